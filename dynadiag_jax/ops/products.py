"""The three diagonal products as JAX primitives, with JVP, transpose and batching rules.

With ``W`` the diagonal matrix of ``(values, offsets)`` (element or block diagonals):

* ``fwd(x, values)     = x @ W.T``                       ``[..., in]  -> [..., out]``
* ``dx(dy, values)     = dy @ W``                        ``[..., out] -> [..., in]``
* ``dvalues(dy, x)     = sum_r dy[r, row] * x[r, col]``  ``-> values' shape`` (diagonal SDDMM)

Each is bilinear in its two array operands, and the three close under transposition, as
``lax.dot_general`` does: ``fwd`` transposes to ``dx`` (in ``x``) and ``dvalues`` (in ``values``);
``dx`` to ``fwd`` (in ``dy``) and ``dvalues(dy, ct)`` (in ``values``); ``dvalues`` to
``fwd(x, ct)`` (in ``dy``) and ``dx(dy, ct)`` (in ``x``). So every autodiff mode and order (grad,
jvp, jacfwd, hessian, grad of grad) runs through the sparse products and never builds a dense W.

Two more primitives keep ordinary reverse mode at one backward kernel call: the tangent of ``fwd``
when both ``x`` and ``values`` vary is ``fwd_tangent(x_dot, values_dot, x, values) =
fwd(x_dot, values) + fwd(x, values_dot)``, one primitive linear in ``(x_dot, values_dot)``, whose
transpose is ``bwd(dy, x, values) = (dx(dy, values), dvalues(dy, x))``: the fused CPU kernel where
the platform has it.

Every product takes an optional input permutation ``perm[in]`` (int32) as one more operand after
``offsets``: the product of ``W P``, ``fwd = W x[..., perm]``, ``dx`` scattered back through
``perm``, ``dvalues`` from ``x[..., perm]``. The three still close under transposition, so every
rule passes the trailing integer operands (``offsets``, and ``perm`` where given) through as they
are. Backends with kernels that read ``x`` through ``perm`` get it as ``perm=``; the pure-JAX
backend gathers and scatters.

Every primitive carries the implementation name (``impl``) as a parameter and lowers through that
:class:`Backend`'s functions, so the partitioning of the FFI kernels stays in their lowering.
``impl="auto"`` is decided in the lowering, by a lowering rule per platform (:func:`_auto_impl`), so
a program lowered for another platform than the default one (``jax.export``, ``lowering_platforms``)
gets that platform's choice, and one lowered for several switches between their choices.

The leading (row) dimensions of ``x``/``dy`` may be symbolic (``jax.export`` with a symbolic
batch): nothing here computes with the row count in Python (:func:`row_count` is None for them).
"""

from __future__ import annotations

import contextvars
import functools
import warnings
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from dynadiag_jax.layout import geometry
from dynadiag_jax.ops import reference
from dynadiag_jax.ops.manual_axes import same_varying, shaped_array

__all__ = [
    "Backend",
    "abstract_eval",
    "available_backends",
    "backend",
    "register_backend",
    "row_count",
    "fwd",
    "dx",
    "dvalues",
    "bwd_p",
]


class Backend(NamedTuple):
    """The products behind one implementation (traced inside the primitives' lowering).

    ``perm``: None, or the input permutation ``perm[in]`` (int32, a permutation of ``range(in)``).
    """

    fwd: Callable  # (x, values, offsets, *, out_features, perm=None) -> y
    dx: Callable  # (dy, values, offsets, *, in_features, perm=None) -> dx
    # (dy, x, offsets, *, block_size, perm=None) -> dvalues [K, D] or [K, L_b, b, b]
    dvalues: Callable
    dtypes: Callable  # () -> dtypes supported on the current default platform
    bwd: Callable | None = None  # (dy, x, values, offsets, perm=None) -> (dx, dvalues), one pass
    # (block_size) -> whether the current default platform runs it (1 = element diagonals)
    block_size_ok: Callable = lambda block_size: block_size == 1


def _rows(a):
    return a.reshape((-1, a.shape[-1]))


def row_count(a) -> int | None:
    """Rows of ``a[..., n]`` (its leading dimensions flattened); None where one is symbolic."""
    lead = a.shape[:-1]
    if any(jax.export.is_symbolic_dim(d) for d in lead):
        return None
    return int(np.prod(lead, dtype=np.int64))


