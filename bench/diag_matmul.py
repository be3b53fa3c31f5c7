"""Benchmark ``dd.diag_matmul`` against XLA's dense dot and ``jax.experimental.sparse`` BCOO.

For every shape ``in->out``, sparsity and block size ``b`` (``--blocks``; ``1`` = element diagonals
``values[K, D]``, ``b >= 2`` = block diagonals ``values[K, L_b, b, b]`` with ``K`` from
``dd.num_diagonals(..., block_size=b)``) and batch size (``--batch``, a comma list), times three
phases of a diagonal-sparse layer ``y = x @ W.T`` with ``x[batch, in]``:

* ``fwd``: ``y``;
* ``bwd``: the VJP alone, ``(dx, dvalues)`` from ``dy`` (``(dx, dW)`` for the dense layer);
* ``fwd+bwd``: both in one jitted call (one training step of the layer).

``--phases`` times a subset: ``--phases fwd`` is an inference loop, where no dense backward
(which writes the whole ``dW``) runs between the timed forwards. ``--evict_mb N`` writes an
``N`` MiB buffer before every timed call, so that each call reads its operands from memory, as
the layers of a network larger than the caches do.

Implementations: ``ffi`` (our XLA FFI kernels), ``auto`` (what ``impl="auto"`` picks per product;
not run unless named), ``jax`` (the pure-JAX path), ``dense`` (XLA's ``x @ W.T`` on a dense
``W[out, in]``, differentiated by JAX: the dense layer being replaced) and ``bcoo``
(``jax.experimental.sparse`` with the same ``K * D`` non-zeros). All calls of one case
run interleaved in one process, each time is the median of ``--repeats`` calls, and every time is
reported as a speed-up over ``dense`` measured in the same loop (``dense_ms / ms``); the block
sizes of one shape, sparsity and batch size share that loop and its dense timing. BCOO is the
exception: it runs in its own loop with dense, and is skipped (with the reason printed under the
table and written to the CSV) where one call would exhaust memory or take over a minute. The header
names the CPU kernel family that ran (AVX-512, AVX2 or portable). The table prints one block per
batch size, times in microseconds.

Writes ``bench/results/diag_matmul_<time>.csv`` (one row per case, block size, batch size,
implementation and phase, flushed as it goes) and, where matplotlib is installed, a PNG of the
speed-ups beside it.

``--processes N`` runs all of that in N fresh processes, one after another, and prints per row the
min / median / max over processes of the time and of the speed-up, and max / min of the time: a
kernel whose speed is set once per process (say by memory placement) shows up as a wide spread
that repeats within one process cannot reveal. The CSV then holds that summary, and
``<name>_runs.csv`` beside it every process's rows.

Examples::

    python bench/diag_matmul.py --quick          # a few minutes: 768->3072, ffi vs dense, b = 1, 16
    python bench/diag_matmul.py --quick --sparsities 0.9 --dtype float16   # quick, but only these
    python bench/diag_matmul.py                  # ViT-B shapes x sparsities 0.5/0.8/0.9/0.95
    python bench/diag_matmul.py --shapes 768:3072 --sparsities 0.9 --repeats 15 --impls ffi,dense
    python bench/diag_matmul.py --blocks 1,16,32,64 --shapes 768:3072,768:768,3072:768 \
        --sparsities 0.5,0.9 --impls ffi,dense      # the block-diagonal goal table
    python bench/diag_matmul.py --shapes 768:3072,3072:768 --sparsities 0.9 --blocks 1,16 \
        --impls ffi,jax,dense --batch 1,2,4,8,16 --repeats 101 --phases fwd  # online inference
    python bench/diag_matmul.py --shapes 768:3072 --sparsities 0.9 --blocks 1,16,32 \
        --impls ffi,dense --repeats 15 --processes 10          # spread over 10 fresh processes
"""

from __future__ import annotations

import argparse
import csv
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from bench_cli import (  # bench/, beside this
    check_blocks,
    count,
    divides,
    format_us,
    make_parser,
    out_file,
    parse_fractions,
    parse_shapes,
    parse_sizes,
    results_path,
)
from jax.experimental import sparse
from tqdm import tqdm

