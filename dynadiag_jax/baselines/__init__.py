"""Baselines for DynaDiag: unstructured RigL, SET, MEST and a fixed mask as optax wrappers, sparsity
distributions, and unstructured sparse layers (masked dense, BCOO) for speed comparisons."""

from dynadiag_jax.baselines.distributions import erk, include_paths, path_str, uniform
from dynadiag_jax.baselines.dst import (
    cosine_decay,
    drop_and_grow,
    periodic,
    rigl,
    set_,
    static_mask,
)
from dynadiag_jax.baselines.masks import num_active, random_mask, top_n_mask
from dynadiag_jax.baselines.mest import mest, prune_and_grow
from dynadiag_jax.baselines.sparse_state import (
    SparseState,
    active_counts,
    apply_masks,
    budgets,
    reset_moments,
    sparse_wrapper,
)
from dynadiag_jax.baselines.unstructured_layers import BCOODense, MaskedDense

__all__ = [
    "BCOODense",
    "MaskedDense",
    "SparseState",
    "active_counts",
    "apply_masks",
    "budgets",
    "cosine_decay",
    "drop_and_grow",
    "erk",
    "include_paths",
    "mest",
    "num_active",
    "path_str",
    "periodic",
    "prune_and_grow",
    "random_mask",
    "reset_moments",
    "rigl",
    "set_",
    "sparse_wrapper",
    "static_mask",
    "top_n_mask",
    "uniform",
]
