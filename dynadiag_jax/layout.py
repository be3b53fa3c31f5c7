"""Index maths of wrapped diagonals (DESIGN.md section 1).

A layer maps ``x[..., in]`` to ``x @ W.T`` with ``W[out, in]``. There are ``P = max(in, out)``
candidate diagonals of length ``D = min(in, out)``:

* tall or square (``out >= in``): diagonal ``d`` holds ``W[(j + d) % out, j]`` = ``values[k, j]``;
* wide (``out < in``): diagonal ``d`` holds ``W[i, (i + d) % in]`` = ``values[k, i]``.

References:
  Tyagi et al., "Dynamic Sparse Training of Diagonally Sparse Networks", ICML 2025,
  https://arxiv.org/abs/2506.11449
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp

from dynadiag_jax._checks import int_at_least

__all__ = ["DiagGeometry", "num_diagonals", "diag_indices", "transpose_diagonals"]


class DiagGeometry(NamedTuple):
    """Static shape facts of a ``[out, in]`` diagonal matrix."""

    in_features: int
    out_features: int

    @property
    def num_candidates(self) -> int:
        """``P = max(in, out)``: how many distinct diagonals exist."""
        return max(self.in_features, self.out_features)

    @property
    def length(self) -> int:
        """``D = min(in, out)``: entries per diagonal."""
        return min(self.in_features, self.out_features)

    @property
    def tall(self) -> bool:
        """True for ``out >= in`` (one entry per column), False for wide (one per row)."""
        return self.out_features >= self.in_features

    def transposed(self) -> DiagGeometry:
        """Geometry of ``W.T``."""
        return DiagGeometry(self.out_features, self.in_features)


def geometry(in_features, out_features) -> DiagGeometry:
    """Validated :class:`DiagGeometry` for ``W[out_features, in_features]``."""
    return DiagGeometry(
        int_at_least(in_features, "in_features", 1), int_at_least(out_features, "out_features", 1)
    )


def num_diagonals(in_features: int, out_features: int, sparsity: float) -> int:
    """Number of diagonals ``K`` a layer keeps at ``sparsity`` (the authors' budget rule).

    ``K = max(1, ceil(floor((1 - s) * in * out) / D))``, so the density ``K * D / (in * out)`` is
    at least ``1 - s``. Example: 768 -> 3072 at ``s = 0.9`` gives ``K = 308``.

    Raises:
      ValueError: if ``sparsity`` is not in the open interval (0, 1).
    """
    geo = geometry(in_features, out_features)
    s = float(sparsity)
    if not 0.0 < s < 1.0:
        raise ValueError(f"sparsity must be in (0, 1), got {sparsity!r}")
    nonzeros = math.floor((1.0 - s) * geo.in_features * geo.out_features)
    return max(1, math.ceil(nonzeros / geo.length))


def diag_indices(offsets, in_features: int, out_features: int):
    """Dense coordinates of every diagonal entry.

    Args:
      offsets: ``[K]`` integer diagonal ids in ``[0, P)`` (may be traced).
      in_features, out_features: the shape of ``W[out, in]``.

    Returns:
      ``(rows, cols)``, each ``[K, D]`` int32: ``values[k, t]`` sits at
      ``W[rows[k, t], cols[k, t]]``.
    """
    geo = geometry(in_features, out_features)
    offsets = jnp.asarray(offsets, jnp.int32)[:, None]
    t = jnp.arange(geo.length, dtype=jnp.int32)[None, :]
    moving = (t + offsets) % geo.num_candidates
    fixed = jnp.broadcast_to(t, moving.shape)
    return (moving, fixed) if geo.tall else (fixed, moving)


def transpose_diagonals(values, offsets, in_features: int, out_features: int):
    """The diagonals of ``W.T`` (an ``[in, out]`` matrix) from those of ``W[out, in]``.

    Rectangular: same offsets, same value rows. Square ``n x n``: offsets become ``(-d) % n`` and
    each value row rolls by ``d``, i.e. ``values_t[k, c] = values[k, (c - d_k) % n]``.

    Args:
      values: ``[K, D]``; offsets: ``[K]`` integer.

    Returns:
      ``(values_t [K, D], offsets_t [K] int32)``.
    """
    geo = geometry(in_features, out_features)
    offsets = jnp.asarray(offsets, jnp.int32)
    if geo.in_features != geo.out_features:
        return values, offsets
    n = geo.length
    c = jnp.arange(n, dtype=jnp.int32)[None, :]
    src = (c - offsets[:, None]) % n
    return jnp.take_along_axis(values, src, axis=1), (-offsets) % n
