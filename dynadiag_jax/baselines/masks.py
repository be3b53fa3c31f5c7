"""Binary masks with exact counts: the selection primitive of every unstructured baseline.

All selections here pick an *exact* number of entries, so a layer's active-weight count is an
invariant of the update rules rather than an approximation. Ties are broken towards the lower
flat index, which keeps every rule deterministic for a given key.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dynadiag_jax._checks import int_at_least

__all__ = ["num_active", "top_n_mask", "random_mask"]


def num_active(size: int, sparsity: float) -> int:
    """Weights kept in a layer of ``size`` entries: ``size - floor(sparsity * size)``.

    This is the RigL/jaxpruner convention; it keeps at least one weight for any ``sparsity < 1``.

    Raises:
      TypeError: ``size`` not an int, ``sparsity`` not a number.
      ValueError: if ``sparsity`` is not in ``[0, 1)`` or ``size < 1``.
    """
    size = int_at_least(size, "size", 1)
    if isinstance(sparsity, str | bytes | bool) or not hasattr(sparsity, "__float__"):
        raise TypeError(f"sparsity must be a number, got {type(sparsity).__name__}")
    if not 0.0 <= float(sparsity) < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity!r}")
    return size - math.floor(sparsity * size)


def top_n_mask(scores, n):
    """Mask of the ``n`` largest ``scores`` (any shape); ``n`` may be traced.

    Entries scored ``-inf`` are chosen only when fewer than ``n`` finite scores exist, so callers
    exclude entries from a selection by scoring them ``-inf``.

    Args:
      scores: ``[...]`` floating scores.
      n: integer (Python or traced) in ``[0, scores.size]``.

    Returns:
      bool ``[...]`` with exactly ``clip(n, 0, size)`` true entries.
    """
    flat = scores.reshape(-1)
    # A stable descending sort gives each entry its rank; ranks below n are selected.
    order = jnp.argsort(-flat, stable=True)
    ranks = jnp.zeros(flat.shape, jnp.int32).at[order].set(jnp.arange(flat.size, dtype=jnp.int32))
    return (ranks < jnp.asarray(n, jnp.int32)).reshape(scores.shape)


def random_mask(key, shape, n):
    """Uniformly random bool mask of ``shape`` with exactly ``n`` true entries."""
    return top_n_mask(jax.random.uniform(key, shape, jnp.float32), n)
