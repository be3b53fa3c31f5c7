"""What the CUDA kernels will do with a set of diagonals: tiles, fill, paths and predicted time.

Element diagonals (``values[K, D]``): the forward and ``dx`` kernels cut ``W`` into 16x16 tiles.
Per 16-wide block of outputs a plan kernel lists (once per call, on the device) the diagonals and
the touched tiles of the block and picks its path: the touched tiles packed once and multiplied on
tensor cores, or the diagonals walked on CUDA cores - tensor cores when
``tiles * TILE_COST <= entries * ENTRY_COST`` (a ratio taken from the cost model); float32 always
walks the diagonals. Block diagonals (``values[K, L_b, b, b]``) are full ``b x b`` tiles: tensor
cores for bfloat16/float16 with ``b`` a multiple of 16, CUDA cores otherwise.

:func:`kernel_stats` applies the kernels' rules on the host, so a learned set of offsets shows the
efficiency to expect; with ``rows`` it also gives the cost model's predicted time of every GPU path
(:mod:`dynadiag_jax.gpu_cost`, docs/gpu_cost_model.md). An input permutation does not change
any of this: the layer gathers ``x[..., perm]`` before the product, so the kernels see the same
offsets. :func:`model_paths` says, for every sparse
layer of a model, which path ``impl="auto"`` takes on a platform and (on a GPU) the model's
predicted speed against the dense layer; :func:`describe_paths` words it for a log.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from dynadiag_jax import gpu_cost, launch_plan
from dynadiag_jax._checks import int_at_least
from dynadiag_jax.layout import KERNEL_BLOCK_SIZES, concrete_offsets, geometry
from dynadiag_jax.ops import auto

__all__ = [
    "KernelStats",
    "LayerPath",
    "ProductStats",
    "describe_paths",
    "kernel_stats",
    "model_paths",
]


class ProductStats(NamedTuple):
    """Structure of one product (forward ``x @ W.T`` or ``dx = dy @ W``) as the kernel sees it."""

    output_blocks: int  # output blocks (16 wide; b wide for block diagonals)
    tiles: int  # touched tiles summed over output blocks (16x16, or the K * L_b blocks)
    fill: float  # non-zeros / (tiles * tile area): how full the touched tiles are
    tensor_core_blocks: int  # output blocks on the tensor-core path
    diagonal_blocks: int  # output blocks on the CUDA-core path (the diagonal walk for elements)


class KernelStats(NamedTuple):
    """Result of :func:`kernel_stats`."""

    nonzeros: int  # K * D, or K * L_b * b * b (repeated offsets counted once per repeat)
    density: float  # distinct non-zero entries / (in * out)
    tiles_total: int  # tiles of W: 16x16 (partial edge tiles included), or b x b blocks
    tiles_touched: int  # tiles holding at least one entry
    forward: ProductStats
    dx: ProductStats
    path: str  # "tensor_core", "diagonal", "mixed" (element) or "tensor_core", "cuda_core" (block)
    block_size: int = 1
    cost: gpu_cost.Prediction | None = None  # with rows: predicted seconds of each GPU path


def kernel_stats(
    offsets,
    in_features: int,
    out_features: int,
    *,
    dtype=jnp.bfloat16,
    block_size: int = 1,
    rows: int | None = None,
    device="H100",
) -> KernelStats:
    """Tile structure, kernel paths and (with ``rows``) predicted GPU times for these diagonals.

    Args:
      offsets: ``[K]`` concrete integer diagonal ids in ``[0, P)`` (``[0, P_b)`` for blocks; numpy
        or a non-traced array, e.g. the ``offsets`` of a frozen layer).
      in_features, out_features: the layer shape.
      dtype: input dtype of the product, one the CUDA kernels take: float16/bfloat16 can use
        tensor cores, float32 cannot.
      block_size: 1 for element diagonals ``values[K, D]``, ``b`` for ``values[K, L_b, b, b]``.
      rows: rows of ``x`` (product of its leading dimensions), an int >= 1; None skips the cost
        model.
      device: a name in ``gpu_cost.DEVICES`` or a ``gpu_cost.DeviceSpec``.

    Returns:
      :class:`KernelStats` for the forward and ``dx`` products.

    Raises:
      TypeError: for traced or non-integer offsets, a ``dtype`` the kernels do not take, a
        non-integer ``rows``. ValueError: for offsets out of range, ``rows < 1``, a
        ``block_size`` no kernel runs, an unknown ``device``.
    """
    if block_size != 1 and block_size not in KERNEL_BLOCK_SIZES:
        raise ValueError(
            f"block_size must be 1 (element diagonals) or one of the kernels' block sizes "
            f"{KERNEL_BLOCK_SIZES}, got {block_size!r}"
        )
    gpu_cost.device_spec(device)  # checked with or without rows
    geo = geometry(in_features, out_features, block_size)
    dtype = launch_plan.kernel_dtype(dtype, "kernel_stats")
    if rows is not None:
        rows = int_at_least(rows, "rows", 1)
    off = concrete_offsets(offsets, geo, "kernel_stats")
    stats = _block_stats(off, geo, dtype) if geo.blocked else _element_stats(off, geo, dtype)
    if rows is None:
        return stats
    cost = gpu_cost.predict_layer(rows, geo, dtype, offsets=off, device=device)
    return stats._replace(cost=cost)


def _element_stats(off, geo, dtype) -> KernelStats:
    in_f, out_f = geo.in_features, geo.out_features
    const = launch_plan.constants()

    def product(kind):
        st = gpu_cost.element_structure(off, kind, geo, dtype)
        tiles = int(st.n_tiles.sum())
        return ProductStats(
            output_blocks=len(st.path),
            tiles=tiles,
            fill=float(st.entries.sum()) / (tiles * const.TILE * const.TILE) if tiles else 0.0,
            tensor_core_blocks=int((st.path == const.PATH_TENSOR_CORE).sum()),
            diagonal_blocks=int((st.path == const.PATH_DIAGONAL).sum()),
        )

    fwd, dx = product("fwd"), product("dx")
    tc = fwd.tensor_core_blocks + dx.tensor_core_blocks
    diag = fwd.diagonal_blocks + dx.diagonal_blocks
    layout = launch_plan.product_layout("fwd", in_f, out_f)
    return KernelStats(
        nonzeros=int(off.size) * geo.length,
        density=len(np.unique(off)) * geo.length / (in_f * out_f),
        tiles_total=layout.n_mb * layout.n_tb,
        tiles_touched=fwd.tiles,  # every touched tile belongs to one output block
        forward=fwd,
        dx=dx,
        path="tensor_core" if diag == 0 else "diagonal" if tc == 0 else "mixed",
    )


def _block_stats(off, geo, dtype) -> KernelStats:
    b = geo.block_size
    distinct = len(np.unique(off))
    plan = launch_plan.block_product_plan("fwd", geo.in_features, geo.out_features, b, dtype)
    tensor_cores = plan.tensor_cores

    def product(output_blocks):
        return ProductStats(
            output_blocks=output_blocks,
            tiles=int(off.size) * geo.length,
            fill=1.0 if off.size else 0.0,
            tensor_core_blocks=output_blocks if tensor_cores else 0,
            diagonal_blocks=0 if tensor_cores else output_blocks,
        )

    return KernelStats(
        nonzeros=int(off.size) * geo.length * b * b,
        density=distinct * geo.length * b * b / (geo.in_features * geo.out_features),
        tiles_total=geo.nb_in * geo.nb_out,
        tiles_touched=distinct * geo.length,
        forward=product(geo.nb_out),
        dx=product(geo.nb_in),
        path="tensor_core" if tensor_cores else "cuda_core",
        block_size=b,
    )


# --- which path each layer of a model takes ----------------------------------------------------


class LayerPath(NamedTuple):
    """What ``impl="auto"`` runs for one sparse layer (:func:`model_paths`)."""

    path: str  # module path, "/"-joined
    platform: str
    in_features: int
    out_features: int
    block_size: int
    num_diagonals: int  # K
    impl: str  # "ffi", "jax" or "dense"
    reason: str
    # GPU only: the cost model's (forward, step) speed of the kernels and of the path taken,
    # each against the dense layer (XLA's dot on a dense W parameter)
    kernel_speedup: tuple | None = None
    path_speedup: tuple | None = None
    # the layer's input permutation ("random", "learned") or None: a gather of x before the
    # product (a dense in x in product while a learned one is soft), not part of the kernels
    permutation: str | None = None
    # a learned permutation's relaxation while searching ("sinkhorn", "blocks"), else None
    permutation_relaxation: str | None = None
    # how many layers the path holds: more than 1 for a layer stacked by nn.scan / nn.vmap
    copies: int = 1


LOWERING_PLATFORMS = ("cpu", "cuda", "rocm", "tpu")


def model_paths(model, *init_args, platform: str | None = None) -> list[LayerPath]:
    """For every ``DiagonalDense`` of a linen ``model``: the path ``impl="auto"`` takes there.

    The model is initialised abstractly, ``jax.eval_shape(model.init, *init_args)`` (no memory,
    no compile), and each layer's call is seen on the way (``nn.intercept_methods``): its widths,
    rows, computation dtype and K are those of that call, so the input in ``init_args`` should be
    the one a device sees. Search-phase and frozen layers alike; sorted by module path.

    Args:
      model: a linen module holding ``dd.nn.DiagonalDense`` layers.
      init_args: the arguments of ``model.init`` (an RNG key and an example input).
      platform: lowering platform (``"cpu"``, ``"cuda"``, ``"rocm"`` or ``"tpu"``); default the
        default backend's.
    """
    from dynadiag_jax.nn import DiagonalDense  # noqa: PLC0415 - the layers import the ops

    if not isinstance(model, nn.Module):  # an NNX one has no init to trace
        raise TypeError(
            f"model_paths takes a linen module (it traces model.init), got "
            f"{type(model).__name__}; for an NNX layer pass its offsets to dd.kernel_stats"
        )
    if platform is not None and platform not in LOWERING_PLATFORMS:
        hint = " (JAX's backend 'gpu' lowers as 'cuda' or 'rocm')" if platform == "gpu" else ""
        raise ValueError(
            f"platform must be one of {', '.join(LOWERING_PLATFORMS)}, got {platform!r}{hint}"
        )
    calls = {}  # module path -> (y shape, y dtype, input width, K, b, permutation, relaxation)

    def record(next_fun, args, kwargs, context):
        y = next_fun(*args, **kwargs)
        layer = context.module
        if isinstance(layer, DiagonalDense) and context.method_name == "__call__":
            width = args[0].shape[-1]
            facts = (y.shape, y.dtype, width, layer.budget(width), layer.block_size)
            relaxation = layer.permutation_relaxation if layer.permutation == "learned" else None
            calls["/".join(layer.path)] = (*facts, layer.permutation, relaxation)
        return y

    with nn.intercept_methods(record):
        # a fresh trace: nothing cached
        variables = jax.eval_shape(lambda *a: model.init(*a), *init_args)
    params = traverse_util.flatten_dict(variables.get("params", {}), sep="/")
    platform = auto.current_platform() if platform is None else platform
    out = []
    for name, (y_shape, dtype, in_f, k, b, permutation, relaxation) in sorted(calls.items()):
        path = _layer_path(name, in_f, y_shape, dtype, k, b, platform)
        # values [P or K, D] or [P or K, L_b, b, b] per layer; leading axes stack layers
        values = params.get(f"{name}/values")
        stacked = values.shape[: values.ndim - (4 if b > 1 else 2)] if values is not None else ()
        out.append(
            path._replace(
                permutation=permutation,
                permutation_relaxation=relaxation,
                copies=math.prod(stacked),
            )
        )
    return out


def _layer_path(name, in_f, y_shape, dtype, k, b, platform) -> LayerPath:
    """What ``"auto"`` runs for one layer call ``[rows, in_f] -> y_shape``."""
    out_f = y_shape[-1]
    geo = geometry(in_f, out_f, b)
    rows = int(np.prod(y_shape[:-1], dtype=np.int64))
    d = auto.decide_for_lowering(platform, rows=rows, geo=geo, dtype=dtype, num_diagonals=k)
    kernel = taken = None
    if platform == "cuda":
        pred = d.prediction or gpu_cost.predict_layer(rows, geo, dtype, k, device=auto.gpu_spec())
        kernel = pred.speedup("kernel", "dense_layer")
        taken = pred.speedup("kernel" if d.impl == "ffi" else "dense", "dense_layer")
    return LayerPath(name, platform, in_f, out_f, b, k, d.impl, d.reason, kernel, taken)


_WORDS = {
    "jax": "the pure-JAX path",
    "dense": "W built + XLA's dot (dense speed)",
}


def describe_paths(paths: list[LayerPath]) -> list[str]:
    """One line per distinct layer shape: its count, the path and the predicted speed."""
    groups: dict[tuple, list[str]] = {}
    for p in paths:
        key = p._replace(path="")
        groups.setdefault(key, []).append(p.path)
    lines = []
    for p, names in groups.items():
        b = f", blocks of {p.block_size}" if p.block_size > 1 else ", element diagonals"
        if p.permutation is not None:
            b += f", {p.permutation} input permutation"
        if p.permutation_relaxation == "blocks":
            b += " (blocks relaxation)"
        line = (
            f"{len(names) * p.copies} x {p.in_features}->{p.out_features}{b}, "
            f"K={p.num_diagonals} "
            f"({names[0]}{', ...' if len(names) > 1 else ''}) on {p.platform}: "
            + _WORDS.get(p.impl, "the C++ kernels" if p.platform == "cpu" else "the CUDA kernels")
        )
        if p.kernel_speedup is not None:
            line += (
                f"; predicted vs a dense layer: this path {p.path_speedup[0]:.2f}x forward, "
                f"{p.path_speedup[1]:.2f}x step; the CUDA kernels would be "
                f"{p.kernel_speedup[0]:.2f}x / {p.kernel_speedup[1]:.2f}x"
            )
        lines.append(line)
    return lines
