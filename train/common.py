"""Config -> library adapters shared by the training scripts (the library never reads configs).

Each ``build_*`` takes one section of an ``ml_collections`` config and returns library objects;
:func:`check_config` compares a config against the script's reference config, so an unknown or a
missing key is reported before anything is built or compiled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import pathlib
import signal
import sys
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import ml_collections
import optax
from absl import logging
from flax import traverse_util

import dynadiag_jax as dd
from dynadiag_jax import models
from dynadiag_jax import training as T
from dynadiag_jax._checks import finite_number
from dynadiag_jax.kernel_stats import describe_paths, model_paths
from dynadiag_jax.layout import KERNEL_BLOCK_SIZES
from dynadiag_jax.nn.functional import HYPER_NAME
from dynadiag_jax.training.checkpoint import UnreadableCheckpoint, usable_directory
from train.configs import common as config_common

MODELS = {"mlp": models.MLP, "vit": models.ViT, "mixer": models.MlpMixer, "gpt2": models.GPT2}
MODEL_MODULES = {"mlp": models.mlp, "vit": models.vit, "mixer": models.mixer, "gpt2": models.gpt2}


class ConfigError(ValueError):
    """A configuration or input problem, reported to the user without a traceback."""


def _flat_keys(config, prefix="") -> dict[str, Any]:
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, (ml_collections.ConfigDict, Mapping)) and value:
            out.update(_flat_keys(value, name + "."))
        else:
            out[name] = value
    return out


def check_config(config, reference, *, free=("model",)) -> None:
    """Raise :class:`ConfigError` for keys of ``config`` not in ``reference`` and vice versa.

    Sections named in ``free`` are only checked for presence (their keys are validated by the
    builder that consumes them, e.g. model constructor arguments).
    """
    got, want = _flat_keys(config), _flat_keys(reference)
    is_free = lambda k: any(k == f or k.startswith(f + ".") for f in free)  # noqa: E731
    unknown = sorted(k for k in got if k not in want and not is_free(k))
    missing = sorted(k for k in want if k not in got and not is_free(k))
    problems = []
    if unknown:
        problems.append(f"unknown config keys: {', '.join(unknown)}")
    if missing:
        problems.append(f"missing config keys: {', '.join(missing)}")
    if problems:
        raise ConfigError("; ".join(problems) + f" (known keys: {', '.join(sorted(want))})")
    # the data pipelines seed numpy's generators with it, which take no negative seed
    if "seed" in config and not 0 <= int(config.seed) < 2**63:
        raise ConfigError(f"seed must be in [0, 2**63), got {config.seed}")


def sparsity_of(dynadiag_cfg) -> float:
    """``dynadiag.sparsity``: 0 (dense) or in (0, 1)."""
    sparsity = float(dynadiag_cfg.sparsity)
    if sparsity != 0.0 and not 0.0 < sparsity < 1.0:
        raise ConfigError(f"dynadiag.sparsity must be 0 (dense) or in (0, 1), got {sparsity}")
    return sparsity


PERMUTATIONS = {"none": None, "random": "random", "learned": "learned"}


def permutation_of(cfg) -> str | None:
    """``dynadiag.permutation`` as ``DiagonalDense``'s argument (``"none"`` -> None)."""
    if cfg.permutation not in PERMUTATIONS:
        raise ConfigError(
            f"dynadiag.permutation must be one of {', '.join(PERMUTATIONS)}, "
            f"got {cfg.permutation!r}"
        )
    return PERMUTATIONS[cfg.permutation]


