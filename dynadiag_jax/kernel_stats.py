"""What the CUDA kernel will do with a set of diagonals: tiles, fill, tensor-core vs diagonal path.

The CUDA forward and ``dx`` kernels cut ``W`` into 16x16 tiles and, per 16-wide block of outputs,
either multiply the touched tiles on tensor cores (after assembling them from the diagonals) or walk
the diagonals on CUDA cores. A block takes the tensor-core path when its touched tiles are at least
a quarter full; float32 inputs always take the diagonal path. :func:`kernel_stats` applies the
kernel's rule on the host (the same counts, the same threshold), so a learned set of offsets shows
the efficiency to expect: random offsets at 90% sparsity touch nearly every tile but fill each to
~10% (diagonal path); bands of adjacent offsets fill few tiles well (tensor cores).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dynadiag_jax.layout import geometry
from dynadiag_jax.ops import cuda

__all__ = ["KernelStats", "ProductStats", "kernel_stats"]

PATH_DIAGONAL, PATH_TENSOR_CORE = 0, 1


class ProductStats(NamedTuple):
    """Structure of one product (forward ``x @ W.T`` or ``dx = dy @ W``) as the kernel sees it."""

    output_blocks: int  # 16-wide blocks of outputs: the kernel's unit of work (per 64 rows)
    tiles: int  # touched 16x16 tiles summed over output blocks (the tensor-core work)
    fill: float  # non-zeros / (tiles * 256): how full the touched tiles are
    tensor_core_blocks: int  # output blocks on the tensor-core path
    diagonal_blocks: int  # output blocks on the diagonal CUDA-core path


class KernelStats(NamedTuple):
    """Result of :func:`kernel_stats`."""

    nonzeros: int  # K * D (repeated offsets counted once per repeat)
    density: float  # distinct non-zero entries / (in * out)
    tiles_total: int  # 16x16 tiles of W (partial edge tiles included)
    tiles_touched: int  # tiles holding at least one entry
    forward: ProductStats
    dx: ProductStats
    path: str  # "tensor_core", "diagonal" or "mixed", over both products


def tile_counts(offsets, in_features: int, out_features: int) -> np.ndarray:
    """Entries per 16x16 tile, ``[ceil(P/16), ceil(D/16)]`` in (moving, fixed) block coordinates.

    Moving/fixed are the row/column axes of a tall or square ``W`` and the column/row axes of a
    wide one (docs/design.md section 1); this is what the kernel's ``count_tiles_kernel`` computes.
    """
    geo = geometry(in_features, out_features)
    p, d = geo.num_candidates, geo.length
    offsets = _concrete_offsets(offsets, p)
    layout = cuda.product_layout("fwd", in_features, out_features)
    t = np.arange(d, dtype=np.int64)
    m = (t[None, :] + offsets[:, None]) % p
    flat = (m // cuda.TILE) * layout.n_tb + (t[None, :] // cuda.TILE)
    return np.bincount(flat.ravel(), minlength=layout.n_mb * layout.n_tb).reshape(
        layout.n_mb, layout.n_tb
    )


def block_structure(offsets, in_features: int, out_features: int, kind: str, dtype):
    """Per output block of product ``kind`` (``"fwd"``/``"dx"``): touched tiles, non-zeros, path.

    The host copy of ``compact_tiles_kernel``; arrays of length ``n_ob``.
    """
    counts = tile_counts(offsets, in_features, out_features)
    layout = cuda.product_layout(kind, in_features, out_features)
    per_block = counts if layout.out_moving else counts.T  # [n_ob, n_qb]
    ntiles = (per_block > 0).sum(axis=1)
    entries = per_block.sum(axis=1)
    tensor_cores = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    dense_enough = entries * cuda.MIN_FILL_DEN >= ntiles * cuda.TILE * cuda.TILE * cuda.MIN_FILL_NUM
    path = np.where(tensor_cores & (ntiles > 0) & dense_enough, PATH_TENSOR_CORE, PATH_DIAGONAL)
    return ntiles, entries, path


def kernel_stats(
    offsets, in_features: int, out_features: int, *, dtype=jnp.bfloat16
) -> KernelStats:
    """Tile structure and kernel path of ``W[out_features, in_features]`` with these diagonals.

    Args:
      offsets: ``[K]`` concrete integer diagonal ids in ``[0, max(in, out))`` (numpy or a
        non-traced array; e.g. the ``offsets`` of a frozen layer).
      in_features, out_features: the layer shape.
      dtype: input dtype of the product: float16/bfloat16 can use tensor cores, float32 cannot.

    Returns:
      :class:`KernelStats` for the forward and ``dx`` products.

    Raises:
      TypeError: for traced or non-integer offsets. ValueError: for offsets outside ``[0, P)``.
    """
    geo = geometry(in_features, out_features)
    off = _concrete_offsets(offsets, geo.num_candidates)
    counts = tile_counts(off, in_features, out_features)

    def product(kind):
        ntiles, entries, path = block_structure(off, in_features, out_features, kind, dtype)
        tiles = int(ntiles.sum())
        return ProductStats(
            output_blocks=len(path),
            tiles=tiles,
            fill=float(entries.sum()) / (tiles * cuda.TILE * cuda.TILE) if tiles else 0.0,
            tensor_core_blocks=int((path == PATH_TENSOR_CORE).sum()),
            diagonal_blocks=int((path == PATH_DIAGONAL).sum()),
        )

    fwd, dx = product("fwd"), product("dx")
    tc = fwd.tensor_core_blocks + dx.tensor_core_blocks
    diag = fwd.diagonal_blocks + dx.diagonal_blocks
    return KernelStats(
        nonzeros=int(off.size) * geo.length,
        density=len(np.unique(off)) * geo.length / (geo.in_features * geo.out_features),
        tiles_total=counts.size,
        tiles_touched=int((counts > 0).sum()),
        forward=fwd,
        dx=dx,
        path="tensor_core" if diag == 0 else "diagonal" if tc == 0 else "mixed",
    )


def _concrete_offsets(offsets, num_candidates: int) -> np.ndarray:
    if isinstance(offsets, jax.core.Tracer):
        raise TypeError("kernel_stats needs concrete offsets, got a traced array")
    off = np.asarray(offsets)
    if off.ndim != 1 or not np.issubdtype(off.dtype, np.integer):
        raise TypeError(f"offsets must be a 1-D integer array, got shape {off.shape} {off.dtype}")
    if off.size and (off.min() < 0 or off.max() >= num_candidates):
        raise ValueError(
            f"offsets must lie in [0, P) = [0, {num_candidates}); got values in "
            f"[{off.min()}, {off.max()}]"
        )
    return off.astype(np.int64)
