"""``set_gate``: write the gate hyper-parameters of every search-phase layer in a model at once;
``alpha_from_values``: restart every layer's scores from what its values learned."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from flax.core import FrozenDict

from dynadiag_jax._checks import refuse_nnx
from dynadiag_jax.nn.functional import GATE_COLLECTION, HYPER_NAME
from dynadiag_jax.topk import check_gate_value

__all__ = ["alpha_from_values", "set_gate"]

# The gate each gate-state entry belongs to, for the error that names the gates present.
_OWNER = {hyper: f"gate={gate!r}" for gate, hyper in HYPER_NAME.items()}
_OWNER["score"] = "every search-phase layer"


def _describe(found: Counter) -> str:
    gates = [
        f"{name}= ({_OWNER[name]}) in {n} layer{'s' * (n != 1)}"
        for name, n in sorted(found.items())
        if name != "score"
    ]
    return ", ".join(gates) or "no gate hyper-parameter"


def check_score(score, fn: str) -> None:
    """Rejects a dense-scoring flag that is not a bool or a bool array (traced or not): any other
    value would be stored as its truth value (``"no"`` as True)."""
    if not isinstance(score, bool) and getattr(score, "dtype", None) != jnp.bool_:
        raise TypeError(f"{fn}: score must be a bool (or a bool array), got {score!r}")


def check_scale(value, name: str, fn: str) -> None:
    """Rejects a concrete scale of the scores that is not a number > 0 everywhere: 0 would erase
    their ranking, a negative value reverse it. A traced value is not checked."""
    if isinstance(value, jax.core.Tracer):
        return
    arr = np.asarray(value)
    real = jnp.issubdtype(arr.dtype, jnp.integer) or jnp.issubdtype(arr.dtype, jnp.floating)
    if isinstance(value, bool) or not real:  # jnp's test: numpy's misses bfloat16
        raise TypeError(f"{fn}: {name} must be a number > 0, got {value!r}")
    if not np.all(arr > 0):
        raise ValueError(
            f"{fn}: {name} must be > 0 (it scales the scores: 0 would erase their ranking, a "
            f"negative value reverse it), got {value!r}"
        )


def set_gate(variables, *, strength=None, temperature=None, score=None):
    """``variables`` with every layer's ``"dynadiag"`` entries replaced (pure, jit-able).

    Args:
      variables: a model's variables (``{"params": ..., "dynadiag": ..., ...}``).
      strength: new ``strength`` of every ``gate="sparse_topk"`` layer (scalar ``>= 0``; 0 is the
        hard top-K, see :func:`dynadiag_jax.sparse_soft_topk`).
      temperature: new ``temperature`` of every ``gate="softmax"`` layer (scalar ``>= 0``).
      score: bool (a Python bool or a bool array, e.g. traced), sets the dense-scoring flag of
        ``explore="dense_score"`` layers.

    Returns:
      A new variables dict; other collections are shared, not copied.

    Raises:
      TypeError: a ``score`` that is not a bool, a strength/temperature that is not a number.
      ValueError: nothing to set; a concrete negative or NaN strength/temperature; an argument
        that no layer takes (``strength=`` with only softmax layers, ``temperature=`` with only
        sparse ones, or no ``"dynadiag"`` collection at all: a frozen or dense model, or
        variables restored without it). The message names the gates present.
    """
    if strength is None and temperature is None and score is None:
        raise ValueError("set_gate needs strength=, temperature= and/or score=")
    for name, value in (("strength", strength), ("temperature", temperature)):
        if value is not None:
            check_gate_value(value, name, "set_gate")
    if score is not None:
        check_score(score, "set_gate")
    refuse_nnx(variables, "variables", "set_gate", "dd.nnx.set_gate(model, ...)")
    if not isinstance(variables, Mapping):
        raise TypeError(
            f"variables must be a mapping of collections, got {type(variables).__name__}"
        )
    if GATE_COLLECTION not in variables:
        raise ValueError(
            f"set_gate: the variables have no {GATE_COLLECTION!r} collection, so there is no "
            f"search-phase DiagonalDense to set (collections: {sorted(variables)}); a frozen or "
            f"dense model has no gate, and a search-phase model needs the {GATE_COLLECTION!r} "
            f"collection created by init"
        )
    requested = {"strength": strength, "temperature": temperature, "score": score}
    entries = traverse_util.flatten_dict(variables[GATE_COLLECTION], keep_empty_nodes=True)
    found = Counter(key[-1] for key in entries if key[-1] in _OWNER)
    for name, value in requested.items():
        if value is not None and not found[name]:
            raise ValueError(
                f"set_gate({name}=...) matches no layer: the search-phase layers here take "
                f"{_describe(found)}"
            )
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
    out[GATE_COLLECTION] = traverse_util.unflatten_dict(
        {key: updates[key[-1]](v) if key[-1] in updates else v for key, v in entries.items()}
    )
    return out


def alpha_from_values(params, scale):
    """``params`` with each search-phase layer's ``alpha[P]`` set from its ``values[P, ...]``.

    ``alpha[p] = scale * (n_p - mean(n)) / std(n)`` with ``n_p`` the norm of diagonal ``p``'s
    values (an informative start after a warm-up with flat gates: the diagonals whose values grew
    most rank first). ``scale`` is typically the gate's current strength, so the scores spread over
    a few strengths and the gate narrows from there. Pure and jit-able; other leaves are shared.
    A layer whose norms are all equal (std 0) gets ``alpha = 0``; one with a NaN or inf among its
    values (a diverged search) gets a NaN ``alpha``, which freezing refuses. The new alphas are
    constants (``stop_gradient``): no gradient flows back to the values or to ``scale`` through
    them.

    ``scale`` is a number > 0 (or an array of them that broadcasts against ``alpha``); a concrete
    value <= 0 or NaN raises ``ValueError``. Under ``jit``, where it cannot be checked,
    a value <= 0 or NaN has no ranking to give and makes ``alpha`` NaN there (the loss shows it, and
    freezing refuses such a layer).
    """
    check_scale(scale, "scale", "alpha_from_values")
    if not isinstance(params, dict | FrozenDict):
        raise TypeError(
            f"alpha_from_values: params must be a params dict (variables['params']), got "
            f"{type(params).__name__}; an NNX model restarts with dd.nnx.alpha_from_values(model, "
            f"scale)"
        )
    flat = traverse_util.flatten_dict(params)
    out = dict(flat)
    for key, alpha in flat.items():
        values = flat.get(key[:-1] + ("values",))
        if key[-1] != "alpha" or values is None:
            continue
        norms = jnp.sqrt(
            jnp.sum(
                jnp.square(values.astype(alpha.dtype)),
                axis=tuple(range(alpha.ndim, values.ndim)),
            )
        )
        centred = norms - jnp.mean(norms, axis=-1, keepdims=True)
        std = jnp.std(norms, axis=-1, keepdims=True)
        # NaN or inf values give a NaN std, and a NaN alpha that freezing refuses
        z = jnp.where(std == 0, 0, centred / jnp.where(std == 0, 1, std))
        g = jnp.asarray(scale, alpha.dtype)
        out[key] = jax.lax.stop_gradient(jnp.where(g > 0, g * z, jnp.asarray(jnp.nan, g.dtype)))
    return traverse_util.unflatten_dict(out)