def sparse_layer(cfg) -> functools.partial:
    """``DiagonalDense`` bound to the config's sparsity, block size, gate, slack, exploration mode,
    impl and input permutation, which are checked here (the layer itself checks them only when a
    model is built)."""
    if cfg.impl not in dd.available_impls():
        raise ConfigError(f"dynadiag.impl must be one of {dd.available_impls()}, got {cfg.impl!r}")
    layer = functools.partial(
        dd.nn.DiagonalDense,
        sparsity=float(cfg.sparsity),
        block_size=int(cfg.block_size),
        gate=cfg.gate,
        slack=float(cfg.slack),
        explore=cfg.explore,
        impl=cfg.impl,
        fan_in=cfg.fan_in,
        scale=cfg.scale,
        permutation=permutation_of(cfg),
        permutation_penalty=float(cfg.permutation_penalty),
        permutation_start=cfg.permutation_start,
        permutation_relaxation=cfg.permutation_relaxation,
    )
    try:
        layer(1)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"dynadiag: {e}") from None
    return layer


def build_model(model_cfg, dynadiag_cfg, **overrides) -> nn.Module:
    """The model named ``model_cfg.name`` with the config's arguments; replaceable layers matching
    ``dynadiag_cfg.layers`` become DiagonalDense unless ``dynadiag_cfg.sparsity == 0`` (dense)."""
    clash = sorted(k for k in overrides if k in model_cfg and model_cfg[k] != overrides[k])
    if clash:
        raise ConfigError(
            "; ".join(f"model.{k}={model_cfg[k]!r}" for k in clash)
            + f": the script sets {', '.join(f'{k}={overrides[k]!r}' for k in clash)} from the "
            "data; remove it from the config"
        )
    kwargs = {**dict(model_cfg), **overrides}
    name = kwargs.pop("name", None)
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; known models: {', '.join(MODELS)}")
    cls = MODELS[name]
    fields = {f.name for f in dataclasses.fields(cls)} - {"parent", "name", "dense"}
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ConfigError(
            f"unknown {name} model arguments: {', '.join(unknown)}; accepted: "
            f"{', '.join(sorted(fields - set(overrides)))}"
        )
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    if sparsity_of(dynadiag_cfg) != 0.0:
        kwargs["dense"] = models.ByPath(
            tuple(dynadiag_cfg.layers), sparse=sparse_layer(dynadiag_cfg)
        )
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"model {name}: {e}") from None


def dense_kernel_init(model_cfg):
    """The kernel initializer of the model's replaceable dense layers (``nn.Dense``'s default
    unless the model's ``DENSE`` binds one)."""
    module = MODEL_MODULES.get(model_cfg.name)
    if module is None:
        raise ConfigError(f"unknown model {model_cfg.name!r}; known models: {', '.join(MODELS)}")
    bound = models.routing.initializers(module.DENSE)
    return bound.get("kernel_init", nn.initializers.lecun_normal())


def check_layer_patterns(
    model: nn.Module, example_input, dynadiag_cfg, *, block_size: int = 1
) -> list[str]:
    """The replaceable layers that the patterns select; raises if a pattern or all of them select
    nothing, or if ``block_size`` (:func:`train.baselines.block_size`) does not divide both
    widths of every one."""
    paths = models.replaceable_layers(model, example_input)
    if float(dynadiag_cfg.sparsity) == 0.0:
        return []
    unmatched = models.unmatched_patterns(tuple(dynadiag_cfg.layers), paths)
    if unmatched:
        raise ConfigError(
            f"dynadiag.layers patterns {unmatched} match no replaceable layer; "
            f"the model's replaceable layers are: {', '.join(paths)}"
        )
    selected = [
        p for p in paths if models.ByPath(tuple(dynadiag_cfg.layers), sparse=nn.Dense).matches(p)
    ]
    if not selected:  # a sparse run of the dense model, reported at its sparsity
        raise ConfigError(
            f"dynadiag.layers={tuple(dynadiag_cfg.layers)} selects no layer, so a sparsity of "
            f"{float(dynadiag_cfg.sparsity):g} would train the dense model; the model's "
            f"replaceable layers are: {', '.join(paths)}"
        )
    if block_size > 1:
        _check_block_size(layer_shapes(model, example_input), selected, block_size)
    return selected


