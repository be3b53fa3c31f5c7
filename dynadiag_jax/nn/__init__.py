"""Flax layers: ``DiagonalDense``, the helper that sets every layer's gate hyper-parameter,
``sparsify`` (diagonal layers in any linen model by module path, without editing it), ``lora_fa``
(LoRA-FA adapters on its linear layers, likewise), and the functional core that layers of any
framework wrap (:mod:`dynadiag_jax.nn.functional`)."""

from dynadiag_jax.nn import functional
from dynadiag_jax.nn.diagonal_dense import DiagonalDense
from dynadiag_jax.nn.functional import PRODUCT_NAME
from dynadiag_jax.nn.gate_state import alpha_from_values, set_gate
from dynadiag_jax.nn.lora import LoRAFA, lora_fa
from dynadiag_jax.nn.sparsify import LinearLayer, linear_layer_paths, sparsify

__all__ = [
    "DiagonalDense",
    "LinearLayer",
    "LoRAFA",
    "PRODUCT_NAME",
    "alpha_from_values",
    "functional",
    "linear_layer_paths",
    "lora_fa",
    "set_gate",
    "sparsify",
]
