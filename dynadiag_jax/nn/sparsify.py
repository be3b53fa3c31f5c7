"""``sparsify``: diagonal layers in any Flax linen model, chosen by module path, with no edit of it.

``sparsify(module, rules)`` returns ``module`` as an instance of a subclass of its own class (same
fields, methods and names) whose method calls run under a method interceptor
(``flax.linen.intercept_methods``). The interceptor sees every ``nn.Dense`` / ``nn.DenseGeneral``
call; where the layer's module path matches a rule, it calls a :class:`DiagonalDense` bound to the
*layer's own scope* instead of the layer's ``__call__``. The replaced layer's variables are then
exactly a ``DiagonalDense``'s, at the dense layer's path (``params`` ``alpha``, ``values``,
``bias``; the ``"dynadiag"`` gate state; ``"diagonals"``), so :func:`dynadiag_jax.nn.set_gate`,
:func:`dynadiag_jax.freeze_tree`, :func:`dynadiag_jax.freeze_opt_state`, checkpoints and
:func:`dynadiag_jax.export` see an ordinary DynaDiag model. ``DiagonalDense`` tells the phase from
the variables it finds, so the same sparsified module runs frozen variables too.

``nn.DenseGeneral`` maps to a diagonal layer over the flattened sizes: ``x[..., *in] ->
y[..., *features]`` is ``DiagonalDense(prod(features))`` on ``x[..., prod(in)]``, reshaped back
(the q/k/v projections ``[d] -> [heads, head_dim]`` and the output projection
``[heads, head_dim] -> [d]`` of ``nn.MultiHeadDotProductAttention``). The contracted axes must be
the trailing ones and ``batch_dims`` empty; anything else is a ``ValueError`` naming the path.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import threading
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import flax.linen as nn
import jax

from dynadiag_jax.nn.diagonal_dense import DiagonalDense
from dynadiag_jax.nn.functional import CARRY_ADVICE, LAYER_COLLECTIONS, uncarried_collections

__all__ = ["LinearLayer", "linear_layer_paths", "sparsify"]

# Exactly these classes: a subclass may compute something else in its own __call__.
LINEAR_TYPES = (nn.Dense, nn.DenseGeneral)
# DiagonalDense fields a rule may not set: the replaced layer fixes them.
_FIXED = ("features", "in_features", "name", "parent")


class Rule(NamedTuple):
    """One ``(pattern, kwargs)`` rule, compiled."""

    pattern: str
    regex: re.Pattern
    kwargs: dict


class LinearLayer(NamedTuple):
    """One ``nn.Dense`` / ``nn.DenseGeneral`` of a model (:func:`linear_layer_paths`)."""

    path: str  # module path, "/"-joined, relative to the model
    kind: str  # "Dense" or "DenseGeneral"
    in_shape: tuple[int, ...]  # the contracted axes of x
    out_shape: tuple[int, ...]  # features


def parse_rules(rules, who: str) -> tuple[Rule, ...]:
    """``rules`` (a sequence of ``(regex, kwargs)`` pairs, or an ordered mapping) checked and
    compiled: each regex compiles and each ``kwargs`` makes a valid ``DiagonalDense``."""
    if isinstance(rules, Mapping):
        rules = list(rules.items())
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise TypeError(
            f"{who}: rules must be a sequence of (regex, kwargs) pairs, got {type(rules).__name__}"
        )
    if not rules:
        raise ValueError(f"{who}: rules is empty: the module would come back unchanged")
    out = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2):
            raise TypeError(f"{who}: rules[{i}] must be a (regex, kwargs) pair, got {rule!r}")
        pattern, kwargs = rule
        if not isinstance(pattern, str) or not isinstance(kwargs, Mapping):
            raise TypeError(
                f"{who}: rules[{i}] must be (str regex, mapping of DiagonalDense keyword "
                f"arguments), got ({type(pattern).__name__}, {type(kwargs).__name__})"
            )
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{who}: rules[{i}] pattern {pattern!r} is invalid: {e}") from None
        fixed = sorted(set(kwargs) & set(_FIXED))
        if fixed:
            raise ValueError(
                f"{who}: rules[{i}] ({pattern!r}) sets {fixed}, which the replaced layer fixes"
            )
        known = {f.name for f in dataclasses.fields(DiagonalDense) if f.init}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(
                f"{who}: rules[{i}] ({pattern!r}) has keyword arguments DiagonalDense does not "
                f"take: {unknown}; it takes {sorted(known - set(_FIXED))}"
            )
        try:
            DiagonalDense(1, **kwargs)  # validates every value (sparsity, block_size, gate, ...)
        except (TypeError, ValueError) as e:
            raise type(e)(f"{who}: rules[{i}] ({pattern!r}): {e}") from None
        out.append(Rule(pattern, regex, dict(kwargs)))
    return tuple(out)


def first_match(rules: Sequence[Rule], path: str) -> int | None:
    """Index of the first rule whose regex ``re.fullmatch``-es ``path``, else None."""
    for i, rule in enumerate(rules):
        if rule.regex.fullmatch(path):
            return i
    return None


def unmatched_message(who: str, rules, matched, paths: Sequence[str], model: str) -> str:
    """The error for rules that matched no linear layer, listing the layers there are."""
    missing = ", ".join(repr(r.pattern) for i, r in enumerate(rules) if i not in matched)
    # layers are taken by their exact class: a subclass of nn.Dense is none of them
    listed = "\n  ".join(paths) if paths else "(none; a subclass of the layer classes is not one)"
    return (
        f"{who}: rule pattern(s) {missing} match no linear layer of {model} (patterns are matched "
        f"with re.fullmatch against these module paths):\n  {listed}"
    )


def _call_input(args, kwargs):
    """The ``inputs`` argument of a ``Dense``/``DenseGeneral`` call."""
    return args[0] if args else kwargs["inputs"]


def _shapes(layer, x) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """``(contracted axes, in_shape, out_shape)`` of a ``Dense``/``DenseGeneral`` call on ``x``."""
    if isinstance(layer, nn.DenseGeneral):
        axis = layer.axis if isinstance(layer.axis, Sequence) else (layer.axis,)
        axes = tuple(sorted(a % x.ndim for a in axis))
        features = layer.features if isinstance(layer.features, Sequence) else (layer.features,)
        return axes, tuple(x.shape[a] for a in axes), tuple(features)
    return (x.ndim - 1,), (x.shape[-1],), (layer.features,)


def _diagonal_call(layer, path: str, rule: Rule, x):
    """What a replaced ``layer`` computes: a ``DiagonalDense`` in its scope, on flattened sizes."""
    axes, in_shape, out_shape = _shapes(layer, x)
    if isinstance(layer, nn.DenseGeneral):
        batch_dims = layer.batch_dims
        if batch_dims if isinstance(batch_dims, Sequence) else True:
            raise ValueError(
                f"sparsify: the nn.DenseGeneral at {path!r} has batch_dims={layer.batch_dims!r}: "
                f"a diagonal layer has one weight for every batch entry; leave this layer out of "
                f"the rules"
            )
        if axes != tuple(range(x.ndim - len(axes), x.ndim)):
            raise ValueError(
                f"sparsify: the nn.DenseGeneral at {path!r} contracts axes {layer.axis!r} of an "
                f"input of shape {tuple(x.shape)}: a diagonal layer maps the trailing axes "
                f"(axis=-1, or (-2, -1), ...) only; leave this layer out of the rules"
            )
    if uncarried_collections(layer):
        raise ValueError(
            f"sparsify: the layer at {path!r} sits in a lifted transform (nn.scan, nn.vmap) that "
            f"does not carry the collections {list(LAYER_COLLECTIONS)} a diagonal layer keeps "
            f"beside 'params': {CARRY_ADVICE}, or leave this layer out of the rules"
        )
    kwargs = {
        "use_bias": layer.use_bias,
        "dtype": layer.dtype,
        "param_dtype": layer.param_dtype,
        "kernel_init": layer.kernel_init,
        "bias_init": layer.bias_init,
        **rule.kwargs,
    }
    # parent=<the dense layer's scope>: the variables go where the dense layer's would.
    diagonal = DiagonalDense(math.prod(out_shape), parent=layer.scope, **kwargs)
    lead = x.shape[: x.ndim - len(in_shape)]
    y = diagonal(x.reshape((*lead, math.prod(in_shape))))
    return y.reshape((*lead, *out_shape))


class PathSession:
    """What the interceptor of one outermost call of a wrapped module saw: the rules it matched
    and every layer path it was asked about (for the unmatched-rule error)."""

    def __init__(self, owner: type, rules: tuple[Rule, ...], root: tuple):
        self.owner = owner
        self.rules = rules
        self.root = root
        self.matched: set[int] = set()
        self.paths: dict[str, None] = {}  # every candidate layer seen, in call order

    def relative_path(self, module) -> str | None:
        path = tuple(module.path)
        if path[: len(self.root)] != self.root:
            return None  # a module bound outside the wrapped one: not its layer
        return "/".join(path[len(self.root) :])

    def rule_for(self, layer) -> tuple[str, Rule] | None:
        """``(path, rule)`` of a candidate ``layer`` that a rule matches (recorded), else None."""
        path = self.relative_path(layer)
        if path is None:
            return None
        self.paths[path] = None
        i = first_match(self.rules, path)
        if i is None:
            return None
        self.matched.add(i)
        return path, self.rules[i]

    def note(self) -> str:
        """What the unmatched-rule error adds after the layers it lists (nothing here)."""
        return ""


class _Session(PathSession):
    def intercept(self, next_fun, args, kwargs, context):
        layer = context.module
        if type(layer) not in LINEAR_TYPES or context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        hit = self.rule_for(layer)
        if hit is None:
            return next_fun(*args, **kwargs)
        return _diagonal_call(layer, *hit, _call_input(args, kwargs))


_ACTIVE = threading.local()  # the sessions of the calls in progress on this thread


def _sessions() -> list:
    if not hasattr(_ACTIVE, "stack"):
        _ACTIVE.stack = []
    return _ACTIVE.stack


def intercepted(
    module: nn.Module, who: str, done: str, rules: tuple[Rule, ...], session: type
) -> nn.Module:
    """``module`` as an instance of a subclass of its own class (same fields, methods and names)
    whose outermost method call runs under ``session(cls, rules, root path).intercept``; at
    ``init`` a rule that matched no layer raises. Wrappers nest; each (``who``, whose result is
    ``done``: "sparsified") wraps a module once."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"{who}: module must be a flax.linen Module, got {type(module).__name__}")
    if module.scope is not None or isinstance(module.parent, nn.Module):
        raise TypeError(
            f"{who}: module must be unbound: build it outside any other module's method (as "
            f"for model.init), then pass the wrapped module on"
        )
    base = type(module)
    if who in getattr(base, "_dynadiag_wrappers", ()):
        raise ValueError(f"{who}: module is already {done}; pass all its rules in one {who} call")

    @nn.nowrap
    def _call_wrapped_method(self, fun, args, kwargs):
        parent = functools.partial(base._call_wrapped_method, self)
        stack = _sessions()
        nested = any(s.owner is cls for s in stack)
        if nested or self.scope is None or getattr(fun, "__name__", "") == "setup":
            return parent(fun, args, kwargs)  # an unbound call gets Flax's own error
        current = session(cls, rules, tuple(self.path))
        stack.append(current)
        try:
            with nn.intercept_methods(current.intercept):
                out = parent(fun, args, kwargs)
        finally:
            stack.pop()
        if self.is_initializing() and len(current.matched) < len(rules):
            raise ValueError(
                unmatched_message(who, rules, current.matched, list(current.paths), base.__name__)
                + current.note()
            )
        return out

    cls = type(
        base.__name__,
        (base,),
        {
            "__module__": base.__module__,
            "__qualname__": base.__qualname__,
            "__doc__": base.__doc__,
            "_dynadiag_wrappers": (*getattr(base, "_dynadiag_wrappers", ()), who),
            "_call_wrapped_method": _call_wrapped_method,
        },
    )
    fields = {f.name: getattr(module, f.name) for f in dataclasses.fields(module) if f.init}
    fields["parent"] = None
    return cls(**fields)