def _check_block_size(shapes: dict[str, tuple[int, int]], selected: list[str], b: int) -> None:
    """Raises naming the selected layers whose widths ``b`` does not divide, and the block sizes
    that divide every selected layer's."""
    misfits = [p for p in selected if shapes[p][0] % b or shapes[p][1] % b]
    if not misfits:
        return
    fits = [c for c in KERNEL_BLOCK_SIZES if all(not (w % c) for p in selected for w in shapes[p])]
    raise ConfigError(
        f"dynadiag.block_size={b} must divide both widths of every sparse layer; it does not "
        f"divide {', '.join(f'{p} ({shapes[p][0]} -> {shapes[p][1]})' for p in misfits)}. "
        f"Block sizes that fit every sparse layer: {', '.join(map(str, fits)) or 'none'}, "
        "or 1 (element diagonals)"
    )


def layer_shapes(model: nn.Module, example_input) -> dict[str, tuple[int, int]]:
    """``{path: (in_features, out_features)}`` of every replaceable layer (traced, not compiled)."""
    dense = model.clone(dense=nn.Dense)
    shapes = jax.eval_shape(lambda x: dense.init(jax.random.key(0), x), example_input)["params"]
    flat = traverse_util.flatten_dict(shapes)
    paths = set(models.replaceable_layers(model, example_input))
    return {
        "/".join(k[:-1]): tuple(v.shape)
        for k, v in flat.items()
        if k[-1] == "kernel" and "/".join(k[:-1]) in paths
    }


def gate_schedule(dynadiag_cfg, freeze_step: int | None, num_steps: int) -> T.GateSchedule | None:
    """The gate's schedule over the search phase (``None`` for a dense model)."""
    if float(dynadiag_cfg.sparsity) == 0.0:
        return None
    sched = dict(dynadiag_cfg.gate_schedule)
    for gate, default in config_common.GATE_SCHEDULES.items():
        if gate != dynadiag_cfg.gate and sched == default:
            # --config.dynadiag.gate alone keeps the other gate's schedule (a strength decayed
            # as a temperature); the config argument sets both
            raise ConfigError(
                f"dynadiag.gate={dynadiag_cfg.gate} with the {gate} gate's schedule {default}: "
                f"pick the gate with the config argument (--config=<config file>:"
                f"gate={dynadiag_cfg.gate}), which sets its schedule too, or also set "
                f"dynadiag.gate_schedule"
            )
    name = sched.pop("name")
    steps = max(1, freeze_step if freeze_step is not None else num_steps)
    try:
        if name == "constant":
            schedule = dd.schedules.by_name(name, value=sched["init_value"])
        else:
            schedule = dd.schedules.by_name(name, steps=steps, **sched)
    except (TypeError, ValueError, KeyError) as e:
        raise ConfigError(f"dynadiag.gate_schedule: {e}") from None
    rescore = float(dynadiag_cfg.rescore_fraction)
    if not 0.0 <= rescore < 1.0:
        raise ConfigError(f"dynadiag.rescore_fraction must be in [0, 1), got {rescore}")
    if rescore and round(rescore * steps) >= steps:  # the restart would come with the freeze
        raise ConfigError(
            f"dynadiag.rescore_fraction={rescore} of the {steps} search steps restarts alpha at "
            f"step {round(rescore * steps)}, the freeze's; use a smaller fraction"
        )
    try:
        return T.GateSchedule(
            HYPER_NAME[dynadiag_cfg.gate],
            schedule,
            int(dynadiag_cfg.score_every),
            rescore_step=round(rescore * steps),
        ).check()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"dynadiag.{e}") from None


