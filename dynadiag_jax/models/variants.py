"""Parsing of ``"<size>/<patch>"`` variant strings (``"B/16"``) against a table of sizes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

__all__ = ["parse_variant"]

T = TypeVar("T")


def parse_variant(variant: str, sizes: Mapping[str, T], *, model: str) -> tuple[T, int]:
    """``"B/16"`` -> ``(sizes["B"], 16)``.

    Raises:
      ValueError: naming the model and the known sizes when ``variant`` is malformed or unknown.
    """
    if not isinstance(variant, str) or variant.count("/") != 1:
        raise ValueError(
            f"{model} variant must look like 'B/16' (size/patch), got {variant!r}; "
            f"sizes: {', '.join(sizes)}"
        )
    size, patch = variant.split("/")
    if size not in sizes:
        raise ValueError(
            f"unknown {model} size {size!r} in variant {variant!r}; known sizes: {', '.join(sizes)}"
        )
    if not patch.isdigit() or int(patch) < 1:
        raise ValueError(
            f"{model} patch size must be a positive integer, got {patch!r} in {variant!r}"
        )
    return sizes[size], int(patch)
