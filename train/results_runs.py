"""The training runs behind the results command (``train/results.py``): plan, build, train, record.

A suite is one entry of the config's ``models``: a model, its data (Fashion-MNIST images for
``task="classification"``, a byte-level corpus for ``task="language_modeling"``) and one recipe
for every method. Methods are :data:`train.baselines.METHODS` and their block-diagonal variants
``dynadiag_b<b>`` / ``static_diagonals_b<b>`` (the same method with ``dynadiag.block_size = b``),
those with ``_random_perm`` / ``_learned_perm`` (with ``dynadiag.permutation`` set), and any of
those with ``_lorafa_r<r>``: the run as usual, then ``lora.fraction`` of its steps more of a LoRA-FA
phase at rank ``r`` (train/finetuning.py) with the suite's ``lora`` section.

Kept apart from the script so tests import it without defining absl flags.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import multiprocessing
import os
import pathlib
import re
import shutil
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import tqdm
from flax import traverse_util

from dynadiag_jax import data as D
from dynadiag_jax import training as T
from dynadiag_jax.nn import permutation as perms
from train import baselines, common, finetuning
from train.configs import results as default_config

ACCURACY_FILE = "accuracy.jsonl"
SPEED_FILE = "speed.json"
TASKS = ("classification", "language_modeling")
_BLOCK_METHOD = re.compile(r"(dynadiag|static_diagonals)_b([1-9][0-9]*)")
# A diagonal method with an input permutation: "<method>_random_perm", "<method>_learned_perm".
_PERMUTED_METHOD = re.compile(r"(dynadiag\w*|static_diagonals\w*)_(random|learned)_perm")
# A diagonal method with a LoRA-FA phase of rank r after its run: "<method>_lorafa_r<r>".
_LORA_METHOD = re.compile(r"(dynadiag\w*|static_diagonals\w*)_lorafa_r([1-9][0-9]*)")


class MethodParts(NamedTuple):
    """What a method's name says: ``base`` (of :data:`train.baselines.METHODS`), ``block`` size
    (1: element diagonals), ``permutation`` (``"random"``, ``"learned"`` or None) and the
    ``rank`` of its LoRA-FA phase (0: none)."""

    base: str
    block: int
    permutation: str | None
    rank: int


class Data(NamedTuple):
    """What the suites train on: ``images`` (:class:`~dynadiag_jax.data.ImageData`) and
    ``corpus`` (:class:`~dynadiag_jax.data.Corpus`); ``None`` where no suite needs it."""

    images: object | None
    corpus: object | None

    @property
    def name(self) -> str:
        return "; ".join(x.name for x in (self.images, self.corpus) if x is not None)


def _split_method(method: str) -> MethodParts:
    """The :class:`MethodParts` of a method name.

    Raises:
      common.ConfigError: not a method of :data:`train.baselines.METHODS`, a block variant, or one
        of those with a permutation a diagonal method can take, or with a LoRA-FA phase.
    """
    adapted = _LORA_METHOD.fullmatch(method)
    unadapted, rank = (adapted.group(1), int(adapted.group(2))) if adapted else (method, 0)
    permuted = _PERMUTED_METHOD.fullmatch(unadapted)
    unpermuted, permutation = permuted.groups() if permuted else (unadapted, None)
    match = _BLOCK_METHOD.fullmatch(unpermuted)
    if match and int(match.group(2)) >= 2:
        base, block = match.group(1), int(match.group(2))
    elif unpermuted in baselines.METHODS:
        base, block = unpermuted, 1
    else:
        base = None
    # static diagonals never search, so they never harden a learned permutation
    if base is None or (base, permutation) == ("static_diagonals", "learned"):
        raise common.ConfigError(
            f"unknown method {method!r}; known: {', '.join(baselines.METHODS)}, "
            "dynadiag_b<b> / static_diagonals_b<b> (block diagonals of size b >= 2), and those "
            "of dynadiag with _random_perm or _learned_perm, of static_diagonals with _random_perm "
            "(a fixed or learned input permutation), and any diagonal one of these with "
            "_lorafa_r<r> (a LoRA-FA phase of rank r >= 1 after the run)"
        )
    return MethodParts(base, block, permutation, rank)


def parse_method(method: str) -> tuple[str, int]:
    """``"dynadiag_b16"`` -> ``("dynadiag", 16)``; ``"rigl"`` -> ``("rigl", 1)``; a permutation
    suffix is read by :func:`method_permutation` (``"dynadiag_b16_random_perm"`` ->
    ``("dynadiag", 16)``), a LoRA-FA one by :func:`method_rank`.

    Raises:
      common.ConfigError: as :func:`_split_method`.
    """
    return tuple(_split_method(method)[:2])


def method_permutation(method: str) -> str | None:
    """The input permutation a method's name asks for (``"random"``, ``"learned"``), or None
    when the name has no permutation suffix (the suite's ``dynadiag.permutation`` applies)."""
    return _split_method(method).permutation


def method_rank(method: str) -> int:
    """The rank of the LoRA-FA phase a method's name asks for (``"dynadiag_lorafa_r8"`` -> 8),
    or 0 when it has none."""
    return _split_method(method).rank


def is_language_model(m) -> bool:
    return m.task == "language_modeling"


def run_plan(config, models=None) -> list[tuple[str, str, float, int]]:
    """``(model, method, sparsity, seed)`` of every training run, goal sparsity first.

    Dense runs once per seed; ``goal_methods`` run only at ``config.goal_sparsity``; other
    sparsities run ``sweep_seeds`` seeds.
    """
    goal, plan = float(config.goal_sparsity), []
    for model in suites(config) if models is None else models:
        m = config.models[model]
        sparsities = sorted((float(s) for s in m.sparsities), key=lambda s: (s != goal, s))
        for sparsity in sparsities:
            at_goal = sparsity == goal
            methods = tuple(m.methods) + (tuple(m.goal_methods) if at_goal else ())
            for seed in range(int(m.seeds if at_goal else m.sweep_seeds)):
                if "dense" in methods and sparsity == sparsities[0]:
                    plan.append((model, "dense", 0.0, seed))
                plan += [(model, x, sparsity, seed) for x in methods if x != "dense"]
    return plan


def run_percent(sparsity: float) -> int:
    """The whole percent that names a run of ``sparsity`` (its directory: ``..._s90_...``)."""
    return round(100 * float(sparsity))


def suites(config) -> list[str]:
    """The config's suites in the order of :data:`train.configs.results.SUITES` (a ConfigDict
    sorts its keys)."""
    return sorted(config.models, key=default_config.SUITES.index)


def selected_suites(config, names) -> list[str]:
    """The suites ``--suite`` names, in :func:`suites` order; ``all`` is every suite."""
    if list(names) == ["all"]:
        return suites(config)
    if not names:
        raise common.ConfigError(f"--suite names no suite: give all or some of {suites(config)}")
    if "all" in names:
        raise common.ConfigError(f"--suite=all stands alone (it is every suite), got {names}")
    unknown = sorted(set(names) - set(config.models))
    if unknown:
        raise common.ConfigError(
            f"--suite names {unknown}, which the config does not define; "
            f"known: all, {', '.join(suites(config))}"
        )
    return [n for n in suites(config) if n in names]


def untrained(config, data, suites, workdir: pathlib.Path) -> list[tuple]:
    """The planned runs of ``suites`` with no record of their settings in ``accuracy.jsonl``."""
    done = {
        (r["model"], r["method"], r["sparsity"], r["seed"], r["fingerprint"])
        for r in read_records(workdir / ACCURACY_FILE)
    }
    return [
        spec
        for spec in run_plan(config, suites)
        if (*spec, fingerprint(config, spec[0], spec[1], steps_of(config.models[spec[0]], data)))
        not in done
    ]


def timing_recipe(config, model_name: str, data: Data) -> str:
    """Hash of what a suite's timings depend on: the suite's settings but its seed counts (the
    model, batch, sparsities, methods and their sections), its data and steps (the clean runs
    train), the mask updates' section (RigL's step is timed) and the ``speed`` section."""
    m = config.models[model_name].to_dict()
    for key in ("seeds", "sweep_seeds"):  # how many runs train, not what a step computes
        m.pop(key, None)
    steps = steps_of(config.models[model_name], data)
    parts = {
        "suite": m,
        "data": recipe(config, model_name, "dense", steps)["data"],
        "steps": steps,
        "unstructured": config.unstructured.to_dict(),
        "speed": config.speed.to_dict(),
    }
    return _digest(parts)


def read_timings(workdir: pathlib.Path) -> dict | None:
    """``speed.json`` of ``workdir`` (None if absent).

    Raises:
      common.ConfigError: it cannot be read (e.g. cut short by a full disk).
    """
    path = pathlib.Path(workdir) / SPEED_FILE
    if not path.exists():
        return None
    try:
        timings = json.loads(path.read_text())
        if not isinstance(timings.get("models"), dict):
            raise ValueError("no 'models' entry")
    except (ValueError, AttributeError) as e:
        raise common.ConfigError(
            f"{path} cannot be read ({e}): remove it and time the suites again (--timing_only)"
        ) from None
    return timings


def write_timings(workdir: pathlib.Path, timings: dict) -> None:
    """``speed.json`` replaced at once: a kill mid-write leaves the old file."""
    path = pathlib.Path(workdir) / SPEED_FILE
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(timings, indent=1))
    os.replace(tmp, path)