import dynadiag_jax as dd
from dynadiag_jax.layout import block_indices, diag_indices, geometry

try:
    from dynadiag_jax import _cpu_ext
except ImportError:
    _cpu_ext = None

VIT_B_SHAPES = ((768, 768), (768, 2304), (768, 3072), (3072, 768))
SPARSITIES = (0.5, 0.8, 0.9, 0.95)
IMPLS = ("ffi", "auto", "jax", "dense", "bcoo")
DEFAULT_IMPLS = ("ffi", "jax", "dense", "bcoo")
PHASES = ("fwd", "bwd", "fwd+bwd")
BLOCKS = (1,)
QUICK = dict(
    shapes=((768, 3072),), sparsities=SPARSITIES, blocks=(1, 16), impls=("ffi", "dense"), repeats=7
)
# BCOO calls take seconds to minutes on CPU and churn gigabytes of memory, which slows whatever
# runs next: they are timed in their own loop, interleaved with dense only, and skipped when one
# call exceeds BCOO_SKIP_SECONDS.
BCOO_SKIP_SECONDS = 60.0
# BCOO's products gather a [nnz, batch] array (several, for gradients): skip cases where one
# would exceed this many elements (2 GiB of float32) rather than exhaust a shared machine.
BCOO_MAX_GATHER = 1 << 29
DENSE = 0  # the block size under which the dense layer is timed (once per shape and sparsity)


class Case(NamedTuple):
    in_features: int
    out_features: int
    sparsity: float
    block: int  # 1: element diagonals, b >= 2: block diagonals
    k: int
    x: jax.Array  # [batch, in]
    dy: jax.Array  # [batch, out]
    values: jax.Array  # [K, D] or [K, L_b, b, b]
    offsets: jax.Array  # [K] int32, distinct


def make_case(in_features, out_features, sparsity, block, batch, dtype, seed) -> Case:
    """Random inputs and ``K = num_diagonals(..., block_size=block)`` distinct random offsets;
    ``x`` and ``dy`` depend on the shape, batch and seed only, so all block sizes see the same
    ones, and the offsets and values not on the batch, so all batch sizes time the same layer."""
    x_rng, w_rng = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(2))
    x = jnp.asarray(x_rng.standard_normal((batch, in_features)), dtype)
    dy = jnp.asarray(x_rng.standard_normal((batch, out_features)), dtype)
    geo = geometry(in_features, out_features, block)
    k = dd.num_diagonals(in_features, out_features, sparsity, block_size=block)
    offsets = jnp.asarray(w_rng.choice(geo.num_candidates, size=k, replace=False), jnp.int32)
    fan_in = k * block * block if block > 1 else k
    values = jnp.asarray(w_rng.standard_normal((k, *geo.values_shape)) / np.sqrt(fan_in), dtype)
    return Case(in_features, out_features, sparsity, block, k, x, dy, values, offsets)


def _phases(layer: Callable, x, param, dy, phases=PHASES) -> dict[str, tuple[Callable, tuple]]:
    """Jitted ``phases`` (of fwd / bwd / fwd+bwd) of ``layer(x, param)`` with their arguments."""

    def fwd(x, param):
        return layer(x, param)

    def bwd(x, param, dy):
        return jax.vjp(layer, x, param)[1](dy)

    def fwd_bwd(x, param, dy):
        y, vjp = jax.vjp(layer, x, param)
        return y, vjp(dy)

    every = {
        "fwd": (jax.jit(fwd), (x, param)),
        "bwd": (jax.jit(bwd), (x, param, dy)),
        "fwd+bwd": (jax.jit(fwd_bwd), (x, param, dy)),
    }
    return {phase: every[phase] for phase in phases}


