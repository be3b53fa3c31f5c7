"""Which linear layers of a model are diagonal-sparse: a constructor chosen per module path.

Every model in :mod:`dynadiag_jax.models` builds its *replaceable* linear layers (attention
projections, MLP layers) through :func:`linear`, which calls the model's ``dense`` constructor.
``dense`` is either a plain constructor (``flax.linen.Dense``, ``dd.nn.DiagonalDense`` with its
sparsity bound by ``functools.partial``) used for all of them, or a :class:`ByPath` that picks a
constructor by matching regular expressions against the layer's module path, e.g.
``"encoder/block_3/attn/qkv"``. Embeddings, patch embeddings and heads never go through
:func:`linear`, so they stay dense whatever the patterns say.

A constructor is called as ``ctor(features, *, name, use_bias, dtype, param_dtype)``, the keywords
that ``flax.linen.Dense`` and ``dd.nn.DiagonalDense`` share, less those it binds itself as a
``functools.partial`` (a ``use_bias=False`` or ``dtype`` bound there is kept) and a ``dtype`` or
``param_dtype`` the model leaves ``None``. Model-specific initialisers live in
each model's default dense constructor (``vit.DENSE`` etc.), which :class:`ByPath` uses for the
layers no pattern matches; :func:`resolve_dense` also passes them (``kernel_init``,
``bias_init``) to the other constructors, which must then accept them as ``nn.Dense`` does.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import traverse_util

__all__ = [
    "ByPath",
    "DenseFactory",
    "linear",
    "replaceable_layers",
    "resolve_dense",
    "initializers",
    "INIT_ARGS",
    "unmatched_patterns",
]

DenseFactory = Callable[..., nn.Module]


@dataclasses.dataclass(frozen=True)
class ByPath:
    """A ``dense`` argument that picks ``sparse`` for layers whose path fully matches a pattern.

    Attributes:
      patterns: regular expressions, each matched with ``re.fullmatch`` against the layer's module
        path inside the model (names joined by ``"/"``, without the model's own name or those of
        modules the model is nested in), e.g. ``r".*/attn/qkv"``.
      sparse: constructor for matching layers, e.g. ``partial(dd.nn.DiagonalDense, sparsity=0.9)``.
      dense: constructor for the other layers; ``None`` means the model's own default.
    """

    patterns: tuple[str, ...]
    sparse: DenseFactory
    dense: DenseFactory | None = None
    # The model's own module path, set by resolve_dense: layer paths are matched relative to it.
    root: tuple[str, ...] = dataclasses.field(default=(), repr=False)

    def __post_init__(self):
        if isinstance(self.patterns, str):
            raise TypeError(
                f"patterns must be a sequence of regular expressions, got the string "
                f"{self.patterns!r}; write ({self.patterns!r},)"
            )
        object.__setattr__(self, "patterns", tuple(self.patterns))
        for name in ("sparse", "dense"):
            ctor = getattr(self, name)
            if not callable(ctor) and not (name == "dense" and ctor is None):
                raise TypeError(
                    f"ByPath.{name} must be a layer constructor (e.g. functools.partial("
                    f"dd.nn.DiagonalDense, sparsity=0.9)){'' if name == 'sparse' else ' or None'}, "
                    f"got {ctor!r}"
                )
        for p in self.patterns:
            try:
                re.compile(p)
            except re.error as e:
                raise ValueError(f"invalid layer pattern {p!r}: {e}") from None

    def matches(self, path: str) -> bool:
        """Whether the layer at ``path`` is one of the sparse layers."""
        return any(re.fullmatch(p, path) for p in self.patterns)


Dense = DenseFactory | ByPath


# The initializer arguments of nn.Dense that a model's default constructor may bind.
INIT_ARGS = ("kernel_init", "bias_init")


def initializers(ctor) -> dict:
    """The :data:`INIT_ARGS` that ``ctor`` binds (as a ``functools.partial``), else ``{}``."""
    bound = getattr(ctor, "keywords", None) or {}
    return {k: bound[k] for k in INIT_ARGS if k in bound}


def _with_initializers(ctor, inits: dict):
    missing = {k: v for k, v in inits.items() if k not in initializers(ctor)}
    return functools.partial(ctor, **missing) if missing else ctor


def resolve_dense(dense: Dense, default: DenseFactory, root: Sequence[str] = ()) -> Dense:
    """``dense`` ready for :func:`linear`: a :class:`ByPath`'s missing ``dense`` is the model
    default, and every other constructor gets the default's initializers it does not bind itself
    (so a ``DiagonalDense`` in place of the model's dense layer starts from that layer's
    distribution: ``dd.nn.DiagonalDense``'s ``kernel_init``). ``root`` is the model's module path
    (``self.path``), so that a model nested in another module matches the same layers."""
    inits = initializers(default)
    if isinstance(dense, ByPath):
        return dataclasses.replace(
            dense,
            sparse=_with_initializers(dense.sparse, inits),
            dense=default if dense.dense is None else _with_initializers(dense.dense, inits),
            root=tuple(root),
        )
    return _with_initializers(dense, inits)


def linear(
    parent: nn.Module,
    dense: Dense,
    features: int,
    *,
    name: str,
    use_bias: bool = True,
    dtype: Any = None,
    param_dtype: Any = None,
) -> nn.Module:
    """Build the replaceable linear layer ``name`` inside the bound module ``parent``.

    Args:
      parent: the module whose ``@nn.compact`` method or ``setup`` creates the layer.
      dense: a constructor or a :class:`ByPath` (resolved with :func:`resolve_dense`).
      features: output width.
      name: the child's name; the layer path is ``parent.path + (name,)``.
    """
    ctor = dense
    if isinstance(dense, ByPath):
        path = (*parent.path, name)
        if path[: len(dense.root)] == dense.root:
            path = path[len(dense.root) :]
        ctor = dense.sparse if dense.matches("/".join(path)) else dense.dense
        if ctor is None:
            raise ValueError("ByPath.dense is None: pass the ByPath through resolve_dense first")
    bound = getattr(ctor, "keywords", None) or {}
    kwargs = {
        k: v
        for k, v in (("use_bias", use_bias), ("dtype", dtype), ("param_dtype", param_dtype))
        if k not in bound and (v is not None or k == "use_bias")
    }
    return ctor(features, name=name, **kwargs)


def unmatched_patterns(patterns: Sequence[str], layer_paths: Sequence[str]) -> list[str]:
    """The patterns that match none of ``layer_paths`` (a typo would leave a model dense)."""
    return [p for p in patterns if not any(re.fullmatch(p, path) for path in layer_paths)]


class _Probe(nn.Module):
    """Stands in for a replaceable layer so that its path shows up as a ``probe`` parameter."""

    features: int
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Any = None
    bias_init: Any = None

    @nn.compact
    def __call__(self, x):
        self.param("probe", nn.initializers.zeros, (), self.param_dtype)
        return jnp.zeros((*x.shape[:-1], self.features), self.dtype or x.dtype)


def replaceable_layers(model: nn.Module, *args, **kwargs) -> list[str]:
    """Module paths of every layer of ``model`` that its ``dense`` argument decides.

    Traces ``model.init`` abstractly (no compilation) with every replaceable layer swapped for a
    probe. ``args``/``kwargs`` are example inputs for ``model.init`` (shapes matter, not values).
    """
    probe = model.clone(dense=ByPath((".*",), sparse=_Probe))
    # The key is made inside the traced function: creating one eagerly would compile.
    shapes = jax.eval_shape(lambda *a, **k: probe.init(jax.random.key(0), *a, **k), *args, **kwargs)
    flat = traverse_util.flatten_dict(shapes["params"])
    return sorted("/".join(path[:-1]) for path in flat if path[-1] == "probe")
