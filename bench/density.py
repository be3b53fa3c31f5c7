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

import argparse
import csv
import datetime
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from diag_matmul import parse_sizes, time_interleaved  # bench/, beside this
from tqdm import tqdm

import dynadiag_jax as dd
from dynadiag_jax.layout import geometry

PRODUCTS = ("y", "dx", "dvalues")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"784:256,256:256"`` -> ``[(784, 256), (256, 256)]``."""
    try:
        shapes = [tuple(int(n) for n in pair.split(":")) for pair in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected IN:OUT pairs like 784:256, got {text!r}")
    return shapes


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("784:256,256:256"))
    parser.add_argument("--batch", type=parse_sizes("batch", "128,1024"), default=(128,))
    parser.add_argument("--blocks", type=parse_sizes("block", "1,16"), default=(1,))
    parser.add_argument("--densities", default="0.125,0.25,0.375,0.5,0.625,0.75,1.0")
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    args = parser.parse_args()
    densities = [float(d) for d in args.densities.split(",")]
    if not densities or min(densities) <= 0 or max(densities) > 1:
        parser.error(f"--densities must lie in (0, 1], got {args.densities!r}")
    stamp = datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    out = args.out or pathlib.Path(__file__).parent / "results" / f"density_{stamp}.csv"
    out.parent.mkdir(parents=True, exist_ok=True)

    cells = [
        (s, b, r, d)
        for s in args.shapes
        for b in args.blocks
        if s[0] % b == 0 and s[1] % b == 0
        for r in args.batch
        for d in densities
    ]
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