def sparsify(module: nn.Module, rules) -> nn.Module:
    """``module`` with the ``nn.Dense``/``nn.DenseGeneral`` layers that ``rules`` match diagonal.

    Args:
      module: an unbound linen module (any model; its source is not edited).
      rules: ``(regex, kwargs)`` pairs in order (or an ordered mapping ``{regex: kwargs}``). A layer
        whose module path (names joined by ``"/"`` as in the params tree of ``module``, e.g.
        ``"Encoder_0/MlpBlock_0/Dense_0"``) ``re.fullmatch``-es a regex computes a
        ``DiagonalDense(prod(features), **kwargs)`` (``sparsity=``/``k=``, ``block_size=``,
        ``gate=``, ...); the first matching rule wins; unmatched layers stay dense. The layer's
        ``use_bias``, ``dtype``, ``param_dtype``, ``kernel_init`` and ``bias_init`` carry over
        unless the rule sets them; its ``precision`` and ``dot_general`` are not used.

    Returns:
      A module of a subclass of ``type(module)`` with the same fields. Its ``init`` makes, at each
      replaced layer's path, a ``DiagonalDense``'s variables (params ``alpha``, ``values``,
      ``bias[prod(features)]``, collections ``"dynadiag"`` and ``"diagonals"``); its ``apply``
      runs search-phase or frozen (``dd.freeze_tree``) variables.

    Raises:
      TypeError, ValueError: at once for malformed rules or a module that is already bound or
        sparsified; at ``init`` (before any training) for a rule that matches no layer (the
        message lists the model's linear layers), a layer whose sizes cannot take its rule (a
        block size that does not divide them), a ``DenseGeneral`` that contracts non-trailing axes
        or has ``batch_dims``, and a layer inside an ``nn.scan``/``nn.vmap`` that does not carry
        the ``"dynadiag"`` and ``"diagonals"`` collections - each naming the layer's path.
    """
    return intercepted(module, "sparsify", "sparsified", parse_rules(rules, "sparsify"), _Session)


