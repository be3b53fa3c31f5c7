"""The search phase of a diagonal layer: gate, exploration and the product on the top gates.

``W_eff = sum_p gate[p] * values[p]`` placed on diagonal ``p``, with
``gate = sparse_soft_topk(alpha, K, strength=s)`` or ``softmax_topk(alpha, K, temperature=T)``.
The product runs on the diagonals with the largest gate only (``jax.lax.top_k``, static shapes)
through :func:`dynadiag_jax.diag_matmul`; a dense ``W`` is never built. How many are computed
depends on ``spec.explore``:

* ``"buckets"``: every diagonal with a non-zero gate, in the smallest of ``num_buckets`` static
  sizes from ``K_cap`` up to ``P`` that holds the gate's support (``lax.switch``).
* ``"dense_score"``: ``K_cap`` diagonals; when ``score`` is set the backward pass also runs one
  diagonal SDDMM over all ``P`` offsets, so every diagonal gets its exact gradient.
* ``"none"``: ``K_cap`` diagonals; the gate mass outside is dropped (and reported).

Element (``values[P, D]``) and block (``values[P_b, L_b, b, b]``) diagonals take the same path:
the gate scales a whole diagonal, whatever its shape.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dynadiag_jax.ops.diag_matmul import diag_matmul_in_range, resolve_impl
from dynadiag_jax.topk import softmax_topk, sparse_soft_topk

__all__ = ["SearchStats", "bucket_sizes", "gate_values", "search_forward"]


class SearchStats(NamedTuple):
    """Float32 scalars of one search-phase call, for logging.

    Attributes:
      gate_nonzero: number of non-zero gates (the support).
      gate_mass_outside: gate mass on diagonals that were not computed.
      gate_mean: mean gate.
      computed_diagonals: number of diagonals in the product.
    """

    gate_nonzero: jax.Array
    gate_mass_outside: jax.Array
    gate_mean: jax.Array
    computed_diagonals: jax.Array


def bucket_sizes(k_cap: int, num_candidates: int, num_buckets: int) -> tuple[int, ...]:
    """Static numbers of computed diagonals for ``explore="buckets"``: geometric ``k_cap .. P``.

    The last size is always ``P``, so any support fits; one bucket means always computing all.
    """
    if k_cap >= num_candidates or num_buckets <= 1:
        return (num_candidates,)
    ratio = (num_candidates / k_cap) ** (1.0 / (num_buckets - 1))
    sizes = {min(num_candidates, math.ceil(k_cap * ratio**i)) for i in range(num_buckets - 1)}
    return tuple(sorted(sizes | {num_candidates}))


def gate_values(spec, alpha, hyper):
    """``gate[P]`` of ``alpha[P]`` for the spec's gate, in ``alpha``'s dtype."""
    hyper = jnp.asarray(hyper, alpha.dtype)
    if spec.gate == "sparse_topk":
        return sparse_soft_topk(alpha, spec.k, strength=hyper)
    return softmax_topk(alpha, spec.k, temperature=hyper)


@functools.partial(jax.jit, static_argnums=(0,))
def search_forward(spec, alpha, values, x, *, hyper, score=False):
    """The search-phase product ``x @ W_eff.T`` (no bias) and its :class:`SearchStats`.

    Args:
      spec: the layer's :class:`dynadiag_jax.nn.functional.LayerSpec`.
      alpha: ``[P]`` scores (float32 or wider).
      values: ``[P, *V]`` diagonal values.
      x: ``[..., in]`` in the computation dtype.
      hyper: the gate's strength or temperature (scalar, may be traced).
      score: bool scalar; with ``explore="dense_score"``, score every diagonal this call.

    Returns:
      ``(y[..., out] in x.dtype, SearchStats)``.

    Jitted with ``spec`` static: an eager ``init`` compiles the product once per layer shape
    instead of dispatching its ops one by one, and a model traces it once per layer shape.
    """
    gate = gate_values(spec, alpha, hyper)
    p, k_cap = spec.num_candidates, spec.k_cap
    product = _Product(x, values, gate, spec.out_features, spec.impl)
    rows = int(np.prod(x.shape[:-1], dtype=np.int64))
    if (
        spec.explore == "buckets"
        and resolve_impl(spec.impl, x.dtype, spec.geometry, rows, k_cap) == "dense"
    ):
        # W built and XLA's dot: the cost does not depend on how many diagonals, so one product
        # over all P replaces the buckets.
        y, kept = product.sparse(p)
        computed = jnp.asarray(p, jnp.float32)
    elif spec.explore == "buckets":
        sizes = bucket_sizes(k_cap, p, spec.num_buckets)
        support = jnp.sum(gate > 0)
        branch = jnp.minimum(jnp.searchsorted(jnp.asarray(sizes), support), len(sizes) - 1)
        if len(sizes) == 1:
            y, kept = product.sparse(sizes[0])
        else:
            y, kept = jax.lax.switch(branch, [lambda s=s: product.sparse(s) for s in sizes])
        computed = jnp.asarray(sizes, jnp.float32)[branch]
    elif spec.explore == "dense_score":
        y, kept = jax.lax.cond(
            jnp.asarray(score, jnp.bool_),
            lambda: product.scored(k_cap),
            lambda: product.sparse(k_cap),
        )
        computed = jnp.asarray(k_cap, jnp.float32)
    else:
        y, kept = product.sparse(k_cap)
        computed = jnp.asarray(k_cap, jnp.float32)
    stats = SearchStats(
        gate_nonzero=jnp.sum(gate > 0).astype(jnp.float32),
        gate_mass_outside=jax.lax.stop_gradient(jnp.sum(gate) - kept).astype(jnp.float32),
        gate_mean=jax.lax.stop_gradient(jnp.mean(gate)).astype(jnp.float32),
        computed_diagonals=computed,
    )
    return y, stats


class _Product:
    """The diagonal product of one search-phase call, on a chosen number of top-gate diagonals."""

    def __init__(self, x, values, gate, out_features, impl):
        self.x, self.values, self.gate = x, values, gate
        self.out_features, self.impl = out_features, impl

    def _select(self, size: int):
        # Ascending offsets, as in the frozen phase: kernels see one ordering in both phases.
        if size == self.gate.shape[0]:  # every diagonal: nothing to rank
            return jnp.arange(size, dtype=jnp.int32)
        _, idx = jax.lax.top_k(jax.lax.stop_gradient(self.gate), size)
        return jnp.sort(idx).astype(jnp.int32)

    def sparse(self, size: int):
        """``(y, gate mass computed)`` over the ``size`` diagonals with the largest gate."""
        idx = self._select(size)
        w = _selected_weights(self.gate, self.values, idx, self.x.dtype)
        y = diag_matmul_in_range(self.x, w, idx, out_features=self.out_features, impl=self.impl)
        return y, jnp.sum(self.gate[idx])

    def scored(self, size: int):
        """As :meth:`sparse`, with exact gradients for all ``P`` diagonals (dense SDDMM)."""
        idx = self._select(size)
        y = _scored_vjp(self.out_features, self.impl)(self.x, self.gate, self.values, idx)
        return y, jnp.sum(self.gate[idx])


def _per_row(gate, ndim: int):
    """``gate[K]`` shaped to broadcast over ``values[K, *V]`` (``ndim`` axes)."""
    return gate.reshape(gate.shape + (1,) * (ndim - 1))


def _selected_weights(gate, values, idx, dtype):
    """``gate[idx] * values[idx]`` (in the gate's dtype), cast to the compute dtype."""
    rows = values[idx].astype(gate.dtype)
    return (_per_row(gate[idx], rows.ndim) * rows).astype(dtype)


@functools.cache
def _scored_vjp(out_features: int, impl: str):
    """``y = x @ W_sel.T`` over ``idx``, whose VJP gives every diagonal its exact gradient.

    Forward and ``dx`` use the ``len(idx)`` selected diagonals; ``dgate[p] = <values[p], G[p]>``
    and ``dvalues[p] = gate[p] * G[p]`` for all ``p``, with ``G`` the diagonal SDDMM of ``dy`` and
    ``x`` over every offset (one dense-cost reduction, never a dense ``W``).
    """

    @jax.custom_vjp
    def f(x, gate, values, idx):
        w = _selected_weights(gate, values, idx, x.dtype)
        return diag_matmul_in_range(x, w, idx, out_features=out_features, impl=impl)

    def fwd(x, gate, values, idx):
        return f(x, gate, values, idx), (x, gate, values, idx)

    def bwd(res, dy):
        x, gate, values, idx = res
        w = _selected_weights(gate, values, idx, x.dtype)
        _, pull_x = jax.vjp(
            lambda x_: diag_matmul_in_range(x_, w, idx, out_features=out_features, impl=impl), x
        )
        (dx,) = pull_x(dy)
        every = jnp.arange(values.shape[0], dtype=jnp.int32)
        _, pull_v = jax.vjp(
            lambda v: diag_matmul_in_range(x, v, every, out_features=out_features, impl=impl),
            jnp.zeros(values.shape, x.dtype),
        )
        (g_all,) = pull_v(dy)
        g_all = g_all.astype(gate.dtype)
        dgate = jnp.sum(values.astype(gate.dtype) * g_all, axis=tuple(range(1, values.ndim)))
        dvalues = (_per_row(gate, values.ndim) * g_all).astype(values.dtype)
        return dx, dgate, dvalues, None

    f.defvjp(fwd, bwd)
    return f