def build(impl: str, case: Case, phases=PHASES) -> dict[str, tuple[Callable, tuple]]:
    """The timed functions (one per phase) of one implementation."""
    out_f, in_f = case.out_features, case.in_features
    if impl in ("ffi", "auto", "jax"):

        def layer(x, values):
            return dd.diag_matmul(x, values, case.offsets, out_features=out_f, impl=impl)

        return _phases(layer, case.x, case.values, case.dy, phases)
    w = dd.diag_to_dense(case.values, case.offsets, in_features=in_f, out_features=out_f)
    if impl == "dense":
        return _phases(lambda x, w: x @ w.T, case.x, w, case.dy, phases)
    if impl == "bcoo":
        indices = jnp.stack([a.reshape(-1) for a in _entry_coordinates(case)], axis=1)

        def layer(x, data):
            w_sp = sparse.BCOO(
                (data, indices), shape=(out_f, in_f), indices_sorted=False, unique_indices=True
            )
            return sparse.bcoo_dot_general(w_sp, x, dimension_numbers=(([1], [1]), ([], []))).T

        return _phases(layer, case.x, case.values.reshape(-1), case.dy, phases)
    raise ValueError(f"unknown implementation {impl!r}; choose from {IMPLS}")


def _entry_coordinates(case: Case):
    """``(rows, cols)`` of every entry of ``values`` in ``W``, in the order of ``values``."""
    in_f, out_f, b = case.in_features, case.out_features, case.block
    if b == 1:
        return diag_indices(case.offsets, in_f, out_f)
    block_rows, block_cols = block_indices(case.offsets, in_f, out_f, b)
    i = jnp.arange(b, dtype=jnp.int32)
    rows = block_rows[:, :, None, None] * b + i[:, None]
    cols = block_cols[:, :, None, None] * b + i[None, :]
    return jnp.broadcast_to(rows, case.values.shape), jnp.broadcast_to(cols, case.values.shape)


def time_call(f, args) -> float:
    """Seconds of one call of ``f(*args)``, results ready."""
    start = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - start


def time_interleaved(
    fns: dict, repeats: int, progress, evict: np.ndarray | None = None
) -> dict[tuple[str, str], float]:
    """Median seconds per (impl, phase); all calls interleaved, after one warm-up call each.

    ``evict``: a buffer larger than the caches, written through before every timed call, so that
    each call reads its operands from memory (a network whose weights do not fit the caches)."""
    for f, args in fns.values():
        time_call(f, args)
    times = {key: [] for key in fns}
    for _ in range(repeats):
        for key, (f, args) in fns.items():
            if evict is not None:
                evict += 1
            times[key].append(time_call(f, args))
            progress.update(1)
    return {key: statistics.median(t) for key, t in times.items()}


def time_case(fns: dict, repeats: int, progress, evict=None) -> tuple[dict, str | None]:
    """``({(impl, b, phase): (median s, dense median s of the same loop)}, why BCOO was skipped)``.

    ``fns`` has dense once per phase, under block size ``DENSE``."""
    main = {key: fp for key, fp in fns.items() if key[0] != "bcoo"}
    med = time_interleaved(main, repeats, progress, evict)
    out = {key: (t, med[("dense", DENSE, key[2])]) for key, t in med.items()}
    bcoo = {key: fp for key, fp in fns.items() if key[0] == "bcoo"}
    if not bcoo:
        return out, None
    skipped = None
    try:
        first = max(time_call(f, args) for f, args in bcoo.values())  # includes compilation
        if first > BCOO_SKIP_SECONDS:
            skipped = f"one call took {first:.0f} s (> {BCOO_SKIP_SECONDS:.0f} s)"
    except jax.errors.JaxRuntimeError as err:  # out of memory
        skipped = str(err).splitlines()[0][:120]
    dense = {key: fp for key, fp in main.items() if key[0] == "dense"}
    pair = {**bcoo, **dense}
    if skipped:
        progress.total -= len(bcoo) * repeats
        progress.refresh()
        return out, skipped
    progress.total += len(dense) * repeats  # dense runs again beside bcoo
    progress.refresh()
    med = time_interleaved(pair, repeats, progress, evict)
    out.update({key: (med[key], med[("dense", DENSE, key[2])]) for key in bcoo})
    return out, None


def _names(text: str) -> tuple[str, ...]:
    names = tuple(text.split(","))
    for name in names:
        if name not in IMPLS:
            raise argparse.ArgumentTypeError(
                f"unknown implementation {name!r}; choose from {IMPLS}"
            )
    return names


