"""The optax wrapper shared by the unstructured baselines: masks live in the optimizer state.

``sparse_wrapper(inner, ...)`` returns an optax ``GradientTransformationExtraArgs`` whose state is
a :class:`SparseState`. Each ``update``:

1. on a mask-update step, replaces the masks by ``rule(...)`` and zeroes the inner optimizer's
   moments of every newly activated weight (jaxpruner's ``restart_inner_state``, done generically);
2. masks the gradients and runs the inner optimizer;
3. returns updates that also zero every inactive weight, so ``optax.apply_updates`` leaves the
   parameters exactly masked after each step; no separate "apply masks" call is needed in the
   training loop (only once after ``init``: see :func:`apply_masks`).

Masks are bool arrays for sparsified leaves and ``None`` for dense leaves.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from dynadiag_jax.baselines.masks import num_active, top_n_mask

__all__ = [
    "SparseState",
    "sparse_wrapper",
    "apply_masks",
    "active_counts",
    "reset_moments",
    "budgets",
    "key_data",
    "typed_key",
    "map_masks",
    "random_scores",
]

# (masks, params, grads, count, key) -> new masks; every argument a pytree or array.
MaskRule = Callable[..., Any]


class SparseState(NamedTuple):
    """Optimizer state of a sparse-training wrapper.

    Attributes:
      masks: pytree like the params: bool arrays (True = active) or ``None`` for dense leaves.
      inner_state: the wrapped optimizer's state.
      count: int32 scalar, the number of updates done so far.
      key: uint32 raw PRNG key data (checkpoint friendly); split on every update.
    """

    masks: Any
    inner_state: Any
    count: jax.Array
    key: jax.Array


def _is_none(x) -> bool:
    return x is None


def map_masks(f, masks, *trees):
    """``f(mask, *leaves)`` on sparsified leaves; ``None`` stays ``None``."""
    return jax.tree.map(
        lambda m, *xs: None if m is None else f(m, *xs), masks, *trees, is_leaf=_is_none
    )


def _map_masked(f, masks, tree, *rest):
    """``f(mask, leaf, *rest)`` on sparsified leaves; dense leaves of ``tree`` pass through."""
    return jax.tree.map(
        lambda m, x, *r: x if m is None else f(m, x, *r), masks, tree, *rest, is_leaf=_is_none
    )


def random_scores(key, masks, like):
    """Uniform ``[0, 1)`` float32 scores shaped like ``like``'s sparsified leaves (``None`` else).

    One draw for the whole tree, split per leaf: a single random-bits computation compiles much
    faster on CPU than one per layer.
    """
    sizes = jax.tree.leaves(map_masks(lambda m, x: math.prod(x.shape), masks, like))
    flat = jax.random.uniform(typed_key(key), (sum(sizes),), jnp.float32)
    pieces = iter(jnp.split(flat, list(itertools.accumulate(sizes))[:-1]))
    return map_masks(lambda m, x: next(pieces).reshape(x.shape), masks, like)


def typed_key(key) -> jax.Array:
    """A typed PRNG key from a typed key or raw uint32 key data (default implementation)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(key)


def key_data(key) -> jax.Array:
    """Raw uint32 data of a typed or legacy PRNG key."""
    if not hasattr(key, "dtype"):
        raise TypeError(
            f"key must be a jax.random.key or a uint32 key array, got {type(key).__name__}"
        )
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key)
    if key.dtype != jnp.uint32:
        raise TypeError(f"key must be a jax.random.key or a uint32 key array, got {key.dtype}")
    return key


def budgets(distribution, params):
    """Active-weight budget per sparsified leaf (Python ints; ``None`` for dense leaves)."""
    sparsities = distribution(params)
    return jax.tree.map(
        lambda s, p: None if s is None else num_active(p.size, s),
        sparsities,
        params,
        is_leaf=_is_none,
    )


def apply_masks(params, masks):
    """``params`` with every inactive weight set to zero (call once after ``tx.init``)."""
    return _map_masked(lambda m, p: jnp.where(m, p, jnp.zeros_like(p)), masks, params)


def active_counts(masks):
    """Number of active weights per sparsified leaf (int32 scalars; ``None`` for dense)."""
    return map_masks(lambda m: jnp.sum(m, dtype=jnp.int32), masks)


