"""Time a forward product in fresh processes, with the page faults each call takes.

A product that runs in one of two speeds per process (docs/cpu_kernels.md, "The same speed in
every process") can be told apart from noise by what the slow calls do: the operating system's
count of minor page faults (``getrusage``) taken by each call. A call whose output lands in fresh
memory faults in every page of it.

For one shape, block size, sparsity and batch size, each of ``--processes`` fresh processes times
``--calls`` jitted forwards of ``dd.diag_matmul(impl="ffi")`` and of XLA's dense dot, one after the
other, and reports per process and implementation the median time (microseconds), its speed-up
over dense in the same process (``x dense``), how many calls faulted, and the median faults of a
faulting call. Writes a CSV (``--out``, default
``bench/results/page_faults_<time>.csv``) with one row per process, implementation and call.

Example::

    python bench/page_faults.py --shape 768:3072 --block 16 --processes 10
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

from bench_cli import (  # bench/, beside this
    add_options,
    count,
    format_us,
    make_parser,
    results_path,
    sparsity,
    write_csv,
)

IMPLS = ("ffi", "dense")


def _child(args) -> None:
    """Times the calls in this process; prints one JSON line per call."""
    import jax  # noqa: PLC0415 - the parent process never imports JAX
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    from diag_matmul import make_case  # noqa: PLC0415 - bench/, beside this script

    import dynadiag_jax as dd  # noqa: PLC0415

    if not dd.has_cpu_kernels():
        sys.exit("error: it times impl='ffi', and the C++ extension is not built")

    in_f, out_f = args.shape
    case = make_case(in_f, out_f, args.sparsity, args.block, args.batch, jnp.float32, args.seed)
    x, values, offsets = case.x, case.values, case.offsets
    rng = np.random.default_rng(args.seed)
    kernel = jnp.asarray(rng.standard_normal((in_f, out_f)), jnp.float32)
    fns = {
        "ffi": (
            jax.jit(lambda x, v, o: dd.diag_matmul(x, v, o, out_features=out_f, impl="ffi")),
            (x, values, offsets),
        ),
        "dense": (jax.jit(lambda x, w: x @ w), (x, kernel)),
    }
    for impl, (f, operands) in fns.items():
        jax.block_until_ready(f(*operands))
        for call in range(args.calls):
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            jax.block_until_ready(f(*operands))
            seconds = time.perf_counter() - start
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            print(json.dumps(dict(impl=impl, call=call, ms=seconds * 1e3, faults=faults)))


def _shape(text: str) -> tuple[int, int]:
    try:
        shape = tuple(int(v) for v in text.split(":"))
    except ValueError:
        shape = ()
    if len(shape) != 2 or min(shape) < 1:
        raise argparse.ArgumentTypeError(f"expected IN:OUT like 768:3072, got {text!r}")
    return shape


def main(argv=None) -> None:
    parser = make_parser(__doc__)
    parser.add_argument(
        "--shape", type=_shape, default=(768, 3072), help="IN:OUT of the layer (default 768:3072)"
    )
    parser.add_argument(
        "--block",
        type=count("the block size"),
        default=16,
        help="block size: 1 = element diagonals (default 16)",
    )
    parser.add_argument("--sparsity", type=sparsity, default=0.9, help="in (0, 1) (default 0.9)")
    parser.add_argument(
        "--batch", type=count("the batch size"), default=2048, help="rows of x (default 2048)"
    )
    parser.add_argument(
        "--calls",
        type=count("calls"),
        default=15,
        help="timed calls per implementation and process (default 15)",
    )
    parser.add_argument(
        "--processes", type=count("processes"), default=10, help="fresh processes (default 10)"
    )
    parser.add_argument("--seed", type=int, default=0)
    add_options(parser, "page_faults")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    in_f, out_f = args.shape
    if args.block > 1 and (in_f % args.block or out_f % args.block):
        parser.error(f"--block {args.block} does not divide the shape {in_f}:{out_f}")
    if args.child:
        _child(args)
        return
    out = args.out or results_path("page_faults")
    child = [sys.executable, __file__, "--child", *(argv if argv is not None else sys.argv[1:])]
    print(
        f"{in_f}->{out_f}, b={args.block}, sparsity {args.sparsity}, batch {args.batch}: "
        f"{args.calls} calls per implementation in each of {args.processes} fresh processes"
    )
    header = ("process", "impl", "median us", "x dense", "calls faulting", "faults/call")
    print(" ".join(f"{h:>{w}}" for h, w in zip(header, (7, 5, 10, 8, 15, 12))))
    rows = []
    for process in range(args.processes):
        proc = subprocess.run(child, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(f"error: process {process} failed:\n{proc.stderr[-2000:]}")
        calls = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        mine = {impl: [c for c in calls if c["impl"] == impl] for impl in IMPLS}
        median = {impl: statistics.median(c["ms"] for c in mine[impl]) for impl in IMPLS}
        for impl in IMPLS:
            faulting = [c["faults"] for c in mine[impl] if c["faults"] > 0]
            per_call = int(statistics.median(faulting)) if faulting else 0
            print(
                f"{process:>7} {impl:>5} {format_us(median[impl]):>10}"
                f" {median['dense'] / median[impl]:>7.2f}x"
                f" {len(faulting):>9} of {len(mine[impl]):<3} {per_call:>12}"
            )
            rows += [dict(process=process, **c) for c in mine[impl]]
    write_csv(rows, ["process", "impl", "call", "ms", "faults"], "page_faults", out)


if __name__ == "__main__":
    main()
