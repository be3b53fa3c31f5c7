"""The jitted training and evaluation steps (pure functions of the state and a batch)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from dynadiag_jax.nn.functional import GATE_COLLECTION
from dynadiag_jax.training.optimizer import merge_params, split_params
from dynadiag_jax.training.sparsity import (
    GateSchedule,
    apply_gate,
    is_searching,
    layer_metrics,
    rescore,
)
from dynadiag_jax.training.state import TrainState
from dynadiag_jax.training.working_set import has_working_set

__all__ = ["make_eval_step", "make_train_step"]


def make_train_step(
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    task,
    *,
    gate: GateSchedule | None = None,
    trained: Sequence[str] | None = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict]]:
    """``(state, batch) -> (state, metrics)``: one optimizer step on a (global) batch.

    Randomness: dropout and augmentation keys are ``fold_in(state.rng, state.step)``. In the search
    phase the gate's hyper-parameter is set from ``gate.schedule(state.step)`` and DiagonalDense's
    ``"dynadiag"`` collection is updated (its top-K tracking); the per-layer scalars the layers sow
    come back as metrics (``effective_k/<path>``, ...). Terms the layers sow into the ``"losses"``
    collection (a learned permutation's weighted penalty) are added to the loss that is
    differentiated; the metric ``loss`` stays the task's, ``aux_loss`` is their sum. The same
    function serves both phases: the frozen state has another structure, so ``jax.jit`` compiles
    it once more after the freeze.

    ``trained`` (path regexes, as :func:`dynadiag_jax.training.split_params` reads them): only
    those params are differentiated and updated, and ``optimizer`` (and ``state.opt_state``) sees
    only them; the others are constants of the loss, so no gradient is computed for them (with
    LoRA-FA's ``B`` alone, a diagonal layer's backward computes no ``values`` gradient and keeps
    no ``x`` for one). ``None``: every param. ``grad_norm`` is the trained params' gradient norm.

    A state in the working-set form (:func:`dynadiag_jax.training.enter_working_set`) is a third
    structure, compiled once more: its layers compute and update only their ``W`` working-set
    rows, and the restart of alpha (``gate.rescore_step``, which reads all ``P`` values) is not
    part of it; it does not combine with ``trained`` (``ValueError`` while tracing).
    """

    def train_step(state: TrainState, batch):
        key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        k_drop, k_data = jax.random.split(key)
        inputs, targets = task.train_inputs(batch, k_data)
        searching = is_searching(state.params)
        working_set = has_working_set(state.collections)
        if working_set and trained is not None:
            raise ValueError(
                "make_train_step: trained= (a subset of the params) does not combine with a "
                "state in the working-set form; leave it first (leave_working_set)"
            )
        params = (
            rescore(state.params, gate, state.step)
            if searching and not working_set
            else state.params
        )
        collections = (
            apply_gate(state.collections, gate, state.step) if searching else state.collections
        )
        mutable = (
            ["intermediates", "losses", GATE_COLLECTION]
            if searching and GATE_COLLECTION in collections
            else ["intermediates", "losses"]
        )

        fit, fixed = split_params(params, trained) if trained is not None else (params, {})

        def loss_fn(fit):
            logits, updated = model.apply(
                {"params": merge_params(fit, fixed) if trained is not None else fit, **collections},
                inputs,
                train=True,
                rngs={"dropout": k_drop},
                mutable=mutable,
            )
            loss, metrics = task.loss(logits, targets, batch)
            updated = dict(updated)
            extra = jax.tree.leaves(updated.pop("losses", {}))
            if extra:
                aux = sum(jnp.asarray(term, jnp.float32) for term in extra)
                loss, metrics = loss + aux, {**metrics, "aux_loss": aux}
            return loss, (metrics, updated)

        (_, (metrics, updated)), grads = jax.value_and_grad(loss_fn, has_aux=True)(fit)
        # optax mixes Python floats with int32 step counts (bias correction), which strict dtype
        # promotion rejects; the arithmetic is well defined under the standard rules.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = optimizer.update(grads, state.opt_state, fit)
        fit = optax.apply_updates(fit, updates)
        params = merge_params(fit, fixed) if trained is not None else fit
        updated = dict(updated)
        metrics = {
            **metrics,
            **layer_metrics(updated.pop("intermediates", {})),
            # The barrier keeps XLA from sharing g * g between this norm and Adam's second
            # moment: shared, it is written out as a buffer the size of the params (in a search
            # step all P candidates' values) instead of fused into both readers of g.
            "grad_norm": optax.tree.norm(jax.lax.optimization_barrier(grads)),
        }
        if searching and gate is not None:
            metrics[gate.name] = jnp.asarray(gate.schedule(state.step), jnp.float32)
        collections = {**collections, **updated}
        return TrainState(state.step + 1, params, opt_state, collections, state.rng), metrics

    return train_step


def make_eval_step(model: nn.Module, task) -> Callable[[TrainState, Any], dict]:
    """``(state, batch) -> sums``: the task's additive evaluation sums for one batch."""

    def eval_step(state: TrainState, batch):
        logits = model.apply(
            {"params": state.params, **state.collections}, task.eval_inputs(batch), train=False
        )
        return task.eval_sums(logits, batch)

    return eval_step
