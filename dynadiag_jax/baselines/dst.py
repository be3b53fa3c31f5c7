"""Unstructured sparse training: RigL and SET (drop and grow) as optax wrappers, and their fixed
first mask (:func:`static_mask`, the control without updates).

Every ``update_every`` steps in ``[start_step, end_step)`` each sparsified layer drops the
``round(f(t) * n)`` active weights of smallest magnitude and grows as many inactive ones: by
largest dense-gradient magnitude (RigL) or uniformly at random (SET). Grown weights start at
zero with zeroed optimizer moments. ``f`` is the drop fraction: a float ``f0`` decays as
``f0 * (1 + cos(pi * t / end_step)) / 2`` (RigL's schedule); a callable is used as given.

References:
  Evci et al., "Rigging the Lottery: Making All Tickets Winners", ICML 2020,
  https://arxiv.org/abs/1911.11134
  Mocanu et al., "Scalable training of artificial neural networks with adaptive sparse
  connectivity inspired by network science", Nature Communications 2018,
  https://arxiv.org/abs/1707.04780
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from dynadiag_jax import schedules
from dynadiag_jax._checks import finite_number, int_at_least
from dynadiag_jax.baselines.masks import top_n_mask
from dynadiag_jax.baselines.sparse_state import map_masks, random_scores, sparse_wrapper

__all__ = ["rigl", "set_", "static_mask", "drop_and_grow", "cosine_decay", "periodic"]

Schedule = float | Callable[[jax.Array], jax.Array]


def periodic(update_every: int, start_step: int, end_step: int, *, include_end: bool = False):
    """``count -> bool``: True at ``start_step + i * update_every`` below ``end_step``.

    With ``include_end``, ``end_step`` itself is also an update step (MEST's final prune-back).
    """
    every = int_at_least(update_every, "update_every", 1)
    start = int_at_least(start_step, "start_step", 0)
    end = int_at_least(end_step, "end_step", 0)
    if end <= start:
        raise ValueError(f"end_step ({end}) must be greater than start_step ({start})")

    def is_update(count):
        on_grid = (count >= start) & (count < end) & ((count - start) % every == 0)
        return on_grid | (count == end) if include_end else on_grid

    return is_update


def cosine_decay(value: Schedule, end_step: int) -> Callable[[jax.Array], jax.Array]:
    """``value`` if callable, else ``value * (1 + cos(pi * min(t, end) / end)) / 2`` (float32)."""
    if callable(value):
        return value
    v = float(value)
    if v < 0.0:
        raise ValueError(f"the schedule's initial value must be >= 0, got {value!r}")
    return schedules.cosine(v, 0.0, end_step)


def drop_and_grow(mask, drop_score, grow_score, num_drop):
    """One layer's drop-and-grow step with an exact active count.

    Keeps the ``n - num_drop`` active entries with the largest ``drop_score`` (``n`` = active
    count), then activates the ``num_drop`` entries with the largest ``grow_score`` among those not
    kept (a weight dropped here may be grown back, as in RigL).

    Args:
      mask: bool ``[...]``; drop_score, grow_score: floating ``[...]``.
      num_drop: integer scalar (may be traced), clipped to ``[0, n]``.

    Returns:
      bool ``[...]`` with the same number of True entries as ``mask``.
    """
    n = jnp.sum(mask, dtype=jnp.int32)
    num_drop = jnp.clip(jnp.asarray(num_drop, jnp.int32), 0, n)
    neg_inf = jnp.asarray(-jnp.inf, jnp.float32)
    keep = top_n_mask(jnp.where(mask, drop_score.astype(jnp.float32), neg_inf), n - num_drop)
    grow = top_n_mask(jnp.where(keep, neg_inf, grow_score.astype(jnp.float32)), num_drop)
    return keep | grow


def _check_fraction(value: Schedule, name: str) -> None:
    # finite_number: None, "0.3" (float() took it) and True (drop everything) named the argument
    if not callable(value) and not 0.0 <= finite_number(value, name) <= 1.0:
        raise ValueError(f"{name} must be in [0, 1] or a schedule, got {value!r}")


def _drop_grow_wrapper(
    inner, *, distribution, key, update_every, end_step, start_step, drop_fraction, grow_scores
):
    _check_fraction(drop_fraction, "drop_fraction")
    if start_step is None:
        start_step = update_every
    is_update = periodic(update_every, start_step, end_step)
    fraction = cosine_decay(drop_fraction, end_step)

    def rule(masks, params, grads, count, key):
        f = jnp.asarray(fraction(count), jnp.float32)
        scores = grow_scores(masks, params, grads, key)

        def one(mask, p, s):
            n = jnp.sum(mask, dtype=jnp.int32).astype(jnp.float32)
            return drop_and_grow(mask, jnp.abs(p), s, jnp.round(f * n).astype(jnp.int32))

        return map_masks(one, masks, params, scores)

    return sparse_wrapper(
        inner, distribution=distribution, rule=rule, is_update_step=is_update, key=key
    )


def rigl(
    inner: optax.GradientTransformation,
    *,
    distribution,
    key,
    update_every: int,
    end_step: int,
    start_step: int | None = None,
    drop_fraction: Schedule = 0.3,
) -> optax.GradientTransformationExtraArgs:
    """RigL: drop the smallest weights, grow where the dense gradient is largest.

    Args:
      inner: optimizer of the active weights.
      distribution: ``params -> sparsities``, e.g. ``functools.partial(erk, sparsity=0.9)``.
      key: ``jax.random.key`` for the random initial masks.
      update_every: steps between mask updates (RigL's delta T).
      end_step: no mask updates from this step on (RigL: 75% of training).
      start_step: first mask-update step; default ``update_every``.
      drop_fraction: initial fraction (cosine-decayed to 0 at ``end_step``) or a schedule.

    Returns:
      An optax transform with :class:`SparseState` state. ``update`` needs ``params``.
    """

    def grow_scores(masks, params, grads, key):
        del params, key
        return map_masks(lambda m, g: jnp.abs(g), masks, grads)

    return _drop_grow_wrapper(
        inner,
        distribution=distribution,
        key=key,
        update_every=update_every,
        end_step=end_step,
        start_step=start_step,
        drop_fraction=drop_fraction,
        grow_scores=grow_scores,
    )


def set_(
    inner: optax.GradientTransformation,
    *,
    distribution,
    key,
    update_every: int,
    end_step: int,
    start_step: int | None = None,
    drop_fraction: Schedule = 0.3,
) -> optax.GradientTransformationExtraArgs:
    """SET: drop the smallest weights, grow uniformly at random.

    Named with a trailing underscore so that it does not shadow the builtin ``set``. Arguments
    as in :func:`rigl`; ``key`` also drives the random growth (split on every update).
    """

    def grow_scores(masks, params, grads, key):
        del grads
        return random_scores(key, masks, params)

    return _drop_grow_wrapper(
        inner,
        distribution=distribution,
        key=key,
        update_every=update_every,
        end_step=end_step,
        start_step=start_step,
        drop_fraction=drop_fraction,
        grow_scores=grow_scores,
    )


def static_mask(
    inner: optax.GradientTransformation, *, distribution, key
) -> optax.GradientTransformationExtraArgs:
    """A fixed random unstructured mask: the first mask of :func:`rigl` and :func:`set_` (the same
    draw for the same ``key``), never updated.

    The control that tells what the drop-and-grow updates add over an unstructured layout alone
    (with ``drop_fraction=0`` SET trains the same weights, bit for bit, while still scheduling
    updates that change nothing). Arguments as in :func:`rigl`.
    """

    def keep(masks, params, grads, count, key):
        del params, grads, count, key
        return masks

    return sparse_wrapper(
        inner,
        distribution=distribution,
        rule=keep,
        is_update_step=lambda count: jnp.zeros((), jnp.bool_),
        key=key,
    )
