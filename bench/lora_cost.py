"""What LoRA-FA adapters cost a frozen DynaDiag model: weights, inference time and fine-tune step.

Builds a suite of ``train/configs/results.py`` (its model and data) with its diagonal layers in
the frozen form (train/finetuning.py's ``frozen_model``; random weights: the time does not depend
on them), adds LoRA-FA adapters at each ``--ranks`` on the suite's diagonal layers, and times,
interleaved (median of ``--repeats``), the jitted inference (``model.apply(train=False)``) at each
of the suite's inference batch sizes, and the jitted fine-tune step on a training batch with the
suite's optimizer: ``B`` alone (only ``B`` differentiated), ``B`` + values, and the values alone
without adapters. Prints a table with the weight counts (diagonal values, adapter ``A`` + ``B``,
trained) and each time's ratio to the frozen model's (inference) or the values-only fine-tune
(step).

Example::

    python bench/lora_cost.py --suite gpt --ranks 4,8,16
"""

from __future__ import annotations

import argparse
import pathlib
import sys

# Appended: `train` from the checkout; the installed dynadiag_jax (with its kernels) still wins.
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_collections  # noqa: E402
from diag_matmul import time_interleaved  # noqa: E402 - bench/, beside this
from sparse_lr_probe import prepare  # noqa: E402 - bench/, beside this
from tqdm import tqdm  # noqa: E402

from dynadiag_jax import training as T  # noqa: E402
from train import common, finetuning  # noqa: E402
from train import results_runs as R  # noqa: E402
from train.configs import results as results_config  # noqa: E402
from train.configs.common import lora_section  # noqa: E402


def _lora(m, rank: int, train_values: bool):
    section = lora_section(steps=None)  # layers (): the diagonal layers
    section.update(rank=rank, train_values=train_values)
    return ml_collections.ConfigDict(section)


def measure(config, data, suite: str, sparsity: float, ranks, repeats: int) -> list[dict]:
    """Rows ``{"what", "rank", "batch", "ms", "diagonal", "adapter", "trained"}``: inference per
    (rank, batch) and fine-tune step per (rank, what is trained) on ``data``
    (``R.prepare(config)``); rank 0: no adapter."""
    m = config.models[suite]
    dyn = R.method_dynadiag(m, "dynadiag")
    with dyn.unlocked():
        dyn.sparsity = float(sparsity)
    base = finetuning.frozen_model(m.model, dyn, **R.model_kwargs(m, data))
    task, batch = R.task_of(m, data), R.sample_batch(m, data, int(m.batch_size))
    example = R.example_input(m, data)
    infer, steps = {}, {}
    for rank in (0, *ranks):
        for train_values in (False, True) if rank else (True,):
            lora = _lora(m, rank, train_values)
            phase = finetuning.lora_phase(
                lora, base, m.optimizer, dyn, example, start_step=0, steps=100
            )
            state = jax.jit(
                lambda p=phase: T.create_train_state(
                    p.model, p.optimizer, example, seed=0, trained=p.trained
                )
            )()
            counts = finetuning.counts(T.variables_of(state), list(phase.trained))
            step = jax.jit(
                T.make_train_step(phase.model, phase.optimizer, task, trained=phase.trained)
            )
            what = "B + values" if train_values and rank else "values" if train_values else "B"
            steps[(rank, what)] = ((step, (state, batch)), counts)
            if train_values and rank:
                continue
            apply = jax.jit(lambda v, x, model=phase.model: model.apply(v, x, train=False))
            for n in m.inference_batches:
                x = R.model_inputs(m, R.sample_batch(m, data, int(n)))
                infer[(rank, int(n))] = ((apply, (T.variables_of(state), x)), counts)
    calls = {("infer", *k): fc for k, (fc, _) in infer.items()}
    calls.update({("step", *k): fc for k, (fc, _) in steps.items()})
    with tqdm(total=repeats * len(calls), unit="call", leave=False) as progress:
        times = time_interleaved(calls, repeats, progress)
    rows = []
    for (rank, n), (_, counts) in infer.items():
        rows.append(
            dict(what="inference", rank=rank, batch=n, ms=1e3 * times[("infer", rank, n)], **counts)
        )
    for (rank, what), (_, counts) in steps.items():
        rows.append(
            dict(
                what=f"step, {what}",
                rank=rank,
                batch=int(m.batch_size),
                ms=1e3 * times[("step", rank, what)],
                **counts,
            )
        )
    return rows


def table(rows) -> list[str]:
    """The printed table; ``vs``: the time over the frozen model's inference at the same batch,
    or over the values-only fine-tune step."""
    ref = {
        (r["what"], r["batch"]): r["ms"]
        for r in rows
        if r["rank"] == 0 and r["what"] in ("inference", "step, values")
    }
    lines = [
        f"{'what':<18} {'rank':>4} {'batch':>5} {'ms':>9} {'vs':>6} "
        f"{'diagonal':>9} {'adapter':>8} {'trained':>8}"
    ]
    for r in rows:
        base = ref[("inference" if r["what"] == "inference" else "step, values", r["batch"])]
        lines.append(
            f"{r['what']:<18} {r['rank']:>4} {r['batch']:>5} {r['ms']:>9.3f} "
            f"{r['ms'] / base:>5.2f}x {r['diagonal']:>9} {r['adapter']:>8} {r['trained']:>8}"
        )
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="gpt", choices=results_config.SUITES)
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--ranks", default="4,8,16", help="comma-separated adapter ranks")
    parser.add_argument("--repeats", type=int, default=51)
    parser.add_argument("--data", default="auto", help="the suites' data.source (mnist5k: small)")
    args = parser.parse_args(argv)
    try:
        ranks = [int(r) for r in args.ranks.split(",")]
    except ValueError:
        parser.error(f"--ranks must be comma-separated ints, got {args.ranks!r}")
    if not 0.0 < args.sparsity < 1.0 or args.repeats < 1 or min(ranks) < 1:
        parser.error("need 0 < --sparsity < 1, --repeats >= 1 and every rank >= 1")
    config = results_config.get_config(f"models={args.suite}")
    config.data.source = args.data
    try:
        rows = measure(
            config, prepare(parser, config), args.suite, args.sparsity, ranks, args.repeats
        )
    except common.ConfigError as e:  # a rank above a layer's width
        parser.error(f"--ranks: {e}")
    print(f"{args.suite} at {args.sparsity:g}, {jax.devices()[0].platform}, {jnp.float32.dtype}")
    print("\n".join(table(rows)))


if __name__ == "__main__":
    main()