def stale_timings(config, data, timings: dict) -> list[str]:
    """The suites of ``config`` whose timings in ``timings`` were taken with another
    :func:`timing_recipe` (or before the recipes were recorded)."""
    recorded = timings.get("recipes", {})
    return [
        s
        for s in suites(config)
        if s in timings["models"] and recorded.get(s) != timing_recipe(config, s, data)
    ]


def untimed(config, data, suites, workdir: pathlib.Path) -> list[str]:
    """The ``suites`` that ``speed.json`` has no timings of this recipe of."""
    timings = read_timings(workdir) or {"models": {}}
    stale = set(stale_timings(config, data, timings))
    return [s for s in suites if s not in timings["models"] or s in stale]


def check_full_campaign(config, data, workdir, *, trained, timed) -> None:
    """Raises unless the report of ``workdir`` will be the full campaign's (what ``--docs``
    writes): the default config, and every run and suite timing either in ``workdir`` or among
    those this command produces (the suites ``trained`` and ``timed``)."""
    if config.to_dict() != default_config.get_config().to_dict():
        raise common.ConfigError(
            "--docs writes the shipped report, which only the full campaign may write: this "
            "config is not the default one (a config argument such as :quick, or an override); "
            f"leave out --docs and the report goes to {workdir}"
        )
    everything = suites(config)
    runs = untrained(config, data, [s for s in everything if s not in trained], workdir)
    missing = [f"{len(runs)} training runs ({runs[0][0]} {runs[0][1]} ...)"] if runs else []
    missing += [
        f"the timings of {s}"
        for s in untimed(config, data, [s for s in everything if s not in timed], workdir)
    ]
    if missing:
        raise common.ConfigError(
            f"--docs writes the shipped report, which only the full campaign may write: "
            f"{workdir} lacks {', '.join(missing)}. Complete it first (without --docs and "
            f"--suite the same command trains what is missing and times every suite), or leave "
            f"out --docs: the report then goes to {workdir}"
        )


