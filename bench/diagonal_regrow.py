"""Would SET's mask updates help diagonal layers if they swapped whole diagonals?

A probe, not a method (docs/selection.md, "What the unstructured methods add"): on one results
suite at 90%, each method of ``--methods`` trains over ``--seeds`` without and with the updates.
With them, every frozen diagonal layer (DynaDiag's after its freeze, static diagonals' from the
start) replaces, every ``--every`` steps until ``--end`` of training, its ``round(f K)`` diagonals
of smallest values norm by as many random diagonals not in the layer, whose values and optimizer
moments start at zero; ``f`` is ``--fraction`` cosine-decayed to 0 at ``--end`` (SET's schedule in
the suites). The update runs between the jitted steps, patched into the training loop for these
runs only (``dynadiag_jax.training.loop.train_one_step``); the library is unchanged.

Prints mean +- std per method, without and with the updates; writes a CSV (``--out``, default
``bench/results/diagonal_regrow_<time>.csv``). Example::

    python bench/diagonal_regrow.py --suite mlp --methods dynadiag,static_diagonals
"""

from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys

# Appended: `train` from the checkout; the installed dynadiag_jax (with its kernels) still wins.
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from bench_cli import write_csv  # noqa: E402 - bench/, beside this
from flax import traverse_util  # noqa: E402
from sparse_lr_probe import (  # noqa: E402 - bench/, beside this
    add_run_arguments,
    final_metric,
    methods_and_seeds,
    prepare,
)

from dynadiag_jax import baselines as B  # noqa: E402
from dynadiag_jax.training import loop  # noqa: E402
from train import common  # noqa: E402
from train import results_runs as R  # noqa: E402
from train.configs import results as results_config  # noqa: E402

SPARSITY = 0.9
METHODS = ("dynadiag", "static_diagonals")
# Folded into the run's key for the random diagonals, apart from its other streams.
REGROW_STREAM = 0x72656772


def regrow(state, candidates: dict[str, int], fraction, end: int):
    """``state`` with each frozen element-diagonal layer's smallest diagonals replaced.

    ``candidates``: ``{layer path: P}``. At step ``t`` (``state.step``) a layer of ``K`` diagonals
    swaps ``round(f K)`` of them, ``f = fraction (1 + cos(pi min(t, end) / end)) / 2``: the ones
    of smallest values norm leave, as many offsets not in the layer, drawn uniformly, enter with
    zero values and zero optimizer moments.
    """
    t = state.step
    f = B.cosine_decay(fraction, end)(t)  # SET's and RigL's drop fraction
    key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), REGROW_STREAM)
    key = jax.random.fold_in(key, t)
    diagonals = traverse_util.flatten_dict(state.collections["diagonals"])
    params = traverse_util.flatten_dict(state.params)
    grown = {k: False for k in params}
    for i, path in enumerate(p[:-1] for p in diagonals if p[-1] == "offsets"):
        offsets, values = diagonals[(*path, "offsets")], params[(*path, "values")]
        k, p = offsets.shape[0], candidates["/".join(path)]
        norms = jnp.sum(jnp.square(values.astype(jnp.float32)), axis=tuple(range(1, values.ndim)))
        rank = jnp.argsort(jnp.argsort(norms))  # 0: the smallest
        leaves = rank < jnp.round(f * k).astype(jnp.int32)
        taken = jnp.zeros((p,), bool).at[offsets].set(True)
        draw = jnp.where(taken, -1.0, jax.random.uniform(jax.random.fold_in(key, i), (p,)))
        entering = jax.lax.top_k(draw, k)[1].astype(offsets.dtype)  # distinct, none taken
        diagonals[(*path, "offsets")] = jnp.where(leaves, entering[rank], offsets)
        rows = leaves.reshape((k,) + (1,) * (values.ndim - 1))
        params[(*path, "values")] = jnp.where(rows, jnp.zeros_like(values), values)
        grown[(*path, "values")] = jnp.broadcast_to(rows, values.shape)
    grown = traverse_util.unflatten_dict(grown)
    collections = {
        **state.collections,
        "diagonals": traverse_util.unflatten_dict(diagonals),
    }
    return state._replace(
        params=traverse_util.unflatten_dict(params),
        collections=collections,
        opt_state=B.reset_moments(state.opt_state, grown),
    )


@contextlib.contextmanager
def regrowing(candidates: dict[str, int], every: int, end: int, fraction: float):
    """The training loop, inside the block, applies :func:`regrow` after every ``every``-th step
    before ``end`` on states whose diagonal layers are frozen (no ``alpha``)."""
    update = jax.jit(lambda state: regrow(state, candidates, fraction, end))
    step_once = loop.train_one_step

    def patched(train_step, state, *args):
        state = step_once(train_step, state, *args)
        flat = traverse_util.flatten_dict(state.params)
        frozen = "diagonals" in state.collections and not any(k[-1] == "alpha" for k in flat)
        t = int(state.step)  # a sync every step: this probe is about accuracy, not speed
        if frozen and t % every == 0 and t < end:
            state = update(state)
        return state

    loop.train_one_step = patched
    try:
        yield
    finally:
        loop.train_one_step = step_once


def probe(config, data, suite, methods, seeds, every, end_fraction, fraction) -> list[dict]:
    """Rows ``{"method", "regrow", "seed", "metric"}``."""
    m = config.models[suite]
    steps = R.steps_of(m, data)
    end = max(1, round(end_fraction * steps))
    rows = []
    for method in methods:
        model = R.build(config, suite, method, SPARSITY, 0, data, steps).model
        shapes = common.layer_shapes(model, R.example_input(m, data))
        candidates = {path: max(shape) for path, shape in shapes.items()}
        for on in (False, True):
            for seed in seeds:
                built = R.build(config, suite, method, SPARSITY, seed, data, steps)
                updates = regrowing(candidates, every, end, fraction)
                with updates if on else contextlib.nullcontext():
                    metric = final_metric(config, data, suite, built, seed)
                rows.append(dict(method=method, regrow=on, seed=seed, metric=metric))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, METHODS, "dynadiag,static_diagonals")
    parser.add_argument("--every", type=int, default=100, help="steps between updates")
    parser.add_argument("--end", type=float, default=0.75, help="no updates after this fraction")
    parser.add_argument("--fraction", type=float, default=0.3, help="share swapped at step 0")
    args = parser.parse_args(argv)
    methods, seeds = methods_and_seeds(parser, args, METHODS)
    if args.every < 1 or not 0.0 < args.end <= 1.0 or not 0.0 <= args.fraction <= 1.0:
        parser.error("need --every >= 1, --end in (0, 1] and --fraction in [0, 1]")
    config = results_config.get_config(f"models={args.suite}")
    config.data.source = args.data
    data = prepare(parser, config)
    rows = probe(config, data, args.suite, methods, seeds, args.every, args.end, args.fraction)
    lm = R.is_language_model(config.models[args.suite])
    print(f"{args.suite} at {SPARSITY:g}: test {'perplexity' if lm else 'accuracy'}, seeds {seeds}")
    for method in methods:
        for on in (False, True):
            values = np.array(
                [r["metric"] for r in rows if (r["method"], r["regrow"]) == (method, on)]
            )
            spread = values.std(ddof=1) if len(values) > 1 else 0.0
            label = "whole diagonals swapped" if on else "as the suite trains it"
            print(f"  {method:<17} {label:<24} {values.mean():.4f} +- {spread:.4f}")
    write_csv(rows, ("method", "regrow", "seed", "metric"), "diagonal_regrow", args.out)


if __name__ == "__main__":
    main()
