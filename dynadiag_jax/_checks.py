"""Argument checks shared by the library's public functions."""

from __future__ import annotations

import operator

import numpy as np


def int_at_least(value, name: str, minimum: int) -> int:
    """``value`` as an int; ``TypeError`` if not integral, ``ValueError`` below ``minimum``."""
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def permutation_problem(perm, n: int) -> str | None:
    """Why a concrete integer ``perm[n]`` is not a permutation of ``range(n)``, or None if it is."""
    perm = np.asarray(perm).astype(np.int64)
    outside = perm[(perm < 0) | (perm >= n)]
    if outside.size:
        return f"it holds {outside[0]}, outside [0, {n})"
    counts = np.bincount(perm, minlength=n)
    if np.any(counts != 1):
        twice, missed = int(np.argmax(counts)), int(np.argmin(counts))
        return f"it holds {twice} {int(counts[twice])} times and misses {missed}"
    return None