def _jax_fwd(x, values, offsets, *, out_features, perm=None):
    x2 = reference.gather_columns(_rows(x), perm)
    y = reference.diag_matmul_fwd_reference(x2, values, offsets, out_features=out_features)
    return y.reshape(x.shape[:-1] + (out_features,))


def _jax_dx(dy, values, offsets, *, in_features, perm=None):
    dx_ = reference.diag_matmul_dx_reference(_rows(dy), values, offsets, in_features=in_features)
    return reference.scatter_columns(dx_, perm).reshape(dy.shape[:-1] + (in_features,))


def _jax_dvalues(dy, x, offsets, *, block_size, perm=None):
    return reference.diag_matmul_dvalues_reference(
        _rows(dy), reference.gather_columns(_rows(x), perm), offsets, block_size=block_size
    )


def every_float_dtype() -> tuple:
    """``Backend.dtypes`` of the implementations written in JAX: every floating dtype (the
    float8 types too, which ``diag_matmul`` accepts for these backends by kind; listed here are
    the usual ones)."""
    return (jnp.float16, jnp.bfloat16, jnp.float32, jnp.float64)


def every_block_size(block_size: int) -> bool:
    """``Backend.block_size_ok`` of the implementations written in JAX: every block size."""
    return True


# The reference on any platform (any floating dtype and block size); leading dims become rows.
_JAX = Backend(
    fwd=_jax_fwd,
    dx=_jax_dx,
    dvalues=_jax_dvalues,
    dtypes=every_float_dtype,
    block_size_ok=every_block_size,
)

# "jax" always; the extension loaders add "ffi" and "cuda_emulated" at import time.
_BACKENDS: dict[str, Backend] = {"jax": _JAX}


def register_backend(name: str, impl: Backend) -> None:
    """Make ``impl=name`` available (used by the extension loaders at import time)."""
    _BACKENDS[name] = impl


def available_backends() -> dict[str, Backend]:
    """Name -> :class:`Backend` of every implementation in this installation."""
    return dict(_BACKENDS)


def backend(name: str) -> Backend:
    if name == "dense":  # impl="auto"'s choice where the kernels do not pay; not a public impl here
        from dynadiag_jax.ops import dense  # noqa: PLC0415 - dense imports this module

        return dense.BACKEND
    return _BACKENDS[name]


# True while a product primitive is lowered for jax.export (read by the FFI backends, whose
# custom_partitioning is a Python callback that an exported program cannot hold).
lowering_for_export = contextvars.ContextVar("dynadiag_lowering_for_export", default=False)


def require_devices_during_lowering(prim: Primitive) -> None:
    """Ask jit to lower ``prim`` with a concrete device assignment, as custom_partitioning needs.

    The FFI backends partition their kernels with ``custom_partitioning`` inside the lowering.
    JAX has no public switch for this; its own wrappers around custom_partitioning (the cuDNN
    attention primitives) use the same set. Without it the op still runs, but replicated.
    tests/test_sharding.py fails if partitioning is lost.
    """
    try:
        from jax._src import dispatch  # noqa: PLC0415 - private, see the docstring

        dispatch.prim_requires_devices_during_lowering.add(prim)
    except (ImportError, AttributeError):  # a JAX release that moved it: degrade, don't break
        warnings.warn(
            f"this JAX ({jax.__version__}) has no jax._src.dispatch."
            "prim_requires_devices_during_lowering: diag_matmul on a batch-sharded x will run "
            "replicated (gathering x) instead of per shard",
            RuntimeWarning,
            stacklevel=2,
        )


# --- shapes ---------------------------------------------------------------------------------


def abstract_eval(kind: str):
    """Abstract evaluation of product ``kind`` (shared with the FFI backends' raw calls)."""

    def abstract(*avals, width=None, block_size=1, impl=None, guard=True):
        del impl, guard
        if kind == "dvalues":  # dy [..., out], x [..., in], offsets [K] (, perm [in])
            dy, x, offsets, *_ = avals
            k, (n_out, n_in) = offsets.shape[0], (dy.shape[-1], x.shape[-1])
            if block_size == 1:
                return shaped_array((k, min(n_out, n_in)), x.dtype, *avals)
            length = max(n_out, n_in) // block_size
            return shaped_array((k, length, block_size, block_size), x.dtype, *avals)
        if kind == "bwd":  # dy, x, values, offsets (, perm) -> (dx, dvalues)
            _, x, values, *_ = avals
            return (
                shaped_array(x.shape, x.dtype, *avals),
                shaped_array(values.shape, values.dtype, *avals),
            )
        a = avals[0]  # fwd (x, ...), dx (dy, ...), fwd_tangent (x_dot, ...)
        return shaped_array(a.shape[:-1] + (width,), a.dtype, *avals)

    return abstract