def working_set(
    dynadiag_cfg, gate: T.GateSchedule | None, freeze_step: int | None, num_steps: int
) -> T.WorkingSet | None:
    """The search's working-set option (``None``: ``dynadiag.working_set = 0`` or a dense model):
    factor ``working_set``, refreshed every ``working_set_refresh`` steps, entered
    ``working_set_start`` of the search phase in (after the restart of alpha)."""
    factor = float(dynadiag_cfg.working_set)
    if gate is None or factor == 0.0:
        return None
    steps = max(1, freeze_step if freeze_step is not None else num_steps)
    start = float(dynadiag_cfg.working_set_start)
    rescore = float(dynadiag_cfg.rescore_fraction)
    if not rescore < start < 1.0:
        raise ConfigError(
            f"dynadiag.working_set_start must be in (rescore_fraction={rescore}, 1), got {start}"
        )
    start_step = max(round(start * steps), gate.rescore_step + 1)
    if start_step >= steps:
        raise ConfigError(
            f"dynadiag.working_set_start={start} leaves no search step in the working set "
            f"({steps} search steps): lower it or search longer"
        )
    try:
        return T.WorkingSet(factor, int(dynadiag_cfg.working_set_refresh), start_step).check()
    except (TypeError, ValueError) as e:
        raise ConfigError(f"dynadiag.working_set: {e}") from None


def freeze_step(dynadiag_cfg, num_steps: int) -> int | None:
    """Step of the freeze: ``search_fraction`` of training (``None`` for dense models)."""
    if float(dynadiag_cfg.sparsity) == 0.0:
        return None
    try:
        return dd.schedules.freeze_step(
            num_steps, search_fraction=float(dynadiag_cfg.search_fraction)
        )
    except ValueError as e:
        raise ConfigError(f"dynadiag: {e}") from None


# A config number's ranges: the words its error message uses -> the test.
POSITIVE = ("> 0", lambda v: v > 0)
NON_NEGATIVE = (">= 0", lambda v: v >= 0)
FRACTION = ("in [0, 1)", lambda v: 0 <= v < 1)
PROBABILITY = ("in [0, 1]", lambda v: 0 <= v <= 1)


def config_number(section, key: str, prefix: str, bounds: tuple[str, Callable]) -> float:
    """``section[key]`` as a float, finite and within ``bounds`` (:data:`POSITIVE`, ...); else
    :class:`ConfigError` naming ``prefix.key``."""
    name, (words, within) = f"{prefix}.{key}", bounds
    try:
        value = finite_number(section[key], name)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{e}; it must be {words}") from None
    if not within(value):
        raise ConfigError(f"{name} must be {words}, got {section[key]!r}")
    return value


def check_optimizer_section(opt_cfg, dynadiag_cfg) -> None:
    """The ``optimizer`` section's numbers, and alpha's factor on the rate
    (``dynadiag.alpha_lr_scale``): each finite and in range. optax takes a NaN or negative rate,
    a negative clip norm (which flips the gradient) or ``b1 >= 1`` without a word and trains to
    NaN or away from the minimum, so they are refused here, before anything is built."""
    checks = {
        "learning_rate": POSITIVE,
        "end_learning_rate": NON_NEGATIVE,
        "weight_decay": NON_NEGATIVE,
        "b1": FRACTION,
        "b2": FRACTION,
        "clip_norm": (">= 0 (0: no clipping)", NON_NEGATIVE[1]),
        "label_smoothing": FRACTION,  # the classification configs only
    }
    for key, bounds in checks.items():
        if key in opt_cfg:
            config_number(opt_cfg, key, "optimizer", bounds)
    config_number(dynadiag_cfg, "alpha_lr_scale", "dynadiag", POSITIVE)


def check_lora_learning_rate(lora_cfg) -> None:
    """``lora.learning_rate``, finite and > 0, where the config has a LoRA-FA phase (``lora.steps``
    > 0, or no such entry: train/lora_fa.py). The phase's optimizer is built from the optimizer
    section with this rate in it, whose check would name ``optimizer.learning_rate``."""
    if int(lora_cfg.get("steps", 1)):
        config_number(lora_cfg, "learning_rate", "lora", POSITIVE)


def check_eval_limit(data_cfg, key: str, zero: str) -> None:
    """``data.<key>``, a cap on the evaluation set (0: ``zero``), must be >= 0: a negative one
    gives an evaluation of no batch, which fails only after the whole training."""
    if int(data_cfg[key]) < 0:
        raise ConfigError(f"data.{key} must be >= 0 (0: {zero}), got {data_cfg[key]}")


