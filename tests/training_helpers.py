"""Shared pieces of the training tests: tiny data, tiny models, a compilation counter, a hook
that crashes a run at a step."""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynadiag_jax as dd
from dynadiag_jax import data as D
from dynadiag_jax import models
from dynadiag_jax import training as T
from dynadiag_jax.training.loop import TIMING_METRICS

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
NUM_CLASSES = 4
FEATURES = 16


class CompileCounter:
    """Counts XLA backend compilations while active: ``with CompileCounter() as c: ...``.

    ``count``: all of them, on any thread; ``on_caller``: the names (``"jit(f)"``) of those made
    on the thread that entered the counter (not on a background compile's worker).
    """

    def __init__(self):
        self.count = 0
        self.on_caller = []
        self._caller = threading.get_ident()

    def _listener(self, event, duration, **kwargs):
        del duration
        if event == COMPILE_EVENT:
            self.count += 1
            if threading.get_ident() == self._caller:
                self.on_caller.append(kwargs.get("fun_name"))

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


def blobs(n: int = 256, seed: int = 0) -> dict:
    """``{"image": float32 [n, 16], "label": int32 [n]}``: four Gaussian clusters."""
    centres = (
        np.random.default_rng(1234).normal(size=(NUM_CLASSES, FEATURES)).astype(np.float32) * 2
    )
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, NUM_CLASSES, n).astype(np.int32)
    images = centres[labels] + rng.normal(size=(n, FEATURES)).astype(np.float32)
    return {"image": images, "label": labels}


def tiny_mlp(sparsity: float | None = None, hidden=(32, 32), **layer_kwargs) -> models.MLP:
    """A 16-32-32-4 MLP; with ``sparsity`` its hidden layers are DiagonalDense."""
    if sparsity is None:
        return models.MLP(NUM_CLASSES, hidden=hidden)
    sparse = functools.partial(dd.nn.DiagonalDense, sparsity=sparsity, **layer_kwargs)
    return models.MLP(
        NUM_CLASSES, hidden=hidden, dense=models.ByPath(models.mlp.SPARSE_LAYERS, sparse=sparse)
    )


def train_tiny(
    workdir=None,
    *,
    num_steps: int = 12,
    sparsity: float | None = None,
    freeze_step=None,
    batch_size: int = 16,
    seed: int = 0,
    hooks=(),
    checkpoint_every: int = 2,
    eval_every: int = 0,
    selection_every: int = 0,
    log_every: int = 1,
    run_info=None,
    mesh=None,
    model=None,
    eval_data=None,
    optimizer=None,
    **kwargs,
) -> T.TrainResult:
    """Train :func:`tiny_mlp` (or ``model``) on :func:`blobs` (evaluated on a second draw of
    blobs)."""
    model = tiny_mlp(sparsity) if model is None else model
    gate = None
    if sparsity is not None:
        gate = T.GateSchedule(
            "strength", dd.schedules.cosine(1.0, 0.05, max(1, freeze_step or num_steps))
        )
    return T.train(
        model=model,
        optimizer=T.adamw(1e-2, weight_decay=1e-4) if optimizer is None else optimizer,
        task=T.Classification(NUM_CLASSES),
        train_data=D.ArrayBatches(blobs(), batch_size, seed=seed),
        num_steps=num_steps,
        example_input=jax.ShapeDtypeStruct((batch_size, FEATURES), jnp.float32),
        seed=seed,
        eval_data=D.EvalBatches(blobs(100, seed=1), 32) if eval_data is None else eval_data,
        eval_every=eval_every,
        freeze_step=freeze_step,
        gate=gate,
        workdir=workdir,
        checkpoint_every=checkpoint_every if workdir else 0,
        log_every=log_every,
        selection_every=selection_every,
        mesh=mesh,
        progress=False,
        hooks=hooks,
        run_info={"sparsity": sparsity} if run_info is None else run_info,
        **kwargs,
    )


def comparable(records):
    """Metric records without the wall-clock timings (which differ between any two runs)."""
    return [{k: v for k, v in r.items() if k not in TIMING_METRICS} for r in records]


def assert_resumed_as_uninterrupted(resumed, full, resumed_dir, full_dir):
    """A resumed run ended as the uninterrupted one: evaluation, params, optimizer state and
    its metrics log (timings aside)."""
    assert resumed.eval_metrics == full.eval_metrics
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, full.state.params)
    jax.tree.map(np.testing.assert_array_equal, resumed.state.opt_state, full.state.opt_state)
    a = comparable(T.read_jsonl(full_dir / "metrics.jsonl"))
    b = comparable(T.read_jsonl(resumed_dir / "metrics.jsonl"))
    assert a == b


@pytest.fixture
def fast_compile():
    """Skip most XLA optimisations (as flax's example tests do): tests only check behaviour."""
    before = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", before)


class Crash(Exception):
    pass


def crash_at(step):
    """A ``train(hooks=...)`` hook that raises :class:`Crash` after step ``step``."""

    def hook(s, state):
        if s == step:
            raise Crash(s)

    return hook
