"""What a search-phase ``DiagonalDense`` step costs against the same layer after its freeze.

For every shape, sparsity and batch size this times, interleaved (median of ``--repeats``), the
jitted forward + backward (gradients of ``sum(y^2)`` for the layer's params and ``x``) of:

* ``dense``: ``nn.Dense`` of the same shape (XLA's dot);
* ``frozen``: the layer after ``dd.freeze_tree``: ``K`` diagonals, no gate;
* ``narrow``: the search phase once the gate has narrowed (random scores at strength 1e-3, so
  about ``K`` gates are non-zero and the smallest bucket, ``K_cap`` diagonals, is computed): the
  ranking, the gate, the product and the gradients of all ``P`` scores and values;
* ``flat``: the search phase at its start (every gate ``K / P``): all ``P`` diagonals computed.

``--permutation random`` or ``learned`` builds the layer with that input permutation
(``DiagonalDense(permutation=...)``: after the freeze the product reads ``x`` through ``perm``, on
CPU inside the kernels; in the search variants a gather of ``x`` before the product, or, while a
learned one is soft, ``x @ M.T`` with ``M[in, in]``) and adds ``plain``: the frozen layer without
a permutation, so ``frozen / plain`` is what the permutation costs after the freeze.
``--relaxation blocks`` relaxes a learned one as ``permutation_relaxation="blocks"`` does (a
gather of ``x`` and a hard permutation inside blocks of at most 64 inputs while searching).

``--block-size b`` builds block-diagonal layers of ``b x b`` blocks instead of element diagonals.
``--rounds n`` repeats the interleaved timing ``n`` times and reports the median of the rounds'
medians: the shared hosts change speed for seconds at a time, which one round charges to
whichever variant it hits.

Each time is printed with its ratio to ``frozen``; the training goal is a search step at most 1.3x
the frozen one. Writes a CSV (``--out``, default ``bench/results/search_step_<time>.csv``).

Example::

    python bench/search_step.py --shapes 784:256,160:640 --batch 128,1024 --sparsity 0.9,0.95
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from bench_cli import (  # bench/, beside this
    add_options,
    count,
    make_parser,
    parse_fractions,
    results_path,
    write_csv,
)
from diag_matmul import time_interleaved  # bench/, beside this
from flax import traverse_util
from tqdm import tqdm

import dynadiag_jax as dd

VARIANTS = ("dense", "frozen", "narrow", "flat")


def _loss_grad(module, collections):
    """Jitted ``(params, x) -> grads of sum(y^2)`` for params and x (gate state not mutated)."""

    def loss(params, x):
        y = module.apply({**collections, "params": params}, x, mutable=["dynadiag"])[0]
        return jnp.sum(jnp.square(y))

    return jax.jit(jax.grad(loss, argnums=(0, 1)))


def _with_scores(params, key):
    """``params`` with every ``alpha`` replaced by standard normal scores (distinct ranks)."""
    flat = traverse_util.flatten_dict(params)
    for path, leaf in flat.items():
        if path[-1] == "alpha":
            flat[path] = jax.random.normal(key, leaf.shape, leaf.dtype)
    return traverse_util.unflatten_dict(flat)


def functions(
    in_f: int,
    out_f: int,
    sparsity: float,
    batch: int,
    seed: int,
    permutation=None,
    block_size: int = 1,
    relaxation: str = "sinkhorn",
) -> dict:
    """``{variant: (fn, args)}`` for one layer shape, sparsity, batch, input permutation and block
    size."""
    keys = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(keys[0], (batch, in_f), jnp.float32)
    layer = dd.nn.DiagonalDense(
        out_f,
        sparsity=sparsity,
        permutation=permutation,
        block_size=block_size,
        permutation_relaxation=relaxation,
    )
    variables = layer.init(keys[1], x)
    rest = {k: v for k, v in variables.items() if k != "params"}
    narrow = dd.nn.set_gate(
        {**variables, "params": _with_scores(variables["params"], keys[2])}, strength=1e-3
    )
    frozen = dd.freeze_tree(narrow)
    dense = nn.Dense(out_f)
    dense_params = dense.init(keys[3], x)["params"]
    extra = {}
    if permutation is not None:
        plain = {c: {k: v for k, v in t.items() if k != "perm"} for c, t in frozen.items()}
        extra["plain"] = (
            _loss_grad(layer.clone(permutation=None), {"diagonals": plain["diagonals"]}),
            (plain["params"], x),
        )
    return {
        **extra,
        "dense": (_loss_grad(dense, {}), (dense_params, x)),
        "frozen": (
            _loss_grad(layer, {k: v for k, v in frozen.items() if k != "params"}),
            (frozen["params"], x),
        ),
        "narrow": (
            _loss_grad(layer, {k: v for k, v in narrow.items() if k != "params"}),
            (narrow["params"], x),
        ),
        "flat": (_loss_grad(layer, dd.nn.set_gate(rest, strength=1.0)), (variables["params"], x)),
    }


def variants(permutation) -> tuple[str, ...]:
    return VARIANTS if permutation is None else ("plain", *VARIANTS)


def run(args, progress) -> list[dict]:
    rows = []
    for in_f, out_f in args.shapes:
        for sparsity in args.sparsity:
            for batch in args.batch:
                fns = functions(
                    in_f,
                    out_f,
                    sparsity,
                    batch,
                    args.seed,
                    args.permutation,
                    args.block_size,
                    args.relaxation,
                )
                rounds = [time_interleaved(fns, args.repeats, progress) for _ in range(args.rounds)]
                median = {name: float(np.median([r[name] for r in rounds])) for name in fns}
                for name in variants(args.permutation):
                    rows.append(
                        dict(
                            shape=f"{in_f}->{out_f}",
                            block_size=args.block_size,
                            sparsity=sparsity,
                            batch=batch,
                            variant=name,
                            us=round(median[name] * 1e6, 1),
                            vs_frozen=round(median[name] / median["frozen"], 3),
                        )
                    )
    return rows


def main(argv=None) -> None:
    parser = make_parser(__doc__)
    add_options(
        parser,
        "search_step",
        shapes="784:256,160:640",
        batch="128,1024",
        repeats=101,
        each="variant",
    )
    parser.add_argument(
        "--sparsity",
        type=parse_fractions(),
        default=(0.9, 0.95),
        help="sparsities in (0, 1), comma separated (default 0.9,0.95)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--permutation", choices=("none", "random", "learned"), default="none")
    parser.add_argument(
        "--relaxation", choices=("sinkhorn", "blocks"), default="sinkhorn", help="of learned"
    )
    parser.add_argument(
        "--block-size", type=count("the block size"), default=1, help="1: element diagonals"
    )
    parser.add_argument(
        "--rounds", type=count("rounds"), default=1, help="median over this many timings"
    )
    args = parser.parse_args(argv)
    args.permutation = None if args.permutation == "none" else args.permutation
    names = variants(args.permutation)
    bad = [f"{i}:{o}" for i, o in args.shapes if i % args.block_size or o % args.block_size]
    if bad:
        parser.error(f"--block-size {args.block_size} must divide both widths of {', '.join(bad)}")
    out = args.out or results_path("search_step")
    print(
        f"jax {jax.__version__}, backend {jax.default_backend()}, forward + backward, "
        f"{'element diagonals' if args.block_size == 1 else f'blocks of {args.block_size}'}, "
        f"interleaved, median of {args.repeats}"
        f"{f' (median of {args.rounds} rounds)' if args.rounds > 1 else ''}"
        " (us, and ratio to the frozen layer)"
    )
    total = len(args.shapes) * len(args.sparsity) * len(args.batch) * len(names) * args.repeats
    total *= args.rounds
    with tqdm(total=total, unit="call") as progress:
        rows = run(args, progress)
    header = f"{'shape':>10} {'sparsity':>8} {'batch':>5} " + " ".join(f"{v:>17}" for v in names)
    print(header)
    print("-" * len(header))
    for i in range(0, len(rows), len(names)):
        group = rows[i : i + len(names)]
        cells = " ".join(f"{r['us']:>9.1f} {r['vs_frozen']:>6.2f}x" for r in group)
        first = group[0]
        print(f"{first['shape']:>10} {first['sparsity']:>8g} {first['batch']:>5} {cells}")
    write_csv(rows, list(rows[0]), "search_step", out)


if __name__ == "__main__":
    main()
