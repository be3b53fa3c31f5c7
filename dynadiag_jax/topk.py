"""Differentiable top-k gates over diagonal scores (docs/design.md section 3).

* :func:`sparse_soft_topk`: the Euclidean projection of ``scores / strength`` onto
  ``{y : 0 <= y <= 1, sum(y) = k}`` (Sander et al. 2023, p = 2). Exactly zero outside its top
  entries, so a layer only has to compute the diagonals with a non-zero gate.
* :func:`softmax_topk`: ``clip(k * softmax(scores / T), 0, 1)``, the gate of the authors' released
  code; never exactly sparse.

References:
  Sander, Puigcerver, Djolonga, Peyre, Blondel, "Fast, Differentiable and Sparse Top-k: a Convex
  Analysis Perspective", ICML 2023, https://arxiv.org/abs/2302.01425
  Tyagi et al., "Dynamic Sparse Training of Diagonally Sparse Networks", ICML 2025,
  https://arxiv.org/abs/2506.11449
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from dynadiag_jax._dtypes import work_dtype

__all__ = ["sparse_soft_topk", "softmax_topk", "capped_simplex_projection"]


def _check_k(k, n: int, fn: str):
    if isinstance(k, bool) or not isinstance(k, numbers.Real):
        raise TypeError(f"{fn}: k must be a Python number (static), got {type(k).__name__}")
    if not 0 < k <= n:
        raise ValueError(f"{fn}: k must be in (0, n] = (0, {n}] for scores of size {n}, got {k}")


def _check_positive(value, name: str, fn: str):
    """Rejects a missing or non-positive hyper-parameter when its value is known at trace time."""
    if value is None:
        raise ValueError(f"{fn}: {name} is required (a positive scalar)")
    if isinstance(value, jax.core.Tracer):
        return
    arr = np.asarray(value)
    if arr.ndim != 0:
        raise ValueError(f"{fn}: {name} must be a scalar, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.number) or not arr > 0:
        raise ValueError(f"{fn}: {name} must be > 0, got {value!r}")


def _check_scores(scores, fn: str):
    if not hasattr(scores, "shape") or not hasattr(scores, "dtype"):
        raise TypeError(f"{fn}: scores must be an array, got {type(scores).__name__}")
    if scores.ndim < 1:
        raise ValueError(f"{fn}: scores must have shape [..., n], got a scalar")
    if not jnp.issubdtype(scores.dtype, jnp.floating):
        raise TypeError(f"{fn}: scores must be floating, got dtype {scores.dtype}")


def _solve_tau(z, k: float):
    """Threshold ``tau`` and free-set mask of the projection of ``z[..., n]`` (``0 < k < n``).

    ``f(t) = sum_i clip(z_i - t, 0, 1)`` is continuous, piecewise linear and non-increasing, with
    breakpoints at ``z_i - 1`` and ``z_i``. A binary search over the ``2n`` sorted breakpoints finds
    the segment ``[lo, hi]`` with ``f(lo) >= k > f(hi)``; on its interior the sets of saturated
    (``y = 1``) and free (``0 < y < 1``) entries are fixed, and ``sum(y) = k`` gives ``tau`` in
    closed form. ``f(min z - 1) = n > k`` and ``f(max z) = 0 < k`` bound the search.
    """
    n = z.shape[-1]
    zm1 = z - 1
    breaks = jnp.sort(jnp.concatenate([zm1, z], axis=-1), axis=-1)

    def f_at(idx):
        t = jnp.take_along_axis(breaks, idx[..., None], axis=-1)
        return jnp.sum(jnp.clip(z - t, 0, 1), axis=-1)

    def step(_, bounds):
        lo, hi = bounds
        mid = (lo + hi) // 2
        above = f_at(mid) >= k
        return jnp.where(above, mid, lo), jnp.where(above, hi, mid)

    lead = z.shape[:-1]
    lo = jnp.zeros(lead, jnp.int32)
    hi = jnp.full(lead, 2 * n - 1, jnp.int32)
    lo, hi = jax.lax.fori_loop(0, math.ceil(math.log2(2 * n - 1)), step, (lo, hi))
    b_lo = jnp.take_along_axis(breaks, lo[..., None], axis=-1)
    b_hi = jnp.take_along_axis(breaks, hi[..., None], axis=-1)
    # Membership on the open segment (b_lo, b_hi), decided against breakpoints computed by the
    # same float operations, so ties and rounding cannot misclassify an entry.
    ones = zm1 >= b_hi
    free = (z >= b_hi) & ~ones
    n_free = jnp.sum(free, axis=-1, keepdims=True).astype(z.dtype)
    n_ones = jnp.sum(ones, axis=-1, keepdims=True).astype(z.dtype)
    sum_free = jnp.sum(jnp.where(free, z, 0), axis=-1, keepdims=True)
    tau = jnp.where(n_free > 0, (sum_free + n_ones - k) / jnp.maximum(n_free, 1), b_lo)
    return tau, free


def _kth_largest(z, k: float):
    """The ``ceil(k)``-th largest entry along the last axis, ``[..., 1]``, without gradient.

    The projection is shift-invariant and ``tau`` lies in ``[z_(k+1) - 1, z_(k)]``; subtracting
    ``z_(k)`` first keeps the free entries near 0, so ``z - tau`` does not cancel large numbers.
    """
    n = z.shape[-1]
    rank = min(n, max(1, math.ceil(k)))
    return jax.lax.stop_gradient(jnp.sort(z, axis=-1)[..., n - rank : n - rank + 1])


def _project_value(z, k):
    z = z - _kth_largest(z, k)
    tau, _ = _solve_tau(z, k)
    return jnp.clip(z - tau, 0, 1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _project(z, k):
    return _project_value(z, k)


def _project_fwd(z, k):
    y = _project_value(z, k)
    return y, (y > 0) & (y < 1)


def _project_bwd(k, free, g):
    # Jacobian on the free set F is I - 11^T/|F|, zero elsewhere: centre g within F.
    del k
    n_free = jnp.maximum(jnp.sum(free, axis=-1, keepdims=True), 1).astype(g.dtype)
    mean_f = jnp.sum(jnp.where(free, g, 0), axis=-1, keepdims=True) / n_free
    return (jnp.where(free, g - mean_f, 0),)


_project.defvjp(_project_fwd, _project_bwd)


def capped_simplex_projection(z, k):
    """Euclidean projection of ``z[..., n]`` onto ``{y : 0 <= y <= 1, sum(y) = k}`` (last axis).

    ``y = clip(z - tau, 0, 1)`` with ``tau`` solved exactly (sort + binary search over breakpoints,
    O(n log n), no host callback). Differentiable with the closed-form VJP: on the free set
    ``F = {0 < y < 1}`` the Jacobian is ``I - 11^T / |F|``, elsewhere zero.

    Args:
      z: ``[..., n]`` floating.
      k: static Python number in ``(0, n]``.

    Returns:
      ``[..., n]`` in ``z.dtype`` (computed in float32 or wider).
    """
    fn = "capped_simplex_projection"
    _check_scores(z, fn)
    n = z.shape[-1]
    _check_k(k, n, fn)
    if k == n:  # the feasible set is the single point y = 1
        return jnp.ones_like(z)
    # Low-precision input is projected in float32: tau is a difference of nearby sums.
    zw = z.astype(work_dtype(z.dtype))
    return _project(zw, float(k)).astype(z.dtype)


def sparse_soft_topk(scores, k, *, strength):
    """Sparse soft top-k mask (Sander et al. 2023, p = 2) along the last axis.

    The projection of ``scores / strength`` onto ``{y : 0 <= y <= 1, sum(y) = k}``:
    ``y = clip(scores / strength - tau, 0, 1)``. It is exactly zero outside the top entries, sums to
    ``k``, gives equal outputs to equal scores, and tends to the hard top-k mask as
    ``strength -> 0`` (larger strength: smoother and denser). Gradients use the closed-form VJP
    ``(1 / strength) * (I - 11^T / |F|)`` on the free set ``F = {0 < y < 1}``, zero elsewhere.
    jit-, grad- and vmap-able.

    Args:
      scores: ``[..., n]`` floating.
      k: static Python number in ``(0, n]`` (the budget).
      strength: positive scalar (may be traced; a concrete value <= 0 raises).

    Returns:
      ``[..., n]`` gate in ``scores.dtype``.

    Raises:
      ValueError: ``k`` outside ``(0, n]``, a missing or non-positive ``strength``.
    """
    fn = "sparse_soft_topk"
    _check_scores(scores, fn)
    _check_k(k, scores.shape[-1], fn)
    _check_positive(strength, "strength", fn)
    work = work_dtype(scores.dtype)
    s = scores.astype(work)
    # Shift before scaling (exact by shift invariance) so 1/strength does not magnify rounding.
    z = (s - _kth_largest(s, k)) / jnp.asarray(strength, work)
    return capped_simplex_projection(z, k).astype(scores.dtype)


def softmax_topk(scores, k, *, temperature):
    """Temperature soft top-k of the authors' released code: ``clip(k * softmax(s / T), 0, 1)``.

    Never exactly sparse (every entry > 0 up to underflow) and its sum is at most ``k``; as
    ``T -> 0`` its mass concentrates on the arg-max, not on the top-k, so the released recipe
    relies on a hard freeze.

    Args:
      scores: ``[..., n]`` floating.
      k: static Python number in ``(0, n]``.
      temperature: positive scalar (may be traced; a concrete value <= 0 raises).

    Returns:
      ``[..., n]`` gate in ``scores.dtype``.
    """
    fn = "softmax_topk"
    _check_scores(scores, fn)
    _check_k(k, scores.shape[-1], fn)
    _check_positive(temperature, "temperature", fn)
    work = work_dtype(scores.dtype)
    p = jax.nn.softmax(scores.astype(work) / jnp.asarray(temperature, work), axis=-1)
    return jnp.clip(jnp.asarray(k, work) * p, 0, 1).astype(scores.dtype)
