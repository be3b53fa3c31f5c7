"""Config -> sparse-training method for the training scripts: the model's layers and the optimizer.

A method is one of :data:`METHODS`, built from the same config sections as the DynaDiag runs so
that every method trains the same layers (``dynadiag.layers``) at the same sparsity with the same
recipe:

* ``dense``: ``flax.linen.Dense`` everywhere;
* ``dynadiag``: DiagonalDense with the learned selection (search, then freeze);
* ``static_diagonals``: DiagonalDense in its frozen form from the start, ``K`` random offsets
  (with ``dynadiag.permutation="random"``, a fixed random input permutation too);
* ``rigl``, ``set``, ``mest``: dense layers whose selected kernels an optimizer wrapper keeps
  unstructured-sparse (masks in the optimizer state, :mod:`dynadiag_jax.baselines`);
* ``static_unstructured``: the same layers with RigL's and SET's first random mask, never
  updated (the control for their updates, as ``static_diagonals`` is for DynaDiag's search).

The ``unstructured`` config section holds the drop-and-grow schedule (see :func:`check`). Every
training script selects the method with its config's ``method`` entry (:func:`from_config`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import dynadiag_jax as dd
from dynadiag_jax import baselines as B
from dynadiag_jax import models
from dynadiag_jax import training as T
from train import common

METHODS = ("dense", "dynadiag", "static_diagonals", "static_unstructured", "rigl", "set", "mest")
UNSTRUCTURED = {
    "rigl": B.rigl,
    "set": B.set_,
    "mest": B.mest,
    "static_unstructured": B.static_mask,
}
DISTRIBUTIONS = {"uniform": B.uniform, "erk": B.erk}
# The entries of the ``dynadiag`` and ``unstructured`` sections that each method reads (a section's
# name: all of it); the other sections (model, optimizer, ...) every method reads.
READS = {
    "dense": (),
    "dynadiag": ("dynadiag",),
    "static_diagonals": (
        "dynadiag.layers",
        "dynadiag.sparsity",
        "dynadiag.block_size",
        "dynadiag.fan_in",
        "dynadiag.permutation",
    ),
    **{m: ("dynadiag.layers", "dynadiag.sparsity", "unstructured") for m in UNSTRUCTURED},
    # no updates: no schedule to read
    "static_unstructured": (
        "dynadiag.layers",
        "dynadiag.sparsity",
        "unstructured.distribution",
        "unstructured.fan_in",
    ),
}
# Folded into the run's seed for the masks' key, apart from the initialisation and data keys.
MASK_STREAM = 0x6D61736B


class Method(NamedTuple):
    """What a run of one method needs (arguments of :func:`dynadiag_jax.training.train`).

    Attributes:
      name: the method.
      model: the flax model.
      optimizer: the optax transformation (wrapped for unstructured methods).
      learning_rate: the learning-rate schedule (for logging).
      gate: the gate schedule (``dynadiag`` only, else ``None``).
      freeze_step: the freeze step (``dynadiag`` only, else ``None``).
      reads: the ``dynadiag`` and ``unstructured`` config entries the method reads (:data:`READS`).
      working_set: the search's working-set option (``dynadiag`` only; None: off).
      sparse_update_scale: the factor on the sparse weights' updates
        (``optimizer.sparse_lr_scale``; 1.0: none).
    """

    name: str
    model: Any
    optimizer: Any
    learning_rate: Callable
    gate: Any
    freeze_step: int | None
    reads: tuple[str, ...]
    working_set: Any = None
    sparse_update_scale: float = 1.0


def check(method: str, unstructured_cfg) -> None:
    """Raise :class:`common.ConfigError` for an unknown method or a bad ``unstructured`` section."""
    if method not in METHODS:
        raise common.ConfigError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if unstructured_cfg.distribution not in DISTRIBUTIONS:
        raise common.ConfigError(
            f"unstructured.distribution must be one of {sorted(DISTRIBUTIONS)}, "
            f"got {unstructured_cfg.distribution!r}"
        )
    if not 0.0 < float(unstructured_cfg.end_fraction) <= 1.0:
        raise common.ConfigError(
            f"unstructured.end_fraction must be in (0, 1], got {unstructured_cfg.end_fraction}"
        )
    if unstructured_cfg.fan_in not in dd.nn.functional.FAN_INS:
        raise common.ConfigError(
            f"unstructured.fan_in must be one of {dd.nn.functional.FAN_INS}, "
            f"got {unstructured_cfg.fan_in!r}"
        )
    if unstructured_cfg.fan_in == "sparse" and unstructured_cfg.distribution != "uniform":
        raise common.ConfigError(
            "unstructured.fan_in='sparse' scales every sparse layer by the same density: it "
            f"needs distribution='uniform', got {unstructured_cfg.distribution!r}"
        )
    if int(unstructured_cfg.update_every) < 1:
        raise common.ConfigError(
            f"unstructured.update_every must be >= 1, got {unstructured_cfg.update_every}"
        )


def kernel_include(layer_patterns) -> Callable:
    """``(path, leaf) -> bool`` selecting the kernels of the layers ``dynadiag.layers`` names."""
    return B.include_paths([f"^(?:{p})/kernel$" for p in layer_patterns])


# optimizer.sparse_lr_scale: "none", or "init_gain": the sparse layers' weights (DiagonalDense
# values, the unstructured methods' selected kernels) take updates scaled by the gain their init
# has over the dense layer's (1 / sqrt(density) with fan_in="sparse", else 1). Adam's steps are
# about the learning rate whatever a weight's size, so weights started that many times larger
# otherwise change that many times more slowly, relative to their size, than the dense layer's.
SPARSE_LR_SCALES = ("none", "init_gain")


def sparse_update_scale(method: str, optimizer_cfg, init_fan_in: str, sparsity: float) -> float:
    """The factor ``optimizer.sparse_lr_scale`` puts on the updates of ``method``'s sparse
    weights at ``sparsity``, whose init follows ``init_fan_in`` (1.0: none)."""
    mode = optimizer_cfg.get("sparse_lr_scale", "none")
    if mode not in SPARSE_LR_SCALES:
        raise common.ConfigError(
            f"optimizer.sparse_lr_scale must be one of {SPARSE_LR_SCALES}, got {mode!r}"
        )
    if mode == "none" or method == "dense" or init_fan_in != "sparse":
        return 1.0
    return dd.optim.init_gain(sparsity)


def scaled_sparse_updates(tx, layer_patterns, weight: str, factor: float):
    """``tx`` with its updates of the ``weight`` (``"kernel"``, ``"values"``) of the layers
    ``layer_patterns`` names multiplied by ``factor``."""
    weights = dd.optim.path_mask([f"(?:{p})/{weight}" for p in layer_patterns])
    return optax.chain(tx, optax.masked(optax.scale(factor), weights))


def scaled_initializer(init, gain: float):
    """``init`` with every value multiplied by ``gain``."""

    def scaled(key, shape, dtype=jnp.float32):
        return (gain * init(key, shape, jnp.float32)).astype(dtype)

    return scaled


def with_sparsity(dynadiag_cfg, sparsity: float):
    """A copy of the ``dynadiag`` config section with ``sparsity`` set."""
    cfg = dynadiag_cfg.copy_and_resolve_references()
    with cfg.unlocked():
        cfg.sparsity = float(sparsity)
    return cfg


def model_with_layer(model_cfg, dynadiag_cfg, layer: Callable, **model_kwargs):
    """The model with ``layer`` (a constructor like ``partial(BCOODense, sparsity=0.9)``) in place
    of every layer that ``dynadiag_cfg.layers`` selects; the other layers stay dense.

    ``model_kwargs`` (e.g. ``num_classes``) go to the model's constructor with the config's."""
    dense = common.build_model(model_cfg, with_sparsity(dynadiag_cfg, 0.0), **model_kwargs)
    return dense.clone(dense=models.ByPath(tuple(dynadiag_cfg.layers), sparse=layer))


def build(
    method: str,
    *,
    model_cfg,
    dynadiag_cfg,
    unstructured_cfg,
    optimizer_cfg,
    sparsity: float,
    num_steps: int,
    warmup_steps: int,
    seed: int,
    **model_kwargs,
) -> Method:
    """The model, optimizer, gate schedule and freeze step of ``method`` at ``sparsity``.

    ``sparsity`` is ignored for ``dense``; ``model_kwargs`` (``num_classes=...``, ...) go to the
    model's constructor. Raises :class:`common.ConfigError` on bad settings.
    """
    check(method, unstructured_cfg)
    if method != "dense" and not 0.0 < float(sparsity) < 1.0:
        raise common.ConfigError(
            f"dynadiag.sparsity must be 0 (dense) or in (0, 1), got {sparsity} (method {method})"
        )
    diag_cfg = with_sparsity(dynadiag_cfg, sparsity if method == "dynadiag" else 0.0)
    unstructured = method in UNSTRUCTURED
    fan_in = unstructured_cfg.fan_in if unstructured else dynadiag_cfg.fan_in
    scale = sparse_update_scale(method, optimizer_cfg, fan_in, sparsity)
    optimizer, lr = common.build_optimizer(
        optimizer_cfg,
        diag_cfg,
        num_steps,
        warmup_steps,
        values_lr_scale=1.0 if unstructured else scale,
    )
    if unstructured and scale != 1.0:  # their sparse weights are the masked kernels
        optimizer = scaled_sparse_updates(optimizer, dynadiag_cfg.layers, "kernel", scale)
    gate = freeze = working_set = None
    if method == "dynadiag":
        model = common.build_model(model_cfg, diag_cfg, **model_kwargs)
        freeze = common.freeze_step(diag_cfg, num_steps)
        gate = common.gate_schedule(diag_cfg, freeze, num_steps)
        working_set = common.working_set(diag_cfg, gate, freeze, num_steps)
    elif method == "static_diagonals":
        permutation = common.permutation_of(dynadiag_cfg)
        if permutation == "learned":
            raise common.ConfigError(
                "static_diagonals never search, so a learned permutation would never be hardened: "
                "use dynadiag.permutation='random' (or 'none') with static_diagonals"
            )
        static = functools.partial(
            dd.nn.DiagonalDense,
            sparsity=float(sparsity),
            block_size=int(dynadiag_cfg.block_size),
            init_phase="frozen",
            fan_in=dynadiag_cfg.fan_in,
            impl=dynadiag_cfg.get("impl", "auto"),
            permutation=permutation,
        )
        model = model_with_layer(model_cfg, dynadiag_cfg, static, **model_kwargs)
    elif method in UNSTRUCTURED and unstructured_cfg.fan_in == "sparse":
        kernel_init = scaled_initializer(
            common.dense_kernel_init(model_cfg), dd.optim.init_gain(sparsity)
        )
        dense = functools.partial(nn.Dense, kernel_init=kernel_init)
        model = model_with_layer(model_cfg, dynadiag_cfg, dense, **model_kwargs)
    else:
        model = common.build_model(model_cfg, diag_cfg, **model_kwargs)
    if method in UNSTRUCTURED:
        u = unstructured_cfg
        distribution = functools.partial(
            DISTRIBUTIONS[u.distribution],
            sparsity=float(sparsity),
            include=kernel_include(dynadiag_cfg.layers),
        )
        kwargs = dict(
            distribution=distribution, key=jax.random.fold_in(T.seed_key(seed), MASK_STREAM)
        )
        if method != "static_unstructured":
            end_step = max(1, round(float(u.end_fraction) * num_steps))
            if method == "mest":
                # its last update at end_step prunes back to the budget: one at or after the
                # last step never runs, and the run ended above its budget
                end_step = min(end_step, num_steps - 1)
            if int(u.update_every) >= end_step:
                # the first mask update is at step update_every; none would come before the end
                raise common.ConfigError(
                    f"{method} updates its masks from step unstructured.update_every="
                    f"{u.update_every} until unstructured.end_fraction={u.end_fraction} of the "
                    f"{num_steps} training steps (step {end_step}): no update would run; "
                    f"set unstructured.update_every below {end_step}"
                )
            kwargs.update(update_every=int(u.update_every), end_step=end_step)
        if method == "mest":
            kwargs.update(mutation_ratio=float(u.mutation_ratio), soft_bound=bool(u.soft_bound))
        elif method in ("rigl", "set"):
            kwargs.update(drop_fraction=float(u.drop_fraction))
        optimizer = UNSTRUCTURED[method](optimizer, **kwargs)
    return Method(method, model, optimizer, lr, gate, freeze, READS[method], working_set, scale)


def block_size(method: Method, dynadiag_cfg) -> int:
    """The block size ``method`` trains with: ``dynadiag.block_size`` where it reads it, else 1."""
    reads_it = "dynadiag" in method.reads or "dynadiag.block_size" in method.reads
    return int(dynadiag_cfg.block_size) if reads_it else 1


def from_config(config, *, num_steps: int, warmup_steps: int, **model_kwargs) -> Method:
    """The method that ``config.method`` names (``dense`` when ``dynadiag.sparsity`` is 0), built
    from the config's ``model``, ``dynadiag``, ``unstructured`` and ``optimizer`` sections."""
    sparsity = float(config.dynadiag.sparsity)
    check(config.method, config.unstructured)  # a misspelt method at sparsity 0 trained dense
    return build(
        config.method if sparsity else "dense",
        model_cfg=config.model,
        dynadiag_cfg=config.dynadiag,
        unstructured_cfg=config.unstructured,
        optimizer_cfg=config.optimizer,
        sparsity=sparsity,
        num_steps=num_steps,
        warmup_steps=warmup_steps,
        seed=int(config.seed),
        **model_kwargs,
    )
