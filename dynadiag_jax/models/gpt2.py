"""GPT-2 (Radford et al. 2019), in the nanoGPT layout, as a causal language model.

The attention projections (``attn/c_attn``, ``attn/c_proj``) and the MLP (``mlp/c_fc``,
``mlp/c_proj``) are replaceable; token/position embeddings stay dense, and the output head is
tied to the token embedding.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax.numpy as jnp

from dynadiag_jax._checks import fraction, host_array, int_at_least
from dynadiag_jax.models.blocks import FeedForward, SelfAttention
from dynadiag_jax.models.routing import Dense, resolve_dense

__all__ = ["GPT2", "GPT2Size", "SIZES", "DENSE", "SPARSE_LAYERS"]


class GPT2Size(NamedTuple):
    width: int
    depth: int
    num_heads: int


SIZES = {
    "mu": GPT2Size(32, 2, 2),  # tests and smoke runs only
    "mini": GPT2Size(128, 4, 4),  # CPU-sized runs of train/lm.py
    # CPU-sized runs of train/results.py: widths are multiples of 16 with 10 block candidates.
    "micro": GPT2Size(160, 2, 4),
    "small": GPT2Size(768, 12, 12),
    "medium": GPT2Size(1024, 24, 16),
}

DENSE = functools.partial(
    nn.Dense, kernel_init=nn.initializers.normal(0.02), bias_init=nn.initializers.zeros
)
SPARSE_LAYERS = (r".*/attn/(c_attn|c_proj)", r".*/mlp/(c_fc|c_proj)")


class Block(nn.Module):
    size: GPT2Size
    dense: Dense
    dropout: float
    dtype: Any

    @nn.compact
    def __call__(self, x, *, deterministic: bool):
        y = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name="ln_1")(x)
        x = x + SelfAttention(
            self.size.num_heads,
            self.dense,
            names=("c_attn", "c_proj"),
            causal=True,
            dropout=self.dropout,
            dtype=self.dtype,
            name="attn",
        )(y, deterministic=deterministic)
        y = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name="ln_2")(x)
        return x + FeedForward(
            4 * self.size.width,
            self.dense,
            names=("c_fc", "c_proj"),
            dropout=self.dropout,
            approximate_gelu=True,
            dtype=self.dtype,
            name="mlp",
        )(y, deterministic=deterministic)


class GPT2(nn.Module):
    """Decoder-only transformer language model.

    Attributes:
      vocab_size: number of token ids (50257 for the GPT-2 BPE, 256 for bytes).
      variant: a key of :data:`SIZES` (``"small"``, ``"medium"``).
      block_size: the longest sequence (number of position embeddings).
      dense: constructor for the replaceable layers, or a :class:`~dynadiag_jax.models.ByPath`.
      dropout: dropout on embeddings and residual branches.
      dtype: computation dtype.
    """

    vocab_size: int = 50257
    variant: str = "small"
    block_size: int = 1024
    dense: Dense = DENSE
    dropout: float = 0.0
    dtype: Any = None

    def __post_init__(self):
        int_at_least(self.vocab_size, "GPT2: vocab_size", 1)
        int_at_least(self.block_size, "GPT2: block_size", 1)
        fraction(self.dropout, "GPT2: dropout")
        if self.variant not in SIZES:
            raise ValueError(f"unknown GPT2 variant {self.variant!r}; known: {', '.join(SIZES)}")
        super().__post_init__()

    @nn.compact
    def __call__(self, tokens, *, train: bool = False):
        """``tokens[B, T]`` int (T <= block_size) -> next-token logits ``[B, T, vocab_size]``.

        Token ids must lie in ``[0, vocab_size)``: an array whose values can be read without a
        trace or a device sync (numpy, or on the CPU) is checked; otherwise (inside ``jit``, on a
        GPU) an id out of range, negative ones included, makes the logits of its sequence NaN
        (its embedding is NaN, and attention carries it on).
        """
        if tokens.ndim != 2 or tokens.shape[1] > self.block_size:
            raise ValueError(
                f"GPT2 expects tokens [B, T] with T <= block_size={self.block_size}, "
                f"got shape {tokens.shape}"
            )
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise TypeError(f"tokens must be integers, got dtype {tokens.dtype}")
        host = host_array(tokens)
        if host is not None and host.size:
            low, high = int(host.min()), int(host.max())
            if low < 0 or high >= self.vocab_size:
                raise ValueError(
                    f"token ids must lie in [0, vocab_size={self.vocab_size}), got ids from "
                    f"{low} to {high}"
                )
        if jnp.issubdtype(tokens.dtype, jnp.signedinteger):
            # a negative id would index from the end of the table: out of range like the others
            tokens = jnp.where(tokens < 0, self.vocab_size, tokens)
        size = SIZES[self.variant]
        dense = resolve_dense(self.dense, DENSE, self.path)
        wte = nn.Embed(
            self.vocab_size,
            size.width,
            embedding_init=nn.initializers.normal(0.02),
            dtype=self.dtype,
            name="wte",
        )
        wpe = self.param("wpe", nn.initializers.normal(0.01), (self.block_size, size.width))
        x = wte(tokens) + wpe[None, : tokens.shape[1]].astype(self.dtype or jnp.float32)
        x = nn.Dropout(self.dropout)(x, deterministic=not train)
        for i in range(size.depth):
            x = Block(size, dense, self.dropout, self.dtype, name=f"block_{i}")(
                x, deterministic=not train
            )
        x = nn.LayerNorm(epsilon=1e-5, dtype=self.dtype, name="ln_f")(x)
        return wte.attend(x).astype(jnp.float32)
