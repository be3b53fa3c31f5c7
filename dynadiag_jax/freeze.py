"""Freezing: the search phase ends and every layer keeps the K diagonals with the largest alpha.

A frozen layer holds params ``values[K, *V]`` (+ ``bias``; ``V = (D,)`` for element diagonals,
``(L_b, b, b)`` for block diagonals) and, in the ``"diagonals"``
collection, ``offsets[K]`` int32, ``in_features`` (int32 scalar, its input width) and, with an
input permutation, ``perm[in]`` int32 (a learned one is hardened here from ``perm_soft``, its
kept entries folded into the values: :func:`dynadiag_jax.nn.permutation.harden_and_fold`; a
random one passes through); it computes
exactly the hard top-K product (gate 1 on the selected diagonals), with memory and compute K/P of
a dense layer. All functions here are pure and jit-able (K comes from static shapes), so a
training loop can freeze inside ``jax.jit``.

* :func:`freeze`: one layer, ``(layer, variables) -> (frozen_layer, frozen_variables)``.
* :func:`freeze_tree`: every search-phase ``DiagonalDense`` in a model's variables.
* :func:`freeze_opt_state`: the optimizer state that matches the frozen params.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from dynadiag_jax._checks import check_variables, host_array, int_in_range, refuse_nnx
from dynadiag_jax.nn.diagonal_dense import DiagonalDense
from dynadiag_jax.nn.functional import (
    DIAGONALS_COLLECTION,
    GATE_COLLECTION,
    search_width,
    select_diagonals,
)
from dynadiag_jax.nn.permutation import harden_and_fold, harden_blocks

__all__ = ["freeze", "freeze_tree", "freeze_opt_state", "select_diagonals"]

# Entries of a layer's "dynadiag" collection that only the search phase uses.
_SEARCH_STATE = ("strength", "temperature", "topk", "score")
# Params that only the search phase has: the scores and a learned permutation's soft matrix.
_SEARCH_PARAMS = ("alpha", "perm_soft")


def is_abstract(tree) -> bool:
    """Whether ``tree`` holds ``jax.ShapeDtypeStruct`` leaves (``eval_shape``'s: a template)."""
    return any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(tree))


def gather_rows(values, offsets):
    """``values[..., P, *V]`` rows ``offsets[..., K]`` -> ``[..., K, *V]``."""
    row_axis = offsets.ndim - 1
    extra = values.ndim - offsets.ndim
    return jnp.take_along_axis(values, offsets.reshape(offsets.shape + (1,) * extra), row_axis)


def _is_search_layer(node) -> bool:
    """``alpha[..., P]`` beside ``values[..., P, D]`` (element) or ``[..., P, L_b, b, b]``."""
    if not isinstance(node, Mapping) or "alpha" not in node or "values" not in node:
        return False
    alpha, values = node["alpha"], node["values"]
    return (
        hasattr(alpha, "shape")
        and hasattr(values, "shape")
        and values.ndim - alpha.ndim in (1, 3)
        and values.shape[: alpha.ndim] == alpha.shape
    )


def _not_finite_message(path: tuple, count: int, size: int) -> str:
    return (
        f"freeze_tree: alpha of the DiagonalDense at params path {'/'.join(path) or '(root)'} "
        f"holds {count} non-finite values (NaN or inf) of {size}: the search diverged (a NaN "
        f"loss or gradient), so its top-K is meaningless; freeze an earlier checkpoint"
    )


def finite_values(alpha, values, path: tuple):
    """``values[..., K, *V]`` of a layer frozen from ``alpha[..., P]``, if alpha is finite.

    A concrete ``alpha`` with NaN or inf raises naming ``path``. A traced one cannot be read while
    tracing: the values of every slice whose alpha is not finite become NaN instead, so everything
    the frozen layer computes is NaN (as for an offset out of range known only at run time),
    without a host callback. An abstract one (``jax.ShapeDtypeStruct``) has nothing to check.
    """
    if isinstance(alpha, jax.ShapeDtypeStruct):
        return values
    finite = jnp.all(jnp.isfinite(alpha), axis=-1)
    if isinstance(alpha, jax.core.Tracer):
        finite = finite.reshape(finite.shape + (1,) * (values.ndim - finite.ndim))
        return jnp.where(finite, values, jnp.asarray(jnp.nan, values.dtype))
    if not bool(jnp.all(finite)):
        raise ValueError(_not_finite_message(path, int(jnp.sum(~jnp.isfinite(alpha))), alpha.size))
    return values


