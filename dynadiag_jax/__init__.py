"""dynadiag_jax: DynaDiag diagonally sparse layers for JAX/Flax (Tyagi et al., ICML 2025)."""

from dynadiag_jax import nn, optim, schedules
from dynadiag_jax._extension import has_cpu_kernels, has_cuda_kernels
from dynadiag_jax.freeze import freeze, freeze_opt_state, freeze_tree, select_diagonals
from dynadiag_jax.kernel_stats import kernel_stats
from dynadiag_jax.layout import num_diagonals
from dynadiag_jax.ops import available_impls, diag_matmul, diag_to_dense
from dynadiag_jax.topk import capped_simplex_projection, softmax_topk, sparse_soft_topk

__all__ = [
    "available_impls",
    "capped_simplex_projection",
    "diag_matmul",
    "diag_to_dense",
    "freeze",
    "freeze_opt_state",
    "freeze_tree",
    "has_cpu_kernels",
    "has_cuda_kernels",
    "kernel_stats",
    "nn",
    "num_diagonals",
    "optim",
    "schedules",
    "select_diagonals",
    "softmax_topk",
    "sparse_soft_topk",
]
