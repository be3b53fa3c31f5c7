"""Unstructured sparse linear layers as a JAX user would write them (speed baselines).

Both layers take the constructor arguments of ``dd.nn.DiagonalDense`` (``features``, then
keyword-only ``sparsity``, ``use_bias``, ``dtype``, ``param_dtype``) and keep exactly
``num_active(in * out, sparsity)`` weights at random positions drawn from the ``"params"`` RNG
at ``init``. The positions live in the non-param collection
``"sparsity"``; pass it to ``apply`` with the params.

* :class:`MaskedDense`: ``x @ (kernel * mask)``; a dense ``[in, out]`` kernel and a bool mask
  (``variables["sparsity"][...]["mask"]``): dense compute and memory, what jaxpruner/RigL do.
* :class:`BCOODense`: ``x @ W`` with ``W`` a ``jax.experimental.sparse.BCOO`` matrix: params
  ``{"data": [nse]}``, ``variables["sparsity"][...]["indices"]`` ``[nse, 2]`` int32 (row-major
  sorted ``(in, out)`` coordinates). Sparse compute and memory.

Parameters follow ``flax.linen.Dense`` (kernel ``[in, out]``, LeCun-normal init, zero bias); the
BCOO data are the dense initialiser's values at the chosen positions.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dynadiag_jax._checks import int_at_least
from dynadiag_jax.baselines.masks import num_active, random_mask

__all__ = ["MaskedDense", "BCOODense"]

COLLECTION = "sparsity"


def _check(layer, x):
    if not 0.0 < float(layer.sparsity) < 1.0:
        raise ValueError(f"sparsity must be in (0, 1), got {layer.sparsity!r}")
    int_at_least(layer.features, "features", 1)
    if x.ndim < 1:
        raise ValueError("x must have shape [..., in_features], got a scalar")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating array, got dtype {x.dtype}")


def _structure(layer, name: str, init_fn):
    if not layer.is_initializing() and not layer.has_variable(COLLECTION, name):
        raise ValueError(
            f"{type(layer).__name__} needs its {COLLECTION!r} collection: "
            f"call apply({{'params': ..., '{COLLECTION}': variables['{COLLECTION}']}}, x)"
        )
    return layer.variable(COLLECTION, name, init_fn).value


class _UnstructuredDense(nn.Module):
    """The unstructured layers' fields: those of ``flax.linen.Dense`` plus ``sparsity``."""

    features: int
    _: dataclasses.KW_ONLY
    sparsity: float
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = nn.initializers.lecun_normal()
    bias_init: Any = nn.initializers.zeros_init()

    def _setup(self, x):
        """Validate, and return ``(kernel shape [in, features], active count, bias or None)``."""
        _check(self, x)
        shape = (x.shape[-1], self.features)
        bias = (
            self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            if self.use_bias
            else None
        )
        return shape, num_active(shape[0] * shape[1], float(self.sparsity)), bias


class MaskedDense(_UnstructuredDense):
    """``y = x @ (kernel * mask) + bias``; ``x[..., in] -> y[..., features]``."""

    @nn.compact
    def __call__(self, x):
        shape, n, bias = self._setup(x)
        kernel = self.param("kernel", self.kernel_init, shape, self.param_dtype)
        mask = _structure(self, "mask", lambda: random_mask(self.make_rng("params"), shape, n))
        x, kernel, bias = nn.dtypes.promote_dtype(x, kernel, bias, dtype=self.dtype)
        y = jnp.dot(x, jnp.where(mask, kernel, jnp.zeros_like(kernel)))
        return _add_bias(y, bias)


def _add_bias(y, bias):
    return y if bias is None else y + bias.reshape((1,) * (y.ndim - 1) + (-1,))


def _random_indices(key, shape, n):
    flat = jnp.sort(jax.random.choice(key, shape[0] * shape[1], (n,), replace=False))
    return jnp.stack([flat // shape[1], flat % shape[1]], axis=1).astype(jnp.int32)


class BCOODense(_UnstructuredDense):
    """``y = x @ W + bias``, ``W[in, features]`` in BCOO; ``x[..., in] -> y[..., features]``."""

    @nn.compact
    def __call__(self, x):
        shape, n, bias = self._setup(x)
        indices = _structure(
            self, "indices", lambda: _random_indices(self.make_rng("params"), shape, n)
        )
        data = self.param(
            "data",
            lambda key: self.kernel_init(key, shape, self.param_dtype)[
                indices[:, 0], indices[:, 1]
            ],
        )
        if data.shape != (n,) or indices.shape != (n, 2):
            raise ValueError(
                f"data {data.shape} and indices {indices.shape} must be [{n}] and "
                f"[{n}, 2] for a {shape} kernel at sparsity {self.sparsity}"
            )
        # imported here: with the baselines, jax.experimental.sparse added 1.2 s to the import of
        # every process that imports dynadiag_jax.training (which imports the baselines)
        from jax.experimental import sparse

        x, data, bias = nn.dtypes.promote_dtype(x, data, bias, dtype=self.dtype)
        w = sparse.BCOO((data, indices), shape=shape, indices_sorted=True, unique_indices=True)
        lead = x.shape[:-1]
        y = (x.reshape((-1, shape[0])) @ w).reshape(lead + (self.features,))
        return _add_bias(y, bias)
