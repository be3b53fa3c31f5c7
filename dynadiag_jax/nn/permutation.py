"""Input permutations of a diagonal layer: ``y = S(x[..., perm])`` (PA-DST's ``y = S P x``).

A layer with ``permutation="random"`` or ``"learned"`` applies one permutation of its ``in``
inputs before the diagonal product, so its kept entries ``W[o, perm[i]]`` need not lie on wrapped
diagonals of the original input order. Variables (names shared by every framework's layer):

* ``perm[in]`` int32, not trained (linen's ``"diagonals"`` collection, NNX's ``Diagonals``):
  ``"random"`` draws it at init; a ``"learned"`` layer gets it at the freeze;
* ``perm_soft[in, in]`` float32 param, ``"learned"`` only, search phase only: the relaxation
  (``[in / B, B, B]`` for the ``"blocks"`` relaxation, whose layers also hold ``perm`` while
  searching: the random permutation the blocks permute within).

The learned relaxation (PA-DST, after AutoShuffleNet): ``M = sinkhorn(|perm_soft|)`` is non-negative
and near doubly stochastic (:data:`SINKHORN_ITERS` row-then-column normalisations in every
forward, so no projection step is needed after the optimizer's), the layer computes
``S(x @ M.T)`` (dense: ``in * in`` multiply-adds per row of ``x``) and adds
``weight * l1_l2_penalty(M)`` to the loss, which is zero exactly on permutation matrices. The
freeze hardens ``M`` with :func:`hard_permutation`.

The ``"blocks"`` relaxation is cheaper: after a random ``perm``, one permutation inside each block
of ``B`` (:func:`soft_block_size`) positions, applied hard in the forward (a gather) and trained
straight through (:func:`block_permute`); the freeze composes the two (:func:`harden_blocks`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dynadiag_jax._checks import as_int32, finite_number, host_array, permutation_problem
from dynadiag_jax._dtypes import promote_floats, work_dtype
from dynadiag_jax.layout import block_indices, diag_indices
from dynadiag_jax.ops.reference import gather_columns, is_permutation, scatter_columns

__all__ = [
    "DEFAULT_PENALTY",
    "PERMUTATIONS",
    "PERMUTATION_STARTS",
    "RELAXATIONS",
    "SINKHORN_ITERS",
    "SOFT_BLOCK",
    "block_assignment",
    "block_permute",
    "check_permutation_args",
    "checked_permutation",
    "doubly_stochastic",
    "hard_permutation",
    "harden",
    "harden_blocks",
    "host_array",
    "init_block_soft",
    "init_soft",
    "apply_permutation",
    "harden_and_fold",
    "is_permutation",
    "l1_l2_penalty",
    "permute_inputs",
    "random_permutation",
    "soft_block_size",
    "soft_permute",
]

PERMUTATIONS = (None, "random", "learned")
SINKHORN_ITERS = 3
DEFAULT_PENALTY = 1e-3
# perm_soft's uniform part: U(1 - SOFT_INIT_NOISE, 1) / n, PA-DST's start (every input mixed into
# every position) with a noise that breaks the ties the penalty would otherwise keep. The 1 / n
# puts the entries at the scale of the normalised matrix, as PA-DST's projection after every step
# keeps them: the normalisation does not care about the scale, but Adam's steps (about the
# learning rate each) do. At U(0.5, 1) the MLP suite's search (lr 1e-3) left the penalty within
# 0.3% of its uniform value: nothing was learned before the freeze.
SOFT_INIT_NOISE = 0.5
# The starts of perm_soft: "random" puts RANDOM_START_WEIGHT on a random permutation matrix and
# the rest on the uniform part, so the search trains through a near-permutation from its first
# step and the freeze hardens a matrix whose rows already have an entry above 1/2; "uniform" is
# PA-DST's start, which a budget of a few epochs leaves far from any permutation at the freeze.
PERMUTATION_STARTS = ("random", "uniform")
RANDOM_START_WEIGHT = 0.5
# How a learned permutation is relaxed while it searches: "sinkhorn", PA-DST's soft in x in matrix
# (a dense mixing of the inputs); "blocks", a random base permutation followed by a hard
# permutation inside each block of at most SOFT_BLOCK inputs, trained straight through.
RELAXATIONS = ("sinkhorn", "blocks")
SOFT_BLOCK = 64
_TINY = 1e-12  # keeps a row or column of zeros from dividing by zero


def check_permutation_args(permutation, weight, start="random", relaxation="sinkhorn") -> None:
    """Raises ``ValueError`` for a ``permutation`` not in :data:`PERMUTATIONS`, a ``start`` not
    in :data:`PERMUTATION_STARTS`, a ``relaxation`` not in :data:`RELAXATIONS` or a negative or
    non-finite weight, ``TypeError`` for a weight that is not a number."""
    if not (permutation is None or (isinstance(permutation, str) and permutation in PERMUTATIONS)):
        raise ValueError(
            f"permutation must be one of {PERMUTATIONS} (None: no permutation), got {permutation!r}"
        )
    if not (isinstance(start, str) and start in PERMUTATION_STARTS):
        raise ValueError(f"permutation_start must be one of {PERMUTATION_STARTS}, got {start!r}")
    if not (isinstance(relaxation, str) and relaxation in RELAXATIONS):
        raise ValueError(f"permutation_relaxation must be one of {RELAXATIONS}, got {relaxation!r}")
    if finite_number(weight, "permutation_penalty") < 0:
        raise ValueError(f"permutation_penalty must be a finite float >= 0, got {weight!r}")


def random_permutation(key, n: int):
    """A uniformly random permutation of ``range(n)``, int32 ``[n]``."""
    return jax.random.permutation(key, n).astype(jnp.int32)


def init_soft(key, shape, dtype=jnp.float32, start: str = "random"):
    """``perm_soft[n, n]``: ``U(1 - SOFT_INIT_NOISE, 1) / n`` (``start="uniform"``), or that
    times ``1 - RANDOM_START_WEIGHT`` plus ``RANDOM_START_WEIGHT`` on the ones of a random
    permutation matrix (``"random"``)."""
    noise_key, perm_key = jax.random.split(key)
    n = shape[-1]
    uniform = jax.random.uniform(noise_key, shape, jnp.float32, 1.0 - SOFT_INIT_NOISE, 1.0) / n
    if start == "uniform":
        return uniform.astype(dtype)
    ones = jax.nn.one_hot(random_permutation(perm_key, n), n, dtype=jnp.float32)
    return (RANDOM_START_WEIGHT * ones + (1.0 - RANDOM_START_WEIGHT) * uniform).astype(dtype)


def doubly_stochastic(soft, iters: int = SINKHORN_ITERS):
    """``|soft[..., n, n]|`` after ``iters`` Sinkhorn sweeps (rows, then columns, sum to 1).

    The last normalisation is the columns', so columns sum to 1 exactly and rows approximately.
    """
    m = jnp.abs(soft) + _TINY
    for _ in range(iters):
        m = m / jnp.sum(m, axis=-1, keepdims=True)
        m = m / jnp.sum(m, axis=-2, keepdims=True)
    return m


def l1_l2_penalty(m):
    """AutoShuffleNet's ``sum_i (|m_i.|_1 - |m_i.|_2) + sum_j (|m_.j|_1 - |m_.j|_2)``, in
    float32 (float64 for float64 ``m``).

    ``m[..., n, n]``; summed over leading axes too. Zero exactly when every row and column holds
    one non-zero entry (on a doubly stochastic matrix: a permutation matrix), positive otherwise.
    """
    m = m.astype(work_dtype(m.dtype))
    a = jnp.abs(m)
    rows = jnp.sum(a, axis=-1) - jnp.sqrt(jnp.sum(m * m, axis=-1))
    cols = jnp.sum(a, axis=-2) - jnp.sqrt(jnp.sum(m * m, axis=-2))
    return jnp.sum(rows) + jnp.sum(cols)


def soft_permute(x, m):
    """``x[..., n] @ m[n, n].T`` in ``x``'s dtype: input ``i`` becomes ``sum_j m[i, j] x[j]``."""
    return jnp.einsum("...j,ij->...i", x, m.astype(x.dtype))