def _block_size(values_shape) -> int:
    return values_shape[-1] if len(values_shape) == 4 else 1


def _shape(a):
    return a.aval.shape if ad.is_undefined_primal(a) else a.shape


# --- offsets out of range --------------------------------------------------------------------
#
# Offsets that are traced (or live on an accelerator) cannot be checked at trace time. Every
# product clamps them before any kernel sees them and poisons its result instead: NaN everywhere
# in y and dx (every output may depend on a misplaced diagonal), NaN in the rows of dvalues that
# belong to a bad offset. As every derivative is again one of these products, derivatives of any
# order obey the same rule; the kernels never read through a bad offset.
#
# Where every diagonal reaches every output of a product (block diagonals always; element
# diagonals for y of a wide or square W and dx of a tall or square one), NaN in what the kernel
# reads poisons the whole output inside the kernel, so no pass over the output is needed: the
# guard poisons whichever operand is smallest - the rows of values that belong to a bad offset,
# or, for a product whose only results are y or dx, the whole moving operand (x, dy) when any
# offset is bad - and falls back to a pass over the output when that is smaller still. At a few
# rows the values (K * D entries) are the largest array of the call: a pass over them cost as
# much as the whole batch-1 product, a pass over x costs nothing.
#
# The CPU kernels (impl="ffi" lowered for the CPU) apply the same rule themselves, from a check
# of the K offsets (and of perm) before they run, so their products get no guard ops around the
# call: at a few rows, XLA's small element-wise ops next to a single-threaded custom call cost as
# much as the product (docs/cpu_kernels.md, "What XLA costs around the call").


def _reaches_every_output(output: str, geo) -> bool:
    if geo.blocked:
        return True
    if output == "y":
        return geo.out_features <= geo.in_features
    return geo.out_features >= geo.in_features  # dx


def _guarded(
    lower: Callable,
    num_arrays: int,
    widths: Callable,
    values_at: tuple,
    outputs: tuple,
    moving_at: tuple = (),
) -> Callable:
    """``lower`` on clamped offsets, its results poisoned where an offset is out of range.

    A ``perm`` operand that is not a permutation of ``range(in)`` poisons every result, as if every
    offset were out of range, and the kernels get the identity in its place.

    Args:
      num_arrays: how many operands come before ``offsets`` (the floating arrays).
      widths: ``(*arrays, **params) -> (in_features, out_features, block_size)``.
      values_at: positions of the ``values``-like operands.
      outputs: per result, ``"y"``, ``"dx"`` or ``"dvalues"``.
      moving_at: positions of the row operands whose NaN reaches every result (empty when a
        result, such as dvalues, must stay finite in the rows of good offsets).
    """

    def guarded(impl, *operands, guard, platform, **params):
        arrays, (offsets, *perm) = list(operands[:num_arrays]), operands[num_arrays:]
        geo = geometry(*widths(*arrays, **params))
        if impl == "auto":
            impl = _auto_impl(platform, geo, arrays[0], offsets)
        if not guard or (impl == "ffi" and platform == "cpu"):
            return lower(impl, *arrays, offsets, *perm, **params)
        valid = (offsets >= 0) & (offsets < geo.num_candidates)
        if perm:
            ok = reference.is_permutation(perm[0])
            valid = valid & ok
            perm = [jnp.where(ok, perm[0], jnp.arange(geo.in_features, dtype=jnp.int32))]
        all_valid = jnp.all(valid)

        def poison(a, ok):
            return jnp.where(ok, a, jnp.asarray(jnp.nan, a.dtype))

        def rows(a):
            return valid.reshape(valid.shape + (1,) * (a.ndim - 1))

        # A symbolic row count is costed at one row: a pass over x, dy or the outputs is a fixed
        # share of the product at every row count, one over values costs a whole product there.
        n_rows = row_count(arrays[0])
        n_rows = 1 if n_rows is None else n_rows
        # Results a NaN operand poisons in the kernel; the others get a pass of their own.
        reached = {o for o in outputs if o != "dvalues" and _reaches_every_output(o, geo)}
        passes = sum(n_rows * (geo.out_features if o == "y" else geo.in_features) for o in reached)
        moving = n_rows * sum(arrays[i].shape[-1] for i in moving_at)
        route = min(
            (passes, "outputs"),
            (sum(arrays[i].size for i in values_at), "values"),
            (moving if moving_at and len(reached) == len(outputs) else np.inf, "moving"),
        )[1]
        if route == "moving":
            arrays = [poison(a, all_valid) if i in moving_at else a for i, a in enumerate(arrays)]
        elif route == "values":
            arrays = [poison(a, rows(a)) if i in values_at else a for i, a in enumerate(arrays)]
        out = lower(impl, *arrays, jnp.where(valid, offsets, 0), *perm, **params)
        outs = out if len(outputs) > 1 else (out,)
        outs = tuple(
            o
            if kind in reached and route != "outputs"
            else poison(o, rows(o) if kind == "dvalues" else all_valid)
            for o, kind in zip(outs, outputs)
        )
        return outs if len(outputs) > 1 else outs[0]

    return guarded


