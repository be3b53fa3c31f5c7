"""dynadiag_jax: DynaDiag diagonally sparse layers for JAX/Flax (Tyagi et al., ICML 2025).

The training-side subpackages (``baselines``, ``data``, ``models``, ``training``) and the Flax NNX
layer (``nnx``) load on first use: ``dd.models.ViT`` works after ``import dynadiag_jax as dd``
without making that import pay for them. ``training`` and ``data`` need the ``train`` extra
(``pip install "dynadiag-jax[train]"``); the rest needs only jax, flax, optax and numpy.
"""

import importlib as _importlib

__version__ = "0.1.0"  # the package's version (pyproject.toml reads it from here)

from dynadiag_jax import nn, optim, schedules
from dynadiag_jax._extension import has_cpu_kernels, has_cuda_kernels
from dynadiag_jax.export import export
from dynadiag_jax.freeze import freeze, freeze_opt_state, freeze_tree, select_diagonals
from dynadiag_jax.from_dense import from_dense
from dynadiag_jax.kernel_stats import kernel_stats
from dynadiag_jax.layout import num_diagonals
from dynadiag_jax.ops import available_impls, diag_matmul, diag_to_dense
from dynadiag_jax.refit import refit
from dynadiag_jax.topk import capped_simplex_projection, softmax_topk, sparse_soft_topk

__all__ = [
    "available_impls",
    "capped_simplex_projection",
    "diag_matmul",
    "diag_to_dense",
    "export",
    "freeze",
    "freeze_opt_state",
    "freeze_tree",
    "from_dense",
    "has_cpu_kernels",
    "has_cuda_kernels",
    "kernel_stats",
    "nn",
    "num_diagonals",
    "optim",
    "refit",
    "schedules",
    "select_diagonals",
    "softmax_topk",
    "sparse_soft_topk",
]

# Subpackages imported by `__getattr__` on first access (listed by `dir`, not in `__all__`, so a
# star import does not load them either).
_LAZY_SUBPACKAGES = ("baselines", "data", "models", "nnx", "training")


def __getattr__(name: str):
    if name in _LAZY_SUBPACKAGES:
        return _importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_SUBPACKAGES})
