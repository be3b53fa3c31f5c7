"""LoRA-FA on a frozen DynaDiag run: low-rank adapters fine-tuned on top of the frozen diagonals.

Reads a frozen DynaDiag run's Orbax checkpoint (``--config`` ``checkpoint``: its workdir, e.g. a
``dynadiag`` run of ``train/results.py``), adds a LoRA-FA adapter (``dd.nn.lora_fa``: ``A[r, in]``
random and frozen, ``B[out, r]`` zero) to every layer ``lora.layers`` matches, trains ``B`` (and
the diagonal values with ``lora.train_values``) for ``train.finetune_fraction`` of the suite's
from-scratch steps at ``optimizer.learning_rate``, and writes the adapted checkpoint
(``--workdir/checkpoints``) and a before/after table with parameter counts (printed, and
``--workdir/lora_fa.json``). The diagonal layers keep running through ``dd.diag_matmul``; the
adapters cannot be merged into them, so their weights are counted separately. ``lora.rank=0``
with ``lora.train_values`` is the control: the same fine-tune of the diagonal values, no adapter.

  python train/lora_fa.py --workdir=runs/lora_mlp_r8 \\
      --config=train/configs/lora_fa.py:checkpoint=runs/results/mlp/<dynadiag run>,rank=8
  python train/lora_fa.py --workdir=runs/lora_mlp_values \
      --config=train/configs/lora_fa.py:checkpoint=<dynadiag run>,rank=0,train_values

A checkpoint of another model, size or sparsity, or one still in the search phase, is refused.
"""

from __future__ import annotations

import functools
import json
import pathlib
import sys

if __package__ in (None, ""):  # run as a file: make `train` importable from the repository root
    # Appended: the installed dynadiag_jax (with the compiled kernels) must win over the checkout.
    sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags
from flax import traverse_util

import dynadiag_jax as dd
from dynadiag_jax import data as D
from dynadiag_jax import training as T
from train import baselines, cli, common
from train.configs import lora_fa as default_config

FLAGS = flags.FLAGS

ADAPTER_LEAVES = ("lora_a", "lora_b")


def trained_patterns(lora_cfg) -> list[str]:
    """The params the fine-tune trains: every ``B``, and the diagonal values if asked."""
    return [r".*/lora_b"] + ([r".*/values"] if bool(lora_cfg.train_values) else [])


def with_adapters(template, frozen) -> dict:
    """``template`` (the adapted model's init) with every variable but the adapters' taken from
    ``frozen``; raises naming the variables where the two models differ."""
    have = traverse_util.flatten_dict(frozen, sep="/")
    want = traverse_util.flatten_dict(template, sep="/")
    problems = [
        f"{key}: {np.shape(have[key]) if key in have else 'absent'} in the checkpoint, "
        f"{np.shape(want[key]) if key in want else 'absent'} in the model"
        for key in sorted(set(have) | set(want))
        if key.split("/")[-1] not in ADAPTER_LEAVES
        and (key not in have or key not in want or np.shape(have[key]) != np.shape(want[key]))
    ]
    if problems:
        raise common.ConfigError(
            "the checkpoint does not fit the frozen model of this config (another model, "
            "sparsity or block size?): " + "; ".join(problems[:6]) + ("; ..." * (len(problems) > 6))
        )
    merged = {k: have.get(k, v) for k, v in want.items()}
    return traverse_util.unflatten_dict(merged, sep="/")


