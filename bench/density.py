"""Where the CPU kernels stop beating XLA's dense dot as a product gets denser.

A search step computes a ranked prefix of a layer's diagonals: all ``P`` of them at the flat start,
then ever fewer buckets while the gate narrows. At a high density the kernels do the dense
product's work through scattered diagonals, and XLA's dot on ``W`` built on the device is faster;
``impl="auto"`` on CPU takes ``"dense"`` above :data:`dynadiag_jax.ops.auto.CPU_DENSE_DENSITY`.
This measures the ratio per product (``y``, ``dx``, ``dvalues``) at a sweep of densities, shapes
and batch sizes: each cell the ``"ffi"`` path and the ``"dense"`` one timed interleaved in one loop
(median of ``--repeats`` calls, float32, random offsets), ``dense/ffi`` > 1 where the kernel wins.
Prints a table with the lowest density at which dense wins per row; writes a CSV (``--out``).

Example::

    python bench/density.py --shapes 784:256,256:256,160:640 --batch 128,1024
"""

from __future__ import annotations

import csv

import jax
import jax.numpy as jnp
import numpy as np
from bench_cli import (  # bench/, beside this
    add_options,
    check_blocks,
    divides,
    make_parser,
    parse_fractions,
    results_path,
)
from diag_matmul import time_interleaved  # bench/, beside this
from tqdm import tqdm

import dynadiag_jax as dd
from dynadiag_jax.layout import geometry

PRODUCTS = ("y", "dx", "dvalues")


def calls(in_f: int, out_f: int, block: int, k: int, rows: int, seed: int) -> dict:
    """``{(impl, product): (jitted fn, args)}`` for one cell."""
    geo = geometry(in_f, out_f, block)
    rng = np.random.default_rng(seed)
    offsets = jnp.asarray(np.sort(rng.choice(geo.num_candidates, k, replace=False)), jnp.int32)
    values = jnp.asarray(rng.standard_normal((k, *geo.values_shape)) * 0.05, jnp.float32)
    x = jnp.asarray(rng.standard_normal((rows, in_f)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((rows, out_f)), jnp.float32)
    out = {}
    for impl in ("ffi", "dense"):

        def product(a, v, impl=impl):
            return dd.diag_matmul(a, v, offsets, out_features=out_f, impl=impl)

        out[(impl, "y")] = (jax.jit(product), (x, values))
        out[(impl, "dx")] = (
            jax.jit(lambda a, v, g, f=product: jax.vjp(lambda a_: f(a_, v), a)[1](g)[0]),
            (x, values, dy),
        )
        out[(impl, "dvalues")] = (
            jax.jit(lambda a, v, g, f=product: jax.vjp(lambda v_: f(a, v_), v)[1](g)[0]),
            (x, values, dy),
        )
    return out


def main(argv=None) -> None:
    parser = make_parser(__doc__)
    add_options(parser, "density", shapes="784:256,256:256", blocks="1", batch="128", repeats=21)
    parser.add_argument(
        "--densities",
        type=parse_fractions("densities", "0.25,0.5,1", one=True),
        default="0.125,0.25,0.375,0.5,0.625,0.75,1.0",
        help="shares of the candidate diagonals computed, in (0, 1], comma separated",
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    check_blocks(parser, args.shapes, args.blocks)
    if not dd.has_cpu_kernels():
        parser.error("it times impl='ffi', and the C++ extension is not built")
    densities = args.densities
    cells = [
        (s, b, r, d)
        for s in args.shapes
        for b in args.blocks
        if divides(b, s)
        for r in args.batch
        for d in densities
    ]
    out = args.out or results_path("density")
    out.parent.mkdir(parents=True, exist_ok=True)

    rows = []
    with tqdm(total=len(cells) * 6 * args.repeats, unit="call") as progress:
        for (in_f, out_f), block, batch, density in cells:
            p = geometry(in_f, out_f, block).num_candidates
            k = max(1, min(p, round(density * p)))
            med = time_interleaved(
                calls(in_f, out_f, block, k, batch, args.seed), args.repeats, progress
            )
            for product in PRODUCTS:
                rows.append(
                    {
                        "shape": f"{in_f}->{out_f}",
                        "b": block,
                        "batch": batch,
                        "density": k / p,
                        "product": product,
                        "ffi_us": 1e6 * med[("ffi", product)],
                        "dense_us": 1e6 * med[("dense", product)],
                    }
                )
    with out.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    print(f"jax {jax.__version__}, float32, median of {args.repeats}; dense/ffi > 1: kernel faster")
    header = f"{'shape':>10} {'b':>3} {'batch':>6} {'product':>8} " + " ".join(
        f"{d:>6.3f}" for d in densities
    )
    print(header + "  dense from")
    print("-" * (len(header) + 12))
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["shape"], r["b"], r["batch"], r["product"]), []).append(r)
    for (shape, block, batch, product), group in groups.items():
        ratios = [r["dense_us"] / r["ffi_us"] for r in group]
        wins = [r["density"] for r, q in zip(group, ratios, strict=True) if q < 1]
        first = f"{min(wins):.3f}" if wins else "never"
        cols = " ".join(f"{q:6.2f}" for q in ratios)
        print(f"{shape:>10} {block:>3} {batch:>6} {product:>8} {cols}  {first:>10}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
