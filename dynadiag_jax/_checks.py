"""Argument checks shared by the library's public functions."""

from __future__ import annotations

import operator


def int_at_least(value, name: str, minimum: int) -> int:
    """``value`` as an int; ``TypeError`` if not integral, ``ValueError`` below ``minimum``."""
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
