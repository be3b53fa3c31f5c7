"""Can a learned input permutation move, and would a layout matched to the weights pay?

Two probes on one results suite at 90% (``train/configs/results.py``: its model, recipe, data and
search), each trained over ``--seeds``:

* ``--probe moves``: ``dynadiag_learned_perm`` with the optimizer's updates of ``perm_soft``
  multiplied by each factor of ``--lr-scales`` (1: the suite's own run; 0: ``perm_soft`` kept at
  its start, so the soft phase mixes the inputs but learns nothing there). Beside the test metric
  it reports, per sparse layer, the share of rows whose hardened permutation differs from the
  hardening of the layer's initial soft matrix (its random start): 0 means the search never moved
  the permutation, whatever it learned in between. ``--relaxation blocks`` trains the learned
  permutation as ``permutation_relaxation="blocks"`` (a hard permutation inside blocks of at most
  64 inputs after a random one) instead of PA-DST's soft matrix.
* ``--probe assigned``: static diagonals behind a permutation, with the permutation drawn at
  random (the suite's ``static_diagonals_random_perm``) against one matched to a dense model of
  the suite trained for ``--dense-steps`` steps: for each sparse layer, alternately the top-``K``
  diagonals of ``|W[:, perm]|^2`` and the permutation that puts the most of ``|W|^2`` on them
  (``scipy.optimize.linear_sum_assignment`` over slots and inputs); the offsets too where the
  layer keeps ``K`` of them. An oracle-like layout: the dense weights it matches cost a dense run.

Prints a table (metric mean +- std; rows moved per layer); writes a CSV (``--out``, default
``bench/results/permutation_probe_<time>.csv``). Example::

    python bench/permutation_probe.py --suite mlp --probe moves --lr-scales 1,10
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

# Appended: `train` from the checkout; the installed dynadiag_jax (with its kernels) still wins.
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from bench_cli import out_file, write_csv  # noqa: E402 - bench/, beside this
from flax import traverse_util  # noqa: E402
from scipy.optimize import linear_sum_assignment  # noqa: E402
from sparse_lr_probe import prepare, seeds_of  # noqa: E402 - bench/, beside this

import dynadiag_jax as dd  # noqa: E402
from dynadiag_jax import training as T  # noqa: E402
from dynadiag_jax.layout import diag_indices, geometry  # noqa: E402
from train import results_runs as R  # noqa: E402
from train.configs import results as results_config  # noqa: E402

SPARSITY = 0.9
ASSIGN_ROUNDS = 6  # alternations of offsets and permutation (settled after 1-2 on the MLP)


def scaled_permutation_updates(tx: optax.GradientTransformation, factor: float):
    """``tx`` with its updates of every ``perm_soft`` multiplied by ``factor``."""
    return optax.chain(tx, optax.masked(optax.scale(factor), dd.optim.path_mask([r".*perm_soft"])))


def matched_layout(w, k: int, rounds: int = ASSIGN_ROUNDS):
    """``(perm[in], offsets[k])`` for ``W[out, in]``: ``k`` wrapped diagonals of ``W[:, perm]``
    and the permutation holding the most of ``|W|^2`` on them, by alternating maximisation."""
    a = np.square(np.asarray(w, np.float64))
    out_features, in_features = a.shape
    candidates = np.arange(geometry(in_features, out_features).num_candidates)
    rows, cols = (np.asarray(i) for i in diag_indices(candidates, in_features, out_features))
    perm = np.arange(in_features)
    offsets = None
    for _ in range(rounds):
        mass = a[:, perm][rows, cols].sum(axis=1)  # per candidate diagonal
        offsets = np.sort(np.argsort(-mass, kind="stable")[:k])
        kept_rows, kept_cols = (
            np.asarray(i).ravel() for i in diag_indices(offsets, in_features, out_features)
        )
        reads = np.zeros((in_features, out_features))  # reads[slot, o]: row o reads slot
        reads[kept_cols, kept_rows] = 1.0
        perm = linear_sum_assignment(reads @ a, maximize=True)[1]
    return perm.astype(np.int32), offsets.astype(np.int32)


def _train(config, data, suite, built, seed, steps, initial_variables=None):
    with tempfile.TemporaryDirectory(prefix="permutation_probe") as workdir:
        result = R.train_built(
            config,
            data,
            suite,
            built,
            seed,
            steps,
            pathlib.Path(workdir),
            checkpoints=False,
            initial_variables=initial_variables,
        )
    metrics = result.eval_metrics
    return result, float(metrics["perplexity" if "perplexity" in metrics else "accuracy"])


def probe_moves(config, data, suite, seeds, lr_scales) -> list[dict]:
    """Rows ``{"run", "seed", "metric", "moved"}`` of the learned permutation per ``lr_scales``."""
    m = config.models[suite]
    steps, example = R.steps_of(m, data), R.example_input(m, data)
    rows = []
    for factor in lr_scales:
        for seed in seeds:
            built = R.build(config, suite, "dynadiag_learned_perm", SPARSITY, seed, data, steps)
            built = built._replace(optimizer=scaled_permutation_updates(built.optimizer, factor))
            initial = R.initial_state(built, example, seed)
            start = R.start_permutations(initial.params, initial.collections.get("diagonals"))
            variables = T.variables_of(initial)
            result, metric = _train(config, data, suite, built, seed, steps, variables)
            moved = R.rows_moved(start, result.state.collections["diagonals"])
            rows.append(
                dict(run=f"learned, perm lr x{factor:g}", seed=seed, metric=metric, moved=moved)
            )
    return rows


def probe_assigned(config, data, suite, seeds, dense_steps: int) -> list[dict]:
    """Rows ``{"run", "seed", "metric", "moved"}``: static diagonals behind a random permutation
    and behind one matched to a dense model trained ``dense_steps`` steps."""
    m = config.models[suite]
    steps, example = R.steps_of(m, data), R.example_input(m, data)
    method = "static_diagonals_random_perm"
    rows = []
    for seed in seeds:
        built = R.build(config, suite, method, SPARSITY, seed, data, steps)
        _, metric = _train(config, data, suite, built, seed, steps)
        rows.append(dict(run="static diagonals, random permutation", seed=seed, metric=metric))
        dense = R.build(config, suite, "dense", 0.0, seed, data, steps)
        trained, _ = _train(config, data, suite, dense, seed, dense_steps)
        kernels = R.leaves_named(trained.state.params, "kernel")
        variables = T.variables_of(R.initial_state(built, example, seed))
        diagonals = traverse_util.flatten_dict(variables["diagonals"])
        for path in R.leaves_named(variables["diagonals"], "perm"):
            if path not in kernels:
                raise ValueError(f"the dense model has no kernel at {'/'.join(path)}")
            w = np.asarray(kernels[path]).T  # [out, in]
            k = diagonals[(*path, "offsets")].shape[-1]
            perm, offsets = matched_layout(w, k)
            diagonals[(*path, "perm")] = jnp.asarray(perm)
            diagonals[(*path, "offsets")] = jnp.asarray(
                offsets, diagonals[(*path, "offsets")].dtype
            )
        variables["diagonals"] = traverse_util.unflatten_dict(diagonals)
        _, metric = _train(config, data, suite, built, seed, steps, variables)
        run = f"static diagonals, layout matched to dense after {dense_steps} steps"
        rows.append(dict(run=run, seed=seed, metric=metric))
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="mlp", choices=results_config.SUITES)
    parser.add_argument("--probe", default="moves", choices=("moves", "assigned"))
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--lr-scales", default="1,10", help="moves: perm_soft's update factors")
    parser.add_argument("--dense-steps", type=int, default=0, help="assigned (0: the suite's)")
    parser.add_argument(
        "--relaxation", default="sinkhorn", choices=("sinkhorn", "blocks"), help="moves: of perm"
    )
    parser.add_argument("--data", default="auto", help="the suites' data.source (mnist5k: small)")
    parser.add_argument("--out", type=out_file, default=None)
    args = parser.parse_args(argv)
    seeds = seeds_of(parser, args.seeds)
    try:
        scales = [float(s) for s in args.lr_scales.split(",")]
    except ValueError:
        parser.error("--lr-scales is a comma-separated list of numbers")
    if not all(np.isfinite(s) and s >= 0 for s in scales):
        parser.error("need --lr-scales >= 0")
    if args.dense_steps < 0:
        parser.error("need --dense-steps >= 0")
    config = results_config.get_config(f"models={args.suite}")
    config.data.source = args.data
    config.models[args.suite].dynadiag.permutation_relaxation = args.relaxation
    data = prepare(parser, config)
    if args.probe == "moves":
        rows = probe_moves(config, data, args.suite, seeds, scales)
    else:
        steps = args.dense_steps or R.steps_of(config.models[args.suite], data)
        rows = probe_assigned(config, data, args.suite, seeds, steps)
    metric = "perplexity" if R.is_language_model(config.models[args.suite]) else "accuracy"
    print(f"{args.suite} at {SPARSITY:g}, {args.probe}: test {metric} over seeds {args.seeds}")
    for run in dict.fromkeys(r["run"] for r in rows):
        mine = [r for r in rows if r["run"] == run]
        values = np.array([r["metric"] for r in mine])
        spread = values.std(ddof=1) if len(values) > 1 else 0.0  # the sample std, as results.py
        line = f"  {run:<58} {values.mean():.4f} +- {spread:.4f}"
        if "moved" in mine[0]:
            moved = np.mean([list(r["moved"].values()) for r in mine], axis=0)
            line += "  rows moved per layer: " + " ".join(f"{x:.2f}" for x in moved)
        print(line)
    per_layer = [
        dict(run=r["run"], seed=r["seed"], metric=r["metric"], layer=layer, rows_moved=moved)
        for r in rows
        for layer, moved in r.get("moved", {"": ""}).items()
    ]
    fields = ("run", "seed", "metric", "layer", "rows_moved")
    write_csv(per_layer, fields, "permutation_probe", args.out)


if __name__ == "__main__":
    main()
