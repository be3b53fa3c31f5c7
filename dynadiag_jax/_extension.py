"""Load the compiled kernels, register their FFI targets and the ``impl`` backends they provide.

Runs once at ``import dynadiag_jax``. A missing module is not an error: the package works without
the extension (``impl="auto"`` then uses the pure-JAX path).
"""

from __future__ import annotations

import importlib.metadata
import pathlib
import re
import warnings

import jax
import jax.numpy as jnp

from dynadiag_jax.ops import cuda, ranking
from dynadiag_jax.ops.ffi import PlatformKernels, make_ffi_backend
from dynadiag_jax.ops.products import register_backend

__all__ = ["custom_call_targets", "has_cpu_kernels", "has_cuda_kernels"]

# The ABI version is part of every target name (docs/kernel_abi.md, "Versions"): a change to any
# target's operands, results, dtypes or meaning registers the new handlers under v3, never v2.
TARGET_PREFIX = "dynadiag_diag_matmul_v2"
# The CPU's targets with an input permutation: the v2 operands and perm[in] s32 after offsets.
PERMUTED_PREFIX = "dynadiag_diag_matmul_permuted_v1"

try:
    from dynadiag_jax import _cpu_ext
except ImportError:
    _cpu_ext = None
try:  # built when nvcc was found at install time
    from dynadiag_jax import _cuda_ext
except ImportError:
    _cuda_ext = None
try:  # the CUDA kernels compiled for the host (tests)
    from dynadiag_jax import _emu_ext
except ImportError:
    _emu_ext = None


def _shadowed_build() -> pathlib.Path | None:
    """The directory of an installed dynadiag_jax with compiled kernels that this copy hides."""
    try:
        files = importlib.metadata.distribution("dynadiag-jax").files or ()
    except importlib.metadata.PackageNotFoundError:
        return None
    here = pathlib.Path(__file__).resolve().parent
    for f in files:
        if f.name.startswith("_cpu_ext."):
            path = pathlib.Path(f.locate()).resolve()
            if path.exists() and path.parent != here:
                return path.parent
    return None


if _cpu_ext is None and (installed := _shadowed_build()) is not None:
    # Typically a script or `python -c` run from the repository root: the source checkout comes
    # first on sys.path, and everything would silently run on the pure-JAX path.
    warnings.warn(
        f"dynadiag_jax is imported from {pathlib.Path(__file__).resolve().parent}, which has no "
        f"compiled kernels, while the installed copy in {installed} has them; impl='auto' will "
        "run the pure-JAX path. Run from outside the source checkout, or build in place with "
        "`bash scripts/dev_build.sh`.",
        RuntimeWarning,
        stacklevel=2,
    )


def _register(module, platform: str) -> None:
    for name, capsule in module.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform=platform)


def running_ffi_api() -> tuple[int, int] | None:
    """``(major, minor)`` of the XLA FFI API of the running jaxlib, from the header it ships
    (``jax.ffi.include_dir()``); None where that cannot be read."""
    try:
        header = pathlib.Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api" / "c_api.h"
        text = header.read_text()
    except (OSError, AttributeError):
        return None
    found = [re.search(rf"^#define XLA_FFI_API_{part} (\d+)", text, re.M) for part in _API_PARTS]
    return None if None in found else tuple(int(m.group(1)) for m in found)


_API_PARTS = ("MAJOR", "MINOR")


def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return "of unknown version"


def _refused(module, what: str) -> str | None:
    """Why this jaxlib or its CUDA plugin would refuse ``module``'s handlers, or None.

    A jaxlib older than the FFI headers the handlers were compiled against refuses them when its
    backend starts, which fails every JAX operation in the process, not only ours.
    """
    built, running = getattr(module, "ffi_api", None), running_ffi_api()
    if built is not None and running is not None:
        if built[0] != running[0] or built[1] > running[1]:
            return (
                f"{what} were compiled against XLA FFI API {built[0]}.{built[1]}, newer than "
                f"this jaxlib's {running[0]}.{running[1]} (jaxlib {_jaxlib_version()})"
            )
    cuda = getattr(module, "cuda_runtime_version", None)
    if cuda is not None:
        majors = {major for _, major in jax_cuda_plugins()}
        if majors and cuda // 1000 not in majors:
            return (
                f"{what} link the CUDA {cuda // 1000} runtime, but JAX's CUDA plugin is for "
                f"CUDA {', '.join(map(str, sorted(majors)))}"
            )
    return None


def jax_cuda_plugins() -> list[tuple[str, int]]:
    """``[(distribution, CUDA major)]`` of the installed JAX CUDA plugins (jax-cuda12-plugin,
    jax-cuda13-pjrt, ...)."""
    found = set()
    for dist in importlib.metadata.distributions():
        if m := _PLUGIN.fullmatch(dist.metadata["Name"] or ""):
            found.add((dist.metadata["Name"], int(m.group(1))))
    return sorted(found)


_PLUGIN = re.compile(r"jax[-_.]cuda(\d+)[-_.](plugin|pjrt)", re.IGNORECASE)


def _usable(module, what: str):
    """``module``, or None with a warning when registering it would break JAX."""
    if module is None or (reason := _refused(module, what)) is None:
        return module
    warnings.warn(
        f"dynadiag_jax: {reason}, so they are not registered and impl='auto' runs the pure-JAX "
        "path. Reinstall dynadiag-jax in this environment (docs: README, Install) or install "
        "the jax it was built for.",
        RuntimeWarning,
        stacklevel=2,
    )
    return None


_cpu_ext = _usable(_cpu_ext, "the C++ CPU kernels")
_cuda_ext = _usable(_cuda_ext, "the CUDA kernels")
_emu_ext = _usable(_emu_ext, "the emulated CUDA kernels")


def custom_call_targets() -> tuple[str, ...]:
    """Every custom-call target name this package registers (or would, with all kernels built)."""
    kinds = {
        TARGET_PREFIX: ("fwd", "dx", "dvalues", "bwd"),
        PERMUTED_PREFIX: ("fwd", "dx", "dvalues", "bwd"),
        # the emulation runs dx and dvalues separately: it has no fused backward
        cuda.EMULATED_PREFIX: ("fwd", "dx", "dvalues"),
    }
    products = tuple(f"{prefix}_{kind}" for prefix, names in kinds.items() for kind in names)
    return (*products, ranking.TARGET)


def has_cpu_kernels() -> bool:
    """True when the C++ CPU kernels are built and registered."""
    return _cpu_ext is not None


def has_cuda_kernels() -> bool:
    """True when the CUDA kernels are built and registered (they run when the backend is a GPU)."""
    return _cuda_ext is not None


_native: dict[str, PlatformKernels] = {}
if _cpu_ext is not None:
    _register(_cpu_ext, "cpu")
    ranking.register_cpu_target()
    _native["cpu"] = PlatformKernels(
        dtypes=(jnp.float32, jnp.bfloat16),
        fused_backward=True,
        block_diagonals=True,
        widened_dtypes=(jnp.float16,),  # no float16 arithmetic in the kernels; docs/cpu_kernels.md
        permuted_prefix=PERMUTED_PREFIX,
    )
if _cuda_ext is not None:
    _register(_cuda_ext, "CUDA")
    _native["cuda"] = cuda.KERNELS
if _native:
    register_backend("ffi", make_ffi_backend(TARGET_PREFIX, _native))
if _emu_ext is not None:
    _register(_emu_ext, "cpu")
    register_backend("cuda_emulated", make_ffi_backend(cuda.EMULATED_PREFIX, {"cpu": cuda.KERNELS}))
