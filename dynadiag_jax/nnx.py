"""DynaDiag layers for Flax NNX: ``dd.nnx.DiagonalDense``, ``set_gate``, ``freeze`` and
``freeze_opt_state``.

The same functional core as the linen layer (:mod:`dynadiag_jax.nn.functional`,
:mod:`dynadiag_jax.nn.search`) with the same variable names, so ``nnx.state(model)`` holds what
linen's variables hold, by variable type instead of collection:

* search phase: ``nnx.Param`` ``alpha[P]``, ``values[P, *V]``, ``bias[out]``; :class:`GateState`
  (linen's ``"dynadiag"`` collection) ``strength`` or ``temperature`` (float32 scalar), ``topk[K]``
  int32, ``score`` bool;
* frozen: ``nnx.Param`` ``values[K, *V]``, ``bias``; :class:`Diagonals` (linen's ``"diagonals"``)
  ``offsets[K]`` int32;
* both: :class:`Diagonals` ``in_features`` (int32 scalar).

``V = (D,)`` for element diagonals, ``(L_b, b, b)`` for block diagonals (``block_size = b``).
Unlike linen, a search-phase call always refreshes ``topk`` (NNX state is mutable); the search
statistics are not recorded.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from flax import nnx

from dynadiag_jax._dtypes import promote_floats, work_dtype
from dynadiag_jax.freeze import finite_values
from dynadiag_jax.freeze import freeze_opt_state as freeze_params_opt_state
from dynadiag_jax.layout import KERNEL_BLOCK_SIZES
from dynadiag_jax.nn import functional as F
from dynadiag_jax.nn.search import gate_inputs, search_forward
from dynadiag_jax.topk import check_gate_value, nan_if_nan

__all__ = ["DiagonalDense", "Diagonals", "GateState", "freeze", "freeze_opt_state", "set_gate"]

BLOCK_SIZES = (1, *KERNEL_BLOCK_SIZES)


class GateState(nnx.Variable):
    """Search-phase gate state: ``strength``/``temperature``, ``topk``, ``score`` (not trained)."""


class Diagonals(nnx.Variable):
    """Which diagonals a layer holds: frozen ``offsets[K]`` and ``in_features`` (not trained)."""


class DiagonalDense(nnx.Module):
    """``y = x @ W.T + bias``, ``W[out, in]`` a learned sum of K wrapped diagonals (NNX).

    Args:
      in_features, out_features: the widths.
      sparsity: fraction of zeros in ``(0, 1)``; or ``k``: the budget ``K`` in ``[1, P]``.
      block_size: 1 (element diagonals) or ``b`` in (8, 16, 32, 64, 128) dividing both widths.
      gate: ``"sparse_topk"`` (hyper-parameter ``strength``) or ``"softmax"`` (``temperature``).
      use_bias, slack, explore, num_buckets, gate_init, dtype, param_dtype, impl, kernel_init,
        bias_init, fan_in, scale: as
        :class:`dynadiag_jax.nn.DiagonalDense`.
      init_phase: ``"search"``, or ``"frozen"`` for K random offsets (static diagonals).
      rngs: ``nnx.Rngs`` with a ``params`` stream.

    Shapes: ``x[..., in_features] -> [..., out_features]``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        sparsity: float | None = None,
        k: int | None = None,
        block_size: int = 1,
        gate: str = "sparse_topk",
        use_bias: bool = True,
        slack: float = 0.25,
        init_phase: str = "search",
        explore: str = "buckets",
        num_buckets: int = 4,
        gate_init: float | None = None,
        dtype=None,
        param_dtype=jnp.float32,
        impl: str = "auto",
        kernel_init=F.DEFAULT_KERNEL_INIT,
        bias_init=F.DEFAULT_BIAS_INIT,
        fan_in: str = "sparse",
        scale: str = "rms",
        rngs: nnx.Rngs,
    ):
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if block_size not in BLOCK_SIZES or isinstance(block_size, bool):
            raise ValueError(
                f"block_size must be 1 (element diagonals) or one of {KERNEL_BLOCK_SIZES}, "
                f"got {block_size!r}"
            )
        if gate not in F.GATES:
            raise ValueError(f"unknown gate {gate!r}; expected one of {F.GATES}")
        if explore not in F.EXPLORE_MODES:
            raise ValueError(f"unknown explore {explore!r}; expected one of {F.EXPLORE_MODES}")
        if init_phase not in ("search", "frozen"):
            raise ValueError(f"unknown init_phase {init_phase!r}; expected 'search' or 'frozen'")
        if not slack >= 0:
            raise ValueError(f"slack must be >= 0, got {slack!r}")
        F.check_init_and_search(fan_in, scale)
        if gate_init is not None:
            check_gate_value(gate_init, "gate_init")
        budget = F.layer_budget(
            in_features, out_features, sparsity=sparsity, k=k, block_size=block_size
        )
        self.spec = F.LayerSpec(
            in_features=int(in_features),
            out_features=int(out_features),
            k=budget,
            block_size=int(block_size),
            gate=gate,
            slack=float(slack),
            explore=explore,
            num_buckets=int(num_buckets),
            impl=impl,
            scale=scale,
        )
        self.dtype = dtype
        self.param_dtype = param_dtype
        spec = self.spec
        self.in_features = Diagonals(jnp.asarray(spec.in_features, jnp.int32))
        values_init = F.init_values(spec, kernel_init, fan_in)
        if init_phase == "frozen":
            offsets = F.random_offsets(rngs.params(), spec)
            self.offsets = Diagonals(offsets)
            self.values = nnx.Param(values_init(rngs.params(), offsets, param_dtype))
        else:
            p = spec.num_candidates
            alpha = F.init_alpha(rngs.params(), (p,), work_dtype(param_dtype))
            self.alpha = nnx.Param(alpha)
            every = jnp.arange(p, dtype=jnp.int32)
            self.values = nnx.Param(values_init(rngs.params(), every, param_dtype))
            start = gate_init if gate_init is not None else F.DEFAULT_HYPER[spec.hyper_name]
            setattr(self, spec.hyper_name, GateState(jnp.asarray(start, jnp.float32)))
            self.topk = GateState(F.select_diagonals(alpha, spec.k))
            self.score = GateState(jnp.asarray(False))
        self.bias = (
            nnx.Param(bias_init(rngs.params(), (spec.out_features,), param_dtype))
            if use_bias
            else None
        )

    @property
    def frozen(self) -> bool:
        """Whether the layer holds its final ``K`` diagonals (``offsets``) instead of ``alpha``."""
        return hasattr(self, "offsets")

    def __call__(self, x, *, strength=None, temperature=None):
        """``x[..., in] -> [..., out]``; a call's gate value overrides the stored one."""
        spec = self.spec
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"x must be an array, got {type(x).__name__}")
        if x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"x must be a floating array [..., in], got {x.dtype}{tuple(x.shape)}")
        if x.shape[-1] != spec.in_features:
            raise ValueError(
                f"DiagonalDense: x has width {x.shape[-1]}, the layer expects {spec.in_features}"
            )
        name = spec.hyper_name
        given, wrong = (strength, temperature) if name == "strength" else (temperature, strength)
        if wrong is not None:
            raise ValueError(f"gate={spec.gate!r} takes {name}=, not the other gate's value")
        if given is not None:
            check_gate_value(given, name)
        dtype = (
            jnp.dtype(self.dtype)
            if self.dtype is not None
            else promote_floats(x.dtype, self.param_dtype)
        )
        x = x.astype(dtype)
        if self.frozen:
            y = F.frozen_forward(spec, self.values.get_value(), self.offsets.get_value(), x)
        else:
            alpha = self.alpha.get_value().astype(work_dtype(self.param_dtype))
            hyper = given if given is not None else getattr(self, name).get_value()
            inputs = gate_inputs(alpha, hyper, gate=spec.gate, k=spec.k, impl=spec.impl)
            y, _ = search_forward(
                spec, self.values.get_value(), x, inputs, score=self.score.get_value()
            )
            y = nan_if_nan(y, hyper)
            self.topk.set_value(inputs.topk)
        if self.bias is not None:
            bias = self.bias.get_value().astype(dtype)
            y = y + bias.reshape((1,) * (y.ndim - 1) + (spec.out_features,))
        return y


