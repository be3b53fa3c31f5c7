"""A run's fine-tuning phase: LoRA-FA adapters (or some params alone) trained on the frozen model.

:class:`Finetune` describes the phase :func:`dynadiag_jax.training.train` switches to at its
``start_step`` (after the freeze, or at once on a frozen checkpoint's variables);
:func:`enter_finetune` is the switch: the phase's model (e.g. ``dd.nn.lora_fa(model, ...)``) is
initialised, every variable the run already has keeps its value, the new ones (the adapters' ``A``
and ``B``) take the init's, and the phase's optimizer starts over the trained params alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util

from dynadiag_jax.training.optimizer import split_params
from dynadiag_jax.training.state import TrainState, seed_key

__all__ = ["Finetune", "enter_finetune", "new_variables"]


class Finetune(NamedTuple):
    """The last phase of a run.

    Attributes:
      start_step: the step it starts at: the state with ``step == start_step`` is the first of
        the phase (at or after the freeze; 0 for a run that starts from frozen variables).
      model: the phase's model, called as the run's; its variables are the run's plus new ones
        (``dd.nn.lora_fa(model, layers, rank=r)``: ``lora_b`` and ``"lora_frozen"`` ``lora_a``),
        or exactly the run's (the run's own model: fine-tune some params without adapters).
      optimizer: the phase's optimizer, over the ``trained`` params only; its step count starts
        at 0 at ``start_step``.
      trained: path regexes (``re.fullmatch`` on "/"-joined param paths) of the params the phase
        trains, e.g. ``(r".*/lora_b",)``; the others are not differentiated.
      learning_rate: the phase's schedule (of its own step count), only to log its value.
    """

    start_step: int
    model: nn.Module
    optimizer: optax.GradientTransformation
    trained: Sequence[str]
    learning_rate: Callable | None = None


def new_variables(template, have) -> dict:
    """``template`` (the phase model's init) with every variable ``have`` holds taken from
    ``have``: only what the phase adds keeps the init's value.

    Raises:
      ValueError: a variable of ``have`` is absent from ``template`` or has another shape there
        (the phase's model is not the run's model plus adapters), naming the first few.
    """
    old = traverse_util.flatten_dict(have, sep="/")
    new = traverse_util.flatten_dict(template, sep="/")
    problems = [
        f"{key}: {np.shape(value)} in the run, "
        f"{np.shape(new[key]) if key in new else 'absent'} in the fine-tuned model"
        for key, value in sorted(old.items())
        if key not in new or np.shape(new[key]) != np.shape(value)
    ]
    if problems:
        raise ValueError(
            "the fine-tuning phase's model does not extend the run's: "
            + "; ".join(problems[:6])
            + ("; ..." if len(problems) > 6 else "")
        )
    return traverse_util.unflatten_dict({k: old.get(k, v) for k, v in new.items()}, sep="/")


def enter_finetune(state: TrainState, phase: Finetune, example_input, *, seed: int) -> TrainState:
    """``state`` (frozen) as the first state of ``phase``: its variables plus the phase model's
    new ones, drawn with ``seed_key(seed)`` as the ``"params"`` RNG (so an adapter's ``A``
    depends only on the seed and its layer's path), and the phase optimizer's fresh state over the
    trained params. Same step and RNG. Pure and jit-able (works under ``jax.eval_shape``).
    """
    x = jnp.zeros(example_input.shape, example_input.dtype)
    key = seed_key(seed)
    template = phase.model.init({"params": key, "dropout": key}, x, train=False)
    template = {k: v for k, v in template.items() if k != "intermediates"}
    variables = dict(new_variables(template, {"params": state.params, **state.collections}))
    params = variables.pop("params")
    opt_state = phase.optimizer.init(split_params(params, phase.trained)[0])
    return TrainState(state.step, params, opt_state, variables, state.rng)
