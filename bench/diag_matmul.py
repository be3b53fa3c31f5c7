"""Benchmark ``dd.diag_matmul`` against XLA's dense dot and ``jax.experimental.sparse`` BCOO.

For every shape ``in->out`` and sparsity, times three phases of a diagonal-sparse layer
``y = x @ W.T`` with ``x[batch, in]``:

* ``fwd``: ``y``;
* ``bwd``: the VJP alone, ``(dx, dvalues)`` from ``dy`` (``(dx, dW)`` for the dense layer);
* ``fwd+bwd``: both in one jitted call (one training step of the layer).

Implementations: ``ffi`` (our XLA FFI kernels), ``jax`` (the pure-JAX path), ``dense`` (XLA's
``x @ W.T`` on a dense ``W[out, in]``, differentiated by JAX: the dense layer being replaced) and
``bcoo`` (``jax.experimental.sparse`` with the same ``K * D`` non-zeros). All calls of one case
run interleaved in one process, each time is the median of ``--repeats`` calls, and every time is
reported as a speed-up over ``dense`` measured in the same loop (``dense_ms / ms``). BCOO is the
exception: it runs in its own loop with dense, and is skipped (with the reason printed under the
table and written to the CSV) where one call would exhaust memory or take over a minute.

Writes ``bench/results/diag_matmul_<time>.csv`` (one row per case, implementation and phase, flushed
as it goes) and a PNG of the speed-ups beside it.

Examples::

    python bench/diag_matmul.py --quick          # about a minute: 768->3072, ffi vs dense
    python bench/diag_matmul.py                  # ViT-B shapes x sparsities 0.5/0.8/0.9/0.95
    python bench/diag_matmul.py --shapes 768:3072 --sparsities 0.9 --repeats 15 --impls ffi,dense
"""

from __future__ import annotations

import argparse
import csv
import datetime
import pathlib
import statistics
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import sparse
from tqdm import tqdm

import dynadiag_jax as dd
from dynadiag_jax.layout import diag_indices

VIT_B_SHAPES = ((768, 768), (768, 2304), (768, 3072), (3072, 768))
SPARSITIES = (0.5, 0.8, 0.9, 0.95)
IMPLS = ("ffi", "jax", "dense", "bcoo")
PHASES = ("fwd", "bwd", "fwd+bwd")
QUICK = dict(shapes=((768, 3072),), sparsities=SPARSITIES, impls=("ffi", "dense"), repeats=7)
# BCOO calls take seconds to minutes on CPU and churn gigabytes of memory, which slows whatever
# runs next: they are timed in their own loop, interleaved with dense only, and skipped when one
# call exceeds BCOO_SKIP_SECONDS.
BCOO_SKIP_SECONDS = 60.0
# BCOO's products gather a [nnz, batch] array (several, for gradients): skip cases where one
# would exceed this many elements (2 GiB of float32) rather than exhaust a shared machine.
BCOO_MAX_GATHER = 1 << 29
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


class Case(NamedTuple):
    in_features: int
    out_features: int
    sparsity: float
    k: int
    x: jax.Array  # [batch, in]
    dy: jax.Array  # [batch, out]
    values: jax.Array  # [K, D]
    offsets: jax.Array  # [K] int32, distinct


def make_case(in_features, out_features, sparsity, batch, dtype, seed) -> Case:
    """Random inputs and ``K = num_diagonals(...)`` distinct random offsets."""
    rng = np.random.default_rng(seed)
    k = dd.num_diagonals(in_features, out_features, sparsity)
    p, d = max(in_features, out_features), min(in_features, out_features)
    offsets = jnp.asarray(rng.choice(p, size=k, replace=False), jnp.int32)
    values = jnp.asarray(rng.standard_normal((k, d)) / np.sqrt(k), dtype)
    x = jnp.asarray(rng.standard_normal((batch, in_features)), dtype)
    dy = jnp.asarray(rng.standard_normal((batch, out_features)), dtype)
    return Case(in_features, out_features, sparsity, k, x, dy, values, offsets)


def _phases(layer: Callable, x, param, dy) -> dict[str, tuple[Callable, tuple]]:
    """Jitted fwd / bwd / fwd+bwd of ``layer(x, param)`` with their arguments."""

    def fwd(x, param):
        return layer(x, param)

    def bwd(x, param, dy):
        return jax.vjp(layer, x, param)[1](dy)

    def fwd_bwd(x, param, dy):
        y, vjp = jax.vjp(layer, x, param)
        return y, vjp(dy)

    return {
        "fwd": (jax.jit(fwd), (x, param)),
        "bwd": (jax.jit(bwd), (x, param, dy)),
        "fwd+bwd": (jax.jit(fwd_bwd), (x, param, dy)),
    }