def _layers(model):
    return [(path, m) for path, m in nnx.iter_graph(model) if isinstance(m, DiagonalDense)]


def set_gate(model, *, strength=None, temperature=None, score=None):
    """Sets the gate state of every search-phase :class:`DiagonalDense` in ``model`` in place.

    Works inside ``nnx.jit`` (traced values are fine). Raises ``ValueError`` when nothing is given,
    for a concrete negative or NaN value, and when an argument matches no layer (``strength=``
    with only softmax layers, or a frozen model); the message names the gates present.
    """
    if strength is None and temperature is None and score is None:
        raise ValueError("set_gate needs strength=, temperature= and/or score=")
    for name, value in (("strength", strength), ("temperature", temperature)):
        if value is not None:
            check_gate_value(value, name, "set_gate")
    layers = [m for _, m in _layers(model) if not m.frozen]
    present = {
        "strength": sum(m.spec.hyper_name == "strength" for m in layers),
        "temperature": sum(m.spec.hyper_name == "temperature" for m in layers),
        "score": len(layers),
    }
    requested = {"strength": strength, "temperature": temperature, "score": score}
    for name, value in requested.items():
        if value is not None and not present[name]:
            took = ", ".join(f"{n}= ({c} layers)" for n, c in present.items() if c and n != "score")
            raise ValueError(
                f"set_gate({name}=...) matches no layer: the search-phase DiagonalDense layers "
                f"here take {took or 'nothing (there are none: a frozen or dense model)'}"
            )
    for m in layers:
        value = requested[m.spec.hyper_name]
        if value is not None:
            getattr(m, m.spec.hyper_name).set_value(jnp.asarray(value, jnp.float32))
        if score is not None:
            m.score.set_value(jnp.asarray(score, jnp.bool_))


