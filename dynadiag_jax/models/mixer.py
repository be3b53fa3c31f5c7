"""MLP-Mixer (Tolstikhin et al. 2021).

Each block mixes tokens (an MLP over the patch axis) and then channels (an MLP over the feature
axis). Both MLPs are replaceable (``block_i/token_mixing/fc{1,2}``,
``block_i/channel_mixing/fc{1,2}``);
the patch embedding (``stem``) and the head stay dense.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax.numpy as jnp
import numpy as np

from dynadiag_jax._checks import fraction, int_at_least
from dynadiag_jax.models.blocks import DropPath, FeedForward, patch_tokens
from dynadiag_jax.models.routing import Dense, resolve_dense
from dynadiag_jax.models.variants import parse_variant

__all__ = ["MlpMixer", "MixerSize", "SIZES", "DENSE", "SPARSE_LAYERS"]


class MixerSize(NamedTuple):
    hidden: int
    depth: int
    tokens_mlp_dim: int
    channels_mlp_dim: int


SIZES = {
    "mu": MixerSize(32, 2, 16, 64),  # tests, smoke runs and results.py's Mixer suite (mu/7)
    "C": MixerSize(256, 8, 128, 1024),  # CIFAR scale: use "C/4" on 32x32 images (64 tokens)
    "S": MixerSize(512, 8, 256, 2048),
    "B": MixerSize(768, 12, 384, 3072),
}

DENSE = functools.partial(
    nn.Dense, kernel_init=nn.initializers.xavier_uniform(), bias_init=nn.initializers.normal(1e-6)
)
SPARSE_LAYERS = (r".*/(token_mixing|channel_mixing)/(fc1|fc2)",)


class MixerBlock(nn.Module):
    size: MixerSize
    dense: Dense
    drop_path: float
    dtype: Any

    @nn.compact
    def __call__(self, x, *, deterministic: bool):
        """``x[B, tokens, hidden]`` -> same shape."""
        y = nn.LayerNorm(dtype=self.dtype, name="ln_1")(x).swapaxes(1, 2)
        y = FeedForward(
            self.size.tokens_mlp_dim, self.dense, dtype=self.dtype, name="token_mixing"
        )(y, deterministic=deterministic).swapaxes(1, 2)
        x = x + DropPath(self.drop_path)(y, deterministic=deterministic)
        y = nn.LayerNorm(dtype=self.dtype, name="ln_2")(x)
        y = FeedForward(
            self.size.channels_mlp_dim, self.dense, dtype=self.dtype, name="channel_mixing"
        )(y, deterministic=deterministic)
        return x + DropPath(self.drop_path)(y, deterministic=deterministic)


class MlpMixer(nn.Module):
    """MLP-Mixer classifier.

    Attributes:
      num_classes: width of the (dense, zero-initialised) head.
      variant: ``"<size>/<patch>"`` with size in :data:`SIZES`: ``"S/16"``, ``"B/16"`` on 224px
        images; ``"C/4"`` is the CIFAR-scale model for 32px images.
      dense: constructor for the replaceable layers, or a :class:`~dynadiag_jax.models.ByPath`.
      drop_path: stochastic-depth rate of the last block.
      dtype: computation dtype.
    """

    num_classes: int
    variant: str = "B/16"
    dense: Dense = DENSE
    drop_path: float = 0.0
    dtype: Any = None

    def __post_init__(self):
        int_at_least(self.num_classes, "MlpMixer: num_classes", 1)
        fraction(self.drop_path, "MlpMixer: drop_path")
        parse_variant(self.variant, SIZES, model="MlpMixer")
        super().__post_init__()

    @nn.compact
    def __call__(self, images, *, train: bool = False):
        """``images[B, H, W, C]`` (H, W divisible by the patch) -> logits ``[B, num_classes]``."""
        size, patch = parse_variant(self.variant, SIZES, model="MlpMixer")
        dense = resolve_dense(self.dense, DENSE, self.path)
        x = patch_tokens(
            images,
            patch,
            size.hidden,
            name="stem",
            model=f"MlpMixer {self.variant}",
            dtype=self.dtype,
        )
        rates = np.linspace(0.0, self.drop_path, size.depth)
        for i in range(size.depth):
            x = MixerBlock(size, dense, float(rates[i]), self.dtype, name=f"block_{i}")(
                x, deterministic=not train
            )
        x = nn.LayerNorm(dtype=self.dtype, name="ln_f")(x).mean(axis=1)
        return nn.Dense(
            self.num_classes, kernel_init=nn.initializers.zeros, dtype=self.dtype, name="head"
        )(x).astype(jnp.float32)