def build(impl: str, case: Case) -> dict[str, tuple[Callable, tuple]]:
    """The three timed functions of one implementation."""
    out_f, in_f = case.out_features, case.in_features
    if impl in ("ffi", "jax"):

        def layer(x, values):
            return dd.diag_matmul(x, values, case.offsets, out_features=out_f, impl=impl)

        return _phases(layer, case.x, case.values, case.dy)
    w = dd.diag_to_dense(case.values, case.offsets, in_features=in_f, out_features=out_f)
    if impl == "dense":
        return _phases(lambda x, w: x @ w.T, case.x, w, case.dy)
    if impl == "bcoo":
        rows, cols = diag_indices(case.offsets, in_f, out_f)
        indices = jnp.stack([rows.reshape(-1), cols.reshape(-1)], axis=1)

        def layer(x, data):
            w_sp = sparse.BCOO(
                (data, indices), shape=(out_f, in_f), indices_sorted=False, unique_indices=True
            )
            return sparse.bcoo_dot_general(w_sp, x, dimension_numbers=(([1], [1]), ([], []))).T

        return _phases(layer, case.x, case.values.reshape(-1), case.dy)
    raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")


def _call(f, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - start


def time_interleaved(fns: dict, repeats: int, progress) -> dict[tuple[str, str], float]:
    """Median seconds per (impl, phase); all calls interleaved, after one warm-up call each."""
    for f, args in fns.values():
        _call(f, args)
    times = {key: [] for key in fns}
    for _ in range(repeats):
        for key, (f, args) in fns.items():
            times[key].append(_call(f, args))
            progress.update(1)
    return {key: statistics.median(t) for key, t in times.items()}


def time_case(fns: dict, repeats: int, progress) -> tuple[dict, str | None]:
    """``({(impl, phase): (median s, dense median s of the same loop)}, why BCOO was skipped)``."""
    main = {key: fp for key, fp in fns.items() if key[0] != "bcoo"}
    med = time_interleaved(main, repeats, progress)
    out = {key: (t, med[("dense", key[1])]) for key, t in med.items()}
    bcoo = {key: fp for key, fp in fns.items() if key[0] == "bcoo"}
    if not bcoo:
        return out, None
    skipped = None
    try:
        first = max(_call(f, args) for f, args in bcoo.values())  # includes compilation
        if first > BCOO_SKIP_SECONDS:
            skipped = f"one call took {first:.0f} s (> {BCOO_SKIP_SECONDS:.0f} s)"
    except jax.errors.JaxRuntimeError as err:  # out of memory
        skipped = str(err).splitlines()[0][:120]
    pair = {**bcoo, **{("dense", phase): main[("dense", phase)] for _, phase in bcoo}}
    if skipped:
        progress.total -= len(bcoo) * repeats
        progress.refresh()
        return out, skipped
    progress.total += len(pair) * repeats - len(bcoo) * repeats  # dense runs again beside bcoo
    progress.refresh()
    med = time_interleaved(pair, repeats, progress)
    out.update({key: (med[key], med[("dense", key[1])]) for key in bcoo})
    return out, None


def _pairs(text: str) -> tuple[tuple[int, int], ...]:
    try:
        return tuple(tuple(int(n) for n in item.split(":")) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"shapes must look like 768:3072,3072:768; got {text!r}"
        ) from None


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(s) for s in text.split(","))


def _names(text: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    for name in names:
        if name not in IMPLS:
            raise argparse.ArgumentTypeError(
                f"unknown implementation {name!r}; choose from {IMPLS}"
            )
    return names


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="768:3072, ffi and dense only, 7 repeats (about a minute)",
    )
    parser.add_argument(
        "--shapes",
        type=_pairs,
        default=VIT_B_SHAPES,
        help="IN:OUT pairs, comma separated (default: ViT-B MLP/attention shapes)",
    )
    parser.add_argument("--sparsities", type=_floats, default=SPARSITIES)
    parser.add_argument(
        "--impls",
        type=_names,
        default=IMPLS,
        help=f"comma separated subset of {','.join(IMPLS)} (dense always runs)",
    )
    parser.add_argument("--batch", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per function (median)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--out",
        type=pathlib.Path,
        default=None,
        help="CSV path (default bench/results/diag_matmul_<time>.csv)",
    )
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    if "dense" not in args.impls:
        args.impls = ("dense", *args.impls)
    if "ffi" in args.impls and "ffi" not in dd.available_impls():
        print("note: the C++ extension is not built; skipping impl=ffi", file=sys.stderr)
        args.impls = tuple(i for i in args.impls if i != "ffi")
    if args.repeats < 1 or args.batch < 1:
        parser.error("--repeats and --batch must be >= 1")
    return args


