"""``diag_matmul``: ``y = x @ W.T`` for a diagonal-sparse ``W``, sparse in forward and backward.

The product is a ``jax.custom_vjp`` over three primitive products, each provided by a *backend*:

* ``fwd``:     ``y[B, out]     = x[B, in] @ W.T``
* ``dx``:      ``dx[B, in]     = dy[B, out] @ W``           (the transpose closure)
* ``dvalues``: ``dvalues[K, D] = sum_b dy[b, row] * x[b, col]``  (a diagonal SDDMM)

Backends: ``"jax"`` (pure JAX, any platform), ``"ffi"`` (our XLA FFI kernels: C++ on CPU, CUDA on
GPU), and ``"dense"`` (materialise ``W`` and use XLA's dot; a baseline, differentiated by JAX).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dynadiag_jax.layout import geometry
from dynadiag_jax.ops import reference

__all__ = ["diag_matmul", "available_impls"]


class Backend(NamedTuple):
    """The three products behind one implementation (all on 2-D operands)."""

    fwd: Callable  # (x2, values, offsets, *, out_features) -> y2
    dx: Callable  # (dy2, values, offsets, *, in_features) -> dx2
    dvalues: Callable  # (dy2, x2, offsets) -> dvalues [K, D]
    dtypes: Callable  # () -> dtypes supported on the current default platform
    bwd: Callable | None = None  # (dy2, x2, values, offsets) -> (dx2, dvalues), one pass


_JAX = Backend(
    fwd=reference.diag_matmul_fwd_reference,
    dx=reference.diag_matmul_dx_reference,
    dvalues=reference.diag_matmul_dvalues_reference,
    dtypes=lambda: (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64),
)

# Registered by dynadiag_jax.ops.ffi when the compiled extension is importable.
_BACKENDS: dict[str, Backend] = {"jax": _JAX}


def register_backend(name: str, backend: Backend) -> None:
    """Make ``impl=name`` available (used by the extension loaders at import time)."""
    _BACKENDS[name] = backend


def available_impls() -> tuple[str, ...]:
    """Names accepted by ``diag_matmul(impl=...)`` in this installation."""
    return ("auto", "dense", *_BACKENDS)


def _as_array(a, name):
    if isinstance(a, np.ndarray):
        return jnp.asarray(a)
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    return a


def _host_offsets(offsets):
    """``offsets`` as a numpy array if they are already on the host, else None.

    Reading arrays that live on an accelerator would copy them to the host and wait for the device
    on every eager call; the kernels check those at run time instead.
    """
    if isinstance(offsets, np.ndarray):
        return offsets
    if isinstance(offsets, jax.Array) and not isinstance(offsets, jax.core.Tracer):
        if all(d.platform == "cpu" for d in offsets.devices()):
            return np.asarray(offsets)
    return None


def _check_args(x, values, offsets, out_features, host_offsets):
    if x.ndim < 1:
        raise ValueError("x must have shape [..., in_features], got a scalar")
    geo = geometry(x.shape[-1], out_features)
    if values.ndim != 2:
        raise ValueError(f"values must have shape [K, D] = [K, {geo.length}], got {values.shape}")
    if offsets.ndim != 1:
        raise ValueError(f"offsets must have shape [K] = [{values.shape[0]}], got {offsets.shape}")
    if values.shape[1] != geo.length:
        raise ValueError(
            f"values must have shape [K, min(in, out)] = [K, {geo.length}] for in_features="
            f"{geo.in_features}, out_features={geo.out_features}; got {values.shape}"
        )
    if offsets.shape[0] != values.shape[0]:
        raise ValueError(
            f"offsets must have shape [K] = [{values.shape[0]}] to match values {values.shape}; "
            f"got {offsets.shape}"
        )
    if not jnp.issubdtype(offsets.dtype, jnp.integer):
        raise TypeError(f"offsets must be an integer array, got dtype {offsets.dtype}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating array, got dtype {x.dtype}")
    if values.dtype != x.dtype:
        raise TypeError(f"values dtype {values.dtype} must equal x dtype {x.dtype}")
    if host_offsets is not None:
        off = host_offsets
        if off.size and (off.min() < 0 or off.max() >= geo.num_candidates):
            raise ValueError(
                f"offsets must lie in [0, P) = [0, {geo.num_candidates}); got values in "
                f"[{off.min()}, {off.max()}]"
            )
    return geo


def _supports(impl: str, dtype) -> bool:
    return any(dtype == d for d in _BACKENDS[impl].dtypes())


def _resolve_impl(impl: str, dtype) -> str:
    if impl == "auto":
        return "ffi" if "ffi" in _BACKENDS and _supports("ffi", dtype) else "jax"
    if impl != "dense" and impl not in _BACKENDS:
        raise ValueError(f"impl must be one of {available_impls()}, got {impl!r}")
    if impl != "dense" and not _supports(impl, dtype):
        supported = ", ".join(str(jnp.dtype(d)) for d in _BACKENDS[impl].dtypes()) or "none"
        raise TypeError(
            f"impl={impl!r} supports dtypes ({supported}) on platform {jax.default_backend()!r}; "
            f"got {jnp.dtype(dtype)} (impl='jax' runs every floating dtype on every platform)"
        )
    return impl


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _product(x2, values, offsets, out_features, impl):
    return _BACKENDS[impl].fwd(x2, values, offsets, out_features=out_features)


def _product_fwd(x2, values, offsets, out_features, impl):
    y2 = _BACKENDS[impl].fwd(x2, values, offsets, out_features=out_features)
    return y2, (x2, values, offsets)


def _product_bwd(out_features, impl, res, dy2):
    x2, values, offsets = res
    backend = _BACKENDS[impl]
    if backend.bwd is not None:
        dx2, dvalues = backend.bwd(dy2, x2, values, offsets)
    else:
        dx2 = backend.dx(dy2, values, offsets, in_features=x2.shape[1])
        dvalues = backend.dvalues(dy2, x2, offsets)
    return dx2, dvalues, None


_product.defvjp(_product_fwd, _product_bwd)


def diag_matmul(x, values, offsets, *, out_features: int, impl: str = "auto"):
    """``y = x @ W.T`` where ``W[out_features, in]`` is the sum of the given wrapped diagonals.

    Args:
      x: ``[..., in]`` floating input.
      values: ``[K, D]`` with ``D = min(in, out_features)``, same dtype as ``x``; row ``k`` holds
        the entries of diagonal ``offsets[k]`` (DESIGN.md section 1 gives the index convention).
      offsets: ``[K]`` integer diagonal ids in ``[0, max(in, out_features))``; repeats add up.
      out_features: the output width.
      impl: ``"auto"`` (the compiled kernel where it is built and supports the dtype, else
        ``"jax"``), ``"ffi"``, ``"jax"`` or ``"dense"``; see :func:`available_impls`.

    Returns:
      ``[..., out_features]`` in ``x.dtype``; low-precision inputs accumulate in float32.
      Differentiable in ``x`` and ``values`` without building a dense ``W`` (except ``"dense"``).

    Raises:
      TypeError, ValueError: at trace time, for bad ranks, shapes, dtypes, or an offset outside
        ``[0, P)`` in host data (numpy, or a jax array on CPU devices). Offsets that are traced or
        live on an accelerator are not read back; one out of range there makes the CPU kernel
        raise at run time, while the CUDA kernels (which cannot report without a host sync)
        write NaN (all of ``y``/``dx``, that diagonal's row of ``dvalues``), and the ``"jax"``
        path poisons the affected outputs with NaN.
    """
    host_offsets = _host_offsets(offsets)  # before _as_array moves numpy data to the device
    x, values, offsets = (
        _as_array(a, n) for a, n in ((x, "x"), (values, "values"), (offsets, "offsets"))
    )
    geo = _check_args(x, values, offsets, out_features, host_offsets)
    impl = _resolve_impl(impl, x.dtype)
    lead = x.shape[:-1]
    x2 = x.reshape((-1, geo.in_features))
    if impl == "dense":
        y2 = reference.diag_matmul_dense(x2, values, offsets, out_features=geo.out_features)
    else:
        if impl == "jax":
            values = _poison_invalid(values, offsets, geo.num_candidates)
        y2 = _product(x2, values, offsets.astype(jnp.int32), geo.out_features, impl)
    return y2.reshape(lead + (geo.out_features,))


def _poison_invalid(values, offsets, num_candidates):
    # dynamic_slice clamps out-of-range starts; NaN makes a bad traced offset visible instead.
    valid = (offsets >= 0) & (offsets < num_candidates)
    return jnp.where(valid[:, None], values, jnp.asarray(jnp.nan, values.dtype))
