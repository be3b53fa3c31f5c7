"""Does a results suite's method train better when its sparse layers' weights learn faster?

The control behind ``optimizer.sparse_lr_scale="init_gain"`` (docs/selection.md, "The sparse
weights' learning rate"): each method of ``--methods`` trains on one results suite at 90% with
the optimizer's updates of the weights of the suite's sparse layers (``dynadiag.layers``; their
``kernel`` in ``dense``, their ``values`` in ``dynadiag`` and ``static_diagonals``) multiplied by
each factor of ``--factors``, over ``--seeds``. For ``dense`` the factor speeds up weights that
start at the dense scale: if it helps there too, the suite's learning rate is low for the model;
if it helps only the sparse methods, it is their up-scaled init that learns too slowly. (RigL,
SET and MEST take the factor through ``sparse_lr_scale`` itself, inside their mask updates.)
The suite's own ``sparse_lr_scale`` is set to ``"none"``: a factor of 1 is the plain rate.

Prints mean +- std per method and factor; writes a CSV (``--out``, default
``bench/results/sparse_lr_probe_<time>.csv``). Example::

    python bench/sparse_lr_probe.py --suite mlp --methods dense,dynadiag --factors 1,3.16
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

# Appended: `train` from the checkout; the installed dynadiag_jax (with its kernels) still wins.
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
from bench_cli import out_file, write_csv  # noqa: E402 - bench/, beside this

from train import baselines, common  # noqa: E402
from train import results_runs as R  # noqa: E402
from train.configs import results as results_config  # noqa: E402

SPARSITY = 0.9
METHODS = ("dense", "dynadiag", "static_diagonals")


def probe(config, data, suite, methods, factors, seeds) -> list[dict]:
    """Rows ``{"method", "factor", "seed", "metric"}``."""
    m = config.models[suite]
    steps = R.steps_of(m, data)
    rows = []
    for method in methods:
        for factor in factors:
            for seed in seeds:
                built = R.build(config, suite, method, SPARSITY, seed, data, steps)
                weight = "kernel" if method == "dense" else "values"
                tx = baselines.scaled_sparse_updates(
                    built.optimizer, m.dynadiag.layers, weight, factor
                )
                metric = final_metric(config, data, suite, built._replace(optimizer=tx), seed)
                rows.append(dict(method=method, factor=factor, seed=seed, metric=metric))
    return rows


def final_metric(config, data, suite: str, built, seed: int) -> float:
    """The test accuracy (language model: validation perplexity) of ``built`` trained with
    suite ``suite``'s recipe, in a scratch directory, no checkpoint but the ones the loop must
    write."""
    steps = R.steps_of(config.models[suite], data)
    with tempfile.TemporaryDirectory(prefix="probe") as workdir:
        result = R.train_built(
            config, data, suite, built, seed, steps, pathlib.Path(workdir), checkpoints=False
        )
    metrics = result.eval_metrics
    return float(metrics["perplexity" if "perplexity" in metrics else "accuracy"])


def add_run_arguments(parser, methods: tuple[str, ...], default: str) -> None:
    """``--suite``, ``--methods`` (of ``methods``), ``--seeds``, ``--data`` and ``--out``: what
    a probe that trains a results suite's methods takes (read back by :func:`methods_and_seeds`)."""
    parser.add_argument("--suite", default="mlp", choices=results_config.SUITES)
    parser.add_argument("--methods", default=default, help=f"of {methods}")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--data", default="auto", help="the suites' data.source (mnist5k: small)")
    parser.add_argument("--out", type=out_file, default=None)


def methods_and_seeds(parser, args, methods: tuple[str, ...]) -> tuple[list[str], list[int]]:
    """The checked ``--methods`` and ``--seeds``, and ``--out`` checked (``parser.error`` on bad
    ones)."""
    chosen = args.methods.split(",")
    if not set(chosen) <= set(methods):
        parser.error(f"--methods must be among {methods}")
    return chosen, seeds_of(parser, args.seeds)


def seeds_of(parser, text: str) -> list[int]:
    """``--seeds``, comma-separated integers >= 0 (``parser.error`` otherwise)."""
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        parser.error("--seeds is a comma-separated list of integers")
    if min(seeds) < 0:
        parser.error("need seeds >= 0")
    return seeds


def prepare(parser, config):
    """``R.prepare(config)``: the suite's data, or ``parser.error`` naming what is wrong (an
    unknown ``--data``, say) before anything is compiled."""
    try:
        return R.prepare(config)
    except common.ConfigError as e:
        parser.error(str(e))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser, METHODS, "dense,dynadiag")
    parser.add_argument("--factors", default="1,3.16")
    args = parser.parse_args(argv)
    methods, seeds = methods_and_seeds(parser, args, METHODS)
    try:
        factors = [float(f) for f in args.factors.split(",")]
    except ValueError:
        parser.error("--factors is a comma-separated list of numbers")
    if not all(np.isfinite(f) and f > 0 for f in factors):
        parser.error("need --factors > 0")
    config = results_config.get_config(f"models={args.suite}")
    config.data.source = args.data
    # The factors replace the recipe's own (the suites default to init_gain): x1 is the plain rate.
    config.models[args.suite].optimizer.sparse_lr_scale = "none"
    data = prepare(parser, config)
    rows = probe(config, data, args.suite, methods, factors, seeds)
    lm = R.is_language_model(config.models[args.suite])
    print(f"{args.suite} at {SPARSITY:g}: test {'perplexity' if lm else 'accuracy'}, seeds {seeds}")
    for method in methods:
        for factor in factors:
            values = np.array(
                [r["metric"] for r in rows if (r["method"], r["factor"]) == (method, factor)]
            )
            spread = values.std(ddof=1) if len(values) > 1 else 0.0
            print(f"  {method:<17} x{factor:<6g} {values.mean():.4f} +- {spread:.4f}")
    write_csv(rows, ("method", "factor", "seed", "metric"), "sparse_lr_probe", args.out)


if __name__ == "__main__":
    main()