def _kept(alpha, values, k: int):
    """``(offsets[K], values[K, *V])`` of the ``k`` diagonals with the largest ``alpha[P]``;
    abstract arrays (``jax.ShapeDtypeStruct``, from ``nnx.eval_shape``) give abstract ones."""

    def keep(alpha, values):
        offsets = F.select_diagonals(alpha, k)
        return offsets, values[offsets]

    if isinstance(alpha, jax.ShapeDtypeStruct):
        return jax.eval_shape(keep, alpha, values)
    return keep(alpha, values)


def freeze(model):
    """A copy of ``model`` with every search-phase :class:`DiagonalDense` in the compact frozen
    form: the ``K`` diagonals with the largest ``alpha`` (``dd.select_diagonals``), ``values[K,
    *V]`` and ``offsets[K]``; ``alpha`` and the gate state are gone. ``model`` is unchanged.

    An abstract model (``nnx.eval_shape(lambda: Model(...))``) gives the abstract frozen one, a
    template to restore a frozen checkpoint into. Continue training with
    :func:`freeze_opt_state`. Raises ``ValueError`` naming the layer when a concrete ``alpha``
    holds NaN or inf (a diverged search); inside ``nnx.jit`` such a layer's frozen ``values`` are
    NaN instead (:func:`dynadiag_jax.freeze_tree`).
    """
    frozen = nnx.clone(model)
    for path, m in _layers(frozen):
        if m.frozen:
            continue
        alpha = m.alpha.get_value()
        offsets, values = _kept(alpha, m.values.get_value(), m.spec.k)
        values = finite_values(alpha, values, tuple(map(str, path)))
        for name in ("alpha", m.spec.hyper_name, "topk", "score"):
            delattr(m, name)
        m.offsets = Diagonals(offsets)
        m.values = nnx.Param(values)
    return frozen


def freeze_opt_state(optimizer: nnx.Optimizer, model, frozen) -> nnx.Optimizer:
    """An ``nnx.Optimizer`` for ``frozen = freeze(model)`` that continues ``optimizer`` (made for
    ``model``), as :func:`dynadiag_jax.freeze_opt_state` does for linen: the same transformation,
    ``wrt`` and step count; every params-shaped tree of its state (Adam's moments, ...) loses
    ``alpha`` and keeps the rows of the diagonals ``freeze`` kept. ``optimizer`` is unchanged.
    """
    params_before = nnx.to_pure_dict(nnx.state(model, optimizer.wrt))
    params_after = nnx.to_pure_dict(nnx.state(frozen, optimizer.wrt))
    state = freeze_params_opt_state(
        nnx.to_pure_dict(nnx.state(optimizer)), params_before, params_after
    )
    continued = nnx.Optimizer(frozen, optimizer.tx, wrt=optimizer.wrt)
    template = nnx.state(continued)
    nnx.replace_by_pure_dict(template, state)
    nnx.update(continued, template)
    return continued
