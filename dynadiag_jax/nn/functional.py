"""The functional core of a diagonal layer: pure functions over params, gate state and ``x``.

Layer classes hold variables and call these functions; ``dd.nn.DiagonalDense`` (Flax linen) is
one such wrapper, and any other framework can wrap the same core with the same variable names:

* search phase: params ``alpha[P]``, ``values[P, *V]``, ``bias[out]``; gate state ``strength``
  (``gate="sparse_topk"``) or ``temperature`` (``gate="softmax"``) float32 scalar, ``topk[K]``
  int32 (the top-K offsets by alpha at the last refresh), ``score`` bool scalar;
* frozen: params ``values[K, *V]``, ``bias[out]``; ``offsets[K]`` int32;
* both phases: ``in_features`` (int32 scalar), the input width.

``V`` is ``(D,)`` for element diagonals and ``(L_b, b, b)`` for block diagonals
(``block_size = b >= 2``; docs/design.md section 1 gives both index conventions).

* :class:`LayerSpec`: the static facts of one layer at one input width (hashable, so it can be a
  static argument of ``jit``).
* :func:`init_alpha`, :func:`init_values`, :func:`random_offsets`: initial values.
* :func:`~dynadiag_jax.nn.search.gate_inputs`, :func:`~dynadiag_jax.nn.search.search_forward`:
  the search phase (gate, ranking and top-K refresh; exploration, product, metrics:
  ``search.py``).
* :func:`frozen_forward`: the product of exactly ``K`` diagonals with a hard gate of 1.
* :func:`select_diagonals`: the top-K offsets by alpha (the freeze keeps them).
* :func:`search_width`, :func:`frozen_width`: the input width that variables' shapes fix.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from dynadiag_jax._checks import check_sparsity, int_in_range
from dynadiag_jax.layout import DiagGeometry, geometry, num_diagonals
from dynadiag_jax.ops import diag_matmul
from dynadiag_jax.ops.ranking import descending_order
from dynadiag_jax.ops.reference import dense_to_diag

__all__ = [
    "GATES",
    "EXPLORE_MODES",
    "HYPER_NAME",
    "GATE_COLLECTION",
    "DIAGONALS_COLLECTION",
    "CARRY_ADVICE",
    "LAYER_COLLECTIONS",
    "PRODUCT_NAME",
    "DEFAULT_HYPER",
    "LayerSpec",
    "layer_budget",
    "check_sparsity",
    "check_init_and_search",
    "check_layer_input",
    "init_alpha",
    "init_values",
    "random_offsets",
    "frozen_forward",
    "select_diagonals",
    "search_width",
    "frozen_width",
]

EXPLORE_MODES = ("buckets", "dense_score", "none")
SCALES = ("none", "rms")
FAN_INS = ("sparse", "dense")
# nn.Dense's default: a DiagonalDense in place of an nn.Dense starts from the same distribution.
DEFAULT_KERNEL_INIT = nn.initializers.lecun_normal()
DEFAULT_BIAS_INIT = nn.initializers.zeros_init()
# Each gate's hyper-parameter, the name of its entry in the gate state and of the call's argument.
HYPER_NAME = {"sparse_topk": "strength", "softmax": "temperature"}
GATES = tuple(HYPER_NAME)
# A layer's collections besides "params": the search phase's gate state (the hyper-parameter,
# topk, score) and the diagonals it holds (offsets once frozen, in_features, perm).
GATE_COLLECTION = "dynadiag"
DIAGONALS_COLLECTION = "diagonals"
LAYER_COLLECTIONS = (GATE_COLLECTION, DIAGONALS_COLLECTION)
# The name of every layer's product (before the bias) for rematerialisation policies: it is no
# dot_general, so jax.checkpoint_policies.dots_saveable would recompute it; save it with
# save_only_these_names(PRODUCT_NAME) or save_any_names_but_these.
PRODUCT_NAME = "dynadiag_product"
# What a lifted transform around a diagonal layer must list to carry its collections.
CARRY_ADVICE = (
    "list them in its variable_axes (e.g. variable_axes={'params': 0, 'dynadiag': 0, "
    "'diagonals': 0}, or {True: 0})"
)


def uncarried_collections(module, collections=LAYER_COLLECTIONS) -> list[str]:
    """Those of ``collections`` that ``module`` (initialising) cannot create: inside ``nn.scan``
    or ``nn.vmap``, each one the transform's ``variable_axes`` do not list."""
    if not module.is_initializing():
        return []
    return [c for c in collections if not module.scope.is_mutable_collection(c)]


# The gate value a layer starts with when neither the call nor the layer gives one.
DEFAULT_HYPER = {"strength": 1.0, "temperature": 5.0}
# alpha = (1 + ALPHA_NOISE * u) / P with u ~ U(0, 1): breaks most ties in the ranking (float32
# holds about 8k values in [1/P, 1.001/P]: at P = 3072 some hundreds stay tied, so a hard gate
# right after init can share its K-th place), and stays far below any sensible strength, so the
# first sparse gate is uniform (K / P) on every diagonal.
ALPHA_NOISE = 1e-3


