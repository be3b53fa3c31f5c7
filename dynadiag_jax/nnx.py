"""DynaDiag layers for Flax NNX: ``dd.nnx.DiagonalDense``, ``set_gate``, ``freeze``,
``freeze_opt_state``, ``sparsify`` (diagonal layers in place of a model's ``nnx.Linear`` /
``nnx.LinearGeneral`` by path rules), and ``lora_fa`` (LoRA-FA adapters on its linear layers).

The same functional core as the linen layer (:mod:`dynadiag_jax.nn.functional`,
:mod:`dynadiag_jax.nn.search`) with the same variable names, so ``nnx.state(model)`` holds what
linen's variables hold, by variable type instead of collection:

* search phase: ``nnx.Param`` ``alpha[P]``, ``values[P, *V]``, ``bias[out]``; :class:`GateState`
  (linen's ``"dynadiag"`` collection) ``strength`` or ``temperature`` (float32 scalar), ``topk[K]``
  int32, ``score`` bool;
* frozen: ``nnx.Param`` ``values[K, *V]``, ``bias``; :class:`Diagonals` (linen's ``"diagonals"``)
  ``offsets[K]`` int32;
* both: :class:`Diagonals` ``in_features`` (int32 scalar);
* with an input permutation: :class:`Diagonals` ``perm[in]`` int32 (``"random"``, and
  ``"learned"`` once frozen), or ``nnx.Param`` ``perm_soft[in, in]`` (``"learned"``, search phase).

``V = (D,)`` for element diagonals, ``(L_b, b, b)`` for block diagonals (``block_size = b``).
Unlike linen, a search-phase call always refreshes ``topk`` (NNX state is mutable); the search
statistics are not recorded. The search's working-set form (linen:
:mod:`dynadiag_jax.training.working_set`) is not implemented here: a layer given a
``working_set`` raises ``NotImplementedError``.
"""

from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
from flax import nnx

from dynadiag_jax._checks import (
    check_layer_arguments,
    finite_number,
    floating_dtype,
    host_array,
    int_at_least,
    non_negative,
)
from dynadiag_jax._dtypes import promote_floats, work_dtype
from dynadiag_jax.freeze import finite_values, gather_rows, is_abstract
from dynadiag_jax.freeze import freeze_opt_state as freeze_params_opt_state
from dynadiag_jax.layout import KERNEL_BLOCK_SIZES
from dynadiag_jax.nn import functional as F
from dynadiag_jax.nn import permutation as perms
from dynadiag_jax.nn.gate_state import alpha_from_values as restart_alpha
from dynadiag_jax.nn.gate_state import check_score
from dynadiag_jax.nn.lora import adapter_rules, check_rank, default_a_init, low_rank_term
from dynadiag_jax.nn.search import gate_inputs, search_forward
from dynadiag_jax.nn.sparsify import first_match, parse_rules, unmatched_message
from dynadiag_jax.ops.diag_matmul import check_impl
from dynadiag_jax.topk import check_gate_value, nan_if_nan

__all__ = [
    "DiagonalDense",
    "DiagonalDenseGeneral",
    "Diagonals",
    "GateState",
    "LoRAFA",
    "LoRAFrozen",
    "alpha_from_values",
    "freeze",
    "freeze_opt_state",
    "lora_fa",
    "permutation_penalty",
    "set_gate",
    "sparsify",
]

BLOCK_SIZES = (1, *KERNEL_BLOCK_SIZES)


class GateState(nnx.Variable):
    """Search-phase gate state: ``strength``/``temperature``, ``topk``, ``score`` (not trained)."""


