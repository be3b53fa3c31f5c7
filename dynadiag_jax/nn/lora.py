"""``lora_fa``: LoRA-FA adapters on the linear layers of any linen model, chosen by module path.

LoRA-FA (Zhang et al., "LoRA-FA: Memory-efficient Low-rank Adaptation for Large Language Models
Fine-tuning", 2023, https://arxiv.org/abs/2308.03303) adds a rank-``r`` term to a layer:

    y = layer(x) + (alpha / r) * (x @ A.T) @ B.T,   A[r, in] random and frozen, B[out, r] zero.

Only ``B`` is trained, so the adapter's backward pass needs the ``r``-wide ``x @ A.T``, not ``x``,
and at the start (``B = 0``) the adapted model computes exactly what the base model does. That
activation saving needs a gradient taken for ``B`` alone: ``make_train_step(trained=...)`` and a
run's :class:`dynadiag_jax.training.Finetune` phase differentiate only the trained params, so a
diagonal layer's ``values`` get no gradient product (:func:`dynadiag_jax.training.train_only`
zeroes the frozen params' updates but still computes their gradients).

``lora_fa(module, layers, rank=...)`` wraps ``module`` as :func:`dynadiag_jax.nn.sparsify` does (a
subclass of its class whose calls run under a method interceptor): every ``nn.Dense`` and
``DiagonalDense`` call whose module path a pattern matches runs as before, plus the adapter,
whose variables live in *the layer's own scope*: ``params/<path>/lora_b[out, r]`` (trained) and
``lora_frozen/<path>/lora_a[r, in]`` (a collection no optimizer sees). A diagonal layer's product
keeps running through :func:`dynadiag_jax.diag_matmul`, in either phase. ``B A`` is dense, so it
cannot be merged into a diagonal layer's ``values``: the adapter stays a separate low-rank
product, ``r * (in + out)`` more weights (``r * out`` of them trained) and as many multiply-adds
per row.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from dynadiag_jax._checks import finite_number, floating_dtype
from dynadiag_jax.nn.diagonal_dense import DiagonalDense
from dynadiag_jax.nn.sparsify import PathSession, Rule, intercepted

__all__ = ["FROZEN_COLLECTION", "LoRAFA", "default_a_init", "lora_fa"]

# The collection of the frozen projections A: not "params", so gradients and optimizers skip it.
FROZEN_COLLECTION = "lora_frozen"
# Exactly these classes: a subclass may compute something else in its own __call__.
ADAPTED_TYPES = (nn.Dense, DiagonalDense)


def default_a_init(key, shape, dtype=jnp.float32):
    """``A[r, in]`` ~ N(0, 1/in): each entry of ``x @ A.T`` has about the scale of ``x``'s."""
    return nn.initializers.normal(1.0 / math.sqrt(shape[-1]))(key, shape, dtype)


def low_rank_term(x, a, b, scale: float):
    """``scale * (x @ A.T) @ B.T`` in ``x``'s dtype: ``x[..., in]``, ``A[r, in]``, ``B[out, r]``
    -> ``[..., out]`` (the ``r``-wide product first: ``B A`` is never formed)."""
    return scale * ((x @ a.T.astype(x.dtype)) @ b.T.astype(x.dtype))


class LoRAFA(nn.Module):
    """The adapter term ``scale * (x @ A.T) @ B.T`` of one layer (``scale = alpha / rank``).

    ``A`` (``"lora_frozen"`` ``lora_a[rank, in]``) is drawn from ``a_init`` with the ``"params"``
    RNG at init; ``B`` (``params`` ``lora_b[features, rank]``) starts at zero. Computed in ``x``'s
    dtype. Shapes: ``x[..., in] -> [..., features]``.
    """

    features: int
    rank: int
    scale: float
    a_init: Any = default_a_init
    param_dtype: Any = jnp.float32
    label: str = "LoRAFA"  # the adapted layer's path, for error messages

    @nn.compact
    def __call__(self, x):
        width = x.shape[-1]
        check_rank(self.rank, width, self.features, self.label, "lora_fa")
        if self.is_initializing() and not self.scope.is_mutable_collection(FROZEN_COLLECTION):
            # Inside nn.scan/nn.vmap a collection the transform does not list cannot be created.
            raise ValueError(
                f"lora_fa: the layer at {self.label!r} sits in a lifted transform (nn.scan, "
                f"nn.vmap) that does not carry the {FROZEN_COLLECTION!r} collection: list it in "
                f"its variable_axes, or leave this layer out of the patterns"
            )
        if not self.is_initializing() and not self.has_variable(FROZEN_COLLECTION, "lora_a"):
            raise ValueError(
                f"lora_fa: the layer at {self.label!r} has no frozen projection A: pass the "
                f"{FROZEN_COLLECTION!r} collection made by init with the params (variables"
                f"[{FROZEN_COLLECTION!r}][<layer path>]['lora_a'])"
            )
        a = self.variable(
            FROZEN_COLLECTION,
            "lora_a",
            lambda: self.a_init(self.make_rng("params"), (self.rank, width), self.param_dtype),
        ).value
        b = self.param(
            "lora_b", nn.initializers.zeros, (self.features, self.rank), self.param_dtype
        )
        return low_rank_term(x, a, b, self.scale)