def learning_rate(opt_cfg, num_steps: int, warmup: int):
    """Linear warm-up over ``warmup`` steps to ``learning_rate``, then cosine decay to
    ``end_learning_rate``."""
    # Name the entry the user sets: warmup_steps, or warmup_epochs (imagenet.py).
    if "warmup_epochs" in opt_cfg:
        entry = f"optimizer.warmup_epochs={opt_cfg.warmup_epochs} ({warmup} steps)"
    else:
        entry = f"optimizer.warmup_steps={warmup}"
    if warmup < 0:
        raise ConfigError(f"{entry} must be >= 0 (0: no warm-up)")
    if num_steps < 1:
        raise ConfigError(f"the number of training steps must be >= 1, got {num_steps}")
    if warmup >= num_steps:
        raise ConfigError(
            f"{entry} must be fewer than the {num_steps} training steps: lower it or train longer"
        )
    return optax.warmup_cosine_decay_schedule(
        0.0 if warmup else float(opt_cfg.learning_rate),
        float(opt_cfg.learning_rate),
        warmup,
        num_steps,
        float(opt_cfg.end_learning_rate),
    )


def build_optimizer(
    opt_cfg, dynadiag_cfg, num_steps: int, warmup_steps: int, *, values_lr_scale: float = 1.0
):
    """``(optimizer, learning-rate schedule)`` from the config's optimizer section; the
    DiagonalDense values' updates times ``values_lr_scale``. The section is checked first
    (:func:`check_optimizer_section`), so every script refuses a bad one before it compiles."""
    check_optimizer_section(opt_cfg, dynadiag_cfg)
    lr = learning_rate(opt_cfg, num_steps, warmup_steps)
    clip = float(opt_cfg.clip_norm) or None
    tx = T.adamw(
        lr,
        weight_decay=float(opt_cfg.weight_decay),
        b1=float(opt_cfg.b1),
        b2=float(opt_cfg.b2),
        clip_norm=clip,
        alpha_lr_scale=float(dynadiag_cfg.alpha_lr_scale),
        values_lr_scale=values_lr_scale,
    )
    return tx, lr


def reports_config_errors(prepare: Callable) -> Callable:
    """Decorate a script's ``prepare``: bad input (``ValueError``, ``FileNotFoundError``) becomes
    a :class:`ConfigError`, which :func:`run_script` reports without a traceback."""

    @functools.wraps(prepare)
    def wrapper(*args, **kwargs):
        try:
            return prepare(*args, **kwargs)
        except ConfigError:
            raise
        except (FileNotFoundError, ValueError) as e:
            raise ConfigError(str(e)) from None

    return wrapper


# Config entries that do not change what a run computes, so that a resumed run may change them:
# where the data lives, input-pipeline threads, how often to checkpoint, log and evaluate, the
# evaluation batch (padded; only the rounding of the summed loss can change), the kernel backend
# (the same products), and which runs fashion_mnist.py trains (each in its own subdirectory; the
# method is recorded by name). Every other entry is part of the recipe (see :func:`recipe`).
NOT_RECIPE = frozenset(
    {
        "data.data_dir",
        "data.path",
        "data.num_threads",
        "data.prefetch",
        "train.checkpoint_every",
        "train.keep_checkpoints",
        "train.log_every",
        "train.eval_every",
        "train.selection_every",
        "train.eval_batch_size",
        "dynadiag.impl",
        "compare_dense",
        "method",
    }
)


SPARSE_LR_KEY = "optimizer.sparse_lr_scale"


