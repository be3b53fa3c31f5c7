"""Index maths of wrapped diagonals and block diagonals (docs/design.md section 1).

A layer maps ``x[..., in]`` to ``x @ W.T`` with ``W[out, in]``.

Element diagonals (``values[K, D]``): ``P = max(in, out)`` candidates of length
``D = min(in, out)``:

* tall or square (``out >= in``): diagonal ``d`` holds ``W[(j + d) % out, j]`` = ``values[k, j]``;
* wide (``out < in``): diagonal ``d`` holds ``W[i, (i + d) % in]`` = ``values[k, i]``.

Block diagonals (``values[K, L_b, b, b]``, ``b >= 2`` dividing ``in`` and ``out``): W is a grid of
``nb_out x nb_in`` blocks; ``P_b = min(nb_out, nb_in)`` candidates, each a chain of
``L_b = max(nb_out, nb_in)`` blocks that wraps around the shorter axis, so that every diagonal
touches every block row and block column:

* tall or square: block ``t`` of diagonal ``d`` is (block row ``t``, block col ``(t + d) % nb_in``);
* wide: block ``t`` of diagonal ``d`` is (block row ``(t + d) % nb_out``, block col ``t``);

and ``values[k, t, i, j] = W[block_row * b + i, block_col * b + j]``.

In both forms ``values.shape[1] == length`` and offsets lie in ``[0, num_candidates)`` of
:class:`DiagGeometry`.

References:
  Tyagi et al., "Dynamic Sparse Training of Diagonally Sparse Networks", ICML 2025,
  https://arxiv.org/abs/2506.11449
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dynadiag_jax._checks import check_sparsity, host_array, int_at_least

__all__ = [
    "KERNEL_BLOCK_SIZES",
    "DiagGeometry",
    "geometry",
    "num_diagonals",
    "diag_indices",
    "block_indices",
    "transpose_diagonals",
    "coverage",
]

# Block sizes the compiled kernels and the layer accept. The pure-JAX path takes any b >= 2 that
# divides both widths.
KERNEL_BLOCK_SIZES = (8, 16, 32, 64, 128)


class DiagGeometry(NamedTuple):
    """Static shape facts of a ``[out, in]`` diagonal (``block_size == 1``) or block matrix."""

    in_features: int
    out_features: int
    block_size: int = 1

    @property
    def blocked(self) -> bool:
        """True for block diagonals (``block_size >= 2``)."""
        return self.block_size > 1

    @property
    def nb_in(self) -> int:
        """Block columns ``in / b`` (``in`` for element diagonals)."""
        return self.in_features // self.block_size

    @property
    def nb_out(self) -> int:
        """Block rows ``out / b`` (``out`` for element diagonals)."""
        return self.out_features // self.block_size

    @property
    def num_candidates(self) -> int:
        """Distinct diagonals: ``P = max(in, out)``, or ``P_b = min(nb_out, nb_in)`` for blocks."""
        if self.blocked:
            return min(self.nb_in, self.nb_out)
        return max(self.in_features, self.out_features)

    @property
    def length(self) -> int:
        """Entries per diagonal ``D = min(in, out)``, or blocks per diagonal ``L_b = max(nb)``."""
        if self.blocked:
            return max(self.nb_in, self.nb_out)
        return min(self.in_features, self.out_features)

    @property
    def tall(self) -> bool:
        """True for ``out >= in``, False for wide."""
        return self.out_features >= self.in_features

    @property
    def values_shape(self) -> tuple:
        """Shape of ``values`` without its leading ``K``: ``(D,)`` or ``(L_b, b, b)``."""
        if self.blocked:
            return (self.length, self.block_size, self.block_size)
        return (self.length,)

    def transposed(self) -> DiagGeometry:
        """Geometry of ``W.T``."""
        return DiagGeometry(self.out_features, self.in_features, self.block_size)


def _fitting_block_sizes(in_features: int, out_features: int) -> list[int]:
    return [b for b in KERNEL_BLOCK_SIZES if in_features % b == 0 and out_features % b == 0]


def geometry(in_features, out_features, block_size=1) -> DiagGeometry:
    """Validated :class:`DiagGeometry` for ``W[out_features, in_features]``.

    Raises:
      TypeError, ValueError: non-integral or too small arguments, or a ``block_size`` that does
        not divide both widths (the message lists the kernel block sizes that would).
    """
    in_features = int_at_least(in_features, "in_features", 1)
    out_features = int_at_least(out_features, "out_features", 1)
    block_size = int_at_least(block_size, "block_size", 1)
    if in_features % block_size or out_features % block_size:
        fits = _fitting_block_sizes(in_features, out_features)
        raise ValueError(
            f"block_size={block_size} must divide in_features={in_features} and out_features="
            f"{out_features}; block sizes in {KERNEL_BLOCK_SIZES} that fit: "
            f"{', '.join(map(str, fits)) or 'none'} (DiagonalDense and the kernels take only "
            "these; dd.diag_matmul(..., impl='jax') also takes any other common divisor >= 2)"
        )
    return DiagGeometry(in_features, out_features, block_size)


def num_diagonals(in_features: int, out_features: int, sparsity: float, *, block_size=1) -> int:
    """Number of diagonals ``K`` a layer keeps at ``sparsity`` (the authors' budget rule).

    Element diagonals: ``K = max(1, ceil(floor((1 - s) * in * out) / D))``, so the density
    ``K * D / (in * out)`` is at least ``floor((1 - s) * in * out) / (in * out)`` (``1 - s`` up to
    that floor and float rounding: 9 -> 9 at ``s = 0.1`` keeps 8 of 9 diagonals, 0.889). Example:
    768 -> 3072 at ``s = 0.9`` gives 308.

    Block diagonals (``block_size = b >= 2``):
    ``K = max(1, min(P_b, ceil(floor((1 - s) * in * out) / (max(in, out) * b))))``; each holds
    ``max(in, out) * b`` non-zeros. Example: 768 -> 3072, ``s = 0.9``, ``b = 16`` gives 5 of 48.

    Raises:
      TypeError: ``sparsity`` is not a real number (a bool is not).
      ValueError: ``sparsity`` is not in the open interval (0, 1), or ``block_size`` does not
        divide both widths.
    """
    check_sparsity(sparsity)
    geo = geometry(in_features, out_features, block_size)
    s = float(sparsity)
    nonzeros = math.floor((1.0 - s) * geo.in_features * geo.out_features)
    if not geo.blocked:
        return max(1, math.ceil(nonzeros / geo.length))
    per_diagonal = max(geo.in_features, geo.out_features) * geo.block_size
    return max(1, min(geo.num_candidates, math.ceil(nonzeros / per_diagonal)))


def _checked_offsets(offsets, geo: DiagGeometry):
    """``offsets`` as int32 ``[K]``: ``TypeError`` unless integer, ``ValueError`` unless 1-D.

    Values that can be read without a trace or a device sync must lie in ``[0, P)`` too; traced
    ones (inside ``jit``) cannot be read, and wrap modulo ``P``.
    """
    if not hasattr(offsets, "shape") or not hasattr(offsets, "dtype"):
        offsets = np.asarray(offsets)
    got = f"{offsets.dtype}{list(offsets.shape)}"
    if not jnp.issubdtype(offsets.dtype, jnp.integer):
        raise TypeError(f"offsets must be an integer array [K] of diagonal ids, got {got}")
    if offsets.ndim != 1:
        raise ValueError(f"offsets must be an integer array [K] of diagonal ids, got {got}")
    host = host_array(offsets)
    if host is not None:
        outside = host[(host < 0) | (host >= geo.num_candidates)]
        if outside.size:
            p = "P_b" if geo.blocked else "P"
            raise ValueError(
                f"offsets must lie in [0, {p}) = [0, {geo.num_candidates}) for W[{geo.out_features}"
                f", {geo.in_features}]"
                + (f" in blocks of {geo.block_size}" if geo.blocked else "")
                + f"; got {outside[0]}"
            )
    return jnp.asarray(offsets, jnp.int32)


def concrete_offsets(offsets, geo: DiagGeometry, caller: str) -> np.ndarray:
    """``offsets`` read on the host as int64 ``[K]`` in ``[0, P)``, for what counts or plans
    from their values (``TypeError`` for a traced or non-integer array, ``ValueError`` out of
    range)."""
    if isinstance(offsets, jax.core.Tracer):
        raise TypeError(f"{caller} needs concrete offsets, got a traced array")
    off = np.asarray(offsets)
    if off.ndim != 1 or not np.issubdtype(off.dtype, np.integer):
        raise TypeError(f"offsets must be a 1-D integer array, got shape {off.shape} {off.dtype}")
    if off.size and (off.min() < 0 or off.max() >= geo.num_candidates):
        raise ValueError(
            f"offsets must lie in [0, {'P_b' if geo.blocked else 'P'}) = [0, {geo.num_candidates})"
            f"; got values in [{off.min()}, {off.max()}]"
        )
    return off.astype(np.int64)


def diag_indices(offsets, in_features: int, out_features: int):
    """Dense coordinates of every element-diagonal entry.

    Args:
      offsets: ``[K]`` integer diagonal ids in ``[0, P)`` (may be traced; a traced id outside
        wraps modulo ``P``).
      in_features, out_features: the shape of ``W[out, in]``.

    Returns:
      ``(rows, cols)``, each ``[K, D]`` int32: ``values[k, t]`` sits at
      ``W[rows[k, t], cols[k, t]]``.

    Raises:
      TypeError, ValueError: ``offsets`` not an integer ``[K]``, or (when it can be read on the
        host) holding an id outside ``[0, P)``.
    """
    geo = geometry(in_features, out_features)
    offsets = _checked_offsets(offsets, geo)[:, None]
    t = jnp.arange(geo.length, dtype=jnp.int32)[None, :]
    moving = (t + offsets) % geo.num_candidates
    fixed = jnp.broadcast_to(t, moving.shape)
    return (moving, fixed) if geo.tall else (fixed, moving)


def block_indices(offsets, in_features: int, out_features: int, block_size: int):
    """Block coordinates of every block of the given block diagonals.

    Args:
      offsets: ``[K]`` integer diagonal ids in ``[0, P_b)`` (may be traced; a traced id outside
        wraps modulo ``P_b``).
      in_features, out_features: the shape of ``W[out, in]``; block_size: ``b >= 2``.

    Returns:
      ``(block_rows, block_cols)``, each ``[K, L_b]`` int32: ``values[k, t]`` is the block
      ``W[block_rows[k, t] * b : ... + b, block_cols[k, t] * b : ... + b]``.

    Raises:
      TypeError, ValueError: as :func:`diag_indices`.
    """
    geo = geometry(in_features, out_features, int_at_least(block_size, "block_size", 2))
    offsets = _checked_offsets(offsets, geo)[:, None]
    t = jnp.arange(geo.length, dtype=jnp.int32)[None, :]
    wrapped = (t + offsets) % geo.num_candidates  # along the shorter block axis
    along = jnp.broadcast_to(t, wrapped.shape)
    return (along, wrapped) if geo.tall else (wrapped, along)


def transpose_diagonals(values, offsets, in_features: int, out_features: int):
    """The diagonals of ``W.T`` (an ``[in, out]`` matrix) from those of ``W[out, in]``.

    Rectangular: same offsets, same value rows. Square (``n`` diagonals): offsets become
    ``(-d) % n`` and each value row rolls by ``d``: ``values_t[k, c] = values[k, (c - d_k) % n]``.
    Block diagonals (``values[K, L_b, b, b]``) follow the same rule on the block grid, and every
    block is transposed as well.

    Args:
      values: ``[K, D]`` or ``[K, L_b, b, b]``; offsets: ``[K]`` integer in ``[0, P)`` (may be
        traced, as :func:`diag_indices`).

    Returns:
      ``(values_t, offsets_t [K] int32)``, ``values_t`` of the shape of ``values``.

    Raises:
      TypeError, ValueError: ``values`` not of the shape above for ``W[out, in]``, ``offsets`` as
        :func:`diag_indices` or not as long as ``values``.
    """
    if not hasattr(values, "shape") or not hasattr(values, "ndim"):
        raise TypeError(
            f"values must be an array [K, D] or [K, L_b, b, b], got {type(values).__name__}"
        )
    block_size = values.shape[-1] if values.ndim == 4 else 1
    geo = geometry(in_features, out_features, block_size)
    if values.shape[1:] != geo.values_shape:
        names = "[K, L_b, b, b]" if geo.blocked else "[K, D]"
        raise ValueError(
            f"values must have shape {names} = [K, {', '.join(map(str, geo.values_shape))}] for "
            f"W[{geo.out_features}, {geo.in_features}], got {list(values.shape)}"
        )
    offsets = _checked_offsets(offsets, geo)
    if offsets.shape[0] != values.shape[0]:
        raise ValueError(
            f"offsets must have shape [K] = [{values.shape[0]}] to match values "
            f"{list(values.shape)}, got {list(offsets.shape)}"
        )
    if geo.blocked:
        values = jnp.swapaxes(values, -1, -2)
    if geo.in_features != geo.out_features:
        return values, offsets
    n = geo.length
    c = jnp.arange(n, dtype=jnp.int32)[None, :]
    src = (c - offsets[:, None]) % n
    src = src.reshape(src.shape + (1,) * (values.ndim - 2))
    return jnp.take_along_axis(values, src, axis=1), (-offsets) % n


def coverage(offsets, in_features: int, out_features: int, *, block_size: int = 1):
    """How many kept weights each output row and each input column of ``W`` has.

    A block diagonal touches every block row and column, so block layers cover everything; an
    element diagonal of a tall ``W`` covers ``in`` of the ``out`` rows (of a wide one, ``out`` of
    the ``in`` columns), so some selections leave output features constant (bias only) or inputs
    unread.

    Args:
      offsets: ``[K]`` concrete integer diagonal ids in ``[0, P)`` (``[0, P_b)`` for blocks);
        host-only: the counts are numpy arrays, so not inside ``jit``.
      in_features, out_features: the shape of ``W[out, in]``; block_size: 1 or ``b >= 2``.

    Returns:
      ``(rows[out], cols[in])`` int64 numpy arrays (repeated offsets count twice).

    Raises:
      TypeError: traced ``offsets``, or not integer.
      ValueError: ``offsets`` not ``[K]``, or holding an id outside ``[0, P)``.
    """
    geo = geometry(in_features, out_features, block_size)
    if isinstance(offsets, jax.core.Tracer):
        raise TypeError(
            "coverage: offsets must be concrete (it counts on the host and returns numpy "
            "arrays), got a traced array; call it outside jit"
        )
    off = np.asarray(offsets)
    _checked_offsets(off, geo)
    if geo.blocked:
        b = geo.block_size
        brows, bcols = (np.asarray(a) for a in block_indices(off, in_features, out_features, b))
        rows = np.repeat(np.bincount(brows.ravel(), minlength=out_features // b) * b, b)
        cols = np.repeat(np.bincount(bcols.ravel(), minlength=in_features // b) * b, b)
        return rows, cols
    r, c = (np.asarray(a).ravel() for a in diag_indices(off, in_features, out_features))
    return np.bincount(r, minlength=out_features), np.bincount(c, minlength=in_features)
