"""Differentiable top-k gates over diagonal scores (docs/design.md section 3).

* :func:`sparse_soft_topk`: the Euclidean projection of ``scores / strength`` onto
  ``{y : 0 <= y <= 1, sum(y) = k}`` (Sander et al. 2023, p = 2). Exactly zero outside its top
  entries, so a layer only has to compute the diagonals with a non-zero gate.
* :func:`softmax_topk`: ``clip(k * softmax(scores / T), 0, 1)``, the gate of the authors' released
  code; never exactly sparse.

Both take their hyper-parameter (``strength`` / ``temperature``) as a scalar that may be traced,
e.g. a schedule inside ``jit``. Every value gives a defined gate, never NaN: a value of 0 is the
limit of the gate as the value goes to 0 (see each function), a traced negative or NaN value acts
as 0, and gradients there are zero. Concrete values are checked at trace time: negative or NaN
raises.

Infinite scores give the gate's limit as they grow, never NaN: ``+inf`` scores share the budget
as ties at the top do (sparse gate: 1 each while fewer than ``k``, else ``k / count``; softmax
gate: ``min(1, k / count)`` each, 0 elsewhere), and ``-inf`` scores get 0 (sparse gate: unless
fewer than ``ceil(k)`` scores lie above them, which then get 1 and leave them the rest, shared).
Where that limit is the hard gate (an infinite ``ceil(k)``-th largest score for the sparse gate,
an infinite maximum for the softmax one) the gate is the hard gate for every value of the
hyper-parameter, with zero gradient. A NaN score has no rank: its whole row of gates is NaN (so
the loss shows the diverged score), with zero gradient.

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
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dynadiag_jax._dtypes import work_dtype

__all__ = [
    "sparse_soft_topk",
    "softmax_topk",
    "capped_simplex_projection",
    "check_gate_value",
    "nan_if_nan",
]

# The softmax gate clips its shifted logits (all <= 0) from below here: exp of anything below is
# exactly 0 in float32 and float64, so the clip changes no value, and a tiny temperature cannot
# turn a logit into -inf (whose gradient would be inf * 0 = NaN).
_MIN_LOGIT = -1000.0


def _check_k(k, n: int, fn: str):
    if isinstance(k, bool) or not isinstance(k, numbers.Real):
        raise TypeError(f"{fn}: k must be a Python number (static), got {type(k).__name__}")
    if not 0 < k <= n:
        raise ValueError(f"{fn}: k must be in (0, n] = (0, {n}] for scores of size {n}, got {k}")


def check_gate_value(value, name: str, fn: str | None = None):
    """Rejects a missing, non-scalar, negative or NaN gate hyper-parameter known at trace time.

    A traced value's shape is checked (it is static); its value cannot be read inside ``jit``, so
    the gates define what every traced value does (a negative or NaN one acts as 0), and a
    layer's output is NaN for a NaN one (:func:`nan_if_nan`).
    """
    where = f"{fn}: " if fn else ""
    if value is None:
        raise TypeError(f"{where}{name} is required (a scalar >= 0)")
    if isinstance(value, jax.core.Tracer):
        if value.ndim != 0:  # as eagerly: a shape (3,) was refused eagerly, applied under jit
            raise ValueError(f"{where}{name} must be a scalar, got shape {value.shape}")
        return
    arr = np.asarray(value)
    real = jnp.issubdtype(arr.dtype, jnp.integer) or jnp.issubdtype(arr.dtype, jnp.floating)
    if isinstance(value, bool) or not real:  # jnp's test: numpy's misses bfloat16
        raise TypeError(f"{where}{name} must be a number >= 0, got {value!r}")
    if arr.ndim != 0:
        raise ValueError(f"{where}{name} must be a scalar, got shape {arr.shape}")
    if not arr >= 0:
        raise ValueError(f"{where}{name} must be >= 0 (0 is the hard limit), got {value!r}")


def nan_if_nan(y, value):
    """``y``, or NaN everywhere in it when the gate hyper-parameter ``value`` is NaN.

    A layer's answer to a traced NaN strength or temperature, which :func:`check_gate_value`
    cannot refuse: no gate belongs to it, and NaN outputs say so in the loss (as an offset out of
    range known only at run time does), where computing on would hide a broken schedule.
    """
    return jnp.where(jnp.isnan(value), jnp.asarray(jnp.nan, y.dtype), y)


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
    breakpoints at ``z_i - 1`` and ``z_i``. Two rounds over the ``2n`` sorted breakpoints find
    the segment ``[lo, hi]`` with ``f(lo) >= k > f(hi)``: ``f`` at every ``s``-th breakpoint
    (``s ~ sqrt(2n)``) brackets it within ``s``, then ``f`` at each breakpoint of the bracket
    pins it (``O(n sqrt(n))`` work in a few vectorized ops, no loop: a loop or a running sum would
    cost far more to compile than to run). On the segment's interior the sets of saturated
    (``y = 1``) and free (``0 < y < 1``) entries are fixed, and ``sum(y) = k`` gives ``tau`` in
    closed form. ``f(min z - 1) = n > k`` and ``f(max z) = 0 < k`` bound the search.
    """
    n = z.shape[-1]
    last = 2 * n - 1
    zm1 = z - 1
    breaks = jnp.sort(jnp.concatenate([zm1, z], axis=-1), axis=-1)
    stride = math.ceil(math.sqrt(2 * n))

    def last_at_least_k(idx):
        """The largest of ``idx[..., M]`` (ascending) where ``f >= k``, or ``idx[..., 0]``."""
        t = jnp.take_along_axis(breaks, jnp.minimum(idx, last), axis=-1)
        f = jnp.sum(jnp.clip(z[..., None, :] - t[..., :, None], 0, 1), axis=-1)
        return jnp.max(jnp.where(f >= k, idx, idx[..., :1]), axis=-1, keepdims=True)

    def steps(count):
        return jax.lax.broadcasted_iota(jnp.int32, z.shape[:-1] + (count,), z.ndim - 1)

    lo = last_at_least_k(stride * steps(-(-last // stride)))  # f(lo) >= k > f(lo + stride)
    lo = last_at_least_k(lo + steps(stride))
    b_lo = jnp.take_along_axis(breaks, lo, axis=-1)
    b_hi = jnp.take_along_axis(breaks, lo + 1, axis=-1)
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


@jax.custom_vjp
def _threshold(z, tau):
    """``clip(z - tau, 0, 1)`` for the projection's threshold ``tau[..., 1]`` (no gradient)."""
    return jnp.clip(z - tau, 0, 1)


def _threshold_fwd(z, tau):
    # A gradient of a gradient differentiates this output: written so that plain autodiff of it
    # gives the projection's Jacobian too (tau moved by mean_F(z)'s change, zero in value). With
    # a plain clip it saw no centring, and Hessians through alpha were 2-5% off.
    y = z - jax.lax.stop_gradient(tau)
    free = jax.lax.stop_gradient((y > 0) & (y < 1))
    mean_f = _free_mean(free, z)
    moved = y - (mean_f - jax.lax.stop_gradient(mean_f))
    return jnp.where(free, moved, jax.lax.stop_gradient(jnp.clip(y, 0, 1))), free


def _threshold_bwd(free, g):
    # The projection's Jacobian: on the free set F it is I - 11^T/|F| (tau moves with z so that
    # the sum stays k), zero elsewhere; centre g within F.
    return jnp.where(free, g - _free_mean(free, g), 0), None


def _free_mean(free, v):
    """The mean of ``v[..., n]`` over the entries ``free`` marks, ``[..., 1]`` (0 where none)."""
    n_free = jnp.maximum(jnp.sum(free, axis=-1, keepdims=True), 1).astype(v.dtype)
    return jnp.sum(jnp.where(free, v, 0), axis=-1, keepdims=True) / n_free


_threshold.defvjp(_threshold_fwd, _threshold_bwd)


class SparseSolution(NamedTuple):
    """The non-differentiable part of :func:`sparse_soft_topk` of ``scores[..., n]``, per row.

    Every field is ``[..., 1]`` in the scores' work dtype.

    Attributes:
      kth: the ``ceil(k)``-th largest score.
      tau: the threshold of the projection of ``clip((scores - kth) / strength, -2, 2)``.
      share: the hard gate (strength 0) of the scores tied with ``kth``.
    """

    kth: jax.Array
    tau: jax.Array
    share: jax.Array


def _row_hyper(value, s):
    """The hyper-parameter, one per row of ``s[..., n]``, as ``[..., 1]``."""
    value = jnp.broadcast_to(jnp.asarray(value, s.dtype), s.shape[:-1])
    return value.reshape(value.shape + (1,))


def sparse_solution(s, k, strength) -> SparseSolution:
    """:class:`SparseSolution` of work-dtype scores ``s[..., n]`` (``0 < k <= n``, no gradient).

    ``strength`` is a scalar or one value per row (``[...]``). The sort and the threshold search
    are the costly part of the gate to compile and to run; :func:`sparse_gate` finishes it.
    """
    return solution_from_kth(s, k, strength, _kth_largest(s, k))


def solution_from_kth(s, k, strength, kth) -> SparseSolution:
    """:func:`sparse_solution` given ``kth[..., 1]``, the ``ceil(k)``-th largest of ``s`` (e.g.
    read from a ranking instead of sorted again)."""
    s, kth = jax.lax.stop_gradient(s), jax.lax.stop_gradient(kth)
    _, safe = _split_hyper(_row_hyper(strength, s), s.dtype)
    above, tied = s > kth, s == kth
    n_above = jnp.sum(above, axis=-1, keepdims=True).astype(s.dtype)
    n_tied = jnp.maximum(jnp.sum(tied, axis=-1, keepdims=True), 1).astype(s.dtype)
    share = (k - n_above) / n_tied
    if k == s.shape[-1]:
        return SparseSolution(kth, jnp.zeros_like(kth), share)
    # After the shift the ceil(k)-th largest entry is 0, so tau <= 0 and every entry >= 1 projects
    # to 1; an entry <= -1 with y > 0 would need tau < -1, putting 1 on the top ceil(k) entries
    # and exceeding the budget, so it projects to 0. Clipping to [-2, 2] therefore changes no
    # output, and keeps infinite inputs (a tiny strength) out of the breakpoint search, where
    # inf - inf would give NaN.
    z = jnp.clip((s - kth) / safe, -2, 2)
    tau, _ = _solve_tau(z, float(k))
    return SparseSolution(kth, tau, share)


def sparse_gate(s, k, strength, solution: SparseSolution):
    """The sparse gate of work-dtype scores ``s[..., n]`` given their :class:`SparseSolution`.

    Differentiable in ``s`` in reverse mode, to any order (the projection's closed-form
    Jacobian); ``strength`` as in :func:`sparse_solution`.
    """
    nan_rows = jnp.any(jnp.isnan(s), axis=-1, keepdims=True)
    if k == s.shape[-1]:  # the feasible set is the single point y = 1, for every strength
        return _nan_where(nan_rows, jnp.ones_like(s))
    positive, safe = _split_hyper(_row_hyper(strength, s), s.dtype)
    # s - kth is NaN on a row with a NaN score or an infinite kth (ceil(k) scores at +inf, or
    # fewer above -inf); the gate's limit as those infinite scores grow is the hard gate. The
    # soft branch sees zeros there, so that its discarded gradient is 0, not NaN.
    defined = jnp.isfinite(solution.kth) & ~nan_rows
    # Shift before scaling (exact by shift invariance) so 1/strength does not magnify rounding.
    # The clip to [-2, 2] changes no output (see sparse_solution).
    z = _scaled(jnp.where(defined, s - solution.kth, 0), safe, -2.0, 2.0)
    soft = _threshold(z, solution.tau)
    # strength 0: 1 above the ceil(k)-th largest, 0 below it, the rest of the budget shared by
    # the scores tied with it (no gradient)
    hard = jnp.where(s > solution.kth, 1.0, jnp.where(s == solution.kth, solution.share, 0.0))
    return _nan_where(nan_rows, jnp.where(positive & defined, soft, hard.astype(s.dtype)))


def _nan_where(rows, gate):
    """``gate`` with NaN on ``rows`` (``[..., 1]``), those holding a NaN score: such a row has no
    ranking, and the loss should show the diverged score rather than a gate made up around it."""
    return jnp.where(rows, jnp.asarray(jnp.nan, gate.dtype), gate)


def capped_simplex_projection(z, k):
    """Euclidean projection of ``z[..., n]`` onto ``{y : 0 <= y <= 1, sum(y) = k}`` (last axis).

    ``y = clip(z - tau, 0, 1)`` with ``tau`` solved exactly (a sort and a search over the sorted
    breakpoints, O(n sqrt(n)) vectorized work, no loop, no host callback). Differentiable in
    reverse mode with the closed-form Jacobian: on the free set ``F = {0 < y < 1}`` it is
    ``I - 11^T / |F|``, elsewhere zero.

    Args:
      z: ``[..., n]`` floating.
      k: static Python number in ``(0, n]``.

    Returns:
      ``[..., n]`` in ``z.dtype`` (computed in float32 or wider); NaN on a row with a NaN score.
    """
    fn = "capped_simplex_projection"
    _check_scores(z, fn)
    n = z.shape[-1]
    _check_k(k, n, fn)
    # Low-precision input is projected in float32: tau is a difference of nearby sums.
    w = z.astype(work_dtype(z.dtype))
    nan_rows = jnp.any(jnp.isnan(w), axis=-1, keepdims=True)
    if k == n:  # the feasible set is the single point y = 1
        return _nan_where(nan_rows, jnp.ones_like(z))
    # the sparse gate's solution at strength 1: the same shift, clip and threshold
    solution = sparse_solution(w, k, 1.0)
    return _nan_where(nan_rows, _threshold(w - solution.kth, solution.tau)).astype(z.dtype)


def _hard_argmax(s, k):
    """The limit of ``clip(k * softmax(s / T), 0, 1)`` as ``T -> 0+`` (no gradient).

    All the mass goes to the maximal scores: ``min(1, k / m)`` on each of the ``m`` entries equal
    to the maximum, 0 elsewhere.
    """
    s = jax.lax.stop_gradient(s)
    top = s == jnp.max(s, axis=-1, keepdims=True)
    m = jnp.maximum(jnp.sum(top, axis=-1, keepdims=True), 1).astype(s.dtype)
    return jnp.where(top, jnp.minimum(1.0, k / m), 0.0).astype(s.dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(2, 3))
def _scaled(d, h, lo, hi):
    """``clip(d / h, lo, hi)`` for ``h > 0``, with derivatives that stay finite for a tiny ``h``.

    Autodiff of ``d / h`` would form ``d / h**2``, which overflows for ``h`` below ~1e-19 in
    float32 and turns the zero cotangent of a clipped entry into ``0 * inf = NaN``; the tangent
    here is written with the clipped quotient instead.
    """
    return jnp.clip(d / h, lo, hi)


@_scaled.defjvp
def _scaled_jvp(lo, hi, primals, tangents):
    d, h = primals
    d_dot, h_dot = tangents
    q = d / h
    z = jnp.clip(q, lo, hi)
    return z, jnp.where((q > lo) & (q < hi), (d_dot - z * h_dot) / h, 0)


# The largest strength or temperature a gate divides by: an infinite one made inf / inf = NaN of
# an infinite score, and above about 1 / tiny (~8.5e37) a finite score's quotient is denormal and
# the threshold solve gave gates of 1 on every finite entry. 1e30 is already the smooth limit.
_MAX_HYPER = 1e30


def _split_hyper(value, work):
    """``(positive, safe)``: whether the traced value is > 0, and the value with 1 elsewhere
    (and at most :data:`_MAX_HYPER`).

    The soft branch is computed with ``safe`` so that neither it nor its gradient can hold NaN
    where the hard branch is chosen (``jnp.where`` would still propagate a NaN gradient).
    """
    value = jnp.asarray(value, work)
    positive = value > 0  # False for negative and NaN values
    return positive, jnp.where(positive, jnp.minimum(value, _MAX_HYPER), jnp.ones_like(value))


def sparse_soft_topk(scores, k, *, strength):
    """Sparse soft top-k mask (Sander et al. 2023, p = 2) along the last axis.

    The projection of ``scores / strength`` onto ``{y : 0 <= y <= 1, sum(y) = k}``:
    ``y = clip(scores / strength - tau, 0, 1)``. It is exactly zero outside the top entries, sums to
    ``k``, gives equal outputs to equal scores, and tends to the hard top-k mask as
    ``strength -> 0`` (larger strength: smoother and denser). Gradients (and gradients of them)
    use the closed-form Jacobian ``(1 / strength) * (I - 11^T / |F|)`` on the free set
    ``F = {0 < y < 1}``, zero elsewhere. jit-, grad- and vmap-able; no ``jax.jvp`` of the gate
    itself, but forward over reverse (``jax.hessian``) runs.

    ``strength = 0`` is that limit: 1 on the scores above the ``ceil(k)``-th largest, 0 below it,
    and the remaining budget shared equally by the scores tied with it; the gradient is zero
    there. A traced negative or NaN strength (e.g. a schedule overshooting 0 inside ``jit``) acts
    as 0. The gradient with respect to the scores grows as ``1 / strength`` on the free set, which
    only holds scores within ``strength`` of each other. Infinite scores give the gate's limit,
    NaN ones a NaN row (see the module docstring): with ``k`` below the number of ``+inf``
    scores, each gets ``k / count``, whatever the strength.

    Args:
      scores: ``[..., n]`` floating.
      k: static Python number in ``(0, n]`` (the budget).
      strength: scalar ``>= 0`` (may be traced; a concrete negative or NaN value raises).

    Returns:
      ``[..., n]`` gate in ``scores.dtype``.

    Raises:
      ValueError: ``k`` outside ``(0, n]``, a negative or NaN concrete ``strength``.
      TypeError: ``scores`` not floating, ``k`` or ``strength`` not a number (or missing).
    """
    fn = "sparse_soft_topk"
    _check_scores(scores, fn)
    _check_k(k, scores.shape[-1], fn)
    check_gate_value(strength, "strength", fn)
    s = scores.astype(work_dtype(scores.dtype))
    return sparse_gate(s, k, strength, sparse_solution(s, k, strength)).astype(scores.dtype)


def softmax_topk(scores, k, *, temperature):
    """Temperature soft top-k of the authors' released code: ``clip(k * softmax(s / T), 0, 1)``.

    Never exactly sparse (every entry > 0 up to underflow) and its sum is at most ``k``; as
    ``T -> 0`` its mass concentrates on the arg-max, not on the top-k, so the released recipe
    relies on a hard freeze.

    ``temperature = 0`` is that limit: ``min(1, k / m)`` on each of the ``m`` scores equal to the
    maximum (a single 1 for distinct scores), 0 elsewhere, with zero gradient. A traced negative or
    NaN temperature acts as 0. An infinite maximum gives that limit too, whatever the
    temperature (``+inf`` scores share ``k``, at most 1 each); ``-inf`` scores otherwise get 0,
    and a NaN score makes its row NaN (see the module docstring).

    Args:
      scores: ``[..., n]`` floating.
      k: static Python number in ``(0, n]``.
      temperature: scalar ``>= 0`` (may be traced; a concrete negative or NaN value raises).

    Returns:
      ``[..., n]`` gate in ``scores.dtype``.
    """
    fn = "softmax_topk"
    _check_scores(scores, fn)
    _check_k(k, scores.shape[-1], fn)
    check_gate_value(temperature, "temperature", fn)
    return softmax_gate(scores.astype(work_dtype(scores.dtype)), k, temperature).astype(
        scores.dtype
    )


def softmax_gate(s, k, temperature):
    """:func:`softmax_topk` of work-dtype scores ``s[..., n]`` without the checks; ``temperature``
    is a scalar or one value per row (``[...]``)."""
    positive, safe = _split_hyper(_row_hyper(temperature, s), s.dtype)
    top = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))  # NaN if a score is NaN
    # s - top is NaN on a row with a NaN score or an infinite maximum; the gate's limit as the
    # scores equal to an infinite maximum grow is the hard gate. The soft branch sees zeros
    # there, so that its discarded gradient is 0, not NaN.
    finite = jnp.isfinite(top)
    shifted = jnp.where(finite, s - top, 0)  # <= 0
    p = jax.nn.softmax(_scaled(shifted, safe, _MIN_LOGIT, 1.0), axis=-1)
    soft = jnp.clip(jnp.asarray(k, s.dtype) * p, 0, 1)
    gate = jnp.where(positive & finite, soft, _hard_argmax(s, k))
    return _nan_where(jnp.isnan(top), gate)
