"""Flax layers: ``DiagonalDense`` and the helper that sets every layer's gate hyper-parameter."""

from dynadiag_jax.nn.diagonal_dense import DiagonalDense
from dynadiag_jax.nn.gate_state import set_gate

__all__ = ["DiagonalDense", "set_gate"]
