"""Mixup (Zhang et al. 2018) and CutMix (Yun et al. 2019) on a batch, inside the jitted step.

As in timm/DeiT, each batch uses either mixup or cutmix (chosen with ``switch_prob``) with one
mixing ratio for the whole batch, and pairs every example with the batch flipped end to end.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dynadiag_jax._checks import finite_number

__all__ = ["MixupCutmix"]


class MixupCutmix(NamedTuple):
    """Mixing hyper-parameters (DeiT: ``mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.5``).

    An alpha of 0 disables that method; ``prob`` is the chance that a batch is mixed at all.
    :meth:`check` (called by ``Classification`` and by each call) refuses a negative or
    non-finite alpha and probabilities outside ``[0, 1]``.
    """

    mixup_alpha: float = 0.8
    cutmix_alpha: float = 1.0
    switch_prob: float = 0.5
    prob: float = 1.0

    def check(self) -> MixupCutmix:
        """``self`` after checking every field (``TypeError``: not a real number; ``ValueError``:
        an alpha below 0 or not finite, a probability outside ``[0, 1]``)."""
        for name, low, high in (
            ("mixup_alpha", 0, math.inf),
            ("cutmix_alpha", 0, math.inf),
            ("switch_prob", 0, 1),
            ("prob", 0, 1),
        ):
            value = finite_number(getattr(self, name), f"MixupCutmix: {name}")
            if not low <= value <= high:
                bounds = ">= 0" if high == math.inf else "in [0, 1]"
                raise ValueError(f"MixupCutmix: {name} must be {bounds}, got {value}")
        return self

    def __call__(self, key, images, targets):
        """Mix ``images[B, H, W, C]`` and soft ``targets[B, N]``; returns both, same shapes
        (integer images come back as float32: a mix of uint8 pixels is not a uint8)."""
        self.check()
        if self.mixup_alpha <= 0 and self.cutmix_alpha <= 0:
            return images, targets
        if not jnp.issubdtype(images.dtype, jnp.floating):
            images = images.astype(jnp.float32)  # lam cast to uint8 was 0: all-black images
        k_apply, k_switch, k_mix, k_cut, k_box = jax.random.split(key, 5)
        b, h, w = images.shape[:3]
        f32 = jnp.float32
        lam_mix = jax.random.beta(k_mix, max(self.mixup_alpha, 1e-6), max(self.mixup_alpha, 1e-6))
        lam_cut = jax.random.beta(k_cut, max(self.cutmix_alpha, 1e-6), max(self.cutmix_alpha, 1e-6))
        if self.mixup_alpha <= 0:
            use_cut = jnp.asarray(True)
        elif self.cutmix_alpha <= 0:
            use_cut = jnp.asarray(False)
        else:
            use_cut = jax.random.uniform(k_switch) < self.switch_prob
        # CutMix box with area (1 - lam) of the image, clipped at the borders.
        cut = jnp.sqrt(1.0 - lam_cut)
        cy, cx = jax.random.uniform(k_box, (2,)) * jnp.asarray([h, w], f32)
        hh, hw = cut * h / 2, cut * w / 2
        y0, y1 = jnp.clip(cy - hh, 0, h), jnp.clip(cy + hh, 0, h)
        x0, x1 = jnp.clip(cx - hw, 0, w), jnp.clip(cx + hw, 0, w)
        y0, y1, x0, x1 = (jnp.round(v).astype(jnp.int32) for v in (y0, y1, x0, x1))
        rows = jnp.arange(h, dtype=jnp.int32)[:, None]
        cols = jnp.arange(w, dtype=jnp.int32)[None, :]
        box = (rows >= y0) & (rows < y1) & (cols >= x0) & (cols < x1)
        lam_box = 1.0 - ((y1 - y0) * (x1 - x0)).astype(f32) / (h * w)
        lam = jnp.where(use_cut, lam_box, lam_mix)
        lam = jnp.where(jax.random.uniform(k_apply) < self.prob, lam, jnp.asarray(1.0, f32))
        other = images[::-1]
        mixed = lam.astype(images.dtype) * images + (1 - lam).astype(images.dtype) * other
        pasted = jnp.where(box[None, :, :, None], other, images)
        applied = lam < 1.0
        images = jnp.where(applied & use_cut, pasted, jnp.where(applied, mixed, images))
        targets = (
            lam.astype(targets.dtype) * targets + (1 - lam).astype(targets.dtype) * targets[::-1]
        )
        return images, targets
