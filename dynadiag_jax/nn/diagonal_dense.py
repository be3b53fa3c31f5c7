"""``DiagonalDense``: a Flax linen layer whose weight is a learned sum of K wrapped diagonals.

A thin wrapper over the functional core (:mod:`dynadiag_jax.nn.functional`, with the search
machinery in :mod:`dynadiag_jax.nn.search`): it creates the variables, checks the input and
calls the core. One module class serves both phases; which one runs is decided by the variables
it is given:

* search: params ``alpha[P]``, ``values[P, *V]``, ``bias[features]``; collection ``"dynadiag"``
  holds the gate hyper-parameter (``strength`` or ``temperature``, float32 scalar), ``topk``
  (int32 ``[K]``, see below) and ``score`` (bool scalar, used by ``explore="dense_score"``).
* frozen: params ``values[K, *V]``, ``bias``; collection ``"diagonals"`` holds ``offsets[K]`` int32.
* search, working-set form (``dynadiag_jax.training.enter_working_set``): ``"dynadiag"`` also
  holds ``working_set[W]`` (int32, distinct candidates), and params ``values[W, *V]`` (row ``j``:
  candidate ``working_set[j]``); ``alpha[P]`` stays. The product computes exactly those ``W``
  diagonals (:func:`dynadiag_jax.nn.search.working_set_forward`).

``V = (D,)`` for element diagonals, ``(L_b, b, b)`` for block diagonals (``block_size = b``). In
both phases the ``"diagonals"`` collection also holds ``in_features`` (int32 scalar), the input
width: frozen shapes do not always determine it (a wide element layer's ``values[K, D]`` has
``D = out``), and every call checks ``x`` against it.

With an input permutation (``permutation="random"`` or ``"learned"``,
:mod:`dynadiag_jax.nn.permutation`) the ``"diagonals"`` collection also holds ``perm[in]`` int32
(``"random"``: both phases; ``"learned"``: once frozen), and a learned layer in the search phase
has the param ``perm_soft[in, in]`` instead.

References:
  Tyagi et al., "Dynamic Sparse Training of Diagonally Sparse Networks", ICML 2025,
  https://arxiv.org/abs/2506.11449
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from dynadiag_jax._checks import check_layer_arguments, int_at_least, non_negative
from dynadiag_jax._dtypes import promote_floats, work_dtype
from dynadiag_jax.layout import KERNEL_BLOCK_SIZES
from dynadiag_jax.nn import functional as F
from dynadiag_jax.nn import permutation as perms
from dynadiag_jax.nn.search import (
    gate_inputs,
    search_forward,
    working_set_forward,
    working_set_problem,
)
from dynadiag_jax.ops.diag_matmul import check_impl
from dynadiag_jax.topk import check_gate_value, nan_if_nan

__all__ = ["DiagonalDense"]

PHASES = ("search", "frozen")
BLOCK_SIZES = (1, *KERNEL_BLOCK_SIZES)


def _host_int(value):
    """``value`` as a Python int when it can be read without a trace or a device sync, else None."""
    host = perms.host_array(value)
    return None if host is None else int(host)


class DiagonalDense(nn.Module):
    """``y = x @ W.T + bias`` with ``W[features, in]`` a sum of wrapped diagonals.

    Search phase: ``W_eff = sum_p gate[p] * values[p]`` placed on diagonal ``p``, with
    ``gate = sparse_soft_topk(alpha, K, strength=s)`` (default) or
    ``softmax_topk(alpha, K, temperature=T)``. The product runs on the diagonals with the largest
    gate only (ranked by :func:`dynadiag_jax.ops.ranking.gate_rank`, static shapes) through
    :func:`dynadiag_jax.diag_matmul`; a dense ``W`` is never built. How many are computed depends
    on ``explore``:

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

    docs/selection.md compares the three on planted diagonals (bench/exploration.py).

    Working-set form (``"dynadiag"`` holds ``working_set[W]``, params ``values[W, *V]``; made by
    :func:`dynadiag_jax.training.enter_working_set`): the gate still runs over all ``P`` scores,
    but exactly the ``W`` working-set diagonals are computed, gated by ``gate[working_set]``, and
    ``explore`` has no effect; gate mass outside is dropped (``gate_mass_outside``), and
    ``scale="rms"`` is taken over the computed gates. A concrete working set with duplicates,
    ids outside ``[0, P)`` or more than ``P`` entries raises; a traced one makes every output NaN.

    Frozen phase (after :func:`dynadiag_jax.freeze`, or ``init_phase="frozen"``): the product of
    exactly ``K`` diagonals ``offsets`` with a hard gate of 1.

    The gate hyper-parameter comes from the call (``strength=`` / ``temperature=``) or, if not
    given, from the ``"dynadiag"`` collection created by ``init``; a training loop updates every
    layer at once with :func:`dynadiag_jax.nn.set_gate`. A value of 0 is the gate's hard limit
    (:func:`dynadiag_jax.sparse_soft_topk`); a traced negative value acts as 0, and a traced NaN
    makes every output NaN (a concrete negative or NaN value raises).

    Metrics sown into ``"intermediates"`` by a search-phase call (float32 scalars):
    ``gate_nonzero`` (number of non-zero gates), ``gate_mass_outside`` (gate mass on diagonals
    not computed), ``gate_mean``, ``computed_diagonals``, ``output_scale`` (the product's expected
    output scale relative to the frozen layer's); and ``topk_changed`` (diagonals that
    entered the top-K of alpha since the last refresh) when ``"dynadiag"`` is mutable, in which
    case ``topk`` (the top-K offsets by alpha) is refreshed. Only its length matters to
    :func:`dynadiag_jax.freeze_tree`, which always re-ranks the current alpha.

    Attributes:
      features: output width (>= 1).
      in_features: the input width, if known in advance (``dd.freeze`` sets it on the layer it
        returns): every call checks ``x`` against it while tracing, so a wrong width raises even
        inside ``jit``. Without it (None) the width is checked against the variables, which are
        traced inside ``jit``: where a frozen layer's shapes do not fix the width, a wrong one
        there gives NaN outputs.
      sparsity: fraction of zeros in ``(0, 1)``;
        ``K = dd.num_diagonals(in, features, sparsity, block_size=block_size)``.
      k: the budget ``K`` directly, in ``[1, P]`` (instead of ``sparsity``).
      block_size: 1 for element diagonals (the paper's), or ``b`` in (8, 16, 32, 64, 128) for
        block diagonals of full ``b x b`` blocks (``b`` must divide ``in`` and ``features``):
        ``P_b = min(in, features) / b`` candidates, each spanning every block row and column.
      gate: ``"sparse_topk"`` or ``"softmax"``.
      use_bias: add a bias (zeros at init).
      slack: ``K_cap = min(P, ceil((1 + slack) * K))``, >= 0.
      init_phase: ``"search"``, or ``"frozen"`` to initialise ``K`` distinct random offsets (the
        static-random-diagonals baseline).
      explore: ``"buckets"``, ``"dense_score"`` or ``"none"`` (see above).
      num_buckets: number of static sizes for ``explore="buckets"``.
      gate_init: value ``init`` stores for the gate hyper-parameter when the call gives none
        (default 1.0 strength / 5.0 temperature).
      dtype: floating computation dtype (default: promote the input and ``param_dtype``).
      param_dtype: floating dtype of ``values`` and ``bias``. ``alpha`` is stored in at least
        float32: its init noise and the small updates that rank the diagonals are below the
        resolution of a 16-bit float (in bfloat16 every alpha would start equal).
      impl: passed to :func:`dynadiag_jax.diag_matmul`.
      kernel_init: the initializer of the dense kernel ``[in, features]`` this layer stands for
        (``nn.Dense``'s argument, same default): ``values`` are that kernel's entries on the
        diagonals (:func:`dynadiag_jax.nn.functional.init_values`).
      bias_init: initializer of ``bias`` (zeros, as ``nn.Dense``).
      fan_in: ``"sparse"`` (default) scales the initial values by ``1 / sqrt(density)``, so the
        frozen layer starts at the output scale of the dense layer ``kernel_init`` was made for;
        ``"dense"`` keeps the dense kernel's entries (the start of a masked dense layer).
      scale: ``"rms"`` (default): the search product times ``sqrt(K / sum(gate^2))`` (no
        gradient), the output scale of ``K`` diagonals at gate 1 however flat the gates, so the
        search starts at the frozen layer's scale and the freeze changes nothing (at hard gates
        the factor is 1); ``"none"``: the plain gated sum, ``sqrt(K / P)`` as large at a flat
        start.

      permutation: None (default), ``"random"`` or ``"learned"``: the layer computes the
        diagonal product of ``x[..., perm]``, one permutation of its inputs. ``"random"``: ``perm``
        drawn at init from the ``"params"`` key, never trained. ``"learned"`` (PA-DST): in the
        search phase a soft matrix ``M = sinkhorn(|perm_soft|)`` takes its place (the product of
        ``x @ M.T``, dense: ``in * in`` multiply-adds per row), with the l1-l2 penalty of ``M``
        times ``permutation_penalty`` sown into the ``"losses"`` collection (the training step
        adds it to the loss; the unweighted penalty is sown into ``"intermediates"`` as
        ``permutation_penalty``); the freeze hardens ``M`` into ``perm``
        (:func:`dynadiag_jax.nn.permutation.hard_permutation`). A frozen layer (``init_phase=
        "frozen"``) with ``"learned"`` is the form the freeze gives: its init draws ``perm`` as
        ``"random"`` does, a template for restored values. Which product runs follows the
        variables (``perm`` or ``perm_soft``); a layer whose variables do not match its
        ``permutation`` raises. A ``perm`` that is not a permutation of ``range(in)`` raises
        when it can be read on the host, and makes every output NaN inside ``jit``.
      permutation_penalty: the penalty's weight (lambda, >= 0), for ``"learned"``.
      permutation_start: ``perm_soft``'s init, for ``"learned"``: ``"random"`` (default) half on
        a random permutation matrix and half uniform, or ``"uniform"`` (PA-DST's start: every
        input mixed into every position).
      permutation_relaxation: for ``"learned"``: ``"sinkhorn"`` (default, PA-DST's soft matrix
        above) or ``"blocks"``: ``perm`` drawn as for ``"random"``, then a hard permutation
        inside each block of ``B`` inputs (``B``: :func:`~dynadiag_jax.nn.permutation.
        soft_block_size`), the assignment of ``sinkhorn(|perm_soft[in / B, B, B]|)``, trained
        straight through (:func:`~dynadiag_jax.nn.permutation.block_permute`): the forward is a
        gather, so the search phase stays sparse, and the freeze keeps the function exactly.
        ``permutation_start`` does not apply (each block starts half on its identity).

    Shapes: ``x[..., in] -> y[..., features]``. Element diagonals: ``P = max(in, features)``,
    ``values[P, D]`` with ``D = min(in, features)``. Block diagonals: ``P_b`` as above,
    ``values[P_b, L_b, b, b]`` with ``L_b = max(in, features) / b``.
    """

    features: int
    _: dataclasses.KW_ONLY
    in_features: int | None = None
    sparsity: float | None = None
    k: int | None = None
    block_size: int = 1
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
    kernel_init: Any = F.DEFAULT_KERNEL_INIT
    bias_init: Any = F.DEFAULT_BIAS_INIT
    fan_in: str = "sparse"
    scale: str = "rms"
    permutation: str | None = None
    permutation_penalty: float = perms.DEFAULT_PENALTY
    permutation_start: str = "random"
    permutation_relaxation: str = "sinkhorn"

    def __post_init__(self):
        int_at_least(self.features, "features", 1)
        if self.in_features is not None:
            int_at_least(self.in_features, "in_features", 1)
        if (self.sparsity is None) == (self.k is None):
            raise ValueError("DiagonalDense needs exactly one of sparsity= (in (0, 1)) or k=")
        if self.sparsity is not None:
            F.check_sparsity(self.sparsity)
        if int_at_least(self.block_size, "block_size", 1) not in BLOCK_SIZES:
            raise ValueError(
                f"block_size must be 1 (element diagonals) or one of {KERNEL_BLOCK_SIZES}, "
                f"got {self.block_size!r}"
            )
        if self.gate not in F.GATES:
            raise ValueError(f"unknown gate {self.gate!r}; expected one of {F.GATES}")
        if self.init_phase not in PHASES:
            raise ValueError(f"unknown init_phase {self.init_phase!r}; expected one of {PHASES}")
        if self.explore not in F.EXPLORE_MODES:
            raise ValueError(f"unknown explore {self.explore!r}; expected one of {F.EXPLORE_MODES}")
        non_negative(self.slack, "slack")
        check_layer_arguments(
            num_buckets=self.num_buckets,
            dtype=self.dtype,
            param_dtype=self.param_dtype,
            kernel_init=self.kernel_init,
            bias_init=self.bias_init,
            use_bias=self.use_bias,
        )
        F.check_init_and_search(self.fan_in, self.scale)
        check_impl(self.impl)
        perms.check_permutation_args(
            self.permutation,
            self.permutation_penalty,
            self.permutation_start,
            self.permutation_relaxation,
        )
        if self.gate_init is not None:
            check_gate_value(self.gate_init, "gate_init")
        super().__post_init__()

    @property
    def hyper_name(self) -> str:
        """``"strength"`` for the sparse gate, ``"temperature"`` for the softmax gate."""
        return F.HYPER_NAME[self.gate]

    def spec(self, in_features: int) -> F.LayerSpec:
        """The functional core's :class:`~dynadiag_jax.nn.functional.LayerSpec` at this width."""
        k = F.layer_budget(
            in_features,
            self.features,
            sparsity=self.sparsity,
            k=self.k,
            block_size=self.block_size,
        )
        return F.LayerSpec(
            in_features=in_features,
            out_features=self.features,
            k=k,
            block_size=self.block_size,
            gate=self.gate,
            slack=float(self.slack),
            explore=self.explore,
            num_buckets=int(self.num_buckets),
            impl=self.impl,
            scale=self.scale,
        )

    def budget(self, in_features: int) -> int:
        """``K`` for an input width ``in_features``."""
        return self.spec(in_features).k

    def capacity(self, in_features: int) -> int:
        """``K_cap = min(P, ceil((1 + slack) * K))``."""
        return self.spec(in_features).k_cap

    @nn.compact
    def __call__(self, x, *, strength=None, temperature=None):
        """``x[..., in] -> [..., features]``; call kwargs override the ``"dynadiag"`` value."""
        F.check_layer_input(x)
        self._check_frozen_entries()
        self._check_phase()
        self._check_stored_shapes()
        self._check_width(x.shape[-1])
        try:
            spec = self.spec(x.shape[-1])
        except ValueError as e:  # e.g. a block size that does not divide this layer's widths
            raise ValueError(f"{self._label()}: {e}") from None
        dtype = (
            jnp.dtype(self.dtype)
            if self.dtype is not None
            else promote_floats(x.dtype, self.param_dtype)
        )
        x = x.astype(dtype)

        frozen = self.has_variable(F.DIAGONALS_COLLECTION, "offsets") or (
            self.is_initializing() and self.init_phase == "frozen"
        )
        given = self._given_hyper(strength, temperature)  # checked in both phases
        needed = (F.DIAGONALS_COLLECTION,) if frozen else F.LAYER_COLLECTIONS
        missing = F.uncarried_collections(self, needed)
        if missing:  # Flax's own error came later, naming one entry of one collection
            raise ValueError(
                f"{self._label()}: this DiagonalDense sits in a lifted transform (nn.scan, "
                f"nn.vmap) that does not carry the collections {missing} it keeps beside "
                f"'params': {F.CARRY_ADVICE}"
            )
        if self.is_initializing():
            self.variable(
                F.DIAGONALS_COLLECTION,
                "in_features",
                lambda: jnp.asarray(spec.in_features, jnp.int32),
            )
        x, perm = self._permute(x, frozen)
        if frozen:
            y = self._frozen(spec, x, perm)
        else:
            y = self._search(spec, x, self._gate_hyper(given))
            if not self.is_initializing():
                y = self._guard_width(y, spec.in_features)
        if self.use_bias:
            bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype)
            y = y + bias.astype(dtype).reshape((1,) * (y.ndim - 1) + (self.features,))
        return y

    def _budget_text(self) -> str:
        return f"sparsity={self.sparsity}" if self.k is None else f"k={self.k}"

    def _label(self) -> str:
        """The layer's module path (``"encoder/block_0/mlp/fc1"``), for error messages."""
        return "/".join(self.path) or self.name or "DiagonalDense"

    def _check_frozen_entries(self):
        """Frozen params (``values`` without ``alpha``) need their offsets and input width: say
        where they live."""
        if not self.has_variable("params", "values") or self.has_variable("params", "alpha"):
            return
        for name, missing in (("offsets", "its offsets are"), ("in_features", "its width is")):
            if not self.has_variable(F.DIAGONALS_COLLECTION, name):
                raise ValueError(
                    f"{self._label()}: these are the params of a frozen layer (values [K, ...], "
                    f"no alpha), but {missing} missing: a frozen layer keeps offsets[K] and "
                    f"in_features in the 'diagonals' collection (variables['diagonals'][<layer "
                    f"path>]['{name}'], written by dd.freeze / dd.freeze_tree); save and restore "
                    f"every collection, not only 'params'"
                )

    def _permute(self, x, frozen: bool):
        """``(x, perm)``: ``x`` with the layer's input permutation applied (soft ``perm_soft``, or
        a hard ``perm`` in the search phase) and None, or, for a frozen layer with a hard ``perm``,
        ``x`` as it is and the checked ``perm``, which the product reads ``x`` through."""
        soft = self.has_variable("params", "perm_soft")
        hard = self.has_variable(F.DIAGONALS_COLLECTION, "perm")
        init = self.is_initializing()
        if self.permutation is None:
            if soft or hard:
                raise ValueError(
                    f"{self._label()}: the variables hold an input permutation "
                    f"({'params/perm_soft' if soft else 'diagonals/perm'}) but the layer has "
                    f"permutation=None; make the layer with the permutation= they were made with"
                )
            return x, None
        if soft or (init and self.permutation == "learned" and not frozen):
            if self.permutation != "learned" or frozen:
                raise ValueError(
                    f"{self._label()}: params/perm_soft (a learned permutation in the search "
                    f"phase) goes with a search-phase layer with permutation='learned'; this one "
                    f"has permutation={self.permutation!r}"
                    + (" and frozen diagonals (offsets)" if frozen else "")
                )
            return self._soft_permute(x), None
        if not (init or hard):
            raise ValueError(
                f"{self._label()}: permutation={self.permutation!r} needs its permutation in the "
                f"variables (diagonals/perm, or params/perm_soft while a learned one searches), "
                f"and there is none: save and restore every collection, not only 'params'"
            )
        perm = self._perm(x.shape[-1])
        if frozen:
            return x, perms.checked_permutation(perm, x.shape[-1], self._label())
        return perms.apply_permutation(x, perm, self._label()), None

    def _soft_permute(self, x):
        """``x @ M.T`` with ``M = sinkhorn(|perm_soft|)``, or for ``"blocks"`` the hard
        :func:`~dynadiag_jax.nn.permutation.block_permute` of ``x[..., perm]``; sows the penalty
        of ``M``."""
        work = work_dtype(self.param_dtype)
        n = x.shape[-1]
        blocks = self.permutation_relaxation == "blocks"
        if blocks:
            b = perms.soft_block_size(n)
            shape, init = (n // b, b, b), perms.init_block_soft
        else:
            shape = (n, n)
            init = functools.partial(perms.init_soft, start=self.permutation_start)
        held = self.get_variable("params", "perm_soft")  # checked before flax compares shapes
        if held is not None and held.shape != shape:
            raise ValueError(
                f"{self._label()}: params/perm_soft must have shape {list(shape)} for "
                f"permutation_relaxation={self.permutation_relaxation!r} at in = {n}, "
                f"got {held.shape}"
            )
        soft = self.param("perm_soft", init, shape, work)
        m = perms.doubly_stochastic(soft.astype(work))
        penalty = perms.l1_l2_penalty(m)
        if not self.is_initializing():  # init keeps every mutable collection in the variables
            self.sow("intermediates", "permutation_penalty", penalty)
            weighted = jnp.float32(self.permutation_penalty) * penalty
            self.sow("losses", "permutation_penalty", weighted)
        if blocks:
            x = perms.apply_permutation(x, self._perm(n), self._label())
            return perms.block_permute(x, m)
        return perms.soft_permute(x, m)

    def _perm(self, n: int):
        """``diagonals/perm[n]``, drawn at init as a random permutation."""
        return self.variable(
            F.DIAGONALS_COLLECTION,
            "perm",
            lambda: perms.random_permutation(self.make_rng("params"), n),
        ).value

    def _check_phase(self):
        """Search-phase params (``alpha``) only go with a search-phase layer and collections."""
        if self.is_initializing() or not self.has_variable("params", "alpha"):
            return
        if self.has_variable(F.DIAGONALS_COLLECTION, "offsets"):
            raise ValueError(
                f"{self._label()}: mixed phases: params hold a search-phase layer (alpha [P], "
                f"values [P, ...]) but the 'diagonals' collection holds the offsets [K] of a "
                f"frozen one; pass params and collections of one phase (dd.freeze / "
                f"dd.freeze_tree return the frozen ones together)"
            )
        if self.init_phase == "frozen":
            raise ValueError(
                f"{self._label()}: this layer has init_phase='frozen' (dd.freeze returns it so) "
                f"and computes the frozen product, but was given search-phase variables (params "
                f"alpha [P], values [P, ...]): apply the search-phase layer to them, or freeze "
                f"them first (dd.freeze, dd.freeze_tree)"
            )

    def _check_stored_shapes(self):
        """Raises when the variables were made for another ``features`` or ``block_size``: a
        ``bias`` of another width, or search-phase ``values`` that no layer with this output
        width and block size has (element ``[P, D]``: ``features`` is ``P`` or ``D <= P``; block
        ``[P_b, L_b, b, b]``: ``features`` is ``L_b * b`` or ``P_b * b <= L_b * b``)."""
        if self.is_initializing():
            return
        bias = self.get_variable("params", "bias")
        if self.use_bias and bias is not None and bias.shape != (self.features,):
            raise ValueError(
                f"{self._label()}: params/bias has shape {list(bias.shape)}, but the layer has "
                f"features={self.features}: the variables were made by a layer with other "
                f"features"
            )
        if not self.has_variable("params", "alpha") or not self.has_variable("params", "values"):
            return
        p = self.get_variable("params", "alpha").shape[-1]
        rows = self.get_variable("params", "values").shape[1:]
        b = self.block_size
        if len(rows) == 1 and b == 1:
            outs = {p} | ({rows[0]} if rows[0] <= p else set())
        elif len(rows) == 3 and rows[1:] == (b, b):
            outs = {rows[0] * b} | ({p * b} if p <= rows[0] else set())
        else:
            outs = set()
        if self.features not in outs:
            raise ValueError(
                f"{self._label()}: the search-phase params (alpha [P] = [{p}], values "
                f"[P, {', '.join(map(str, rows))}]) were made by a layer with other features or "
                f"block_size than this one's features={self.features}, block_size={b}"
            )

    def _check_width(self, width: int):
        """Raises unless ``x``'s width is the layer's (known from its variables after init).

        Search phase: from the shapes, which must agree with the ``"diagonals"`` entry
        ``in_features`` (variables of a layer with another ``features`` can have the same
        shapes). Frozen: from ``values`` where its shape fixes the width, else from
        ``in_features``. Both read ``in_features`` when it is a host value; inside ``jit`` it is
        traced, so only the bounds the shape gives (:meth:`_guard_width` does the rest).
        """
        if self.in_features is not None and width != self.in_features:
            raise ValueError(
                f"{self._label()}: x has width {width}, the layer expects {self.in_features}"
            )
        if self.is_initializing() or not self.has_variable("params", "values"):
            return
        shape = self.get_variable("params", "values").shape
        if self.has_variable("params", "alpha"):
            # in the working-set form values has W rows; alpha has the P candidates
            p = self.get_variable("params", "alpha").shape[-1]
            exact, low, high = (F.search_width((p, *shape[1:]), self.features),) * 3
            stored = _host_int(self.get_variable(F.DIAGONALS_COLLECTION, "in_features"))
            if stored is not None and stored != exact:
                raise ValueError(
                    f"{self._label()}: the variables were made for inputs of width {stored} "
                    f"(diagonals/in_features), but a layer with features={self.features} reads "
                    f"their params (alpha [{p}], values {list(shape)}) as a {exact} -> "
                    f"{self.features} layer: the variables were made by a layer with other "
                    f"features"
                )
        else:
            exact, low, high = F.frozen_width(shape, self.features)
            if exact is None:
                exact = _host_int(self.get_variable(F.DIAGONALS_COLLECTION, "in_features"))
        if exact is not None and width != exact:
            raise ValueError(f"{self._label()}: x has width {width}, the layer expects {exact}")
        if width < low:
            raise ValueError(
                f"{self._label()}: x has width {width}, the layer expects at least {low}"
            )
        if high is not None and width > high:
            raise ValueError(
                f"{self._label()}: x has width {width}, the layer expects at most {high}"
            )

    def _guard_width(self, y, width: int):
        """NaN outputs when a traced stored width differs from ``x``'s (jit cannot raise)."""
        stored = self.get_variable(F.DIAGONALS_COLLECTION, "in_features")
        if stored is None or _host_int(stored) is not None:
            return y  # checked at trace time (or made before the entry existed)
        return jnp.where(stored == width, y, jnp.asarray(jnp.nan, y.dtype))

    def _frozen(self, spec: F.LayerSpec, x, perm):
        offsets = self.variable(
            F.DIAGONALS_COLLECTION,
            "offsets",
            lambda: F.random_offsets(self.make_rng("params"), spec),
        ).value
        if offsets.shape != (spec.k,):
            # Inside jit a frozen layer's stored width is traced, so a wrong x width first shows
            # here, as a budget that differs from the one the variables were frozen with.
            raise ValueError(
                f"{self._label()}: diagonals/offsets must have shape [K] = [{spec.k}] (the "
                f"budget of a {spec.in_features} -> {spec.out_features} layer), got "
                f"{offsets.shape}: x's width or the layer's sparsity/k differs from the ones the "
                f"variables were frozen with"
            )
        values = self.param("values", self._values_init(spec), offsets, self.param_dtype)
        y = F.frozen_forward(spec, values, offsets, x, perm)
        if F.frozen_width(values.shape, self.features)[0] is not None:
            return y  # the shape fixed the width
        return self._guard_width(y, spec.in_features)

    def _values_init(self, spec: F.LayerSpec):
        return F.init_values(spec, self.kernel_init, self.fan_in)

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
                else (self.gate_init if self.gate_init is not None else F.DEFAULT_HYPER[name])
            )
            stored = self.variable(F.GATE_COLLECTION, name, lambda: jnp.asarray(start, jnp.float32))
            self.variable(F.GATE_COLLECTION, "score", lambda: jnp.asarray(False))
            return stored.value if given is None else given
        if given is not None:
            return given
        if self.has_variable(F.GATE_COLLECTION, name):
            return self.get_variable(F.GATE_COLLECTION, name)
        raise ValueError(
            f"{self._label()}: the gate needs {name}=: pass it to the call, or "
            f"include the 'dynadiag' collection created by init in the variables "
            f"(set it with dd.nn.set_gate(variables, {name}=...))"
        )

    def _search(self, spec: F.LayerSpec, x, hyper):
        work = work_dtype(self.param_dtype)
        p = spec.num_candidates
        alpha = self.param("alpha", F.init_alpha, (p,), work).astype(work)
        working_set = self._working_set(spec)
        if working_set is None:
            every = jnp.arange(p, dtype=jnp.int32)
            values = self.param("values", self._values_init(spec), every, self.param_dtype)
        else:
            values = self.get_variable("params", "values")
            expected = (working_set.shape[0], *spec.row_shape)
            if values.shape != expected:
                raise ValueError(
                    f"{self._label()}: in the working-set form params/values must have shape "
                    f"[W, *V] = {list(expected)} (W = len(dynadiag/working_set)), got "
                    f"{list(values.shape)}"
                )
        stored = self.get_variable(F.GATE_COLLECTION, "topk")
        if stored is not None and stored.shape[-1] != spec.k and not self.is_initializing():
            # the freeze takes K from topk's length: a mismatch would freeze another budget
            raise ValueError(
                f"{self._label()}: dynadiag/topk holds K = {stored.shape[-1]} diagonals (the "
                f"budget the variables were made with), but this layer's budget is K = {spec.k} "
                f"({self._budget_text()} at {spec.in_features} -> {spec.out_features}): make the "
                f"layer with the sparsity/k the variables were made with"
            )
        tracking = self.has_variable(F.GATE_COLLECTION, "topk") and self.is_mutable_collection(
            F.GATE_COLLECTION
        )
        old = self.get_variable(F.GATE_COLLECTION, "topk") if tracking else None
        inputs = gate_inputs(alpha, hyper, old, gate=spec.gate, k=spec.k, impl=spec.impl)
        if self.is_initializing():
            self.variable(F.GATE_COLLECTION, "topk", lambda: inputs.topk)
        elif tracking:
            self.put_variable(F.GATE_COLLECTION, "topk", inputs.topk)
            self.sow("intermediates", "topk_changed", inputs.topk_changed)
        if working_set is None:
            score = (
                self.get_variable(F.GATE_COLLECTION, "score")
                if self.has_variable(F.GATE_COLLECTION, "score")
                else jnp.asarray(False)
            )
            y, stats = search_forward(spec, values, x, inputs, score=score)
        else:
            y, stats = working_set_forward(spec, values, working_set, x, inputs)
            y = self._guard_working_set(y, working_set, p)
        for name, value in stats._asdict().items():
            self.sow("intermediates", name, value)
        return nan_if_nan(y, hyper)

    def _working_set(self, spec: F.LayerSpec):
        """The ``"dynadiag"`` entry ``working_set`` as int32 (None without one), checked: its
        shape and dtype while tracing, its values when they can be read on the host."""
        if not self.has_variable(F.GATE_COLLECTION, "working_set"):
            return None
        ws = self.get_variable(F.GATE_COLLECTION, "working_set")
        p = spec.num_candidates
        problem = None
        if ws.ndim != 1 or not 1 <= ws.shape[0] <= p:
            problem = f"it must have shape [W] with 1 <= W <= P = {p}, got {tuple(ws.shape)}"
        elif not jnp.issubdtype(ws.dtype, jnp.integer):
            problem = f"it must hold int32 candidate ids, got {ws.dtype}"
        elif (host := perms.host_array(ws)) is not None:
            problem = working_set_problem(host, p)
        if problem:
            raise ValueError(
                f"{self._label()}: dynadiag/working_set is not a working set: {problem}"
            )
        return ws.astype(jnp.int32)

    def _guard_working_set(self, y, working_set, p: int):
        """NaN outputs when a traced working set is not distinct ids in ``[0, P)`` (``jit``
        cannot raise; the check is ``O(W log W)``)."""
        if perms.host_array(working_set) is not None:
            return y  # checked on the host
        ordered = jnp.sort(working_set)
        valid = (ordered[0] >= 0) & (ordered[-1] < p) & jnp.all(ordered[1:] != ordered[:-1])
        return jnp.where(valid, y, jnp.asarray(jnp.nan, y.dtype))