class _Session(PathSession):
    """Adds the adapter to every matched layer call, once per call: a layer standing in for
    another at the same path (``sparsify``'s ``DiagonalDense`` for an ``nn.Dense``) is not
    adapted again inside the outer layer's call."""

    def __init__(self, owner, rules, root):
        super().__init__(owner, rules, root)
        self.active: list[str] = []  # paths of the adapted calls in progress
        self.unadapted: dict[str, None] = {}  # nn.DenseGeneral layers seen, in call order

    def intercept(self, next_fun, args, kwargs, context):
        layer = context.module
        if type(layer) is nn.DenseGeneral and context.method_name == "__call__":
            path = self.relative_path(layer)
            if path is not None:
                self.unadapted[path] = None
        if type(layer) not in ADAPTED_TYPES or context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        hit = self.rule_for(layer)
        if hit is None or hit[0] in self.active:
            return next_fun(*args, **kwargs)
        path, rule = hit
        self.active.append(path)
        try:
            y = next_fun(*args, **kwargs)
        finally:
            self.active.pop()
        x = args[0] if args else kwargs["inputs" if "inputs" in kwargs else "x"]
        adapter = LoRAFA(y.shape[-1], parent=layer.scope, label=path, **rule.kwargs)
        return y + adapter(x.astype(y.dtype))

    def note(self) -> str:
        if not self.unadapted:
            return ""
        listed = "\n  ".join(self.unadapted)
        return (
            f"\nand these nn.DenseGeneral layers, which take no adapter (e.g. attention "
            f"projections; dd.nn.sparsify them first, and adapt the DiagonalDense layers it "
            f"makes):\n  {listed}"
        )


def adapter_rules(layers, rank, alpha, who: str, **extra) -> tuple[Rule, ...]:
    """``layers`` (path regexes) checked and compiled into rules whose kwargs are the adapter's:
    ``rank``, ``scale = alpha / rank`` (``alpha`` None: ``rank``) and ``extra``."""
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise TypeError(f"{who}: layers must be a sequence of regular expressions, got {layers!r}")
    if not layers:
        raise ValueError(f"{who}: layers is empty: no layer would get an adapter")
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):
        raise TypeError(f"{who}: rank must be an int, got {type(rank).__name__}")
    if rank < 1:
        raise ValueError(f"{who}: rank must be an int >= 1, got {rank!r}")
    alpha = finite_number(rank if alpha is None else alpha, f"{who}: alpha")
    if alpha == 0:  # B's gradient is scaled by alpha too: the adapter could never move
        raise ValueError(f"{who}: alpha=0 scales the adapter to nothing (and its gradient)")
    if not callable(extra.get("a_init", callable)):
        raise TypeError(
            f"{who}: a_init must be an initializer, (key, shape, dtype) -> array, got "
            f"{extra['a_init']!r}"
        )
    if "param_dtype" in extra:
        extra["param_dtype"] = floating_dtype(extra["param_dtype"], f"{who}: param_dtype")
    kwargs = {"rank": int(rank), "scale": alpha / int(rank), **extra}
    rules = []
    for i, pattern in enumerate(layers):
        if not isinstance(pattern, str):
            raise TypeError(f"{who}: layers[{i}] must be a str regex, got {pattern!r}")
        try:
            rules.append(Rule(pattern, re.compile(pattern), kwargs))
        except re.error as e:
            raise ValueError(f"{who}: layers[{i}] pattern {pattern!r} is invalid: {e}") from None
    return tuple(rules)


def check_rank(rank: int, n_in: int, n_out: int, path: str, who: str) -> None:
    """Raises unless ``rank <= min(n_in, n_out)``, naming the layer."""
    if rank > min(n_in, n_out):
        raise ValueError(
            f"{who}: rank={rank} exceeds min(in, out) = {min(n_in, n_out)} of the layer at "
            f"{path!r} ({n_in} -> {n_out}); lower rank or leave this layer out of the patterns"
        )


def lora_fa(
    module: nn.Module,
    layers: Sequence[str],
    *,
    rank: int,
    alpha: float | None = None,
    a_init=default_a_init,
    param_dtype=jnp.float32,
) -> nn.Module:
    """``module`` with a LoRA-FA adapter on every ``nn.Dense``/``DiagonalDense`` ``layers`` match.

    Args:
      module: an unbound linen module (any model, also one returned by
        :func:`dynadiag_jax.nn.sparsify`; its source is not edited).
      layers: regular expressions (as a config's ``dynadiag.layers``), each ``re.fullmatch``-ed
        against the layers' module paths (names joined by ``"/"`` as in the params tree, e.g.
        ``"hidden_0"``); every pattern must match at least one layer.
      rank: ``r``, an int in ``[1, min(in, out)]`` of every matched layer.
      alpha: the scale is ``alpha / rank`` (default: ``alpha = rank``, scale 1).
      a_init: initializer of the frozen ``A[r, in]`` (default N(0, 1/in)).
      param_dtype: dtype of ``A`` and ``B``.

    Returns:
      A module of a subclass of ``type(module)`` with the same fields. Its ``init`` adds, at each
      matched layer's path, ``params`` ``lora_b[out, r]`` (zeros) and ``"lora_frozen"``
      ``lora_a[r, in]``; its ``apply`` needs the ``"lora_frozen"`` collection with the params.

    Raises:
      TypeError, ValueError: at once for a bad pattern, ``rank`` or ``alpha``, or a module that is
        bound or already adapted; at ``init`` for a pattern that matches no layer (the message lists
        the layers there are), a ``rank`` above a matched layer's ``min(in, out)``, or a layer in an
        ``nn.scan``/``nn.vmap`` that does not carry ``"lora_frozen"``, naming the layer's path.
    """
    rules = adapter_rules(layers, rank, alpha, "lora_fa", a_init=a_init, param_dtype=param_dtype)
    return intercepted(module, "lora_fa", "adapted", rules, _Session)
