"""XLA FFI binding of the diagonal kernels (docs/kernel_abi.md).

Each of the three targets (``fwd``, ``dx``, ``dvalues``) is a JAX primitive with

* a lowering per platform to ``stablehlo.custom_call`` (plus, where the platform's kernels need
  one, a ``u8[W]`` workspace result that XLA allocates and the lowering drops again);
* a partitioner: ``jit`` over a row-sharded ``x`` with replicated ``values`` runs the kernel on
  each shard with no gather; ``dvalues`` all-reduces the per-shard partial sums;
* a ``vmap`` rule: mapping over ``x``/``dy`` alone folds the mapped axis into the rows (one kernel
  call); mapping over ``values``/``offsets`` runs one call per element (``lax.map``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import ShapedArray
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from dynadiag_jax.ops.diag_matmul import Backend

__all__ = ["PlatformKernels", "make_ffi_backend", "platform_of_default_backend"]

# workspace_bytes(kind, rows, in_features, out_features, k) -> bytes, or None for no workspace.
WorkspaceFn = Callable[[str, int, int, int, int], int]


class PlatformKernels(NamedTuple):
    """What one platform provides for a set of targets."""

    dtypes: tuple  # floating dtypes its handlers accept
    workspace_bytes: WorkspaceFn | None = None


def platform_of_default_backend() -> str:
    """Lowering platform of the default backend: ``"cpu"``, ``"cuda"``, ``"rocm"`` or ``"tpu"``."""
    backend = jax.default_backend()
    if backend != "gpu":
        return backend
    return "rocm" if "rocm" in jax.devices()[0].client.platform_version.lower() else "cuda"


# --- partitioning ---------------------------------------------------------------------------
#
# XLA replicates a custom call it has no partitioner for, and its built-in "batch partitionable"
# partitioner needs leading batch dimensions on *every* operand (``values[K, D]`` has none). So
# each op lowers through ``custom_partitioning``: the rows of ``x``/``dy`` keep their sharding,
# ``values``/``offsets`` are replicated, and ``dvalues`` sums the per-shard partial results with a
# ``psum``. This sits in the lowering (after ``vmap`` has been applied), because
# ``custom_partitioning`` itself has no batching rule.


def _row_axes(sharding, rank: int):
    """Mesh axes that shard the row dimensions (all but the last) of a ``rank``-d operand."""
    spec = tuple(sharding.spec) + (None,) * (rank - len(tuple(sharding.spec)))
    return spec[: rank - 1]


def _partitioned(kind: str, raw: Primitive, rank: int, params: dict):
    """``raw.bind`` in ``custom_partitioning``, for operands with ``rank - 1`` row dimensions."""

    def call(a, b, offsets):
        return raw.bind(a, b, offsets, **params)

    def shardings(mesh, arg_shapes):
        rows = _row_axes(arg_shapes[0].sharding, rank)
        row_sharded = NamedSharding(mesh, PartitionSpec(*rows, None))
        replicated = NamedSharding(mesh, PartitionSpec())
        if kind == "dvalues":  # dy and x share the row sharding chosen for dy
            return rows, replicated, (row_sharded, row_sharded, replicated)
        return rows, row_sharded, (row_sharded, replicated, replicated)

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        return shardings(mesh, arg_shapes)[1]

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        rows, out_sharding, arg_shardings = shardings(mesh, arg_shapes)
        axes = tuple(
            a for r in rows if r is not None for a in (r if isinstance(r, tuple) else (r,))
        )
        if kind == "dvalues" and axes:

            def lower(a, b, offsets):
                return jax.lax.psum(call(a, b, offsets), axes)
        else:
            lower = call
        return mesh, lower, out_sharding, arg_shardings

    rows = " ".join(f"r{i}" for i in range(rank - 1))
    if kind == "dvalues":
        rule = f"{rows} o, {rows} i, k -> k d"
        factors = dict(
            reduction_factors=tuple(rows.split()), need_replication_factors=("o", "i", "k", "d")
        )
    else:
        rule = f"{rows} i, k d, k -> {rows} o"
        factors = dict(need_replication_factors=("i", "k", "d", "o"))
    wrapped = custom_partitioning(call)
    wrapped.def_partition(
        partition, infer_sharding_from_operands=infer, sharding_rule=rule, **factors
    )
    return wrapped


def _require_devices_during_lowering(prim: Primitive) -> None:
    """Ask jit to lower ``prim`` with a concrete device assignment, as custom_partitioning needs.

    JAX has no public switch for this; its own wrappers around custom_partitioning (the cuDNN
    attention primitives) use the same set. Without it the op still runs, but replicated.
    tests/test_sharding.py fails if partitioning is lost.
    """
    from jax._src import dispatch  # noqa: PLC0415 - private, see the docstring

    dispatch.prim_requires_devices_during_lowering.add(prim)


# --- primitives -----------------------------------------------------------------------------


def _abstract(kind):
    def abstract(a, b, offsets, *, width=None):
        if kind == "dvalues":  # a = dy [..., out], b = x [..., in]
            return ShapedArray((offsets.shape[0], min(a.shape[-1], b.shape[-1])), b.dtype)
        return ShapedArray(a.shape[:-1] + (width,), a.dtype)

    return abstract


def _custom_call_lowering(target: str, kind: str, kernels: PlatformKernels):
    def rule(ctx, *operands, width=None):
        del width
        avals_out = list(ctx.avals_out)
        if kernels.workspace_bytes is not None:
            a, b, offsets = ctx.avals_in
            if kind == "dvalues":
                in_f, out_f = b.shape[-1], a.shape[-1]
            elif kind == "fwd":
                in_f, out_f = a.shape[-1], avals_out[0].shape[-1]
            else:
                in_f, out_f = avals_out[0].shape[-1], a.shape[-1]
            rows = int(np.prod(a.shape[:-1], dtype=np.int64))
            nbytes = kernels.workspace_bytes(kind, rows, in_f, out_f, offsets.shape[0])
            avals_out.append(ShapedArray((max(int(nbytes), 1),), jnp.uint8))
        results = jax.ffi.ffi_lowering(target)(ctx.replace(avals_out=avals_out), *operands)
        return results[: len(ctx.avals_out)]

    return rule


def _make_primitive(prefix: str, kind: str, platforms: Mapping[str, PlatformKernels]) -> Primitive:
    target = f"{prefix}_{kind}"
    raw = Primitive(f"{target}_call")  # the custom call itself, on per-shard shapes
    raw.def_abstract_eval(_abstract(kind))
    for platform, kernels in platforms.items():
        mlir.register_lowering(raw, _custom_call_lowering(target, kind, kernels), platform=platform)

    prim = Primitive(target)
    prim.def_abstract_eval(_abstract(kind))
    prim.def_impl(lambda *args, **params: jax.jit(functools.partial(prim.bind, **params))(*args))

    def lowering(ctx, *operands, **params):
        wrapped = _partitioned(kind, raw, len(ctx.avals_in[0].shape), params)
        return mlir.lower_fun(wrapped, multiple_results=False)(ctx, *operands)

    mlir.register_lowering(prim, lowering)
    _require_devices_during_lowering(prim)

    def batch_rule(args, dims, **params):
        a, b, offsets = args
        da, db, doff = dims
        # Mapping over x/dy alone adds rows; anything else (or dvalues, whose sums are per
        # element) needs one call per mapped element.
        if kind != "dvalues" and db is None and doff is None:
            return prim.bind(jnp.moveaxis(a, da, 0), b, offsets, **params), 0
        mapped = [i for i, d in enumerate(dims) if d is not None]

        def one(elems):
            full = list(args)
            for i, e in zip(mapped, elems):
                full[i] = e
            return prim.bind(*full, **params)

        elems = tuple(jnp.moveaxis(args[i], dims[i], 0) for i in mapped)
        return jax.lax.map(one, elems), 0

    batching.primitive_batchers[prim] = batch_rule
    return prim


def make_ffi_backend(prefix: str, platforms: Mapping[str, PlatformKernels]) -> Backend:
    """A :class:`Backend` whose products call the FFI targets ``{prefix}_{fwd,dx,dvalues}``.

    Args:
      prefix: target name prefix, e.g. ``"dynadiag_diag_matmul"``.
      platforms: lowering platform (``"cpu"``, ``"cuda"``) -> what its handlers accept. The targets
        must already be registered with ``jax.ffi.register_ffi_target`` for those platforms.
    """
    fwd_p, dx_p, dvalues_p = (
        _make_primitive(prefix, k, platforms) for k in ("fwd", "dx", "dvalues")
    )

    def dtypes():
        kernels = platforms.get(platform_of_default_backend())
        return kernels.dtypes if kernels else ()

    return Backend(
        fwd=lambda x2, values, offsets, *, out_features: fwd_p.bind(
            x2, values, offsets, width=out_features
        ),
        dx=lambda dy2, values, offsets, *, in_features: dx_p.bind(
            dy2, values, offsets, width=in_features
        ),
        dvalues=lambda dy2, x2, offsets: dvalues_p.bind(dy2, x2, offsets),
        dtypes=dtypes,
    )
