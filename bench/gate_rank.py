"""What one layer's ranking of its scores costs per search step: ``gate_rank`` on the CPU kernel
against its pure-JAX reference.

Every search step ranks every sparse layer's ``P`` scores (the order, the top-K and the sparse
gate's threshold: ``dynadiag_jax.ops.ranking.gate_rank``). For each ``P`` (with ``K`` at
``--sparsity``) this times the jitted call on one row of normal scores, the kernel and the
reference one after the other (each the median of ``--repeats`` calls in a row, microseconds,
dispatch included; interleaved with the reference, whose sort runs on XLA's thread pool, the
kernel's own time doubles), and checks that both give the same order. Prints a table with the
kernel's time over the reference's (below 1: the kernel is faster); writes a CSV (``--out``,
default ``bench/results/gate_rank_<time>.csv``).

Example::

    python bench/gate_rank.py --p 256,784,3072
"""

from __future__ import annotations

import math
import statistics

import jax
import jax.numpy as jnp
import numpy as np
from bench_cli import (  # bench/, beside this
    add_options,
    make_parser,
    parse_sizes,
    sparsity,
    write_csv,
)
from diag_matmul import time_call  # bench/, beside this
from tqdm import tqdm

import dynadiag_jax as dd
from dynadiag_jax.ops.ranking import gate_rank


def measure(p: int, sparsity: float, repeats: int, progress) -> dict:
    """One row: ``p``, ``k``, the kernel's and the reference's median microseconds."""
    k = max(1, math.ceil((1 - sparsity) * p))
    rng = np.random.default_rng(p)
    alpha = jnp.asarray(rng.standard_normal((1, p)) * 0.1, jnp.float32)
    old = jnp.asarray(rng.choice(p, (1, k), replace=False), jnp.int32)
    calls = {
        impl: (
            jax.jit(lambda a, o, impl=impl: gate_rank(a, 0.5, o, sparse=True, impl=impl)),
            (alpha, old),
        )
        for impl in ("auto", "jax")
    }
    orders = [np.asarray(f(*args).order) for f, args in calls.values()]
    if not np.array_equal(*orders):
        raise AssertionError(f"P={p}: the kernel's order differs from the reference's")
    times = {}
    for impl, (f, args) in calls.items():
        time_call(f, args)
        samples = []
        for _ in range(repeats):
            samples.append(time_call(f, args))
            progress.update(1)
        times[impl] = statistics.median(samples)
    kernel, reference = 1e6 * times["auto"], 1e6 * times["jax"]
    ratio = round(kernel / reference, 3)
    return {
        "p": p,
        "k": k,
        "kernel_us": kernel,
        "reference_us": reference,
        "kernel_over_reference": ratio,
    }


def main(argv=None) -> None:
    parser = make_parser(__doc__)
    parser.add_argument(
        "--p",
        type=parse_sizes("--p", "256,784"),
        default=(256, 784, 3072),
        help="numbers of candidates, comma separated (default 256,784,3072)",
    )
    parser.add_argument(
        "--sparsity", type=sparsity, default=0.9, help="K = ceil((1 - sparsity) P) (default 0.9)"
    )
    add_options(parser, "gate_rank", repeats=1001, each="implementation")
    args = parser.parse_args(argv)
    if not dd.has_cpu_kernels():  # impl="auto" would time the reference under both names
        parser.error("the C++ extension is not built: there is no kernel to time")
    sizes = args.p
    with tqdm(total=2 * args.repeats * len(sizes), unit="call", leave=False) as progress:
        rows = [measure(p, args.sparsity, args.repeats, progress) for p in sizes]
    print(f"gate_rank, one row, sparsity {args.sparsity:g}, median of {args.repeats} (us)")
    print(f"{'P':>6} {'K':>5} {'kernel':>9} {'reference':>10} {'kernel/reference':>17}")
    for r in rows:
        print(
            f"{r['p']:>6} {r['k']:>5} {r['kernel_us']:>9.1f} {r['reference_us']:>10.1f}"
            f" {r['kernel_over_reference']:>17.2f}"
        )
    write_csv(rows, list(rows[0]), "gate_rank", args.out)


if __name__ == "__main__":
    main()
