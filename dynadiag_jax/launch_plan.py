"""The launch plan of the CUDA kernels: tiling constants, grids and workspace sizes.

Defined once, in C++ (``xla_ext/cuda/launch_plan.h``), which the kernels, their launch sequences and
both builds of the handlers (CUDA, and the host emulation of ``impl="cuda_emulated"``) compile; the
compiled module ``_plan_ext`` (built with every installation, GPU or not) hands the same constants
and plan functions to Python. This module only adapts them: dtypes to the tensor-core flag, the C++
plans to named tuples. The lowering (``ops/cuda.py``: the workspace of each custom call) and the
cost model (``gpu_cost.py``: the launches it counts) read the plan from here.

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
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax.numpy as jnp

from dynadiag_jax._checks import int_at_least
from dynadiag_jax.layout import geometry

try:
    from dynadiag_jax import _plan_ext
except ImportError:
    _plan_ext = None

__all__ = [
    "TENSOR_CORE_DTYPES",
    "BlockProductPlan",
    "BlockSddmmPlan",
    "LaunchConstants",
    "ProductLayout",
    "block_product_plan",
    "block_sddmm_plan",
    "check_index_range",
    "constants",
    "product_layout",
    "sddmm_splits",
    "workspace_bytes",
]

# Input dtypes with a tensor-core path (kHasTensorCorePath in xla_ext/cuda/diag_launch.cuh).
TENSOR_CORE_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class LaunchConstants(NamedTuple):
    """The constants of ``launch_plan.h`` the cost model counts with (C++ names in brackets)."""

    TILE: int  # element structure granularity, the wmma m16n16k16 tile (kTile)
    WORKSPACE_ALIGN: int  # bytes every workspace segment is aligned to (kWorkspaceAlign)
    ELEM_ROWS: int  # rows of x per element product thread block (kElemRows)
    ELEM_WARPS: int  # warps per element product thread block, 16 rows each (kElemWarps)
    ELEM_GROUPS: int  # row groups of the diagonal path (kElemGroups)
    # path rule of the plan kernel: tensor cores when tiles * TILE_COST <= entries * ENTRY_COST,
    # for at most MAX_PLAN_BLOCKS input blocks (kTileCost, kEntryCost, kMaxPlanBlocks)
    TILE_COST: int
    ENTRY_COST: int
    MAX_PLAN_BLOCKS: int
    PATH_DIAGONAL: int  # per output block path ids (kPathDiagonal, kPathTensorCore)
    PATH_TENSOR_CORE: int
    SDDMM_LANES: int  # element dvalues: consecutive t per warp (kSddmmLanes)
    SDDMM_DIAGS: int  # element dvalues: diagonals per thread block (kSddmmDiags)
    REDUCE_THREADS: int  # threads per block of the split reduction (kReduceThreads)
    BLOCK_ROWS: int  # block products: rows per slab on CUDA cores (kBlockRows)
    BLOCK_WARPS: int  # warps per block-kernel thread block (kBlockWarps)
    BLOCK_SLICE: int  # block products: contraction columns per slice (kBlockSlice)
    PLAN_WARPS: int  # warps per element plan thread block (kPlanThreads / 32)
    SDDMM_WARPS: int  # warps per element dvalues thread block (kSddmmWarps)


def _ext():
    if _plan_ext is None:
        raise ImportError(
            "the CUDA launch plan comes from the compiled module dynadiag_jax._plan_ext, which "
            "this copy of dynadiag_jax lacks: install the package (pip install .) or build in "
            "place with `bash scripts/dev_build.sh`"
        )
    return _plan_ext


@functools.cache
def constants() -> LaunchConstants:
    """The launch constants the kernels are compiled with."""
    return LaunchConstants(**_ext().constants())


# The dtypes the CUDA kernels take (ops/cuda.py registers them; gpu_cost.py counts them).
KERNEL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def kernel_dtype(dtype, caller: str):
    """``dtype`` as a numpy dtype; ``TypeError`` naming ``caller`` unless the kernels take it."""
    supported = [jnp.dtype(d) for d in KERNEL_DTYPES]
    try:
        parsed = None if dtype is None else jnp.dtype(dtype)
    except TypeError:
        parsed = None
    if parsed not in supported:
        got = repr(dtype) if parsed is None else str(parsed)
        raise TypeError(
            f"{caller}: dtype must be one the CUDA kernels take "
            f"({', '.join(map(str, supported))}), got {got}"
        )
    return parsed


def _tensor_cores(dtype) -> bool:
    """None stands for the plan with tensor cores (the largest)."""
    return dtype is None or jnp.dtype(dtype) in TENSOR_CORE_DTYPES


def _itemsize(dtype) -> int:
    return 2 if dtype is None else jnp.dtype(dtype).itemsize


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


def _check_kind(kind: str, kinds: tuple) -> None:
    if kind not in kinds:
        names = " or ".join(", ".join(repr(k) for k in kinds).rsplit(", ", 1))
        raise ValueError(f"kind must be {names}, got {kind!r}")


def _check_shape(in_features, out_features, block_size=1, *, rows=0, num_diagonals=0) -> None:
    """The C++ planners divide by the widths and the block count along the short axis: a width,
    block size, row or diagonal count out of range is a ValueError here, not a SIGFPE there."""
    geometry(in_features, out_features, block_size)
    int_at_least(rows, "rows", 0)
    int_at_least(num_diagonals, "num_diagonals", 0)  # offsets may repeat: K is not bounded by P


def product_layout(
    kind: str, in_features: int, out_features: int, num_diagonals: int = 0, dtype=None
) -> ProductLayout:
    """The plan of the element fwd/dx product of ``W[out_features, in_features]``.

    Args:
      kind: ``"fwd"`` or ``"dx"``; num_diagonals: ``K``; dtype: of the operands (None: the
        tensor-core plan, the largest).
    """
    _check_kind(kind, ("fwd", "dx"))
    _check_shape(in_features, out_features, num_diagonals=num_diagonals)
    plan = _ext().product_plan(
        in_features, out_features, kind == "dx", num_diagonals, _tensor_cores(dtype)
    )
    return ProductLayout(**plan)


def sddmm_splits(rows: int, in_features: int, out_features: int, num_diagonals: int) -> int:
    """Into how many row ranges the element dvalues kernel splits the batch (1 = no workspace)."""
    _check_shape(in_features, out_features, rows=rows, num_diagonals=num_diagonals)
    return _ext().sddmm_splits(rows, in_features, out_features, num_diagonals)


class BlockProductPlan(NamedTuple):
    """Grid of the block fwd/dx product: output panels x row slabs of ``slab_rows``."""

    out_long: bool  # outputs run along the long axis (L_b blocks): panels share one x block
    tensor_cores: bool  # wmma (16-bit dtypes, b a multiple of 16), else CUDA cores
    slice_width: int  # contraction columns per pipeline slice: min(b, BLOCK_SLICE)
    wraps: int  # ceil(L_b / P_b): long-axis blocks per short-axis block
    wraps_per_panel: int  # long-axis output blocks per panel (out_long), else 1
    n_panels: int
    cols: int  # tensor cores: the kernel's panel width (a power of two >= the panel), else 0
    slab_rows: int  # rows per thread block: 128, or 256 on tensor cores below 128 columns


def block_product_plan(kind, in_features, out_features, block_size, dtype) -> BlockProductPlan:
    """The panel plan of the block forward (``"fwd"``) or ``dx`` product."""
    _check_kind(kind, ("fwd", "dx"))
    _check_shape(in_features, out_features, block_size)
    plan = _ext().block_product_plan(
        in_features, out_features, kind == "dx", block_size, _tensor_cores(dtype)
    )
    return BlockProductPlan(slice_width=min(block_size, constants().BLOCK_SLICE), **plan)


class BlockSddmmPlan(NamedTuple):
    """Grid of the block dvalues: (residue, wrap chunk, diagonal group, row split)."""

    tensor_cores: bool
    wraps_per_cta: int  # long-axis blocks t = r + w * P_b of one residue r per CTA
    wrap_chunks: int
    diags_per_cta: int
    groups: int
    splits: int
    rows_per_split: int
    stage_rows: int  # rows per pipeline stage (tensor cores: 32 for b <= 32, else 16)
    workspace_bytes: int


def block_sddmm_plan(
    rows, in_features, out_features, num_diagonals, block_size, dtype, available=None
) -> BlockSddmmPlan:
    """The plan of the block dvalues (``available``: workspace bytes given, None = as planned)."""
    _check_shape(in_features, out_features, block_size, rows=rows, num_diagonals=num_diagonals)
    limit = {} if available is None else {"available": int_at_least(available, "available", 0)}
    plan = _ext().block_sddmm_plan(
        rows,
        in_features,
        out_features,
        num_diagonals,
        block_size,
        _itemsize(dtype),
        _tensor_cores(dtype),
        **limit,
    )
    return BlockSddmmPlan(**plan)


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
        dtype needs.
      block_size: ``b`` of block diagonals, 1 for element diagonals.

    Raises:
      ValueError: for ``in_features + out_features >= 2**31`` (see :func:`check_index_range`),
        for widths, a block size, rows or a diagonal count the kernels cannot take, and for
        sizes beyond one launch's grid (e.g. element ``dvalues`` of more than 524,280 diagonals,
        which repeated offsets allow): the handler's own message, here at lowering instead of
        as a run-time error.
    """
    _check_kind(kind, ("fwd", "dx", "dvalues"))
    _check_shape(in_features, out_features, block_size, rows=rows, num_diagonals=num_diagonals)
    check_index_range(in_features, out_features)
    paths = (False, True) if dtype is None else (_tensor_cores(dtype),)
    ext = _ext()
    for tc in paths:
        limit = ext.launch_limits(
            kind, rows, in_features, out_features, num_diagonals, tc, block_size
        )
        if limit is not None:
            raise ValueError(
                f"the CUDA {kind} target cannot take rows={rows}, {in_features} -> {out_features}, "
                f"K={num_diagonals}, block_size={block_size}: {limit}"
            )
    return max(
        ext.workspace_bytes(kind, rows, in_features, out_features, num_diagonals, tc, block_size)
        for tc in paths
    )
