"""Schedules ``step -> value`` for the gate's strength or temperature, and the freeze step.

Each factory takes plain numbers (configs live in ``train/configs`` and pass them in) and returns a
jit-able function of an integer step (Python int or integer array, traced or not) giving float32
values of the step's shape, computed with optax's formulas (the exponential with its own, see
there). A step is clipped to ``[0, steps]`` at its own integer width, before the float32 cast (so
an int64 step beyond int32 cannot wrap): a schedule gives its init value before step 0 and holds
exactly its end value from ``steps`` on. Every value lies between the end values, so it is finite;
the end values must be finite in float32. The released recipe anneals the temperature over the
search phase only (cosine 5.0 -> 0.05 until the freeze), then holds it.

Example (the released recipe, freeze after 30% of training)::

    freeze_at = dd.schedules.freeze_step(total_steps, search_fraction=0.3)
    temperature = dd.schedules.cosine(5.0, 0.05, freeze_at)
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from dynadiag_jax._checks import finite_number, int_at_least, int_in_range

__all__ = [
    "Schedule",
    "constant",
    "linear",
    "cosine",
    "exponential",
    "warmup_cosine",
    "by_name",
    "freeze_step",
]

Schedule = Callable[..., jnp.ndarray]

_MAX = float(np.finfo(np.float32).max)
_MAX_STEPS = int(np.iinfo(np.int32).max)
# The smallest magnitude that float32 rounds to inf: half an ulp above _MAX.
_INF = 2.0**128 - 2.0**103
_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32


def _float32_number(value, name: str) -> float:
    """``finite_number`` that float32, where the schedules compute, holds too (not inf there)."""
    value = finite_number(value, name)
    if abs(value) >= _INF:
        raise ValueError(
            f"{name} must be finite in float32 (|{name}| <= {_MAX:.8g}), got {value!r}"
        )
    return value


def _steps(value, name: str, low: int) -> int:
    """A step count: an int in ``[low, 2**31 - 1]``, the range of the int32 steps a schedule is
    compared with inside ``jit``."""
    return int_in_range(value, name, low, _MAX_STEPS)


def _step(step, end: int):
    """``clip(step, 0, end)`` as float32, clipped at the step's own width: JAX would narrow an
    int64 step to int32 by wrapping it."""
    if isinstance(step, numbers.Integral) and not isinstance(step, bool):
        return jnp.float32(min(max(int(step), 0), end))
    if isinstance(step, (list, tuple)):
        step = np.asarray(step)
    dtype = getattr(step, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        kind = type(step).__name__ if dtype is None else f"an array of dtype {dtype}"
        raise TypeError(f"step must be an integer (a Python int or an integer array), got {kind}")
    xp = jnp if isinstance(step, jax.Array) else np
    return jnp.asarray(xp.clip(step, 0, min(end, int(np.iinfo(dtype).max))).astype(np.float32))


def _schedule(value_of, steps: int) -> Schedule:
    """``step -> value_of(t)`` with ``t`` the float32 step clipped to ``[0, steps]``, as float32
    values of the step's shape."""

    def schedule(step):
        t = _step(step, steps)
        return jnp.broadcast_to(jnp.asarray(value_of(t), jnp.float32), jnp.shape(t))

    return schedule


def _held(a: float, b: float, value, done):
    """``value`` clipped to ``[min(a, b), max(a, b)]`` (float32 rounding could leave it, to inf
    near float32's limit), and exactly ``b`` where ``done``."""
    return jnp.where(done, jnp.float32(b), jnp.clip(value, min(a, b), max(a, b)))


def _between(a: float, b: float, weight, done):
    """``b + (a - b) * weight`` for ``weight`` in ``[0, 1]``, :func:`_held`; computed at half
    scale when ``a - b`` overflows float32 (halving is exact)."""
    s = 2.0 if abs(a - b) > _MAX else 1.0
    return _held(a, b, s * ((a / s - b / s) * weight + b / s), done)


def _linear(a: float, b: float, steps: int, t):
    return _between(a, b, 1 - t / steps, t >= steps)


def _cosine(a: float, b: float, steps: int, t):
    # optax's cosine decays by a ratio end / init, undefined for init = 0: its shape from 1 to 0.
    return _between(a, b, optax.cosine_decay_schedule(1.0, steps)(t), t >= steps)


def constant(value) -> Schedule:
    """``step -> value``."""
    value = _float32_number(value, "value")
    return _schedule(lambda t: value, 0)