def check_layer_input(x) -> None:
    """Rejects a layer input that is not an array (``TypeError``), not floating (``TypeError``)
    or a scalar (``ValueError``): a layer takes ``x[..., in]``."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(f"x must be an array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating array [..., in], got {x.dtype}{tuple(x.shape)}")
    if x.ndim < 1:
        raise ValueError(f"x must be a floating array [..., in], got {x.dtype}{tuple(x.shape)}")


def check_init_and_search(fan_in: str, scale: str) -> None:
    """Rejects an unknown ``fan_in`` or ``scale``."""
    if fan_in not in FAN_INS:
        raise ValueError(f"unknown fan_in {fan_in!r}; expected one of {FAN_INS}")
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; expected one of {SCALES}")


def layer_budget(
    in_features: int, out_features: int, *, sparsity=None, k=None, block_size: int = 1
) -> int:
    """The number of diagonals ``K`` a layer keeps: ``k`` if given, else from ``sparsity``.

    Raises:
      ValueError: neither or both given, sparsity outside (0, 1), ``k`` outside ``[1, P]``.
      TypeError: a ``sparsity`` that is not a number or a ``k`` that is not an int.
    """
    geo = geometry(in_features, out_features, block_size)
    if (sparsity is None) == (k is None):
        raise ValueError("give exactly one of sparsity= (in (0, 1)) or k= (number of diagonals)")
    if k is None:
        check_sparsity(sparsity)
        return num_diagonals(geo.in_features, geo.out_features, sparsity, block_size=geo.block_size)
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if not 1 <= k <= geo.num_candidates:
        raise ValueError(
            f"budget k={k} must be in [1, P] with P = {geo.num_candidates} candidate diagonals "
            f"for a {geo.in_features} -> {geo.out_features} layer"
            + (f" with block_size={geo.block_size}" if geo.blocked else "")
        )
    return int(k)


class LayerSpec(NamedTuple):
    """Static facts of one diagonal layer at one input width.

    Attributes:
      in_features, out_features: the widths of ``W[out, in]``.
      k: the budget ``K`` (number of diagonals kept).
      block_size: 1 for element diagonals, ``b >= 2`` for block diagonals.
      gate: ``"sparse_topk"`` or ``"softmax"``.
      slack: ``K_cap = min(P, ceil((1 + slack) * K))``.
      explore: ``"buckets"``, ``"dense_score"`` or ``"none"`` (see ``search.py``).
      num_buckets: static sizes for ``explore="buckets"``.
      impl: passed to :func:`dynadiag_jax.diag_matmul`.
      scale: the search product's output scale (``search.py``): ``"none"`` or ``"rms"``.
    """

    in_features: int
    out_features: int
    k: int
    block_size: int = 1
    gate: str = "sparse_topk"
    slack: float = 0.25
    explore: str = "buckets"
    num_buckets: int = 4
    impl: str = "auto"
    scale: str = "rms"

    @property
    def geometry(self) -> DiagGeometry:
        return geometry(self.in_features, self.out_features, self.block_size)

    @property
    def num_candidates(self) -> int:
        """``P``: ``max(in, out)`` element diagonals or ``min(in, out) / b`` block diagonals."""
        return self.geometry.num_candidates

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of one diagonal's values: ``(D,)`` or ``(L_b, b, b)``."""
        return self.geometry.values_shape

    @property
    def k_cap(self) -> int:
        """``min(P, ceil((1 + slack) * K))``: diagonals a fixed-size search step computes (the
        product rounded to 9 decimals first: 1.12 * 25 is 28.000000000000004 in floats)."""
        p = self.num_candidates
        if self.slack * self.k >= p:  # also a slack so large that the product overflows
            return p
        return min(p, math.ceil(round((1.0 + self.slack) * self.k, 9)))

    @property
    def hyper_name(self) -> str:
        """``"strength"`` for the sparse gate, ``"temperature"`` for the softmax gate."""
        return HYPER_NAME[self.gate]


def init_alpha(key, shape, dtype=jnp.float32):
    """``alpha[P] = (1 + 1e-3 u) / P``, ``u ~ U(0, 1)``: equal scores up to a tie-breaking noise."""
    (p,) = shape
    u = jax.random.uniform(key, shape, jnp.float32)
    return ((1.0 + ALPHA_NOISE * u) / p).astype(dtype)


