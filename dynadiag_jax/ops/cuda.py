"""The CUDA targets of ``diag_matmul`` and their host emulation: dtypes, plans, workspace sizes.

The CUDA handlers (``xla_ext/cuda``) take no scratch memory of their own: XLA allocates a ``u8[W]``
workspace as an extra result of each custom call, and :func:`workspace_bytes` gives ``W``. This
module mirrors the C++ plans in ``xla_ext/cuda/diag_launch.cuh`` (tests/test_cuda_emulated.py
compares the two); the handlers reject a workspace smaller than their plan.

Element diagonals (``values[K, D]``):

* ``fwd`` / ``dx``: the plan kernel writes, per 16-wide output block, the diagonals that touch it
  (``[n_ob, K]`` int32 and their number, for products whose outputs run along the moving axis)
  and, for bfloat16/float16, its touched input blocks (``[n_ob, n_qb]``), their number, its path
  and the 16x16 ``W`` tiles of tensor-core blocks (``[n_ob * n_qb, 16, 16]`` in the input dtype),
  in 256-byte aligned segments. float32 outputs along the fixed axis need nothing.
* ``dvalues``: float32 partial sums ``[splits, K, D]`` when the batch rows are split over several
  thread blocks (small ``K * D``, many rows), else nothing.

Block diagonals (``values[K, L_b, b, b]``): ``fwd`` / ``dx`` need no workspace (each thread block
enumerates its input blocks from the offsets); ``dvalues`` needs ``[splits, K, L_b, b, b]`` float32
partial sums when it splits the rows.

The same kernels compiled for the host against a SIMT emulation (``xla_ext/emu``) are registered for
the CPU as ``dynadiag_emu_diag_matmul_v2_{fwd,dx,dvalues}`` and reached with
``diag_matmul(..., impl="cuda_emulated")``: slow, for tests only.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp

from dynadiag_jax.layout import geometry
from dynadiag_jax.ops.ffi import PlatformKernels

__all__ = [
    "EMULATED_PREFIX",
    "KERNELS",
    "BlockProductPlan",
    "BlockSddmmPlan",
    "ProductLayout",
    "block_product_plan",
    "block_sddmm_plan",
    "block_sddmm_stage_rows",
    "check_index_range",
    "product_layout",
    "sddmm_splits",
    "workspace_bytes",
]

# Mirrors of the constants in xla_ext/cuda/diag_kernels.cuh and diag_launch.cuh.
TILE = 16
WORKSPACE_ALIGN = 256
# Element products: 128-row slabs, 256 threads (8 warps of 16 rows on tensor cores; 16 outputs x
# 16 row groups on the diagonal path).
ELEM_ROWS = 128
ELEM_WARPS = 8
ELEM_GROUPS = 16
# Path rule of the plan kernel: tensor cores when tiles * TILE_COST <= entries * ENTRY_COST (the
# cost model's tile/entry cost ratio, gpu_cost.tile_cost_ratio, rounded); at most MAX_PLAN_BLOCKS
# input blocks (the plan counts them in shared memory), else the diagonal path.
TILE_COST, ENTRY_COST = 16, 1
MAX_PLAN_BLOCKS = 4096
PATH_DIAGONAL, PATH_TENSOR_CORE = 0, 1
# Element dvalues (diagonal SDDMM on CUDA cores).
SDDMM_LANES = 32
SDDMM_DIAGS = 8
SDDMM_ROWS_PER_SPLIT = 256
SDDMM_MAX_SPLITS = 64
SDDMM_TARGET_BLOCKS = 512
REDUCE_THREADS = 256
# Block products: 128-row slabs, 8 warps, output panels of at most 128 columns.
BLOCK_ROWS = 128
BLOCK_WARPS = 8
BLOCK_MAX_COLS = 128
# Block dvalues: at most 16384 accumulators and 16 KiB of operands per stage per CTA; 16-row
# stages on CUDA cores.
SDDMM_STAGE_ROWS = 16
BLOCK_SDDMM_MAX_ELEMS = 16384
BLOCK_SDDMM_STAGE_BYTES = 16384
BLOCK_SDDMM_TARGET_CTAS = 1024
BLOCK_SDDMM_MAX_SPLITS = 64
BLOCK_SDDMM_ROWS_PER_SPLIT = 512
# Tensor-core block dvalues: 32-row stages for b <= 32, 16 above; shared rows padded by 8 elements;
# at most 3 16-byte chunks of a stage per thread.
TC_SDDMM_PAD = 8
TC_SDDMM_CHUNKS = 3

EMULATED_PREFIX = "dynadiag_emu_diag_matmul_v2"
# Input dtypes with a tensor-core path (kHasTensorCorePath in diag_launch.cuh).
TENSOR_CORE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _align(n: int) -> int:
    return _cdiv(n, WORKSPACE_ALIGN) * WORKSPACE_ALIGN


def _tensor_cores(dtype) -> bool:
    """None stands for the plan with tensor cores (the largest)."""
    return dtype is None or jnp.dtype(dtype) in TENSOR_CORE_DTYPES


class ProductLayout(NamedTuple):
    """Tile grid and workspace layout of the element forward (``"fwd"``) or ``dx`` product."""

    n_mb: int  # 16-row blocks along the moving axis (length P)
    n_tb: int  # 16-wide blocks along the fixed axis (length D)
    out_moving: bool  # output blocks run along the moving axis
    n_ob: int  # output blocks
    n_qb: int  # input blocks
    lists: bool  # per-output-block diagonal lists (out_moving)
    tiles: bool  # tensor-core structure (16-bit dtypes with n_qb <= MAX_PLAN_BLOCKS)
    list_at: int  # byte offsets of the segments (int32, packed tiles in the input dtype)
    nlist_at: int
    tiles_at: int
    ntiles_at: int
    path_at: int
    packed_at: int
    nbytes: int


def product_layout(
    kind: str, in_features: int, out_features: int, num_diagonals: int = 0, dtype=None
) -> ProductLayout:
    """The plan of the element fwd/dx product of ``W[out_features, in_features]``.

    Args:
      kind: ``"fwd"`` or ``"dx"``; num_diagonals: ``K``; dtype: of the operands (None: the
        tensor-core plan, the largest).
    """
    if kind not in ("fwd", "dx"):
        raise ValueError(f"kind must be 'fwd' or 'dx', got {kind!r}")
    p, d = max(in_features, out_features), min(in_features, out_features)
    n_mb, n_tb = _cdiv(p, TILE), _cdiv(d, TILE)
    tall = out_features >= in_features
    out_moving = tall if kind == "fwd" else not tall
    n_ob, n_qb = (n_mb, n_tb) if out_moving else (n_tb, n_mb)
    tiles = _tensor_cores(dtype) and n_qb <= MAX_PLAN_BLOCKS
    itemsize = 2 if dtype is None else jnp.dtype(dtype).itemsize
    at = 0
    list_at = at
    at += _align(4 * n_ob * num_diagonals) if out_moving else 0
    nlist_at = at
    at += _align(4 * n_ob) if out_moving else 0
    tiles_at = at
    at += _align(4 * n_ob * n_qb) if tiles else 0
    ntiles_at = at
    at += _align(4 * n_ob) if tiles else 0
    path_at = at
    at += _align(4 * n_ob) if tiles else 0
    packed_at = at
    at += _align(itemsize * n_ob * n_qb * TILE * TILE) if tiles else 0
    return ProductLayout(
        n_mb, n_tb, out_moving, n_ob, n_qb, out_moving, tiles,
        list_at, nlist_at, tiles_at, ntiles_at, path_at, packed_at, at,
    )  # fmt: skip


def sddmm_splits(rows: int, in_features: int, out_features: int, num_diagonals: int) -> int:
    """Into how many row ranges the element dvalues kernel splits the batch (1 = no workspace)."""
    d = min(in_features, out_features)
    blocks = _cdiv(d, SDDMM_LANES) * _cdiv(num_diagonals, SDDMM_DIAGS)
    splits = min(_cdiv(rows, SDDMM_ROWS_PER_SPLIT), SDDMM_MAX_SPLITS)
    if blocks > 0:
        splits = min(splits, _cdiv(SDDMM_TARGET_BLOCKS, blocks))
    return splits if splits >= 2 and num_diagonals * d > 0 else 1


class BlockProductPlan(NamedTuple):
    """Grid of the block fwd/dx product: output panels x row slabs of ``slab_rows``."""

    out_long: bool  # outputs run along the long axis (L_b blocks): panels share one x block
    tensor_cores: bool  # wmma (16-bit dtypes, b a multiple of 16), else CUDA cores
    slice_width: int  # contraction columns per pipeline slice: min(b, 16)
    wraps: int  # ceil(L_b / P_b): long-axis blocks per short-axis block
    wraps_per_panel: int  # long-axis output blocks per panel (out_long), else 1
    n_panels: int
    cols: int  # tensor cores: the kernel's panel width (a power of two >= the panel), else 0
    slab_rows: int  # rows per thread block: 128, or 256 on tensor cores below 128 columns


def block_product_plan(kind, in_features, out_features, block_size, dtype) -> BlockProductPlan:
    """The panel plan of the block forward (``"fwd"``) or ``dx`` product."""
    geo = geometry(in_features, out_features, block_size)
    b = block_size
    out_long = geo.tall if kind == "fwd" else not geo.tall
    wraps = _cdiv(geo.length, geo.num_candidates)
    per_panel = min(wraps, max(1, BLOCK_MAX_COLS // b)) if out_long else 1
    n_panels = geo.num_candidates * (_cdiv(wraps, per_panel) if out_long else 1)
    tc = _tensor_cores(dtype) and b % 16 == 0
    cols = b * (1 << (per_panel - 1).bit_length()) if tc else 0
    slab_rows = 2 * BLOCK_ROWS if tc and cols < BLOCK_MAX_COLS else BLOCK_ROWS
    return BlockProductPlan(out_long, tc, min(b, 16), wraps, per_panel, n_panels, cols, slab_rows)


class BlockSddmmPlan(NamedTuple):
    """Grid of the block dvalues: (residue, wrap chunk, diagonal group, row split)."""

    tensor_cores: bool
    wraps_per_cta: int  # long-axis blocks t = r + w * P_b of one residue r per CTA
    wrap_chunks: int
    diags_per_cta: int
    groups: int
    splits: int
    rows_per_split: int
    workspace_bytes: int


def block_sddmm_stage_rows(block_size: int, tensor_cores: bool) -> int:
    """Rows per pipeline stage of the block dvalues (tensor cores: TcSddmm::kRows)."""
    if not tensor_cores:
        return SDDMM_STAGE_ROWS
    return 32 if block_size <= 32 else 16


def _block_sddmm_stage_blocks(block_size: int, itemsize: int, tensor_cores: bool) -> int:
    """Operand blocks one stage holds (tensor cores: TcSddmm::kMaxBlocks)."""
    rows = block_sddmm_stage_rows(block_size, tensor_cores)
    if not tensor_cores:
        return BLOCK_SDDMM_STAGE_BYTES // (rows * block_size * itemsize)
    by_bytes = BLOCK_SDDMM_STAGE_BYTES // (rows * (block_size + TC_SDDMM_PAD) * itemsize)
    by_chunks = TC_SDDMM_CHUNKS * BLOCK_WARPS * 32 // (rows * block_size // 8)
    return min(by_bytes, by_chunks)


def block_sddmm_plan(
    rows, in_features, out_features, num_diagonals, block_size, dtype, available=None
) -> BlockSddmmPlan:
    """The plan of the block dvalues (``available``: workspace bytes given, None = as planned)."""
    geo = geometry(in_features, out_features, block_size)
    b, k = block_size, num_diagonals
    itemsize = 2 if dtype is None else jnp.dtype(dtype).itemsize
    wraps = _cdiv(geo.length, geo.num_candidates)
    cap = max(1, BLOCK_SDDMM_MAX_ELEMS // (b * b))
    per_cta = min(wraps, max(1, math.isqrt(cap)))
    tc = _tensor_cores(dtype) and b % 16 == 0
    room = _block_sddmm_stage_blocks(b, itemsize, tc) - per_cta
    diags = max(1, min(max(k, 1), cap // per_cta, room))
    groups, chunks = _cdiv(k, diags), _cdiv(wraps, per_cta)
    base = geo.num_candidates * chunks * max(groups, 1)
    splits = min(
        BLOCK_SDDMM_MAX_SPLITS,
        _cdiv(rows, BLOCK_SDDMM_ROWS_PER_SPLIT),
        _cdiv(BLOCK_SDDMM_TARGET_CTAS, base),
    )
    per_split = 4 * k * geo.length * b * b
    if available is not None and per_split > 0 and splits * per_split > available:
        splits = available // per_split
    if splits < 2 or per_split == 0:
        splits = 1
    return BlockSddmmPlan(
        tc, per_cta, chunks, diags, groups, splits,
        _cdiv(rows, splits) if rows > 0 else 0, per_split * splits if splits > 1 else 0,
    )  # fmt: skip


def check_index_range(in_features: int, out_features: int) -> None:
    """The CUDA kernels add 32-bit indices along both axes (``t + d < P + D``): larger layers are
    rejected here (at lowering) and by the handlers."""
    if in_features + out_features >= 2**31:
        raise ValueError(
            f"in_features + out_features = {in_features} + {out_features} must be below 2^31 for "
            "the CUDA kernels (they add indices along both axes in 32 bits)"
        )


def workspace_bytes(
    kind: str,
    rows: int,
    in_features: int,
    out_features: int,
    num_diagonals: int,
    dtype=None,
    *,
    block_size: int = 1,
) -> int:
    """Bytes of device workspace the CUDA target ``kind`` (``fwd``, ``dx``, ``dvalues``) needs.

    Args:
      kind: which product.
      rows: product of the leading dimensions of ``x``/``dy``.
      in_features, out_features: the shape of ``W[out, in]``.
      num_diagonals: ``K``.
      dtype: of the operands (the lowering in ``ops/ffi.py`` passes it); None gives the most any
        dtype needs (the tensor-core plan).
      block_size: ``b`` of block diagonals, 1 for element diagonals.

    Raises:
      ValueError: for ``in_features + out_features >= 2**31`` (see :func:`check_index_range`).
    """
    if kind not in ("fwd", "dx", "dvalues"):
        raise ValueError(f"kind must be 'fwd', 'dx' or 'dvalues', got {kind!r}")
    check_index_range(in_features, out_features)
    if block_size > 1:
        if kind != "dvalues":
            return 0
        dtypes = (jnp.float32, jnp.bfloat16) if dtype is None else (dtype,)
        return max(
            block_sddmm_plan(
                rows, in_features, out_features, num_diagonals, block_size, d
            ).workspace_bytes
            for d in dtypes
        )
    if kind == "dvalues":
        splits = sddmm_splits(rows, in_features, out_features, num_diagonals)
        d = min(in_features, out_features)
        return 4 * splits * num_diagonals * d if splits > 1 else 0
    return product_layout(kind, in_features, out_features, num_diagonals, dtype).nbytes


# What the CUDA handlers and their emulation accept (ops/ffi.py adds the workspace result).
KERNELS = PlatformKernels(
    dtypes=(jnp.float32, jnp.bfloat16, jnp.float16),
    workspace_bytes=workspace_bytes,
    block_diagonals=True,
)
