"""Optimizer helpers (optax): a separate learning rate for alpha, no weight decay on it.

``alpha`` (the diagonal scores) is a selection variable, not a weight: it gets its own
transformation and never weight decay; biases and norm scales get no weight decay either. After
:func:`dynadiag_jax.freeze_tree` there is no ``alpha`` left, and
:func:`dynadiag_jax.freeze_opt_state` turns the state into the one these transformations keep for
the frozen params (the alpha group then holds no arrays).

The values of a ``fan_in="sparse"`` layer start ``1 / sqrt(density)`` times larger than the dense
layer's weights, and Adam moves every weight by about the learning rate whatever its size, so
they change that many times more slowly relative to their size; ``values_lr_scale`` (with
:func:`init_gain`) gives their updates that factor back.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence

import jax
import optax

from dynadiag_jax._checks import finite_number, fraction, non_negative

__all__ = [
    "alpha_mask",
    "values_mask",
    "init_gain",
    "path_mask",
    "compile_patterns",
    "weight_decay_mask",
    "param_labels",
    "with_alpha_optimizer",
    "diag_optimizer",
    "NO_DECAY",
]

# Leaves that never get weight decay, by "/"-joined path (re.fullmatch), besides every leaf with
# fewer than two axes: alpha, biases and norm scales.
NO_DECAY = (r"(.*/)?alpha", r"(.*/)?bias", r"(.*/)?scale")


def _names(path) -> tuple:
    """The mapping keys of a leaf's path (NNX's ``Variable.value`` attribute dropped)."""
    return tuple(k.key for k in path if isinstance(k, jax.tree_util.DictKey))


def _map_named(params, fn):
    """``fn(names, leaf, sibling_names)`` on every leaf of a nested mapping of params (``names``:
    the mapping keys of its path).

    The result has the params' tree structure (plain dicts, ``FrozenDict`` or ``nnx.State`` with
    its ``Variable`` leaves), as optax's masks and labels require.
    """
    if not isinstance(params, Mapping):
        raise TypeError(f"params must be a nested mapping, got {type(params).__name__}")
    siblings = defaultdict(set)
    for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]:
        names = _names(path)
        siblings[names[:-1]].add(names[-1])
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: fn(_names(path), leaf, siblings[_names(path)[:-1]]), params
    )


def _is_alpha(names, parent) -> bool:
    return names[-1] == "alpha" and "values" in parent


def alpha_mask(params):
    """Tree of bools: True at every ``DiagonalDense`` ``alpha`` (a leaf beside ``values``)."""
    return _map_named(params, lambda names, leaf, parent: _is_alpha(names, parent))


def values_mask(params):
    """Tree of bools: True at every leaf named ``values`` (``DiagonalDense``'s, searching or
    frozen)."""
    return _map_named(params, lambda names, leaf, parent: names[-1] == "values")


def init_gain(sparsity: float) -> float:
    """``1 / sqrt(1 - sparsity)``: how many times larger than the dense layer's weights the values
    of a ``fan_in="sparse"`` layer at ``sparsity`` start (the ``values_lr_scale`` that gives them
    the dense layer's relative step under Adam)."""
    if not 0.0 <= finite_number(sparsity, "init_gain: sparsity") < 1.0:
        raise ValueError(f"init_gain: sparsity must be in [0, 1), got {sparsity}")
    return 1.0 / math.sqrt(1.0 - float(sparsity))


def compile_patterns(patterns: Sequence[str], name: str = "patterns") -> list[re.Pattern]:
    """The regexes of a sequence of path patterns. ``TypeError``: a bare string (a sequence of
    one-letter patterns, each a path it would miss) or a pattern that is not a string;
    ``ValueError``: a pattern that is not a regex, naming it."""
    if isinstance(patterns, (str, bytes)) or not isinstance(patterns, Sequence):
        raise TypeError(
            f"{name} must be a sequence of path patterns, e.g. ({patterns!r},), got "
            f"{type(patterns).__name__}"
        )
    compiled = []
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise TypeError(f"{name}: each pattern must be a str, got {type(pattern).__name__}")
        try:
            compiled.append(re.compile(pattern))
        except re.error as e:
            raise ValueError(f"{name}: {pattern!r} is not a regex: {e}") from None
    return compiled


def path_mask(
    patterns: Sequence[str], *, match: bool = True, min_ndim: int = 0, name: str = "patterns"
):
    """``params -> bool tree``: True where the leaf's "/"-joined path fully matches a pattern
    (``match``) or none (``not match``), and the leaf has at least ``min_ndim`` axes; bad
    patterns are refused as :func:`compile_patterns` does, by ``name``."""
    compiled = compile_patterns(patterns, name)

    def mask(params):
        def hit(names, leaf, parent):
            matched = any(c.fullmatch("/".join(map(str, names))) for c in compiled)
            return matched == match and getattr(leaf, "ndim", 0) >= min_ndim

        return _map_named(params, hit)

    return mask


def weight_decay_mask(params, no_decay: Sequence[str] = NO_DECAY):
    """Tree of bools: True where weight decay applies: leaves with >= 2 axes whose path matches
    none of ``no_decay`` (so stacked layers' biases, with 2 axes, stay undecayed too)."""
    return path_mask(no_decay, match=False, min_ndim=2, name="no_decay")(params)


def param_labels(params):
    """``"alpha"`` for alpha leaves, ``"weights"`` for everything else (``multi_transform``)."""
    return _map_named(
        params, lambda names, leaf, parent: "alpha" if _is_alpha(names, parent) else "weights"
    )


def with_alpha_optimizer(
    tx: optax.GradientTransformation, alpha_tx: optax.GradientTransformation
) -> optax.GradientTransformation:
    """``alpha_tx`` on alpha, ``tx`` on every other param (``optax.multi_transform``)."""
    return optax.multi_transform({"alpha": alpha_tx, "weights": tx}, param_labels)


def _mask_of_tree(tree):
    """A tree of bools as ``params -> tree`` of the params' structure: the tree itself kept
    ``alpha``'s entries, and the first update after the freeze (no ``alpha``) failed on them."""
    flat = {_names(path): v for path, v in jax.tree_util.tree_leaves_with_path(tree)}

    def entry(names, leaf, parent):
        if names not in flat:
            raise ValueError(f"decay_mask has no entry for params/{'/'.join(names)}")
        return flat[names]

    return lambda params: _map_named(params, entry)


def diag_optimizer(
    learning_rate,
    *,
    alpha_learning_rate,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    decay_mask=weight_decay_mask,
    values_lr_scale: float = 1.0,
) -> optax.GradientTransformation:
    """AdamW on the weights, Adam with its own learning rate (and no decay) on alpha.

    Args:
      learning_rate: float or optax schedule for every param except alpha.
      alpha_learning_rate: float or optax schedule for alpha.
      weight_decay: decoupled weight decay on the leaves selected by ``decay_mask``.
      b1, b2, eps: Adam moments, shared by both groups.
      decay_mask: tree of bools (its entries at the params' paths are read, so it serves the
        frozen params too) or ``params -> tree``; default :func:`weight_decay_mask`
        (``functools.partial(weight_decay_mask, no_decay=...)`` for other path patterns).
      values_lr_scale: the final updates of every ``values`` leaf (:func:`values_mask`), weight
        decay included, times this; :func:`init_gain` of the layers' sparsity for
        ``fan_in="sparse"`` layers (docs/selection.md, "The sparse weights' learning rate").

    Returns:
      An ``optax.GradientTransformation``; combine with ``optax.chain`` for clipping etc.

    Raises:
      TypeError: a rate that is neither a number nor a schedule, a hyper-parameter that is not a
        number.
      ValueError: a negative or non-finite rate, ``weight_decay`` or ``eps``; ``b1`` or ``b2``
        outside ``[0, 1)``; ``values_lr_scale`` <= 0.
    """
    for name, rate in (
        ("learning_rate", learning_rate),
        ("alpha_learning_rate", alpha_learning_rate),
    ):
        if not callable(rate):  # a schedule is called with the step; a number must be a rate
            non_negative(rate, f"diag_optimizer: {name} (a number or a schedule)")
    fraction(b1, "diag_optimizer: b1")
    fraction(b2, "diag_optimizer: b2")
    non_negative(eps, "diag_optimizer: eps")
    non_negative(weight_decay, "diag_optimizer: weight_decay")
    if finite_number(values_lr_scale, "diag_optimizer: values_lr_scale") <= 0.0:
        raise ValueError(f"diag_optimizer: values_lr_scale must be > 0, got {values_lr_scale}")
    if not callable(decay_mask):
        decay_mask = _mask_of_tree(decay_mask)
    weights = optax.adamw(
        learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=decay_mask
    )
    if values_lr_scale != 1.0:
        weights = optax.chain(weights, optax.masked(optax.scale(values_lr_scale), values_mask))
    alpha = optax.adam(alpha_learning_rate, b1=b1, b2=b2, eps=eps)
    return with_alpha_optimizer(weights, alpha)
