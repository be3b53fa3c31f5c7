"""The DynaDiag-specific part of training: gate schedule, freeze, selection and layer metrics.

Everything here reads DiagonalDense's variables as ``dd.nn.DiagonalDense`` documents them:
search phase ``params/<path>/{alpha, values}`` and ``dynadiag/<path>/{strength | temperature,
score, topk}``; frozen phase ``params/<path>/values`` and ``diagonals/<path>/offsets``. A model
without DiagonalDense layers passes through every function unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

import dynadiag_jax as dd
from dynadiag_jax._checks import int_at_least
from dynadiag_jax.nn.functional import DIAGONALS_COLLECTION, GATE_COLLECTION, HYPER_NAME
from dynadiag_jax.training.state import TrainState
from dynadiag_jax.training.working_set import leave_working_set

__all__ = [
    "GateSchedule",
    "apply_gate",
    "rescore",
    "freeze_state",
    "is_searching",
    "kept_offsets",
    "layer_metrics",
    "parameter_counts",
    "ParameterCounts",
]

# Intermediates sown by DiagonalDense, renamed for the metric logs.
_METRIC_NAMES = {"gate_nonzero": "effective_k"}


class GateSchedule(NamedTuple):
    """How the gate's hyper-parameter moves during the search phase.

    Attributes:
      name: ``"strength"`` (``gate="sparse_topk"``) or ``"temperature"`` (``gate="softmax"``).
      schedule: ``step -> value`` (e.g. ``dd.schedules.cosine(5.0, 0.05, freeze_step)``).
      score_every: for ``explore="dense_score"`` layers, score every diagonal on each step that
        is a multiple of this (0: never).
      rescore_step: at this step (> 0) every layer's ``alpha`` restarts from its values
        (:func:`dynadiag_jax.nn.alpha_from_values` at the current strength); 0: never.
    """

    name: str
    schedule: Callable
    score_every: int = 0
    rescore_step: int = 0

    def check(self) -> GateSchedule:
        if self.name not in HYPER_NAME.values():
            raise ValueError(f"gate name must be 'strength' or 'temperature', got {self.name!r}")
        if not callable(self.schedule):
            raise TypeError(
                f"GateSchedule.schedule must be a function step -> value (e.g. "
                f"dd.schedules.constant(...)), got {type(self.schedule).__name__}"
            )
        # int_at_least: 2.5 scored at steps 0, 5, 10 and a rescore at 2.5 never came
        int_at_least(self.score_every, "score_every", 0)
        int_at_least(self.rescore_step, "rescore_step", 0)
        return self


def _leaves(tree, name: str) -> dict[str, Any]:
    """``{layer path: leaf}`` for every leaf called ``name`` in the nested dict ``tree``."""
    flat = traverse_util.flatten_dict(tree) if tree else {}
    return {"/".join(k[:-1]): v for k, v in flat.items() if k[-1] == name}


def is_searching(params) -> bool:
    """Whether any DiagonalDense layer in ``params`` is in the search phase (an ``alpha`` beside
    its ``values``: a model's own parameter named ``alpha`` is none)."""
    return any(jax.tree.leaves(dd.optim.alpha_mask(params))) if params else False


def apply_gate(collections: dict, gate: GateSchedule | None, step) -> dict:
    """``collections`` with every layer's gate hyper-parameter set for ``step`` (jit-able)."""
    if gate is None or GATE_COLLECTION not in collections:
        return collections
    kwargs = {gate.name: gate.schedule(step)}
    if gate.score_every:
        kwargs["score"] = (step % gate.score_every) == 0
    return dict(dd.nn.set_gate(collections, **kwargs))


def rescore(params, gate: GateSchedule | None, step):
    """``params`` with every layer's ``alpha`` restarted from its values on ``gate.rescore_step``
    (jit-able; unchanged on other steps or without a rescore step)."""
    if gate is None or not gate.rescore_step:
        return params
    return jax.lax.cond(
        step == gate.rescore_step,
        lambda p: dd.nn.alpha_from_values(p, gate.schedule(step)),
        lambda p: p,
        params,
    )


def freeze_state(state: TrainState) -> TrainState:
    """The compact frozen form of ``state``: hard top-K by ``alpha`` in every search-phase layer.

    Parameters, collections and the optimizer state all switch (``alpha`` and its optimizer
    moments are dropped; the kept rows of ``values`` keep theirs). A state in the working-set form
    (:func:`~dynadiag_jax.training.enter_working_set`) leaves it first
    (:func:`~dynadiag_jax.training.leave_working_set`): the kept top K by alpha may include a
    candidate outside the working set, which keeps its stored values and gets zero moments, as
    if it had entered. Pure and jit-able.
    """
    state = leave_working_set(state)
    before = {"params": state.params, **state.collections}
    after = dict(dd.freeze_tree(before))
    params = after.pop("params")
    opt_state = dd.freeze_opt_state(state.opt_state, state.params, params)
    return state._replace(params=params, opt_state=opt_state, collections=after)


def _check_mapping(tree, name: str, what: str, example: str) -> None:
    """Raises ``TypeError`` naming ``what``'s argument ``name`` unless ``tree`` is a mapping
    (else the first access fails as an AttributeError or an assertion in flax)."""
    if not isinstance(tree, Mapping):
        raise TypeError(
            f"{what}: {name} must be a mapping such as {example}, got {type(tree).__name__}"
        )


def kept_offsets(collections) -> dict[str, np.ndarray]:
    """``{layer path: offsets}``: the frozen diagonals, or while searching the top-K by alpha as
    the last step's forward pass saw it (before that step's update of alpha; the freeze ranks the
    alpha after it).

    ``collections``: the model's non-param collections (``state.collections``); ``TypeError``
    for anything but a mapping."""
    _check_mapping(collections, "collections", "kept_offsets", "state.collections")
    out = _leaves(collections.get(DIAGONALS_COLLECTION, {}), "offsets")
    for p, v in _leaves(collections.get(GATE_COLLECTION, {}), "topk").items():
        out.setdefault(p, v)
    return {p: np.asarray(jax.device_get(v)) for p, v in sorted(out.items())}


def layer_metrics(intermediates) -> dict[str, jax.Array]:
    """Sown per-layer scalars as ``{"<name>/<layer path>": value}`` (``effective_k`` etc.); a
    layer stacked by ``nn.scan`` / ``nn.vmap`` sows one per member, logged as
    ``"<name>/<layer path>/<index>"`` (``i,j`` for two stacking axes)."""
    flat = traverse_util.flatten_dict(intermediates) if intermediates else {}
    out = {}
    for key, value in flat.items():
        name = _METRIC_NAMES.get(key[-1], key[-1])
        value = jnp.asarray(value[0] if isinstance(value, tuple) else value, jnp.float32)
        label = f"{name}/{'/'.join(key[:-1])}"
        if value.ndim == 0:
            out[label] = value
            continue
        for index in np.ndindex(value.shape):
            out[f"{label}/{','.join(map(str, index))}"] = value[index]
    return out


class ParameterCounts(NamedTuple):
    """Parameter counts of a model's variables.

    Attributes:
      total: every parameter (search phase: all ``P`` candidate diagonals and ``alpha``).
      diagonal: entries of diagonal ``values`` (frozen: exactly the non-zero weights ``K * D``).
      alpha: selection scores (0 once frozen).
      other: every other parameter (dense layers, embeddings, norms, biases).
    """

    total: int
    diagonal: int
    alpha: int
    other: int


def parameter_counts(params) -> ParameterCounts:
    """Count the parameters of ``params`` by role (see :class:`ParameterCounts`); ``TypeError``
    if ``params`` is not a mapping (the ``"params"`` collection)."""
    _check_mapping(params, "params", "parameter_counts", "state.params")
    diag_layers = set(_leaves(params, "values"))
    flat = traverse_util.flatten_dict(params)
    diagonal = alpha = other = 0
    for key, leaf in flat.items():
        n = int(np.prod(np.shape(leaf)))
        layer = "/".join(key[:-1])
        if layer in diag_layers and key[-1] == "values":
            diagonal += n
        elif layer in diag_layers and key[-1] == "alpha":
            alpha += n
        else:
            other += n
    return ParameterCounts(diagonal + alpha + other, diagonal, alpha, other)