# --- impl="auto" ----------------------------------------------------------------------------

# Platforms with a lowering rule (and an impl="auto" decision) of their own; any other platform
# has no kernels and takes the default rule, where "auto" is "dense" (auto.decide).
_AUTO_PLATFORMS = ("cpu", "cuda")


def _auto_impl(platform, geo, first, offsets) -> str:
    """The impl ``"auto"`` runs for the product on lowering platform ``platform`` (None: one
    without kernels)."""
    if platform is None:
        return "dense"
    from dynadiag_jax.ops import auto  # noqa: PLC0415 - auto's cost model imports the FFI backend

    return auto.decide_for_lowering(
        platform,
        rows=row_count(first),
        geo=geo,
        dtype=first.dtype,
        num_diagonals=offsets.shape[0],
    ).impl


# --- primitives -----------------------------------------------------------------------------


def _lower_fwd(impl, x, values, offsets, perm=None, *, width):
    return backend(impl).fwd(x, values, offsets, out_features=width, perm=perm)


def _lower_dx(impl, dy, values, offsets, perm=None, *, width):
    return backend(impl).dx(dy, values, offsets, in_features=width, perm=perm)


def _lower_dvalues(impl, dy, x, offsets, perm=None, *, block_size):
    return backend(impl).dvalues(dy, x, offsets, block_size=block_size, perm=perm)


def _lower_bwd(impl, dy, x, values, offsets, perm=None):
    be = backend(impl)
    if be.bwd is not None:
        return tuple(be.bwd(dy, x, values, offsets, perm=perm))
    dx_ = be.dx(dy, values, offsets, in_features=x.shape[-1], perm=perm)
    return dx_, be.dvalues(dy, x, offsets, block_size=_block_size(values.shape), perm=perm)


def _lower_fwd_tangent(impl, x_dot, values_dot, x, values, offsets, perm=None, *, width):
    be = backend(impl)
    return be.fwd(x_dot, values, offsets, out_features=width, perm=perm) + be.fwd(
        x, values_dot, offsets, out_features=width, perm=perm
    )


@functools.cache
def _compiled(prim: Primitive, params: tuple):
    """Eager calls run the primitive under ``jit`` (one cache entry per parameter set)."""
    return jax.jit(functools.partial(prim.bind, **dict(params)))


def _primitive(name: str, kind: str, lower: Callable) -> Primitive:
    prim = Primitive(f"diag_matmul_{name}")
    prim.multiple_results = kind == "bwd"
    prim.def_abstract_eval(abstract_eval(kind))
    prim.def_impl(lambda *args, **params: _compiled(prim, tuple(sorted(params.items())))(*args))

    def lowering(ctx, *operands, impl, platform=None, **params):
        fn = functools.partial(lower, impl, platform=platform, **params)
        token = lowering_for_export.set(ctx.module_context.lowering_parameters.for_export)
        try:
            return mlir.lower_fun(fn, multiple_results=prim.multiple_results)(ctx, *operands)
        finally:
            lowering_for_export.reset(token)

    # One rule per platform: a multi-platform lowering switches between them and lowers each for
    # its platform alone (the kernels' own per-platform rules included).
    mlir.register_lowering(prim, lowering)
    for platform in _AUTO_PLATFORMS:
        rule = functools.partial(lowering, platform=platform)
        mlir.register_lowering(prim, rule, platform=platform)
    require_devices_during_lowering(prim)
    return prim