def steps_of(model_cfg, data: Data) -> int:
    steps = int(model_cfg.get("steps", 0))
    if steps < 0 or (is_language_model(model_cfg) and steps == 0):
        raise common.ConfigError(f"steps must be > 0 (or 0 to train by epochs), got {steps}")
    if steps:
        return steps
    return int(model_cfg.epochs) * (len(data.images.train["label"]) // int(model_cfg.batch_size))


def method_dynadiag(model_cfg, method: str):
    """The suite's ``dynadiag`` section as ``method`` trains it (block variants set
    ``block_size``, permuted ones ``permutation``)."""
    _, block, permutation, _ = _split_method(method)
    cfg = model_cfg.dynadiag.copy_and_resolve_references()
    with cfg.unlocked():
        if block > 1:
            cfg.block_size = block
        if permutation is not None:
            cfg.permutation = permutation
    return cfg


def lora_steps(model_cfg, method: str, steps: int) -> int:
    """The length of ``method``'s LoRA-FA phase after its ``steps`` (0: it has none)."""
    return round(float(model_cfg.lora.fraction) * steps) if method_rank(method) else 0


def lora_phase(config, model_name: str, method: str, sparsity: float, data: Data, steps: int):
    """``method``'s LoRA-FA phase (:class:`dynadiag_jax.training.Finetune`) from step ``steps``,
    or None when its name asks for none: rank from the name, the rest from the suite's ``lora``
    section, adapters on its diagonal layers.

    Raises:
      common.ConfigError: a bad ``lora`` section, or a rank above a diagonal layer's width.
    """
    m = config.models[model_name]
    rank = method_rank(method)
    if not rank:
        return None
    lora = m.lora.to_dict()
    del lora["fraction"]
    lora_cfg = ml_collections.ConfigDict(dict(lora, rank=rank, layers=list(m.dynadiag.layers)))
    dyn = baselines.with_sparsity(method_dynadiag(m, method), sparsity)
    base = finetuning.frozen_model(m.model, dyn, **model_kwargs(m, data))
    return finetuning.lora_phase(
        lora_cfg,
        base,
        m.optimizer,
        dyn,
        example_input(m, data),
        start_step=steps,
        steps=lora_steps(m, method, steps),
    )


def build(
    config, model_name: str, method: str, sparsity: float, seed: int, data: Data, steps: int
) -> baselines.Method:
    m = config.models[model_name]
    built = baselines.build(
        parse_method(method)[0],
        model_cfg=m.model,
        dynadiag_cfg=method_dynadiag(m, method),
        unstructured_cfg=config.unstructured,
        optimizer_cfg=m.optimizer,
        sparsity=sparsity,
        num_steps=steps,
        warmup_steps=int(m.optimizer.warmup_steps),
        seed=seed,
        **model_kwargs(m, data),
    )
    return built._replace(name=method)


def model_kwargs(model_cfg, data: Data) -> dict:
    """The model constructor's data-dependent arguments (classes, or vocabulary and length)."""
    if is_language_model(model_cfg):
        return dict(vocab_size=D.BYTE_VOCAB_SIZE, block_size=int(model_cfg.seq_len))
    return dict(num_classes=data.images.num_classes)


def task_of(model_cfg, data: Data):
    if is_language_model(model_cfg):
        return T.LanguageModeling()
    return T.Classification(
        data.images.num_classes, float(model_cfg.optimizer.get("label_smoothing", 0.0))
    )


def example_input(model_cfg, data: Data, batch_size: int | None = None) -> jax.ShapeDtypeStruct:
    n = int(model_cfg.batch_size) if batch_size is None else int(batch_size)
    if is_language_model(model_cfg):
        return jax.ShapeDtypeStruct((n, int(model_cfg.seq_len)), jnp.int32)
    return jax.ShapeDtypeStruct((n, *data.images.train["image"].shape[1:]), jnp.float32)


def sample_batch(model_cfg, data: Data, n: int) -> dict:
    """The first ``n`` training examples (or windows) as one batch, for timing."""
    if is_language_model(model_cfg):
        windows = D.TokenWindows(data.corpus.train, int(model_cfg.seq_len), n, seed=0)
        return {"tokens": jnp.asarray(next(iter(windows.iterate(0)))["tokens"])}
    return {k: jnp.asarray(data.images.train[k][:n]) for k in ("image", "label")}


def model_inputs(model_cfg, batch: dict):
    return batch["tokens"][:, :-1] if is_language_model(model_cfg) else batch["image"]


def train_source(model_cfg, data: Data, seed: int):
    """The suite's training batches: shuffled images, or random token windows."""
    batch = int(model_cfg.batch_size)
    if is_language_model(model_cfg):
        return D.TokenWindows(data.corpus.train, int(model_cfg.seq_len), batch, seed=seed)
    return D.ArrayBatches(data.images.train, batch, seed=seed)


def _eval_source(config, model_cfg, data: Data):
    if is_language_model(model_cfg):
        return D.WindowEvalBatches(
            data.corpus.valid,
            int(model_cfg.seq_len),
            int(model_cfg.eval_batch_size),
            max_windows=int(model_cfg.eval_windows),
        )
    return D.EvalBatches(data.images.test, int(config.eval_batch_size))


def _check_suite(name: str, m, mesh) -> None:
    reference = default_config.get_config(f"models={name}").models[name]
    try:
        common.check_config(m, reference, free=("model",))
    except common.ConfigError as e:
        raise common.ConfigError(f"models.{name}: {e}") from None
    if m.task not in TASKS:
        raise common.ConfigError(f"models.{name}.task must be one of {TASKS}, got {m.task!r}")
    for method in (*m.methods, *m.goal_methods):
        parse_method(method)
    if int(m.seeds) < 1 or int(m.sweep_seeds) < 0 or not m.sparsities:
        raise common.ConfigError(
            f"models.{name}: need seeds >= 1, sweep_seeds >= 0 and at least one sparsity"
        )
    if not 0.0 < float(m.lora.fraction) <= 1.0:
        raise common.ConfigError(
            f"models.{name}.lora.fraction (the LoRA-FA phase's length as a fraction of the run's "
            f"steps) must lie in (0, 1], got {m.lora.fraction}"
        )
    if not all(0.0 < float(s) < 1.0 for s in m.sparsities):
        raise common.ConfigError(
            f"models.{name}.sparsities must lie in (0, 1), got {tuple(m.sparsities)}"
        )
    # A run's directory and the report's columns name a sparsity by its percent: two of one
    # percent would share a checkpoint, a repeated one would count its runs twice as seeds.
    percents = [run_percent(s) for s in m.sparsities]
    if len(set(percents)) < len(percents):
        raise common.ConfigError(
            f"models.{name}.sparsities must differ in their whole percent, got "
            f"{tuple(m.sparsities)}"
        )
    listed = [*m.methods, *m.goal_methods]
    repeated = sorted({x for x in listed if listed.count(x) > 1})
    if repeated:
        raise common.ConfigError(
            f"models.{name}: methods and goal_methods name {', '.join(repeated)} more than once"
        )
    T.check_batch_size(int(m.batch_size), mesh, name=f"models.{name}.batch_size")
    if is_language_model(m):
        T.check_batch_size(int(m.eval_batch_size), mesh, name=f"models.{name}.eval_batch_size")


@common.reports_config_errors
def prepare(config, *, timed: bool = False) -> Data:
    """Check the config and load the data: every problem surfaces here, before compiling.

    ``timed``: the suites will be timed too, which builds RigL whatever the methods trained.

    Raises:
      common.ConfigError: a bad config entry, missing data, a batch that does not split over the
        devices, or a layer pattern that selects no layer.
    """
    common.check_config(config, default_config.get_config(), free=("models",))
    if not config.models:
        raise common.ConfigError("need at least one model")
    if not 0 < float(config.goal_sparsity) < 1:  # the report headed "Goals at 150% sparsity"
        raise common.ConfigError(f"goal_sparsity must be in (0, 1), got {config.goal_sparsity}")
    for key, low in (("repeats", 1), ("warmup", 0), ("clean_repeats", 1)):
        if int(config.speed[key]) < low:  # 0 repeats: a median of nothing, NaN ratios
            raise common.ConfigError(f"speed.{key} must be >= {low}, got {config.speed[key]}")
    mesh = T.data_mesh()
    T.check_batch_size(int(config.eval_batch_size), mesh, name="eval_batch_size")
    for name, m in config.models.items():
        _check_suite(name, m, mesh)
    tasks = {m.task for m in config.models.values()}
    try:
        images = (
            D.load_small_images(config.data.source, data_dir=config.data.data_dir or None)
            if "classification" in tasks
            else None
        )
        corpus = (
            D.load_corpus(config.data.corpus, config.data.path or None)
            if "language_modeling" in tasks
            else None
        )
    except (FileNotFoundError, ValueError) as e:
        raise common.ConfigError(str(e)) from None
    data = Data(images, corpus)
    for name, m in config.models.items():
        steps = steps_of(m, data)
        # RigL, SET and MEST update their masks; a suite that trains none of them has no schedule.
        updates = any(
            "unstructured" in baselines.READS[parse_method(method)[0]]
            for _, method, _, _ in run_plan(config, [name])
        )
        if updates and steps <= int(config.unstructured.update_every):
            raise common.ConfigError(
                f"model {name}: {steps} training steps leave no room for a mask update "
                f"every {config.unstructured.update_every} steps"
            )
        example = example_input(m, data)
        for model, method, sparsity, _ in run_plan(config, [name]):
            try:
                built = build(config, model, method, sparsity, 0, data, steps)
                dyn = baselines.with_sparsity(method_dynadiag(m, method), sparsity)
                block = baselines.block_size(built, dyn)
                common.check_layer_patterns(built.model, example, dyn, block_size=block)
                lora_phase(config, model, method, sparsity, data, steps)
            except ValueError as e:
                raise common.ConfigError(f"model {name}, method {method}: {e}") from None
        # the timing (train/speed.py) builds RigL's step at every sparsity, trained or not
        for sparsity in m.sparsities if timed else ():
            try:
                build(config, name, "rigl", float(sparsity), 0, data, steps)
            except ValueError as e:
                raise common.ConfigError(
                    f"model {name}: the timing builds RigL's step (--notiming skips it): {e}"
                ) from None
    return data


def fingerprint(config, model_name: str, method: str, steps: int) -> str:
    """Hash of :func:`recipe` (a changed setting retrains the run)."""
    return _digest(recipe(config, model_name, method, steps))


def _digest(parts) -> str:
    """A short hash of JSON-able ``parts`` (keys sorted)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def recipe(config, model_name: str, method: str, steps: int) -> dict:
    """The settings a run's result depends on, nested: the model, recipe and data; the sparse
    layers for sparse methods; the whole ``dynadiag`` section for DynaDiag (with the method's block
    size), and the ``unstructured`` section for RigL, SET and MEST (its distribution and fan-in for
    the fixed mask, which has no schedule). Entries added since are left out where their value
    changes nothing (element diagonals, no permutation, no working set), so that
    :func:`fingerprint` hashes the runs from before them as it did."""
    m = config.models[model_name]
    base, block = parse_method(method)
    if is_language_model(m):
        data = {
            "corpus": config.data.corpus,
            **{k: int(m[k]) for k in ("seq_len", "eval_windows")},
        }
        if config.data.path:  # the default corpora's runs hash as before a path could be given
            data["path"] = config.data.path
    else:
        data = {k: config.data[k] for k in ("source", "data_dir")}
    optimizer = m.optimizer.to_dict()
    if optimizer.get("sparse_lr_scale") == "none":  # hashes as before it could be chosen
        optimizer.pop("sparse_lr_scale")
    parts = {
        "model": m.model.to_dict(),
        "optimizer": optimizer,
        "batch_size": int(m.batch_size),
        "steps": steps,
        "data": data,
        "method": method,
    }
    if base != "dense":
        parts["layers"] = list(m.dynadiag.layers)
    if base == "dynadiag":
        section = method_dynadiag(m, method).to_dict()
        if section.get("block_size", 1) == 1:  # element diagonals hash as before blocks existed
            section.pop("block_size", None)
        # and runs without a permutation as before permutations existed
        if section.get("permutation", "none") != "learned":
            section.pop("permutation_penalty", None)
            section.pop("permutation_start", None)
            section.pop("permutation_relaxation", None)
        if section.get("permutation_relaxation") == "sinkhorn":  # as before it could be chosen
            section.pop("permutation_relaxation", None)
        if section.get("permutation", "none") == "none":
            section.pop("permutation", None)
        # and runs without a working set as before it existed
        if not section.get("working_set", 0.0):
            for key in ("working_set", "working_set_refresh", "working_set_start"):
                section.pop(key, None)
        parts["dynadiag"] = section
    if base == "static_diagonals":
        parts["fan_in"] = m.dynadiag.fan_in
        # the name's block size, else the section's (which the method reads too)
        block = int(method_dynadiag(m, method).get("block_size", 1))
        if block > 1:
            parts["block_size"] = block
        permutation = method_dynadiag(m, method).get("permutation", "none")
        if permutation != "none":
            parts["permutation"] = permutation
    if base in baselines.UNSTRUCTURED:
        section = config.unstructured.to_dict()
        # the entries the method reads (a fixed mask reads no schedule), else the section
        read = [r.split(".", 1)[1] for r in baselines.READS[base] if r.startswith("unstructured.")]
        parts["unstructured"] = {k: section[k] for k in read} if read else section
    if method_rank(method):
        parts["lora"] = m.lora.to_dict()
    return parts


def sparse_layer_density(params, shapes: dict[str, tuple[int, int]], adapters=None) -> float:
    """Non-zero over dense weights in the replaceable layers (frozen diagonals: every entry of
    ``values``, i.e. ``K*D`` for element and ``K*max(in, out)*b`` for block diagonals), LoRA-FA
    adapters included: ``B`` (``<path>/lora_b`` in ``params``) and ``A`` (``<path>/lora_a`` in
    ``adapters``, the ``"lora_frozen"`` collection), ``r * (in + out)`` weights per layer."""
    flat = traverse_util.flatten_dict(params, sep="/")
    frozen = traverse_util.flatten_dict(adapters or {}, sep="/")
    nonzero = total = 0
    for path, (n_in, n_out) in shapes.items():
        total += n_in * n_out
        for key in (f"{path}/lora_b", f"{path}/lora_a"):
            nonzero += int(np.size(flat.get(key, frozen.get(key, ()))))
        if f"{path}/kernel" in flat:
            nonzero += int(np.count_nonzero(np.asarray(flat[f"{path}/kernel"])))
        elif f"{path}/values" in flat and f"{path}/alpha" not in flat:
            nonzero += int(np.asarray(flat[f"{path}/values"]).size)
        else:
            raise ValueError(
                f"layer {path}: neither a dense kernel nor frozen diagonal values in {sorted(flat)}"
            )
    return nonzero / total


def mean_step_time(
    metrics_path, start: int = 0, stop: int | None = None, *, key: str = "step_time_s"
) -> float | None:
    """Mean of the logged ``key`` (the step time by default; any timing metric, e.g.
    ``beside_compile``) over training records with ``start < step <= stop``, leaving out the
    intervals a checkpoint was written beside (``beside_save``: Orbax's background write shares
    the cores with the steps after a save, e.g. for 50-150 of the MLP's steps after the
    freeze's), unless every interval in the range was."""
    records = [
        r
        for r in T.read_jsonl(metrics_path)
        if r.get("kind") == "train"
        and key in r
        and r["step"] > start
        and (stop is None or r["step"] <= stop)
    ]
    alone = [r for r in records if not r.get("beside_save")]
    times = [r[key] for r in alone or records]
    return float(np.mean(times)) if times else None


def loss_curve(metrics_path) -> list[tuple[int, float]]:
    """``[(step, training loss), ...]``: each logged interval's mean training loss."""
    return [
        (int(r["step"]), float(r["loss"]))
        for r in T.read_jsonl(metrics_path)
        if r.get("kind") == "train" and "loss" in r
    ]


def validation_curve(metrics_path) -> list[tuple[int, float]]:
    """``[(step, bits per token), ...]`` of a language model's logged evaluations."""
    return [
        (int(r["step"]), float(r["bits_per_token"]))
        for r in T.read_jsonl(metrics_path)
        if r.get("kind") == "eval" and "bits_per_token" in r
    ]


def train_built(
    config,
    data: Data,
    model_name: str,
    built,
    seed: int,
    steps: int,
    workdir,
    run_info=None,
    finetune=None,
    compile_first=False,
    checkpoints=True,
    initial_variables=None,
    progress=False,
):
    """``T.train`` of a built method (:class:`train.baselines.Method`) with suite ``model_name``'s
    recipe, data and logging: what every results run trains, whatever its model; ``steps`` in
    all, the last ones ``finetune``'s phase if given; ``compile_first`` as for ``T.train``;
    ``checkpoints=False`` saves only where the loop must (the freeze, the end), not every epoch
    (a quarter of the run for a language model); ``initial_variables`` and ``progress`` (a bar
    over the run's steps) as for ``T.train``."""
    m = config.models[model_name]
    lm = is_language_model(m)
    every = max(1, steps // 4) if lm else steps // int(m.epochs)
    return T.train(
        model=built.model,
        optimizer=built.optimizer,
        task=task_of(m, data),
        train_data=train_source(m, data, seed),
        eval_data=_eval_source(config, m, data),
        eval_every=int(m.eval_every) if lm else 0,
        num_steps=steps,
        example_input=example_input(m, data),
        seed=seed,
        freeze_step=built.freeze_step,
        gate=built.gate,
        working_set=built.working_set,
        workdir=workdir,
        checkpoint_every=every if checkpoints else 0,
        keep_checkpoints=1,
        log_every=50,
        learning_rate=built.learning_rate,
        progress=progress,
        tensorboard=False,
        run_info=run_info,
        finetune=finetune,
        compile_first=compile_first,
        initial_variables=initial_variables,
    )


def leaves_named(tree, name: str) -> dict[tuple, object]:
    """``{path of the parent: leaf}`` for every leaf called ``name`` in a nested mapping."""
    return {k[:-1]: v for k, v in traverse_util.flatten_dict(tree).items() if k[-1] == name}


def initial_state(built, example, seed: int):
    """The ``T.TrainState`` a run of ``built`` starts from, its init compiled as one program
    (called eagerly, it dispatches op by op)."""
    return jax.jit(lambda: T.create_train_state(built.model, built.optimizer, example, seed=seed))()


def start_permutations(params, diagonals=None) -> dict[str, np.ndarray]:
    """``{layer path: perm[in]}``: the permutation each learned layer's ``perm_soft`` stands for
    at the start (what the freeze would harden it to there, :func:`perms.harden`: for the random
    start, the permutation it started half on; for the ``"blocks"`` relaxation, whose base
    permutation is in ``diagonals``, :func:`perms.harden_blocks`)."""
    bases = {"/".join(p): v for p, v in leaves_named(diagonals or {}, "perm").items()}
    out = {}
    for path, soft in leaves_named(params, "perm_soft").items():
        name = "/".join(path)
        hard = perms.harden_blocks(soft, bases[name]) if name in bases else perms.harden(soft)
        out[name] = np.asarray(hard)
    return out


def rows_moved(start: dict[str, np.ndarray], diagonals) -> dict[str, float]:
    """Per learned layer, the share of input positions whose frozen ``perm`` (in the
    ``"diagonals"`` collection) differs from its :func:`start_permutations` entry.

    Raises:
      ValueError: a layer of ``start`` with no ``perm`` in ``diagonals`` (not frozen yet).
    """
    final = {"/".join(path): np.asarray(v) for path, v in leaves_named(diagonals, "perm").items()}
    missing = sorted(set(start) - set(final))
    if missing:
        raise ValueError(f"no frozen perm for the learned layers {missing}")
    return {path: float(np.mean(final[path] != perm)) for path, perm in start.items()}


def train_run(
    config,
    data: Data,
    spec,
    steps: int,
    workdir: pathlib.Path,
    fp: str,
    *,
    compile_first: bool = False,
    checkpoints: bool = True,
) -> dict:
    """Train one ``(model, method, sparsity, seed)`` run of ``steps`` (more with a LoRA-FA
    phase: :func:`lora_steps`) and return its record (``compile_first`` as for ``T.train``,
    ``checkpoints`` as for :func:`train_built`)."""
    model_name, method, sparsity, seed = spec
    m = config.models[model_name]
    lm = is_language_model(m)
    built = build(config, model_name, method, sparsity, seed, data, steps)
    phase = lora_phase(config, model_name, method, sparsity, data, steps)
    total = steps + lora_steps(m, method, steps)
    example = example_input(m, data)
    perm_start, initial = {}, None
    if method_dynadiag(m, method).permutation == "learned" and built.freeze_step is not None:
        # The run's own init (same model and seed), built once: the run starts from it, and each
        # learned layer's search start is read from it.
        state = initial_state(built, example, seed)
        initial = T.variables_of(state)
        perm_start = start_permutations(state.params, state.collections.get("diagonals"))
    load_before = os.getloadavg()[0]
    start, cpu_start = time.perf_counter(), time.process_time()
    run_info = {"model": model_name, "method": method, "sparsity": sparsity, "fingerprint": fp}
    result = train_built(
        config,
        data,
        model_name,
        built,
        seed,
        total,
        workdir,
        run_info,
        finetune=phase,
        compile_first=compile_first,
        initial_variables=initial,
        checkpoints=checkpoints,
    )
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    shapes = common.layer_shapes(built.model, example)
    metrics_path = workdir / "metrics.jsonl"
    ev = result.eval_metrics
    record = {
        "model": model_name,
        "method": method,
        "sparsity": sparsity,
        "seed": seed,
        "fingerprint": fp,
        "loss": ev["loss"],
        "steps": total,
        "seconds": seconds,
        # Processor time of every thread: less sensitive to other programs than wall time.
        "cpu_seconds": cpu_seconds,
        "load_average": [load_before, os.getloadavg()[0]],
        "resumed_at": result.start_step,
        "density": sparse_layer_density(
            result.state.params, shapes, result.state.collections.get("lora_frozen")
        ),
        "step_time_s": mean_step_time(metrics_path),
        # the share of the logged intervals that ran beside a background compile
        "beside_compile": mean_step_time(metrics_path, key="beside_compile"),
        "loss_curve": loss_curve(metrics_path),
    }
    if lm:
        record.update(
            perplexity=ev["perplexity"],
            bits_per_byte=ev["bits_per_token"],
            curve=validation_curve(metrics_path),
        )
    else:
        record["accuracy"] = ev["accuracy"]
    if perm_start:
        diagonals = result.state.collections["diagonals"]
        record["perm_rows_moved"] = rows_moved(perm_start, diagonals)
    if built.freeze_step is not None:
        record["search_step_time_s"] = mean_step_time(metrics_path, 0, built.freeze_step)
        record["frozen_step_time_s"] = mean_step_time(metrics_path, built.freeze_step, steps)
    if phase is not None:
        record["lora_steps"] = total - steps
        record["lora_step_time_s"] = mean_step_time(metrics_path, steps)
        metric = "perplexity" if lm else "accuracy"
        record[f"{metric}_before_lora"] = finetuning.metric_before(metrics_path, steps, metric)
    return record


def read_records(path: pathlib.Path) -> list[dict]:
    return list(T.read_jsonl(path))


# What the clean runs of time_suites train, per suite (seed 0, at config.goal_sparsity): the
# methods the search-cost goals compare.
CLEAN_METHODS = ("dense", "static_diagonals", "dynadiag")
CLEAN_KEYS = ("step_time_s", "search_step_time_s", "frozen_step_time_s", "seconds")


# Where Debian's libjemalloc2 puts the allocator the clean runs preload (docs/cpu_kernels.md):
# with glibc's a process's steps run in a page-faulting or a fault-free mode, and the mode can
# change mid-run (a GPT static-diagonal run logged 22 ms steps for 400 steps, then 15 ms).
JEMALLOC = pathlib.Path("/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"


def cold_compiles() -> None:
    """Switch JAX's persistent compilation cache off in this process (before its first compile).

    The report times whole runs with their compilation, and a user's environment may switch the
    cache on (JAX_COMPILATION_CACHE_DIR), which would serve a run the programs an earlier one
    compiled: the campaign's process and each clean run's call this first.
    """
    jax.config.update("jax_enable_compilation_cache", False)


def merge_timings(old: dict | None, timings: dict, clean: dict, recipes: dict) -> dict:
    """``timings`` of the suites in ``recipes`` (their clean runs ``clean``) over the ``old``
    ones of ``speed.json``: a re-timed suite keeps none of its old entries, clean runs included
    (none when it trains no run at the goal sparsity), so none is judged under the new recipe."""
    old = old or {"models": {}}
    timings["models"] = {**old.get("models", {}), **timings["models"]}
    kept = {s: runs for s, runs in old.get("clean_runs", {}).items() if s not in recipes}
    timings["clean_runs"] = {**kept, **clean}
    timings["recipes"] = {**old.get("recipes", {}), **recipes}
    return timings


def clean_specs(config, suites) -> list[tuple[str, str, float, int]]:
    """``(suite, method, sparsity, seed)`` of the clean runs: :data:`CLEAN_METHODS` at
    ``config.goal_sparsity`` (dense at 0), seed 0, for the ``suites`` that train that sparsity."""
    goal = float(config.goal_sparsity)
    return [
        (name, method, goal if method != "dense" else 0.0, 0)
        for name in suites
        if goal in [float(s) for s in config.models[name].sparsities]
        for method in CLEAN_METHODS
    ]


def clean_runs(config, suites, workdir: pathlib.Path, *, progress: bool = True) -> dict:
    """``{suite: {method: {key: value}}}`` of :data:`CLEAN_METHODS` trained afresh with
    ``compile_first`` under ``workdir/clean_runs``, each in a new process (logged step times
    with no background compile beside them, and no memory or threads left by earlier work in the
    process: after the side-by-side timings a Mixer search step logged 1.7x its frozen step where
    fresh processes logged 1.2-1.4x), with jemalloc preloaded where installed (:data:`JEMALLOC`)
    and no checkpoint but the freeze's and the last (a save's background write slows the steps
    after it: an MLP static-diagonal run logged 0.52 ms per step with one per epoch, 0.32 without).
    Every run is trained ``config.speed.clean_repeats`` times, the methods taking turns, and each
    key is the least over the repeats: the host's speed can change for tens of seconds (a Mixer
    static-diagonal run logged 3.9 ms steps for its first 1,100 steps, then 2.3 ms; a DynaDiag
    one 3.7-4.0 ms through all its 1,872 steps, where the next logged 2.2-2.5 ms), which one run
    per method would charge to whichever method it hit, and a median of three when it hits two.
    Such spells only ever add time, so the fastest run is the closest to the steps' own. Values:
    the keys :data:`CLEAN_KEYS` of the records (and ``<key>_runs``, every repeat's value, in
    order), ``allocator`` and ``repeats``."""
    specs = clean_specs(config, suites)
    repeats = int(config.speed.clean_repeats)
    runs = {}
    spawn = multiprocessing.get_context("spawn")
    env = {"LD_PRELOAD": str(JEMALLOC), "MALLOC_CONF": JEMALLOC_CONF} if JEMALLOC.exists() else {}
    plan = [(repeat, spec) for repeat in range(repeats) for spec in specs]
    for repeat, spec in tqdm.tqdm(plan, unit="run", disable=not progress, desc="clean runs"):
        with _environment(env), concurrent.futures.ProcessPoolExecutor(1, mp_context=spawn) as pool:
            record = pool.submit(_clean_run, config, spec, workdir, repeat).result()
        runs.setdefault(spec[:2], []).append(record)
    return least_over_repeats(runs, "jemalloc" if env else "system")


def least_over_repeats(runs: dict, allocator: str) -> dict:
    """``{suite: {method: {key: value}}}`` from ``{(suite, method): [record per repeat]}``: each
    of :data:`CLEAN_KEYS` the records have, as its least value (None where no repeat logged one)
    and ``<key>_runs``, every logged value in order; ``allocator`` and ``repeats`` beside them."""
    out = {}
    for (name, method), records in runs.items():
        least = {}
        for k in (k for k in CLEAN_KEYS if any(k in r for r in records)):
            values = [r[k] for r in records if r.get(k) is not None]
            least[k] = min(values) if values else None  # None: never logged
            least[f"{k}_runs"] = values
        least.update(allocator=allocator, repeats=len(records))
        out.setdefault(name, {})[method] = least
    return out


@contextlib.contextmanager
def _environment(changes: dict):
    """``os.environ`` updated by ``changes`` inside the block (what a spawned child inherits)."""
    before = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _clean_run(config, spec, workdir: pathlib.Path, repeat: int) -> dict:
    cold_compiles()
    name, method = spec[:2]
    data = prepare(config)
    steps = steps_of(config.models[name], data)
    fp = fingerprint(config, name, method, steps)
    run_dir = workdir / "clean_runs" / name / f"{method}_{fp}_{repeat}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: a resumed one would not train
    record = train_run(
        config, data, spec, steps, run_dir, fp, compile_first=True, checkpoints=False
    )
    return {k: record[k] for k in CLEAN_KEYS if k in record}
