"""The three products on the dense path: ``W`` built on the device (a scatter) and XLA's dot.

What ``impl="auto"`` lowers to on a platform where the kernels are not predicted to pay (every
GPU today, TPU, ROCm; :mod:`dynadiag_jax.ops.auto`). The forward is ``diag_matmul(impl="dense")``'s
``x @ W.T``; ``dx`` and ``dvalues`` are its transposes in ``x`` and in ``values`` (``dy @ W``, and
the diagonals gathered from ``dy^T x``), so both are dots in the input dtype, as autodiff of the
dense forward gives them. Leading dimensions of ``x`` / ``dy`` are rows. An input permutation
is folded into ``W`` (its columns permuted once, ``W P``) instead of gathering ``x``.
"""

from __future__ import annotations

import jax.numpy as jnp

from dynadiag_jax.ops import reference
from dynadiag_jax.ops.products import Backend, every_block_size, every_float_dtype

__all__ = ["BACKEND", "permuted_dense"]


def permuted_dense(values, offsets, perm, *, in_features, out_features):
    """``W P`` as a dense ``[out, in]``: column ``perm[j]`` holds ``W``'s column ``j``, so that
    ``x @ (W P).T = x[..., perm] @ W.T``."""
    w = reference.diag_to_dense(values, offsets, in_features=in_features, out_features=out_features)
    return reference.scatter_columns(w, perm)


def _product(x, values, offsets, perm, in_features, out_features):
    """``x[..., in] @ (W P).T`` with ``W`` scattered from ``(values, offsets)``."""
    w = permuted_dense(values, offsets, perm, in_features=in_features, out_features=out_features)
    x2 = x.reshape(-1, in_features)
    return reference.dense_product(x2, w).reshape(x.shape[:-1] + (out_features,))


def _fwd(x, values, offsets, *, out_features, perm=None):
    return _product(x, values, offsets, perm, x.shape[-1], out_features)


# The transposes written out, not jax.linear_transpose of the forward: inside jax.shard_map that
# transpose summed dvalues over the mesh axis already (values do not vary along it, dy does), and
# the primitive's own rule summed it again: gradients 4x on four devices.
def _dx(dy, values, offsets, *, in_features, perm=None):
    """``dy @ (W P)``."""
    w = permuted_dense(values, offsets, perm, in_features=in_features, out_features=dy.shape[-1])
    dx = jnp.dot(dy.reshape(-1, dy.shape[-1]), w)
    return dx.reshape(dy.shape[:-1] + (in_features,))


def _dvalues(dy, x, offsets, *, block_size, perm=None):
    """The diagonals of ``dW = d(W P) P^T``, ``d(W P) = dy^T x``."""
    in_features, out_features = x.shape[-1], dy.shape[-1]
    dwp = jnp.dot(dy.reshape(-1, out_features).T, x.reshape(-1, in_features))
    dw = reference.gather_columns(dwp, perm)
    return reference.dense_to_diag(dw, offsets, block_size=block_size)


BACKEND = Backend(
    fwd=_fwd,
    dx=_dx,
    dvalues=_dvalues,
    dtypes=every_float_dtype,
    block_size_ok=every_block_size,
)