def recipe(config, method, *, phase: bool = True) -> dict[str, Any]:
    """What decides the result of a run of ``method`` (a :class:`train.baselines.Method`), flat:
    ``{"method": name, "optimizer.learning_rate": 1e-3, ...}``: every config entry but
    :data:`NOT_RECIPE` (and the ``lora`` section of a run without a LoRA-FA phase - ``lora.steps``
    0, or ``phase`` False: fashion_mnist.py's dense comparison run - and
    ``optimizer.sparse_lr_scale`` of train/lora_fa.py's, which no step reads), and of the
    ``dynadiag`` and ``unstructured`` sections only what the method reads. Stored with the run's
    checkpoints; resuming with another recipe is refused."""
    # A config without a LoRA-FA phase (lora.steps = 0) computes the same whatever its settings.
    no_phase = "lora" in config and (not phase or int(config.lora.get("steps", 1)) == 0)

    def kept(key):
        if key in NOT_RECIPE or (no_phase and key.startswith("lora.")):
            return False
        if key.split(".")[0] in ("dynadiag", "unstructured"):
            return any(key == r or key.startswith(r + ".") for r in method.reads)
        return True

    flat = {k: v for k, v in _flat_keys(config).items() if kept(k)}
    # "none" is what every run trained before the entry existed did: those runs still resume.
    # lora_fa.py's phase builds its optimizer without the factor, so any value computes the same.
    if flat.get(SPARSE_LR_KEY) == "none" or method.name == "lora_fa":
        flat.pop(SPARSE_LR_KEY, None)
    return {"method": method.name, **flat}


def train_from_config(
    config,
    *,
    method,
    task,
    train_data,
    eval_data,
    num_steps: int,
    example_input,
    workdir,
    progress: bool,
    initial_variables=None,
    finetune: T.Finetune | None = None,
) -> T.TrainResult:
    """:func:`dynadiag_jax.training.train` of ``method`` (a :class:`train.baselines.Method`: the
    model, optimizer, freeze step and gate schedule) with the ``train`` section of ``config``,
    from the model's init or from ``initial_variables``, ending with the ``finetune`` phase if
    given (train/finetuning.py).

    Raises:
      ConfigError: ``workdir`` holds a checkpoint of another recipe (:func:`recipe`) or seed.
    """
    t = config.train
    if jax.process_index() == 0:
        for line in startup_lines(config, method, example_input):
            print(line)
    try:
        return T.train(
            model=method.model,
            optimizer=method.optimizer,
            task=task,
            train_data=train_data,
            eval_data=eval_data,
            num_steps=num_steps,
            example_input=example_input,
            seed=int(config.seed),
            freeze_step=method.freeze_step,
            gate=method.gate,
            working_set=method.working_set,
            workdir=workdir,
            eval_every=int(t.eval_every),
            checkpoint_every=int(t.checkpoint_every),
            keep_checkpoints=int(t.keep_checkpoints),
            log_every=int(t.log_every),
            selection_every=int(t.selection_every),
            learning_rate=method.learning_rate,
            run_info=recipe(config, method, phase=finetune is not None),
            progress=progress,
            initial_variables=initial_variables,
            finetune=finetune,
        )
    except T.CheckpointMismatch as e:
        hint = (
            f" (--workdir; a run from before {SPARSE_LR_KEY} existed resumes with "
            f"--config.{SPARSE_LR_KEY}=none)"
            if f"{SPARSE_LR_KEY}: absent in the checkpoint" in str(e)
            else " (--workdir)"
        )
        raise ConfigError(f"{e}{hint}") from None


class SourceRun(NamedTuple):
    """The run a script starts from (:func:`source_run`)."""

    directory: pathlib.Path  # its workdir, resolved
    step: int  # the step read
    recipe: dict  # what its checkpoint records of its run (``"method"``, ...)
    variables: dict


