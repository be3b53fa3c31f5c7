"""The CUDA targets of ``diag_matmul`` and their host emulation: dtypes and workspace sizes.

The CUDA handlers (``xla_ext/cuda``) take no scratch memory of their own: XLA allocates a ``u8[W]``
workspace as an extra result of each custom call, and :func:`workspace_bytes` gives ``W``. It
mirrors the C++ plan in ``xla_ext/cuda/diag_launch.cuh`` (tests/test_cuda_emulated.py compares the
two); the handlers reject a workspace smaller than their plan.

* ``fwd`` / ``dx``: the tile structure the device computes from ``offsets`` - entries per 16x16 tile
  of ``W`` (int32 ``[n_mb, n_tb]``), per 16-wide output block its touched input blocks
  (``[n_ob, n_qb]``), their number and its path (``[n_ob]`` each), in 256-byte aligned segments,
  for bfloat16/float16 only: float32 has no tensor-core path and needs no workspace.
* ``dvalues``: float32 partial sums ``[splits, K, D]`` when the batch rows are split over several
  thread blocks (small ``K * D``, many rows), else nothing.

The same kernels compiled for the host against a SIMT emulation (``xla_ext/emu``) are registered for
the CPU as ``dynadiag_emu_diag_matmul_v2_{fwd,dx,dvalues}`` and reached with
``diag_matmul(..., impl="cuda_emulated")``: slow, for tests only.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from dynadiag_jax.ops.ffi import PlatformKernels

__all__ = [
    "EMULATED_PREFIX",
    "KERNELS",
    "ProductLayout",
    "product_layout",
    "sddmm_splits",
    "workspace_bytes",
]

# Mirrors of the constants in xla_ext/cuda/diag_kernels.cuh and diag_launch.cuh.
TILE = 16
# An output block takes the tensor-core path when its touched tiles are at least 1/4 full.
MIN_FILL_NUM, MIN_FILL_DEN = 1, 4
WORKSPACE_ALIGN = 256
SDDMM_LANES = 32
SDDMM_DIAGS = 8
SDDMM_ROWS_PER_SPLIT = 256
SDDMM_MAX_SPLITS = 64
SDDMM_TARGET_BLOCKS = 512

EMULATED_PREFIX = "dynadiag_emu_diag_matmul_v2"
# Input dtypes with a tensor-core path (kHasTensorCorePath in diag_launch.cuh).
TENSOR_CORE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _align(n: int) -> int:
    return _cdiv(n, WORKSPACE_ALIGN) * WORKSPACE_ALIGN


class ProductLayout(NamedTuple):
    """Tile grid and workspace layout of the forward (``kind="fwd"``) or ``dx`` product."""

    n_mb: int  # 16-row blocks along the moving axis (length P)
    n_tb: int  # 16-wide blocks along the fixed axis (length D)
    out_moving: bool  # output blocks run along the moving axis
    n_ob: int  # output blocks
    n_qb: int  # input blocks
    count_at: int  # byte offsets of the int32 segments
    tiles_at: int
    ntiles_at: int
    path_at: int
    nbytes: int


def product_layout(kind: str, in_features: int, out_features: int) -> ProductLayout:
    """The tile structure of ``W[out_features, in_features]`` as the fwd/dx kernels lay it out."""
    if kind not in ("fwd", "dx"):
        raise ValueError(f"kind must be 'fwd' or 'dx', got {kind!r}")
    p, d = max(in_features, out_features), min(in_features, out_features)
    n_mb, n_tb = _cdiv(p, TILE), _cdiv(d, TILE)
    tall = out_features >= in_features
    out_moving = tall if kind == "fwd" else not tall
    n_ob, n_qb = (n_mb, n_tb) if out_moving else (n_tb, n_mb)
    count_at = 0
    tiles_at = count_at + _align(4 * n_mb * n_tb)
    ntiles_at = tiles_at + _align(4 * n_ob * n_qb)
    path_at = ntiles_at + _align(4 * n_ob)
    nbytes = path_at + _align(4 * n_ob)
    return ProductLayout(
        n_mb, n_tb, out_moving, n_ob, n_qb, count_at, tiles_at, ntiles_at, path_at, nbytes
    )


def sddmm_splits(rows: int, in_features: int, out_features: int, num_diagonals: int) -> int:
    """Into how many row ranges the dvalues kernel splits the batch (1 = no workspace)."""
    d = min(in_features, out_features)
    blocks = _cdiv(d, SDDMM_LANES) * _cdiv(num_diagonals, SDDMM_DIAGS)
    splits = min(_cdiv(rows, SDDMM_ROWS_PER_SPLIT), SDDMM_MAX_SPLITS)
    if blocks > 0:
        splits = min(splits, _cdiv(SDDMM_TARGET_BLOCKS, blocks))
    return splits if splits >= 2 and num_diagonals * d > 0 else 1


def workspace_bytes(
    kind: str, rows: int, in_features: int, out_features: int, num_diagonals: int, dtype=None
) -> int:
    """Bytes of device workspace the CUDA target ``kind`` (``fwd``, ``dx``, ``dvalues``) needs.

    Args:
      kind: which product.
      rows: product of the leading dimensions of ``x``/``dy``.
      in_features, out_features: the shape of ``W[out, in]``.
      num_diagonals: ``K``.
      dtype: of the operands (the lowering in ``ops/ffi.py`` passes it); None gives the most any
        dtype needs (the tensor-core plan).
    """
    if kind == "dvalues":
        splits = sddmm_splits(rows, in_features, out_features, num_diagonals)
        d = min(in_features, out_features)
        return 4 * splits * num_diagonals * d if splits > 1 else 0
    layout = product_layout(kind, in_features, out_features)  # also validates kind
    if dtype is not None and jnp.dtype(dtype) not in TENSOR_CORE_DTYPES:
        return 0  # the diagonal path computes no tile structure
    return layout.nbytes


# What the CUDA handlers and their emulation accept (ops/ffi.py adds the workspace result).
KERNELS = PlatformKernels(
    dtypes=(jnp.float32, jnp.bfloat16, jnp.float16), workspace_bytes=workspace_bytes
)