def _fwd_widths(x, values, *, width):
    return x.shape[-1], width, _block_size(values.shape)


fwd_p = _primitive("fwd", "fwd", _guarded(_lower_fwd, 2, _fwd_widths, (1,), ("y",), (0,)))
dx_p = _primitive(
    "dx",
    "dx",
    _guarded(
        _lower_dx,
        2,
        lambda dy, v, *, width: (width, dy.shape[-1], _block_size(v.shape)),
        (1,),
        ("dx",),
        (0,),
    ),
)
dvalues_p = _primitive(
    "dvalues",
    "dvalues",
    _guarded(
        _lower_dvalues,
        2,
        lambda dy, x, *, block_size: (x.shape[-1], dy.shape[-1], block_size),
        (),
        ("dvalues",),
    ),
)
bwd_p = _primitive(
    "bwd",
    "bwd",
    _guarded(
        _lower_bwd,
        3,
        lambda dy, x, v: (x.shape[-1], dy.shape[-1], _block_size(v.shape)),
        (2,),
        ("dx", "dvalues"),
    ),
)
fwd_tangent_p = _primitive(
    "fwd_tangent",
    "fwd",
    _guarded(
        _lower_fwd_tangent,
        4,
        lambda x_dot, values_dot, x, values, *, width: _fwd_widths(x, values, width=width),
        (1, 3),
        ("y",),
        (0, 2),
    ),
)


def fwd(x, values, offsets, perm=None, *, out_features: int, impl: str, guard: bool = True):
    """``y[..., out] = x[..., perm] @ W.T`` (``x @ W.T`` without ``perm``).

    ``guard=False``: the caller guarantees ``offsets`` in range (e.g. they come from a ranking
    of the candidates) and ``perm`` a permutation, so the lowering skips the out-of-range rule's
    extra passes (also for every derivative of this call).
    """
    operands = same_varying(x, values, *_index(offsets, perm))
    return fwd_p.bind(*operands, width=out_features, impl=impl, guard=guard)


def dx(dy, values, offsets, perm=None, *, in_features: int, impl: str, guard: bool = True):
    """``dx[..., perm[j]] = (dy[..., out] @ W)[..., j]`` (the transpose closure)."""
    operands = same_varying(dy, values, *_index(offsets, perm))
    return dx_p.bind(*operands, width=in_features, impl=impl, guard=guard)


def dvalues(dy, x, offsets, perm=None, *, block_size: int, impl: str, guard: bool = True):
    """The (block) SDDMM of ``dy`` and ``x[..., perm]``: ``[K, D]`` (``block_size`` 1) or
    ``[K, L_b, b, b]``."""
    operands = same_varying(dy, x, *_index(offsets, perm))
    return dvalues_p.bind(*operands, block_size=block_size, impl=impl, guard=guard)


def _index(offsets, perm):
    """The trailing integer operands of a product: ``(offsets,)`` or ``(offsets, perm)``."""
    return (offsets,) if perm is None else (offsets, perm)


# --- JVP rules: every product is bilinear ---------------------------------------------------
#
# ``index`` is the tuple of trailing integer operands, ``(offsets,)`` or ``(offsets, perm)``: every
# rule passes it on unchanged and transposes to ``None`` for each of them.


def _zero(t) -> bool:
    return type(t) is ad.Zero


def _sum(terms, like):
    """Sum of ``terms``, or a symbolic zero tangent shaped like ``like``."""
    if not terms:
        return ad.Zero.from_primal_value(like)
    return functools.reduce(jnp.add, terms)


def _bilinear_tangent(product, a, b, a_dot, b_dot, like):
    """``product(a_dot, b) + product(a, b_dot)``, skipping symbolic-zero tangents."""
    terms = [product(a_dot, b)] if not _zero(a_dot) else []
    terms += [product(a, b_dot)] if not _zero(b_dot) else []
    return _sum(terms, like)


