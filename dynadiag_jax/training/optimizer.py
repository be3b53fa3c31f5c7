"""AdamW for DynaDiag models: no weight decay on scores, biases and norms; alpha's own rate.

The state holds only step counters and parameter-shaped moments (no per-label sub-states), so the
freeze can map it to the compact parameters like the parameters themselves.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import jax
import optax
from flax import traverse_util

__all__ = ["NO_DECAY", "adamw", "path_mask"]

# Parameters never decayed (DeiT/timm): biases, norm scales, position embeddings, the class token,
# and the diagonal scores. Matched with re.fullmatch against "/"-joined parameter paths.
NO_DECAY = (r".*bias", r".*scale", r".*pos_embed", r".*cls_token", r".*wpe", r".*alpha")


def path_mask(patterns: Sequence[str], *, match: bool = True, min_ndim: int = 0):
    """``params -> bool tree``: True where the path fully matches a pattern (``match``) or matches
    none (``not match``), and the leaf has at least ``min_ndim`` dimensions."""
    compiled = [re.compile(p) for p in patterns]

    def mask(params):
        flat = traverse_util.flatten_dict(params)
        out = {}
        for key, leaf in flat.items():
            hit = any(c.fullmatch("/".join(key)) for c in compiled)
            out[key] = (hit == match) and jax.numpy.ndim(leaf) >= min_ndim
        return traverse_util.unflatten_dict(out)

    return mask


def adamw(
    learning_rate,
    *,
    weight_decay: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    clip_norm: float | None = None,
    no_decay: Sequence[str] = NO_DECAY,
    alpha_lr_scale: float = 1.0,
) -> optax.GradientTransformation:
    """AdamW with decoupled weight decay on matrices only.

    Args:
      learning_rate: a float or an optax schedule ``step -> lr``.
      weight_decay: decay coefficient for parameters with >= 2 dimensions not in ``no_decay``.
      b1, b2, eps: Adam's constants.
      clip_norm: clip the gradient's global norm first (``None``: no clipping).
      no_decay: path patterns (``re.fullmatch``) never decayed.
      alpha_lr_scale: ``alpha`` (DiagonalDense scores) learns at ``alpha_lr_scale * lr``.
    """
    parts = []
    if clip_norm is not None:
        parts.append(optax.clip_by_global_norm(clip_norm))
    parts += [
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
        optax.add_decayed_weights(weight_decay, mask=path_mask(no_decay, match=False, min_ndim=2)),
    ]
    if alpha_lr_scale != 1.0:
        parts.append(optax.masked(optax.scale(alpha_lr_scale), path_mask((r".*alpha",))))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)
