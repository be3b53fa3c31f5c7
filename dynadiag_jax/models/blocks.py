"""Building blocks shared by the models: stochastic depth, feed-forward and self-attention.

The linear layers inside :class:`FeedForward` and :class:`SelfAttention` are *replaceable*: they
are built through :func:`dynadiag_jax.models.routing.linear`, so the model's ``dense`` argument
decides whether each one is dense or diagonal-sparse.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dynadiag_jax.models.routing import Dense, linear

__all__ = ["DropPath", "FeedForward", "SelfAttention", "patch_tokens"]


class DropPath(nn.Module):
    """Stochastic depth: drops the whole residual branch per example with probability ``rate``.

    Uses the ``"dropout"`` RNG stream when ``deterministic`` is False and ``rate > 0``.
    """

    rate: float

    @nn.compact
    def __call__(self, x, *, deterministic: bool):
        """``x[B, ...]`` -> same shape, scaled by ``1 / (1 - rate)`` where kept."""
        if deterministic or self.rate == 0.0:
            return x
        keep = 1.0 - self.rate
        mask = jax.random.bernoulli(
            self.make_rng("dropout"), keep, (x.shape[0],) + (1,) * (x.ndim - 1)
        )
        return jnp.where(mask, x / jnp.asarray(keep, x.dtype), jnp.zeros((), x.dtype))


class FeedForward(nn.Module):
    """``fc2(dropout(gelu(fc1(x))))``: the transformer MLP (and a Mixer's token/channel MLP).

    Attributes:
      hidden_dim: width of the inner layer.
      out_dim: output width; ``None`` keeps the input width.
      dense: constructor (or :class:`~dynadiag_jax.models.routing.ByPath`) for both layers.
      names: the two layers' names (``("fc1", "fc2")``; GPT-2 uses ``("c_fc", "c_proj")``).
      dropout: dropout rate after the activation and after ``fc2``.
      approximate_gelu: the tanh approximation (GPT-2) instead of the exact erf form (ViT).
    """

    hidden_dim: int
    dense: Dense
    out_dim: int | None = None
    names: tuple[str, str] = ("fc1", "fc2")
    dropout: float = 0.0
    approximate_gelu: bool = False
    dtype: Any = None

    @nn.compact
    def __call__(self, x, *, deterministic: bool):
        """``x[..., d]`` -> ``[..., out_dim or d]``."""
        out_dim = x.shape[-1] if self.out_dim is None else self.out_dim
        h = linear(self, self.dense, self.hidden_dim, name=self.names[0], dtype=self.dtype)(x)
        h = nn.gelu(h, approximate=self.approximate_gelu)
        h = nn.Dropout(self.dropout)(h, deterministic=deterministic)
        y = linear(self, self.dense, out_dim, name=self.names[1], dtype=self.dtype)(h)
        return nn.Dropout(self.dropout)(y, deterministic=deterministic)


class SelfAttention(nn.Module):
    """Multi-head self-attention with one fused ``qkv`` projection and an output projection.

    The fused projection (``[d] -> [3d]``) matches timm's ViT and GPT-2's ``c_attn``, so a
    diagonal-sparse version has the same shape (and diagonal budget) as the authors' layers.

    Attributes:
      num_heads: number of heads; the width must be divisible by it.
      dense: constructor (or ``ByPath``) for both projections.
      names: names of the fused and the output projection.
      causal: mask future positions (language models).
      dropout: dropout rate on the output projection.
    """

    num_heads: int
    dense: Dense
    names: tuple[str, str] = ("qkv", "proj")
    causal: bool = False
    dropout: float = 0.0
    dtype: Any = None

    @nn.compact
    def __call__(self, x, *, deterministic: bool):
        """``x[B, T, d]`` -> ``[B, T, d]``."""
        b, t, d = x.shape
        if d % self.num_heads:
            raise ValueError(f"width {d} is not divisible by num_heads={self.num_heads}")
        qkv = linear(self, self.dense, 3 * d, name=self.names[0], dtype=self.dtype)(x)
        q, k, v = jnp.split(qkv.reshape(b, t, 3, self.num_heads, d // self.num_heads), 3, axis=2)
        y = jax.nn.dot_product_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], is_causal=self.causal)
        y = linear(self, self.dense, d, name=self.names[1], dtype=self.dtype)(y.reshape(b, t, d))
        return nn.Dropout(self.dropout)(y, deterministic=deterministic)


def patch_tokens(images, patch: int, width: int, *, name: str, model: str, dtype: Any = None):
    """Embed non-overlapping ``patch x patch`` squares: ``[B, H, W, C] -> [B, (H/p)(W/p), width]``.

    Call inside a ``@nn.compact`` method: the (always dense) convolution is created there, named
    ``name``. ``model`` names the caller in the error for a bad image shape.
    """
    if images.ndim != 4 or images.shape[1] % patch or images.shape[2] % patch:
        raise ValueError(
            f"{model} expects images [B, H, W, C] with H and W divisible by {patch}, "
            f"got shape {images.shape}"
        )
    x = nn.Conv(
        width, (patch, patch), strides=(patch, patch), padding="VALID", dtype=dtype, name=name
    )(images)
    return x.reshape(x.shape[0], -1, x.shape[-1])