def init_values(spec: LayerSpec, kernel_init=DEFAULT_KERNEL_INIT, fan_in: str = "sparse"):
    """Initializer ``(key, offsets[N], dtype) -> values[N, *V]`` drawn as a dense layer would be.

    A dense kernel ``[in, out]`` (flax's layout) is drawn with ``kernel_init`` (``nn.Dense``'s
    argument of the same name) and its entries on the diagonals ``offsets`` become the values, so
    every value has the distribution the dense layer gives that position. ``fan_in="sparse"``
    multiplies them by ``1 / sqrt(density)`` (``density = K * entries per diagonal / (in * out)``,
    the frozen layer's): each output then sums its ``density * in`` inputs at the scale the dense
    layer has with all ``in``, instead of starting ``sqrt(density)`` times smaller as a masked
    dense layer does (``fan_in="dense"``). The draw is dense-sized once, as ``nn.Dense``'s init.
    A sharding annotation on the kernel (``nn.with_partitioning`` / ``nnx.with_partitioning``) is
    dropped with the kernel: its axes name ``[in, out]``, not the values' ``[N, *V]``.
    """
    check_init_and_search(fan_in, "none")
    geo = spec.geometry
    per_diagonal = math.prod(geo.values_shape)
    density = spec.k * per_diagonal / (spec.in_features * spec.out_features)
    gain = 1.0 / math.sqrt(density) if fan_in == "sparse" else 1.0

    def init(key, offsets, dtype=jnp.float32):
        kernel = _unboxed(kernel_init(key, (spec.in_features, spec.out_features), jnp.float32))
        values = dense_to_diag(kernel.T, offsets, block_size=spec.block_size)
        return (gain * values).astype(dtype)

    return init


def _unboxed(kernel):
    """``kernel`` without the metadata box of linen's (``nn.Partitioned``) or NNX's
    (``VariableMetadata``) partitioned initializers."""
    kernel = nn.meta.unbox(kernel)
    return getattr(kernel, "raw_value", kernel)


def random_offsets(key, spec: LayerSpec):
    """``K`` distinct random offsets in ``[0, P)``, ascending int32 (the static baseline)."""
    perm = jax.random.permutation(key, spec.num_candidates)
    return jnp.sort(perm[: spec.k]).astype(jnp.int32)


def select_diagonals(alpha, k: int):
    """The ``k`` offsets with the largest ``alpha[..., P]``, sorted ascending, int32 ``[..., k]``.

    Ties go to the lower offset; NaN scores rank with -inf, below every other score (the order of
    :func:`dynadiag_jax.ops.ranking.descending_order`, which the search phase's ``topk`` uses).

    Raises:
      TypeError: ``alpha`` is not a floating array, or ``k`` is not an int.
      ValueError: ``alpha`` is a scalar, or ``k`` is outside ``[1, P]``.
    """
    if not hasattr(alpha, "shape") or not hasattr(alpha, "dtype"):
        raise TypeError(
            f"select_diagonals: alpha must be a floating array [..., P], got {type(alpha).__name__}"
        )
    got = f"{alpha.dtype}{list(alpha.shape)}"
    if not jnp.issubdtype(alpha.dtype, jnp.floating):
        raise TypeError(f"select_diagonals: alpha must be a floating array [..., P], got {got}")
    if alpha.ndim < 1:
        raise ValueError(f"select_diagonals: alpha must be a floating array [..., P], got {got}")
    k = int_in_range(k, "select_diagonals: k", 1, alpha.shape[-1], "[1, P]")
    order = descending_order(jax.lax.stop_gradient(alpha))
    return jnp.sort(order[..., :k], axis=-1)


def frozen_forward(spec: LayerSpec, values, offsets, x, perm=None):
    """``x[..., perm] @ W.T`` for the ``K`` diagonals ``offsets[K]`` with ``values[K, *V]``.

    ``values`` is cast to ``x.dtype`` (the computation dtype); no bias. ``perm``: the layer's
    input permutation (int32 ``[in]``) or None; the product reads ``x`` through it (on CPU inside
    the kernels, docs/design.md section 4.7).
    """
    y = diag_matmul(
        x,
        values.astype(x.dtype),
        offsets,
        out_features=spec.out_features,
        impl=spec.impl,
        perm=perm,
    )
    return checkpoint_name(y, PRODUCT_NAME)


def search_width(values_shape, out_features: int) -> int:
    """The input width of search-phase ``values[P, *V]`` of a layer with ``out_features``.

    Element ``[P, D]``: ``D`` if ``P == out`` (tall or square), else ``P`` (wide). Block
    ``[P_b, L_b, b, b]``: ``P_b * b`` if ``L_b * b == out`` (tall or square), else ``L_b * b``.
    """
    if len(values_shape) == 2:
        p, d_len = values_shape
        return d_len if p == out_features else p
    p, length, b, _ = values_shape
    return p * b if length * b == out_features else length * b


def frozen_width(values_shape, out_features: int) -> tuple[int | None, int, int | None]:
    """``(exact, low, high)``: what frozen ``values[K, *V]`` say about the input width.

    Element ``[K, D]``: ``D < out`` fixes ``in = D`` (tall); ``D == out`` only says ``in >= out``.
    Block ``[K, L_b, b, b]``: ``L_b * b > out`` fixes ``in = L_b * b`` (wide); ``L_b * b == out``
    only says ``in <= out``. ``high`` is None when unbounded.
    """
    if len(values_shape) == 2:
        d_len = values_shape[-1]
        return (d_len, d_len, d_len) if d_len < out_features else (None, out_features, None)
    length, b = values_shape[1], values_shape[-1]
    if length * b > out_features:
        return length * b, length * b, length * b
    return None, b, out_features
