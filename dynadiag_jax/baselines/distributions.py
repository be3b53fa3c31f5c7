"""Per-layer sparsity for unstructured baselines: uniform and Erdos-Renyi-Kernel (ERK).

A *distribution* maps a parameter pytree to a pytree of the same structure whose leaves are a
float sparsity in ``[0, 1)`` for sparsified leaves and ``None`` for leaves left dense (biases,
norms, heads). Only shapes are read, so a distribution can run at trace time on tracers.

References:
  Evci et al., "Rigging the Lottery: Making All Tickets Winners", ICML 2020,
  https://arxiv.org/abs/1911.11134 (ERK, appendix).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import jax

from dynadiag_jax._checks import finite_number

__all__ = ["uniform", "erk", "include_paths", "path_str"]

Include = Callable[[str, jax.Array], bool]


def path_str(path) -> str:
    """``"Dense_0/kernel"`` for a key path from ``jax.tree_util.tree_flatten_with_path``."""
    parts = []
    for k in path:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _default_include(path: str, leaf) -> bool:
    del path
    return leaf.ndim >= 2


def include_paths(patterns: Sequence[str], *, min_ndim: int = 2) -> Include:
    """Predicate selecting leaves whose ``path_str`` matches any regex in ``patterns``.

    Leaves with fewer than ``min_ndim`` dimensions (biases, scales) are never selected.
    """
    if isinstance(patterns, str):
        raise TypeError("patterns must be a sequence of regex strings, got a single str")
    compiled = [re.compile(p) for p in patterns]
    return lambda path, leaf: leaf.ndim >= min_ndim and any(c.search(path) for c in compiled)


def _check_sparsity(sparsity) -> float:
    s = finite_number(sparsity, "sparsity")
    if not 0.0 <= s < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity!r}")
    return s


def _selected(params, include: Include):
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    chosen = [bool(include(path_str(p), leaf)) for p, leaf in flat]
    if not any(chosen):
        raise ValueError("no parameter leaf is selected for sparsification; check `include`")
    return flat, treedef, chosen


def uniform(params, sparsity: float, *, include: Include = _default_include):
    """Every selected leaf gets ``sparsity``; the others ``None`` (dense).

    Args:
      params: parameter pytree (arrays or anything with ``.shape``/``.ndim``).
      sparsity: fraction of zeros in ``[0, 1)``.
      include: ``(path, leaf) -> bool``; default: leaves with ``ndim >= 2``.
    """
    s = _check_sparsity(sparsity)
    flat, treedef, chosen = _selected(params, include)
    return jax.tree_util.tree_unflatten(treedef, [s if c else None for c in chosen])


def erk(params, sparsity: float, *, include: Include = _default_include, power: float = 1.0):
    """Erdos-Renyi-Kernel sparsities whose selected weights total ``(1 - sparsity)`` density.

    The density of a leaf of shape ``(n_1, ..., n_r)`` is ``eps * (sum(n) / prod(n)) ** power``,
    with ``eps`` solved so the selected leaves keep ``(1 - sparsity) * N`` weights in total.
    Leaves whose density would exceed 1 become fully dense (sparsity 0) and ``eps`` is solved again.

    Args:
      params: parameter pytree.
      sparsity: overall fraction of zeros over the selected leaves, in ``[0, 1)``.
      include: ``(path, leaf) -> bool``; default: leaves with ``ndim >= 2``.
      power: exponent on the ERK ratio (``< 1`` flattens the distribution).
    """
    s = _check_sparsity(sparsity)
    power = finite_number(power, "erk: power")
    flat, treedef, chosen = _selected(params, include)
    shapes = {i: tuple(leaf.shape) for i, ((_, leaf), c) in enumerate(zip(flat, chosen)) if c}
    sizes = {i: math.prod(shape) for i, shape in shapes.items()}
    raw = {i: (sum(shape) / sizes[i]) ** power for i, shape in shapes.items()}
    dense: set[int] = set()
    eps = 0.0
    while True:
        free = [i for i in shapes if i not in dense]
        if not free:
            break
        # Weights the free leaves must hold so that (dense + free) keeps (1 - s) of all weights.
        budget = (1.0 - s) * sum(sizes.values()) - sum(sizes[i] for i in dense)
        eps = budget / sum(raw[i] * sizes[i] for i in free)
        too_dense = [i for i in free if eps * raw[i] > 1.0]
        if not too_dense:
            break
        dense.update(too_dense)
    out = [None] * len(flat)
    for i in shapes:
        out[i] = 0.0 if i in dense else max(0.0, 1.0 - eps * raw[i])
    return jax.tree_util.tree_unflatten(treedef, out)
