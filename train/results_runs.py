"""The training runs behind the results command (``train/results.py``): plan, build, train, record.

Kept apart from the script so tests import it without defining absl flags.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from dynadiag_jax import data as D
from dynadiag_jax import training as T
from train import baselines, common
from train.configs import results as default_config

ACCURACY_FILE = "accuracy.jsonl"
SPEED_FILE = "speed.json"


def run_plan(config) -> list[tuple[str, str, float, int]]:
    """``(model, method, sparsity, seed)`` of every training run; dense runs once per seed."""
    plan = []
    for model in config.models:
        for seed in range(int(config.seeds)):
            for method in config.methods:
                for sparsity in (0.0,) if method == "dense" else config.sparsities:
                    plan.append((model, method, float(sparsity), seed))
    return plan


def steps_of(model_cfg, data) -> int:
    return int(model_cfg.epochs) * (len(data.train["label"]) // int(model_cfg.batch_size))


def build(
    config, model_name: str, method: str, sparsity: float, seed: int, data, steps: int
) -> baselines.Method:
    m = config.models[model_name]
    return baselines.build(
        method,
        model_cfg=m.model,
        dynadiag_cfg=m.dynadiag,
        unstructured_cfg=config.unstructured,
        optimizer_cfg=m.optimizer,
        sparsity=sparsity,
        num_steps=steps,
        warmup_steps=int(m.optimizer.warmup_steps),
        seed=seed,
        num_classes=data.num_classes,
    )


def example_input(model_cfg, data) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(
        (int(model_cfg.batch_size), *data.train["image"].shape[1:]), jnp.float32
    )


def prepare(config):
    """Check the config and load the data: every problem surfaces here, before compiling."""
    common.check_config(config, default_config.get_config(), free=("models",))
    unknown = sorted(set(config.methods) - set(baselines.METHODS))
    if unknown:
        raise common.ConfigError(
            f"unknown methods {unknown}; known: {', '.join(baselines.METHODS)}"
        )
    if int(config.seeds) < 1 or not config.models or not config.sparsities:
        raise common.ConfigError("need at least one seed, one model and one sparsity")
    if not all(0.0 < float(s) < 1.0 for s in config.sparsities):
        raise common.ConfigError(f"sparsities must lie in (0, 1), got {tuple(config.sparsities)}")
    try:
        data = D.load_small_images(config.data.source, data_dir=config.data.data_dir or None)
    except (FileNotFoundError, ValueError) as e:
        raise common.ConfigError(str(e)) from None
    mesh = T.data_mesh()
    T.check_batch_size(int(config.eval_batch_size), mesh, name="eval_batch_size")
    for name, m in config.models.items():
        T.check_batch_size(int(m.batch_size), mesh)
        steps = steps_of(m, data)
        if steps <= int(config.unstructured.update_every):
            raise common.ConfigError(
                f"model {name}: {steps} training steps leave no room for a mask update "
                f"every {config.unstructured.update_every} steps"
            )
        for method in config.methods:
            for sparsity in (0.0,) if method == "dense" else config.sparsities:
                built = build(config, name, method, sparsity, 0, data, steps)
                common.check_layer_patterns(built.model, example_input(m, data), m.dynadiag)
    return data


def fingerprint(config, model_name: str, method: str, steps: int) -> str:
    """Hash of the settings a run's result depends on (a changed one retrains the run): the model,
    recipe and data; the sparse layers for sparse methods; the whole ``dynadiag`` section for
    DynaDiag, and the ``unstructured`` section for RigL, SET and MEST."""
    m = config.models[model_name]
    parts = {
        "model": m.model.to_dict(),
        "optimizer": m.optimizer.to_dict(),
        "batch_size": int(m.batch_size),
        "steps": steps,
        "data": config.data.to_dict(),
        "method": method,
    }
    if method != "dense":
        parts["layers"] = list(m.dynadiag.layers)
    if method == "dynadiag":
        parts["dynadiag"] = m.dynadiag.to_dict()
    if method in baselines.UNSTRUCTURED:
        parts["unstructured"] = config.unstructured.to_dict()
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


def sparse_layer_density(params, shapes: dict[str, tuple[int, int]]) -> float:
    """Non-zero over dense weights in the replaceable layers (frozen diagonals: K*D/(in*out))."""
    flat = traverse_util.flatten_dict(params, sep="/")
    nonzero = total = 0
    for path, (n_in, n_out) in shapes.items():
        total += n_in * n_out
        if f"{path}/kernel" in flat:
            nonzero += int(np.count_nonzero(np.asarray(flat[f"{path}/kernel"])))
        elif f"{path}/values" in flat and f"{path}/alpha" not in flat:
            nonzero += int(np.asarray(flat[f"{path}/values"]).size)
        else:
            raise ValueError(
                f"layer {path}: neither a dense kernel nor frozen diagonal values in {sorted(flat)}"
            )
    return nonzero / total


def mean_step_time(metrics_path, start: int = 0, stop: int | None = None) -> float | None:
    """Mean of the logged ``step_time_s`` over training records with ``start < step <= stop``."""
    times = [
        r["step_time_s"]
        for r in T.read_jsonl(metrics_path)
        if r.get("kind") == "train"
        and "step_time_s" in r
        and r["step"] > start
        and (stop is None or r["step"] <= stop)
    ]
    return float(np.mean(times)) if times else None


def train_run(config, data, spec, steps: int, workdir: pathlib.Path, fp: str) -> dict:
    """Train one ``(model, method, sparsity, seed)`` run and return its record."""
    model_name, method, sparsity, seed = spec
    m = config.models[model_name]
    built = build(config, model_name, method, sparsity, seed, data, steps)
    example = example_input(m, data)
    start = time.perf_counter()
    result = T.train(
        model=built.model,
        optimizer=built.optimizer,
        task=T.Classification(data.num_classes, float(m.optimizer.label_smoothing)),
        train_data=D.ArrayBatches(data.train, int(m.batch_size), seed=seed),
        eval_data=D.EvalBatches(data.test, int(config.eval_batch_size)),
        num_steps=steps,
        example_input=example,
        seed=seed,
        freeze_step=built.freeze_step,
        gate=built.gate,
        workdir=workdir,
        checkpoint_every=len(data.train["label"]) // int(m.batch_size),
        keep_checkpoints=1,
        log_every=50,
        learning_rate=built.learning_rate,
        progress=False,
        tensorboard=False,
        run_info={"model": model_name, "method": method, "sparsity": sparsity, "fingerprint": fp},
    )
    seconds = time.perf_counter() - start
    shapes = common.layer_shapes(built.model, example)
    metrics_path = workdir / "metrics.jsonl"
    record = {
        "model": model_name,
        "method": method,
        "sparsity": sparsity,
        "seed": seed,
        "fingerprint": fp,
        "accuracy": result.eval_metrics["accuracy"],
        "loss": result.eval_metrics["loss"],
        "steps": steps,
        "seconds": seconds,
        "resumed_at": result.start_step,
        "density": sparse_layer_density(result.state.params, shapes),
        "step_time_s": mean_step_time(metrics_path),
    }
    if built.freeze_step is not None:
        record["search_step_time_s"] = mean_step_time(metrics_path, 0, built.freeze_step)
        record["frozen_step_time_s"] = mean_step_time(metrics_path, built.freeze_step)
    return record


def read_records(path: pathlib.Path) -> list[dict]:
    return list(T.read_jsonl(path))