def linear(init_value, end_value, steps) -> Schedule:
    """Linear from ``init_value`` at step 0 to ``end_value`` at ``steps``, held afterwards."""
    a, b = _float32_number(init_value, "init_value"), _float32_number(end_value, "end_value")
    steps = _steps(steps, "steps", 1)
    return _schedule(lambda t: _linear(a, b, steps, t), steps)


def cosine(init_value, end_value, steps) -> Schedule:
    """Half-cosine from ``init_value`` at step 0 to ``end_value`` at ``steps``, held afterwards.

    ``v(t) = end + (init - end) * (1 + cos(pi * t / steps)) / 2``.
    """
    a, b = _float32_number(init_value, "init_value"), _float32_number(end_value, "end_value")
    steps = _steps(steps, "steps", 1)
    return _schedule(lambda t: _cosine(a, b, steps, t), steps)


def exponential(init_value, end_value, steps) -> Schedule:
    """Geometric from ``init_value`` to ``end_value`` (both > 0) over ``steps``, held afterwards.

    ``v(t) = init * (end / init) ** (t / steps)``: a constant ratio per step, e.g. 5.0 -> 0.05
    over 100 steps multiplies by 0.955 each step. Both values must be at least float32's smallest
    normal number (about 1.2e-38).
    """
    a, b = _float32_number(init_value, "init_value"), _float32_number(end_value, "end_value")
    for name, value in (("init_value", a), ("end_value", b)):
        if value < _TINY:
            raise ValueError(
                f"exponential needs {name} > 0, at least float32's smallest normal number "
                f"{_TINY:.8g}, got {value!r}"
            )
    steps = _steps(steps, "steps", 1)
    # Not optax.exponential_decay: its init * rate ** p rounds differently in float32, enough to
    # change the trained runs of the default gate, whose strength decays so (docs/RESULTS.md).
    log_ratio = math.log(b / a)
    # init * exp(...) needs exp(log_ratio * p) to be a normal float32; a wider ratio is taken
    # in log space.
    wide = abs(log_ratio) >= -math.log(_TINY)

    def value_of(t):
        p = jnp.clip(t / jnp.float32(steps), 0.0, 1.0)
        geometric = jnp.exp(math.log(a) + log_ratio * p) if wide else a * jnp.exp(log_ratio * p)
        return _held(a, b, geometric, t >= steps)

    return _schedule(value_of, steps)


def warmup_cosine(init_value, peak_value, end_value, warmup_steps, steps) -> Schedule:
    """Linear ``init -> peak`` over ``warmup_steps``, then cosine ``peak -> end`` until ``steps``.

    ``steps`` counts from step 0 and includes the warm-up (as in optax's
    ``warmup_cosine_decay_schedule``); the value is held at ``end_value`` afterwards.
    """
    a = _float32_number(init_value, "init_value")
    peak = _float32_number(peak_value, "peak_value")
    b = _float32_number(end_value, "end_value")
    warmup_steps = _steps(warmup_steps, "warmup_steps", 0)
    steps = _steps(steps, "steps", 1)
    if warmup_steps >= steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) must be < steps ({steps})")

    def value_of(t):
        decay = _cosine(peak, b, steps - warmup_steps, jnp.maximum(t - warmup_steps, 0))
        if not warmup_steps:
            return decay
        warm = _linear(a, peak, warmup_steps, jnp.minimum(t, warmup_steps))
        return jnp.where(t < warmup_steps, warm, decay)

    return _schedule(value_of, steps)


_FACTORIES = {
    "constant": constant,
    "linear": linear,
    "cosine": cosine,
    "exponential": exponential,
    "warmup_cosine": warmup_cosine,
}


def by_name(name: str, **kwargs) -> Schedule:
    """The schedule factory called ``name`` applied to ``kwargs`` (for configs that hold a name).

    Example: ``by_name("cosine", init_value=5.0, end_value=0.05, steps=3000)``.

    Raises:
      ValueError: an unknown name, or an argument's value out of range.
      TypeError: a missing or unexpected argument, or one of the wrong type.
    """
    if name not in _FACTORIES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {sorted(_FACTORIES)}")
    return _FACTORIES[name](**kwargs)


def freeze_step(total_steps, *, search_fraction) -> int:
    """The step at which the selection is frozen: ``round(search_fraction * total_steps)``.

    ``search_fraction`` in ``[0, 1]``; 0 freezes before the first step (static diagonals chosen
    by the initial scores), 1 never freezes during training. The released recipe uses 0.3.
    """
    total_steps = int_at_least(total_steps, "total_steps", 1)
    frac = finite_number(search_fraction, "search_fraction")
    if not 0.0 <= frac <= 1.0:
        raise ValueError(f"search_fraction must be in [0, 1], got {search_fraction!r}")
    return int(round(frac * total_steps))
