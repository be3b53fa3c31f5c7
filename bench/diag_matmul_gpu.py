"""GPU benchmark of ``dd.diag_matmul`` (the CUDA kernels) vs XLA's dense dot and BCOO.

For each layer shape ``in:out``, sparsity, block size ``b`` (1: element diagonals) and offset
layout, times ``y = x @ W.T`` with ``x[batch, in]`` in two phases - ``fwd`` and ``fwd+bwd`` (``y``
and the VJP in one jitted call: one training step of the layer) - for

* ``ffi``: our CUDA kernels (``impl="ffi"``; the script checks the compiled HLO calls them);
* ``auto``: what ``impl="auto"`` picks (the kernels or W built on the device + XLA's dot);
* ``dense``: XLA's dot on a dense ``W[out, in]`` (the layer DynaDiag replaces);
* ``bcoo``: ``jax.experimental.sparse`` BCOO with the same non-zeros.

Offset layouts: ``random`` (distinct random diagonals, as a search phase leaves them) and, for
element diagonals, ``band`` (adjacent diagonals: the tensor-core path for 16-bit inputs). Each row
also records what ``dd.kernel_stats`` reports (touched tiles, fill, the share of output blocks on
tensor cores) and the cost model's predicted time (``gpu_cost``, for the GPU found or H100).
Times are medians of ``--repeats`` interleaved calls, reported as speed-ups over ``dense`` from the
same loop. Writes ``bench/results/diag_matmul_gpu_<time>.csv`` (or ``--out``).

Examples::

    python bench/diag_matmul_gpu.py --quick                       # 768:3072, bf16, ffi vs dense
    python bench/diag_matmul_gpu.py --batch 403456 --shapes 768:3072 --sparsities 0.9 \\
        --block-sizes 1,16,32 --impls ffi,auto                     # ViT-B/16's fc1
    python bench/diag_matmul_gpu.py --allow-cpu --quick --batch 64   # smoke run without a GPU
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from bench_cli import (  # bench/, beside this
    count,
    out_file,
    parse_fractions,
    parse_shapes,
    parse_sizes,
    results_path,
)
from jax.experimental import sparse
from tqdm import tqdm

import dynadiag_jax as dd
from dynadiag_jax import gpu_cost
from dynadiag_jax.layout import block_indices, diag_indices, geometry
from dynadiag_jax.ops import auto

SHAPES = ((768, 768), (768, 3072), (3072, 768))
SPARSITIES = (0.8, 0.9, 0.95)
LAYOUTS = ("random", "band")
BLOCK_SIZES = (1, 16, 32)
IMPLS = ("ffi", "auto", "dense", "bcoo")
# --quick's defaults; an option given on the command line still wins
QUICK = dict(shapes=((768, 3072),), sparsities=(0.9,), impls=("ffi", "dense"), block_sizes=(1, 16))
PHASES = ("fwd", "fwd+bwd")


def make_offsets(layout: str, k: int, p: int, rng) -> np.ndarray:
    """``k`` distinct diagonals: scattered at random, or in bands of 16 adjacent ones (one band of
    ``k`` from a random start where ``p`` has too few 16-aligned bands for them)."""
    if layout == "random":
        return rng.choice(p, size=k, replace=False)
    if -(-k // 16) > p // 16:
        return (rng.integers(p) + np.arange(k)) % p
    starts = rng.choice(p // 16, size=-(-k // 16), replace=False) * 16
    return (starts[:, None] + np.arange(16)).reshape(-1)[:k] % p


def coordinates(offsets, in_f: int, out_f: int, b: int):
    """Dense ``(rows, cols)`` of every stored value, in the order of ``values``."""
    if b == 1:
        return diag_indices(offsets, in_f, out_f)
    block_rows, block_cols = block_indices(offsets, in_f, out_f, b)
    i = jnp.arange(b, dtype=jnp.int32)
    rows = block_rows[:, :, None, None] * b + i[None, None, :, None]
    cols = block_cols[:, :, None, None] * b + i[None, None, None, :]
    shape = (*block_rows.shape, b, b)
    return jnp.broadcast_to(rows, shape), jnp.broadcast_to(cols, shape)


def layer_fns(impl: str, offsets, in_f: int, out_f: int, values):
    """``(layer(x, param), param)`` for one implementation."""
    if impl in ("ffi", "auto"):

        def layer(x, v):
            return dd.diag_matmul(x, v, offsets, out_features=out_f, impl=impl)

        return layer, values
    w = dd.diag_to_dense(values, offsets, in_features=in_f, out_features=out_f)
    if impl == "dense":
        return (lambda x, w: x @ w.T), w
    b = values.shape[-1] if values.ndim == 4 else 1
    rows, cols = coordinates(offsets, in_f, out_f, b)
    indices = jnp.stack([rows.reshape(-1), cols.reshape(-1)], axis=1)

    def bcoo(x, data):
        w_sp = sparse.BCOO((data, indices), shape=(out_f, in_f), unique_indices=True)
        return sparse.bcoo_dot_general(w_sp, x, dimension_numbers=(([1], [1]), ([], []))).T

    return bcoo, values.reshape(-1)


def phase_fns(layer, x, param, dy):
    def fwd_bwd(x, param, dy):
        y, vjp = jax.vjp(layer, x, param)
        return y, vjp(dy)

    return {"fwd": (jax.jit(layer), (x, param)), "fwd+bwd": (jax.jit(fwd_bwd), (x, param, dy))}


def uses_dynadiag_kernels(fn, args) -> bool:
    """True if the compiled program calls the dynadiag custom calls (CUDA targets on a GPU)."""
    return "dynadiag_diag_matmul_v2" in fn.lower(*args).compile().as_text()


def timed(fn, args) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def run_case(fns: dict, repeats: int, warmup: int, progress) -> dict:
    for _ in range(warmup):  # compile and warm up
        for fn, args in fns.values():
            timed(fn, args)
    times = {key: [] for key in fns}
    for _ in range(repeats):
        for key, (fn, args) in fns.items():
            times[key].append(timed(fn, args))
            progress.update(1)
    return {key: statistics.median(t) for key, t in times.items()}


def parse_args(argv):
    def names(choices):
        def parse(text):
            out = tuple(text.split(","))
            bad = [n for n in out if n not in choices]
            if bad:
                raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {choices}")
            return out

        return parse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="defaults 768:3072, 0.9, block sizes 1,16, ffi and dense (options given still count)",
    )
    parser.add_argument(
        "--shapes", type=parse_shapes, default=SHAPES, help="IN:OUT pairs, comma separated"
    )
    parser.add_argument(
        "--sparsities",
        type=parse_fractions(),
        default=SPARSITIES,
        help="in (0, 1), comma separated (default 0.8,0.9,0.95)",
    )
    parser.add_argument(
        "--layouts",
        type=names(LAYOUTS),
        default=LAYOUTS,
        help="offset layouts, comma separated: random (distinct random diagonals), band "
        "(adjacent ones, element diagonals only) (default both)",
    )
    parser.add_argument(
        "--block-sizes",
        type=parse_sizes("block sizes", "1,16,32"),
        default=BLOCK_SIZES,
        help="1 = element diagonals; block sizes run the random layout only",
    )
    parser.add_argument("--impls", type=names(IMPLS), default=IMPLS, help="dense always runs")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument(
        "--batch", type=count("--batch"), default=8192, help="rows of x (tokens x batch)"
    )
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="untimed calls of each function first; --warmup 0 --repeats 1 calls each once "
        "(under a profiler, which replays every launch)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--allow-cpu",
        action="store_true",
        help="run on the CPU backend too (a smoke test; times mean nothing for GPUs)",
    )
    parser.add_argument("--out", type=out_file, default=None)
    args = parser.parse_args(argv)
    if args.quick:  # parsed again with its defaults: what the command line says overrides them
        parser.set_defaults(**QUICK)
        args = parser.parse_args(argv)
    if args.repeats < 1 or args.warmup < 0:
        parser.error("--repeats must be >= 1 and --warmup >= 0")
    if "dense" not in args.impls:
        args.impls = (*args.impls, "dense")
    return args


def _auto_path(rows, in_f, out_f, dtype, k, b, spec) -> str:
    """The cost-model path ``impl="auto"`` takes on a CUDA GPU: "kernel" or "dense"."""
    decision = auto.decide_for_gpu(rows, in_f, out_f, dtype, k, b, spec)
    return "kernel" if decision.impl == "ffi" else "dense"


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.allow_cpu:
        print(
            f"no GPU: the default JAX backend is {jax.default_backend()!r}. Install jax[cuda13] "
            "(or jax[cuda12]) and build dynadiag-jax with nvcc on PATH; --allow-cpu runs anyway.",
            file=sys.stderr,
        )
        return 2
    if on_gpu and not dd.has_cuda_kernels():
        print(
            "dynadiag-jax was built without the CUDA kernels (nvcc was not on PATH at install).",
            file=sys.stderr,
        )
        return 2
    dtype = jnp.dtype(args.dtype)
    out = args.out or results_path("diag_matmul_gpu")
    out.parent.mkdir(parents=True, exist_ok=True)
    cases = [
        (shape, sp, b, lay)
        for shape in args.shapes
        for b in args.block_sizes
        for sp in args.sparsities
        for lay in (args.layouts if b == 1 else ("random",))
        if shape[0] % b == 0 and shape[1] % b == 0
    ]
    kind = jax.devices()[0].device_kind
    spec = gpu_cost.device_for_kind(kind) or gpu_cost.DEVICES[gpu_cost.DEFAULT_DEVICE]
    fields = [
        "device",
        "dtype",
        "in",
        "out",
        "block_size",
        "sparsity",
        "layout",
        "k",
        "batch",
        "impl",
        "phase",
        "ms",
        "speedup_vs_dense",
        "predicted_ms",
        "model_device",
        "tiles_touched",
        "tile_fill",
        "tensor_core_share",
    ]
    rows = []
    with (
        out.open("w", newline="") as fh,
        tqdm(
            total=len(cases) * len(args.impls) * len(PHASES) * args.repeats, desc="timing"
        ) as progress,
    ):
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        for (in_f, out_f), sparsity, b, layout in cases:
            rng = np.random.default_rng(args.seed)
            geo = geometry(in_f, out_f, b)
            k = dd.num_diagonals(in_f, out_f, sparsity, block_size=b)
            offsets_np = make_offsets(layout, k, geo.num_candidates, rng)
            offsets = jnp.asarray(offsets_np, jnp.int32)
            fan_in = k * (b if b > 1 else 1)
            values = rng.standard_normal((k, *geo.values_shape)) / np.sqrt(fan_in)
            values = jnp.asarray(values, dtype)
            x = jnp.asarray(rng.standard_normal((args.batch, in_f)), dtype)
            dy = jnp.asarray(rng.standard_normal((args.batch, out_f)), dtype)
            stats = dd.kernel_stats(
                offsets_np, in_f, out_f, dtype=dtype, block_size=b, rows=args.batch, device=spec
            )
            seconds = stats.cost.seconds
            auto_path = _auto_path(args.batch, in_f, out_f, dtype, k, b, spec)
            fns = {}
            for impl in args.impls:
                layer, param = layer_fns(impl, offsets, in_f, out_f, values)
                for phase, fn_args in phase_fns(layer, x, param, dy).items():
                    fns[(impl, phase)] = fn_args
            if on_gpu and "ffi" in args.impls and not uses_dynadiag_kernels(*fns[("ffi", "fwd")]):
                raise RuntimeError("impl='ffi' did not compile to the dynadiag CUDA custom calls")
            if on_gpu and "auto" in args.impls:
                calls = uses_dynadiag_kernels(*fns[("auto", "fwd")])
                if calls != (auto_path == "kernel"):
                    raise RuntimeError(
                        f"impl='auto' compiled otherwise than the model's {auto_path}"
                    )
            med = run_case(fns, args.repeats, args.warmup, progress)
            blocks = stats.forward.output_blocks + stats.dx.output_blocks
            for (impl, phase), took in med.items():
                model = {"ffi": "kernel", "auto": auto_path, "dense": "dense_layer"}.get(impl)
                predicted = seconds[model][0 if phase == "fwd" else 2] if model else float("nan")
                row = dict(
                    device=kind,
                    dtype=dtype.name,
                    block_size=b,
                    sparsity=sparsity,
                    layout=layout,
                    k=k,
                    batch=args.batch,
                    impl=impl,
                    phase=phase,
                    ms=round(took * 1e3, 4),
                    speedup_vs_dense=round(med[("dense", phase)] / took, 3),
                    predicted_ms=round(predicted * 1e3, 4),
                    model_device=spec.name,
                    tiles_touched=stats.tiles_touched,
                    tile_fill=round(stats.forward.fill, 3),
                    tensor_core_share=round(
                        (stats.forward.tensor_core_blocks + stats.dx.tensor_core_blocks) / blocks, 3
                    ),
                )
                row["in"], row["out"] = in_f, out_f
                writer.writerow(row)
                fh.flush()
                rows.append(row)
    print(
        f"\n{'shape':>10} {'b':>3} {'sp':>5} {'layout':>7} {'TC share':>8} {'impl':>6} "
        f"{'phase':>8} {'ms':>9} {'x dense':>8} {'model ms':>9}"
    )
    for r in rows:
        print(
            f"{r['in']:>4}:{r['out']:<5} {r['block_size']:>3} {r['sparsity']:>5} {r['layout']:>7} "
            f"{r['tensor_core_share']:>8} {r['impl']:>6} {r['phase']:>8} {r['ms']:>9.3f} "
            f"{r['speedup_vs_dense']:>8.2f} {r['predicted_ms']:>9.3f}"
        )
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