def source_run(config, *, workdir=None) -> SourceRun:
    """The variables of the run's checkpoint ``config.checkpoint`` (the run's workdir or its
    ``checkpoints/`` directory, in any spelling) at ``config.step`` (0: the newest), with the run
    they come from. ``config.checkpoint`` and ``config.step`` then name the resolved directory and
    step, so a recipe refuses a source that moved on; process 0 prints which run and step.

    Raises:
      ConfigError: no such checkpoint, or ``workdir`` (the script's own) is the source run's.
    """
    directory = pathlib.Path(config.checkpoint).expanduser().resolve()
    if directory.name == "checkpoints":
        directory = directory.parent
    if workdir is not None and pathlib.Path(workdir).expanduser().resolve() == directory:
        raise ConfigError(
            f"--workdir is the checkpoint's own run ({directory}): give a new directory"
        )
    step = int(config.step)
    with _run_reader(directory) as reader:
        variables = reader.restore_variables(step or None)
        read = step or reader.latest_step()
        recipe = reader.read_meta(read).get("run", {})
    config.checkpoint, config.step = str(directory), read
    if jax.process_index() == 0:
        method = recipe.get("method", "unrecorded method")
        print(f"source: step {read} of {directory} ({method})")
    return SourceRun(directory, read, recipe, variables)


def usable_workdir(workdir, *, create: bool = True) -> pathlib.Path:
    """``--workdir`` checked up front as :func:`usable_directory` does (created unless
    ``create`` is False), as an absolute path.

    Raises:
      ConfigError: it is a file, cannot be created or is not writable, naming ``--workdir``.
    """
    try:
        return usable_directory(workdir, create=create)
    except ValueError as e:
        raise ConfigError(f"--workdir: {e}") from None


def check_batch_fits(batch: int, examples: int, source: str) -> None:
    """Raise :class:`ConfigError` when ``train.batch_size`` exceeds the ``examples`` of the
    training split (``source`` names where they come from)."""
    if batch > examples:
        raise ConfigError(
            f"train.batch_size={batch} exceeds the {examples} examples of the training split "
            f"({source})"
        )


def check_workdir(workdir, run_info) -> None:
    """Refuse now, before anything costly, a ``workdir`` that cannot hold checkpoints or whose
    newest checkpoint records another ``run_info`` (``T.train`` refuses both, but only once it
    runs; an unreadable newest checkpoint is left to it, which resumes from the one before).

    Raises:
      ConfigError: as :func:`train_from_config` would, naming ``--workdir``.
    """
    directory = pathlib.Path(workdir) / "checkpoints"
    try:
        usable_directory(directory, create=False)
    except ValueError as e:
        raise ConfigError(f"checkpoint directory: {e} (--workdir)") from None
    if not directory.is_dir():
        return
    reader = T.Checkpointer(directory, async_save=False, read_only=True)
    try:
        latest = reader.latest_step()
        if latest is not None:
            reader.check_run(latest, json.loads(json.dumps(run_info)))
    except UnreadableCheckpoint:
        pass
    except T.CheckpointMismatch as e:
        raise ConfigError(f"{e} (--workdir)") from None
    finally:
        reader.close()


@contextlib.contextmanager
def _run_reader(checkpoint):
    """A read-only :class:`T.Checkpointer` of a run's checkpoints (``checkpoint``: the run's
    workdir or its ``checkpoints/`` directory), closed on leaving."""
    directory = pathlib.Path(checkpoint)
    if directory.name != "checkpoints":
        directory = directory / "checkpoints"
    if not directory.is_dir():
        raise ConfigError(f"checkpoint: no directory {directory}")
    reader = T.Checkpointer(directory, async_save=False, read_only=True)
    try:
        yield reader
    finally:
        reader.close()


def restore_run_variables(checkpoint, step: int = 0) -> dict:
    """The variables of a run's Orbax checkpoint (``checkpoint``: the run's workdir or its
    ``checkpoints/`` directory; ``step`` 0: the newest), read without a target."""
    with _run_reader(checkpoint) as reader:
        return reader.restore_variables(int(step) or None)