@common.reports_config_errors
def prepare(config):
    """Check the config, load the data and the frozen variables, build the adapted model: every
    input problem (a checkpoint of another model included) surfaces here, before training.

    Returns ``(data, frozen model, frozen variables, adapted variables, baselines.Method, steps,
    example)``.
    """
    common.check_config(config, default_config.get_config())
    common.check_train_section(config.train)
    if not config.checkpoint:
        raise common.ConfigError("checkpoint= (the frozen DynaDiag run's workdir) is required")
    fraction = float(config.train.finetune_fraction)
    if not 0.0 < fraction <= 1.0:
        raise common.ConfigError(f"train.finetune_fraction must be in (0, 1], got {fraction}")
    if not common.sparsity_of(config.dynadiag):
        raise common.ConfigError("dynadiag.sparsity must be in (0, 1): the checkpoint's")
    data = D.load_small_images(config.data.source, data_dir=config.data.data_dir or None)
    batch, mesh = int(config.train.batch_size), T.data_mesh()
    T.check_batch_size(batch, mesh)
    T.check_batch_size(int(config.train.eval_batch_size), mesh, name="train.eval_batch_size")
    steps = max(1, round(fraction * int(config.train.epochs) * (len(data.train["label"]) // batch)))
    # The diagonal layers in their frozen form, so that init has the checkpoint's structure.
    layer = functools.partial(common.sparse_layer(config.dynadiag), init_phase="frozen")
    base = baselines.model_with_layer(
        config.model, config.dynadiag, layer, num_classes=data.num_classes
    )
    example = jax.ShapeDtypeStruct((batch, *data.train["image"].shape[1:]), jnp.float32)
    common.check_layer_patterns(
        base, example, config.dynadiag, block_size=int(config.dynadiag.block_size)
    )
    lora = config.lora
    if int(lora.rank) == 0 and not bool(lora.train_values):
        raise common.ConfigError(
            "lora.rank=0 (no adapters) trains nothing: it is the control run that fine-tunes the "
            "diagonal values alone, with lora.train_values=True"
        )
    model = (
        dd.nn.lora_fa(base, tuple(lora.layers), rank=int(lora.rank), alpha=float(lora.alpha))
        if int(lora.rank)
        else base
    )
    frozen = common.restore_run_variables(config.checkpoint, int(config.step))
    if T.is_searching(frozen["params"]):
        raise common.ConfigError(
            f"checkpoint {config.checkpoint} holds a DynaDiag model still in the search phase "
            f"(alpha): give a frozen one (the end of a dynadiag run, or train/sparsify.py's)"
        )
    template = model.init(jax.random.key(int(config.seed)), jnp.zeros(example.shape))
    template = {k: v for k, v in template.items() if k != "intermediates"}
    initial = with_adapters(template, frozen)
    tx, lr = common.build_optimizer(config.optimizer, config.dynadiag, steps, 0)
    method = baselines.Method(
        "lora_fa", model, T.train_only(tx, trained_patterns(lora)), lr, None, None, ("dynadiag",)
    )
    return data, base, frozen, initial, method, steps, example


def counts(variables, trained: list[str]) -> dict[str, int]:
    """Weights of ``variables`` by role: diagonal values, adapters (``A`` + ``B``), the rest, and
    the ones the fine-tune trains."""
    params = variables["params"]
    flat = traverse_util.flatten_dict(params, sep="/")
    sizes = {k: int(np.prod(np.shape(v))) for k, v in flat.items()}
    b = sum(n for k, n in sizes.items() if k.endswith("/lora_b"))
    a = sum(int(np.prod(np.shape(v))) for v in jax.tree.leaves(variables.get("lora_frozen", {})))
    by_role = T.parameter_counts(params)
    hits = traverse_util.flatten_dict(dd.optim.path_mask(trained)(params), sep="/")
    return {
        "diagonal": by_role.diagonal,
        "adapter": a + b,
        "other": by_role.other - b,
        "trained": sum(sizes[k] for k, hit in hits.items() if hit),
    }


def run(config, workdir, *, progress: bool = True) -> list[dict]:
    """The frozen checkpoint's accuracy, then LoRA-FA's after the fine-tune; returns the table's
    rows (``model``, ``accuracy``, ``steps``, and the weight counts of :func:`counts`)."""
    data, base, frozen, initial, method, steps, example = prepare(config)
    workdir = pathlib.Path(workdir)
    task = T.Classification(data.num_classes, float(config.optimizer.label_smoothing))
    eval_batch = int(config.train.eval_batch_size)
    result = common.train_from_config(
        config,
        method=method,
        task=task,
        train_data=D.ArrayBatches(data.train, int(config.train.batch_size), seed=int(config.seed)),
        eval_data=D.EvalBatches(data.test, eval_batch),
        num_steps=steps,
        example_input=example,
        workdir=workdir,
        progress=progress,
        initial_variables=initial,
    )
    s, lora = round(100 * float(config.dynadiag.sparsity)), config.lora
    trained = trained_patterns(lora)
    what = "B + values" if bool(lora.train_values) else "B"
    name = f"+ LoRA-FA r={int(lora.rank)} ({what})" if int(lora.rank) else "+ values, no adapter"
    rows = [
        {
            "model": f"dynadiag_s{s} frozen",
            "accuracy": common.eval_accuracy(base, frozen, data.test, eval_batch, task),
            "steps": 0,
            **counts(frozen, []),
        },
        {
            "model": name,
            "accuracy": float(result.eval_metrics["accuracy"]),
            "steps": steps,
            **counts(T.variables_of(result.state), trained),
        },
    ]
    print(
        f"\n{'model':<28} {'accuracy':>8} {'steps':>6} {'diagonal':>9} {'adapter':>8} "
        f"{'other':>7} {'trained':>8}"
    )
    for r in rows:
        print(
            f"{r['model']:<28} {r['accuracy']:>8.4f} {r['steps']:>6} {r['diagonal']:>9} "
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
