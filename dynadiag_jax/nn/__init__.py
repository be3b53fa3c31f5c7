"""Flax layers: ``DiagonalDense``, the helper that sets every layer's gate hyper-parameter, and the
functional core that layers of any framework wrap (:mod:`dynadiag_jax.nn.functional`)."""

from dynadiag_jax.nn import functional
from dynadiag_jax.nn.diagonal_dense import DiagonalDense
from dynadiag_jax.nn.gate_state import alpha_from_values, set_gate

__all__ = ["DiagonalDense", "alpha_from_values", "functional", "set_gate"]
