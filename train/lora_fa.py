"""LoRA-FA on a frozen DynaDiag run: low-rank adapters fine-tuned on top of the frozen diagonals.

Reads a frozen DynaDiag run's Orbax checkpoint (``--config`` ``checkpoint``: its workdir, e.g. a
``dynadiag`` run of ``train/results.py``; ``suite``: mlp, mixer, vit or gpt), and trains the
LoRA-FA phase of the ``lora`` section on it (train/finetuning.py, the same phase a training run
adds with ``lora.steps``): a LoRA-FA adapter (``dd.nn.lora_fa``: ``A[r, in]`` random and frozen,
``B[out, r]`` zero) on every layer ``lora.layers`` matches, ``B`` (and the diagonal values with
``lora.train_values``) trained for ``train.finetune_fraction`` of the suite's from-scratch steps at
``lora.learning_rate``; only those params are differentiated. Writes the adapted checkpoint
(``--workdir/checkpoints``) and a before/after table (test accuracy, or validation perplexity for
gpt) with parameter counts (printed, and ``--workdir/lora_fa.json``). The diagonal layers keep
running through ``dd.diag_matmul``; the adapters cannot be merged into them, so their weights are
counted separately. ``lora.rank=0`` with ``lora.train_values`` is the control: the same fine-tune
of the diagonal values, no adapter.

  python train/lora_fa.py --workdir=runs/lora_mlp_r8 \\
      --config=train/configs/lora_fa.py:checkpoint=runs/results/mlp/<dynadiag run>,rank=8
  python train/lora_fa.py --workdir=runs/lora_gpt_values \\
      --config=train/configs/lora_fa.py:suite=gpt,checkpoint=<dynadiag run>,rank=0,train_values

A checkpoint of another model, size or sparsity, or one still in the search phase, is refused.
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any, NamedTuple

if __package__ in (None, ""):  # run as a file: make `train` importable from the repository root
    # Appended: the installed dynadiag_jax (with the compiled kernels) must win over the checkout.
    sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import traverse_util

from dynadiag_jax import training as T
from train import baselines, cli, common, finetuning
from train.configs import lora_fa as default_config

FLAGS = flags.FLAGS


def check_fits(template, frozen) -> None:
    """Raise :class:`common.ConfigError` naming the variables where ``frozen`` (the checkpoint's)
    and ``template`` (the frozen model's init) differ."""
    have = traverse_util.flatten_dict(frozen, sep="/")
    want = traverse_util.flatten_dict(template, sep="/")
    problems = [
        f"{key}: {np.shape(have[key]) if key in have else 'absent'} in the checkpoint, "
        f"{np.shape(want[key]) if key in want else 'absent'} in the model"
        for key in sorted(set(have) | set(want))
        if key not in have or key not in want or np.shape(have[key]) != np.shape(want[key])
    ]
    if problems:
        raise common.ConfigError(
            "the checkpoint does not fit the frozen model of this config (another model, "
            "sparsity or block size?): " + "; ".join(problems[:6]) + ("; ..." * (len(problems) > 6))
        )


class Prepared(NamedTuple):
    """What :func:`run` trains: the frozen model and its checkpoint's variables, the phase, the
    data, the task and the name of the metric the table reports."""

    base: Any
    frozen: dict
    phase: T.Finetune
    steps: int
    train_data: Any
    eval_data: Any
    example: Any
    task: Any
    metric: str


@common.reports_config_errors
def prepare(config, workdir=None) -> Prepared:
    """Check the config, load the data and the frozen variables, build the phase: every input
    problem (a checkpoint of another model or method, ``workdir`` the source's own) surfaces
    here, before training. ``config.checkpoint`` and ``config.step`` become the resolved run
    directory and step, so the recipe names the model it started from."""
    if "suite" not in config:  # another script's config: its keys are not this one's
        raise common.ConfigError("the config has no 'suite' entry: give train/configs/lora_fa.py")
    default = default_config.get_config(f"suite={config.suite}")
    common.check_config(config, default)
    common.check_train_section(config.train)
    for key in ("learning_rate", "warmup_steps"):  # the phase's: lora.learning_rate, no warm-up
        if config.optimizer[key] != default.optimizer[key]:
            raise common.ConfigError(
                f"optimizer.{key} is not read: the phase trains at lora.learning_rate without "
                "a warm-up (set lora.learning_rate instead)"
            )
    if not config.checkpoint:
        raise common.ConfigError("checkpoint= (the frozen DynaDiag run's workdir) is required")
    fraction = float(config.train.finetune_fraction)
    if not 0.0 < fraction <= 1.0:
        raise common.ConfigError(f"train.finetune_fraction must be in (0, 1], got {fraction}")
    if not common.sparsity_of(config.dynadiag):
        raise common.ConfigError("dynadiag.sparsity must be in (0, 1): the checkpoint's")
    finetuning.check_lora(config.lora)
    common.check_lora_learning_rate(config.lora)
    if config.suite == "gpt":
        common.check_eval_limit(config.data, "eval_windows", "every window")
    mesh = T.data_mesh()
    T.check_batch_size(int(config.train.batch_size), mesh)
    T.check_batch_size(int(config.train.eval_batch_size), mesh, name="train.eval_batch_size")
    data = finetuning.suite_data(config)
    example = data.example
    steps = max(1, round(fraction * data.scratch_steps))
    base = finetuning.frozen_model(config.model, config.dynadiag, **data.model_kwargs)
    common.check_layer_patterns(
        base, example, config.dynadiag, block_size=int(config.dynadiag.block_size)
    )
    source = common.source_run(config, workdir=workdir)
    method = source.recipe.get("method", "dynadiag")
    if method in ("dense", *baselines.UNSTRUCTURED):
        raise common.ConfigError(
            f"checkpoint {source.directory} is a {method} run; lora_fa.py adapts a frozen "
            "DynaDiag one (the end of a dynadiag run, or train/sparsify.py's)"
        )
    frozen = source.variables
    if T.is_searching(frozen["params"]):
        raise common.ConfigError(
            f"checkpoint {config.checkpoint} holds a DynaDiag model still in the search phase "
            f"(alpha): give a frozen one (the end of a dynadiag run, or train/sparsify.py's)"
        )
    template = base.init(jax.random.key(0), jnp.zeros(example.shape, example.dtype), train=False)
    check_fits({k: v for k, v in template.items() if k != "intermediates"}, frozen)
    phase = finetuning.lora_phase(
        config.lora, base, config.optimizer, config.dynadiag, example, start_step=0, steps=steps
    )
    return Prepared(
        base, frozen, phase, steps, data.train, data.eval, example, data.task, data.metric
    )


def run(config, workdir, *, progress: bool = True) -> list[dict]:
    """The frozen checkpoint's metric, then the fine-tuned model's; returns the table's rows
    (``model``, the metric, ``steps``, and the weight counts of :func:`finetuning.counts`)."""
    p = prepare(config, workdir)
    workdir = pathlib.Path(workdir)
    # The run's own optimizer is never stepped: the phase starts at step 0.
    method = baselines.Method(
        "lora_fa", p.base, p.phase.optimizer, p.phase.learning_rate, None, None, ("dynadiag",)
    )
    result = common.train_from_config(
        config,
        method=method,
        task=p.task,
        train_data=p.train_data,
        eval_data=p.eval_data,
        num_steps=p.steps,
        example_input=p.example,
        workdir=workdir,
        progress=progress,
        initial_variables=p.frozen,
        finetune=p.phase,
    )
    s = round(100 * float(config.dynadiag.sparsity))
    rows = [
        {
            "model": f"dynadiag_s{s} frozen",
            p.metric: float(finetuning.evaluate(p.base, p.frozen, p.eval_data, p.task)[p.metric]),
            "steps": 0,
            **finetuning.counts(p.frozen, []),
        },
        {
            "model": finetuning.row_name(config.lora),
            p.metric: float(result.eval_metrics[p.metric]),
            "steps": p.steps,
            **finetuning.counts(T.variables_of(result.state), list(p.phase.trained)),
        },
    ]
    print(
        f"\n{'model':<28} {p.metric:>10} {'steps':>6} {'diagonal':>9} {'adapter':>8} "
        f"{'other':>7} {'trained':>8}"
    )
    for r in rows:
        print(
            f"{r['model']:<28} {r[p.metric]:>10.4f} {r['steps']:>6} {r['diagonal']:>9} "
            f"{r['adapter']:>8} {r['other']:>7} {r['trained']:>8}"
        )
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "lora_fa.json").write_text(json.dumps(rows, indent=1) + "\n")
    return rows


def main(argv):
    del argv
    common.run_script(lambda: run(FLAGS.config, FLAGS.workdir, progress=FLAGS.progress))


if __name__ == "__main__":  # flags exist only when run as a script (tests import this module)
    cli.define_config_flag(str(pathlib.Path(default_config.__file__)))
    flags.DEFINE_string("workdir", "runs/lora_fa", "the adapted checkpoint and the table go here")
    flags.DEFINE_bool("progress", True, "show progress bars")
    app.run(main, flags_parser=cli.parse_flags)
