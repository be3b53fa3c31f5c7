"""A multi-layer perceptron classifier (the authors' MNIST model: 784 -> 256 -> 256 -> 10)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from dynadiag_jax._checks import int_at_least
from dynadiag_jax.models.routing import Dense, linear, resolve_dense

__all__ = ["MLP", "DENSE", "SPARSE_LAYERS"]

DENSE = nn.Dense
# The hidden layers are diagonal-sparse; the head (named "head") stays dense.
SPARSE_LAYERS = (r"hidden_\d+",)


class MLP(nn.Module):
    """``head(relu(hidden_{n-1}(... relu(hidden_0(flatten(x))))))``.

    Attributes:
      num_classes: output width of the dense head.
      hidden: widths of the replaceable hidden layers, named ``hidden_0``, ``hidden_1``, ...
      dense: the hidden layers' constructor or a :class:`~dynadiag_jax.models.ByPath`.
      dtype: computation dtype (``None``: as ``nn.Dense``, the input's promoted with the
        parameters', float32 for float32 parameters).
    """

    num_classes: int
    hidden: Sequence[int] = (256, 256)
    dense: Dense = DENSE
    dtype: Any = None

    def __post_init__(self):
        int_at_least(self.num_classes, "MLP: num_classes", 1)
        if isinstance(self.hidden, str) or not self.hidden:
            raise ValueError(
                f"hidden must be a non-empty sequence of positive widths, got {self.hidden!r}"
            )
        for i, width in enumerate(self.hidden):
            int_at_least(width, f"MLP: hidden[{i}]", 1)
        super().__post_init__()

    @nn.compact
    def __call__(self, x, *, train: bool = False):
        """``x[B, ...]`` (flattened) -> logits ``[B, num_classes]``. ``train`` is unused."""
        del train
        if x.ndim < 2:
            raise ValueError(
                f"MLP expects x[B, ...] with a batch axis first (at least 2 dimensions), got "
                f"shape {x.shape}"
            )
        dense = resolve_dense(self.dense, DENSE, self.path)
        x = x.reshape(x.shape[0], -1)
        if self.dtype is not None:
            x = x.astype(self.dtype)
        for i, width in enumerate(self.hidden):
            x = nn.relu(linear(self, dense, int(width), name=f"hidden_{i}", dtype=self.dtype)(x))
        return nn.Dense(self.num_classes, name="head", dtype=self.dtype)(x).astype(jnp.float32)
