"""ViT on ImageNet-1k: tfds ``data_source("imagenet2012")`` + grain, the DeiT recipe; DynaDiag or a
baseline (``method=``: dense, static_diagonals, static_unstructured, rigl, set, mest) on the same
layers.

  python train/imagenet.py --workdir=runs/vit_b16_s90 \\
      --config=train/configs/vit_imagenet.py:variant=B/16,sparsity=0.9 \\
      --config.data.data_dir=/data/tfds

Uses every local device (data parallel); on several hosts, start one process per host with
``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and ``JAX_PROCESS_ID`` set. Re-running the same
command resumes from the newest checkpoint in ``--workdir``. docs/training.md explains how to
prepare the data. Without it, ``--config.data.fake_examples=N`` (set by the smoke run
``--config=train/configs/vit_imagenet.py:runlocal``) trains on N random images per split: the
command, the pipeline and the step run as on ImageNet, and nothing is learned.
"""

from __future__ import annotations

import pathlib
import sys

if __package__ in (None, ""):  # run as a file: make `train` importable from the repository root
    # Appended: the installed dynadiag_jax (with the compiled kernels) must win over the checkout.
    sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
from absl import app, flags

from dynadiag_jax import data as D
from dynadiag_jax import training as T
from train import baselines, cli, common
from train.configs import vit_imagenet

FLAGS = flags.FLAGS
NUM_CLASSES = 1000