def linear_layer_paths(module: nn.Module, *example_inputs, **kwargs) -> list[LinearLayer]:
    """Every ``nn.Dense``/``nn.DenseGeneral`` call of ``module``: what :func:`sparsify`'s rules
    can match, in the order of first call (a shared layer once).

    ``module.init`` is traced abstractly (``jax.eval_shape``: no memory, no compile) on
    ``example_inputs`` and ``kwargs`` (shapes matter, not values) with ``"params"`` and
    ``"dropout"`` RNG streams. Works on a sparsified module too (its replaced layers included).
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"linear_layer_paths: module must be a flax.linen Module, got {type(module).__name__}"
        )
    seen: dict[str, LinearLayer] = {}

    def record(next_fun, args, call_kwargs, context):
        layer = context.module
        if type(layer) in LINEAR_TYPES and context.method_name == "__call__":
            path = "/".join(layer.path)
            if path not in seen:
                _, in_shape, out_shape = _shapes(layer, _call_input(args, call_kwargs))
                seen[path] = LinearLayer(path, type(layer).__name__, in_shape, out_shape)
        return next_fun(*args, **call_kwargs)

    def init(*inputs):
        # Keys made inside the trace: an eager key would compile.
        key = jax.random.key(0)
        return module.init({"params": key, "dropout": key}, *inputs, **kwargs)

    with nn.intercept_methods(record):
        jax.eval_shape(init, *example_inputs)
    return list(seen.values())
