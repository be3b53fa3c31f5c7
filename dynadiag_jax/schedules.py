"""Schedules ``step -> value`` for the gate's strength or temperature, and the freeze step.

Each factory takes plain numbers (configs live in ``train/configs`` and pass them in) and returns a
jit-able function of an integer step (Python int or traced array) giving a float32 scalar: optax's
schedule of that shape with checked arguments (the exponential is computed here, see there). A
schedule holds its end value after ``steps``: the released recipe anneals the temperature over the
search phase only (cosine 5.0 -> 0.05 until the freeze), then holds it.

Example (the released recipe, freeze after 30% of training)::

    freeze_at = dd.schedules.freeze_step(total_steps, search_fraction=0.3)
    temperature = dd.schedules.cosine(5.0, 0.05, freeze_at)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax.numpy as jnp
import optax

from dynadiag_jax._checks import finite_number, int_at_least

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


def _progress(step, steps: int):
    """``clip(step / steps, 0, 1)`` as float32."""
    t = jnp.asarray(step).astype(jnp.float32) / jnp.float32(steps)
    return jnp.clip(t, 0.0, 1.0)


def _float32(schedule) -> Schedule:
    """``schedule`` of a float32 step, as a float32 value of ``step``'s shape (optax's schedules
    mix the step with Python floats, which strict dtype promotion refuses for an int step)."""

    def wrapped(step):
        value = schedule(jnp.asarray(step).astype(jnp.float32))
        return jnp.broadcast_to(jnp.asarray(value, jnp.float32), jnp.shape(step))

    return wrapped


def constant(value) -> Schedule:
    """``step -> value``."""
    return _float32(optax.constant_schedule(finite_number(value, "value")))


def linear(init_value, end_value, steps) -> Schedule:
    """Linear from ``init_value`` at step 0 to ``end_value`` at ``steps``, held afterwards."""
    a, b = finite_number(init_value, "init_value"), finite_number(end_value, "end_value")
    return _float32(optax.linear_schedule(a, b, int_at_least(steps, "steps", 1)))


def _cosine(a: float, b: float, steps: int):
    # optax's cosine decays by a ratio end / init, undefined for init = 0: its shape from 1 to 0.
    shape = optax.cosine_decay_schedule(1.0, steps)
    return lambda step: b + (a - b) * shape(step)


def cosine(init_value, end_value, steps) -> Schedule:
    """Half-cosine from ``init_value`` at step 0 to ``end_value`` at ``steps``, held afterwards.

    ``v(t) = end + (init - end) * (1 + cos(pi * t / steps)) / 2``.
    """
    a, b = finite_number(init_value, "init_value"), finite_number(end_value, "end_value")
    return _float32(_cosine(a, b, int_at_least(steps, "steps", 1)))


def exponential(init_value, end_value, steps) -> Schedule:
    """Geometric from ``init_value`` to ``end_value`` (both > 0) over ``steps``, held afterwards.

    ``v(t) = init * (end / init) ** (t / steps)``: a constant ratio per step, e.g. 5.0 -> 0.05
    over 100 steps multiplies by 0.955 each step.
    """
    a, b = finite_number(init_value, "init_value"), finite_number(end_value, "end_value")
    if a <= 0 or b <= 0:
        raise ValueError(f"exponential needs init_value > 0 and end_value > 0, got {a}, {b}")
    steps = int_at_least(steps, "steps", 1)
    # Not optax.exponential_decay: its init * rate ** p rounds differently in float32, enough to
    # change the trained runs of the default gate, whose strength decays so (docs/RESULTS.md).
    log_ratio = math.log(b / a)

    def schedule(step):
        return a * jnp.exp(log_ratio * _progress(step, steps))

    return schedule


def warmup_cosine(init_value, peak_value, end_value, warmup_steps, steps) -> Schedule:
    """Linear ``init -> peak`` over ``warmup_steps``, then cosine ``peak -> end`` until ``steps``.

    ``steps`` counts from step 0 and includes the warm-up (as in optax's
    ``warmup_cosine_decay_schedule``); the value is held at ``end_value`` afterwards.
    """
    a = finite_number(init_value, "init_value")
    peak = finite_number(peak_value, "peak_value")
    b = finite_number(end_value, "end_value")
    warmup_steps = int_at_least(warmup_steps, "warmup_steps", 0)
    steps = int_at_least(steps, "steps", 1)
    if warmup_steps >= steps:
        raise ValueError(f"warmup_steps ({warmup_steps}) must be < steps ({steps})")
    decay = _cosine(peak, b, steps - warmup_steps)
    if not warmup_steps:
        return _float32(decay)
    warm = optax.linear_schedule(a, peak, warmup_steps)
    return _float32(optax.join_schedules([warm, decay], [warmup_steps]))


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
