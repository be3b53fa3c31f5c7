"""The CUDA targets of ``diag_matmul`` and their host emulation.

The CUDA handlers (``xla_ext/cuda``) take no scratch memory of their own: XLA allocates a ``u8[W]``
workspace as an extra result of each custom call, and
:func:`dynadiag_jax.launch_plan.workspace_bytes` gives ``W`` from the launch plan the handlers
compile (``xla_ext/cuda/launch_plan.h``); ``fwd``/``dx`` reject a workspace smaller than their
plan, ``dvalues`` splits its rows less (block ``fwd``/``dx`` take none).

The same kernels compiled for the host against a SIMT emulation (``xla_ext/emu``) are registered for
the CPU as ``dynadiag_emu_diag_matmul_v2_{fwd,dx,dvalues}`` and reached with
``diag_matmul(..., impl="cuda_emulated")``: slow, for tests only.
"""

from __future__ import annotations

from dynadiag_jax.launch_plan import KERNEL_DTYPES, workspace_bytes
from dynadiag_jax.ops.ffi import PlatformKernels

__all__ = ["EMULATED_PREFIX", "KERNELS"]

EMULATED_PREFIX = "dynadiag_emu_diag_matmul_v2"

# What the CUDA handlers and their emulation accept (ops/ffi.py adds the workspace result).
KERNELS = PlatformKernels(
    dtypes=KERNEL_DTYPES,
    workspace_bytes=workspace_bytes,
    block_diagonals=True,
)
