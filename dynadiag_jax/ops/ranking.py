"""``gate_rank``: what a search-phase layer needs from its scores alone, as one operation.

Per row of ``alpha[..., P]`` (docs/kernel_abi.md, "Gate ranking"):

* ``order[..., P]``: the diagonals by descending score, ties to the lower offset, NaN last;
* ``rank[..., P]``: the position of each diagonal in ``order`` (its inverse);
* ``topk[..., K]``: ``order``'s first ``K``, ascending (``K`` is the width of ``old_topk``);
* ``changed[...]``: offsets of ``topk`` missing from ``old_topk`` (float32);
* with ``sparse=True``, the non-differentiable part of the sparse gate's projection:
  ``kth`` (the ``K``-th largest score, ``alpha[order[K - 1]]``), ``tau`` (the threshold of
  ``clip((alpha - kth) / strength, -2, 2)``, 0 when ``K == P``) and ``share`` (the hard gate's
  value on scores tied with ``kth``), as :func:`dynadiag_jax.topk.sparse_solution` defines them;
  zeros otherwise.

On CPU with the compiled extension it lowers to one custom call (``dynadiag_gate_rank_v1``);
elsewhere, and with ``impl="jax"``, to :func:`reference`. XLA compiles every operation of a
program on its own, so one call instead of some sixty small operations per layer is what keeps
the compile time of a search-phase train step near a dense one's (docs/compile_time.md). No
output has a gradient.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from dynadiag_jax.ops.manual_axes import same_varying, shaped_array
from dynadiag_jax.topk import solution_from_kth

__all__ = ["Ranking", "descending_order", "gate_rank", "reference", "register_cpu_target"]

TARGET = "dynadiag_gate_rank_v1"


class Ranking(NamedTuple):
    """The outputs of :func:`gate_rank` (see the module docstring)."""

    order: jax.Array
    rank: jax.Array
    topk: jax.Array
    changed: jax.Array
    kth: jax.Array
    tau: jax.Array
    share: jax.Array


def descending_order(alpha):
    """``alpha[..., P]``'s indices by descending value, ties to the lower index, NaN last (int32).

    A stable sort: ``jax.lax.top_k`` does not keep the lower index first among ties on CPU for
    ``P >= 64``.
    """
    key = jnp.where(jnp.isnan(alpha), jnp.asarray(jnp.inf, alpha.dtype), -alpha)
    iota = jax.lax.broadcasted_iota(jnp.int32, alpha.shape, alpha.ndim - 1)
    return jax.lax.sort((key, iota), dimension=alpha.ndim - 1, num_keys=2)[1]


def reference(alpha, hyper, old_topk, *, sparse: bool) -> Ranking:
    """:func:`gate_rank` in pure JAX on rows: ``alpha[R, P]``, ``hyper[R]``, ``old_topk[R, K]``."""
    p, k = alpha.shape[-1], old_topk.shape[-1]
    order = descending_order(alpha)
    _, rank = jax.lax.top_k(-order, p)  # the inverse permutation (distinct keys)
    topk = jnp.sort(order[:, :k], axis=-1)
    inside = (old_topk >= 0) & (old_topk < p)
    was_kept = jnp.take_along_axis(rank, jnp.clip(old_topk, 0, p - 1), axis=-1) < k
    changed = (k - jnp.sum(inside & was_kept, axis=-1)).astype(jnp.float32)
    zeros = jnp.zeros(alpha.shape[:-1], alpha.dtype)
    if not sparse:
        return Ranking(order, rank, topk, changed, zeros, zeros, zeros)
    kth = jnp.take_along_axis(alpha, order[:, k - 1 : k], axis=-1)
    solution = solution_from_kth(alpha, k, hyper, kth)
    return Ranking(order, rank, topk, changed, *(v[:, 0] for v in solution))


def _abstract(alpha, hyper, old_topk, *, sparse, impl):
    del sparse, impl
    rows, p = alpha.shape
    k = old_topk.shape[-1]
    operands = (alpha, hyper, old_topk)
    ints = shaped_array((rows, p), jnp.int32, *operands)
    scalars = shaped_array((rows,), alpha.dtype, *operands)
    return (
        ints,
        ints,
        shaped_array((rows, k), jnp.int32, *operands),
        shaped_array((rows,), jnp.float32, *operands),
        scalars,
        scalars,
        scalars,
    )


gate_rank_p = Primitive("dynadiag_gate_rank")
gate_rank_p.multiple_results = True
gate_rank_p.def_abstract_eval(_abstract)


@functools.cache
def _compiled(sparse: bool, impl: str):
    return jax.jit(functools.partial(gate_rank_p.bind, sparse=sparse, impl=impl))


gate_rank_p.def_impl(lambda *args, sparse, impl: _compiled(sparse, impl)(*args))


def _reference_lowering(ctx, alpha, hyper, old_topk, *, sparse, impl):
    del impl
    fn = functools.partial(reference, sparse=sparse)
    return mlir.lower_fun(lambda *a: list(fn(*a)), multiple_results=True)(
        ctx, alpha, hyper, old_topk
    )


mlir.register_lowering(gate_rank_p, _reference_lowering)


def register_cpu_target() -> None:
    """Lower to the CPU custom call (called once the extension has registered it)."""
    kernel = jax.ffi.ffi_lowering(TARGET)

    def lowering(ctx, alpha, hyper, old_topk, *, sparse, impl):
        if impl == "jax":
            return _reference_lowering(ctx, alpha, hyper, old_topk, sparse=sparse, impl=impl)
        return kernel(ctx, alpha, hyper, old_topk, sparse=bool(sparse))

    mlir.register_lowering(gate_rank_p, lowering, platform="cpu")


def _batch(args, dims, *, sparse, impl):
    """vmap: a mapped axis becomes more rows of one call."""
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not None)
    full = [
        jnp.moveaxis(a, d, 0) if d is not None else jnp.broadcast_to(a, (size,) + a.shape)
        for a, d in zip(args, dims)
    ]
    rows = [a.reshape((-1,) + a.shape[2:]) for a in full]
    outs = gate_rank_p.bind(*rows, sparse=sparse, impl=impl)
    return [o.reshape((size, -1) + o.shape[1:]) for o in outs], [0] * len(outs)


batching.primitive_batchers[gate_rank_p] = _batch


def _jvp(primals, tangents, *, sparse, impl):
    del tangents
    outs = gate_rank_p.bind(*primals, sparse=sparse, impl=impl)
    return outs, [ad.Zero.from_primal_value(o) for o in outs]


ad.primitive_jvps[gate_rank_p] = _jvp


def gate_rank(alpha, hyper, old_topk, *, sparse: bool, impl: str = "auto") -> Ranking:
    """:class:`Ranking` of ``alpha[..., P]`` (float32 or float64).

    Args:
      alpha: ``[..., P]`` scores.
      hyper: the gate's strength (used when ``sparse``), a scalar or ``[...]``.
      old_topk: ``[..., K]`` int32, the previous top-K (``K`` in ``[1, P]``); offsets outside
        ``[0, P)`` count as missing.
      sparse: also solve the sparse gate's projection.
      impl: ``"jax"`` for the pure-JAX reference on every platform; anything else uses the CPU
        kernel where it is built.

    Returns:
      :class:`Ranking` with leading dims ``[...]``; ``kth``, ``tau``, ``share`` in ``alpha``'s
      dtype.
    """
    if jnp.dtype(alpha.dtype) not in (jnp.dtype(jnp.float32), jnp.dtype(jnp.float64)):
        # the reference took bfloat16, the CPU kernel refused it only when the program ran
        raise TypeError(f"gate_rank: alpha must be float32 or float64, got {alpha.dtype}")
    lead, p = alpha.shape[:-1], alpha.shape[-1]
    k = old_topk.shape[-1]
    if not 1 <= k <= p:
        raise ValueError(f"gate_rank: old_topk must have shape [..., K] with 1 <= K <= P = {p}")
    alpha = jax.lax.stop_gradient(alpha)
    hyper = jax.lax.stop_gradient(jnp.broadcast_to(jnp.asarray(hyper, alpha.dtype), lead))
    old = jnp.broadcast_to(old_topk.astype(jnp.int32), lead + (k,))
    outs = gate_rank_p.bind(
        *same_varying(alpha.reshape(-1, p), hyper.reshape(-1), old.reshape(-1, k)),
        sparse=bool(sparse),
        impl="jax" if impl == "jax" else "auto",
    )
    return Ranking(*(o.reshape(lead + o.shape[1:]) for o in outs))
