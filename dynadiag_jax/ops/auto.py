"""``impl="auto"``: which implementation ``diag_matmul`` runs, decided from static information.

Only static facts count - the platform, the shapes (rows, in, out), the dtype, K and the block size
b; the offsets are traced (they change during the search), so the cost model assumes them scattered
(the pessimistic case for the kernels, docs/gpu_cost_model.md). The decision is taken in the
lowering, once per platform lowered for (``ops/products.py``), so a program exported or lowered for
CUDA on a CPU host gets CUDA's choice, and one lowered for ``("cpu", "cuda")`` holds both.

* **cpu**: the C++ kernels where they are built and take the dtype and block size, else ``"jax"``;
  except a dense product of element diagonals (at least :data:`CPU_DENSE_DENSITY` of the ``P``
  candidates, e.g. a search step before its gate narrows) on at least :data:`CPU_DENSE_ROWS`
  rows, where XLA's dot on ``W`` built is faster (docs/cpu_kernels.md, "impl=auto on CPU", has
  the measurements). From 80% sparsity XLA's dense dot was slower than one of the other two at
  every measured shape, and the kernels were faster than the pure-JAX path at every batch size
  on a quiet host.
* **cuda**: the CUDA kernels only where the cost model (:mod:`dynadiag_jax.gpu_cost`, for the GPU
  found, H100 figures when none is visible) predicts them at least :data:`MIN_SPEEDUP` times
  faster than building ``W`` and calling XLA's dot, in the forward product and in the whole step
  (forward + backward); otherwise ``"dense"``. The model charges the instructions the compiled
  kernels issue, their occupancy and the measured time of their pipeline stages, and puts each
  profiled H100 block kernel within 30% of its measured time (docs/gpu_cost_model.md); at 90% on
  ViT-B's layers it predicts them below dense for a training step, so an H100 runs ``"dense"``.
* **any other platform** (TPU, ROCm: no kernels): ``"dense"``.

A symbolic row count (``jax.export`` with a symbolic batch, ``rows=None`` here) takes the choice
the rule above makes at both :data:`SYMBOLIC_ROWS` ends, 1 row and 2**20 rows, where the two
agree, else ``"dense"``: so the program never runs a path the rule predicts slower than dense at
either end. On CPU that keeps the kernels (or ``"jax"``) except for element diagonals at
:data:`CPU_DENSE_DENSITY` and more, which take ``"dense"``. On CUDA it is ``"dense"``: the lowering
sizes each kernel's workspace from the launch plan of a concrete row count.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dynadiag_jax import gpu_cost
from dynadiag_jax.layout import KERNEL_BLOCK_SIZES, DiagGeometry, geometry

__all__ = [
    "CPU_DENSE_DENSITY",
    "CPU_DENSE_ROWS",
    "MIN_SPEEDUP",
    "SYMBOLIC_ROWS",
    "Decision",
    "current_platform",
    "decide",
    "decide_for_gpu",
    "decide_for_lowering",
    "gpu_spec",
    "kernel_available",
]

# The predicted speed-up over dense the kernels need, forward and step, before auto takes them: a
# margin for what the model does not see: with its stage term it puts each profiled H100 block
# kernel within 30% of its measured time (docs/gpu_cost_model.md).
MIN_SPEEDUP = 1.25

# A product of element diagonals that keeps at least this share of the P candidates, on at least
# this many rows, runs XLA's dot on W built (forward and backward): measured with both paths
# interleaved (bench/density.py; 160-3072 wide layers, 128-2048 rows), the dot was faster in 34
# of the 36 (shape, product) cells from 75% density at 1024 rows and more (the kernel 1.03x and
# 1.22x faster in the other two, the same layer's forward and dx favouring the dot), while at
# 128-512 rows the kernels stayed faster in a third of the cells up to 100%.
# Block diagonals keep their kernels: faster at 75% density in 17 of 18 cells, 8 of 18 at 100%.
CPU_DENSE_DENSITY = 0.75
CPU_DENSE_ROWS = 1024

# The row counts at which the rule is asked for a symbolic row count: one served example, and more
# rows than any measured shape.
SYMBOLIC_ROWS = (1, 2**20)


class Decision(NamedTuple):
    """The implementation ``impl="auto"`` picks, and why."""

    impl: str  # "ffi", "dense" or "jax"
    reason: str
    prediction: gpu_cost.Prediction | None = None


def current_platform() -> str:
    """Lowering platform of the default backend (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``)."""
    from dynadiag_jax.ops import ffi  # noqa: PLC0415 - ffi imports diag_matmul, which imports us

    return ffi.platform_of_default_backend()


@functools.cache
def _gpu_kind() -> str | None:
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return None
    return device.device_kind if device.platform == "gpu" else None


def gpu_spec() -> gpu_cost.DeviceSpec:
    """The spec of the first GPU (by device kind); H100 when it is unknown or none is visible.

    Looked up on every call (the device kind is cached), so a device registered with
    ``gpu_cost.register_device`` counts from the next decision on."""
    default = gpu_cost.DEVICES[gpu_cost.DEFAULT_DEVICE]
    kind = _gpu_kind()
    return default if kind is None else gpu_cost.device_for_kind(kind) or default


@functools.lru_cache(maxsize=1024)
def _prediction(rows, geo, dtype_name, k, spec):
    return gpu_cost.predict_layer(rows, geo, jnp.dtype(dtype_name), k, device=spec)


def decide(
    platform: str,
    *,
    rows: int,
    in_features: int,
    out_features: int,
    dtype,
    num_diagonals: int,
    block_size: int = 1,
    kernel_available: bool,
    spec: gpu_cost.DeviceSpec | None = None,
) -> Decision:
    """The implementation for these static facts.

    Args:
      platform: lowering platform (see :func:`current_platform`).
      rows, in_features, out_features, dtype, num_diagonals, block_size: the product; ``rows``
        None for a symbolic row count (the rule in the module docstring).
      kernel_available: whether ``impl="ffi"`` runs this dtype and block size on ``platform``.
      spec: GPU to predict for (default :func:`gpu_spec`).

    The forward and the backward products of a layer get the same decision.
    """
    geo = geometry(in_features, out_features, block_size)
    return _decide(platform, rows, geo, dtype, num_diagonals, kernel_available, spec)


def _decide(
    platform: str,
    rows: int | None,
    geo: DiagGeometry,
    dtype,
    num_diagonals: int,
    kernel_available: bool,
    spec: gpu_cost.DeviceSpec | None,
) -> Decision:
    """:func:`decide` for a product whose geometry the caller holds."""
    if rows is None:
        return _decide_symbolic(platform, geo, dtype, num_diagonals, kernel_available, spec)
    if platform == "cpu":
        if not kernel_available:
            return Decision("jax", "no C++ kernel for this dtype or block size")
        density = num_diagonals / geo.num_candidates
        if not geo.blocked and rows >= CPU_DENSE_ROWS and density >= CPU_DENSE_DENSITY:
            return Decision("dense", f"element diagonals at {density:.0%} density, {rows} rows")
        return Decision("ffi", "C++ kernels")
    if platform != "cuda":
        return Decision("dense", f"no kernels on {platform}: XLA's dot on W built on the device")
    if not kernel_available:
        return Decision("dense", "no CUDA kernel for this dtype or block size")
    if rows == 0:
        return Decision("dense", "no rows: nothing to run")
    spec = gpu_spec() if spec is None else spec
    pred = _prediction(rows, geo, jnp.dtype(dtype).name, num_diagonals, spec)
    fwd, step = pred.speedup("kernel", "dense")
    why = f"{spec.name} model: kernel/dense speed-up {fwd:.2f}x forward, {step:.2f}x step"
    if not geo.blocked:
        # Scattered element diagonals run on CUDA cores at a twelfth of the tensor-core rate:
        # no training shape can beat cuBLAS, and the model's small-call wins (reading K/P of W)
        # rest on latency terms no GPU has measured yet.
        return Decision("dense", f"element diagonals stay dense on GPU; {why}", pred)
    if fwd >= MIN_SPEEDUP and step >= MIN_SPEEDUP:
        return Decision("ffi", why, pred)
    return Decision("dense", why, pred)


def _decide_symbolic(platform, geo, dtype, num_diagonals, kernel_available, spec) -> Decision:
    """:func:`decide` for a symbolic row count (the rule in the module docstring)."""
    if platform == "cuda" and kernel_available:
        return Decision(
            "dense",
            "symbolic row count: the CUDA kernels' workspaces are sized for a concrete row count",
        )
    small, large = (
        _decide(platform, rows, geo, dtype, num_diagonals, kernel_available, spec)
        for rows in SYMBOLIC_ROWS
    )
    if small.impl == large.impl:
        return Decision(large.impl, f"symbolic row count, as at 1 and 2**20 rows: {large.reason}")
    return Decision(
        "dense",
        f"symbolic row count: {small.impl!r} at 1 row ({small.reason}), {large.impl!r} at 2**20 "
        f"rows ({large.reason})",
    )


def decide_for_gpu(rows, in_features, out_features, dtype, num_diagonals, block_size=1, spec=None):
    """:func:`decide` on ``"cuda"`` with the kernels available (benchmarks and GPU tests)."""
    return decide(
        "cuda",
        rows=rows,
        in_features=in_features,
        out_features=out_features,
        dtype=dtype,
        num_diagonals=num_diagonals,
        block_size=block_size,
        kernel_available=True,
        spec=spec,
    )


def kernel_available(platform: str, dtype, block_size: int = 1) -> bool:
    """Whether ``impl="ffi"`` runs this dtype and block size when lowering for ``platform``."""
    from dynadiag_jax import _extension  # noqa: PLC0415 - the extension imports the ops

    kernels = _extension._native.get(platform)  # the platforms the "ffi" backend was built with
    if kernels is None or jnp.dtype(dtype) not in (*kernels.dtypes, *kernels.widened_dtypes):
        return False
    return block_size == 1 or (kernels.block_diagonals and block_size in KERNEL_BLOCK_SIZES)


def decide_for_lowering(
    platform: str, *, rows: int | None, geo, dtype, num_diagonals: int
) -> Decision:
    """:func:`decide` for ``platform`` with the kernels this installation has for it.

    ``rows``: None for a symbolic row count. ``geo``: the product's
    :class:`dynadiag_jax.layout.DiagGeometry`, computed once by the caller and handed on to the
    cost model.
    """
    available = kernel_available(platform, dtype, geo.block_size)
    return _decide(platform, rows, geo, dtype, num_diagonals, available, None)