def reset_moments(inner_state, grown):
    """Zero every params-shaped part of ``inner_state`` where ``grown`` is True.

    Finds the copies of the params tree inside any optax state (Adam ``mu``/``nu``, SGD ``trace``,
    through ``chain``, ``masked`` and ``multi_transform``) by structure and shape, so it works for
    optimizers it has never seen. ``optax.MaskedNode`` may stand in for a leaf.

    Args:
      inner_state: an optax state.
      grown: pytree like the params: bool arrays, or ``False`` for leaves that are never reset.
    """
    treedef = jax.tree.structure(grown)
    flags = jax.tree.leaves(grown)

    def params_like(node):
        try:
            subs = treedef.flatten_up_to(node)
        except (ValueError, TypeError):
            return None
        for g, x in zip(flags, subs):
            if isinstance(x, optax.MaskedNode):
                continue
            if not hasattr(x, "shape") or (g is not False and x.shape != g.shape):
                return None
        return subs

    def visit(node):
        subs = params_like(node)
        if subs is not None:
            return treedef.unflatten(
                [
                    x
                    if g is False or isinstance(x, optax.MaskedNode)
                    else jnp.where(g, jnp.zeros_like(x), x)
                    for g, x in zip(flags, subs)
                ]
            )
        children, node_def = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
        if jax.tree_util.treedef_is_leaf(node_def):
            return node
        return node_def.unflatten([visit(c) for c in children])

    return visit(inner_state)


def sparse_wrapper(
    inner: optax.GradientTransformation,
    *,
    distribution,
    rule: MaskRule,
    is_update_step: Callable[[jax.Array], jax.Array],
    key,
) -> optax.GradientTransformationExtraArgs:
    """Wrap ``inner`` so that it trains a sparse subset of the weights chosen by ``rule``.

    Args:
      inner: the optimizer of the active weights (any optax transform).
      distribution: ``params -> sparsities`` (see :mod:`dynadiag_jax.baselines.distributions`).
      rule: ``(masks, params, grads, count, key) -> masks``, pure and jit-able.
      is_update_step: ``count -> bool scalar``: when ``rule`` runs.
      key: a ``jax.random.key`` (default implementation) or its raw uint32 data, for the initial
        masks and the rule; the state carries its raw data, split on every update.

    Returns:
      An optax transform; its ``update`` requires ``params``.
    """
    # a sparsity or a computed sparsities tree in place of the function failed at init, unnamed
    for name, value in (
        ("distribution", distribution),
        ("rule", rule),
        ("is_update_step", is_update_step),
    ):
        if not callable(value):
            raise TypeError(
                f"{name} must be a function, got {type(value).__name__}: e.g. "
                "functools.partial(uniform, sparsity=0.9) for a distribution"
            )
    key = key_data(key)

    def init_fn(params):
        n = budgets(distribution, params)
        init_key, state_key = jax.random.split(typed_key(key))
        scores = random_scores(init_key, n, params)
        masks = map_masks(lambda b, s: top_n_mask(s, b), n, scores)
        return SparseState(
            masks=masks,
            inner_state=inner.init(params),
            count=jnp.zeros((), jnp.int32),
            key=key_data(state_key),
        )

    def update_fn(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(
                "sparse training wrappers need params: call update(grads, state, params)"
            )
        next_key, rule_key = jax.random.split(typed_key(state.key))

        def change(masks, inner_state):
            new = rule(masks, params, updates, state.count, rule_key)
            grown = jax.tree.map(
                lambda o, n_, _: False if o is None else n_ & ~o,
                masks,
                new,
                params,
                is_leaf=_is_none,
            )
            return new, reset_moments(inner_state, grown)

        masks, inner_state = jax.lax.cond(
            is_update_step(state.count), change, lambda m, s: (m, s), state.masks, state.inner_state
        )
        grads = _map_masked(lambda m, g: jnp.where(m, g, jnp.zeros_like(g)), masks, updates)
        inner_updates, inner_state = inner.update(grads, inner_state, params, **extra_args)
        # -p on inactive weights: params + updates is then exactly zero there.
        out = _map_masked(
            lambda m, u, p: jnp.where(m, u, -p.astype(u.dtype)), masks, inner_updates, params
        )
        return out, SparseState(masks, inner_state, state.count + 1, key_data(next_key))

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