def _fwd_jvp(primals, tangents, *, width, impl, guard):
    x, values, *index = primals
    x_dot, values_dot, *_ = tangents
    y = fwd(x, values, *index, out_features=width, impl=impl, guard=guard)
    if _zero(x_dot) or _zero(values_dot):

        def product(a, v):
            return fwd(a, v, *index, out_features=width, impl=impl, guard=guard)

        return y, _bilinear_tangent(product, x, values, x_dot, values_dot, y)
    # One primitive linear in both tangents: its transpose is the fused backward pass.
    y_dot = fwd_tangent_p.bind(
        x_dot, values_dot, x, values, *index, width=width, impl=impl, guard=guard
    )
    return y, y_dot


def _fwd_tangent_jvp(primals, tangents, *, width, impl, guard):
    x_dot, values_dot, x, values, *index = primals
    t_x_dot, t_values_dot, t_x, t_values, *_ = tangents
    y = fwd_tangent_p.bind(
        x_dot, values_dot, x, values, *index, width=width, impl=impl, guard=guard
    )

    def product(a, v):
        return fwd(a, v, *index, out_features=width, impl=impl, guard=guard)

    # d(fwd(x_dot, values) + fwd(x, values_dot)), each term bilinear
    first = _bilinear_tangent(product, x_dot, values, t_x_dot, t_values, y)
    second = _bilinear_tangent(product, x, values_dot, t_x, t_values_dot, y)
    return y, _sum([t for t in (first, second) if not _zero(t)], y)


def _dx_tangent(dy, values, index, dy_dot, values_dot, like, *, width, impl, guard):
    def product(a, v):
        return dx(a, v, *index, in_features=width, impl=impl, guard=guard)

    return _bilinear_tangent(product, dy, values, dy_dot, values_dot, like)


def _dvalues_tangent(dy, x, index, dy_dot, x_dot, like, *, block_size, impl, guard):
    def product(a, b):
        return dvalues(a, b, *index, block_size=block_size, impl=impl, guard=guard)

    return _bilinear_tangent(product, dy, x, dy_dot, x_dot, like)


def _dx_jvp(primals, tangents, *, width, impl, guard):
    dy, values, *index = primals
    out = dx(dy, values, *index, in_features=width, impl=impl, guard=guard)
    return out, _dx_tangent(
        dy, values, index, *tangents[:2], out, width=width, impl=impl, guard=guard
    )


def _dvalues_jvp(primals, tangents, *, block_size, impl, guard):
    dy, x, *index = primals
    out = dvalues(dy, x, *index, block_size=block_size, impl=impl, guard=guard)
    return out, _dvalues_tangent(
        dy, x, index, *tangents[:2], out, block_size=block_size, impl=impl, guard=guard
    )


def _bwd_jvp(primals, tangents, *, impl, guard):
    dy, x, values, *index = primals
    dy_dot, x_dot, values_dot, *_ = tangents
    out_dx, out_dv = bwd_p.bind(dy, x, values, *index, impl=impl, guard=guard)
    width, block_size = x.shape[-1], _block_size(values.shape)
    t_dx = _dx_tangent(
        dy, values, index, dy_dot, values_dot, out_dx, width=width, impl=impl, guard=guard
    )
    t_dv = _dvalues_tangent(
        dy, x, index, dy_dot, x_dot, out_dv, block_size=block_size, impl=impl, guard=guard
    )
    return (out_dx, out_dv), (t_dx, t_dv)


ad.primitive_jvps[fwd_p] = _fwd_jvp
ad.primitive_jvps[fwd_tangent_p] = _fwd_tangent_jvp
ad.primitive_jvps[dx_p] = _dx_jvp
ad.primitive_jvps[dvalues_p] = _dvalues_jvp
ad.primitive_jvps[bwd_p] = _bwd_jvp


# --- transpose rules: the products close under transposition --------------------------------


def _linear_in(name, *operands):
    """Which of two operands is the linear (undefined) one; bilinear means exactly one."""
    a, b = (ad.is_undefined_primal(o) for o in operands)
    if a == b:
        raise ValueError(f"diag_matmul {name} is bilinear: transpose it in exactly one operand")
    return 0 if a else 1


