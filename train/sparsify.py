"""DynaDiag from a dense run: the dense checkpoint's kernels become diagonal layers.

Reads a dense run's Orbax checkpoint (``--config`` ``checkpoint``: its workdir, e.g. a dense run of
``train/results.py``), starts the suite's model with DiagonalDense layers from it
(``dd.from_dense``: values from each diagonal's weights, alpha from its energy), evaluates the
one-shot model (the K highest-energy diagonals of every layer, frozen at once) and the same
diagonals refitted to the dense layers' outputs (``dd.refit``, on ``refit_examples`` training
images, or token windows for ``suite=gpt``), then fine-tunes the refitted model for
``train.finetune_fraction`` of the from-scratch steps (training of the frozen diagonals, towards
the labels and the dense model's outputs: ``distill``; ``dynadiag.search_fraction`` > 0 searches
first), and writes the frozen DynaDiag checkpoint (``--workdir/checkpoints``) and a before/after
table of test accuracy, or validation perplexity for the GPT (printed, and
``--workdir/sparsify.json``).

  python train/sparsify.py --workdir=runs/sparsify_mlp \\
      --config=train/configs/sparsify.py:checkpoint=runs/results/mlp/<dense run>
  python train/sparsify.py --workdir=runs/sparsify_mlp_oneshot \\
      --config=train/configs/sparsify.py:checkpoint=<dense run>,finetune_fraction=0

A checkpoint of another model, size or method is refused with the layer and shapes that differ;
a ``--workdir`` that holds the checkpoint of another recipe (another sparsity, say) is refused with
the settings that differ, one-shot (``finetune_fraction=0``) or fine-tuned.
"""

from __future__ import annotations

import functools
import json
import pathlib
import sys

if __package__ in (None, ""):  # run as a file: make `train` importable from the repository root
    # Appended: the installed dynadiag_jax (with the compiled kernels) must win over the checkout.
    sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

import jax.numpy as jnp
from absl import app, flags

import dynadiag_jax as dd
from dynadiag_jax import training as T
from dynadiag_jax.training.checkpoint import UnreadableCheckpoint
from train import baselines, cli, common, finetuning
from train.configs import sparsify as default_config
from train.configs.common import unstructured_defaults

FLAGS = flags.FLAGS


@common.reports_config_errors
def prepare(config, workdir=None):
    """Check the config, load the data and the dense variables, build both models: every input
    problem (a checkpoint of another model or method, ``workdir`` the source's own) surfaces
    here, before training. ``config.checkpoint`` and ``config.step`` become the resolved run
    directory and step, so the recipe names the model it started from.

    Returns ``(data, dense model, dense variables, search-phase variables from them, the same
    refitted by ``dd.refit`` (None without ``refit_examples``), baselines.Method, fine-tune steps,
    example)``.
    """
    if "suite" not in config:  # another script's config: its keys are not this one's
        raise common.ConfigError("the config has no 'suite' entry: give train/configs/sparsify.py")
    common.check_config(config, default_config.get_config(f"suite={config.suite}"))
    common.check_train_section(config.train)
    if not config.checkpoint:
        raise common.ConfigError("checkpoint= (the dense run's workdir) is required")
    fraction = float(config.train.finetune_fraction)
    if not 0.0 <= fraction <= 1.0:
        raise common.ConfigError(f"train.finetune_fraction must be in [0, 1], got {fraction}")
    examples, ridge = int(config.refit_examples), float(config.refit_ridge)
    if examples < 0 or not ridge >= 0.0:
        raise common.ConfigError(
            f"refit_examples must be >= 0 and refit_ridge >= 0, got {examples} and {ridge}"
        )
    if not 0.0 <= float(config.distill) <= 1.0 or not float(config.distill_temperature) > 0.0:
        raise common.ConfigError(
            f"distill must be in [0, 1] and distill_temperature > 0, got {config.distill} and "
            f"{config.distill_temperature}"
        )
    sparsity = common.sparsity_of(config.dynadiag)
    if not sparsity:
        raise common.ConfigError("dynadiag.sparsity must be in (0, 1): the model to make")
    mesh = T.data_mesh()
    T.check_batch_size(int(config.train.batch_size), mesh)
    T.check_batch_size(int(config.train.eval_batch_size), mesh, name="train.eval_batch_size")
    data = finetuning.suite_data(config)
    # 0: the one-shot model alone; any fraction above trains at least one step
    steps = max(1, round(fraction * data.scratch_steps)) if fraction else 0
    built = baselines.build(
        "dynadiag",
        model_cfg=config.model,
        dynadiag_cfg=config.dynadiag,
        unstructured_cfg=unstructured_defaults(),
        optimizer_cfg=config.optimizer,
        sparsity=sparsity,
        num_steps=max(1, steps),
        warmup_steps=int(config.optimizer.warmup_steps) if steps else 0,
        seed=int(config.seed),
        **data.model_kwargs,
    )
    example = data.example
    common.check_layer_patterns(
        built.model, example, config.dynadiag, block_size=int(config.dynadiag.block_size)
    )
    dense_model = common.build_model(
        config.model, baselines.with_sparsity(config.dynadiag, 0.0), **data.model_kwargs
    )
    source = common.source_run(config, workdir=workdir)
    method = source.recipe.get("method", "dense")
    if method != "dense":
        raise common.ConfigError(
            f"checkpoint {source.directory} is a {method} run; sparsify.py starts from a dense "
            "one (method dense)"
        )
    if workdir is not None:  # before the refit and the evaluations, not after them
        common.check_workdir(workdir, {**common.recipe(config, built), "seed": int(config.seed)})
    dense = source.variables
    template = built.model.init(
        T.seed_key(int(config.seed)), jnp.zeros(example.shape, example.dtype)
    )
    template = {k: v for k, v in template.items() if k != "intermediates"}
    # a checkpoint of another model fails here
    search = dd.from_dense(dense, template, keep_norm=bool(config.keep_norm))
    fitted = None
    if examples:
        calibration = data.calibration(examples)
        fitted = dd.refit(built.model, search, dense_model, dense, calibration, ridge=ridge)
    return data, dense_model, dense, search, fitted, built, steps, example


