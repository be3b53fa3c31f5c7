"""MEST: elastic mutation with a decaying mutation ratio and the soft memory bound.

At every mutation step (``update_every`` steps apart, from ``start_step``) each sparsified layer
with budget ``n`` is pruned by the score ``|w| + grad_weight * |g|`` and then grows
``m = round(r(t) * n)`` weights at random positions (grown weights start at zero with zeroed
optimizer moments):

* soft memory bound (``soft_bound=True``, MEST's EM&S): prune back to ``n``, grow to ``n + m``.
  The grown weights train for a whole period before they compete on magnitude at the next
  mutation step, and the layer holds at most ``n + m`` weights in between;
* hard bound (``soft_bound=False``, MEST's EM): prune to ``n - m``, grow back to ``n``.

The mutation ratio ``r`` decays (a float ``r0`` follows ``r0 * (1 + cos(pi * t / end)) / 2``; MEST's
staged decay is ``optax.piecewise_constant_schedule``). ``end_step`` is a final prune-back step
that grows nothing, so every layer ends at exactly its budget.

The public MEST code prunes by magnitude (``grad_weight=0``) and grows at random, which needs no
dense gradient: that is what makes it memory-economic.

References:
  Yuan et al., "MEST: Accurate and Fast Memory-Economic Sparse Training Framework on the Edge",
  NeurIPS 2021, https://arxiv.org/abs/2110.14032 ; code: github.com/boone891214/MEST
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from dynadiag_jax._checks import boolean, non_negative
from dynadiag_jax.baselines.dst import Schedule, cosine_decay, periodic
from dynadiag_jax.baselines.masks import top_n_mask
from dynadiag_jax.baselines.sparse_state import budgets, map_masks, random_scores, sparse_wrapper

__all__ = ["mest", "prune_and_grow"]


def prune_and_grow(mask, prune_score, grow_score, num_keep, num_grow):
    """Keep the ``num_keep`` best active entries, then add the ``num_grow`` best others.

    Args:
      mask: bool ``[...]``; prune_score, grow_score: floating ``[...]``.
      num_keep, num_grow: integer scalars (may be traced).

    Returns:
      bool ``[...]`` with ``min(num_keep, active) + num_grow`` True entries (capped at the size).
    """
    neg_inf = jnp.asarray(-jnp.inf, jnp.float32)
    keep = top_n_mask(jnp.where(mask, prune_score.astype(jnp.float32), neg_inf), num_keep)
    keep = keep & mask
    grow = top_n_mask(jnp.where(keep, neg_inf, grow_score.astype(jnp.float32)), num_grow)
    return keep | grow


def mest(
    inner: optax.GradientTransformation,
    *,
    distribution,
    key,
    update_every: int,
    end_step: int,
    start_step: int | None = None,
    mutation_ratio: Schedule = 0.2,
    soft_bound: bool = True,
    grad_weight: float = 0.0,
) -> optax.GradientTransformationExtraArgs:
    """MEST elastic mutation as an optax wrapper.

    Args:
      inner: optimizer of the active weights.
      distribution: ``params -> sparsities`` (the budget ``n`` of each layer).
      key: ``jax.random.key`` for the initial masks and the random growth.
      update_every: steps between mutations.
      end_step: the final prune-back step (grows nothing); no mutation after it.
      start_step: first mutation step; default ``update_every``.
      mutation_ratio: ``m / n``: a float (cosine-decayed to 0 at ``end_step``) or a schedule.
        MEST's bounds map to it as ``r = (s_prune - s_grow) / (1 - s_prune)``: its README's
        EM&S at 90% (grow to 88% sparsity) is ``r = 0.2``.
      soft_bound: EM&S (grow above the budget, prune back later) or EM (stay at the budget).
      grad_weight: ``lambda`` in the prune score ``|w| + lambda * |g|``.

    Returns:
      An optax transform with :class:`SparseState` state. After each prune-back a layer holds
      exactly ``n`` weights; in between at most ``n + round(r(t) * n)`` (soft) or exactly ``n``.
    """
    if not callable(mutation_ratio):
        non_negative(mutation_ratio, "mutation_ratio")
    grad_weight = non_negative(grad_weight, "grad_weight")
    soft_bound = boolean(soft_bound, "soft_bound")  # "no" was the soft bound
    if start_step is None:
        start_step = update_every
    is_update = periodic(update_every, start_step, end_step, include_end=True)
    ratio = cosine_decay(mutation_ratio, end_step)

    def rule(masks, params, grads, count, key):
        r = jnp.where(count >= end_step, jnp.float32(0.0), jnp.asarray(ratio(count), jnp.float32))
        n_budget = budgets(distribution, params)
        scores = random_scores(key, masks, params)

        def one(mask, p, g, n, random):
            m = jnp.round(r * jnp.float32(n)).astype(jnp.int32)
            num_keep = jnp.int32(n) if soft_bound else jnp.maximum(jnp.int32(n) - m, 0)
            score = jnp.abs(p).astype(jnp.float32) + jnp.float32(grad_weight) * jnp.abs(g).astype(
                jnp.float32
            )
            return prune_and_grow(
                mask, score, random, num_keep, m if soft_bound else jnp.int32(n) - num_keep
            )

        return map_masks(one, masks, params, grads, n_budget, scores)

    return sparse_wrapper(
        inner, distribution=distribution, rule=rule, is_update_step=is_update, key=key
    )