@common.reports_config_errors
def prepare(config):
    """Check the config, the data directory and the batch sizes; build the model and the data,
    and read and transform one example of each split.

    Returns ``(method, train_data, eval_data, num_steps, example_input)``: ``method`` is the
    :class:`train.baselines.Method` that ``config.method`` names.

    Raises:
      common.ConfigError: for any of these problems (nothing has been compiled yet).
    """
    common.check_config(config, vit_imagenet.get_config())
    common.check_train_section(config.train)
    _check_sizes(config)
    mesh = T.data_mesh()
    T.check_batch_size(int(config.train.batch_size), mesh, name="train.batch_size")
    T.check_batch_size(int(config.train.eval_batch_size), mesh, name="train.eval_batch_size")
    train_source, eval_source = _sources(config.data)
    batch, size = int(config.train.batch_size), int(config.data.image_size)
    common.check_batch_fits(batch, len(train_source), _split_name(config.data, "train_split"))
    steps_per_epoch = max(1, len(train_source) // batch)
    num_steps = int(config.train.num_steps) or int(config.train.epochs) * steps_per_epoch
    example = jax.ShapeDtypeStruct((batch, size, size, 3), jnp.float32)
    warmup = int(config.optimizer.warmup_epochs) * steps_per_epoch
    method = baselines.from_config(
        config, num_steps=num_steps, warmup_steps=warmup, num_classes=NUM_CLASSES
    )
    common.check_layer_patterns(
        method.model,
        example,
        config.dynadiag,
        block_size=baselines.block_size(method, config.dynadiag),
    )
    ra, threads, prefetch = (
        config.data.randaugment,
        int(config.data.num_threads),
        int(config.data.prefetch),
    )
    for section, prefix, key, bounds in (
        # RandAugment clips each draw to [0, 10]: a mean above 10 trains as 10
        (ra, "data.randaugment", "magnitude", ("in [0, 10]", lambda v: 0 <= v <= 10)),
        (ra, "data.randaugment", "magnitude_std", common.NON_NEGATIVE),
        (ra, "data.randaugment", "prob", common.PROBABILITY),
        (config.mixup, "mixup", "mixup_alpha", common.NON_NEGATIVE),
        (config.mixup, "mixup", "cutmix_alpha", common.NON_NEGATIVE),
        (config.mixup, "mixup", "switch_prob", common.PROBABILITY),
        (config.mixup, "mixup", "prob", common.PROBABILITY),
    ):
        common.config_number(section, key, prefix, bounds)
    if int(ra.num_ops) < 0:
        raise common.ConfigError(f"data.randaugment.num_ops must be >= 0, got {ra.num_ops}")
    randaugment = D.RandAugment(
        int(ra.num_ops), float(ra.magnitude), float(ra.magnitude_std), float(ra.prob)
    )
    train_data = D.ImageNetTrain(
        train_source,
        batch,
        seed=int(config.seed),
        image_size=size,
        randaugment=randaugment,
        num_threads=threads,
        prefetch=prefetch,
    )
    eval_data = D.ImageNetEval(
        eval_source,
        int(config.train.eval_batch_size),
        image_size=size,
        num_threads=threads,
        prefetch=prefetch,
        max_examples=int(config.data.eval_max_examples) or None,
    )
    _check_first_examples(config.data, train_data, eval_data)
    return method, train_data, eval_data, num_steps, example


def _check_sizes(config) -> None:
    """The run's length, image size and evaluation limit (:func:`common.check_eval_limit`): a
    bad image size failed in the input pipeline once compiling had begun."""
    t, data = config.train, config.data
    if int(t.num_steps) < 0 or (int(t.num_steps) == 0 and int(t.epochs) < 1):
        raise common.ConfigError(
            f"train.num_steps must be >= 1, or 0 with train.epochs >= 1 (num_steps > 0 overrides "
            f"epochs), got num_steps={t.num_steps}, epochs={t.epochs}"
        )
    if int(data.image_size) < 1:
        raise common.ConfigError(f"data.image_size must be >= 1, got {data.image_size}")
    # grain refuses a negative count only inside the input pipeline, as a traceback.
    for key, zero in (("num_threads", "no reader threads"), ("prefetch", "no read-ahead")):
        if int(data[key]) < 0:
            raise common.ConfigError(f"data.{key} must be >= 0 (0: {zero}), got {data[key]}")
    common.check_eval_limit(data, "eval_max_examples", "the whole split")


def _sources(data_cfg):
    """The training and evaluation splits: ImageNet from ``data_dir``, or ``fake_examples``
    random images each (:class:`dynadiag_jax.data.SyntheticImages`)."""
    fake = int(data_cfg.fake_examples)
    if fake < 0:
        raise common.ConfigError(f"data.fake_examples must be >= 0 (0: ImageNet), got {fake}")
    if not fake:
        version_dir = D.check_imagenet_dir(data_cfg.data_dir or None)
        return tuple(
            _imagenet_split(data_cfg, key, version_dir) for key in ("train_split", "eval_split")
        )
    if data_cfg.data_dir:
        raise common.ConfigError(
            f"data.fake_examples={fake} trains on random images, so data.data_dir="
            f"{data_cfg.data_dir!r} would be ignored: set --config.data.fake_examples=0 to train "
            "on ImageNet"
        )
    train = D.SyntheticImages(fake, seed=0, num_classes=NUM_CLASSES)
    return train, D.SyntheticImages(fake, seed=1, num_classes=NUM_CLASSES)


def _imagenet_split(data_cfg, key: str, version_dir):
    """``data.<key>`` of the preparation in ``version_dir`` (``<data_dir>/imagenet2012/<version>``);
    tfds's error for an unknown or malformed split names no config entry, and its errors for a
    damaged ``dataset_info.json`` (a cut copy, no splits recorded) are long tracebacks."""
    split = data_cfg[key]
    try:
        return D.imagenet_source(split, data_cfg.data_dir, version=version_dir.name)
    except ValueError as e:
        raise common.ConfigError(f"data.{key}={split!r}: {_first_line(e)}") from None
    except Exception as e:  # protobuf, KeyError, AssertionError...: each as one line
        raise common.ConfigError(
            f"data.data_dir={data_cfg.data_dir!r}: the preparation in {version_dir} cannot be "
            f"read (its dataset_info.json damaged?): {type(e).__name__}: {_first_line(e)}"
        ) from None


def _split_name(data_cfg, key: str) -> str:
    fake = int(data_cfg.fake_examples)
    return f"data.fake_examples={fake}" if fake else f"data.{key}={data_cfg[key]!r}"


def _check_first_examples(data_cfg, train_data, eval_data) -> None:
    """Read and transform one example of each split now: a missing shard or an image the
    pipeline cannot take would otherwise stop the run at the first evaluation, hours in."""
    for key, read in (("train_split", train_data.example), ("eval_split", eval_data.example)):
        try:
            read(0)
        except Exception as e:  # whatever the reader or decoder raises, as one line
            raise common.ConfigError(
                f"{_split_name(data_cfg, key)}: its first example cannot be read and transformed: "
                f"{type(e).__name__}: {_first_line(e)}"
            ) from None


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[0] if lines else ""


def train_and_evaluate(config, workdir, *, progress: bool = True) -> T.TrainResult:
    """Train and evaluate as ``config`` says; checkpoints and metrics under ``workdir``.

    Raises:
      common.ConfigError: bad config, data directory or batch size (before compiling anything).
    """
    method, train_data, eval_data, num_steps, example = prepare(config)
    print(
        f"{num_steps} steps of batch {config.train.batch_size} on {common.device_summary()}"
        + (" (data parallel)" if jax.device_count() > 1 else "")
    )
    if int(config.data.fake_examples):
        print(
            f"data: {config.data.fake_examples} random images per split (data.fake_examples), "
            "not ImageNet: the accuracy means nothing"
        )
    mix = config.mixup
    task = T.Classification(
        NUM_CLASSES,
        float(config.optimizer.label_smoothing),
        mixup=T.MixupCutmix(
            float(mix.mixup_alpha), float(mix.cutmix_alpha), float(mix.switch_prob), float(mix.prob)
        ),
        normalize=D.IMAGENET_MEAN_STD,
    )
    return common.train_from_config(
        config,
        method=method,
        task=task,
        train_data=train_data,
        eval_data=eval_data,
        num_steps=num_steps,
        example_input=example,
        workdir=workdir,
        progress=progress,
    )


def main(argv):
    del argv
    T.initialize_distributed()
    if FLAGS.config is None:
        common.die(
            "--config is required, e.g. "
            "--config=train/configs/vit_imagenet.py:variant=B/16,sparsity=0.9"
        )
    result = common.run_script(
        lambda: train_and_evaluate(FLAGS.config, FLAGS.workdir, progress=FLAGS.progress)
    )
    if jax.process_index() == 0:
        m = result.eval_metrics
        print(
            f"top-1 accuracy {m['accuracy']:.4f} on {m['count']} validation images "
            f"(loss {m['loss']:.4f})"
            + (f" (resumed at step {result.start_step})" if result.start_step else "")
        )


if __name__ == "__main__":  # flags exist only when run as a script (tests import this module)
    cli.define_config_flag(
        None,
        "config file and its arguments, required (e.g. train/configs/vit_imagenet.py:runlocal); "
        "--config.<key>=<value> overrides one entry",
    )
    flags.DEFINE_string("workdir", None, "checkpoints and metrics go here", required=True)
    flags.DEFINE_bool("progress", True, "show a progress bar")
    app.run(main, flags_parser=cli.parse_flags)
