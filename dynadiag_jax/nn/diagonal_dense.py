"""``DiagonalDense``: a Flax linen layer whose weight is a learned sum of K wrapped diagonals.

One module class serves both phases; which one runs is decided by the variables it is given:

* search: params ``alpha[P]``, ``values[P, D]``, ``bias[features]``; collection ``"dynadiag"``
  holds the gate hyper-parameter (``strength`` or ``temperature``, float32 scalar), ``topk``
  (int32 ``[K]``, see below) and ``score`` (bool scalar, used by ``explore="dense_score"``).
* frozen: params ``values[K, D]``, ``bias``; collection ``"diagonals"`` holds ``offsets[K]`` int32.

In both phases the ``"diagonals"`` collection also holds ``in_features`` (int32 scalar), the input
width: a frozen wide layer's shapes do not determine it (``values[K, D]`` with ``D = out``), and
every call checks ``x`` against it.

References:
  Tyagi et al., "Dynamic Sparse Training of Diagonally Sparse Networks", ICML 2025,
  https://arxiv.org/abs/2506.11449
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from dynadiag_jax._dtypes import promote_floats, work_dtype
from dynadiag_jax.layout import geometry, num_diagonals
from dynadiag_jax.ops import diag_matmul
from dynadiag_jax.topk import check_gate_value, softmax_topk, sparse_soft_topk

__all__ = ["DiagonalDense", "GATES", "EXPLORE_MODES", "layer_budget", "bucket_sizes"]

GATES = ("sparse_topk", "softmax")
EXPLORE_MODES = ("buckets", "dense_score", "none")
PHASES = ("search", "frozen")
HYPER_NAME = {"sparse_topk": "strength", "softmax": "temperature"}
# Value stored in the "dynadiag" collection by init when neither the call nor gate_init gives one.
DEFAULT_HYPER = {"strength": 1.0, "temperature": 5.0}
# alpha = (1 + ALPHA_NOISE * u) / P with u ~ U(0, 1): breaks ties for lax.top_k, and stays far
# below any sensible strength, so the first sparse gate is uniform (K / P) on every diagonal.
ALPHA_NOISE = 1e-3


def layer_budget(in_features: int, out_features: int, *, sparsity=None, k=None) -> int:
    """The number of diagonals ``K`` a layer keeps: ``k`` if given, else from ``sparsity``.

    Raises:
      ValueError: neither or both given, sparsity outside (0, 1), ``k`` outside ``[1, P]``.
    """
    geo = geometry(in_features, out_features)
    if (sparsity is None) == (k is None):
        raise ValueError("give exactly one of sparsity= (in (0, 1)) or k= (number of diagonals)")
    if k is None:
        return num_diagonals(geo.in_features, geo.out_features, sparsity)
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise ValueError(f"k must be an int, got {k!r}")
    if not 1 <= k <= geo.num_candidates:
        raise ValueError(
            f"budget k={k} must be in [1, P] with P = max(in, out) = {geo.num_candidates} "
            f"for a {geo.in_features} -> {geo.out_features} layer"
        )
    return int(k)


def bucket_sizes(k_cap: int, num_candidates: int, num_buckets: int) -> tuple[int, ...]:
    """Static numbers of computed diagonals for ``explore="buckets"``: geometric ``k_cap .. P``.

    The last size is always ``P``, so any support fits; one bucket means always computing all.
    """
    if k_cap >= num_candidates or num_buckets <= 1:
        return (num_candidates,)
    ratio = (num_candidates / k_cap) ** (1.0 / (num_buckets - 1))
    sizes = {min(num_candidates, math.ceil(k_cap * ratio**i)) for i in range(num_buckets - 1)}
    return tuple(sorted(sizes | {num_candidates}))


def check_sparsity(sparsity) -> None:
    """Rejects a ``sparsity`` that is not a number in ``(0, 1)``, saying what to use instead."""
    if isinstance(sparsity, bool) or not isinstance(sparsity, numbers.Real):
        raise TypeError(
            f"sparsity must be a number in (0, 1), got {sparsity!r} ({type(sparsity).__name__})"
        )
    if not 0.0 < float(sparsity) < 1.0:
        hint = (
            "; for a dense layer use flax.linen.Dense, or keep every diagonal with k=P "
            "(P = max(in, out))"
            if sparsity <= 0
            else ""
        )
        raise ValueError(f"sparsity must be in (0, 1), got {sparsity!r}{hint}")


def _host_int(value):
    """``value`` as a Python int when it can be read without a trace or a device sync, else None."""
    if isinstance(value, jax.core.Tracer):
        return None
    if isinstance(value, jax.Array) and not all(d.platform == "cpu" for d in value.devices()):
        return None
    return int(np.asarray(value))


class DiagonalDense(nn.Module):
    """``y = x @ W.T + bias``, ``W`` a sum of K wrapped diagonals (docs/design.md section 1).

    Search phase: ``W_eff = sum_p gate[p] * values[p]`` placed on diagonal ``p``, with
    ``gate = sparse_soft_topk(alpha, K, strength=s)`` (default) or
    ``softmax_topk(alpha, K, temperature=T)``. The product runs on the diagonals with the largest
    gate only (``jax.lax.top_k``, static shapes) through :func:`dynadiag_jax.diag_matmul`; a dense
    ``W`` is never built. How many are computed depends on ``explore``:

    * ``"buckets"`` (default): every diagonal with a non-zero gate is computed, in the smallest of
      ``num_buckets`` static sizes from ``K_cap = ceil((1 + slack) K)`` up to ``P`` that holds the
      gate's support (``lax.switch``). With a wide start (large strength: every gate ``K/P``) the
      first steps cost up to a dense layer; as the strength anneals the support, and the cost,
      shrink to ``K_cap``. Gradients are exact for every diagonal in the support.
    * ``"dense_score"``: always ``K_cap`` diagonals; on steps where the ``"dynadiag"`` flag
      ``score`` is set (``set_gate(..., score=True)``), the backward pass also runs one dense
      diagonal SDDMM (``dy^T x`` reduced along all ``P`` diagonals, as RigL's dense gradient) so
      every diagonal gets its exact gate and value gradient.
    * ``"none"``: always ``K_cap`` diagonals; the gate mass outside is dropped (and reported).

    On planted diagonals (docs/selection.md, bench/exploration.py) ``"buckets"`` with a strength
    annealed exponentially 1.0 -> 1e-3 recovered every planted diagonal for 13-16% of the
    dense-equivalent compute of the search phase; ``"dense_score"`` cost about the same but lost
    whole runs; ``"none"`` with a narrow gate kept what it started with.

    Frozen phase (after :func:`dynadiag_jax.freeze`, or ``init_phase="frozen"``): the product of
    exactly ``K`` diagonals ``offsets`` with a hard gate of 1.

    The gate hyper-parameter comes from the call (``strength=`` / ``temperature=``) or, if not
    given, from the ``"dynadiag"`` collection created by ``init``; a training loop updates every
    layer at once with :func:`dynadiag_jax.nn.set_gate`.

    Metrics sown into ``"intermediates"`` by a search-phase call (float32 scalars):
    ``gate_nonzero`` (number of non-zero gates), ``gate_mass_outside`` (gate mass on diagonals
    not computed), ``gate_mean``, ``computed_diagonals``; and ``topk_changed`` (diagonals that
    entered the top-K of alpha since the last refresh) when ``"dynadiag"`` is mutable, in which
    case ``topk`` (the top-K offsets by alpha) is refreshed. Only its length matters to
    :func:`dynadiag_jax.freeze_tree`, which always re-ranks the current alpha.

    Attributes:
      features: output width (>= 1).
      sparsity: fraction of zeros in ``(0, 1)``; ``K = dd.num_diagonals(in, features, sparsity)``.
      k: the budget ``K`` directly, in ``[1, P]`` (instead of ``sparsity``).
      gate: ``"sparse_topk"`` or ``"softmax"``.
      use_bias: add a bias (zeros at init).
      slack: ``K_cap = min(P, ceil((1 + slack) * K))``, >= 0.
      init_phase: ``"search"``, or ``"frozen"`` to initialise ``K`` distinct random offsets (the
        static-random-diagonals baseline).
      explore: ``"buckets"``, ``"dense_score"`` or ``"none"`` (see above).
      num_buckets: number of static sizes for ``explore="buckets"``.
      gate_init: value ``init`` stores for the gate hyper-parameter when the call gives none
        (default 1.0 strength / 5.0 temperature).
      dtype: computation dtype (default: promote the input and ``param_dtype``).
      param_dtype: dtype of ``values`` and ``bias``. ``alpha`` is stored in at least float32:
        its init noise and the small updates that rank the diagonals are below the resolution
        of a 16-bit float (in bfloat16 every alpha would start equal).
      impl: passed to :func:`dynadiag_jax.diag_matmul`.

    Shapes: ``x[..., in] -> y[..., features]``; ``P = max(in, features)``,
    ``D = min(in, features)``.
    """

    features: int
    _: dataclasses.KW_ONLY
    sparsity: float | None = None
    k: int | None = None
    gate: str = "sparse_topk"
    use_bias: bool = True
    slack: float = 0.25
    init_phase: str = "search"
    explore: str = "buckets"
    num_buckets: int = 4
    gate_init: float | None = None
    dtype: Any = None
    param_dtype: Any = jnp.float32
    impl: str = "auto"

    def __post_init__(self):
        if isinstance(self.features, bool) or not isinstance(self.features, numbers.Integral):
            raise ValueError(f"features must be an int >= 1, got {self.features!r}")
        if self.features < 1:
            raise ValueError(f"features must be >= 1, got {self.features}")
        if (self.sparsity is None) == (self.k is None):
            raise ValueError("DiagonalDense needs exactly one of sparsity= (in (0, 1)) or k=")
        if self.sparsity is not None:
            check_sparsity(self.sparsity)
        if self.gate not in GATES:
            raise ValueError(f"unknown gate {self.gate!r}; expected one of {GATES}")
        if self.init_phase not in PHASES:
            raise ValueError(f"unknown init_phase {self.init_phase!r}; expected one of {PHASES}")
        if self.explore not in EXPLORE_MODES:
            raise ValueError(f"unknown explore {self.explore!r}; expected one of {EXPLORE_MODES}")
        if not self.slack >= 0:
            raise ValueError(f"slack must be >= 0, got {self.slack!r}")
        buckets = self.num_buckets
        if isinstance(buckets, bool) or not isinstance(buckets, numbers.Integral) or buckets < 1:
            raise ValueError(f"num_buckets must be an int >= 1, got {self.num_buckets!r}")
        if self.gate_init is not None:
            check_gate_value(self.gate_init, "gate_init")
        super().__post_init__()

    @property
    def hyper_name(self) -> str:
        """``"strength"`` for the sparse gate, ``"temperature"`` for the softmax gate."""
        return HYPER_NAME[self.gate]

    def budget(self, in_features: int) -> int:
        """``K`` for an input width ``in_features``."""
        return layer_budget(in_features, self.features, sparsity=self.sparsity, k=self.k)

    def capacity(self, in_features: int) -> int:
        """``K_cap = min(P, ceil((1 + slack) * K))``."""
        p = max(in_features, self.features)
        return min(p, math.ceil((1.0 + self.slack) * self.budget(in_features)))

    @nn.compact
    def __call__(self, x, *, strength=None, temperature=None):
        """``x[..., in] -> [..., features]``; call kwargs override the ``"dynadiag"`` value."""
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"x must be an array, got {type(x).__name__}")
        if x.ndim < 1 or not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"x must be a floating array [..., in], got {x.dtype}{tuple(x.shape)}")
        self._check_offsets_present()
        self._check_width(x.shape[-1])
        geo = geometry(x.shape[-1], self.features)
        k = self.budget(geo.in_features)
        dtype = (
            jnp.dtype(self.dtype)
            if self.dtype is not None
            else promote_floats(x.dtype, self.param_dtype)
        )
        x = x.astype(dtype)

        frozen = self.has_variable("diagonals", "offsets") or (
            self.is_initializing() and self.init_phase == "frozen"
        )
        given = self._given_hyper(strength, temperature)  # checked in both phases
        if self.is_initializing():
            self.variable(
                "diagonals", "in_features", lambda: jnp.asarray(geo.in_features, jnp.int32)
            )
        if frozen:
            y = self._frozen(x, geo, k, dtype)
        else:
            y = self._search(x, geo, k, dtype, self._gate_hyper(given))
        if self.use_bias:
            bias = self.param(
                "bias", nn.initializers.zeros_init(), (self.features,), self.param_dtype
            )
            y = y + bias.astype(dtype).reshape((1,) * (y.ndim - 1) + (self.features,))
        return y

    def _check_offsets_present(self):
        """Frozen params (``values`` without ``alpha``) need their offsets: say where they live."""
        if (
            self.has_variable("params", "values")
            and not self.has_variable("params", "alpha")
            and not self.has_variable("diagonals", "offsets")
        ):
            raise ValueError(
                f"{self.name or 'DiagonalDense'}: these are the params of a frozen layer (values "
                f"[K, D], no alpha), but its offsets are missing: a frozen layer keeps offsets[K] "
                f"in the 'diagonals' collection (variables['diagonals'][<layer path>]['offsets'], "
                f"written by dd.freeze / dd.freeze_tree); save and restore every collection, not "
                f"only 'params'"
            )

    def _check_width(self, width: int):
        """Raises unless ``x``'s width is the layer's (known from its variables after init)."""
        if self.is_initializing() or not self.has_variable("params", "values"):
            return
        expected = self._stored_width()
        name = self.name or "DiagonalDense"
        if expected is not None and width != expected:
            raise ValueError(f"{name}: x has width {width}, the layer expects {expected}")
        # A frozen wide or square layer (D == features) has in >= features, whatever is stored.
        minimum = self.get_variable("params", "values").shape[-1]
        if expected is None and width < minimum:
            raise ValueError(f"{name}: x has width {width}, the layer expects at least {minimum}")

    def _stored_width(self):
        """The input width the variables were made for, when it is known at trace time.

        Search phase: from the shapes (``P`` and ``D`` with ``features``). Frozen: from
        ``values[K, D]`` when ``D < features`` (a tall layer), else from the ``"diagonals"`` entry
        ``in_features`` if it is a host value; otherwise None (see :meth:`_guard_width`).
        """
        if not self.has_variable("params", "values"):
            return None
        values = self.get_variable("params", "values")
        if self.has_variable("params", "alpha"):
            p, d_len = values.shape[-2:]
            return d_len if p == self.features else p
        if values.shape[-1] < self.features:
            return values.shape[-1]
        if self.has_variable("diagonals", "in_features"):
            return _host_int(self.get_variable("diagonals", "in_features"))
        return None

    def _guard_width(self, y, width: int):
        """NaN outputs when a traced stored width differs from ``x``'s (jit cannot raise).

        Only a frozen wide or square layer whose ``in_features`` is traced gets here; variables
        frozen before the width was stored (no ``in_features``) are trusted as they are.
        """
        if not self.has_variable("diagonals", "in_features"):
            return y
        stored = self.get_variable("diagonals", "in_features")
        if _host_int(stored) is not None:
            return y  # checked at trace time
        return jnp.where(stored == width, y, jnp.asarray(jnp.nan, y.dtype))

    def _frozen(self, x, geo, k, dtype):
        def init_offsets():
            perm = jax.random.permutation(self.make_rng("params"), geo.num_candidates)
            return jnp.sort(perm[:k]).astype(jnp.int32)

        offsets = self.variable("diagonals", "offsets", init_offsets).value
        if offsets.shape != (k,):
            raise ValueError(f"diagonals/offsets must have shape [K] = [{k}], got {offsets.shape}")
        values = self.param(
            "values", _uniform(1.0 / math.sqrt(geo.length)), (k, geo.length), self.param_dtype
        )
        y = diag_matmul(
            x, values.astype(dtype), offsets, out_features=self.features, impl=self.impl
        )
        return self._guard_width(y, geo.in_features)

    def _given_hyper(self, strength, temperature):
        """The call's value for this gate's hyper-parameter (or None), validated."""
        name = self.hyper_name
        given, wrong = (strength, temperature) if name == "strength" else (temperature, strength)
        if wrong is not None:
            other = "temperature" if name == "strength" else "strength"
            raise ValueError(f"gate={self.gate!r} takes {name}=, not {other}=")
        if given is not None:
            check_gate_value(given, name)
        return given

    def _gate_hyper(self, given):
        name = self.hyper_name
        if self.is_initializing():
            start = (
                given
                if given is not None
                else (self.gate_init if self.gate_init is not None else DEFAULT_HYPER[name])
            )
            stored = self.variable("dynadiag", name, lambda: jnp.asarray(start, jnp.float32))
            self.variable("dynadiag", "score", lambda: jnp.asarray(False))
            return stored.value if given is None else given
        if given is not None:
            return given
        if self.has_variable("dynadiag", name):
            return self.get_variable("dynadiag", name)
        raise ValueError(
            f"{self.name or 'DiagonalDense'}: the gate needs {name}=: pass it to the call, or "
            f"include the 'dynadiag' collection created by init in the variables "
            f"(set it with dd.nn.set_gate(variables, {name}=...))"
        )

    def _search(self, x, geo, k, dtype, hyper):
        p, d_len = geo.num_candidates, geo.length
        work = work_dtype(self.param_dtype)
        alpha = self.param("alpha", _alpha_init, (p,), work).astype(work)
        values = self.param(
            "values", _uniform(1.0 / math.sqrt(d_len)), (p, d_len), self.param_dtype
        )
        if self.gate == "sparse_topk":
            gate = sparse_soft_topk(alpha, k, strength=jnp.asarray(hyper, work))
        else:
            gate = softmax_topk(alpha, k, temperature=jnp.asarray(hyper, work))
        self._track_topk(alpha, k)

        k_cap = self.capacity(geo.in_features)
        product = _Product(x, values, gate, self.features, self.impl, dtype)
        if self.explore == "buckets":
            sizes = bucket_sizes(k_cap, p, self.num_buckets)
            support = jnp.sum(gate > 0)
            branch = jnp.minimum(jnp.searchsorted(jnp.asarray(sizes), support), len(sizes) - 1)
            if len(sizes) == 1:
                y, kept = product.sparse(sizes[0])
            else:
                y, kept = jax.lax.switch(branch, [lambda s=s: product.sparse(s) for s in sizes])
            computed = jnp.asarray(sizes, jnp.float32)[branch]
        elif self.explore == "dense_score":
            score = (
                self.get_variable("dynadiag", "score")
                if self.has_variable("dynadiag", "score")
                else jnp.asarray(False)
            )
            y, kept = jax.lax.cond(
                score, lambda: product.scored(k_cap), lambda: product.sparse(k_cap)
            )
            computed = jnp.asarray(k_cap, jnp.float32)
        else:
            y, kept = product.sparse(k_cap)
            computed = jnp.asarray(k_cap, jnp.float32)

        self.sow("intermediates", "gate_nonzero", jnp.sum(gate > 0).astype(jnp.float32))
        self.sow(
            "intermediates",
            "gate_mass_outside",
            jax.lax.stop_gradient(jnp.sum(gate) - kept).astype(jnp.float32),
        )
        self.sow("intermediates", "gate_mean", jax.lax.stop_gradient(jnp.mean(gate)))
        self.sow("intermediates", "computed_diagonals", computed)
        return y

    def _track_topk(self, alpha, k):
        def current():
            return jnp.sort(jax.lax.top_k(jax.lax.stop_gradient(alpha), k)[1]).astype(jnp.int32)

        if self.is_initializing():
            self.variable("dynadiag", "topk", current)
        elif self.has_variable("dynadiag", "topk") and self.is_mutable_collection("dynadiag"):
            var = self.variable("dynadiag", "topk", current)
            new = current()
            changed = k - jnp.sum(jnp.isin(new, var.value))
            self.sow("intermediates", "topk_changed", changed.astype(jnp.float32))
            var.value = new


class _Product:
    """The diagonal product of one search-phase call, on a chosen number of top-gate diagonals."""

    def __init__(self, x, values, gate, out_features, impl, dtype):
        self.x, self.values, self.gate = x, values, gate
        self.out_features, self.impl, self.dtype = out_features, impl, dtype

    def _select(self, size: int):
        # Ascending offsets, as in the frozen phase: kernels see one ordering in both phases.
        _, idx = jax.lax.top_k(jax.lax.stop_gradient(self.gate), size)
        return jnp.sort(idx).astype(jnp.int32)

    def sparse(self, size: int):
        """``(y, gate mass computed)`` over the ``size`` diagonals with the largest gate."""
        idx = self._select(size)
        w = _selected_weights(self.gate, self.values, idx, self.dtype)
        y = diag_matmul(self.x, w, idx, out_features=self.out_features, impl=self.impl)
        return y, jnp.sum(self.gate[idx])

    def scored(self, size: int):
        """As :meth:`sparse`, with exact gradients for all ``P`` diagonals (dense SDDMM)."""
        idx = self._select(size)
        y = _scored_product(self.x, self.gate, self.values, idx, self.out_features, self.impl)
        return y, jnp.sum(self.gate[idx])


def _uniform(bound: float):
    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def _alpha_init(key, shape, dtype=jnp.float32):
    (p,) = shape
    u = jax.random.uniform(key, shape, jnp.float32)
    return ((1.0 + ALPHA_NOISE * u) / p).astype(dtype)


def _selected_weights(gate, values, idx, dtype):
    """``gate[idx, None] * values[idx]`` (in the gate's dtype), cast to the compute dtype."""
    return (gate[idx][:, None] * values[idx].astype(gate.dtype)).astype(dtype)


def _scored_product(x, gate, values, idx, out_features, impl):
    """``y = x @ W_sel.T`` over ``idx``, whose VJP gives every diagonal its exact gradient.

    Forward and ``dx`` use the ``len(idx)`` selected diagonals; ``dgate[p] = <values[p], G[p]>``
    and ``dvalues[p] = gate[p] * G[p]`` for all ``p``, with ``G`` the diagonal SDDMM of ``dy`` and
    ``x`` over every offset (one dense-cost reduction, never a dense ``W``).
    """
    return _scored_vjp(out_features, impl)(x, gate, values, idx)


@functools.cache
def _scored_vjp(out_features: int, impl: str):
    @jax.custom_vjp
    def f(x, gate, values, idx):
        w = _selected_weights(gate, values, idx, x.dtype)
        return diag_matmul(x, w, idx, out_features=out_features, impl=impl)

    def fwd(x, gate, values, idx):
        return f(x, gate, values, idx), (x, gate, values, idx)

    def bwd(res, dy):
        x, gate, values, idx = res
        w = _selected_weights(gate, values, idx, x.dtype)
        _, pull_x = jax.vjp(
            lambda x_: diag_matmul(x_, w, idx, out_features=out_features, impl=impl), x
        )
        (dx,) = pull_x(dy)
        every = jnp.arange(values.shape[0], dtype=jnp.int32)
        _, pull_v = jax.vjp(
            lambda v: diag_matmul(x, v, every, out_features=out_features, impl=impl),
            jnp.zeros(values.shape, x.dtype),
        )
        (g_all,) = pull_v(dy)
        g_all = g_all.astype(gate.dtype)
        dgate = jnp.sum(values.astype(gate.dtype) * g_all, axis=1)
        dvalues = (gate[:, None] * g_all).astype(values.dtype)
        return dx, dgate, dvalues, None

    f.defvjp(fwd, bwd)
    return f