def save_one_shot(config, built, variables, example, workdir: pathlib.Path) -> None:
    """Write the one-shot model (``variables`` frozen, with a fresh optimizer state) as step 0 of
    ``workdir/checkpoints``, unless the same recipe's is there already.

    Raises:
      common.ConfigError: ``workdir`` cannot hold checkpoints, or it holds a checkpoint of another
        recipe (the message lists the settings that differ) or one that cannot be read.
    """
    run_info = json.loads(json.dumps(common.recipe(config, built)))  # as the checkpoint keeps it
    try:
        ckpt = T.Checkpointer(workdir / "checkpoints", async_save=False)
        try:
            latest = ckpt.latest_step()
            if latest is not None:
                try:
                    ckpt.check_run(latest, run_info)
                    ckpt.restore_variables(latest)
                    return  # the same recipe computes the same model
                except UnreadableCheckpoint as e:  # written again, as the training loop does
                    kept = ckpt.set_aside(latest)
                    print(
                        f"warning: checkpoint step {latest} cannot be read ({e.reason}); "
                        f"written again, the unreadable one kept as {kept}",
                        file=sys.stderr,
                    )
            state = T.create_train_state(
                built.model, built.optimizer, example, seed=int(config.seed), variables=variables
            )
            ckpt.save(T.freeze_state(state), meta={"run": run_info, "frozen": True, "interval": {}})
        finally:
            ckpt.close()
    except T.CheckpointMismatch as e:
        raise common.ConfigError(f"{e} (--workdir)") from None


def run(config, workdir, *, progress: bool = True) -> list[tuple[str, float, int]]:
    """One-shot and fine-tuned DynaDiag from the dense checkpoint; returns the table's rows
    ``(name, test accuracy or validation perplexity, steps trained after the dense run)``."""
    data, dense_model, dense, search, fitted, built, steps, example = prepare(config, workdir)
    workdir = pathlib.Path(workdir)
    if not steps:  # the one-shot model is the frozen checkpoint: written (or refused) first
        save_one_shot(config, built, search if fitted is None else fitted, example, workdir)
    task = data.task

    def metric(model, variables):
        return float(finetuning.evaluate(model, variables, data.eval, task)[data.metric])

    if float(config.distill):
        teacher = functools.partial(dense_model.apply, dense)
        tuning = T.Distillation(
            task, teacher, float(config.distill), float(config.distill_temperature)
        )
    else:
        tuning = task
    one_shot = dd.freeze_tree(search)
    s = round(100 * float(config.dynadiag.sparsity))
    rows = [
        ("dense (checkpoint)", metric(dense_model, dense), 0),
        (f"dynadiag_s{s} one-shot", metric(built.model, one_shot), 0),
    ]
    if fitted is not None:
        rows.append((f"dynadiag_s{s} refit", metric(built.model, dd.freeze_tree(fitted)), 0))
        search = fitted
    if steps:
        result = common.train_from_config(
            config,
            method=built,
            task=tuning,
            train_data=data.train,
            eval_data=data.eval,
            num_steps=steps,
            example_input=example,
            workdir=workdir,
            progress=progress,
            initial_variables=search,
        )
        rows.append((f"dynadiag_s{s} fine-tuned", result.eval_metrics[data.metric], steps))
    heading = "test accuracy" if data.metric == "accuracy" else "perplexity"
    print(f"\n{'model':<30} {heading:>13}   steps")
    for name, value, n in rows:
        print(f"{name:<30} {value:>13.4f} {n:>7}")
    table = [{"model": name, data.metric: value, "steps": n} for name, value, n in rows]
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "sparsify.json").write_text(json.dumps(table, indent=1) + "\n")
    return rows


def main(argv):
    del argv
    common.run_script(lambda: run(FLAGS.config, FLAGS.workdir, progress=FLAGS.progress))


if __name__ == "__main__":  # flags exist only when run as a script (tests import this module)
    cli.define_config_flag(str(pathlib.Path(default_config.__file__)))
    flags.DEFINE_string("workdir", "runs/sparsify", "the frozen checkpoint and the table go here")
    flags.DEFINE_bool("progress", True, "show progress bars")
    app.run(main, flags_parser=cli.parse_flags)
