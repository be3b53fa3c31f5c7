"""The working-set form of the search phase: each layer trains only its top ``W`` candidates.

In the plain search phase a ``DiagonalDense`` holds ``values[P, *V]`` and every step moves
``[P, ...]``-sized buffers (the spread gradient, AdamW's pass over the values and both moments),
however few diagonals the gate keeps. In the working-set form (:func:`enter_working_set`) a layer
holds ``W = min(P, ceil(c K))`` candidates, the top ``W`` by alpha:

* params: ``alpha[P]`` (the gate still runs over all ``P``), ``values[W, *V]`` (row ``j``:
  candidate ``working_set[j]``);
* ``"dynadiag"``: ``working_set[W]`` int32 beside the gate entries;
* ``"dynadiag_store"`` (:data:`STORE_COLLECTION`, not a param: no gradient, no optimizer state):
  ``values[P, *V]``, where the candidates outside the working set keep their values (the rows of
  the members are stale until written back).

The optimizer state's param-shaped leaves (AdamW's moments) follow ``values`` to ``W`` rows, so a
step is ``W``-sized throughout. :func:`refresh_working_set` (a separate program, every ``R``
steps) moves the working set to the new top ``W`` by alpha: members that stay keep their slot
and their moments, leaving rows are written to the store, entering candidates take the freed
slots with their stored values and zero moments. :func:`leave_working_set` rebuilds the plain
form (moments of non-members zero), which :func:`~dynadiag_jax.training.freeze_state` does before
freezing. All functions are pure and jit-able; stacked layers (leading axes) are handled per
slice.

What changes against the plain search: a candidate outside the working set gets no value update
(no gradient, no AdamW momentum or decay) and its gate mass is dropped from the product
(``gate_mass_outside``); its alpha still trains through the gate, and it enters at the next
refresh once its alpha ranks in the top ``W``.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import traverse_util

from dynadiag_jax._checks import finite_number, int_at_least
from dynadiag_jax.freeze import _is_params_like, gather_rows
from dynadiag_jax.nn.functional import GATE_COLLECTION, select_diagonals
from dynadiag_jax.training.state import TrainState

__all__ = [
    "STORE_COLLECTION",
    "WorkingSet",
    "enter_working_set",
    "has_working_set",
    "leave_working_set",
    "refresh_working_set",
    "working_set_width",
]

STORE_COLLECTION = "dynadiag_store"


class WorkingSet(NamedTuple):
    """The working-set option of :func:`dynadiag_jax.training.train`.

    Attributes:
      factor: ``c >= 1``: each layer's working set holds ``W = min(P, ceil(c K))`` candidates.
      refresh_every: ``R >= 1``: the working set moves to the top ``W`` by alpha every ``R``
        steps after it is entered.
      start_step: the state with ``step == start_step`` is switched to the working-set form (after
        the gate's ``rescore_step``: the restart reads all ``P`` values).
    """

    factor: float
    refresh_every: int
    start_step: int

    def check(self) -> WorkingSet:
        """Raises ``ValueError``/``TypeError`` naming the bad attribute; returns ``self``."""
        check_factor(self.factor)
        int_at_least(self.refresh_every, "working_set.refresh_every", 1)
        int_at_least(self.start_step, "working_set.start_step", 0)
        return self


def check_factor(factor) -> float:
    """``factor`` as a float ``>= 1`` (the working set's width over ``K``), else raises."""
    c = finite_number(factor, "working set factor")
    if c < 1.0:
        raise ValueError(
            f"working set factor must be >= 1 (W = ceil(factor * K) holds at least the K kept "
            f"diagonals), got {factor!r}"
        )
    return c


def working_set_width(k: int, p: int, factor: float) -> int:
    """``W = min(P, ceil(factor * K))`` (``factor * K`` rounded first, so 1.1 * 10 is 11)."""
    return min(p, math.ceil(round(check_factor(factor) * k, 9)))


def has_working_set(collections) -> bool:
    """Whether any layer in ``collections`` is in the working-set form."""
    flat = traverse_util.flatten_dict(dict(collections).get(GATE_COLLECTION, {}) or {})
    return any(key[-1] == "working_set" for key in flat)


def _search_layers(params, gates) -> dict[tuple, int]:
    """``{path: K}`` of the layers with ``alpha`` and ``values`` params and a ``topk`` entry."""
    flat = traverse_util.flatten_dict(params)
    return {
        key[:-1]: gates[key[:-1] + ("topk",)].shape[-1]
        for key in flat
        if key[-1] == "alpha" and key[:-1] + ("values",) in flat and key[:-1] + ("topk",) in gates
    }


def _per_slice(fn, lead: int):
    """``fn`` mapped over ``lead`` leading axes of every argument (stacked layers)."""
    for _ in range(lead):
        fn = jax.vmap(fn)
    return fn


def _map_moments(opt_state, params, convert: dict):
    """``opt_state`` with ``fn(leaf)`` applied to the ``values`` leaf at each layer path of
    ``convert`` (``{path: (the leaf's shape, fn)}``) in every params-shaped tree (Adam's
    ``mu``/``nu``, ...); leaves of another shape (a ``MaskedNode``) are kept."""

    def one(node):
        flat = traverse_util.flatten_dict(node, keep_empty_nodes=True)
        for key, leaf in list(flat.items()):
            if key[-1] == "values" and key[:-1] in convert:
                shape, fn = convert[key[:-1]]
                if getattr(leaf, "shape", None) == shape:
                    flat[key] = fn(leaf)
        return traverse_util.unflatten_dict(flat)

    return jax.tree_util.tree_map(
        lambda node: one(node) if _is_params_like(node, params) else node,
        opt_state,
        is_leaf=lambda node: _is_params_like(node, params),
    )


def _replaced(state: TrainState, params: dict, gates: dict, store: dict | None, moments: dict):
    """``state`` with the flat ``params``, gate entries and store (None: no store collection),
    and its optimizer moments converted by ``moments`` (:func:`_map_moments`)."""
    collections = {**state.collections, GATE_COLLECTION: traverse_util.unflatten_dict(gates)}
    if store is None:
        collections.pop(STORE_COLLECTION, None)
    else:
        collections[STORE_COLLECTION] = traverse_util.unflatten_dict(store)
    return state._replace(
        params=traverse_util.unflatten_dict(params),
        opt_state=_map_moments(state.opt_state, state.params, moments),
        collections=collections,
    )


def enter_working_set(state: TrainState, factor: float) -> TrainState:
    """``state`` (plain search form) in the working-set form (see the module docstring).

    Each search-phase layer's working set is its top ``W = min(P, ceil(factor K))`` candidates by
    alpha, ascending; ``values`` (and their moments) are gathered to those rows, and the full
    ``values[P, *V]`` go to the ``"dynadiag_store"`` collection. Pure and jit-able.

    Raises:
      ValueError: ``factor < 1``, or ``state`` already in the working-set form.
    """
    factor = check_factor(factor)
    if has_working_set(state.collections):
        raise ValueError("enter_working_set: the state is already in the working-set form")
    gates = traverse_util.flatten_dict(state.collections.get(GATE_COLLECTION, {}))
    params = traverse_util.flatten_dict(state.params)
    store = traverse_util.flatten_dict(state.collections.get(STORE_COLLECTION, {}))
    moments = {}
    for path, k in _search_layers(state.params, gates).items():
        alpha, values = params[path + ("alpha",)], params[path + ("values",)]
        ws = select_diagonals(alpha, working_set_width(k, alpha.shape[-1], factor))
        moments[path] = (values.shape, functools.partial(gather_rows, offsets=ws))
        params[path + ("values",)] = gather_rows(values, ws)
        store[path + ("values",)] = values
        gates[path + ("working_set",)] = ws
    return _replaced(state, params, gates, store, moments)


def _refresh_layer(alpha, ws, values, store):
    """One layer's refresh: ``(working_set, values, store, keep[W])`` after it."""
    p, w = alpha.shape[-1], ws.shape[-1]
    new = select_diagonals(alpha, w)
    in_new = jnp.zeros((p,), jnp.bool_).at[new].set(True)
    in_old = jnp.zeros((p,), jnp.bool_).at[ws].set(True)
    keep = in_new[ws]
    # as many candidates enter as slots are freed; the padding pairs (p, w) are dropped
    entering = jnp.nonzero(in_new & ~in_old, size=w, fill_value=p)[0].astype(ws.dtype)
    free = jnp.nonzero(~keep, size=w, fill_value=w)[0]
    ws_new = ws.at[free].set(entering, mode="drop")
    store = store.at[ws].set(values)
    return ws_new, store[ws_new], store, keep


def refresh_working_set(state: TrainState) -> TrainState:
    """``state`` (working-set form) with each working set moved to the top ``W`` by alpha.

    Members still in the top ``W`` keep their slot, values and moments; the leaving rows are
    written to the store (every member's row is, so the store is current after a refresh);
    entering candidates take the freed slots (lowest slot to the lowest id) with their stored
    values and zero moments. Pure and jit-able; every buffer it writes per layer is ``W`` rows.

    Raises:
      ValueError: ``state`` is not in the working-set form.
    """
    if not has_working_set(state.collections):
        raise ValueError("refresh_working_set: the state is not in the working-set form")
    gates = traverse_util.flatten_dict(state.collections[GATE_COLLECTION])
    params = traverse_util.flatten_dict(state.params)
    store = traverse_util.flatten_dict(state.collections[STORE_COLLECTION])
    moments = {}
    for path in _working_set_layers(gates):
        alpha, values = params[path + ("alpha",)], params[path + ("values",)]
        ws = gates[path + ("working_set",)]
        refresh = _per_slice(_refresh_layer, alpha.ndim - 1)
        ws, values_new, stored, keep = refresh(alpha, ws, values, store[path + ("values",)])
        gates[path + ("working_set",)] = ws
        params[path + ("values",)] = values_new
        store[path + ("values",)] = stored
        mask = keep.reshape(keep.shape + (1,) * (values.ndim - keep.ndim))
        moments[path] = (
            values.shape,
            lambda leaf, m=mask: jnp.where(m, leaf, jnp.zeros((), leaf.dtype)),
        )
    return _replaced(state, params, gates, store, moments)


def _working_set_layers(gates) -> list[tuple]:
    return [key[:-1] for key in gates if key[-1] == "working_set"]


def _scatter_rows(full, rows, ws):
    """``full[..., P, *V]`` with rows ``ws[..., W]`` replaced by ``rows[..., W, *V]``."""
    return _per_slice(lambda f, r, i: f.at[i].set(r), ws.ndim - 1)(full, rows, ws)


def leave_working_set(state: TrainState) -> TrainState:
    """``state`` (working-set form) back in the plain search form: ``values[P, *V]`` rebuilt from
    the store with the members' rows, their moments on the same rows and zero elsewhere (the
    non-members' moments were dropped when the working set was entered, and an entering
    candidate starts from zero moments); the working sets and the store are removed. Pure and
    jit-able. A state without a working set is returned unchanged.
    """
    if not has_working_set(state.collections):
        return state
    gates = traverse_util.flatten_dict(state.collections[GATE_COLLECTION])
    params = traverse_util.flatten_dict(state.params)
    store = traverse_util.flatten_dict(state.collections[STORE_COLLECTION])
    moments = {}
    for path in _working_set_layers(gates):
        ws = gates.pop(path + ("working_set",))
        full = store.pop(path + ("values",))
        rows = params[path + ("values",)]
        params[path + ("values",)] = _scatter_rows(full, rows, ws)
        moments[path] = (
            rows.shape,
            lambda leaf, n=full.shape, i=ws: _scatter_rows(jnp.zeros(n, leaf.dtype), leaf, i),
        )
    return _replaced(state, params, gates, store or None, moments)
