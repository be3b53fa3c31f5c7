"""Diagonal-sparse products and their references."""

from dynadiag_jax.ops.diag_matmul import available_impls, diag_matmul, diag_to_dense

__all__ = ["available_impls", "diag_matmul", "diag_to_dense"]
