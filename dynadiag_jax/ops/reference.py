"""Pure-JAX reference implementations of the diagonal products (the spec and the test oracle).

Every kernel (C++ on CPU, CUDA, emulated CUDA) is tested against these functions. They also serve
as the ``impl="jax"`` path on any backend: memory is ``O(batch * (in + out) + K * D)``; neither a
dense ``W`` nor a ``[batch, K, D]`` intermediate is built. Rows of ``x`` are the flattened leading
dimensions; every function here takes 2-D ``x[B, in]`` / ``dy[B, out]``.

The trick for wrapped indices: a diagonal touches a contiguous run of ``D`` rows (tall) or columns
(wide) that may wrap once past the end. Reading from ``concat(a, a[:, :D])`` or writing into an
``[B, P + D]`` buffer that is folded once at the end turns every diagonal into one unwrapped slice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dynadiag_jax.layout import diag_indices, geometry, transpose_diagonals

__all__ = [
    "diag_to_dense",
    "diag_matmul_dense",
    "diag_matmul_fwd_reference",
    "diag_matmul_dx_reference",
    "diag_matmul_dvalues_reference",
]


def diag_to_dense(values, offsets, *, in_features: int, out_features: int):
    """Materialise ``W[out, in]`` (reference and tests only; repeated offsets add up).

    Args:
      values: ``[K, D]``; offsets: ``[K]`` integer in ``[0, P)``.
    """
    rows, cols = diag_indices(offsets, in_features, out_features)
    w = jnp.zeros((out_features, in_features), values.dtype)
    return w.at[rows, cols].add(values)


def diag_matmul_dense(x2, values, offsets, *, out_features: int):
    """``x2 @ diag_to_dense(...).T`` with XLA's dense dot: the dense baseline, ``x2[B, in]``."""
    w = diag_to_dense(values, offsets, in_features=x2.shape[-1], out_features=out_features)
    return jnp.dot(x2, w.T, preferred_element_type=_acc_dtype(x2.dtype)).astype(x2.dtype)


def _acc_dtype(dtype):
    """float32 for half-precision inputs, the input dtype otherwise (float64 stays float64)."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _wrap_extend(a, length: int):
    """``concat(a, a[:, :length])`` so that any wrapped run of ``length`` columns is one slice."""
    return jnp.concatenate([a, a[:, :length]], axis=1)


def diag_matmul_fwd_reference(x2, values, offsets, *, out_features: int):
    """``y[B, out] = x2[B, in] @ W.T`` for the diagonal ``W``; accumulates in float32 (or wider)."""
    in_features = x2.shape[1]
    geo = geometry(in_features, out_features)
    acc = _acc_dtype(x2.dtype)
    xa = x2.astype(acc)
    batch, d_len = x2.shape[0], geo.length
    offsets = offsets.astype(jnp.int32)

    if geo.tall:
        # Diagonal d adds x[:, j] * v[j] into row (j + d) % out: rows d .. d + in of [B, P + D].
        def body(buf, kv):
            d, v = kv
            cur = jax.lax.dynamic_slice(buf, (jnp.int32(0), d), (batch, d_len))
            cur = cur + xa * v.astype(acc)[None, :]
            return jax.lax.dynamic_update_slice(buf, cur, (jnp.int32(0), d)), None

        buf = jnp.zeros((batch, out_features + in_features), acc)
        buf, _ = jax.lax.scan(body, buf, (offsets, values))
        y = buf[:, :out_features].at[:, :in_features].add(buf[:, out_features:])
    else:
        # Diagonal d reads x[:, (i + d) % in] for output row i < out.
        xe = _wrap_extend(xa, d_len)

        def body(y, kv):
            d, v = kv
            xs = jax.lax.dynamic_slice(xe, (jnp.int32(0), d), (batch, d_len))
            return y + xs * v.astype(acc)[None, :], None

        y, _ = jax.lax.scan(body, jnp.zeros((batch, out_features), acc), (offsets, values))
    return y.astype(x2.dtype)


def diag_matmul_dx_reference(dy2, values, offsets, *, in_features: int):
    """``dx[B, in] = dy2[B, out] @ W`` via the transpose closure (``W.T`` is diagonal too)."""
    out_features = dy2.shape[1]
    values_t, offsets_t = transpose_diagonals(values, offsets, in_features, out_features)
    return diag_matmul_fwd_reference(dy2, values_t, offsets_t, out_features=in_features)


def diag_matmul_dvalues_reference(dy2, x2, offsets, *, dtype=None):
    """Diagonal SDDMM: ``dvalues[k, t] = sum_b dy2[b, row(k, t)] * x2[b, col(k, t)]``.

    Args:
      dy2: ``[B, out]``; x2: ``[B, in]``; offsets: ``[K]``.
      dtype: result dtype (default ``x2.dtype``); sums run in float32 or wider.

    Returns:
      ``[K, D]``.
    """
    out_features, in_features = dy2.shape[1], x2.shape[1]
    geo = geometry(in_features, out_features)
    acc = _acc_dtype(x2.dtype)
    batch, d_len = x2.shape[0], geo.length
    # The gathered operand is the one indexed by the moving coordinate.
    fixed, moving = (x2, dy2) if geo.tall else (dy2, x2)
    fixed = fixed.astype(acc)
    moving_ext = _wrap_extend(moving.astype(acc), d_len)

    def one(d):
        return jnp.sum(
            jax.lax.dynamic_slice(moving_ext, (jnp.int32(0), d), (batch, d_len)) * fixed, axis=0
        )

    out = jax.lax.map(one, offsets.astype(jnp.int32))
    return out.astype(x2.dtype if dtype is None else dtype)