def _input_width(node, path: tuple):
    """``in_features`` of a layer given without its ``"diagonals"`` entry (params frozen with
    ``budgets``), from the shapes: a bias gives ``out``, and a square layer has as many
    candidates as its diagonals are long."""
    lead = node["alpha"].shape[:-1]
    rows = node["values"].shape[len(lead) :]
    if "bias" in node:
        width = search_width(rows, node["bias"].shape[-1])
    elif rows[0] == rows[1]:  # square: P == D, or P_b == L_b
        width = rows[0] * (rows[-1] if len(rows) == 4 else 1)
    else:
        raise ValueError(
            f"freeze_tree: cannot tell the input width of the DiagonalDense at params path "
            f"{path}: its 'diagonals' entry 'in_features' (created by init) is missing and a "
            f"rectangular layer without bias does not fix it; keep the 'diagonals' collection "
            f"in the variables"
        )
    return jnp.full(lead, width, jnp.int32)


def _search_layers(flat: dict) -> dict[tuple, dict]:
    """``{path: {name: leaf}}`` of the search-phase layers in a flattened params tree."""
    nodes = {}
    for key, leaf in flat.items():
        nodes.setdefault(key[:-1], {})[key[-1]] = leaf
    return {path: node for path, node in nodes.items() if _is_search_layer(node)}


def _path_text(path: tuple) -> str:
    return "/".join(map(str, path)) or "(root)"


def _checked_budgets(budgets, layers: dict, frozen: set) -> dict:
    """``budgets`` as a dict after checking its paths against the layers' (search-phase
    ``layers`` and already ``frozen`` ones, whose budget is ignored) and each K against ``[1, P]``.
    """
    if budgets is None:
        return {}
    if not isinstance(budgets, Mapping):
        raise TypeError(
            f"freeze_tree: budgets must be a mapping {{params path tuple: K}}, "
            f"got {type(budgets).__name__}"
        )
    known = set(layers) | frozen
    for path, k in budgets.items():
        if path not in known:
            listed = ", ".join(repr(p) for p in sorted(known, key=str)) or "none"
            raise ValueError(
                f"freeze_tree: budgets has the path {path!r}, which is no DiagonalDense's params "
                f"path (a tuple of the keys under 'params'); the layers are at: {listed}"
            )
        if path in layers:
            p = layers[path]["alpha"].shape[-1]
            int_in_range(k, f"freeze_tree: budgets[{path!r}]", 1, p, "[1, P]")
    return dict(budgets)