class Diagonals(nnx.Variable):
    """Which diagonals a layer holds: frozen ``offsets[K]``, ``in_features`` and the input
    permutation ``perm[in]`` (not trained)."""


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
      permutation, permutation_penalty, permutation_start, permutation_relaxation: as
        :class:`dynadiag_jax.nn.DiagonalDense`; the weighted
        penalty of the learned layers is :func:`permutation_penalty` (add it to the loss).
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
        permutation: str | None = None,
        permutation_penalty: float = perms.DEFAULT_PENALTY,
        permutation_start: str = "random",
        permutation_relaxation: str = "sinkhorn",
        rngs: nnx.Rngs,
    ):
        for name, value in (("in_features", in_features), ("out_features", out_features)):
            int_at_least(value, name, 1)
        if int_at_least(block_size, "block_size", 1) not in BLOCK_SIZES:
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
        non_negative(slack, "slack")
        check_layer_arguments(
            num_buckets=num_buckets,
            dtype=dtype,
            param_dtype=param_dtype,
            kernel_init=kernel_init,
            bias_init=bias_init,
            use_bias=use_bias,
        )
        F.check_init_and_search(fan_in, scale)
        check_impl(impl)
        perms.check_permutation_args(
            permutation, permutation_penalty, permutation_start, permutation_relaxation
        )
        if gate_init is not None:
            check_gate_value(gate_init, "gate_init")
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(
                f"rngs must be an nnx.Rngs with a 'params' stream (nnx.Rngs(0)), "
                f"got {type(rngs).__name__}"
            )
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
        self.permutation = permutation
        self.permutation_penalty = float(permutation_penalty)
        self.permutation_relaxation = permutation_relaxation
        n = spec.in_features
        if permutation == "random" or (permutation == "learned" and init_phase == "frozen"):
            self.perm = Diagonals(perms.random_permutation(rngs.params(), n))
        elif permutation == "learned" and permutation_relaxation == "blocks":
            b = perms.soft_block_size(n)
            soft = perms.init_block_soft(rngs.params(), (n // b, b, b), work_dtype(param_dtype))
            self.perm_soft = nnx.Param(soft)
            self.perm = Diagonals(perms.random_permutation(rngs.params(), n))
        elif permutation == "learned":
            self.perm_soft = nnx.Param(
                perms.init_soft(rngs.params(), (n, n), work_dtype(param_dtype), permutation_start)
            )

    @property
    def frozen(self) -> bool:
        """Whether the layer holds its final ``K`` diagonals (``offsets``) instead of ``alpha``."""
        return hasattr(self, "offsets")

    def __call__(self, x, *, strength=None, temperature=None, out_sharding=None):
        """``x[..., in] -> [..., out]``; a call's gate value overrides the stored one.

        ``out_sharding`` is accepted for the callers of ``nnx.Linear`` that pass it (such as
        ``nnx.MultiHeadAttention``), and must be None: the product keeps its rows' sharding.
        """
        if out_sharding is not None:
            raise ValueError(
                f"DiagonalDense: out_sharding={out_sharding!r} is not supported (the product keeps "
                f"the sharding of x's rows); pass None"
            )
        spec = self.spec
        if hasattr(self, "working_set"):
            raise NotImplementedError(
                "DiagonalDense (NNX): the search's working-set form (a working_set beside "
                "values[W, ...]) is implemented for the linen layer and dynadiag_jax.training "
                "only; keep values[P, ...] and no working_set on an NNX layer"
            )
        F.check_layer_input(x)
        if x.shape[-1] != spec.in_features:
            raise ValueError(
                f"{self._label()}: x has width {x.shape[-1]}, the layer expects {spec.in_features}"
            )
        self._check_state()
        self._check_permutation_state()
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
        perm, label = None, self._label()
        if hasattr(self, "perm_soft") and hasattr(self, "perm"):  # the "blocks" relaxation
            x = perms.apply_permutation(x, self.perm.get_value(), label)
            x = perms.block_permute(x, self._soft_matrix())
        elif hasattr(self, "perm_soft"):
            x = perms.soft_permute(x, self._soft_matrix())
        elif hasattr(self, "perm") and self.frozen:  # the product reads x through perm
            perm = perms.checked_permutation(self.perm.get_value(), x.shape[-1], label)
        elif hasattr(self, "perm"):
            x = perms.apply_permutation(x, self.perm.get_value(), label)
        if self.frozen:
            values, offsets = self.values.get_value(), self.offsets.get_value()
            y = F.frozen_forward(spec, values, offsets, x, perm)
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
        return self._guard_width(y)

    def _guard_width(self, y):
        """NaN outputs when the stored ``in_features`` is traced and differs from the layer's
        (jit cannot raise; a host value is checked by :meth:`_check_state`)."""
        stored = self.in_features.get_value()
        if host_array(stored) is not None:
            return y
        return jnp.where(stored == self.spec.in_features, y, jnp.asarray(jnp.nan, y.dtype))

    def _label(self) -> str:
        """The layer's path where it knows one (:class:`DiagonalDenseGeneral`), else its widths."""
        spec = self.spec
        return getattr(self, "path", "") or (
            f"DiagonalDense({spec.in_features} -> {spec.out_features})"
        )

    def _check_state(self):
        """Raises naming the layer when its variables do not have its phase's shapes (a
        search-phase state loaded into a frozen layer, or the reverse)."""
        spec = self.spec
        if self.frozen:
            phase, n = "frozen", spec.k
            expected = {"offsets": (spec.k,)}
        else:
            phase, n = "search-phase", spec.num_candidates
            expected = {"alpha": (n,), "topk": (spec.k,)}
        expected["values"] = (n, *spec.row_shape)
        if self.bias is not None:
            expected["bias"] = (spec.out_features,)
        for name, shape in expected.items():
            got = tuple(getattr(self, name).get_value().shape)
            if got != shape:
                raise ValueError(
                    f"{self._label()}: {name} has shape {list(got)}, but this {phase} layer "
                    f"(K = {spec.k} of P = {spec.num_candidates} diagonals) holds {list(shape)}: "
                    f"its state was made for another layer or phase (e.g. a search-phase state "
                    f"loaded into a frozen layer)"
                )
        # Layers of swapped widths (16 -> 32, 32 -> 16) can hold equal shapes.
        stored = host_array(self.in_features.get_value())
        if stored is not None and int(stored) != spec.in_features:
            raise ValueError(
                f"{self._label()}: its state was made for inputs of width {int(stored)} "
                f"(in_features), but this layer reads {spec.in_features}: the state was made by "
                f"a layer with other widths"
            )

    def _check_permutation_state(self):
        """Raises naming the layer when its permutation variables are not the ones its
        ``permutation`` (and phase, and relaxation) keeps, or ``perm_soft`` is not of its shape (a
        state loaded by ``nnx.update`` can add, drop or reshape them; ``perm`` is checked where it
        is read)."""
        n, label = self.spec.in_features, self._label()
        soft, hard = hasattr(self, "perm_soft"), hasattr(self, "perm")
        blocks = self.permutation_relaxation == "blocks"
        if self.permutation is None:
            want_soft = want_hard = False
        elif self.permutation == "learned" and not self.frozen:
            want_soft, want_hard = True, blocks
        else:
            want_soft, want_hard = False, True
        if (soft, hard) != (want_soft, want_hard):
            held = [v for v, has in (("perm_soft", soft), ("perm", hard)) if has] or ["neither"]
            wanted = [v for v, has in (("perm_soft", want_soft), ("perm", want_hard)) if has]
            raise ValueError(
                f"{label}: its state holds {' and '.join(held)}, but a "
                f"{'frozen' if self.frozen else 'search-phase'} layer with "
                f"permutation={self.permutation!r}"
                + (f" (relaxation {self.permutation_relaxation!r})" if want_soft else "")
                + f" holds {' and '.join(wanted) or 'no permutation'}: the state was made by "
                f"a layer with another permutation or phase"
            )
        if soft:
            b = perms.soft_block_size(n) if blocks else n
            shape = (n // b, b, b) if blocks else (n, n)
            got = tuple(self.perm_soft.get_value().shape)
            if got != shape:
                raise ValueError(
                    f"{label}: perm_soft must have shape {list(shape)} for "
                    f"permutation_relaxation={self.permutation_relaxation!r} at in = {n}, "
                    f"got {list(got)}"
                )

    def _soft_matrix(self):
        soft = self.perm_soft.get_value().astype(work_dtype(self.param_dtype))
        return perms.doubly_stochastic(soft)

    def penalty(self):
        """``permutation_penalty`` times the l1-l2 penalty of the soft permutation (float32
        scalar; 0 without one)."""
        if not hasattr(self, "perm_soft"):
            return jnp.zeros((), jnp.float32)
        weight = jnp.float32(self.permutation_penalty)
        return weight * perms.l1_l2_penalty(self._soft_matrix())


def _sizes(shape, name: str) -> tuple[int, ...]:
    """``shape`` (an int as a 1-tuple, as ``nnx.LinearGeneral`` takes it) checked: ints >= 1."""
    shape = (shape,) if isinstance(shape, numbers.Integral) else tuple(shape)
    if not shape:
        raise ValueError(f"{name} must name at least one axis, got ()")
    return tuple(int_at_least(n, f"{name}[{i}]", 1) for i, n in enumerate(shape))


class DiagonalDenseGeneral(DiagonalDense):
    """A :class:`DiagonalDense` over flattened sizes, in place of an ``nnx.LinearGeneral``.

    ``x[..., *in_shape] -> [..., *out_shape]`` is the diagonal layer ``prod(in_shape) ->
    prod(out_shape)`` on ``x`` with its trailing axes flattened, reshaped back. The variables are
    a ``DiagonalDense``'s (``bias[prod(out_shape)]``).

    Args:
      in_shape, out_shape: the contracted trailing axes of ``x`` and the output features.
      axis: the axes of ``x`` that ``in_shape`` stands for (checked on every call: they must be
        the trailing ones).
      path: the layer's path in its model, for error messages.
      **kwargs: as :class:`DiagonalDense` (``sparsity=``/``k=``, ``rngs=``, ...).
    """

    def __init__(self, in_shape, out_shape, *, axis=None, path: str = "", **kwargs):
        in_shape, out_shape = _sizes(in_shape, "in_shape"), _sizes(out_shape, "out_shape")
        super().__init__(math.prod(in_shape), math.prod(out_shape), **kwargs)
        self.in_shape, self.out_shape = in_shape, out_shape
        if axis is None:
            axis = tuple(range(-len(self.in_shape), 0))
        self.axis = (axis,) if isinstance(axis, numbers.Integral) else tuple(axis)
        self.path = path

    def __call__(self, x, **kwargs):
        """``x[..., *in_shape] -> [..., *out_shape]``; kwargs as :meth:`DiagonalDense.__call__`."""
        n = len(self.in_shape)
        if not hasattr(x, "ndim") or x.ndim < n:
            raise ValueError(
                f"{self.path or 'DiagonalDenseGeneral'}: x must be an array [..., "
                f"{', '.join(map(str, self.in_shape))}], got {getattr(x, 'shape', type(x))}"
            )
        axes = sorted(a % x.ndim for a in self.axis)
        if axes != list(range(x.ndim - n, x.ndim)) or tuple(x.shape[x.ndim - n :]) != self.in_shape:
            raise ValueError(
                f"{self.path or 'DiagonalDenseGeneral'}: a diagonal layer maps the trailing axes "
                f"[..., {', '.join(map(str, self.in_shape))}] of x; got axis={self.axis} of x of "
                f"shape {tuple(x.shape)}"
            )
        lead = x.shape[: x.ndim - n]
        y = super().__call__(x.reshape((*lead, self.spec.in_features)), **kwargs)
        return y.reshape((*lead, *self.out_shape))


def _layers(model):
    return [(path, m) for path, m in nnx.iter_graph(model) if isinstance(m, DiagonalDense)]


def set_gate(model, *, strength=None, temperature=None, score=None):
    """Sets the gate state of every search-phase :class:`DiagonalDense` in ``model`` in place.

    Works inside ``nnx.jit`` (traced values are fine). Raises ``ValueError`` when nothing is given,
    for a concrete negative or NaN value, and when an argument matches no layer (``strength=``
    with only softmax layers, or a frozen model); the message names the gates present.
    ``TypeError`` for a ``score`` that is not a bool (or a bool array).
    """
    if strength is None and temperature is None and score is None:
        raise ValueError("set_gate needs strength=, temperature= and/or score=")
    for name, value in (("strength", strength), ("temperature", temperature)):
        if value is not None:
            check_gate_value(value, name, "set_gate")
    if score is not None:
        check_score(score, "set_gate")
    layers = [m for _, m in _layers(model) if not m.frozen]
    present = {
        name: sum(m.spec.hyper_name == name for m in layers) for name in F.HYPER_NAME.values()
    }
    present["score"] = len(layers)
    requested = {"strength": strength, "temperature": temperature, "score": score}
    for name, value in requested.items():
        if value is not None and not present[name]:
            took = ", ".join(f"{n}= ({c} layers)" for n, c in present.items() if c and n != "score")
            raise ValueError(
                f"set_gate({name}=...) matches no layer: the search-phase DiagonalDense layers "
                f"here take {took or 'nothing (there are none: a frozen or dense model)'}"
            )
    for m in layers:
        # to the stored shape, as the linen set_gate: a model stacked by nnx.vmap / nnx.scan
        # keeps a gate per member (a scalar there failed the next vmapped call)
        value = requested[m.spec.hyper_name]
        if value is not None:
            _set_like(getattr(m, m.spec.hyper_name), jnp.asarray(value, jnp.float32))
        if score is not None:
            _set_like(m.score, jnp.asarray(score, jnp.bool_))


def _set_like(variable, value) -> None:
    variable.set_value(jnp.broadcast_to(value, jnp.shape(variable.get_value())))


def alpha_from_values(model, scale) -> None:
    """Sets, in place, every search-phase :class:`DiagonalDense`'s ``alpha`` from its values, as
    :func:`dynadiag_jax.nn.alpha_from_values` does for linen params (the restart of the scores
    after a warm-up with flat gates; ``scale`` typically the gate's current strength). Works
    inside ``nnx.jit``; a concrete ``scale`` <= 0 or NaN raises ``ValueError``, and a model with no
    search-phase layer too.
    """
    layers = [m for _, m in _layers(model) if not m.frozen]
    if not layers:
        raise ValueError(
            "alpha_from_values: no search-phase DiagonalDense in the model (a frozen or dense one)"
        )
    for m in layers:
        params = {"alpha": m.alpha.get_value(), "values": m.values.get_value()}
        m.alpha.set_value(restart_alpha(params, scale)["alpha"])


def permutation_penalty(model):
    """The sum of every :class:`DiagonalDense`'s :meth:`~DiagonalDense.penalty` in ``model``
    (float32 scalar): the term a loss adds for learned permutations (linen layers sow it into
    their ``"losses"`` collection instead)."""
    if not isinstance(model, nnx.Module):  # a dict of variables would give 0 without a word
        raise TypeError(f"permutation_penalty takes an NNX module, got {type(model).__name__}")
    total = jnp.zeros((), jnp.float32)
    for _, m in _layers(model):
        total = total + m.penalty()
    return total


def _kept(alpha, values, k: int):
    """``(offsets[..., K], values[..., K, *V])`` of the ``k`` diagonals with the largest
    ``alpha[..., P]``; abstract arrays (``jax.ShapeDtypeStruct``, from ``nnx.eval_shape``) give
    abstract ones."""

    def keep(alpha, values):  # leading axes of a model stacked by nnx.vmap / nnx.scan too
        offsets = F.select_diagonals(alpha, k)
        return offsets, gather_rows(values, offsets)

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
    NaN instead (:func:`dynadiag_jax.freeze_tree`); ``TypeError`` when ``model`` is not an
    ``nnx.Module``.
    """
    if not isinstance(model, nnx.Module):
        raise TypeError(f"dd.nnx.freeze: model must be an nnx.Module, got {type(model).__name__}")
    frozen = nnx.clone(model)
    for path, m in _layers(frozen):
        if m.frozen:
            continue
        alpha = m.alpha.get_value()
        offsets, values = _kept(alpha, m.values.get_value(), m.spec.k)
        values = finite_values(alpha, values, tuple(map(str, path)))
        for name in ("alpha", m.spec.hyper_name, "topk", "score"):
            delattr(m, name)
        if hasattr(m, "perm_soft") and hasattr(m, "perm"):  # "blocks": hard forward, no fold
            harden = perms.harden_blocks
            soft = m.perm_soft.get_value()
            if isinstance(soft, jax.ShapeDtypeStruct):
                harden = functools.partial(jax.eval_shape, harden)
            del m.perm_soft
            m.perm = Diagonals(harden(soft, m.perm.get_value()))
        elif hasattr(m, "perm_soft"):
            soft = m.perm_soft.get_value()
            harden = functools.partial(perms.harden_and_fold, out_features=m.spec.out_features)
            if isinstance(soft, jax.ShapeDtypeStruct):
                harden = functools.partial(jax.eval_shape, harden)
            del m.perm_soft
            perm, values = harden(soft, values, offsets)
            m.perm = Diagonals(perm)
        m.offsets = Diagonals(offsets)
        m.values = nnx.Param(values)
    return frozen


def _path_text(path) -> str:
    return "/".join(map(str, path)) or "(root)"


def _path_list(layers) -> str:
    return ", ".join(sorted(_path_text(path) for path in layers)) or "none"


def freeze_opt_state(optimizer: nnx.Optimizer, model, frozen) -> nnx.Optimizer:
    """An ``nnx.Optimizer`` for ``frozen = freeze(model)`` that continues ``optimizer`` (made for
    ``model``), as :func:`dynadiag_jax.freeze_opt_state` does for linen: the same transformation,
    ``wrt`` and step count; every params-shaped tree of its state (Adam's moments, ...) loses
    ``alpha`` and keeps the rows of the diagonals ``freeze`` kept. ``optimizer`` is unchanged.
    Abstract arguments (``nnx.eval_shape``) give an abstract optimizer: a restore template.

    Raises:
      TypeError: ``optimizer`` is not an ``nnx.Optimizer``, or ``model``/``frozen`` not modules.
      ValueError: ``frozen`` is not ``freeze(model)`` (the arguments swapped, layers at other
        paths, or params of other shapes), naming the layer.
    """
    if not isinstance(optimizer, nnx.Optimizer):
        raise TypeError(
            f"dd.nnx.freeze_opt_state: optimizer must be an nnx.Optimizer, "
            f"got {type(optimizer).__name__}"
        )
    for name, module in (("model", model), ("frozen", frozen)):
        if not isinstance(module, nnx.Module):
            raise TypeError(
                f"dd.nnx.freeze_opt_state: {name} must be an nnx.Module, "
                f"got {type(module).__name__}"
            )
    before, after = dict(_layers(model)), dict(_layers(frozen))
    if before.keys() != after.keys():
        raise ValueError(
            f"dd.nnx.freeze_opt_state: frozen must be dd.nnx.freeze(model), but its "
            f"DiagonalDense layers are at {_path_list(after)} and model's at {_path_list(before)}"
        )
    for path, layer in after.items():
        if not layer.frozen:
            swapped = (
                " (and model's is frozen: are the two swapped?)" if before[path].frozen else ""
            )
            raise ValueError(
                f"dd.nnx.freeze_opt_state: the DiagonalDense at {_path_text(path)} of "
                f"frozen is in the search phase{swapped}; pass frozen = dd.nnx.freeze(model)"
            )
    params_before = nnx.to_pure_dict(nnx.state(model, optimizer.wrt))
    params_after = nnx.to_pure_dict(nnx.state(frozen, optimizer.wrt))
    try:
        state = freeze_params_opt_state(
            nnx.to_pure_dict(nnx.state(optimizer)), params_before, params_after
        )
    except ValueError as e:  # name the arguments of this function
        raise ValueError(
            f"dd.nnx.{e} (params_before: model's params, params_after: frozen's)"
        ) from None

    def make(frozen):
        return nnx.Optimizer(frozen, optimizer.tx, wrt=optimizer.wrt)

    # an abstract frozen model (a restore template) gets an abstract optimizer
    continued = nnx.eval_shape(make, frozen) if is_abstract(params_after) else make(frozen)
    template = nnx.state(continued)
    nnx.replace_by_pure_dict(template, state)
    nnx.update(continued, template)
    return continued


# Exactly these classes: a subclass may compute something else in its own __call__.
_LINEAR_TYPES = (nnx.Linear, nnx.LinearGeneral)


def _as_initializer(array):
    """An initializer returning ``array`` (the replaced layer's own draw) reshaped to ``shape``."""

    def init(key, shape, dtype=jnp.float32):
        del key
        return jnp.reshape(array, shape).astype(dtype)

    return init


def _diagonal_layer(layer, path: str, kwargs: dict, rngs):
    """The diagonal layer that takes ``layer``'s place."""
    general = isinstance(layer, nnx.LinearGeneral)
    in_shape = layer.in_features if general else (layer.in_features,)
    out_shape = layer.out_features if general else (layer.out_features,)
    if general and layer.batch_axis:
        raise ValueError(
            f"dd.nnx.sparsify: the nnx.LinearGeneral at {path!r} has batch_axis="
            f"{dict(layer.batch_axis)}: a diagonal layer has one weight for every batch entry; "
            f"leave this layer out of the rules"
        )
    if (
        general
        and all(a < 0 for a in layer.axis)
        and sorted(layer.axis) != list(range(-len(in_shape), 0))
    ):  # positive axes depend on x's rank: DiagonalDenseGeneral checks them on every call
        raise ValueError(
            f"dd.nnx.sparsify: the nnx.LinearGeneral at {path!r} contracts axes {layer.axis} of "
            f"x: a diagonal layer maps the trailing axes (axis=-1, or (-2, -1), ...) only; leave "
            f"this layer out of the rules"
        )
    kernel = layer.kernel.get_value()
    if kernel.ndim != len(in_shape) + len(out_shape):
        raise ValueError(
            f"dd.nnx.sparsify: the layer at {path!r} has a stacked kernel of shape "
            f"{kernel.shape} (nnx.vmap/nnx.scan): stacked layers cannot be replaced one by one; "
            f"leave this layer out of the rules"
        )
    # The values start from the layer's own kernel (its kernel_init's draw, which NNX does not
    # keep): the start a DiagonalDense made with that initializer would have.
    kwargs = {
        "use_bias": layer.use_bias,
        "dtype": layer.dtype,
        "param_dtype": layer.param_dtype,
        "kernel_init": _as_initializer(kernel),
        **({"bias_init": _as_initializer(layer.bias.get_value())} if layer.use_bias else {}),
        **kwargs,
    }
    try:
        if general:
            return DiagonalDenseGeneral(
                in_shape, out_shape, axis=layer.axis, path=path, rngs=rngs, **kwargs
            )
        return DiagonalDense(in_shape[0], out_shape[0], rngs=rngs, **kwargs)
    except (TypeError, ValueError) as e:  # e.g. a block size that does not divide the widths
        raise type(e)(f"dd.nnx.sparsify: {path}: {e}") from None


def _references(nodes):
    """Every ``(container, key, value)`` attribute or item of the graph ``nodes``."""
    out = []
    for _, node in nodes:
        if isinstance(node, nnx.Module):
            out.extend((node, name, value) for name, value in vars(node).items())
        elif isinstance(node, (list, tuple)):
            out.extend((node, i, value) for i, value in enumerate(node))
        elif isinstance(node, dict):
            out.extend((node, key, value) for key, value in node.items())
    return out


def sparsify(model, rules, *, rngs: nnx.Rngs):
    """Replaces, in place, the ``nnx.Linear``/``nnx.LinearGeneral`` layers of ``model`` that
    ``rules`` match with diagonal layers; returns ``model``.

    Args:
      model: an NNX module, freshly built: a replaced layer's values start from its own kernel's
        entries on the diagonals (its ``kernel_init``'s draw, times ``1 / sqrt(density)`` as
        :class:`DiagonalDense` does with ``fan_in="sparse"``) and its bias.
      rules: ``(regex, kwargs)`` pairs in order (or an ordered mapping), as
        :func:`dynadiag_jax.nn.sparsify`: a layer whose path (attribute names and list indices
        joined by ``"/"`` as in ``nnx.state(model)``, e.g. ``"blocks/0/mlp/fc1"``)
        ``re.fullmatch``-es a regex becomes a :class:`DiagonalDense` (an ``nnx.Linear``) or a
        :class:`DiagonalDenseGeneral` (an ``nnx.LinearGeneral``) with that rule's keyword
        arguments; the first matching rule wins; the rest stay dense. A layer referenced from
        several places is matched by any of its paths and replaced everywhere.
      rngs: ``nnx.Rngs`` with a ``params`` stream, for the diagonal layers' ``alpha``.

    Raises:
      TypeError, ValueError: malformed rules; a rule that matches no layer (the message lists
        the model's linear layers); a layer whose sizes cannot take its rule, a
        ``LinearGeneral`` with ``batch_axis``, a stacked layer, or one held in a tuple, each
        naming the layer's path. Nothing is replaced when anything fails.
    """
    parsed = parse_rules(rules, "dd.nnx.sparsify")
    if not isinstance(model, nnx.Module):
        raise TypeError(f"dd.nnx.sparsify: model must be an nnx.Module, got {type(model).__name__}")
    return _replace_layers(
        model,
        parsed,
        _LINEAR_TYPES,
        lambda layer, path, rule: _diagonal_layer(layer, path, rule.kwargs, rngs),
        "dd.nnx.sparsify",
    )


def _replace_layers(model, rules, types, make, who: str):
    """Replaces, in place, every layer of exactly one of ``types`` whose path a rule matches with
    ``make(layer, path, rule)``; returns ``model``. Nothing is replaced when anything fails."""
    nodes = list(nnx.iter_graph(model))
    where = {id(node): path for path, node in nodes}  # each node's first path
    references = _references(nodes)
    found = {}  # id -> (every path of the layer, layer)
    for container, key, value in references:
        if type(value) in types:
            path = "/".join(map(str, (*where[id(container)], key)))
            found.setdefault(id(value), ([], value))[0].append(path)
    matched, new = set(), {}
    for key, (paths, layer) in found.items():
        paths.sort()
        hits = [i for i in (first_match(rules, p) for p in paths) if i is not None]
        if hits:
            matched.add(min(hits))
            new[key] = make(layer, paths[0], rules[min(hits)])
    if len(matched) < len(rules):
        listed = [" = ".join(paths) for paths, _ in found.values()]
        raise ValueError(unmatched_message(who, rules, matched, listed, type(model).__name__))
    references = [(c, k, v) for c, k, v in references if id(v) in new]
    for container, _, value in references:
        if isinstance(container, tuple):
            raise ValueError(
                f"{who}: the layer at {found[id(value)][0][0]!r} is held in a tuple, "
                f"which cannot be changed in place; hold it in an attribute, a list or nnx.List"
            )
    for container, key, value in references:
        if isinstance(container, nnx.Module):
            setattr(container, key, new[id(value)])
        else:
            container[key] = new[id(value)]
    return model


class LoRAFrozen(nnx.Variable):
    """LoRA-FA's frozen projection ``A[r, in]`` (linen's ``"lora_frozen"`` collection): not an
    ``nnx.Param``, so an ``nnx.Optimizer(..., wrt=nnx.Param)`` never updates it."""


class LoRAFA(nnx.Module):
    """``base(x) + scale * (x @ A.T) @ B.T``: a layer with its LoRA-FA adapter (NNX).

    Args:
      base: the adapted layer, an ``nnx.Linear`` or a :class:`DiagonalDense` (either phase; its
        product keeps running through ``dd.diag_matmul``), a :class:`DiagonalDenseGeneral` too.
      rank: ``r``, in ``[1, min(in, out)]``.
      scale: ``alpha / r``.
      a_init: initializer of ``A`` (default N(0, 1/in)); param_dtype: dtype of ``A`` and ``B``.
      rngs: ``nnx.Rngs`` with a ``params`` stream, for ``A``.
      path: the layer's path, for error messages.

    Attributes: ``base``; ``lora_a`` (:class:`LoRAFrozen` ``[r, in]``, random, never trained);
    ``lora_b`` (``nnx.Param`` ``[out, r]``, zeros, so the adapted layer starts equal to ``base``).
    A ``base`` stacked by ``nnx.vmap`` / ``nnx.scan`` (weights with leading axes ``S``) gets
    ``lora_a[*S, r, in]`` and ``lora_b[*S, out, r]``: each member its own adapter, sliced by
    the same transform. Shapes: ``x[..., in] -> [..., out]``.
    """

    def __init__(
        self,
        base,
        *,
        rank: int,
        scale: float,
        rngs: nnx.Rngs,
        a_init=default_a_init,
        param_dtype=jnp.float32,
        path: str = "",
    ):
        who = "dd.nnx.LoRAFA"
        if not isinstance(base, nnx.Linear | DiagonalDense):
            raise TypeError(
                f"{who}: base must be an nnx.Linear or a dd.nnx.DiagonalDense, got "
                f"{type(base).__name__}"
            )
        rank = int_at_least(rank, f"{who}: rank", 1)
        if finite_number(scale, f"{who}: scale") == 0:  # B's gradient is scaled by it too
            raise ValueError(f"{who}: scale=0 scales the adapter to nothing (and its gradient)")
        param_dtype = floating_dtype(param_dtype, f"{who}: param_dtype")
        spec = base.spec if isinstance(base, DiagonalDense) else base
        n_in, n_out = spec.in_features, spec.out_features
        weights = base.values if isinstance(base, DiagonalDense) else base.kernel
        one_layer = 4 if isinstance(base, DiagonalDense) and spec.block_size > 1 else 2
        # a layer stacked by nnx.vmap / nnx.scan gets one adapter per member, stacked alike
        stack = weights.get_value().shape[: weights.get_value().ndim - one_layer]
        check_rank(rank, n_in, n_out, path, "dd.nnx.lora_fa")
        self.base = base
        self.scale = float(scale)
        self.lora_a = LoRAFrozen(a_init(rngs.params(), (*stack, rank, n_in), param_dtype))
        self.lora_b = nnx.Param(jnp.zeros((*stack, n_out, rank), param_dtype))

    def __call__(self, x, **kwargs):
        """``x[..., in] -> [..., out]`` (a :class:`DiagonalDenseGeneral` base: ``[...,
        *in_shape] -> [..., *out_shape]``, the adapter on the flattened axes as the base's
        product); ``kwargs`` go to ``base``."""
        y = self.base(x, **kwargs)  # checks x first
        a, b = self.lora_a.get_value(), self.lora_b.get_value()
        if isinstance(self.base, DiagonalDenseGeneral):
            flat = x.reshape((*x.shape[: x.ndim - len(self.base.in_shape)], -1))
            return y + low_rank_term(flat.astype(y.dtype), a, b, self.scale).reshape(y.shape)
        return y + low_rank_term(x.astype(y.dtype), a, b, self.scale)


def lora_fa(
    model,
    layers,
    *,
    rank: int,
    alpha: float | None = None,
    rngs: nnx.Rngs,
    a_init=default_a_init,
    param_dtype=jnp.float32,
):
    """Wraps, in place, every ``nnx.Linear`` / :class:`DiagonalDense` (:class:`DiagonalDenseGeneral`
    included: an ``nnx.LinearGeneral`` :func:`sparsify` replaced) of ``model`` whose path a pattern
    of ``layers`` matches in a :class:`LoRAFA`; returns ``model``.

    Args:
      model: an NNX module (also one :func:`sparsify` or :func:`freeze` returned).
      layers: regular expressions ``re.fullmatch``-ed against the layers' paths (as
        :func:`sparsify`'s rules, e.g. ``"blocks/0/mlp/fc1"``); each must match a layer.
      rank: ``r``, in ``[1, min(in, out)]`` of every matched layer; alpha: the scale is
        ``alpha / r`` (default ``alpha = r``, scale 1).
      rngs: ``nnx.Rngs`` with a ``params`` stream, for the frozen ``A``.
      a_init, param_dtype: as :class:`LoRAFA`.

    A matched layer's variables move under its new ``base`` (``fc1/base/values``); the adapter
    adds ``fc1/lora_a`` (:class:`LoRAFrozen`) and ``fc1/lora_b`` (``nnx.Param``). Train ``B``
    only with ``nnx.Optimizer(model, tx, wrt=nnx.All(nnx.Param, nnx.PathContains("lora_b")))``.

    Raises:
      TypeError, ValueError: as :func:`dynadiag_jax.nn.lora_fa` (bad patterns or rank, a pattern
        that matches no layer, a rank above a layer's ``min(in, out)``); nothing is wrapped when
        anything fails.

    A layer stacked by ``nnx.vmap`` / ``nnx.scan`` gets one adapter per member (:class:`LoRAFA`).
    """
    rules = adapter_rules(
        layers, rank, alpha, "dd.nnx.lora_fa", a_init=a_init, param_dtype=param_dtype
    )
    if not isinstance(model, nnx.Module):
        raise TypeError(f"dd.nnx.lora_fa: model must be an nnx.Module, got {type(model).__name__}")
    return _replace_layers(
        model,
        rules,
        (nnx.Linear, DiagonalDense, DiagonalDenseGeneral),  # the last: sparsify's LinearGeneral
        lambda layer, path, rule: LoRAFA(layer, rngs=rngs, path=path, **rule.kwargs),
        "dd.nnx.lora_fa",
    )
