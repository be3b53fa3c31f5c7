"""Pure-JAX reference implementations of the diagonal products (the spec and the test oracle).

Every kernel (C++ on CPU, CUDA, emulated CUDA) is tested against these functions. They also serve
as the ``impl="jax"`` path on any backend: memory is ``O(batch * (in + out) + K * D)`` (block
diagonals: ``+ K * L_b * b * b``); neither a dense ``W`` nor a ``[batch, K, ...]`` intermediate is
built (a scan over the K diagonals). Rows of ``x`` are the flattened leading dimensions; every
function here takes 2-D ``x[B, in]`` / ``dy[B, out]``. ``values[K, D]`` are element diagonals,
``values[K, L_b, b, b]`` block diagonals (docs/design.md section 1).

The trick for wrapped indices: a diagonal touches a contiguous run of ``D`` rows (tall) or columns
(wide) that may wrap once past the end. Reading from ``concat(a, a[:, :D])`` or writing into an
``[B, P + D]`` buffer that is folded once at the end turns every diagonal into one unwrapped slice.
Block diagonals do the same on ``[B, blocks, b]`` views, with every step a batched ``b x b``
product over the ``L_b`` blocks.

An input permutation ``perm[in]`` (a product of ``W P``: ``y = W x[..., perm]``) is
:func:`gather_columns` of ``x`` before the product and :func:`scatter_columns` of ``dx`` after it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dynadiag_jax.layout import block_indices, diag_indices, geometry, transpose_diagonals
from dynadiag_jax.ops.manual_axes import varying_zeros

__all__ = [
    "diag_to_dense",
    "dense_to_diag",
    "dense_product",
    "diag_matmul_fwd_reference",
    "diag_matmul_dx_reference",
    "diag_matmul_dvalues_reference",
    "gather_columns",
    "inverse_permutation",
    "is_permutation",
    "scatter_columns",
]


def is_permutation(perm):
    """Whether integer ``perm[n]`` holds each value of ``range(n)`` once (bool scalar, jit-able)."""
    n = perm.shape[-1]
    inside = jnp.all((perm >= 0) & (perm < n))
    counts = jnp.zeros((n,), jnp.int32).at[jnp.clip(perm, 0, n - 1)].add(1)
    return inside & jnp.all(counts == 1)


def inverse_permutation(perm):
    """``inv`` with ``inv[perm[j]] = j`` for a permutation ``perm[n]`` (int32)."""
    n = perm.shape[-1]
    return jnp.zeros((n,), jnp.int32).at[perm].set(jnp.arange(n, dtype=jnp.int32))


def gather_columns(a, perm):
    """``a[..., perm]`` (``a`` itself for ``perm=None``)."""
    return a if perm is None else jnp.take(a, perm, axis=-1, mode="clip")


def scatter_columns(a, perm):
    """``out`` with ``out[..., perm[j]] = a[..., j]`` for a permutation ``perm`` (the transpose of
    :func:`gather_columns`), as a gather by the inverse; ``a`` itself for ``perm=None``."""
    return a if perm is None else gather_columns(a, inverse_permutation(perm))


def _entry_indices(offsets, in_features: int, out_features: int, block_size: int):
    """``(rows, cols)`` of ``W[out, in]`` for every value: ``[K, D]`` or ``[K, L_b, b, b]``."""
    if block_size == 1:
        return diag_indices(offsets, in_features, out_features)
    b = block_size
    block_rows, block_cols = block_indices(offsets, in_features, out_features, b)
    i = jnp.arange(b, dtype=jnp.int32)
    rows = block_rows[:, :, None, None] * b + i[None, None, :, None]
    cols = block_cols[:, :, None, None] * b + i[None, None, None, :]
    return rows, cols


def diag_to_dense(values, offsets, *, in_features: int, out_features: int):
    """Materialise ``W[out, in]`` (repeated offsets add up; arguments unchecked:
    ``dd.diag_to_dense`` is the checked form).

    Args:
      values: ``[K, D]`` (element diagonals) or ``[K, L_b, b, b]`` (block diagonals);
      offsets: ``[K]`` integer in ``[0, P)`` (``[0, P_b)`` for blocks).
    """
    b = values.shape[-1] if values.ndim == 4 else 1
    rows, cols = _entry_indices(offsets, in_features, out_features, b)
    return jnp.zeros((out_features, in_features), values.dtype).at[rows, cols].add(values)


def dense_to_diag(w, offsets, *, block_size: int = 1):
    """The entries of ``w[out, in]`` on the diagonals ``offsets[K]``: ``values[K, D]``
    (``block_size=1``) or ``[K, L_b, b, b]``, so that ``diag_to_dense`` of the result keeps
    exactly those entries of ``w``."""
    out_features, in_features = w.shape
    rows, cols = _entry_indices(offsets, in_features, out_features, block_size)
    return w[rows, cols]


def dense_product(x2, w):
    """``x2[B, in] @ w[out, in].T`` with XLA's dense dot in the input dtype.

    XLA sums half-precision dots in float32 (the CPU upcasts, cuBLAS runs a float32 compute type)
    and rounds once, so no ``preferred_element_type`` is needed; without it, autodiff's
    ``dx = dy @ w`` and ``dw = dy^T x2`` are dots in the input dtype too, where a float32
    accumulation type would hand float32 cotangents to both (float32 GEMMs on bfloat16 data).
    Plain ``jnp`` ops, so every autodiff mode and order applies.
    """
    return jnp.dot(x2, w.T)


def _acc_dtype(dtype):
    """float32 for half-precision inputs, the input dtype otherwise (float64 stays float64)."""
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _wrap_extend(a, length: int):
    """``concat(a, a[:, :length])`` so that any wrapped run of ``length`` columns is one slice."""
    return jnp.concatenate([a, a[:, :length]], axis=1)


def _wrap_blocks(a3, length: int, period: int):
    """``a3[:, [0, 1, .., length) % period]``: any wrapped run of blocks becomes one slice."""
    return a3[:, np.arange(length) % period]


def _block_fwd(x2, values, offsets, out_features: int):
    """Block-diagonal ``x2 @ W.T``: ``values[K, L_b, b, b]``, scanned over K."""
    b = values.shape[-1]
    geo = geometry(x2.shape[1], out_features, b)
    acc = _acc_dtype(x2.dtype)
    batch, n_p, n_l = x2.shape[0], geo.num_candidates, geo.length
    x3 = x2.astype(acc).reshape(batch, geo.nb_in, b)
    zero = jnp.int32(0)

    def block_products(xs, v):  # [B, L_b, b] x [L_b, b, b] -> [B, L_b, b], out_i = v_ij x_j
        return jnp.einsum("btj,tij->bti", xs, v.astype(acc))

    if geo.tall:
        # Output block row t reads input block column (t + d) % nb_in.
        xe = _wrap_blocks(x3, n_l + n_p, n_p)

        def body(y, kv):
            d, v = kv
            xs = jax.lax.dynamic_slice(xe, (zero, d, zero), (batch, n_l, b))
            return y + block_products(xs, v), None

        y, _ = jax.lax.scan(
            body, varying_zeros((batch, n_l, b), acc, x2, values, offsets), (offsets, values)
        )
    else:
        # Input block column t feeds output block row (t + d) % nb_out: blocks d .. d + L_b of a
        # buffer folded modulo nb_out at the end.
        folds = -(-(n_l + n_p) // n_p)

        def body(buf, kv):
            d, v = kv
            cur = jax.lax.dynamic_slice(buf, (zero, d, zero), (batch, n_l, b))
            cur = cur + block_products(x3, v)
            return jax.lax.dynamic_update_slice(buf, cur, (zero, d, zero)), None

        buf = varying_zeros((batch, folds * n_p, b), acc, x2, values, offsets)
        buf, _ = jax.lax.scan(body, buf, (offsets, values))
        y = buf.reshape(batch, folds, n_p, b).sum(axis=1)
    return y.reshape(batch, out_features).astype(x2.dtype)


def diag_matmul_fwd_reference(x2, values, offsets, *, out_features: int):
    """``y[B, out] = x2[B, in] @ W.T`` for the diagonal ``W``; accumulates in float32 (or wider).

    ``values`` is ``[K, D]`` (element diagonals) or ``[K, L_b, b, b]`` (block diagonals).
    """
    offsets = offsets.astype(jnp.int32)
    if values.ndim == 4:
        return _block_fwd(x2, values, offsets, out_features)
    in_features = x2.shape[1]
    geo = geometry(in_features, out_features)
    acc = _acc_dtype(x2.dtype)
    xa = x2.astype(acc)
    batch, d_len = x2.shape[0], geo.length

    if geo.tall:
        # Diagonal d adds x[:, j] * v[j] into row (j + d) % out: rows d .. d + in of [B, P + D].
        def body(buf, kv):
            d, v = kv
            cur = jax.lax.dynamic_slice(buf, (jnp.int32(0), d), (batch, d_len))
            cur = cur + xa * v.astype(acc)[None, :]
            return jax.lax.dynamic_update_slice(buf, cur, (jnp.int32(0), d)), None

        buf = varying_zeros((batch, out_features + in_features), acc, x2, values, offsets)
        buf, _ = jax.lax.scan(body, buf, (offsets, values))
        y = buf[:, :out_features].at[:, :in_features].add(buf[:, out_features:])
    else:
        # Diagonal d reads x[:, (i + d) % in] for output row i < out.
        xe = _wrap_extend(xa, d_len)

        def body(y, kv):
            d, v = kv
            xs = jax.lax.dynamic_slice(xe, (jnp.int32(0), d), (batch, d_len))
            return y + xs * v.astype(acc)[None, :], None

        y, _ = jax.lax.scan(
            body, varying_zeros((batch, out_features), acc, x2, values, offsets), (offsets, values)
        )
    return y.astype(x2.dtype)


def diag_matmul_dx_reference(dy2, values, offsets, *, in_features: int):
    """``dx[B, in] = dy2[B, out] @ W`` via the transpose closure (``W.T`` is diagonal too)."""
    out_features = dy2.shape[1]
    values_t, offsets_t = transpose_diagonals(values, offsets, in_features, out_features)
    return diag_matmul_fwd_reference(dy2, values_t, offsets_t, out_features=in_features)


def _block_dvalues(dy2, x2, offsets, block_size: int):
    """Block SDDMM ``dvalues[k, t] = dy2[:, rows of the block].T @ x2[:, cols of the block]``."""
    b = block_size
    geo = geometry(x2.shape[1], dy2.shape[1], b)
    acc = _acc_dtype(x2.dtype)
    batch, n_p, n_l = x2.shape[0], geo.num_candidates, geo.length
    dy3 = dy2.astype(acc).reshape(batch, geo.nb_out, b)
    x3 = x2.astype(acc).reshape(batch, geo.nb_in, b)
    zero = jnp.int32(0)
    # The operand along the longer block axis is read in order, the other one wrapped.
    wrapped = _wrap_blocks(x3 if geo.tall else dy3, n_l + n_p, n_p)

    def one(d):
        moved = jax.lax.dynamic_slice(wrapped, (zero, d, zero), (batch, n_l, b))
        rows, cols = (dy3, moved) if geo.tall else (moved, x3)
        return jnp.einsum("bti,btj->tij", rows, cols)

    return jax.lax.map(one, offsets)


def diag_matmul_dvalues_reference(dy2, x2, offsets, *, block_size: int = 1, dtype=None):
    """Diagonal SDDMM: ``dvalues[k, t] = sum_b dy2[b, row(k, t)] * x2[b, col(k, t)]``.

    Args:
      dy2: ``[B, out]``; x2: ``[B, in]``; offsets: ``[K]``.
      block_size: 1 for element diagonals, ``b >= 2`` for block diagonals (block SDDMM).
      dtype: result dtype (default ``x2.dtype``); sums run in float32 or wider.

    Returns:
      ``[K, D]``, or ``[K, L_b, b, b]`` for block diagonals.
    """
    if block_size > 1:
        out = _block_dvalues(dy2, x2, offsets.astype(jnp.int32), block_size)
        return out.astype(x2.dtype if dtype is None else dtype)
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