@jax.custom_vjp
def _gather(x, perm):
    return gather_columns(x, perm)


def _gather_fwd(x, perm):
    return _gather(x, perm), perm


def _gather_bwd(perm, dy):
    # perm is a bijection, so the scatter-add of the plain VJP is a gather by the inverse.
    return scatter_columns(dy, perm), None


_gather.defvjp(_gather_fwd, _gather_bwd)


def permute_inputs(x, perm):
    """``x[..., perm]`` for a permutation ``perm[n]`` of ``range(n)`` (not checked here).

    The gradient is a gather by the inverse permutation instead of a scatter-add.
    """
    return _gather(x, perm)


def checked_permutation(perm, n: int, label: str):
    """``perm`` as int32 after checking it against the input width ``n`` (errors name ``label``).

    The shape (``[n]``) and an integer dtype are checked while tracing. A value readable on the
    host (outside ``jit``, on CPU) must be a permutation of ``range(n)`` or this raises; a traced
    one cannot be read: its users make every output NaN when it is not a permutation (no host
    callback; the check is O(n) per call).
    """
    shape, dtype = tuple(getattr(perm, "shape", ())), getattr(perm, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise TypeError(
            f"{label}: perm must be an integer array [in] = [{n}] (a permutation of the "
            f"{n} inputs), got {dtype}{shape}"
        )
    if shape != (n,):
        raise ValueError(
            f"{label}: perm must be an integer array [in] = [{n}] (a permutation of the "
            f"{n} inputs), got {dtype}{shape}: x's width differs from the one the layer was "
            f"made for, or the variables are not this layer's"
        )
    host = host_array(perm)
    if host is not None:
        problem = permutation_problem(host, n)
        if problem is not None:
            raise ValueError(f"{label}: perm is not a permutation of range({n}): {problem}")
        return jnp.asarray(host, jnp.int32)
    return as_int32(perm)


def apply_permutation(x, perm, label: str):
    """``x[..., perm]`` after :func:`checked_permutation`; every output NaN for a traced ``perm``
    that is not a permutation."""
    perm = checked_permutation(perm, x.shape[-1], label)
    y = permute_inputs(x, perm)
    if host_array(perm) is not None:
        return y
    return jnp.where(is_permutation(perm), y, jnp.asarray(jnp.nan, y.dtype))


def hard_permutation(m):
    """The permutation that the soft ``m[..., n, n]`` stands for: int32 ``perm[..., n]``.

    A greedy assignment, pure JAX (so a jitted freeze can run it): rows in the order of their
    largest entry, largest first, each takes its largest entry among the columns not yet taken,
    ``perm[i] = column``. Always a bijection, whatever ``m`` holds (NaN included). When each row's
    largest entry is in a column of its own - true of a doubly stochastic ``m`` whose rows each
    have an entry above 1/2, as the penalty drives them - that is every row's argmax and the
    maximum-weight assignment (what ``scipy.optimize.linear_sum_assignment`` finds); otherwise it
    is a greedy approximation with no bound claimed. O(n^2) work in ``n`` steps.
    """
    m = jnp.asarray(m, jnp.float32)
    lead, n = m.shape[:-2], m.shape[-1]
    flat = m.reshape((-1, n, n))
    perms = jax.vmap(_greedy_assignment)(jnp.where(jnp.isnan(flat), -jnp.inf, flat))
    return perms.reshape((*lead, n))


def harden(soft):
    """``perm[..., n]`` int32 for a learned layer's ``perm_soft[..., n, n]`` at the freeze: the
    :func:`hard_permutation` of the matrix the search phase used, ``doubly_stochastic(soft)``."""
    return hard_permutation(doubly_stochastic(jnp.asarray(soft, jnp.float32)))


def harden_and_fold(soft, values, offsets, out_features: int):
    """The freeze of a learned permutation: ``(perm[..., n], values[..., K, *V])``.

    In the search phase input position ``i`` of the product read ``sum_j M[i, j] x[j]`` with ``M
    = doubly_stochastic(soft)``; the frozen layer reads ``x[perm[i]]``. So that the part of the
    function the hard permutation keeps stays as it was, every value is scaled by ``M[i,
    perm[i]]`` of the position ``i`` it reads (the rest of row ``i``, the mixing of other inputs,
    is what hardening drops). ``values`` and ``offsets`` are the kept diagonals (element ``[...,
    K, D]`` or block ``[..., K, L_b, b, b]``) of a layer of ``n`` inputs and ``out_features``
    outputs; ``values`` keep their dtype.
    """
    m = doubly_stochastic(jnp.asarray(soft, jnp.float32))
    perm = hard_permutation(m)
    kept = jnp.take_along_axis(m, perm[..., :, None], axis=-1)[..., 0]
    n, block = m.shape[-1], values.ndim - offsets.ndim == 3

    def fold(values, offsets, kept):
        if block:
            b = values.shape[-1]
            cols = block_indices(offsets, n, out_features, b)[1]  # [K, L_b] block columns
            scale = kept.reshape(-1, b)[cols][:, :, None, :]  # values[k, t, i, j] reads column j
        else:
            scale = kept[diag_indices(offsets, n, out_features)[1]]
        return (values.astype(jnp.float32) * scale).astype(values.dtype)

    for _ in range(offsets.ndim - 1):  # leading axes of stacked layers
        fold = jax.vmap(fold)
    return perm, fold(values, offsets, kept)


def _greedy_assignment(m):
    n = m.shape[-1]
    order = jnp.argsort(-jnp.max(m, axis=-1), stable=True)

    def take(taken, row):
        column = jnp.argmax(jnp.where(taken, -jnp.inf, m[row])).astype(jnp.int32)
        # a row of -inf (NaN in m) gets the first free column, not an already taken one
        column = jnp.where(taken[column], jnp.argmin(taken).astype(jnp.int32), column)
        return taken.at[column].set(True), column

    _, columns = jax.lax.scan(take, jnp.zeros((n,), bool), order)
    return jnp.zeros((n,), jnp.int32).at[order].set(columns)


def soft_block_size(n: int) -> int:
    """The block of the ``"blocks"`` relaxation at input width ``n``: the largest divisor of
    ``n`` that is at most :data:`SOFT_BLOCK`."""
    return max(d for d in range(1, min(n, SOFT_BLOCK) + 1) if n % d == 0)


def init_block_soft(key, shape, dtype=jnp.float32):
    """``perm_soft[G, B, B]`` of the ``"blocks"`` relaxation: ``RANDOM_START_WEIGHT`` on each
    block's identity (the layer's random base permutation is the start) plus the uniform part
    ``U(1 - SOFT_INIT_NOISE, 1) / B`` on the rest."""
    b = shape[-1]
    uniform = jax.random.uniform(key, shape, jnp.float32, 1.0 - SOFT_INIT_NOISE, 1.0) / b
    eye = jnp.broadcast_to(jnp.eye(b, dtype=jnp.float32), shape)
    return (RANDOM_START_WEIGHT * eye + (1.0 - RANDOM_START_WEIGHT) * uniform).astype(dtype)


def block_assignment(m):
    """``h[..., G * B]`` int32 for the blocks ``m[..., G, B, B]``: each block's
    :func:`hard_permutation`, as global input positions (block ``g`` reads from ``g * B`` on).

    Where every row's largest entry is in a column of its own (the usual case near a
    permutation) this is each row's argmax, and the greedy assignment is not run.
    """
    m = jnp.asarray(m, jnp.float32)
    *lead, g, b, _ = m.shape
    arg = jnp.argmax(m, axis=-1).astype(jnp.int32)
    counts = jnp.sum(jax.nn.one_hot(arg, b, dtype=jnp.int32), axis=-2)
    local = jax.lax.cond(
        jnp.all(counts == 1), lambda: arg, lambda: hard_permutation(m).astype(jnp.int32)
    )
    starts = (jnp.arange(g, dtype=jnp.int32) * b).reshape((1,) * len(lead) + (g, 1))
    return (local + starts).reshape((*lead, g * b))


@jax.custom_vjp
def block_permute(x, m):
    """``x[..., block_assignment(m)]`` for ``x[..., G * B]`` and one layer's ``m[G, B, B]``: the
    hard forward of the ``"blocks"`` relaxation, with a straight-through gradient: ``m`` gets the
    gradient of the soft product ``x_g @ m_g.T`` (per block ``g``), ``x`` the exact one of the
    gather (a gather by the inverse)."""
    return gather_columns(x, block_assignment(m))


def _block_permute_fwd(x, m):
    h = block_assignment(m)
    return gather_columns(x, h), (x, h, m)


def _block_permute_bwd(res, dy):
    x, h, m = res
    rows = (-1, *m.shape[:2])  # [rows, G, B]
    work = work_dtype(promote_floats(dy.dtype, x.dtype))
    dy_blocks, x_blocks = (a.reshape(rows).astype(work) for a in (dy, x))
    dm = jnp.einsum("rgi,rgj->gij", dy_blocks, x_blocks)
    return scatter_columns(dy, h), dm.astype(m.dtype)


block_permute.defvjp(_block_permute_fwd, _block_permute_bwd)


def harden_blocks(soft, base):
    """``perm[..., n]`` at the freeze of a ``"blocks"`` relaxation: the base permutation
    ``base[..., n]`` followed by the blocks' assignment of ``doubly_stochastic(soft)``."""
    h = block_assignment(doubly_stochastic(jnp.asarray(soft, jnp.float32)))
    return jnp.take_along_axis(jnp.asarray(base, jnp.int32), h, axis=-1)
