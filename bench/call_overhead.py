"""Where the time of a small-batch ``dd.diag_matmul`` call goes, beside XLA's dense dot.

At a few rows a product is tens of microseconds, so what XLA runs around the kernel counts as much
as the kernel. For every shape, block size and batch size this times, warm, one jitted forward
``y = x @ W.T`` of:

* ``dense``: XLA's dot on a dense kernel ``[in, out]`` (the ``nn.Dense`` being replaced), and
  ``dense+bias``;
* ``ffi``: ``dd.diag_matmul(impl="ffi")``, with the out-of-range guard of traced offsets;
* ``ffi in range``: ``dynadiag_jax.ops.diag_matmul.diag_matmul_in_range`` (no guard: the kernel
  call alone), and ``ffi in range+bias``: the same followed by one element-wise op, as in a layer;
* ``jax``: ``dd.diag_matmul(impl="jax")``, the pure-JAX path with the guard.

Warm: each function runs its share of the ``--repeats`` calls back to back after an untimed one.
Interleaved: the calls come in ``--rounds`` rounds, each giving every function its share in an
order that rotates from round to round, so a change of the host's speed meets every function
alike; a time is the median of all its calls. Each time is also printed as a speed-up over
``dense`` of the same shape and batch. Writes a CSV
(``--out``, default ``bench/results/call_overhead_<time>.csv``).

Example::

    python bench/call_overhead.py --shapes 768:3072,3072:768 --blocks 1,16 --batch 1,4
"""

from __future__ import annotations

import statistics

import jax
import jax.numpy as jnp
import numpy as np
from bench_cli import (  # bench/, beside this
    add_options,
    check_blocks,
    count,
    make_parser,
    results_path,
    sparsity,
    write_csv,
)
from diag_matmul import make_case, time_call  # bench/, beside this

import dynadiag_jax as dd
from dynadiag_jax.ops.diag_matmul import diag_matmul_in_range

VARIANTS = ("dense", "dense+bias", "ffi", "ffi in range", "ffi in range+bias", "jax")


def _median_us(fns: dict, args, repeats: int, rounds: int) -> dict[str, float]:
    """``{name: us}``: the median of ``repeats`` warm calls of each of ``fns``, in ``rounds``
    interleaved rounds (the order rotating)."""
    names = list(fns)
    times = {name: [] for name in names}
    for r in range(rounds):
        share = repeats // rounds + (r < repeats % rounds)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            time_call(fns[name], args)
            times[name] += [time_call(fns[name], args) for _ in range(share)]
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def _functions(out_features: int):
    def bias(y, b):
        return y + b

    return {
        "dense": lambda x, w, v, o, b: x @ w,
        "dense+bias": lambda x, w, v, o, b: bias(x @ w, b),
        "ffi": lambda x, w, v, o, b: dd.diag_matmul(x, v, o, out_features=out_features, impl="ffi"),
        "ffi in range": lambda x, w, v, o, b: diag_matmul_in_range(
            x, v, o, out_features=out_features, impl="ffi"
        ),
        "ffi in range+bias": lambda x, w, v, o, b: bias(
            diag_matmul_in_range(x, v, o, out_features=out_features, impl="ffi"), b
        ),
        "jax": lambda x, w, v, o, b: dd.diag_matmul(x, v, o, out_features=out_features, impl="jax"),
    }


def run(args) -> list[dict]:
    rng = np.random.default_rng(args.seed)
    rows = []
    for in_f, out_f in args.shapes:
        for b in args.blocks:
            if b > 1 and (in_f % b or out_f % b):
                print(f"skipped {in_f}->{out_f} b={b}: b does not divide the shape")
                continue
            w = jnp.asarray(rng.standard_normal((in_f, out_f)), jnp.float32)  # as nn.Dense
            bias = jnp.zeros((out_f,), jnp.float32)
            for batch in args.batch:
                case = make_case(in_f, out_f, args.sparsity, b, batch, jnp.float32, args.seed)
                x, values, offsets, k = case.x, case.values, case.offsets, case.k
                fns = {name: jax.jit(fn) for name, fn in _functions(out_f).items()}
                rounds = min(args.rounds, args.repeats)
                times = _median_us(fns, (x, w, values, offsets, bias), args.repeats, rounds)
                for name in VARIANTS:
                    rows.append(
                        dict(
                            shape=f"{in_f}->{out_f}",
                            block=b,
                            k=k,
                            batch=batch,
                            variant=name,
                            us=round(times[name], 2),
                            speedup_vs_dense=round(times["dense"] / times[name], 3),
                        )
                    )
    return rows


def main(argv=None) -> None:
    parser = make_parser(__doc__)
    add_options(
        parser,
        "call_overhead",
        shapes="768:3072,3072:768",
        blocks="1,16",
        batch="1",
        repeats=201,
    )
    parser.add_argument("--sparsity", type=sparsity, default=0.9, help="in (0, 1) (default 0.9)")
    parser.add_argument(
        "--rounds",
        type=count("rounds"),
        default=5,
        help="interleaved rounds the repeats are split into (default 5)",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    check_blocks(parser, args.shapes, args.blocks)
    if not dd.has_cpu_kernels():
        parser.error("it times impl='ffi', and the C++ extension is not built")
    out = args.out or results_path("call_overhead")
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, sparsity {args.sparsity}, "
        f"warm, median of {args.repeats} in {min(args.rounds, args.repeats)} interleaved rounds "
        "(us, and speed-up over dense)"
    )
    rows = run(args)
    header = f"{'shape':>10} {'b':>3} {'batch':>5} " + " ".join(f"{v:>18}" for v in VARIANTS)
    print(header)
    print("-" * len(header))
    for i in range(0, len(rows), len(VARIANTS)):
        group = rows[i : i + len(VARIANTS)]
        cells = " ".join(f"{r['us']:>9.1f} {r['speedup_vs_dense']:>7.2f}x" for r in group)
        print(f"{group[0]['shape']:>10} {group[0]['block']:>3} {group[0]['batch']:>5} {cells}")
    write_csv(rows, list(rows[0]) if rows else ["shape"], "call_overhead", out)


if __name__ == "__main__":
    main()
