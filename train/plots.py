"""Figures of the learned diagonals, drawn from a run's ``metrics.jsonl`` (matplotlib, headless)."""

from __future__ import annotations

import pathlib
from collections.abc import Mapping

import numpy as np

from dynadiag_jax.layout import block_indices, diag_indices, geometry
from dynadiag_jax.training import read_jsonl


def selection_history(metrics_path) -> tuple[list[int], dict[str, list[np.ndarray]]]:
    """``(steps, {layer: [offsets at each step]})`` from the run's ``"selection"`` records."""
    steps, history = [], {}
    for record in read_jsonl(metrics_path):
        if record.get("kind") != "selection":
            continue
        steps.append(record["step"])
        for layer, offsets in record["offsets"].items():
            history.setdefault(layer, []).append(np.asarray(offsets, np.int64))
    return steps, history


def support_mask(offsets, in_features: int, out_features: int, block_size: int = 1) -> np.ndarray:
    """``[out, in]`` 0/1 image of the entries the diagonals ``offsets`` cover: single entries of
    element diagonals, or whole ``b x b`` blocks of block diagonals (``block_size = b >= 2``)."""
    offsets = np.asarray(offsets, np.int32)
    mask = np.zeros((out_features, in_features), np.uint8)
    if block_size == 1:
        rows, cols = (np.asarray(a) for a in diag_indices(offsets, in_features, out_features))
        mask[rows.ravel(), cols.ravel()] = 1
        return mask
    block_rows, block_cols = (
        np.asarray(a) for a in block_indices(offsets, in_features, out_features, block_size)
    )
    blocks = np.zeros((out_features // block_size, in_features // block_size), np.uint8)
    blocks[block_rows.ravel(), block_cols.ravel()] = 1
    return np.kron(blocks, np.ones((block_size, block_size), np.uint8))


def _column_edges(steps) -> np.ndarray:
    """``[n + 1]`` column boundaries: column ``j`` spans ``steps[j]`` to ``steps[j + 1]`` (the
    selection in force until the next snapshot); the last one as long as the one before."""
    steps = np.asarray(steps, np.float64)
    last = steps[-1] - steps[-2] if len(steps) > 1 else 1.0
    return np.append(steps, steps[-1] + last)


def plot_diagonals(
    metrics_path,
    kept: Mapping[str, np.ndarray],
    shapes: Mapping[str, tuple[int, int]],
    out_path,
    *,
    freeze_step: int | None = None,
    title: str = "",
    block_size: int = 1,
) -> pathlib.Path:
    """Write a PNG with one row per layer: the kept diagonals as a weight-support image, and the
    evolution of the top-K selection (offset x step) during the search phase.

    Args:
      metrics_path: the run's ``metrics.jsonl`` (its ``"selection"`` records).
      kept: ``{layer path: offsets}`` of the final (frozen) model.
      shapes: ``{layer path: (in_features, out_features)}``.
      out_path: the PNG to write (``.png`` added when it has no suffix).
      freeze_step: the step of the freeze (named in the titles, a dashed line on the step axis).
      block_size: the layers' block size (``dynadiag.block_size``); block layers are drawn as
        whole ``b x b`` blocks, their selection over the ``P_b`` block diagonals.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted(kept)
    if not layers:
        raise ValueError("plot_diagonals: kept names no layer")
    missing = [layer for layer in layers if layer not in shapes]
    if missing:
        raise ValueError(
            f"plot_diagonals: no shape for {', '.join(missing)} (shapes: {sorted(shapes)})"
        )
    steps, history = selection_history(metrics_path)
    fig, axes = plt.subplots(
        len(layers),
        2,
        figsize=(12, 4.2 * len(layers)),
        squeeze=False,
        gridspec_kw={"width_ratios": [1, 1.6]},
    )
    for row, layer in zip(axes, layers):
        fan_in, fan_out = shapes[layer]
        offsets = np.sort(np.asarray(kept[layer]))
        p = geometry(fan_in, fan_out, block_size).num_candidates
        row[0].imshow(
            support_mask(offsets, fan_in, fan_out, block_size),
            cmap="Greys",
            interpolation="nearest",
            aspect="auto",
        )
        kind = "diagonals" if block_size == 1 else f"block diagonals (b = {block_size})"
        row[0].set_title(f"{layer}: {len(offsets)} of {p} {kind} kept ({fan_in}->{fan_out})")
        row[0].set_xlabel("input")
        row[0].set_ylabel("output")
        snaps = history.get(layer, [])
        if snaps:
            grid = np.zeros((p, len(snaps)), np.uint8)
            for j, sel in enumerate(snaps):
                grid[sel, j] = 1
            # Columns at their snapshots' steps: the intervals are uneven (the last one ends at
            # the freeze), so an evenly stretched image would drift off the step axis.
            row[1].pcolormesh(_column_edges(steps), np.arange(p + 1) - 0.5, grid, cmap="Blues")
            row[1].set_ylim(p - 0.5, -0.5)  # offset 0 at the top, as in the support image
            if freeze_step is not None:
                row[1].axvline(freeze_step, color="black", ls="--", lw=1)
            churn = [0] + [len(np.setdiff1d(b, a)) for a, b in zip(snaps, snaps[1:])]
            twin = row[1].twinx()
            twin.plot(steps, churn, color="tab:red", lw=1)
            twin.set_ylabel("diagonals swapped in since previous snapshot", color="tab:red")
            frozen = "" if freeze_step is None else f", frozen at step {freeze_step} (dashed)"
            row[1].set_title(f"top-K by alpha during the search phase{frozen}")
        else:
            row[1].set_title("no selection snapshots recorded")
        row[1].set_xlabel("step")
        row[1].set_ylabel("diagonal offset" if block_size == 1 else "block diagonal offset")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_path = pathlib.Path(out_path)
    if not out_path.suffix:  # matplotlib would add it, and the path returned would not exist
        out_path = out_path.with_suffix(".png")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
