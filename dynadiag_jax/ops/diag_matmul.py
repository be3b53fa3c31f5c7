"""``diag_matmul``: ``y = x @ W.T`` for a diagonal-sparse ``W``, sparse in forward and backward.

``W`` is a sum of element diagonals (``values[K, D]``) or of block diagonals
(``values[K, L_b, b, b]``); docs/design.md section 1. This module checks the arguments, picks the
implementation and flattens leading dimensions; the products themselves are the primitives of
:mod:`dynadiag_jax.ops.products` (forward, ``dx`` by the transpose closure, ``dvalues`` by a
diagonal SDDMM, with JVP and transpose rules for every autodiff mode and order).

Implementations: ``"jax"`` (pure JAX, any platform), ``"ffi"`` (our XLA FFI kernels: C++ on CPU,
CUDA on GPU), ``"cuda_emulated"`` (the CUDA kernels compiled for the host; tests) and ``"dense"``
(materialise ``W`` and use XLA's dot; a baseline, differentiated by JAX).

An optional input permutation ``perm[in]`` makes the product ``W P``: ``y = x[..., perm] @ W.T``.
The CPU kernels read ``x`` (and write ``dx``) through it; ``"dense"`` folds it into ``W``;
``"jax"``, and the CUDA kernels, gather ``x`` first (docs/design.md section 4.7).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dynadiag_jax._checks import as_int32, host_array, int_at_least, permutation_problem
from dynadiag_jax.layout import KERNEL_BLOCK_SIZES, geometry
from dynadiag_jax.ops import auto, products, reference

__all__ = ["diag_matmul", "diag_to_dense", "available_impls"]


def available_impls(*, block_size: int = 1) -> tuple[str, ...]:
    """Names accepted by ``diag_matmul(impl=...)`` in this installation.

    With ``block_size = b >= 2``: those that run block diagonals of that size on the default
    platform (``"jax"`` and ``"dense"`` take any ``b``; the kernels ``b`` in
    ``layout.KERNEL_BLOCK_SIZES`` where their platform has block kernels).
    """
    block_size = int_at_least(block_size, "block_size", 1)
    backends = products.available_backends()
    return ("auto", "dense", *(n for n, be in backends.items() if be.block_size_ok(block_size)))


def _as_array(a, name):
    if isinstance(a, np.ndarray):
        return jnp.asarray(a)
    if not hasattr(a, "shape") or not hasattr(a, "dtype"):
        raise TypeError(f"{name} must be an array, got {type(a).__name__}")
    return a


def _check_values(values, element):
    """The geometry ``values`` describe (``element``: the layer's element geometry);
    ``ValueError`` naming the expected shape otherwise."""
    in_features, out_features = element.in_features, element.out_features
    if values.ndim not in (2, 4):
        raise ValueError(
            f"values must have shape [K, D] = [K, {element.length}] (element diagonals) or "
            f"[K, L_b, b, b] (block diagonals), got {values.shape}"
        )
    if values.ndim == 2:
        if values.shape[1] != element.length:
            raise ValueError(
                f"values must have shape [K, min(in, out)] = [K, {element.length}] for "
                f"in_features={in_features}, out_features={out_features}; got {values.shape}"
            )
        return element
    b = values.shape[-1]
    if values.shape[2] != b:
        raise ValueError(
            f"block-diagonal values must have shape [K, L_b, b, b] with square b x b blocks; "
            f"got {values.shape}"
        )
    if b == 1:
        raise ValueError(
            f"block-diagonal values [K, L_b, b, b] need b >= 2, got {values.shape}; element "
            f"diagonals take values of shape [K, D] = [K, {element.length}]"
        )
    try:
        geo = geometry(in_features, out_features, b)
    except ValueError as e:
        raise ValueError(f"values of shape {values.shape} (b = {b}): {e}") from None
    if values.shape[1] != geo.length:
        raise ValueError(
            f"block-diagonal values must have shape [K, L_b, b, b] = [K, {geo.length}, {b}, {b}] "
            f"(L_b = max(in, out) / b) for in_features={in_features}, out_features="
            f"{out_features}; got {values.shape}"
        )
    return geo


def _x_shape_for(values, out_features):
    """The shape ``x`` needs for ``values`` to fit ``out_features`` (as ``"[..., n]"`` text), or
    None where no width of ``x`` would make them fit."""
    if values.ndim == 2:
        d = values.shape[1]
        if 1 <= d < out_features:  # D = min(in, out) below out: in = D
            return f"[..., {d}]"
        return f"[..., in_features] with in_features >= {d}" if d == out_features else None
    if values.ndim != 4:
        return None
    b = values.shape[-1]
    if b < 2 or values.shape[2] != b or out_features % b:
        return None
    span = values.shape[1] * b  # max(in, out)
    if span > out_features:
        return f"[..., {span}]"
    if span == out_features:
        return f"[..., in_features] with in_features a multiple of {b} up to {out_features}"
    return None


def _check_args(x, values, offsets, out_features, host_offsets):
    if x.ndim < 1:
        raise ValueError("x must have shape [..., in_features], got a scalar")
    if x.shape[-1] < 1:
        raise ValueError(
            f"x must have shape [..., in_features] with in_features >= 1, got {x.shape}"
        )
    # names bad widths before any shape message uses them
    element = geometry(x.shape[-1], out_features)
    try:
        geo = _check_values(values, element)
    except ValueError as e:
        # in_features is x's width, while values are usually a layer's parameters: where they fit
        # another width, the likelier mistake is x
        want = _x_shape_for(values, element.out_features)
        if want is None:
            raise
        raise ValueError(
            f"x must have shape {want} to match values of shape {values.shape} and "
            f"out_features={element.out_features}, got {x.shape}; or else {e}"
        ) from None
    _check_offsets(values, offsets, host_offsets, geo)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating array, got dtype {x.dtype}")
    if values.dtype != x.dtype:
        raise TypeError(f"values dtype {values.dtype} must equal x dtype {x.dtype}")
    return geo


def _check_offsets(values, offsets, host_offsets, geo):
    """``offsets[K]`` of integers for ``values``, in range where they are host values."""
    if offsets.ndim != 1:
        raise ValueError(f"offsets must have shape [K] = [{values.shape[0]}], got {offsets.shape}")
    if offsets.shape[0] != values.shape[0]:
        raise ValueError(
            f"offsets must have shape [K] = [{values.shape[0]}] to match values {values.shape}; "
            f"got {offsets.shape}"
        )
    if not jnp.issubdtype(offsets.dtype, jnp.integer):
        raise TypeError(f"offsets must be an integer array, got dtype {offsets.dtype}")
    if host_offsets is not None:
        off = host_offsets
        if off.size and (off.min() < 0 or off.max() >= geo.num_candidates):
            p = "P_b" if geo.blocked else "P"
            raise ValueError(
                f"offsets must lie in [0, {p}) = [0, {geo.num_candidates}); got values in "
                f"[{off.min()}, {off.max()}]"
            )


def diag_to_dense(values, offsets, *, in_features: int, out_features: int):
    """The dense ``W[out, in]`` that :func:`diag_matmul` multiplies by (repeated offsets add up);
    a reference for tests and inspection, not a fast path.

    Args:
      values: ``[K, D]`` with ``D = min(in, out)`` (element diagonals) or ``[K, L_b, b, b]``
        (block diagonals, ``L_b = max(in, out) / b``), floating.
      offsets: ``[K]`` integer in ``[0, P)`` (``[0, P_b)`` for blocks). Out of range:
        ``ValueError`` when concrete; inside ``jit`` the whole of ``W`` is NaN (as
        :func:`diag_matmul` makes ``y`` NaN), never a wrapped diagonal.
      in_features, out_features: the widths of ``W``.

    Returns:
      ``[out_features, in_features]`` in ``values.dtype``.
    """
    host_offsets = host_array(offsets)
    values, offsets = _as_array(values, "values"), _as_array(offsets, "offsets")
    geo = _check_values(values, geometry(in_features, out_features))
    _check_offsets(values, offsets, host_offsets, geo)
    if not jnp.issubdtype(values.dtype, jnp.floating):
        raise TypeError(f"values must be a floating array, got dtype {values.dtype}")
    offsets = as_int32(offsets)
    widths = {"in_features": geo.in_features, "out_features": geo.out_features}
    if host_offsets is not None:
        return reference.diag_to_dense(values, offsets, **widths)
    valid = (offsets >= 0) & (offsets < geo.num_candidates)
    w = reference.diag_to_dense(values, jnp.where(valid, offsets, 0), **widths)
    return w + jnp.where(jnp.all(valid), jnp.zeros((), w.dtype), jnp.asarray(jnp.nan, w.dtype))


def _check_symbolic(x, out_features, **arrays):
    """``ValueError`` for a symbolic (shape-polymorphic) dimension anywhere but the leading (row)
    dimensions of ``x``: the widths and the diagonals fix the layout, the rows are free."""
    only = "only the leading (row) dimensions of x may be symbolic"
    if x.ndim and jax.export.is_symbolic_dim(x.shape[-1]):
        raise ValueError(
            f"x has the symbolic shape {x.shape}: its last dimension (in_features) must be "
            f"concrete; {only}"
        )
    if jax.export.is_symbolic_dim(out_features):
        raise ValueError(f"out_features must be a concrete integer, got {out_features}; {only}")
    for name, a in arrays.items():
        if any(jax.export.is_symbolic_dim(d) for d in a.shape):
            raise ValueError(
                f"{name} has the symbolic shape {a.shape}: {name} must be concrete; {only}"
            )


def _check_perm(perm, host_perm, in_features):
    """``perm`` must be an integer ``[in]``; on the host, a permutation of ``range(in)``."""
    if perm.ndim != 1 or perm.shape[0] != in_features:
        raise ValueError(
            f"perm must have shape [in] = [{in_features}] (a permutation of x's {in_features} "
            f"columns), got {perm.shape}"
        )
    if not jnp.issubdtype(perm.dtype, jnp.integer):
        raise TypeError(f"perm must be an integer array, got dtype {perm.dtype}")
    if host_perm is not None:
        problem = permutation_problem(host_perm, in_features)
        if problem is not None:
            raise ValueError(f"perm must be a permutation of range({in_features}): {problem}")


def _supports(impl: str, dtype) -> bool:
    backend = products.backend(impl)
    if backend.dtypes is products.every_float_dtype:  # float8 too: written in JAX
        return jnp.issubdtype(dtype, jnp.floating)
    return any(dtype == d for d in backend.dtypes())


def check_impl(impl) -> None:
    """Raises unless ``impl`` names an implementation of this installation (``TypeError``: not a
    str; ``ValueError``: unknown, or kernels this installation was built without). The layers
    call it when made, so a misspelt ``impl`` is not first seen at their first call."""
    if not isinstance(impl, str):
        raise TypeError(f"impl must be a str, one of {available_impls()}, got {impl!r}")
    if impl not in ("auto", "dense") and impl not in products.available_backends():
        unbuilt = {"ffi": "C++/CUDA kernels", "cuda_emulated": "emulated CUDA kernels"}
        why = (
            f" ({impl!r} runs the {unbuilt[impl]}, which this installation does not have: "
            "README, Install)"
            if impl in unbuilt
            else ""
        )
        raise ValueError(f"impl must be one of {available_impls()}, got {impl!r}{why}")


def resolve_impl(impl: str, dtype, geo, rows: int | None, num_diagonals: int) -> str:
    """The implementation ``diag_matmul(impl=impl)`` runs for these static facts.

    ``geo``: the product's :class:`dynadiag_jax.layout.DiagGeometry`; ``rows``: the number of
    rows of ``x`` (leading dimensions flattened), None where they are symbolic. Raises as
    :func:`diag_matmul` does for an impl that cannot run the dtype or block size.
    """
    block_size = geo.block_size
    check_impl(impl)
    if impl == "auto":  # the default platform's choice; diag_matmul decides per lowering platform
        return auto.decide_for_lowering(
            auto.current_platform(), rows=rows, geo=geo, dtype=dtype, num_diagonals=num_diagonals
        ).impl
    if impl == "dense":
        return impl
    if not _supports(impl, dtype):
        supported = ", ".join(str(jnp.dtype(d)) for d in products.backend(impl).dtypes()) or "none"
        raise TypeError(
            f"impl={impl!r} supports dtypes ({supported}) on platform {jax.default_backend()!r}; "
            f"got {jnp.dtype(dtype)} (impl='jax' runs every floating dtype on every platform)"
        )
    if not products.backend(impl).block_size_ok(block_size):
        if block_size in KERNEL_BLOCK_SIZES:
            platform = jax.default_backend()
            why = f"has no block-diagonal kernels on platform {platform!r} in this build"
        else:
            why = f"takes block sizes b in {KERNEL_BLOCK_SIZES}, got b = {block_size}"
        raise ValueError(f"impl={impl!r} {why}; impl='jax' and impl='dense' run any block size")
    return impl


def diag_matmul(x, values, offsets, *, out_features: int, impl: str = "auto", perm=None):
    """``y = x @ W.T`` where ``W[out_features, in]`` is the sum of the given wrapped diagonals.

    Args:
      x: ``[..., in]`` floating input. Its leading dimensions may be symbolic (``jax.export`` with
        a symbolic batch); ``in`` and every other argument's shape must be concrete.
      values: same dtype as ``x``; either element diagonals ``[K, D]`` with
        ``D = min(in, out_features)``, row ``k`` holding the entries of diagonal ``offsets[k]``,
        or block diagonals ``[K, L_b, b, b]`` with ``b = values.shape[-1] >= 2`` dividing ``in``
        and ``out_features`` and ``L_b = max(in, out_features) / b`` (docs/design.md section 1
        gives both index conventions).
      offsets: ``[K]`` integer diagonal ids in ``[0, P)``, ``P = max(in, out_features)``
        (block diagonals: ``[0, P_b)``, ``P_b = min(in, out_features) / b``); repeats add up.
      out_features: the output width.
      impl: ``"auto"`` (decided from the static shapes, dtype, K and b: on CPU the compiled
        kernel where it supports the dtype and block size, else ``"jax"``, and ``"dense"`` for
        element diagonals keeping at least ``auto.CPU_DENSE_DENSITY`` of the ``P`` candidates on
        at least ``auto.CPU_DENSE_ROWS`` rows (where XLA's dot is faster; a non-finite input
        then reaches every output of its row); on GPU the CUDA kernel
        only where the cost model predicts it faster than ``"dense"``; elsewhere ``"dense"``;
        for symbolic rows, the choice made at both 1 and 2**20 rows where the two agree, else
        ``"dense"``, and ``"dense"`` on GPU; see ``ops/auto.py``), ``"ffi"``, ``"jax"`` or
        ``"dense"`` (``W`` built on the device and XLA's dot); see :func:`available_impls`. The
        CUDA kernels (``"ffi"`` lowered for CUDA, ``"cuda_emulated"``) need concrete rows.
      perm: None, or an integer ``[in]`` permutation of ``range(in)``: the input permutation of a
        layer ``y = W x[..., perm]`` (the product of ``W P``); ``dx`` is scattered back through it.
        ``"ffi"`` on CPU reads ``x`` through ``perm`` inside the kernels; ``"dense"`` permutes the
        columns of the dense ``W`` once; ``"jax"`` and the CUDA kernels gather ``x`` first.

    Returns:
      ``[..., out_features]`` in ``x.dtype``; low-precision inputs accumulate in float32.
      Differentiable in ``x`` and ``values`` in every autodiff mode and order, without building a
      dense ``W`` (except ``"dense"``).

    Offsets out of range: those in host data (numpy, or a jax array on CPU devices) raise
    ``ValueError`` here. Traced offsets, or offsets on an accelerator, are not read back; one
    outside ``[0, P)`` (``[0, P_b)``) there gives, with every impl and in both forms, a ``y`` that
    is NaN everywhere, and derivatives poisoned the same way: ``dx`` (and any tangent of ``y``)
    NaN everywhere, ``dvalues`` NaN in the rows of the bad offsets (the other rows are exact).
    No kernel reads through a bad offset, and nothing wraps it modulo ``P`` (nor into int32: an
    int64 offset such as ``2**32 + 1`` is out of range too). A ``perm`` that is not a permutation
    of ``range(in)`` (int64 entries beyond int32 included) raises ``ValueError`` when it is host
    data; traced (or on an accelerator) it makes ``y``, ``dx`` and ``dvalues`` NaN everywhere, and
    the kernels read through the identity instead.

    Raises:
      TypeError, ValueError: at trace time, for bad ranks, shapes, dtypes, block sizes, host
        offsets out of range, a host ``perm`` that is not a permutation, or a symbolic
        (shape-polymorphic) dimension anywhere but the leading dimensions of ``x``; ValueError
        when a CUDA kernel is lowered for symbolic rows.
    """
    return _diag_matmul(
        x, values, offsets, out_features=out_features, impl=impl, guard=True, perm=perm
    )


def diag_matmul_in_range(x, values, offsets, *, out_features: int, impl: str = "auto"):
    """:func:`diag_matmul` for offsets the caller guarantees to lie in ``[0, P)``.

    For the library's own callers whose offsets come from ranking all ``P`` candidates (the search
    phase): the program skips the passes that define the out-of-range rule, in the product and in
    every derivative. An offset out of range here gives unspecified values (kernels still never
    read through it).
    """
    return _diag_matmul(x, values, offsets, out_features=out_features, impl=impl, guard=False)


def _diag_matmul(x, values, offsets, *, out_features, impl, guard, perm=None):
    host_offsets = host_array(offsets)  # before _as_array moves numpy data to the device
    host_perm = None if perm is None else host_array(perm)
    x, values, offsets = (
        _as_array(a, n) for a, n in ((x, "x"), (values, "values"), (offsets, "offsets"))
    )
    arrays = dict(values=values, offsets=offsets)
    if perm is not None:
        arrays["perm"] = perm = _as_array(perm, "perm")
    _check_symbolic(x, out_features, **arrays)
    geo = _check_args(x, values, offsets, out_features, host_offsets)
    if perm is not None:
        _check_perm(perm, host_perm, geo.in_features)
        perm = as_int32(perm)
    offsets = as_int32(offsets)
    lead = x.shape[:-1]
    # checks the impl; "auto" goes on to the products, which decide per lowering platform
    resolve_impl(impl, x.dtype, geo, products.row_count(x), values.shape[0])
    x2 = x.reshape((-1, geo.in_features))
    # impl="dense" too: the products carry the out-of-range rule into every derivative (JAX's
    # autodiff of a W built with NaN left a tangent in values alone half NaN)
    y2 = products.fwd(
        x2, values, offsets, perm, out_features=geo.out_features, impl=impl, guard=guard
    )
    return y2.reshape(lead + (geo.out_features,))