def _fwd_transpose(ct, x, values, *index, width, impl, guard):
    ct = ad.instantiate_zeros(ct)
    none = (None,) * len(index)
    if _linear_in("fwd", x, values) == 0:
        in_features = _shape(x)[-1]
        return dx(ct, values, *index, in_features=in_features, impl=impl, guard=guard), None, *none
    block_size = _block_size(_shape(values))
    return None, dvalues(ct, x, *index, block_size=block_size, impl=impl, guard=guard), *none


def _fwd_tangent_transpose(ct, x_dot, values_dot, x, values, *index, width, impl, guard):
    del width
    ct = ad.instantiate_zeros(ct)
    none = (None, None) + (None,) * len(index)
    want_x, want_v = ad.is_undefined_primal(x_dot), ad.is_undefined_primal(values_dot)
    if want_x and want_v:
        ct_x, ct_v = bwd_p.bind(ct, x, values, *index, impl=impl, guard=guard)
        return ct_x, ct_v, *none
    ct_x = (
        dx(ct, values, *index, in_features=x.shape[-1], impl=impl, guard=guard) if want_x else None
    )
    block_size = _block_size(values.shape)
    ct_v = dvalues(ct, x, *index, block_size=block_size, impl=impl, guard=guard) if want_v else None
    return ct_x, ct_v, *none


def _dx_transpose(ct, dy, values, *index, width, impl, guard):
    del width
    ct = ad.instantiate_zeros(ct)
    none = (None,) * len(index)
    if _linear_in("dx", dy, values) == 0:
        out_features = _shape(dy)[-1]
        return (
            fwd(ct, values, *index, out_features=out_features, impl=impl, guard=guard),
            None,
            *none,
        )
    block_size = _block_size(_shape(values))
    return None, dvalues(dy, ct, *index, block_size=block_size, impl=impl, guard=guard), *none


def _dvalues_transpose(ct, dy, x, *index, block_size, impl, guard):
    del block_size
    ct = ad.instantiate_zeros(ct)
    none = (None,) * len(index)
    if _linear_in("dvalues", dy, x) == 0:
        out_features = _shape(dy)[-1]
        return fwd(x, ct, *index, out_features=out_features, impl=impl, guard=guard), None, *none
    in_features = _shape(x)[-1]
    return None, dx(dy, ct, *index, in_features=in_features, impl=impl, guard=guard), *none


ad.primitive_transposes[fwd_p] = _fwd_transpose
ad.primitive_transposes[fwd_tangent_p] = _fwd_tangent_transpose
ad.primitive_transposes[dx_p] = _dx_transpose
ad.primitive_transposes[dvalues_p] = _dvalues_transpose


# --- batching -------------------------------------------------------------------------------


def _batcher(prim: Primitive, row_operands: frozenset):
    """vmap rule: a mapped axis only on ``row_operands`` (``x``/``dy``-like) becomes more rows of
    one call; anything else (mapped values or offsets, and every sum over rows) is one call per
    mapped element (``lax.map``)."""

    def rule(args, dims, **params):
        mapped = [i for i, d in enumerate(dims) if d is not None]
        size = args[mapped[0]].shape[dims[mapped[0]]]
        if set(mapped) <= row_operands:
            full = list(args)
            for i in row_operands:
                a = args[i]
                full[i] = (
                    jnp.broadcast_to(a, (size,) + a.shape)
                    if dims[i] is None
                    else jnp.moveaxis(a, dims[i], 0)
                )
            return prim.bind(*full, **params), 0

        def one(elems):
            full = list(args)
            for i, e in zip(mapped, elems):
                full[i] = e
            return prim.bind(*full, **params)

        out = jax.lax.map(one, tuple(jnp.moveaxis(args[i], dims[i], 0) for i in mapped))
        return out, ((0,) * len(out) if prim.multiple_results else 0)

    return rule


batching.primitive_batchers[fwd_p] = _batcher(fwd_p, frozenset({0}))
batching.primitive_batchers[dx_p] = _batcher(dx_p, frozenset({0}))
batching.primitive_batchers[fwd_tangent_p] = _batcher(fwd_tangent_p, frozenset({0, 2}))
batching.primitive_batchers[dvalues_p] = _batcher(dvalues_p, frozenset())
batching.primitive_batchers[bwd_p] = _batcher(bwd_p, frozenset())
