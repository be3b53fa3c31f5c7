"""Vision Transformer (Dosovitskiy et al. 2021) as trained by DeiT (Touvron et al. 2021).

Pre-norm blocks with a class token and learned position embeddings. The attention projections
(``qkv``, ``proj``) and the MLP layers (``fc1``, ``fc2``) are replaceable; the patch embedding and
the head stay dense. Layer paths look like ``"encoder/block_3/attn/qkv"``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from dynadiag_jax._checks import fraction, int_at_least
from dynadiag_jax.models.blocks import DropPath, FeedForward, SelfAttention, patch_tokens
from dynadiag_jax.models.routing import Dense, resolve_dense
from dynadiag_jax.models.variants import parse_variant

__all__ = ["ViT", "ViTSize", "SIZES", "DENSE", "SPARSE_LAYERS"]


class ViTSize(NamedTuple):
    width: int
    depth: int
    mlp_dim: int
    num_heads: int


SIZES = {
    "mu": ViTSize(32, 2, 64, 2),  # tests and smoke runs only
    # CPU-sized runs (train/results.py): widths are multiples of 16 with 10 block candidates.
    "mini": ViTSize(160, 2, 320, 4),
    "Ti": ViTSize(192, 12, 768, 3),
    "S": ViTSize(384, 12, 1536, 6),
    "B": ViTSize(768, 12, 3072, 12),
    "L": ViTSize(1024, 24, 4096, 16),
}

DENSE = functools.partial(
    nn.Dense, kernel_init=nn.initializers.xavier_uniform(), bias_init=nn.initializers.normal(1e-6)
)
SPARSE_LAYERS = (r".*/attn/(qkv|proj)", r".*/mlp/(fc1|fc2)")


class EncoderBlock(nn.Module):
    """``x + drop_path(attn(ln(x)))``, then ``x + drop_path(mlp(ln(x)))``."""

    size: ViTSize
    dense: Dense
    drop_path: float
    dropout: float
    dtype: Any

    @nn.compact
    def __call__(self, x, *, deterministic: bool):
        y = SelfAttention(
            self.size.num_heads, self.dense, dropout=self.dropout, dtype=self.dtype, name="attn"
        )(nn.LayerNorm(dtype=self.dtype, name="ln_1")(x), deterministic=deterministic)
        x = x + DropPath(self.drop_path)(y, deterministic=deterministic)
        y = FeedForward(
            self.size.mlp_dim, self.dense, dropout=self.dropout, dtype=self.dtype, name="mlp"
        )(nn.LayerNorm(dtype=self.dtype, name="ln_2")(x), deterministic=deterministic)
        return x + DropPath(self.drop_path)(y, deterministic=deterministic)


class Encoder(nn.Module):
    size: ViTSize
    dense: Dense
    drop_path: float
    dropout: float
    dtype: Any

    @nn.compact
    def __call__(self, x, *, deterministic: bool):
        # Stochastic depth grows linearly with depth (DeiT).
        rates = np.linspace(0.0, self.drop_path, self.size.depth)
        for i in range(self.size.depth):
            x = EncoderBlock(
                self.size, self.dense, float(rates[i]), self.dropout, self.dtype, name=f"block_{i}"
            )(x, deterministic=deterministic)
        return nn.LayerNorm(dtype=self.dtype, name="ln_f")(x)


class ViT(nn.Module):
    """ViT classifier.

    Attributes:
      num_classes: width of the (dense, zero-initialised) head.
      variant: ``"<size>/<patch>"``, size in :data:`SIZES`: ``"Ti/16"``, ``"S/16"``, ``"B/16"``.
      dense: constructor for the replaceable layers, or a :class:`~dynadiag_jax.models.ByPath`.
      drop_path: stochastic-depth rate of the last block.
      dropout: dropout after attention and MLP projections.
      dtype: computation dtype (``None``: float32 parameters and inputs decide).
    """

    num_classes: int
    variant: str = "B/16"
    dense: Dense = DENSE
    drop_path: float = 0.0
    dropout: float = 0.0
    dtype: Any = None

    def __post_init__(self):
        int_at_least(self.num_classes, "ViT: num_classes", 1)
        fraction(self.drop_path, "ViT: drop_path")
        fraction(self.dropout, "ViT: dropout")
        parse_variant(self.variant, SIZES, model="ViT")
        super().__post_init__()

    @nn.compact
    def __call__(self, images, *, train: bool = False):
        """``images[B, H, W, C]`` (H, W divisible by the patch) -> logits ``[B, num_classes]``."""
        size, patch = parse_variant(self.variant, SIZES, model="ViT")
        dense = resolve_dense(self.dense, DENSE, self.path)
        x = patch_tokens(
            images,
            patch,
            size.width,
            name="patch_embed",
            model=f"ViT {self.variant}",
            dtype=self.dtype,
        )
        b, n, c = x.shape
        cls = self.param("cls_token", nn.initializers.zeros, (1, 1, c))
        x = jnp.concatenate([jnp.broadcast_to(cls, (b, 1, c)).astype(x.dtype), x], axis=1)
        pos = self.param("pos_embed", nn.initializers.normal(0.02), (1, n + 1, c))
        x = nn.Dropout(self.dropout)(x + pos.astype(x.dtype), deterministic=not train)
        x = Encoder(size, dense, self.drop_path, self.dropout, self.dtype, name="encoder")(
            x, deterministic=not train
        )
        return nn.Dense(
            self.num_classes, kernel_init=nn.initializers.zeros, dtype=self.dtype, name="head"
        )(x[:, 0]).astype(jnp.float32)
