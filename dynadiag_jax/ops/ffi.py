"""XLA FFI binding of the diagonal kernels (docs/kernel_abi.md): a :class:`Backend` for
:mod:`dynadiag_jax.ops.products`.

Each target (``fwd``, ``dx``, ``dvalues`` and, where a platform has it, the fused ``bwd``) is a
raw call primitive with

* a lowering per platform to ``stablehlo.custom_call`` (plus, where the platform's kernels need
  one, a ``u8[W]`` workspace result that XLA allocates and the lowering drops again);
* a partitioner: ``jit`` over a row-sharded ``x`` with replicated ``values`` runs the kernel on
  each shard with no gather; ``dvalues`` all-reduces the per-shard partial sums.

A call with an input permutation (``perm=``) takes ``perm[in]`` as one more operand after
``offsets``. It lowers to the platform's permuted targets (``PlatformKernels.permuted_prefix``),
whose kernels read ``x`` and write ``dx`` through ``perm``; a platform without them (CUDA, and the
CUDA emulation) gets the separate gather of ``x`` (and gather of ``dx`` by the inverse) around
its plain targets.

The backend's functions are traced inside the lowering of the product primitives, after every
transformation (autodiff, ``vmap``) has been applied to those.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.core import ShapedArray
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec

from dynadiag_jax.layout import KERNEL_BLOCK_SIZES
from dynadiag_jax.ops import reference
from dynadiag_jax.ops.products import (
    Backend,
    abstract_eval,
    backend,
    lowering_for_export,
    row_count,
)

__all__ = ["PlatformKernels", "make_ffi_backend", "platform_of_default_backend"]

# workspace_bytes(kind, rows, in_features, out_features, k, dtype) -> bytes; for block diagonals
# the lowering adds the keyword block_size=b (b >= 2).
WorkspaceFn = Callable[..., int]


class PlatformKernels(NamedTuple):
    """What one platform provides for a set of targets."""

    dtypes: tuple  # floating dtypes its handlers accept
    workspace_bytes: WorkspaceFn | None = None
    fused_backward: bool = False  # provides {prefix}_bwd: (dy, x, values, offsets) -> (dx, dvalues)
    # Its handlers take rank-4 block-diagonal values[K, L_b, b, b] for b in KERNEL_BLOCK_SIZES
    # (docs/kernel_abi.md); without them, impl="auto" picks another path for block diagonals
    # ("jax" on CPU, "dense" on GPU), and a lowering for this platform from another one
    # (jax.export, lowering_platforms) runs the "jax" path.
    block_diagonals: bool = False
    # Dtypes its lowering widens to float32 around the call and rounds back (once) after it: the
    # kernels compute in float32 anyway, and the converts cost one pass over each operand.
    widened_dtypes: tuple = ()
    # Prefix of its targets that take an input permutation (``{prefix}_{fwd,dx,dvalues,bwd}``, one
    # operand perm[in] s32 after offsets); None: a permuted call gathers around the plain ones.
    permuted_prefix: str | None = None


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


class _Kind(NamedTuple):
    """Operand and result layout of one product: which arrays carry rows, which sums need a psum."""

    row_operands: tuple  # per operand: True if it has the row dimensions, else replicated
    summed_results: tuple  # per result: True if it sums over rows (psum across row shards)
    rule: str  # Shardy rule with "R" standing for the row factors
    reduction: bool  # whether the row factors are a reduction in the rule


# "k d" stands for the values' dimensions: [K, D], or [K, L_b, b, b] as "k d u v". An input
# permutation is one more replicated operand, "i" (see _partitioned).
_KINDS = {
    "fwd": _Kind((True, False, False), (False,), "R i, k d, k -> R o", False),
    "dx": _Kind((True, False, False), (False,), "R o, k d, k -> R i", False),
    "dvalues": _Kind((True, True, False), (True,), "R o, R i, k -> k d", True),
    "bwd": _Kind((True, True, False, False), (False, True), "R o, R i, k d, k -> R i, k d", False),
}


def _partitioned(kind: str, raw: Primitive, rank: int, blocked: bool, permuted: bool, params: dict):
    """``raw.bind`` in ``custom_partitioning``, for operands with ``rank - 1`` row dimensions.

    ``blocked``: the values are block diagonals ``[K, L_b, b, b]``; ``permuted``: the last operand
    is ``perm[in]`` (replicated).
    """
    spec = _KINDS[kind]
    if permuted:
        spec = spec._replace(
            row_operands=spec.row_operands + (False,), rule=spec.rule.replace(" ->", ", i ->")
        )
    multiple = len(spec.summed_results) > 1

    def call(*args):
        out = raw.bind(*args, **params)
        return list(out) if multiple else out

    def shardings(mesh, arg_shapes):
        rows = _row_axes(arg_shapes[0].sharding, rank)
        row_sharded = NamedSharding(mesh, PartitionSpec(*rows, None))
        replicated = NamedSharding(mesh, PartitionSpec())
        args = tuple(row_sharded if r else replicated for r in spec.row_operands)
        outs = tuple(replicated if s else row_sharded for s in spec.summed_results)
        return rows, (list(outs) if multiple else outs[0]), args

    def infer(mesh, arg_shapes, result_shape):
        del result_shape
        return shardings(mesh, arg_shapes)[1]

    def partition(mesh, arg_shapes, result_shape):
        del result_shape
        rows, out_shardings, arg_shardings = shardings(mesh, arg_shapes)
        axes = tuple(
            a for r in rows if r is not None for a in (r if isinstance(r, tuple) else (r,))
        )
        if not axes or not any(spec.summed_results):
            return mesh, call, out_shardings, arg_shardings

        def lower(*args):
            outs = call(*args)
            outs = outs if multiple else (outs,)
            outs = [jax.lax.psum(o, axes) if s else o for o, s in zip(outs, spec.summed_results)]
            return outs if multiple else outs[0]

        return mesh, lower, out_shardings, arg_shardings

    rows = " ".join(f"r{i}" for i in range(rank - 1))
    rule = spec.rule.replace("R", rows)
    if blocked:
        rule = rule.replace("k d", "k d u v")
    # Shardy wants special factors in order of first appearance.
    order = list(dict.fromkeys(rule.replace(",", " ").replace("->", " ").split()))
    factors = {"need_replication_factors": tuple(f for f in order if f in {*"oikduv"})}
    if spec.reduction and rows:
        factors["reduction_factors"] = tuple(rows.split())
    wrapped = custom_partitioning(call)
    wrapped.def_partition(
        partition, infer_sharding_from_operands=infer, sharding_rule=rule, **factors
    )
    return wrapped


# --- primitives -----------------------------------------------------------------------------


def _features(kind, avals_in, avals_out):
    """``(in_features, out_features)`` of the product a call computes."""
    a, b = avals_in[0], avals_in[1]
    if kind in ("dvalues", "bwd"):
        return b.shape[-1], a.shape[-1]
    if kind == "fwd":
        return a.shape[-1], avals_out[0].shape[-1]
    return avals_out[0].shape[-1], a.shape[-1]


def _values_aval(kind, avals_in, avals_out):
    """The aval of ``values`` (an operand) or ``dvalues`` (the result) of a call."""
    return avals_out[0] if kind == "dvalues" else avals_in[2 if kind == "bwd" else 1]


# Operands of each raw call without a permutation (one more with it).
_NUM_OPERANDS = {"fwd": 3, "dx": 3, "dvalues": 3, "bwd": 4}


def _split(kind: str, args):
    """``(operands without perm, perm or None)`` of a raw call."""
    n = _NUM_OPERANDS[kind]
    return args[:n], (args[n] if len(args) > n else None)


def _reference_call(kind: str, *args, width=None, block_size=1):
    """Product ``kind`` on the pure-JAX path (for a platform without block-diagonal kernels)."""
    ref = backend("jax")
    args, perm = _split(kind, args)
    if kind == "fwd":
        return ref.fwd(*args, out_features=width, perm=perm)
    if kind == "dx":
        return ref.dx(*args, in_features=width, perm=perm)
    if kind == "dvalues":
        return ref.dvalues(*args, block_size=block_size, perm=perm)
    dy, x, values, offsets = args
    dx = ref.dx(dy, values, offsets, in_features=x.shape[-1], perm=perm)
    return dx, ref.dvalues(dy, x, offsets, block_size=values.shape[-1], perm=perm)


def _gathered_call(raw: Primitive, kind: str, *args, **params):
    """``raw`` with an input permutation on a platform without permuted targets: ``x`` gathered
    through ``perm`` before the plain target, ``dx`` scattered back after it (as a gather)."""
    args, perm = _split(kind, args)
    args = list(args)
    if kind == "fwd":
        args[0] = reference.gather_columns(args[0], perm)
    elif kind in ("dvalues", "bwd"):
        args[1] = reference.gather_columns(args[1], perm)
    out = raw.bind(*args, **params)
    if kind == "dx":
        return reference.scatter_columns(out, perm)
    if kind == "bwd":
        return [reference.scatter_columns(out[0], perm), out[1]]
    return out


def _widened_call(raw: Primitive, kind: str, *args, **params):
    """``raw`` on the floating operands widened to float32, its results rounded back."""
    dtype = args[0].dtype
    wide = [a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating) else a for a in args]
    out = raw.bind(*wide, **params)
    return [o.astype(dtype) for o in out] if kind == "bwd" else out.astype(dtype)


def _custom_call_lowering(prefix: str, kind: str, kernels: PlatformKernels, raw: Primitive):
    def rule(ctx, *operands, **params):
        permuted = len(operands) > _NUM_OPERANDS[kind]
        if len(_values_aval(kind, ctx.avals_in, ctx.avals_out).shape) == 4 and not (
            kernels.block_diagonals
        ):
            # Lowering for a platform whose kernels lack block diagonals (e.g. exporting for
            # CUDA from a CPU host): that platform runs the pure-JAX path.
            fallback = functools.partial(_reference_call, kind, **params)
            return mlir.lower_fun(fallback, multiple_results=kind == "bwd")(ctx, *operands)
        if permuted and kernels.permuted_prefix is None:
            gathered = functools.partial(_gathered_call, raw, kind, **params)
            return mlir.lower_fun(gathered, multiple_results=kind == "bwd")(ctx, *operands)
        if ctx.avals_in[0].dtype in kernels.widened_dtypes:
            widened = functools.partial(_widened_call, raw, kind, **params)
            return mlir.lower_fun(widened, multiple_results=kind == "bwd")(ctx, *operands)
        del params  # the handlers read every size from the operand and result shapes
        avals_out = list(ctx.avals_out)
        target = f"{kernels.permuted_prefix if permuted else prefix}_{kind}"
        if kernels.workspace_bytes is not None:
            in_f, out_f = _features(kind, ctx.avals_in, avals_out)
            a, offsets = ctx.avals_in[0], ctx.avals_in[_NUM_OPERANDS[kind] - 1]
            rows = row_count(a)
            if rows is None:
                raise ValueError(
                    f"the CUDA kernels' {target} needs a concrete number of rows: its workspace "
                    "is sized in the lowering from the launch plan of the row count, and its "
                    f"first operand has the symbolic shape {a.shape}; impl='auto' takes 'dense' "
                    "on CUDA for a symbolic batch, and impl='jax' and impl='dense' take any"
                )
            values = _values_aval(kind, ctx.avals_in, avals_out)
            blocks = {"block_size": values.shape[-1]} if len(values.shape) == 4 else {}
            nbytes = kernels.workspace_bytes(
                kind, rows, in_f, out_f, offsets.shape[0], a.dtype, **blocks
            )
            avals_out.append(ShapedArray((max(int(nbytes), 1),), jnp.uint8))
        results = jax.ffi.ffi_lowering(target)(ctx.replace(avals_out=avals_out), *operands)
        return results[: len(ctx.avals_out)]

    return rule


def _no_kernels_lowering(platforms):
    """The lowering rule for every platform without kernels: a clear refusal instead of MLIR's
    "translation rule not found" (e.g. ``dd.export(..., platforms=("tpu",))`` of
    ``impl="ffi"``)."""

    def rule(ctx, *operands, **params):
        platform = ", ".join(ctx.module_context.platforms)
        raise NotImplementedError(
            f"impl='ffi' has kernels for {', '.join(sorted(platforms))}, not for {platform}: "
            "use impl='auto' (the best path of each platform) or impl='jax' (any platform)"
        )

    return rule


def _new_primitive(name: str, kind: str) -> Primitive:
    prim = Primitive(name)
    prim.multiple_results = kind == "bwd"
    prim.def_abstract_eval(abstract_eval(kind))
    return prim


def make_ffi_backend(prefix: str, platforms: Mapping[str, PlatformKernels]) -> Backend:
    """A :class:`Backend` whose products call the FFI targets ``{prefix}_{fwd,dx,dvalues}`` (with
    an input permutation: the platform's ``permuted_prefix`` targets, or a gather around these).

    The backward pass is one primitive: it lowers to the fused ``{prefix}_bwd`` target on platforms
    whose kernels provide it (``PlatformKernels.fused_backward``), else to the two separate calls.

    Args:
      prefix: target name prefix, e.g. ``"dynadiag_diag_matmul_v2"``.
      platforms: lowering platform (``"cpu"``, ``"cuda"``) -> what its handlers accept. The targets
        must already be registered with ``jax.ffi.register_ffi_target`` for those platforms.
    """
    raws = {}
    refuse = _no_kernels_lowering(platforms)
    for kind in ("fwd", "dx", "dvalues"):
        raws[kind] = _new_primitive(f"{prefix}_{kind}_call", kind)
        mlir.register_lowering(raws[kind], refuse)
        for platform, kernels in platforms.items():
            rule = _custom_call_lowering(prefix, kind, kernels, raws[kind])
            mlir.register_lowering(raws[kind], rule, platform=platform)

    def separate_backward(dy, x, values, offsets, *perm):
        dx = raws["dx"].bind(dy, values, offsets, *perm, width=x.shape[-1])
        block_size = values.shape[-1] if values.ndim == 4 else 1
        return dx, raws["dvalues"].bind(dy, x, offsets, *perm, block_size=block_size)

    raws["bwd"] = _new_primitive(f"{prefix}_bwd_call", "bwd")
    mlir.register_lowering(raws["bwd"], refuse)
    for platform, kernels in platforms.items():
        if kernels.fused_backward:
            rule = _custom_call_lowering(prefix, "bwd", kernels, raws["bwd"])
        else:
            rule = mlir.lower_fun(separate_backward, multiple_results=True)
        mlir.register_lowering(raws["bwd"], rule, platform=platform)

    def call(kind, *args, **params):
        """``raws[kind]`` partitioned over the rows of its first operand.

        Not for jax.export: a serialized program cannot hold custom_partitioning's callback, so
        there XLA's partitioner runs the kernel replicated on sharded inputs (correct, gathers).
        """
        if lowering_for_export.get():
            out = raws[kind].bind(*args, **params)
            return tuple(out) if kind == "bwd" else out
        values_rank = args[2 if kind == "bwd" else 1].ndim if kind != "dvalues" else 0
        blocked = values_rank == 4 or params.get("block_size", 1) > 1
        permuted = len(args) > _NUM_OPERANDS[kind]
        return _partitioned(kind, raws[kind], args[0].ndim, blocked, permuted, params)(*args)

    def dtypes():
        kernels = platforms.get(platform_of_default_backend())
        return (*kernels.dtypes, *kernels.widened_dtypes) if kernels else ()

    def block_size_ok(block_size):
        if block_size == 1:
            return True
        kernels = platforms.get(platform_of_default_backend())
        return bool(kernels and kernels.block_diagonals and block_size in KERNEL_BLOCK_SIZES)

    def index(offsets, perm):
        return (offsets,) if perm is None else (offsets, perm)

    return Backend(
        fwd=lambda x, values, offsets, *, out_features, perm=None: call(
            "fwd", x, values, *index(offsets, perm), width=out_features
        ),
        dx=lambda dy, values, offsets, *, in_features, perm=None: call(
            "dx", dy, values, *index(offsets, perm), width=in_features
        ),
        dvalues=lambda dy, x, offsets, *, block_size, perm=None: call(
            "dvalues", dy, x, *index(offsets, perm), block_size=block_size
        ),
        dtypes=dtypes,
        bwd=lambda dy, x, values, offsets, perm=None: tuple(
            call("bwd", dy, x, values, *index(offsets, perm))
        ),
        block_size_ok=block_size_ok,
    )