def plot(rows: list[dict], path: pathlib.Path) -> None:
    """Speed-up over dense against sparsity, one panel per shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["in"], r["out"]) for r in rows}, key=lambda s: (s[0], s[1]))
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 4), squeeze=False)
    styles = {"fwd": "-", "bwd": ":", "fwd+bwd": "--"}
    colors = {"ffi": "C0", "jax": "C1", "bcoo": "C2"}
    for ax, (in_f, out_f) in zip(axes[0], shapes):
        for impl, color in colors.items():
            for phase, style in styles.items():
                pts = sorted(
                    (r["sparsity"], r["speedup_vs_dense"])
                    for r in rows
                    if (r["in"], r["out"]) == (in_f, out_f)
                    and r["impl"] == impl
                    and r["phase"] == phase
                )
                if pts:
                    ax.plot(*zip(*pts), style, color=color, marker="o", label=f"{impl} {phase}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_yscale("log")
        ax.set_title(f"{in_f} -> {out_f}")
        ax.set_xlabel("sparsity")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("speed-up over dense (same run)")
    if axes[0][-1].get_legend_handles_labels()[0]:
        axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> None:
    args = parse_args(argv)
    dtype = jnp.dtype(args.dtype)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    csv_path = args.out or RESULTS / f"diag_matmul_{stamp}.csv"
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    fields = [
        "in",
        "out",
        "sparsity",
        "k",
        "batch",
        "dtype",
        "impl",
        "phase",
        "ms",
        "speedup_vs_dense",
        "repeats",
        "note",
    ]
    cases = [(s, sp) for s in args.shapes for sp in args.sparsities]
    total = len(cases) * len(args.impls) * len(PHASES) * args.repeats
    rows, skips = [], []
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, "
        f"{jax.device_count()} device(s), batch {args.batch}, {args.dtype}, "
        f"median of {args.repeats}"
    )
    with open(csv_path, "w", newline="") as f, tqdm(total=total, unit="call") as progress:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for (in_f, out_f), sparsity in cases:
            progress.set_description(f"{in_f}->{out_f} s={sparsity}")
            case = make_case(in_f, out_f, sparsity, args.batch, dtype, args.seed)
            gather = case.k * min(in_f, out_f) * args.batch
            impls = [i for i in args.impls if i != "bcoo" or gather <= BCOO_MAX_GATHER]
            fns = {(impl, phase): fp for impl in impls for phase, fp in build(impl, case).items()}
            skipped = None
            if len(impls) < len(args.impls):
                skipped = f"its [nnz, batch] gather holds {gather:.2g} elements (> 2^29)"
                progress.total -= len(PHASES) * args.repeats
                progress.refresh()
            med, slow = time_case(fns, args.repeats, progress)
            skipped = skipped or slow
            if skipped:
                skips.append(f"bcoo skipped at {in_f}->{out_f} s={sparsity}: {skipped}")
                row = dict.fromkeys(fields, "")
                row.update({"in": in_f, "out": out_f, "sparsity": sparsity, "k": case.k})
                row.update(batch=args.batch, dtype=args.dtype, impl="bcoo", note=skipped)
                writer.writerow(row)
            for (impl, phase), (seconds, dense) in med.items():
                row = dict(
                    zip(
                        fields,
                        (
                            in_f,
                            out_f,
                            sparsity,
                            case.k,
                            args.batch,
                            args.dtype,
                            impl,
                            phase,
                            round(seconds * 1e3, 3),
                            round(dense / seconds, 3),
                            args.repeats,
                            "",
                        ),
                    )
                )
                rows.append(row)
                writer.writerow(row)
            f.flush()
    print_table(rows, args.impls)
    for line in skips:
        print(line)
    png_path = csv_path.with_suffix(".png")
    plot(rows, png_path)
    print(f"wrote {csv_path} and {png_path}")


def print_table(rows: list[dict], impls) -> None:
    """One line per case: ms and speed-up over dense for every implementation and phase."""
    others = [i for i in impls if i != "dense"]
    head = f"{'shape':>10} {'sparsity':>8} {'K':>5} {'phase':>7} {'dense ms':>9}"
    head += "".join(f" {i + ' ms':>10} {'x dense':>8}" for i in others)
    print(head)
    print("-" * len(head))
    index = {(r["in"], r["out"], r["sparsity"], r["impl"], r["phase"]): r for r in rows}
    for r in rows:
        if r["impl"] != "dense":
            continue
        key = (r["in"], r["out"], r["sparsity"])
        line = (
            f"{r['in']}->{r['out']:<5} {r['sparsity']:>8} {r['k']:>5} {r['phase']:>7} "
            f"{r['ms']:>9.1f}"
        )
        for impl in others:
            o = index.get((*key, impl, r["phase"]))
            line += (
                f" {o['ms']:>10.1f} {o['speedup_vs_dense']:>7.2f}x"
                if o
                else f" {'skipped':>10} {'':>8}"
            )
        print(line)


if __name__ == "__main__":
    main()
