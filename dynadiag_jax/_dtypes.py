"""Explicit float promotion that does not depend on ``jax_numpy_dtype_promotion``.

Under the strict promotion mode (our tests) even ``jnp.promote_types`` refuses bfloat16 + float32,
so the layer and the gates decide their computation dtypes here.
"""

from __future__ import annotations

import jax.numpy as jnp

__all__ = ["promote_floats", "work_dtype"]


def promote_floats(*dtypes):
    """The narrowest float dtype that holds every given float dtype (bf16 + f16 -> f32)."""
    dtypes = {jnp.dtype(d) for d in dtypes}
    if len(dtypes) == 1:
        return dtypes.pop()
    widest = max(d.itemsize for d in dtypes)
    return jnp.dtype(jnp.float64) if widest == 8 else jnp.dtype(jnp.float32)


def work_dtype(dtype):
    """float32, or float64 for float64 input: where gates and sums are computed."""
    return promote_floats(dtype, jnp.float32)
