"""Per-example image augmentation on the host (numpy + PIL), DeiT-style.

Training: :func:`random_resized_crop` -> horizontal flip -> :class:`RandAugment`; evaluation:
:func:`resize_center_crop`. Every random choice draws from an explicit ``numpy.random.Generator``,
so the pipeline is reproducible per example (the ImageNet pipeline seeds it with
``(seed, example number)``). Mixup/CutMix act on whole batches inside the jitted step
(:class:`dynadiag_jax.training.MixupCutmix`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

from dynadiag_jax._checks import finite_number, int_at_least

__all__ = ["RandAugment", "random_resized_crop", "resize_center_crop", "flip"]

_FILL = (124, 116, 104)  # ImageNet mean, used where geometric ops uncover pixels (timm)


def _as_pil(image: np.ndarray) -> Image.Image:
    """uint8 ``[H, W]`` or ``[H, W, C]`` -> an RGB image, whatever ``C`` (1 to 4) the decoder
    returned (a batch takes one channel count, the model 3): grey (1), grey + alpha (2), RGB (3);
    4 is CMYK, which tfds's PIL decoder returns for a CMYK JPEG, unless the fourth channel is 255
    everywhere: then RGBA (an opaque PNG; as CMYK it would be black). The array does not say which,
    so an RGBA image with transparency is read as CMYK."""
    channels = image.shape[-1] if image.ndim == 3 else 1
    if image.dtype != np.uint8 or image.ndim not in (2, 3) or not 1 <= channels <= 4:
        raise ValueError(
            f"expected a uint8 image [H, W] or [H, W, 1 to 4], got {image.dtype}{image.shape}"
        )
    if channels == 4:
        mode = "RGBA" if (image[..., 3] == 255).all() else "CMYK"
    else:
        mode = ("L", "LA", "RGB")[channels - 1]
    h, w = image.shape[:2]
    img = Image.frombytes(mode, (w, h), np.ascontiguousarray(image).tobytes())
    return img if mode == "RGB" else img.convert("RGB")


def _as_array(img: Image.Image) -> np.ndarray:
    """An RGB image -> uint8 ``[H, W, 3]``."""
    return np.asarray(img.convert("RGB"), np.uint8)


def random_resized_crop(
    image: np.ndarray,
    size: int,
    rng: np.random.Generator,
    *,
    scale=(0.08, 1.0),
    ratio=(3 / 4, 4 / 3),
) -> np.ndarray:
    """A crop of random area fraction in ``scale`` and aspect ratio in ``ratio`` (log-uniform),
    resized to ``size x size`` with bicubic filtering (torchvision's algorithm, 10 attempts, then
    a centre crop). ``image``: uint8 ``[H, W, C]`` (any ``C`` :func:`_as_pil` takes); returns uint8
    RGB ``[size, size, 3]``. ``scale`` and ``ratio``: pairs ``0 < low <= high``."""
    for name, pair in (("scale", scale), ("ratio", ratio)):
        low, high = (finite_number(v, f"random_resized_crop: {name}") for v in pair)
        if not 0 < low <= high:
            raise ValueError(
                f"random_resized_crop: {name} must be (low, high) with 0 < low <= high, got {pair}"
            )
    img = _as_pil(image)
    w, h = img.size
    area = w * h
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        cw, ch = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < cw <= w and 0 < ch <= h:
            x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            break
    else:
        in_ratio = w / h
        if in_ratio < ratio[0]:
            cw, ch = w, int(round(w / ratio[0]))
        elif in_ratio > ratio[1]:
            cw, ch = int(round(h * ratio[1])), h
        else:
            cw, ch = w, h
        x0, y0 = (w - cw) // 2, (h - ch) // 2
    out = img.resize((size, size), Image.BICUBIC, box=(x0, y0, x0 + cw, y0 + ch))
    return _as_array(out)


def check_crop_fraction(crop_fraction) -> float:
    """``crop_fraction`` as a float in ``(0, 1]`` (above 1 the crop would reach past the resized
    image and pad it with black); ``ValueError`` otherwise."""
    value = finite_number(crop_fraction, "crop_fraction")
    if not 0 < value <= 1:
        raise ValueError(f"crop_fraction must be in (0, 1], got {value}")
    return value


def resize_center_crop(image: np.ndarray, size: int, *, crop_fraction: float = 0.875) -> np.ndarray:
    """Resize the shorter side to ``size / crop_fraction`` (bicubic), then take the centre
    ``size x size`` (the standard ImageNet evaluation: 256 -> 224). uint8 ``[H, W, C]`` -> uint8 RGB
    ``[size, size, 3]``; ``crop_fraction`` in ``(0, 1]``."""
    crop_fraction = check_crop_fraction(crop_fraction)
    img = _as_pil(image)
    w, h = img.size
    short = int(math.floor(size / crop_fraction))
    if w <= h:
        nw, nh = short, max(size, int(round(h * short / w)))
    else:
        nw, nh = max(size, int(round(w * short / h))), short
    img = img.resize((nw, nh), Image.BICUBIC)
    x0, y0 = (nw - size) // 2, (nh - size) // 2
    return _as_array(img.crop((x0, y0, x0 + size, y0 + size)))


def flip(image: np.ndarray, rng: np.random.Generator, p: float = 0.5) -> np.ndarray:
    """Mirror left-right with probability ``p``."""
    return image[:, ::-1] if rng.uniform() < p else image


def _sign(rng) -> float:
    return 1.0 if rng.uniform() < 0.5 else -1.0


def _affine(img, rng, m, kind):
    w, h = img.size
    if kind == "Rotate":
        return img.rotate(_sign(rng) * m * 30.0, resample=Image.BILINEAR, fillcolor=_fill(img))
    if kind in ("ShearX", "ShearY"):
        s = _sign(rng) * m * 0.3
        coeffs = (1, s, 0, 0, 1, 0) if kind == "ShearX" else (1, 0, 0, s, 1, 0)
    else:
        t = _sign(rng) * m * 0.45
        coeffs = (1, 0, t * w, 0, 1, 0) if kind == "TranslateXRel" else (1, 0, 0, 0, 1, t * h)
    return img.transform(
        img.size, Image.AFFINE, coeffs, resample=Image.BILINEAR, fillcolor=_fill(img)
    )


def _fill(img):
    return _FILL if img.mode == "RGB" else _FILL[0]


def _enhance(img, rng, m, kind):
    factor = 1.0 + _sign(rng) * m * 0.9
    enhancer = {
        "Color": ImageEnhance.Color,
        "Contrast": ImageEnhance.Contrast,
        "Brightness": ImageEnhance.Brightness,
        "Sharpness": ImageEnhance.Sharpness,
    }[kind]
    return enhancer(img).enhance(factor)


def _solarize_add(img, m):
    arr = np.asarray(img).astype(np.int16)
    added = np.clip(arr + int(m * 110), 0, 255).astype(np.uint8)
    return Image.fromarray(np.where(arr < 128, added, arr.astype(np.uint8)))


_OPS = (
    "AutoContrast",
    "Equalize",
    "Invert",
    "Rotate",
    "Posterize",
    "Solarize",
    "SolarizeAdd",
    "Color",
    "Contrast",
    "Brightness",
    "Sharpness",
    "ShearX",
    "ShearY",
    "TranslateXRel",
    "TranslateYRel",
)


class RandAugment(NamedTuple):
    """RandAugment (Cubuk et al. 2020) as timm's ``rand-m9-mstd0.5-inc1`` used by DeiT.

    Each of ``num_ops`` operations, drawn uniformly from 15, is applied with probability ``prob`` at
    magnitude ``N(magnitude, magnitude_std)`` clipped to [0, 10]; magnitudes grow the distortion
    ("increasing" variants of posterize, solarize and the enhancements).
    """

    num_ops: int = 2
    magnitude: float = 9.0
    magnitude_std: float = 0.5
    prob: float = 0.5

    def check(self) -> RandAugment:
        """``self`` after checking every field: ``num_ops`` an int >= 0, ``magnitude`` in
        ``[0, 10]`` (a mean above 10 would train as 10), ``magnitude_std`` >= 0, ``prob`` in
        ``[0, 1]`` (``TypeError``: not a number; ``ValueError``: out of range)."""
        int_at_least(self.num_ops, "RandAugment: num_ops", 0)
        for name, low, high in (
            ("magnitude", 0, 10),
            ("magnitude_std", 0, math.inf),
            ("prob", 0, 1),
        ):
            value = finite_number(getattr(self, name), f"RandAugment: {name}")
            if not low <= value <= high:
                bounds = ">= 0" if high == math.inf else f"in [{low}, {high}]"
                raise ValueError(f"RandAugment: {name} must be {bounds}, got {value}")
        return self

    def __call__(self, image: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """uint8 ``[H, W, C]`` -> uint8 RGB ``[H, W, 3]``."""
        img = _as_pil(image)
        for _ in range(self.num_ops):
            op = _OPS[int(rng.integers(len(_OPS)))]
            if rng.uniform() >= self.prob:
                continue
            m = float(np.clip(rng.normal(self.magnitude, self.magnitude_std), 0.0, 10.0)) / 10.0
            img = self._apply(img, rng, op, m)
        return _as_array(img)

    @staticmethod
    def _apply(img, rng, op, m):
        if op == "AutoContrast":
            return ImageOps.autocontrast(img)
        if op == "Equalize":
            return ImageOps.equalize(img)
        if op == "Invert":
            return ImageOps.invert(img)
        if op == "Posterize":
            return ImageOps.posterize(img, max(1, 4 - int(m * 4)))
        if op == "Solarize":
            return ImageOps.solarize(img, 256 - int(m * 256))
        if op == "SolarizeAdd":
            return _solarize_add(img, m)
        if op in ("Color", "Contrast", "Brightness", "Sharpness"):
            return _enhance(img, rng, m, op)
        return _affine(img, rng, m, op)
