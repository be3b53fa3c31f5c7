"""The search phase of a diagonal layer: gate, exploration and the product on the top gates.

``W_eff = sum_p gate[p] * values[p]`` placed on diagonal ``p``, with
``gate = sparse_soft_topk(alpha, K, strength=s)`` or ``softmax_topk(alpha, K, temperature=T)``.
The product runs on the diagonals with the largest gate only (static shapes: a prefix of the
ranking of :func:`dynadiag_jax.ops.ranking.gate_rank`) through :func:`dynadiag_jax.diag_matmul`;
a dense ``W`` is never built. How many are computed depends on ``spec.explore``:

* ``"buckets"``: every diagonal with a non-zero gate, in the smallest of ``num_buckets`` static
  sizes from ``K_cap`` up to ``P`` that holds the gate's support (``lax.switch``).
* ``"dense_score"``: ``K_cap`` diagonals; when ``score`` is set the backward pass also runs one
  diagonal SDDMM over all ``P`` offsets, so every diagonal gets its exact gradient.
* ``"none"``: ``K_cap`` diagonals; the gate mass outside is dropped (and reported).

A layer in the working-set form (its ``"dynadiag"`` collection holds ``working_set[W]``,
:func:`working_set_forward`) computes exactly its ``W`` working-set diagonals instead, whatever
``explore`` says.

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
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

from dynadiag_jax.nn.functional import PRODUCT_NAME
from dynadiag_jax.ops.diag_matmul import diag_matmul_in_range, resolve_impl
from dynadiag_jax.ops.products import row_count
from dynadiag_jax.ops.ranking import gate_rank
from dynadiag_jax.topk import SparseSolution, softmax_gate, sparse_gate

__all__ = [
    "GateInputs",
    "SearchStats",
    "bucket_sizes",
    "gate_inputs",
    "search_forward",
    "working_set_forward",
    "working_set_problem",
]


class SearchStats(NamedTuple):
    """Float32 scalars of one search-phase call, for logging.

    Attributes:
      gate_nonzero: number of non-zero gates (the support).
      gate_mass_outside: gate mass on diagonals that were not computed.
      gate_mean: mean gate.
      computed_diagonals: number of diagonals in the product.
      output_scale: the product's expected output scale relative to the frozen layer's (the top-K
        diagonals by alpha at gate 1, same values): ``sqrt(sum_p (c g_p)^2 |v_p|^2 /
        sum_{p in top-K} |v_p|^2)`` with ``c`` the search scale, for inputs uncorrelated across
        diagonals: about ``sqrt(K / P)`` at a flat start without ``scale="rms"``.
    """

    gate_nonzero: jax.Array
    gate_mass_outside: jax.Array
    gate_mean: jax.Array
    computed_diagonals: jax.Array
    output_scale: jax.Array


def bucket_sizes(k_cap: int, num_candidates: int, num_buckets: int) -> tuple[int, ...]:
    """Static numbers of computed diagonals for ``explore="buckets"``: geometric ``k_cap .. P``.

    The last size is always ``P``, so any support fits; one bucket means always computing all.
    """
    if k_cap >= num_candidates or num_buckets <= 1:
        return (num_candidates,)
    ratio = (num_candidates / k_cap) ** (1.0 / (num_buckets - 1))
    sizes = {min(num_candidates, math.ceil(k_cap * ratio**i)) for i in range(num_buckets - 1)}
    return tuple(sorted(sizes | {num_candidates}))


class GateInputs(NamedTuple):
    """What a search-phase call needs from ``alpha`` alone (leading dims ``[...]`` allowed).

    Attributes:
      gate: ``[..., P]`` gate, in ``alpha``'s dtype (differentiable in ``alpha``).
      order: ``[..., P]`` int32, the diagonals by descending ``alpha`` (ties: lower offset
        first; NaN last). Both gates are non-decreasing in ``alpha``, so the diagonals with a
        non-zero sparse gate are a prefix of ``order``.
      rank: ``[..., P]`` int32, the position of each diagonal in ``order``.
      topk: ``[..., K]`` int32, the top-K offsets by ``alpha``, ascending
        (:func:`~dynadiag_jax.nn.functional.select_diagonals`).
      topk_changed: ``[...]`` float32, offsets in ``topk`` that were not in the previous top-K
        (0 without one).
      gate_nonzero: ``[...]`` float32, the number of non-zero gates.
      gate_mean: ``[...]`` float32, the mean gate.
    """

    gate: jax.Array
    order: jax.Array
    rank: jax.Array
    topk: jax.Array
    topk_changed: jax.Array
    gate_nonzero: jax.Array
    gate_mean: jax.Array


@functools.partial(jax.jit, static_argnames=("gate", "k", "impl"))
def gate_inputs(alpha, hyper, old_topk=None, *, gate: str, k: int, impl: str = "auto"):
    """:class:`GateInputs` of ``alpha[..., P]`` with the gate hyper-parameter ``hyper``.

    The ranking, the top-K refresh and the sparse gate's threshold come from one
    :func:`dynadiag_jax.ops.ranking.gate_rank` (one custom call on CPU); the gate itself is
    finished here, differentiable in ``alpha``.

    Args:
      alpha: ``[..., P]`` scores (float32 or wider).
      hyper: the gate's strength or temperature, a scalar or one per row (``[...]``).
      old_topk: ``[..., K]`` int32, the previous top-K, or None (``topk_changed`` is then 0).
      gate: ``"sparse_topk"`` or ``"softmax"``.
      k: the budget ``K``.
      impl: the layer's ``impl``; ``"jax"`` keeps the ranking on the pure-JAX path too.
    """
    lead = alpha.shape[:-1]
    sparse = gate == "sparse_topk"
    old = old_topk if old_topk is not None else jnp.zeros(lead + (k,), jnp.int32)
    ranked = gate_rank(alpha, hyper, old, sparse=sparse, impl=impl)
    if sparse:
        solution = SparseSolution(*(v[..., None] for v in (ranked.kth, ranked.tau, ranked.share)))
        values = sparse_gate(alpha, k, hyper, solution)
    else:
        values = softmax_gate(alpha, k, hyper)
    changed = ranked.changed if old_topk is not None else jnp.zeros(lead, jnp.float32)
    return GateInputs(
        gate=values,
        order=ranked.order,
        rank=ranked.rank,
        topk=ranked.topk,
        topk_changed=changed,
        gate_nonzero=jnp.sum(values > 0, axis=-1).astype(jnp.float32),
        gate_mean=jax.lax.stop_gradient(jnp.mean(values, axis=-1)).astype(jnp.float32),
    )


@functools.partial(jax.jit, static_argnums=(0,))
def search_forward(spec, values, x, inputs: GateInputs, *, score=False):
    """The search-phase product ``x @ W_eff.T`` (no bias) and its :class:`SearchStats`.

    Args:
      spec: the layer's :class:`dynadiag_jax.nn.functional.LayerSpec`.
      values: ``[P, *V]`` diagonal values.
      x: ``[..., in]`` in the computation dtype.
      inputs: the layer's :class:`GateInputs` (no leading dims), from :func:`gate_inputs`.
      score: bool scalar; with ``explore="dense_score"``, score every diagonal this call.

    Returns:
      ``(y[..., out] in x.dtype, SearchStats)``.

    Jitted with ``spec`` static: an eager ``init`` compiles the product once per layer shape
    instead of dispatching its ops one by one, and a model traces it once per layer shape.
    """
    gate, order, rank = inputs.gate, inputs.order, inputs.rank
    p, k_cap = spec.num_candidates, spec.k_cap
    rows = row_count(x)  # None for a symbolic batch (jax.export)
    if spec.explore == "buckets":
        if resolve_impl(spec.impl, x.dtype, spec.geometry, rows, k_cap) == "dense":
            # W built and XLA's dot: the cost does not depend on how many diagonals, so one
            # product over all P replaces the buckets, with nothing to rank.
            sizes, branch = (p,), jnp.asarray(0, jnp.int32)
            w = _weights(gate, values, x.dtype)
            every = jnp.arange(p, dtype=jnp.int32)
            y = diag_matmul_in_range(x, w, every, out_features=spec.out_features, impl=spec.impl)
        else:
            sizes = bucket_sizes(k_cap, p, spec.num_buckets)
            # the smallest size that holds the support (the last one, P, holds any)
            support = inputs.gate_nonzero
            branch = jnp.sum(support > jnp.asarray(sizes[:-1], support.dtype), dtype=jnp.int32)
            product = _ranked_product(sizes, spec.out_features, spec.impl)
            y = product(x, values, gate, order, branch)
        # every non-zero gate is computed
        outside = jnp.zeros((), jnp.float32)
        computed = gate
    else:
        sizes, branch = (k_cap,), jnp.asarray(0, jnp.int32)
        product = _ranked_product(sizes, spec.out_features, spec.impl)
        if spec.explore == "dense_score":
            y = jax.lax.cond(
                jnp.asarray(score, jnp.bool_),
                lambda: _scored_vjp(spec.out_features, spec.impl)(x, gate, values, order[:k_cap]),
                lambda: product(x, values, gate, order, branch),
            )
        else:
            y = product(x, values, gate, order, branch)
        outside = jnp.sum(jnp.where(rank >= k_cap, jax.lax.stop_gradient(gate), 0))
        # the product's gates: the ones beyond K_cap were never computed, and counting them left
        # the search at sqrt(K_cap / P) of the frozen scale while output_scale said 1
        computed = jnp.where(rank < k_cap, gate, 0)
    c = rms_scale(computed, spec.k) if spec.scale == "rms" else jnp.ones((), gate.dtype)
    if spec.scale == "rms":
        y = y * c.astype(y.dtype)
    stats = SearchStats(
        gate_nonzero=inputs.gate_nonzero,
        gate_mass_outside=outside.astype(jnp.float32),
        gate_mean=inputs.gate_mean,
        computed_diagonals=jnp.asarray(sizes, jnp.float32)[branch],
        output_scale=_output_scale(computed * c, values, order[: spec.k]),
    )
    return checkpoint_name(y, PRODUCT_NAME), stats


@functools.partial(jax.jit, static_argnums=(0,))
def working_set_forward(spec, values, working_set, x, inputs: GateInputs):
    """The search-phase product over a working set: ``x @ W_ws.T`` (no bias), :class:`SearchStats`.

    ``W_ws = sum_j gate[working_set[j]] * values[j]`` placed on diagonal ``working_set[j]``: the
    gate is computed over all ``P`` candidates (``inputs``) and read at the working set, so the
    gradient of ``alpha`` reaches every candidate through the gate, while ``values`` and the
    product are ``W``-sized (plain autodiff of :func:`dynadiag_jax.ops.diag_matmul_in_range`: no
    buckets, no ``[P, ...]`` buffer). Gate mass on candidates outside the working set is dropped
    and reported in ``gate_mass_outside``. ``scale="rms"`` is ``sqrt(K / sum(gate[ws]^2))``, over
    the computed gates: the product keeps the output scale of ``K`` diagonals at gate 1 whatever
    mass lies outside (the same factor as the full search whenever the support is inside the
    working set). ``output_scale`` compares with the ``K`` working-set members of largest alpha.

    Args:
      spec: the layer's :class:`dynadiag_jax.nn.functional.LayerSpec`.
      values: ``[W, *V]``, row ``j`` the values of candidate ``working_set[j]``.
      working_set: ``[W]`` int32, distinct candidates in ``[0, P)`` (trusted here: a traced one
        cannot be checked; :func:`working_set_problem` checks a concrete one).
      x: ``[..., in]`` in the computation dtype.
      inputs: the layer's :class:`GateInputs` over all ``P`` (no leading dims).

    Returns:
      ``(y[..., out] in x.dtype, SearchStats)``.
    """
    gate = inputs.gate[working_set]
    y = diag_matmul_in_range(
        x,
        _weights(gate, values, x.dtype),
        working_set,
        out_features=spec.out_features,
        impl=spec.impl,
    )
    computed = jax.lax.stop_gradient(gate)
    total = jnp.sum(jax.lax.stop_gradient(inputs.gate))
    outside = jnp.maximum(total - jnp.sum(computed), 0)
    c = rms_scale(gate, spec.k) if spec.scale == "rms" else jnp.ones((), gate.dtype)
    if spec.scale == "rms":
        y = y * c.astype(y.dtype)
    k = min(spec.k, working_set.shape[0])
    top = jnp.argsort(inputs.rank[working_set])[:k]  # the members of largest alpha
    stats = SearchStats(
        gate_nonzero=inputs.gate_nonzero,
        gate_mass_outside=outside.astype(jnp.float32),
        gate_mean=inputs.gate_mean,
        computed_diagonals=jnp.asarray(working_set.shape[0], jnp.float32),
        output_scale=_output_scale(gate * c, values, top),
    )
    return checkpoint_name(y, PRODUCT_NAME), stats


def working_set_problem(working_set, num_candidates: int) -> str | None:
    """Why a concrete ``working_set`` is not a set of distinct candidates of ``[0, P)`` (or None).

    Checks the shape ``[W]`` with ``1 <= W <= P``, an integer dtype, the range and duplicates.
    """
    ws = np.asarray(working_set)
    if ws.ndim != 1 or not 1 <= ws.shape[0] <= num_candidates:
        return f"it must have shape [W] with 1 <= W <= P = {num_candidates}, got {ws.shape}"
    if not np.issubdtype(ws.dtype, np.integer):
        return f"it must hold integers (int32 candidate ids), got {ws.dtype}"
    outside = ws[(ws < 0) | (ws >= num_candidates)]
    if outside.size:
        return f"it holds {int(outside[0])}, outside [0, P = {num_candidates})"
    ids, counts = np.unique(ws, return_counts=True)
    if np.any(counts > 1):
        return f"it holds {int(ids[np.argmax(counts)])} {int(counts.max())} times"
    return None


def rms_scale(gate, k: int):
    """``sqrt(K / sum(gate^2))`` without gradient: the factor that gives the gated product the
    output scale of ``K`` diagonals at gate 1 (``sqrt(P / K)`` while every gate is ``K / P``, 1
    once ``K`` gates are 1 and the rest 0)."""
    g = jax.lax.stop_gradient(gate)
    return jnp.sqrt(k / jnp.maximum(jnp.sum(g * g), jnp.finfo(g.dtype).tiny))


def _output_scale(gate, values, top):
    """:attr:`SearchStats.output_scale` for the scaled gate ``c * gate[P]`` and ``top[K]``."""
    g = jax.lax.stop_gradient(gate).astype(jnp.float32)
    norms = jnp.sum(
        jnp.square(jax.lax.stop_gradient(values).astype(jnp.float32)),
        axis=tuple(range(1, values.ndim)),
    )
    frozen = jnp.maximum(jnp.sum(norms[top]), jnp.finfo(jnp.float32).tiny)
    return jnp.sqrt(jnp.sum(g * g * norms) / frozen)


def _per_row(gate, ndim: int):
    """``gate[K]`` shaped to broadcast over ``values[K, *V]`` (``ndim`` axes)."""
    return gate.reshape(gate.shape + (1,) * (ndim - 1))


def _weights(gate, values, dtype):
    """``gate * values`` row by row (in the gate's dtype), cast to the compute dtype."""
    rows = values.astype(gate.dtype)
    return (_per_row(gate, rows.ndim) * rows).astype(dtype)


def _selected_weights(gate, values, idx, dtype):
    """``gate[idx] * values[idx]`` (in the gate's dtype), cast to the compute dtype."""
    return _weights(gate[idx], values[idx], dtype)


@functools.cache
def _ranked_product(sizes: tuple, out_features: int, impl: str):
    """``y = x @ W.T`` over the first ``sizes[branch]`` diagonals of ``order`` (``lax.switch``).

    ``(x, values, gate, order, branch) -> y``. Each branch gathers and gates only the ``s`` rows
    it computes, so a narrow search step reads ``s`` rows of ``values``, not all ``P`` (on a small
    layer those passes over ``values[P, ...]`` cost as much as the product). The VJP is written
    out, so the branches keep no residuals (autodiff of a switch returns every branch's residuals
    from every branch); each branch spreads ``dvalues = gate * G`` and ``dgate = <values, G>``
    of its diagonals over the full shapes by one gather through ``rank`` (the inverse of
    ``order``), zeros elsewhere: one write of ``[P, ...]``, where zeros and a scatter took two.
    Where ``x`` needs no gradient (a model's first layer, reading the data), the backward computes
    ``dvalues`` alone: the kernel that also computes ``dx`` costs about twice as much there.
    """

    def switch(fn, branch, *args):
        branches = [functools.partial(fn, s) for s in sizes]
        if len(branches) == 1:
            return branches[0](*args)
        return jax.lax.switch(branch, branches, *args)

    def product(s, x, values, gate, order):
        idx = order[:s]
        w = _selected_weights(gate, values, idx, x.dtype)
        return diag_matmul_in_range(x, w, idx, out_features=out_features, impl=impl)

    def spread(compact, rank, s):
        """``compact[s, ...]`` (rows in ``order``) at every candidate's row; zero past ``s``."""
        padded = jnp.concatenate([compact, jnp.zeros((1, *compact.shape[1:]), compact.dtype)])
        return padded[jnp.minimum(rank, s)]

    def backward(with_dx, s, x, values, gate, order, rank, dy):
        idx = order[:s]
        w = _selected_weights(gate, values, idx, x.dtype)
        if with_dx:
            _, pull = jax.vjp(
                lambda a, v: diag_matmul_in_range(a, v, idx, out_features=out_features, impl=impl),
                x,
                w,
            )
            dx, g = pull(dy)
        else:
            _, pull = jax.vjp(
                lambda v: diag_matmul_in_range(x, v, idx, out_features=out_features, impl=impl), w
            )
            dx, (g,) = None, pull(dy)
        g = g.astype(gate.dtype)
        rows = values[idx].astype(gate.dtype)
        dgate = jnp.sum(rows * g, axis=tuple(range(1, values.ndim)))
        dvalues = (_per_row(gate[idx], values.ndim) * g).astype(values.dtype)
        return dx, spread(dvalues, rank, s), spread(dgate, rank, s)

    @jax.custom_vjp
    def f(x, values, gate, order, branch):
        return switch(product, branch, x, values, gate, order)

    def f_fwd(x, values, gate, order, branch):
        args = [a.value for a in (x, values, gate, order, branch)]
        # the residuals' structure carries whether x needs its gradient (a static fact)
        flag = (None,) if x.perturbed else ()
        return f(*args), (*args, flag)

    def f_bwd(res, dy):
        *args, flag = res
        x, values, gate, order, branch = args
        if isinstance(dy, SymbolicZero):
            dy = jnp.zeros(dy.shape, dy.dtype)
        step = functools.partial(backward, bool(flag))
        every = jnp.arange(order.shape[0], dtype=order.dtype)
        rank = jnp.zeros_like(order).at[order].set(every, unique_indices=True)
        dx, dvalues, dgate = switch(step, branch, x, values, gate, order, rank, dy)
        return dx, dvalues, dgate, None, None

    f.defvjp(f_fwd, f_bwd, symbolic_zeros=True)
    return f


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
        # A gradient of a gradient differentiates this output: the selected diagonals' product,
        # as computed (f again would give it every diagonal's derivative, which y does not have).
        w = _selected_weights(gate, values, idx, x.dtype)
        y = diag_matmul_in_range(x, w, idx, out_features=out_features, impl=impl)
        return y, (x, gate, values, idx)

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