def freeze_tree(variables, *, budgets: Mapping[tuple, int] | None = None):
    """Freezes every search-phase ``DiagonalDense`` in a model's ``variables`` (pure, jit-able).

    A search-phase layer is found by its params (``alpha[..., P]`` next to ``values[..., P, *V]``);
    its budget K is the length of its ``"dynadiag"`` entry ``topk`` (created by ``init``), so K is
    static under ``jit``. Stacked layers (``nn.scan``/``nn.vmap``: leading axes on every leaf) are
    frozen per slice. Layers already frozen and all other collections pass through. Abstract
    variables (``jax.ShapeDtypeStruct`` leaves, e.g. ``jax.eval_shape(model.init, ...)``) give the
    abstract frozen ones: the template to restore a frozen checkpoint into.

    Args:
      variables: ``{"params": ..., "dynadiag": ..., ...}`` of a whole model.
      budgets: optional ``{path tuple: K}`` for layers whose ``"dynadiag"`` collection is absent
        (path = keys under ``"params"``, e.g. ``("Block_0", "DiagonalDense_0")``; ``K`` in
        ``[1, P]``). A layer already frozen keeps its K.

    Returns:
      Variables with each such layer's params ``{"values": [..., K, *V], "bias"?}``, its
      ``"diagonals"`` entry ``{"offsets": [..., K] int32, "in_features": [...] int32}`` (and
      ``"perm": [..., in] int32`` hardened from a learned permutation's ``perm_soft``), and its
      search entries removed from ``"dynadiag"`` (the collection disappears when empty).

    Raises:
      TypeError: ``budgets`` is not a mapping, or one of its K is not an int.
      ValueError: a ``budgets`` path that is no layer's (the message lists the layers' paths) or
        a K outside ``[1, P]``; a layer in the working-set form (leave it first:
        :func:`dynadiag_jax.training.leave_working_set`); a search layer whose K or input width
        cannot be determined (without its ``"diagonals"`` entry only a bias or a square layer
        fixes the width), or whose concrete ``alpha`` holds NaN or inf (naming its path). Inside
        ``jit`` alpha cannot be read while tracing: such a layer's frozen ``values`` are NaN
        instead, so its outputs (and the loss) are NaN.
    """
    check_variables(variables, "variables", "freeze_tree")
    if is_abstract(variables):
        # abstract variables (jax.eval_shape of init): the template of a frozen checkpoint
        return jax.eval_shape(functools.partial(freeze_tree, budgets=budgets), variables)
    params = traverse_util.flatten_dict(variables["params"], keep_empty_nodes=True)
    gates = traverse_util.flatten_dict(variables.get(GATE_COLLECTION, {}))
    in_working_set = sorted("/".join(key[:-1]) for key in gates if key[-1] == "working_set")
    if in_working_set:
        raise ValueError(
            f"freeze_tree: the DiagonalDense at params path {in_working_set[0]} is in the "
            f"working-set form (values [W, ...] of the candidates dynadiag/working_set, the rest "
            f"in the 'dynadiag_store' collection): rebuild the plain search form first "
            f"(dynadiag_jax.training.leave_working_set, which freeze_state calls)"
        )
    diagonals = traverse_util.flatten_dict(
        variables.get(DIAGONALS_COLLECTION, {}), keep_empty_nodes=True
    )
    layers = _search_layers(params)
    frozen = {key[:-1] for key in diagonals if key[-1] == "offsets"}
    budgets = _checked_budgets(budgets, layers, frozen)
    for path, layer in layers.items():
        if path in budgets:
            k = budgets[path]
        elif path + ("topk",) in gates:
            k = gates[path + ("topk",)].shape[-1]
        else:
            raise ValueError(
                f"freeze_tree: cannot tell K for the DiagonalDense at params path {path}: its "
                f"'dynadiag' entry 'topk' (created by init) is missing; keep the 'dynadiag' "
                f"collection in the variables or pass budgets={{{path!r}: K}}"
            )
        width = diagonals.get(path + ("in_features",))
        if width is None:
            width = _input_width(layer, path)
        offsets = select_diagonals(layer["alpha"], k)
        for name in _SEARCH_PARAMS:
            params.pop(path + (name,), None)
        values = gather_rows(layer["values"], offsets)
        if "perm_soft" in layer and path + ("perm",) in diagonals:
            # the "blocks" relaxation: a base permutation and a hard forward, so nothing to fold
            diagonals[path + ("perm",)] = harden_blocks(
                layer["perm_soft"], diagonals[path + ("perm",)]
            )
        elif "perm_soft" in layer:
            soft = layer["perm_soft"]
            out_features = math.prod(layer["values"].shape[offsets.ndim - 1 :]) // soft.shape[-1]
            diagonals[path + ("perm",)], values = harden_and_fold(
                soft, values, offsets, out_features
            )
        params[path + ("values",)] = finite_values(layer["alpha"], values, path)
        diagonals[path + ("offsets",)] = offsets
        diagonals[path + ("in_features",)] = width
    out = dict(variables)
    out["params"] = traverse_util.unflatten_dict(params)
    if diagonals:
        out[DIAGONALS_COLLECTION] = traverse_util.unflatten_dict(diagonals)
    if GATE_COLLECTION in variables:
        kept = {
            key: leaf
            for key, leaf in gates.items()
            if not (key[:-1] in layers and key[-1] in _SEARCH_STATE)
        }
        if kept:
            out[GATE_COLLECTION] = traverse_util.unflatten_dict(kept)
        else:
            del out[GATE_COLLECTION]
    return out


