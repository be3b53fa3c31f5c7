"""Rows and columns that frozen diagonal layers leave empty, from training runs' checkpoints.

An element diagonal of a tall ``W[out, in]`` reaches ``in`` of the ``out`` rows (of a wide one,
``out`` of the ``in`` columns), so a selection can leave output features constant (bias only) or
inputs unread; static random diagonals almost never do (``dd.layout.coverage``). For every run
directory given (``train/results.py`` or ``train/*.py`` workdirs: ``checkpoints/<step>/state``), the
latest checkpoint's frozen layers are listed with their empty output rows and input columns.

Usage:
  python bench/coverage.py RUN_DIR [RUN_DIR ...] [--out bench/results/coverage_<time>.csv]
  python bench/coverage.py runs/results/vit/dynadiag_s90_seed0_* runs/results/vit/static_*
"""

from __future__ import annotations

import argparse
import csv
import sys
import warnings
from pathlib import Path

import numpy as np
from bench_cli import add_options, results_path  # bench/, beside this

FIELDS = ("run", "layer", "in", "out", "k", "block_size", "empty_rows", "empty_cols")


def _latest_state(run_dir: Path) -> Path:
    steps = sorted(
        (p for p in (run_dir / "checkpoints").glob("*") if p.name.isdigit()),
        key=lambda p: int(p.name),
    )
    if not steps:
        raise SystemExit(f"{run_dir}: no checkpoints/<step> directory")
    return steps[-1] / "state"


def _layers(tree, path=()):
    """``(path, node)`` of every dict holding frozen ``offsets`` and ``in_features``."""
    if isinstance(tree, dict):
        if "offsets" in tree and "in_features" in tree:
            yield path, tree
        for key, sub in tree.items():
            yield from _layers(sub, path + (key,))


def _params_at(params, path):
    for key in path:
        params = params.get(key, {}) if isinstance(params, dict) else {}
    return params


def layer_rows(run_dir: Path) -> list[dict]:
    """One row of :data:`FIELDS` per frozen layer of the run's latest checkpoint."""
    import orbax.checkpoint as ocp  # noqa: PLC0415 - after the arguments are read

    from dynadiag_jax.layout import coverage  # noqa: PLC0415

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Orbax: sharding read from the checkpoint's own file
        state = ocp.PyTreeCheckpointer().restore(_latest_state(run_dir))
    diagonals = state.get("collections", {}).get("diagonals", {})
    rows = []
    for path, node in _layers(diagonals):
        params = _params_at(state.get("params", {}), path)
        values, bias = params.get("values"), params.get("bias")
        if values is None or bias is None:
            print(f"{run_dir.name}: {'/'.join(path)} skipped (no values or bias)", file=sys.stderr)
            continue
        n_in, n_out = int(np.asarray(node["in_features"])), int(np.shape(bias)[0])
        b = 1 if np.ndim(values) == 2 else int(np.shape(values)[-1])
        offsets = np.asarray(node["offsets"])
        r, c = coverage(offsets, n_in, n_out, block_size=b)
        rows.append(
            {
                "run": run_dir.name,
                "layer": "/".join(path),
                "in": n_in,
                "out": n_out,
                "k": len(offsets),
                "block_size": b,
                "empty_rows": int((r == 0).sum()),
                "empty_cols": int((c == 0).sum()),
            }
        )
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # absolute: Orbax refuses a relative checkpoint path
    parser.add_argument(
        "runs",
        nargs="+",
        type=lambda p: Path(p).resolve(),
        help="run directories (with checkpoints/)",
    )
    add_options(parser, "coverage")
    args = parser.parse_args(argv)
    args.out = args.out or results_path("coverage")
    all_rows = []
    header = f"{'run':40s} {'layer':32s} {'shape':>11s} {'K':>4s} {'empty rows':>11s} {'cols':>5s}"
    print(header)
    print("-" * len(header))
    for run in args.runs:
        rows = layer_rows(run)
        for r in rows:
            shape = f"{r['in']}->{r['out']}"
            print(
                f"{r['run'][:40]:40s} {r['layer'][-32:]:32s} {shape:>11s} {r['k']:4d} "
                f"{r['empty_rows']:5d}/{r['out']:<5d} {r['empty_cols']:5d}"
            )
        if rows:
            empty = sum(r["empty_rows"] for r in rows) / sum(r["out"] for r in rows)
            print(f"{run.name[:40]:40s} {'all layers: empty output rows':32s} {empty:17.1%}")
        all_rows += rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(all_rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
