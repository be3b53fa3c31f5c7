"""dynadiag_jax: DynaDiag diagonally sparse layers for JAX/Flax (Tyagi et al., ICML 2025)."""

from dynadiag_jax._extension import has_cpu_kernels
from dynadiag_jax.layout import num_diagonals
from dynadiag_jax.ops import available_impls, diag_matmul, diag_to_dense

__all__ = [
    "available_impls",
    "diag_matmul",
    "diag_to_dense",
    "has_cpu_kernels",
    "num_diagonals",
]