def freeze(layer: DiagonalDense, variables):
    """Freezes one search-phase layer: ``(layer, variables) -> (frozen_layer, frozen_variables)``.

    The K diagonals with the largest ``alpha`` become a hard 0/1 gate. ``frozen_layer`` is
    ``layer`` with ``init_phase="frozen"`` (so its ``init`` builds a restore template of the same
    shapes) and ``in_features`` set to the width frozen (so a wrong ``x`` width is an error inside
    ``jit`` too, where the stored width is traced); applying either module to
    ``frozen_variables`` computes the frozen product. ``frozen_layer`` refuses search-phase
    variables.

    Args:
      layer: a :class:`dynadiag_jax.nn.DiagonalDense`.
      variables: that layer's variables (search phase; frozen ones come back unchanged).

    Returns:
      ``(frozen_layer, frozen_variables)`` with params ``{"values": [K, *V], "bias"}`` and
      ``{"diagonals": {"offsets": [K] int32, "in_features": int32 scalar}}``.

    Raises:
      ValueError: ``alpha`` holds NaN or inf (see :func:`freeze_tree`).
    """
    refuse_nnx(layer, "layer", "freeze", "dd.nnx.freeze(model)")
    if not isinstance(layer, DiagonalDense):
        raise TypeError(
            f"freeze expects a DiagonalDense, got {type(layer).__name__}; "
            f"use freeze_tree for a whole model"
        )
    check_variables(variables, "variables", "freeze")
    params = variables["params"]
    if not _is_search_layer(params):
        if "values" in params and "offsets" in variables.get(DIAGONALS_COLLECTION, {}):
            return layer.clone(init_phase="frozen"), variables
        raise ValueError(
            "freeze: variables are not those of a DiagonalDense (need params "
            "'alpha' [P] and 'values' [P, D] or [P, L_b, b, b])"
        )
    in_features = search_width(params["values"].shape, layer.features)
    diagonals = dict(variables.get(DIAGONALS_COLLECTION, {}))
    stored = host_array(diagonals.get("in_features"))
    bias = params.get("bias")
    if (stored is not None and int(stored) != in_features) or (
        bias is not None and bias.shape != (layer.features,)
    ):
        raise ValueError(
            f"freeze: the variables (values {list(params['values'].shape)}, "
            f"diagonals/in_features {None if stored is None else int(stored)}, bias "
            f"{None if bias is None else list(bias.shape)}) were not made by this layer "
            f"(features={layer.features}, which reads them as a {in_features} -> "
            f"{layer.features} layer): pass the layer that made them"
        )
    k = layer.budget(in_features)
    topk = variables.get(GATE_COLLECTION, {}).get("topk")
    if topk is not None and topk.shape[-1] != k:
        raise ValueError(
            f"freeze: dynadiag/topk holds K = {topk.shape[-1]} diagonals (the budget the "
            f"variables were made with), but the layer's budget is K = {k}: pass the layer "
            f"with the sparsity/k that made them"
        )
    frozen_layer = layer.clone(init_phase="frozen", in_features=in_features)
    diagonals.setdefault("in_features", jnp.asarray(in_features, jnp.int32))
    variables = {**variables, DIAGONALS_COLLECTION: diagonals}
    return frozen_layer, freeze_tree(variables, budgets={(): k})


def _is_params_like(node, params) -> bool:
    return isinstance(node, Mapping) and isinstance(params, Mapping) and set(node) == set(params)


def _checked_pair(params_before, params_after) -> tuple[dict, dict, dict]:
    """``(before, after, layers)``: both params trees flattened and the search layers of
    ``params_before``, after checking that ``params_after`` has the structure and shapes of its
    frozen form (shapes only: which rows were kept cannot be checked without the offsets)."""
    for name, tree in (("params_before", params_before), ("params_after", params_after)):
        refuse_nnx(tree, name, "freeze_opt_state", "dd.nnx.freeze_opt_state")
        if not isinstance(tree, Mapping):
            raise TypeError(
                f"freeze_opt_state: {name} must be a params tree (variables['params'], a "
                f"mapping), got {type(tree).__name__}"
            )
        if isinstance(tree.get("params"), Mapping):
            raise ValueError(
                f"freeze_opt_state: {name} holds a 'params' collection: pass the params "
                f"(variables['params']), not the whole variables"
            )
    before = traverse_util.flatten_dict(params_before)
    after = traverse_util.flatten_dict(params_after)
    layers = _search_layers(before)
    searching = _search_layers(after)
    if searching:
        swapped = "" if layers else " (params_before holds none: are the two swapped?)"
        raise ValueError(
            f"freeze_opt_state: params_after holds a search-phase DiagonalDense (alpha beside "
            f"values) at params path {_path_text(next(iter(searching)))}{swapped}; "
            f"params_before: the search-phase params the optimizer state was made for, "
            f"params_after: freeze_tree(...)['params']"
        )
    expected = {
        key: leaf
        for key, leaf in before.items()
        if not (key[:-1] in layers and key[-1] in _SEARCH_PARAMS)
    }
    hint = "pass params_after = freeze_tree(variables)['params'] of the same model"
    missing = sorted(expected.keys() - after.keys(), key=str)
    if missing:
        raise ValueError(
            f"freeze_opt_state: params_after has no entry {_path_text(missing[0])}, which the "
            f"frozen form of params_before has; {hint}"
        )
    extra = sorted(after.keys() - expected.keys(), key=str)
    if extra:
        raise ValueError(
            f"freeze_opt_state: params_after has the entry {_path_text(extra[0])}, which the "
            f"frozen form of params_before has not; {hint}"
        )
    for key, leaf in expected.items():
        want, got = np.shape(leaf), np.shape(after[key])
        if key[:-1] in layers and key[-1] == "values":
            # the freeze cuts the P axis of values to K in [1, P]; every other axis stays
            axis = layers[key[:-1]]["alpha"].ndim - 1
            fits = len(got) == len(want) and 1 <= got[axis] <= want[axis]
            fits = fits and got[:axis] + got[axis + 1 :] == want[:axis] + want[axis + 1 :]
            want = f"{list(want)} with axis {axis} (P = {want[axis]}) cut to K in [1, P]"
        else:
            fits, want = got == want, list(want)
        if not fits:
            raise ValueError(
                f"freeze_opt_state: params_after's {_path_text(key)} has shape {list(got)}, "
                f"params_before's frozen form has {want}; {hint}"
            )
    return before, after, layers


