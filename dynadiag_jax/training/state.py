"""The training state: one pytree holding everything a checkpoint must restore."""

from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from dynadiag_jax.baselines import SparseState, apply_masks
from dynadiag_jax.training.optimizer import split_params

__all__ = ["TrainState", "create_train_state", "variables_of"]


class TrainState(NamedTuple):
    """Everything that changes during training.

    Attributes:
      step: int32 scalar, the number of optimizer steps taken.
      params: the ``"params"`` collection.
      opt_state: the optimizer state for ``params``.
      collections: the model's other variable collections (e.g. DiagonalDense's gate values in
        ``"dynadiag"`` and, once frozen, its offsets in ``"diagonals"``).
      rng: raw key data (``jax.random.key_data``) of the run's base key; step ``t`` uses
        ``fold_in(key, t)``, so randomness depends only on the seed and the step.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    collections: Any
    rng: jax.Array


def variables_of(state: TrainState) -> dict:
    """``{"params": ..., **collections}``, ready for ``model.apply``."""
    return {"params": state.params, **state.collections}


def seed_key(seed: int) -> jax.Array:
    """``jax.random.key(seed)`` for a seed in ``[0, 2**32)``; any other 64-bit seed has its high
    word folded in (``jax.random.key`` keeps the low 32 bits alone without x64: seeds 5 and
    ``2**32 + 5`` drew the same weights, -1 and ``2**32 - 1`` too)."""
    word = int(seed) % 2**64
    key = jax.random.key(word & 0xFFFFFFFF)
    return key if word >> 32 == 0 else jax.random.fold_in(key, word >> 32)


def create_train_state(
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    example_input,
    *,
    seed: int,
    variables=None,
    trained=None,
) -> TrainState:
    """Initialise parameters from ``seed`` (or take ``variables``) and the optimizer state.

    Args:
      model: a flax.linen model called as ``model(x, train=...)``.
      optimizer: the optax transformation used for training.
      example_input: an input batch (or ``jax.ShapeDtypeStruct``) with the training shapes.
      seed: the run's seed; the initialisation key and the per-step base key are both split
        from :func:`seed_key` of it (``jax.random.key(seed)`` for seeds in ``[0, 2**32)``).
      variables: the model's variables to start from instead of its init (e.g.
        :func:`dynadiag_jax.from_dense`'s); they must have the init's structure and shapes.
      trained: path regexes: the optimizer state covers only the params they match (as
        :func:`dynadiag_jax.training.make_train_step`'s ``trained``); None: every param.

    Works under ``jax.eval_shape`` (for abstract checkpoint targets).
    """
    key = seed_key(seed)
    init_key, run_key = jax.random.split(key)
    x = jnp.zeros(example_input.shape, example_input.dtype)
    initial = model.init({"params": init_key, "dropout": init_key}, x, train=False)
    initial = {k: v for k, v in initial.items() if k != "intermediates"}
    if variables is not None:
        _check_like(variables, initial)
        initial = variables
    variables = dict(initial)
    params = variables.pop("params")
    opt_state = optimizer.init(params if trained is None else split_params(params, trained)[0])
    if isinstance(opt_state, SparseState):  # unstructured baselines: train from the masked weights
        params = apply_masks(params, opt_state.masks)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=opt_state,
        collections=variables,
        rng=jax.random.key_data(run_key),
    )


def _check_like(variables, initial) -> None:
    """Raises naming the paths where ``variables`` differ from the model's init in shape."""
    shapes = lambda tree: {  # noqa: E731
        jax.tree_util.keystr(path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }
    given, expected = shapes(variables), shapes(initial)
    problems = [
        f"{path}: given {given.get(path, 'nothing')}, the model has {expected.get(path, 'nothing')}"
        for path in sorted(set(given) | set(expected))
        if given.get(path) != expected.get(path)
    ]
    if problems:
        raise ValueError(
            "the initial variables do not fit the model: "
            + "; ".join(problems[:6])
            + ("; ..." if len(problems) > 6 else "")
        )
