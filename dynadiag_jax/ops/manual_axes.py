"""Results typed for ``jax.shard_map``: inside it every value records the manual mesh axes it
varies along, and a result varies along each axis any operand varies along, as a jnp op's does.

A primitive whose abstract evaluation leaves that out types a per-shard result as replicated:
``shard_map`` then accepted ``out_specs=P()`` for it and summed its gradients wrongly (relative
errors of 1-2 in a frozen layer's parameter gradients), and a scan whose carry starts at plain
zeros does not type-check there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.core import ShapedArray
from jax.sharding import PartitionSpec

__all__ = ["same_varying", "shaped_array", "varying_axes", "varying_zeros"]


def _varying(aval) -> frozenset:
    mat = getattr(aval, "manual_axis_type", None)
    return mat.varying if mat is not None else frozenset(getattr(aval, "vma", frozenset()))


def varying_axes(*avals) -> frozenset:
    """The manual mesh axes along which any of ``avals`` varies."""
    return frozenset().union(*map(_varying, avals))


def shaped_array(shape, dtype, *operands) -> ShapedArray:
    """``ShapedArray(shape, dtype)`` of a result of ``operands`` (avals)."""
    varying = varying_axes(*operands)
    if not varying:
        return ShapedArray(shape, dtype)
    like = next(a for a in operands if _varying(a))
    if not hasattr(like, "manual_axis_type"):  # JAX before manual_axis_type
        return ShapedArray(shape, dtype, vma=varying)
    # the operand's mesh (its manual axes), no dimension partitioned: a per-shard result
    sharding = like.sharding.update(spec=PartitionSpec(*([None] * len(shape))))
    mat = type(like.manual_axis_type)(varying=varying)
    return ShapedArray(shape, dtype, sharding=sharding, manual_axis_type=mat)


def varying_zeros(shape, dtype, *operands):
    """Zeros of ``shape`` typed as a result of ``operands`` (arrays): a scan carry that the body
    adds them into."""
    return _cast(jnp.zeros(shape, dtype), varying_axes(*(jax.typeof(a) for a in operands)))


def same_varying(*arrays):
    """``arrays`` each made to vary along every manual mesh axis any of them varies along, as jnp
    ops do with their operands before they bind: a replicated ``values`` beside a per-shard ``x``
    is cast to varying, and the transpose of that cast sums its gradient over the shards."""
    varying = varying_axes(*(jax.typeof(a) for a in arrays))
    if not varying:
        return arrays
    return tuple(_cast(a, varying - _varying(jax.typeof(a))) for a in arrays)


def _cast(a, missing: frozenset):
    return jax.lax.pcast(a, tuple(sorted(missing)), to="varying") if missing else a
