"""Argument checks shared by the library's public functions.

One rule for every bad argument (docs/design.md, "Errors"): a wrong type - not an int, not a real
number, not an array, a dtype of the wrong kind - raises ``TypeError``; a value of the right type
that is out of range, not finite or not one of the known names raises ``ValueError``.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np


def _as_int(value, name: str) -> int:
    """``value`` as an int; ``TypeError`` if not integral (a bool is not)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def no_directory(path) -> str:
    """Why ``path`` (not a directory) cannot be read as one: ``"does not exist"`` or ``"is not a
    directory"`` (a file of that name)."""
    return "is not a directory" if path.exists() else "does not exist"


def int_at_least(value, name: str, minimum: int) -> int:
    """``value`` as an int; ``TypeError`` if not integral (a bool is not), ``ValueError`` below
    ``minimum``."""
    value = _as_int(value, name)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def int_in_range(value, name: str, low: int, high: int, what: str = "") -> int:
    """``value`` as an int; ``TypeError`` if not integral, ``ValueError`` outside ``[low, high]``
    (``what`` names the bounds in the message, e.g. ``"[1, P]"``)."""
    value = _as_int(value, name)
    if not low <= value <= high:
        bounds = f"{what} = [{low}, {high}]" if what else f"[{low}, {high}]"
        raise ValueError(f"{name} must be in {bounds}, got {value}")
    return value


def permutation_problem(perm, n: int) -> str | None:
    """Why a concrete integer ``perm[n]`` is not a permutation of ``range(n)``, or None if it is."""
    perm = np.asarray(perm).astype(np.int64)
    outside = perm[(perm < 0) | (perm >= n)]
    if outside.size:
        return f"it holds {outside[0]}, outside [0, {n})"
    counts = np.bincount(perm, minlength=n)
    if np.any(counts != 1):
        twice, missed = int(np.argmax(counts)), int(np.argmin(counts))
        return f"it holds {twice} {int(counts[twice])} times and misses {missed}"
    return None


def finite_number(value, name: str) -> float:
    """``value`` as a float; ``TypeError`` if not a real number (a bool is not), ``ValueError`` if
    NaN or infinite."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond float's range: "int too large to convert to float"
        finite = False
    if not finite:
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def fraction(value, name: str) -> float:
    """``value`` as a float in ``[0, 1)``: a dropout or drop-path rate (``1`` drops everything,
    a negative one scales training's activations up against evaluation's), Adam's ``b1``/``b2``,
    a label smoothing."""
    value = finite_number(value, name)
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {value!r}")
    return value


def check_sparsity(sparsity) -> None:
    """Rejects a ``sparsity`` that is not a number in ``(0, 1)``, saying what to use instead."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, numbers.Real):
        raise TypeError(
            f"sparsity must be a number in (0, 1), got {sparsity!r} ({type(sparsity).__name__})"
        )
    if not 0.0 < float(sparsity) < 1.0:
        hint = (
            "; for a dense layer use flax.linen.Dense, or keep every diagonal with k=P "
            "(P = the number of candidate diagonals)"
            if sparsity <= 0
            else ""
        )
        raise ValueError(f"sparsity must be in (0, 1), got {sparsity!r}{hint}")


def non_negative(value, name: str) -> float:
    """``value`` as a float; ``TypeError`` if not a real number (a bool is not), ``ValueError`` if
    negative, NaN or infinite."""
    value = finite_number(value, name)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


def refuse_nnx(value, name: str, what: str, instead: str) -> None:
    """``TypeError`` naming ``instead`` (the NNX function) when ``value`` is an NNX module or
    state given to ``what``, a function of linen variables: they failed deep inside flax, or with
    a message about linen's collections."""
    from flax import nnx

    if isinstance(value, nnx.Module | nnx.State):
        raise TypeError(
            f"{what}: {name} is an NNX {type(value).__name__}; {what} takes linen variables (a "
            f"dict of collections); for an NNX model use {instead}"
        )


def check_variables(variables, name: str, what: str) -> None:
    """Rejects ``variables`` that are not a mapping of collections (``TypeError``) or have no
    ``"params"`` collection (``ValueError``); ``what`` starts both messages (the caller)."""
    refuse_nnx(variables, name, what, "the functions of dd.nnx")
    if not isinstance(variables, Mapping):
        raise TypeError(
            f"{what}: {name} must be a mapping of collections (what model.init returns), "
            f"got {type(variables).__name__}"
        )
    if "params" not in variables:
        raise ValueError(f"{what}: {name} must be variables with a 'params' collection")


def host_array(value) -> np.ndarray | None:
    """``value`` as numpy when it can be read without a trace or a device sync, else None (also
    for None and an abstract ``jax.ShapeDtypeStruct``)."""
    if value is None or isinstance(value, jax.core.Tracer | jax.ShapeDtypeStruct):
        return None
    if isinstance(value, jax.Array) and not all(d.platform == "cpu" for d in value.devices()):
        return None
    return np.asarray(value)


def floating_dtype(dtype, name: str):
    """``dtype`` as a floating ``jnp.dtype``; ``TypeError`` naming ``name`` for anything else."""
    try:
        resolved = jnp.dtype(dtype)
    except (TypeError, ValueError):
        resolved = None
    if resolved is None or not jnp.issubdtype(resolved, jnp.floating):
        got = repr(dtype) if resolved is None else resolved.name
        raise TypeError(
            f"{name} must be a floating dtype (jnp.float32, jnp.bfloat16, ...), got {got}"
        )
    return resolved


def boolean(value, name: str) -> bool:
    """``value`` as a bool; ``TypeError`` for anything else (``"no"`` is truthy: a switch given a
    string would silently be on)."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}")
    return bool(value)


def check_layer_arguments(
    *, num_buckets, dtype, param_dtype, kernel_init, bias_init, use_bias
) -> None:
    """The arguments both diagonal layers (linen and NNX) check alike: ``num_buckets >= 1``,
    floating ``dtype`` (or None) and ``param_dtype``, callable initializers, a bool
    ``use_bias``."""
    int_at_least(num_buckets, "num_buckets", 1)
    boolean(use_bias, "use_bias")
    if dtype is not None:
        floating_dtype(dtype, "dtype")
    # an integer param_dtype would init the values to zeros and make the layer output 0
    floating_dtype(param_dtype, "param_dtype")
    for name, init in (("kernel_init", kernel_init), ("bias_init", bias_init)):
        if not callable(init):
            raise TypeError(
                f"{name} must be an initializer (key, shape, dtype) -> array, such as "
                f"flax.linen.initializers.lecun_normal(), got {init!r}"
            )


def as_int32(a):
    """Integer ``a`` as int32, entries outside int32 becoming -1 rather than wrapping into range:
    -1 is out of range as an offset and as a perm entry, so the products' rule poisons it."""
    info, limit = jnp.iinfo(a.dtype), jnp.iinfo(jnp.int32)
    if info.min >= limit.min and info.max <= limit.max:
        return a.astype(jnp.int32)
    outside = a > limit.max
    if info.min < limit.min:
        outside = outside | (a < limit.min)
    return jnp.where(outside, jnp.int32(-1), a.astype(jnp.int32))