def _phase_names(text: str) -> tuple[str, ...]:
    """``"fwd,bwd"`` -> the phases in their fixed order; an unknown one is an error."""
    names = set(text.split(","))
    if not names <= set(PHASES):
        raise argparse.ArgumentTypeError(f"phases must be a subset of {PHASES}; got {text!r}")
    return tuple(p for p in PHASES if p in names)


def parse_args(argv):
    parser = make_parser(__doc__)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="defaults for a few minutes: 768:3072, ffi and dense only, b = 1 and 16, 7 repeats "
        "(options given on the command line, e.g. --sparsities, still apply)",
    )
    parser.add_argument(
        "--shapes",
        type=parse_shapes,
        default=VIT_B_SHAPES,
        help="IN:OUT pairs, comma separated (default: ViT-B MLP/attention shapes)",
    )
    parser.add_argument(
        "--sparsities",
        type=parse_fractions(),
        default=SPARSITIES,
        help="sparsities in (0, 1), comma separated (default 0.5,0.8,0.9,0.95)",
    )
    parser.add_argument(
        "--blocks",
        type=parse_sizes("block sizes", "1,16,32"),
        default=BLOCKS,
        help="block sizes, comma separated: 1 = element diagonals, b >= 2 = block diagonals "
        "(skipped where b does not divide the shape)",
    )
    parser.add_argument(
        "--impls",
        type=_names,
        default=DEFAULT_IMPLS,
        help=f"comma separated subset of {','.join(IMPLS)} (dense always runs)",
    )
    parser.add_argument(
        "--batch",
        type=parse_sizes("batch sizes", "1,2,4,8,16"),
        default=(2048,),
        help="batch sizes, comma separated: one timing loop and table block each (default 2048)",
    )
    parser.add_argument(
        "--phases",
        type=_phase_names,
        default=PHASES,
        help=f"comma separated subset of {','.join(PHASES)} (fwd alone: an inference loop, in "
        "which no dense backward runs between the timed calls)",
    )
    parser.add_argument(
        "--evict_mb",
        type=int,
        default=0,
        help="write a buffer of this many MiB before every timed call, so each call reads its "
        "operands from memory, not the caches (0: off; use more than the last-level cache)",
    )
    parser.add_argument("--repeats", type=int, default=7, help="timed calls per function (median)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--processes",
        type=count("the number of processes"),
        default=None,
        help="run the benchmark in this many fresh processes and report min / median / max of "
        "every row over them",
    )
    parser.add_argument(
        "--out",
        type=out_file,
        default=None,
        help="CSV path (default bench/results/diag_matmul_<time>.csv)",
    )
    args = parser.parse_args(argv)
    if args.quick:  # the quick case's values replace the defaults, not what was typed
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    if "dense" not in args.impls:
        args.impls = ("dense", *args.impls)
    if "ffi" in args.impls and "ffi" not in dd.available_impls():
        print("note: the C++ extension is not built; skipping impl=ffi", file=sys.stderr)
        args.impls = tuple(i for i in args.impls if i != "ffi")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if args.evict_mb < 0:
        parser.error("--evict_mb must be >= 0")
    check_blocks(parser, args.shapes, args.blocks)
    return args


