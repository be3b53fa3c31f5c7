"""``set_gate``: write the gate hyper-parameters of every search-phase layer in a model at once."""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp

from dynadiag_jax.nn.diagonal_dense import _positive_scalar

__all__ = ["set_gate"]

COLLECTION = "dynadiag"


def _replace(tree, updates: dict):
    if isinstance(tree, Mapping):
        return {
            key: (
                updates[key](value)
                if key in updates and not isinstance(value, Mapping)
                else _replace(value, updates)
            )
            for key, value in tree.items()
        }
    return tree


def set_gate(variables, *, strength=None, temperature=None, score=None):
    """``variables`` with every layer's ``"dynadiag"`` entries replaced (pure, jit-able).

    Args:
      variables: a model's variables (``{"params": ..., "dynadiag": ..., ...}``).
      strength: new ``strength`` of every ``gate="sparse_topk"`` layer (positive scalar).
      temperature: new ``temperature`` of every ``gate="softmax"`` layer (positive scalar).
      score: bool scalar, sets the dense-scoring flag of ``explore="dense_score"`` layers.

    Returns:
      A new variables dict; other collections are shared, not copied. Variables without a
      ``"dynadiag"`` collection (e.g. a fully frozen model) come back unchanged.

    Raises:
      ValueError: nothing to set, or a concrete strength/temperature <= 0.
    """
    if strength is None and temperature is None and score is None:
        raise ValueError("set_gate needs strength=, temperature= and/or score=")
    _positive_scalar(strength, "strength")
    _positive_scalar(temperature, "temperature")
    if not isinstance(variables, Mapping):
        raise TypeError(
            f"variables must be a mapping of collections, got {type(variables).__name__}"
        )
    if COLLECTION not in variables:
        return variables
    updates = {}
    for name, value in (("strength", strength), ("temperature", temperature)):
        if value is not None:
            updates[name] = lambda old, value=value: jnp.broadcast_to(
                jnp.asarray(value, jnp.float32), jnp.shape(old)
            )
    if score is not None:
        updates["score"] = lambda old: jnp.broadcast_to(
            jnp.asarray(score, jnp.bool_), jnp.shape(old)
        )
    out = dict(variables)
    out[COLLECTION] = _replace(variables[COLLECTION], updates)
    return out
