"""AdamW for DynaDiag models: DeiT's no-decay list, optional clipping, alpha's own learning rate.

Built on :func:`dynadiag_jax.optim.diag_optimizer` (Adam without decay on ``alpha``, AdamW on the
rest), whose state :func:`dynadiag_jax.freeze_opt_state` maps to the compact frozen parameters.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Sequence

import jax
import optax
from flax import traverse_util

import dynadiag_jax as dd
from dynadiag_jax._checks import finite_number, fraction, non_negative

__all__ = ["NO_DECAY", "adamw", "merge_params", "split_params", "train_only"]

# Parameters never decayed (DeiT/timm): biases, norm scales, position embeddings, the class token.
# Matched with re.fullmatch against "/"-joined parameter paths; alpha is never decayed either.
NO_DECAY = (r".*bias", r".*scale", r".*pos_embed", r".*cls_token", r".*wpe")


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
    values_lr_scale: float = 1.0,
) -> optax.GradientTransformation:
    """AdamW with decoupled weight decay on matrices only; Adam on ``alpha``.

    Args:
      learning_rate: a finite float > 0 or an optax schedule ``step -> lr``.
      weight_decay: decay coefficient (finite, >= 0) for parameters with >= 2 dimensions not in
        ``no_decay``.
      b1, b2, eps: Adam's constants: ``b1`` and ``b2`` in ``[0, 1)``, ``eps`` finite and >= 0.
      clip_norm: clip the gradient's global norm to this (finite, > 0) first (``None`` or 0: no
        clipping).
      no_decay: path patterns (``re.fullmatch``) never decayed.
      alpha_lr_scale: ``alpha`` (DiagonalDense scores) learns at ``alpha_lr_scale`` (finite,
        > 0) times the rate.
      values_lr_scale: DiagonalDense ``values`` take their updates times this (finite, > 0;
        :func:`dynadiag_jax.optim.diag_optimizer`; ``dd.optim.init_gain(sparsity)`` for
        ``fan_in="sparse"`` layers).

    Raises:
      TypeError: a constant that is not a real number (``learning_rate``: nor a schedule).
      ValueError: a constant out of its range, NaN or infinite (optax would train to NaN, or
        ascend the loss with a negative rate or clip norm, without an error).
    """
    if not callable(learning_rate):
        if isinstance(learning_rate, bool) or not isinstance(learning_rate, numbers.Real):
            raise TypeError(
                "learning_rate must be a number or a schedule step -> rate, "
                f"got {type(learning_rate).__name__}"
            )
        _positive(learning_rate, "learning_rate")
    non_negative(weight_decay, "weight_decay")
    fraction(b1, "b1")
    fraction(b2, "b2")
    non_negative(eps, "eps")
    dd.optim.compile_patterns(no_decay, "no_decay")
    if clip_norm is not None:
        non_negative(clip_norm, "clip_norm (None or 0: no clipping)")
    _positive(alpha_lr_scale, "alpha_lr_scale")
    _positive(values_lr_scale, "values_lr_scale")
    if callable(learning_rate):
        alpha_lr = lambda count: alpha_lr_scale * learning_rate(count)  # noqa: E731
    else:
        alpha_lr = alpha_lr_scale * learning_rate
    tx = dd.optim.diag_optimizer(
        learning_rate,
        alpha_learning_rate=alpha_lr,
        weight_decay=weight_decay,
        b1=b1,
        b2=b2,
        eps=eps,
        decay_mask=functools.partial(dd.optim.weight_decay_mask, no_decay=no_decay),
        values_lr_scale=values_lr_scale,
    )
    return optax.chain(optax.clip_by_global_norm(clip_norm), tx) if clip_norm else tx


def _positive(value, name: str) -> float:
    """``value`` as a float; ``TypeError`` if not a real number, ``ValueError`` unless finite and
    > 0."""
    if finite_number(value, name) <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)


def train_only(tx: optax.GradientTransformation, patterns: Sequence[str]):
    """``tx`` on the params whose "/"-joined path fully matches a pattern; every other param gets
    a zero update and no optimizer state (e.g. ``(r".*/lora_b",)``: a LoRA-FA fine-tune). Their
    gradients are still computed: to skip them, give the patterns to the training step instead
    (``dynadiag_jax.training.train``'s ``finetune``, ``make_train_step(trained=...)``)."""
    trained = dd.optim.path_mask(patterns)

    def labels(params):
        return jax.tree.map(lambda hit: "trained" if hit else "fixed", trained(params))

    return optax.multi_transform({"trained": tx, "fixed": optax.set_to_zero()}, labels)


def split_params(params, patterns: Sequence[str]) -> tuple[dict, dict]:
    """``(trained, fixed)``: the params whose "/"-joined path fully matches a pattern, and the
    others, each nested as in ``params`` (so path-based masks see the same names) in plain dicts
    (a ``FrozenDict`` comes back as a dict); :func:`merge_params` joins them back. Raises
    ``ValueError`` if no param matches."""
    flat = traverse_util.flatten_dict(params, keep_empty_nodes=True)
    mask = dd.optim.path_mask(patterns, name="trained")
    hits = traverse_util.flatten_dict(mask(params), keep_empty_nodes=True)
    picked = {k for k, v in flat.items() if v is not traverse_util.empty_node and hits[k] is True}
    if not picked:
        raise ValueError(f"trained: the patterns {list(patterns)} match no param")
    trained = {k: v for k, v in flat.items() if k in picked}
    fixed = {k: v for k, v in flat.items() if k not in picked}
    return traverse_util.unflatten_dict(trained), traverse_util.unflatten_dict(fixed)


def merge_params(trained, fixed) -> dict:
    """The params :func:`split_params` split into ``trained`` and ``fixed``, as plain dicts."""
    flat = traverse_util.flatten_dict(fixed, keep_empty_nodes=True)
    flat.update(traverse_util.flatten_dict(trained))
    return traverse_util.unflatten_dict(flat)