def plot(rows: list[dict], path: pathlib.Path) -> bool:
    """Speed-up over dense against sparsity, one panel per shape; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = sorted({(r["in"], r["out"]) for r in rows}, key=lambda s: (s[0], s[1]))
    several_batches = len({r["batch"] for r in rows}) > 1
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 4), squeeze=False)
    styles = {"fwd": "-", "bwd": ":", "fwd+bwd": "--"}
    series = sorted({(r["impl"], r["block"], r["batch"]) for r in rows if r["impl"] != "dense"})
    for ax, (in_f, out_f) in zip(axes[0], shapes):
        for n, (impl, block, batch) in enumerate(series):
            name = impl if block == 1 else f"{impl} b={block}"
            if several_batches:
                name += f" batch {batch}"
            for phase, style in styles.items():
                pts = sorted(
                    (r["sparsity"], r["speedup_vs_dense"])
                    for r in rows
                    if (r["in"], r["out"], r["impl"], r["block"], r["batch"], r["phase"])
                    == (in_f, out_f, impl, block, batch, phase)
                )
                if pts:
                    ax.plot(*zip(*pts), style, color=f"C{n}", marker="o", label=f"{name} {phase}")
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
    return True


def kernel_family() -> str:
    """Which CPU kernel family the FFI handlers run on this machine."""
    return _cpu_ext.kernel_isa() if _cpu_ext is not None else "not built"


FIELDS = [
    "in",
    "out",
    "sparsity",
    "block",
    "k",
    "density",
    "batch",
    "dtype",
    "impl",
    "phase",
    "ms",
    "speedup_vs_dense",
    "repeats",
    "note",
]
# What identifies a row across processes.
ROW_KEY = ("in", "out", "sparsity", "block", "batch", "impl", "phase")
STATS = (
    "ms_min",
    "ms_median",
    "ms_max",
    "max_over_min",
    "speedup_min",
    "speedup_median",
    "speedup_max",
)
SUMMARY_FIELDS = [*FIELDS[:10], "processes", "repeats", *STATS, "note"]


def _round(x: float) -> float:
    """Four significant digits: whole microseconds lose all precision at batch 1."""
    return float(f"{x:.4g}")


def _join(values) -> str:
    return ",".join(map(str, values))


def main(argv=None) -> None:
    args = parse_args(argv)
    csv_path = args.out or results_path("diag_matmul")
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, "
        f"{jax.device_count()} device(s), CPU kernels {kernel_family()}, "
        f"batch {_join(args.batch)}, {args.dtype}, median of {args.repeats}"
    )
    if args.processes:
        run_processes(args, csv_path)
    else:
        run(args, csv_path)


def run(args, csv_path: pathlib.Path) -> None:
    """Time every case in this process; print the table, write the CSV and the plot."""
    dtype = jnp.dtype(args.dtype)
    cases = [(s, sp) for s in args.shapes for sp in args.sparsities]
    blocks_of = {s: [b for b in args.blocks if divides(b, s)] for s in args.shapes}
    others = [i for i in args.impls if i != "dense"]
    phases = args.phases
    calls = sum(1 + len(others) * len(blocks_of[s]) for s, _ in cases) * len(phases)
    total = calls * args.repeats * len(args.batch)
    rows, skips = [], []
    evict = np.zeros(args.evict_mb << 18, np.float32) if args.evict_mb else None
    for shape in args.shapes:
        if left := sorted(set(args.blocks) - set(blocks_of[shape])):
            skips.append(
                f"block sizes {left} skipped at {shape[0]}->{shape[1]}: they do not divide it"
            )
    with open(csv_path, "w", newline="") as f, tqdm(total=total, unit="call") as progress:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for batch in args.batch:
            for (in_f, out_f), sparsity in cases:
                progress.set_description(f"{in_f}->{out_f} s={sparsity} batch {batch}")
                by_block = {
                    b: make_case(in_f, out_f, sparsity, b, batch, dtype, args.seed)
                    for b in blocks_of[(in_f, out_f)]
                }
                if not by_block:
                    continue
                first = next(iter(by_block.values()))
                fns = {
                    ("dense", DENSE, phase): fp
                    for phase, fp in build("dense", first, phases).items()
                }
                skipped = []
                for b, case in by_block.items():
                    gather = case.values.size * batch
                    for impl in others:
                        if impl == "bcoo" and gather > BCOO_MAX_GATHER:
                            skipped.append(
                                (b, f"its [nnz, batch] gather holds {gather:.2g} elements (> 2^29)")
                            )
                            progress.total -= len(phases) * args.repeats
                            continue
                        fns.update(
                            {(impl, b, ph): fp for ph, fp in build(impl, case, phases).items()}
                        )
                progress.refresh()
                med, slow = time_case(fns, args.repeats, progress, evict)
                if slow:
                    done = {b for b, _ in skipped}
                    skipped += [(b, slow) for b in by_block if b not in done and "bcoo" in others]
                for b, why in skipped:
                    skips.append(
                        f"bcoo skipped at {in_f}->{out_f} s={sparsity} b={b} batch {batch}: {why}"
                    )
                    row = dict.fromkeys(FIELDS, "")
                    row.update({"in": in_f, "out": out_f, "sparsity": sparsity, "block": b})
                    row.update(k=by_block[b].k, batch=batch, dtype=args.dtype, impl="bcoo")
                    row.update(density=round(by_block[b].values.size / (in_f * out_f), 4))
                    row.update(note=why)
                    writer.writerow(row)
                for b, case in by_block.items():
                    for impl in ("dense", *others):
                        for phase in phases:
                            key = ("dense", DENSE, phase) if impl == "dense" else (impl, b, phase)
                            if key not in med:
                                continue
                            seconds, dense = med[key]
                            row = dict(zip(FIELDS, (in_f, out_f, sparsity, b, case.k)))
                            row.update(density=round(case.values.size / (in_f * out_f), 4))
                            row.update(batch=batch, dtype=args.dtype, impl=impl, phase=phase)
                            row.update(ms=_round(seconds * 1e3))
                            row.update(speedup_vs_dense=round(dense / seconds, 3))
                            row.update(repeats=args.repeats, note="")
                            rows.append(row)
                            writer.writerow(row)
                f.flush()
    print_table(rows, args.impls)
    for line in skips:
        print(line)
    png_path = csv_path.with_suffix(".png")
    if plot(rows, png_path):
        print(f"wrote {csv_path} and {png_path}")
    else:
        print(f"wrote {csv_path} (no plot: matplotlib is not installed)")


def print_table(rows: list[dict], impls) -> None:
    """Per batch size, one line per case and block size: microseconds and speed-up over dense of
    every implementation.

    ``density`` is the share of ``W`` the K diagonals hold (block diagonals round K up to whole
    diagonals, so it can exceed ``1 - sparsity``)."""
    others = [i for i in impls if i != "dense"]
    head = f"{'shape':>10} {'sparsity':>8} {'b':>3} {'K':>5} {'density':>7} {'phase':>7}"
    head += f" {'dense us':>9}"
    head += "".join(f" {i + ' us':>10} {'x dense':>8}" for i in others)
    index = {tuple(r[k] for k in ROW_KEY): r for r in rows}
    for batch in dict.fromkeys(r["batch"] for r in rows):
        print(f"\nbatch {batch}")
        print(head)
        print("-" * len(head))
        for r in rows:
            if r["impl"] != "dense" or r["batch"] != batch:
                continue
            key = (r["in"], r["out"], r["sparsity"], r["block"], batch)
            line = (
                f"{r['in']}->{r['out']:<5} {r['sparsity']:>8} {r['block']:>3} {r['k']:>5} "
                f"{r['density']:>7.1%} {r['phase']:>7} {format_us(r['ms']):>9}"
            )
            for impl in others:
                o = index.get((*key, impl, r["phase"]))
                line += (
                    f" {format_us(o['ms']):>10} {o['speedup_vs_dense']:>7.2f}x"
                    if o
                    else f" {'skipped':>10} {'':>8}"
                )
            print(line)


def _child_argv(args) -> list[str]:
    """The options of this run less ``--processes`` and ``--out``.

    Rebuilt from ``args`` rather than edited from the command line, which may abbreviate options
    or come with ``--quick`` (whose values ``args`` already holds)."""
    return [
        *("--shapes", ",".join(f"{i}:{o}" for i, o in args.shapes)),
        *("--sparsities", _join(args.sparsities)),
        *("--blocks", _join(args.blocks)),
        *("--impls", _join(args.impls)),
        *("--batch", _join(args.batch)),
        *("--phases", _join(args.phases)),
        *("--evict_mb", str(args.evict_mb)),
        *("--repeats", str(args.repeats)),
        *("--dtype", args.dtype),
        *("--seed", str(args.seed)),
    ]


def run_processes(args, csv_path: pathlib.Path) -> None:
    """Run the benchmark in ``args.processes`` fresh processes, one at a time; print and write
    min / median / max over them of every row, and every process's rows beside."""
    script = pathlib.Path(__file__).resolve()
    env = dict(os.environ)
    # the children import the dynadiag_jax this process runs (a source tree's, say), not another
    root = str(pathlib.Path(dd.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    print(f"{args.processes} fresh processes of: {script.name} {' '.join(_child_argv(args))}")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in tqdm(range(args.processes), unit="process"):
            out = pathlib.Path(tmp) / f"{n}.csv"
            cmd = [sys.executable, str(script), *_child_argv(args), "--out", str(out)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            if proc.returncode:
                raise SystemExit(
                    f"process {n + 1} of {args.processes} failed ({proc.returncode}):\n"
                    f"{proc.stderr[-4000:]}"
                )
            with open(out, newline="") as f:
                runs.append(list(csv.DictReader(f)))
    runs_path = csv_path.with_name(f"{csv_path.stem}_runs.csv")
    with open(runs_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["process", *FIELDS])
        writer.writeheader()
        writer.writerows({"process": n, **r} for n, rows in enumerate(runs) for r in rows)
    summary = summarise(runs)
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=SUMMARY_FIELDS)
        writer.writeheader()
        writer.writerows(summary)
    print_summary(summary, args.processes)
    print(f"wrote {csv_path} and {runs_path}")


def summarise(runs: list[list[dict]]) -> list[dict]:
    """One row per ``ROW_KEY`` (in the order the processes wrote them): min / median / max over
    the processes that timed it of the milliseconds and of the speed-up, and max / min of the
    milliseconds; ``processes`` counts them, ``note`` says why the others skipped it."""
    groups: dict[tuple, list[dict]] = {}
    for rows in runs:
        for r in rows:
            groups.setdefault(tuple(r[k] for k in ROW_KEY), []).append(r)
    summary = []
    for rs in groups.values():
        row = {k: rs[0][k] for k in ("in", "out", "sparsity", "block", "k", "density", "batch")}
        row.update(dtype=rs[0]["dtype"], impl=rs[0]["impl"], phase=rs[0]["phase"])
        timed = [r for r in rs if r["ms"]]
        row.update(processes=len(timed), repeats=rs[0]["repeats"])
        stats = dict.fromkeys(STATS, "")
        if timed:
            ms = [float(r["ms"]) for r in timed]
            up = [float(r["speedup_vs_dense"]) for r in timed]
            stats.update(ms_min=min(ms), ms_median=_round(statistics.median(ms)), ms_max=max(ms))
            stats.update(max_over_min=round(max(ms) / min(ms), 3))
            stats.update(speedup_min=min(up), speedup_median=round(statistics.median(up), 3))
            stats.update(speedup_max=max(up))
        row.update(stats)
        notes = sorted({r["note"] for r in rs if r["note"]})
        row["note"] = (
            f"skipped in {len(rs) - len(timed)} process(es): {'; '.join(notes)}" if notes else ""
        )
        summary.append(row)
    return summary


def print_summary(summary: list[dict], processes: int) -> None:
    """One line per row of the summary: microseconds and speed-up over dense, min / median / max
    over the processes, and max / min of the time (near 1 unless the speed varies by process)."""
    head = (
        f"{'shape':>10} {'sparsity':>8} {'b':>3} {'batch':>5} {'impl':>5} {'phase':>7} "
        f"{'us min':>8} {'median':>8} {'max':>8} {'max/min':>7} "
        f"{'x dense min':>11} {'median':>7} {'max':>7}"
    )
    print(f"\nover {processes} processes")
    print(head)
    print("-" * len(head))
    for r in summary:
        line = (
            f"{r['in']}->{r['out']:<5} {r['sparsity']:>8} {r['block']:>3} {r['batch']:>5} "
            f"{r['impl']:>5} {r['phase']:>7}"
        )
        if r["processes"]:
            line += (
                "".join(f" {format_us(r[k]):>8}" for k in ("ms_min", "ms_median", "ms_max"))
                + f" {r['max_over_min']:>7.2f} {r['speedup_min']:>10.2f}x"
                f" {r['speedup_median']:>6.2f}x {r['speedup_max']:>6.2f}x"
            )
        if r["note"]:
            line += f"  {r['note']}"
        print(line)


if __name__ == "__main__":
    main()