def startup_lines(config, method, example_input) -> list[str]:
    """A run's start-up lines: the path ``impl="auto"`` takes for each sparse layer on this
    platform, and on a GPU the cost model's predicted speed against a dense layer (nothing for
    dense models); the factor ``optimizer.sparse_lr_scale`` puts on the sparse weights' updates
    (none when 1), and a warning for each diagonal layer whose own init gain is more than 1.25
    times off that factor: ``K`` clamped to 1, or rounded up on a narrow layer (at the suites'
    sparsities their layers stay within 1.12 times)."""
    batch = example_input.shape[0] // jax.device_count()  # the rows one device multiplies
    x = jax.ShapeDtypeStruct((batch, *example_input.shape[1:]), example_input.dtype)
    paths = model_paths(method.model, jax.random.key(0), x)
    lines = [f"sparse layers: {line}" for line in describe_paths(paths)]
    scale = method.sparse_update_scale
    if scale == 1.0:
        return lines
    mode = config.optimizer.sparse_lr_scale
    lines.append(
        f"sparse weights: updates x{scale:.3g}, their init's gain over the dense layer's "
        f"(optimizer.sparse_lr_scale={mode})"
    )
    for p in paths:
        candidates = dd.layout.geometry(p.in_features, p.out_features, p.block_size).num_candidates
        gain = math.sqrt(candidates / p.num_diagonals)  # 1 / sqrt(K / P), the layer's density
        if max(gain / scale, scale / gain) > 1.25:
            lines.append(
                f"warning: {p.path} keeps {p.num_diagonals} of {candidates} diagonals, so its "
                f"values start x{gain:.3g} the dense layer's, but their updates are x{scale:.3g} "
                f"(optimizer.sparse_lr_scale={mode} follows the nominal sparsity)"
            )
    return lines


def check_train_section(train_cfg) -> None:
    """The ``train`` section's intervals: each >= 0 (0 disables it); ``keep_checkpoints`` >= 1."""
    for name in ("eval_every", "checkpoint_every", "log_every", "selection_every"):
        if int(train_cfg[name]) < 0:
            raise ConfigError(f"train.{name} must be >= 0 (0 disables it), got {train_cfg[name]}")
    if int(train_cfg.keep_checkpoints) < 1:
        raise ConfigError(f"train.keep_checkpoints must be >= 1, got {train_cfg.keep_checkpoints}")


def interrupt_status(interrupt: KeyboardInterrupt) -> int:
    """The shell's status for a run stopped by a signal: 128 + the signal (130 for Ctrl-C, 143 for
    SIGTERM; :class:`dynadiag_jax.training.Interrupted` says which, a bare interrupt is Ctrl-C)."""
    return 128 + getattr(interrupt, "signum", signal.SIGINT)


def exit_interrupted(interrupt: KeyboardInterrupt, message: str) -> None:
    """Print ``message`` to stderr and exit with :func:`interrupt_status`, skipping Python's
    teardown.

    An interrupt can come while XLA compiles on its own threads (jit's compile does not stop
    with the Python frame that waited for it), and Python's teardown destroyed the runtime
    beneath that compile: a segfault (status 139) instead of 130 when unedited_vit.py was
    interrupted while compiling its timed steps. What the scripts write is closed by then (the
    training loop saves and closes its checkpoints and logs before it raises). A multi-process
    run exits normally, so that the distributed runtime shuts down with the other processes.
    """
    print(message, file=sys.stderr)
    status = interrupt_status(interrupt)
    if jax.distributed.is_initialized():
        raise SystemExit(status) from None
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def run_script(body: Callable[[], Any]) -> Any:
    """Run a script's body: a :class:`ConfigError` exits with ``error: ...`` (status 2); an
    interrupt (Ctrl-C, SIGTERM), once the loop has saved its checkpoint, exits with
    :func:`interrupt_status` (130, 143)."""
    logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
    try:
        return body()
    except ConfigError as e:
        die(str(e))
    except KeyboardInterrupt as e:
        # Python's own handler raises a bare KeyboardInterrupt: the signal came outside the
        # training loop's steps, whose handler stops after a step and says where.
        reason = str(e) or "not during a training step: start-up, compiling, evaluating or timing"
        exit_interrupted(e, f"\ninterrupted ({reason}); run the same command to resume")


def die(message: str) -> None:
    """Print ``error: message`` and exit with status 2 (bad input, no traceback)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def device_summary() -> str:
    devices = jax.devices()
    return f"{len(devices)} x {devices[0].platform} ({jax.process_count()} process(es))"