def freeze_opt_state(opt_state: Any, params_before, params_after):
    """The optimizer state for ``params_after = freeze_tree(...)["params"]`` (pure, jit-able).

    Every params-shaped tree inside ``opt_state`` (Adam ``mu``/``nu``, momentum traces, ...,
    including the ``MaskedNode`` trees of ``optax.masked``/``multi_transform``) loses its ``alpha``
    (and ``perm_soft``) entries, and keeps for ``values`` the rows of the selected diagonals,
    selected exactly as :func:`freeze_tree` does (top-K of ``params_before``'s alpha, K from
    ``params_after``). Counts and other leaves are kept, and so are trees already in the frozen
    form. The result has the structure ``tx.init(params_after)`` would give. Abstract arguments
    (``jax.ShapeDtypeStruct`` leaves) give the abstract result: a restore template.

    Only statistics shaped like ``values`` (or scalars) can be cut this way: an optimizer that
    keeps another shape for them (``optax.adafactor``'s factored rows and columns, or its ``(1,)``
    placeholder) is refused; start its state afresh with ``tx.init(params_after)``.

    Args:
      opt_state: state of an optax transformation initialised on ``params_before``.
      params_before: the search-phase params (``variables["params"]``).
      params_after: the frozen params.

    Raises:
      TypeError: ``params_before`` or ``params_after`` is not a params tree.
      ValueError: ``params_after`` does not have the structure and shapes of the frozen form of
        ``params_before`` (whole variables instead of their ``"params"``, the two swapped, another
        model's), or ``opt_state`` holds a params tree made for other params, or a statistic of
        ``values`` of another shape.
    """
    if is_abstract((opt_state, params_before, params_after)):
        return jax.eval_shape(freeze_opt_state, opt_state, params_before, params_after)
    before, after, layers = _checked_pair(params_before, params_after)
    offsets = {
        path: select_diagonals(
            layer["alpha"], after[path + ("values",)].shape[layer["alpha"].ndim - 1]
        )
        for path, layer in layers.items()
    }

    def convert(node):
        flat = traverse_util.flatten_dict(node, keep_empty_nodes=True)
        if traverse_util.flatten_dict(node).keys() == after.keys():
            return node  # already in the frozen form
        for path, kept in offsets.items():
            if path + ("alpha",) not in flat:
                raise ValueError(
                    f"freeze_opt_state: opt_state holds a params tree without the alpha of the "
                    f"DiagonalDense at params path {_path_text(path)}, which is not "
                    f"params_before's structure; pass the state of tx.init(params_before)"
                )
            for name in _SEARCH_PARAMS:
                flat.pop(path + (name,), None)
            value = flat.get(path + ("values",))
            shape = getattr(value, "shape", None)
            if shape == before[path + ("values",)].shape:
                flat[path + ("values",)] = gather_rows(value, kept)
            elif shape not in (None, ()):  # None: optax.masked's MaskedNode
                raise ValueError(
                    f"freeze_opt_state: opt_state holds a statistic of shape {list(shape)} for "
                    f"the values {list(before[path + ('values',)].shape)} of the DiagonalDense "
                    f"at params path {_path_text(path)}: the state of another model (pass "
                    f"tx.init(params_before)'s), or of a factored optimizer (e.g. "
                    f"optax.adafactor), whose statistics cannot be cut to the kept diagonals "
                    f"(start it afresh with tx.init(params_after))"
                )
        return traverse_util.unflatten_dict(flat)

    def is_params(node) -> bool:
        return _is_params_like(node, params_before) or _is_params_like(node, params_after)

    return jax.tree_util.tree_map(
        lambda node: convert(node) if is_params(node) else node, opt_state, is_leaf=is_params
    )
