"""Refit the kept diagonals of a model made from a dense one to the dense layers' outputs.

Freezing :func:`dynadiag_jax.from_dense`'s result keeps each dense kernel's entries on the K
diagonals of largest energy and drops the rest: at 90% sparsity most of every layer's output goes
with them (docs/training.md, "From a dense checkpoint": 16-29% test accuracy on the suites).
:func:`refit` chooses instead, for each output of each diagonal layer, the weights on its kept
inputs that best reproduce the dense layer's output on a calibration batch: a ridge least-squares
problem per output row, in the way one-shot pruning methods for large models reconstruct each
layer (docs/design.md section 4.6).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from dynadiag_jax._checks import boolean, check_variables, non_negative
from dynadiag_jax.freeze import freeze_tree
from dynadiag_jax.from_dense import _layer_matrix, _name
from dynadiag_jax.nn.diagonal_dense import DiagonalDense
from dynadiag_jax.nn.functional import DIAGONALS_COLLECTION
from dynadiag_jax.nn.sparsify import _shapes
from dynadiag_jax.ops.reference import _entry_indices

__all__ = ["refit"]


def _capture(model, variables, inputs, kinds, apply_kwargs) -> tuple[dict, dict]:
    """``({module path: [input of each call as [rows, in]]}, {module path: output width})`` of
    the modules of ``kinds``, in call order; an input given by keyword counts too."""
    seen: dict[tuple, list] = {}
    widths: dict[tuple, int] = {}

    def record(next_fun, args, kwargs, context):
        layer = context.module
        x = args[0] if args else kwargs.get("inputs", kwargs.get("x"))
        if context.method_name == "__call__" and isinstance(layer, kinds) and x is not None:
            x = np.asarray(x)
            # the contracted axes (trailing, as sparsify maps them) flattened to one
            contracted = len(_shapes(layer, x)[0]) if isinstance(layer, nn.DenseGeneral) else 1
            path = tuple(layer.path)
            seen.setdefault(path, []).append(
                x.reshape(-1, math.prod(x.shape[x.ndim - contracted :]))
            )
            features = layer.features
            widths[path] = math.prod(features) if isinstance(features, tuple | list) else features
        return next_fun(*args, **kwargs)

    with nn.intercept_methods(record):
        model.apply(variables, inputs, **apply_kwargs)
    return seen, widths


def _rows(calls: list, n_in: int, path: tuple, which: str) -> np.ndarray:
    """The inputs of every call of a layer as ``[rows, n_in]`` float64."""
    for x in calls:
        if x.shape[-1] != n_in:
            raise ValueError(
                f"refit: the {which} layer at params/{_name(path)} takes {x.shape[-1]} input "
                f"features, the diagonal layer {n_in}: pass the dense model it was made from"
            )
    rows = np.concatenate([np.asarray(x, np.float64) for x in calls])
    if not np.all(np.isfinite(rows)):
        raise ValueError(
            f"refit: the calibration inputs give non-finite activations at the {which} layer "
            f"params/{_name(path)}"
        )
    return rows


def _fit_layer(xs, y, w, offsets, n_in, n_out, block_size, ridge):
    """Values ``[K, *V]`` of one layer: per output row ``r``, the weights on its kept columns
    ``S_r`` minimising ``|xs[:, S_r] v - y[:, r]|^2 + ridge * s * |v - w[r, S_r]|^2`` (``s``: the
    mean of ``xs``'s squared entries, so ``ridge`` does not depend on the activations' scale)."""
    rows, cols = np.broadcast_arrays(*_entry_indices(offsets, n_in, n_out, block_size))
    shape = rows.shape
    rows, cols = rows.reshape(-1), cols.reshape(-1)
    if len(np.unique(rows * n_in + cols)) != len(rows):
        raise ValueError("repeated offsets: a frozen layer keeps each diagonal once")
    n = len(xs)
    gram = xs.T @ xs / n  # [in, in]
    cross = xs.T @ y / n  # [in, out]: what the kept inputs should reproduce
    scale = ridge * max(float(np.mean(np.diag(gram))), np.finfo(np.float64).tiny)
    fitted = np.zeros(len(rows))
    order = np.argsort(rows, kind="stable")
    starts = np.flatnonzero(np.r_[True, np.diff(rows[order]) != 0])
    for lo, hi in zip(starts, np.r_[starts[1:], len(order)]):
        entries = order[lo:hi]
        r, cs = rows[entries[0]], cols[entries]
        a = gram[np.ix_(cs, cs)] + scale * np.eye(len(cs))
        try:
            fitted[entries] = np.linalg.solve(a, cross[cs, r] + scale * w[r, cs])
        except np.linalg.LinAlgError:
            raise ValueError(
                f"the fit of output row {r} is singular: the calibration batch does not determine "
                f"its kept weights; pass ridge > 0 (or more input rows)"
            ) from None
    return fitted.reshape(shape)


def refit(
    model,
    variables,
    dense_model,
    dense_variables,
    inputs,
    *,
    ridge: float = 1e-3,
    sequential: bool = True,
    apply_kwargs: Mapping | None = None,
):
    """``variables`` with the kept diagonals of every diagonal layer refitted to the dense model
    (host NumPy in float64; not jit-able).

    For each ``DiagonalDense`` of ``model`` (in the order the model calls them) and each of its
    output rows ``r``: the weights on the row's kept inputs ``S_r`` are the ridge least-squares
    fit of the dense layer's output (bias excluded: both layers keep the same bias), ``min_v
    |X_s[:, S_r] v - X_d W[r]^T|^2 + ridge * s * |v - W[r, S_r]|^2``, where ``X_d`` is the dense
    layer's input on ``inputs``, ``X_s`` the diagonal layer's (the dense model's too with
    ``sequential=False``), ``W[out, in]`` the dense kernel and ``s`` the mean of ``diag(X_s^T X_s)
    / rows``. The ridge pulls towards the dense entries, where the calibration batch says
    nothing. With ``sequential=True`` each layer reads what the diagonal model, with the layers
    before it already refitted, gives it, so it also corrects what they could not reproduce.

    Args:
      model: the linen module with ``DiagonalDense`` layers (``dd.nn.sparsify`` or
        ``dd.models`` with ``ByPath``).
      variables: its variables in the search phase (e.g. from :func:`dynadiag_jax.from_dense`)
        or frozen. In the search phase the layers are frozen for the fit (each keeps its top-K
        by ``alpha``) and the fitted values are written into those rows of ``values[P, ...]``,
        so a later freeze keeps them; the other rows are unchanged.
      dense_model: the dense module with ``nn.Dense`` / ``nn.DenseGeneral`` layers at the
        params paths of the diagonal layers.
      dense_variables: its variables.
      inputs: a calibration batch, the first positional argument of both models (a few
        thousand rows reach each layer: e.g. 2048 images of 16 tokens).
      ridge: ``>= 0``, the pull towards the dense entries, relative to ``s`` above.
      sequential: whether each layer's input comes from the diagonal model with the earlier
        layers refitted (True) or from the dense model (False).
      apply_kwargs: keyword arguments of both ``apply`` calls (e.g. ``{"train": False}``).

    Returns:
      Variables of the structure of ``variables``.

    Raises:
      TypeError: a ``sequential`` that is not a bool (and the checks of the other arguments).
      ValueError: no diagonal layer; no dense layer at a diagonal layer's path, or a kernel of
        another shape; stacked (``nn.scan``) layers; non-finite activations or dense kernels; a
        negative or non-finite ``ridge``; a singular fit (``ridge=0``); a search-phase layer
        learning its permutation with the Sinkhorn relaxation (refit it frozen).
    """
    non_negative(ridge, "refit: ridge")
    boolean(sequential, "refit: sequential")
    for name, given in (("variables", variables), ("dense_variables", dense_variables)):
        check_variables(given, name, "refit")
    kwargs = dict(apply_kwargs or {})
    flat_search = traverse_util.flatten_dict(variables["params"])
    searching = any(k[-1] == "alpha" for k in flat_search)
    search_perms = traverse_util.flatten_dict(variables.get(DIAGONALS_COLLECTION, {}))
    for key in flat_search:
        if key[-1] == "perm_soft" and key[:-1] + ("perm",) not in search_perms:
            # the freeze folds the soft matrix's kept entries into the values: values fitted on
            # the frozen form and written back would be folded a second time
            raise ValueError(
                f"refit: the layer at params/{_name(key[:-1])} learns its input permutation "
                f"(perm_soft), which the freeze folds into its values; freeze first "
                f"(dd.freeze_tree) and refit the frozen variables"
            )
    frozen = freeze_tree(variables) if searching else variables
    params = traverse_util.flatten_dict(frozen["params"])
    diagonals = traverse_util.flatten_dict(frozen.get(DIAGONALS_COLLECTION, {}))
    dense_params = traverse_util.flatten_dict(dense_variables["params"])
    for key, offsets in diagonals.items():
        # before any call: inside nn.scan the layers' inputs are traced and cannot be captured
        if key[-1] == "offsets" and offsets.ndim != 1:
            raise ValueError(
                f"refit: the layer at params/{_name(key[:-1])} is stacked (offsets "
                f"{offsets.shape}, e.g. by nn.scan); refit fits one layer per call site"
            )

    calls, widths = _capture(model, frozen, inputs, DiagonalDense, kwargs)
    layers = [p for p in calls if p + ("values",) in params and p + ("offsets",) in diagonals]
    if not layers:
        raise ValueError(
            "refit: the model calls no frozen DiagonalDense with these variables; pass the model "
            "with diagonal layers and its variables (search phase or frozen)"
        )
    dense_calls, _ = _capture(
        dense_model, dense_variables, inputs, (nn.Dense, nn.DenseGeneral), kwargs
    )
    fitted = {}
    for i, path in enumerate(layers):
        values = np.asarray(params[path + ("values",)])
        offsets = np.asarray(diagonals[path + ("offsets",)])
        if path not in dense_calls or path + ("kernel",) not in dense_params:
            raise ValueError(
                f"refit: dense_model calls no nn.Dense / nn.DenseGeneral at params/{_name(path)}, "
                f"where the diagonal model has a DiagonalDense: pass the dense model it was made "
                f"from"
            )
        n_in = int(np.asarray(diagonals[path + ("in_features",)]).reshape(-1)[0])
        block_size = values.shape[-1] if values.ndim == 4 else 1
        kernel = dense_params[path + ("kernel",)]
        n_out = widths[path]
        if math.prod(np.shape(kernel)) != n_in * n_out:
            raise ValueError(
                f"refit: the dense kernel at params/{_name(path)} has shape {np.shape(kernel)}, "
                f"the diagonal layer maps {n_in} -> {n_out}: pass the dense model it was made from"
            )
        w = np.asarray(_layer_matrix(path, kernel, (), n_in, n_out), np.float64)
        if not np.all(np.isfinite(w)):
            raise ValueError(f"refit: the dense kernel at params/{_name(path)} holds NaN or inf")
        if sequential and i:
            frozen = _with_values(frozen, fitted)
            calls, _ = _capture(model, frozen, inputs, DiagonalDense, kwargs)
        xs = _rows(calls[path], n_in, path, "diagonal") if sequential else None
        xd = _rows(dense_calls[path], n_in, path, "dense")
        if xs is None:  # the dense model's inputs for every layer
            xs = xd
        if xs.shape != xd.shape:
            raise ValueError(
                f"refit: the diagonal and dense layers at params/{_name(path)} saw {xs.shape[0]} "
                f"and {xd.shape[0]} input rows: the two models must call it alike"
            )
        target = xd @ w.T
        perm = diagonals.get(path + ("perm",))
        if perm is not None:  # the layer applies its W to x[..., perm]: W[:, perm] is the prior
            perm = np.asarray(perm)
            xs, w = xs[:, perm], w[:, perm]
        try:
            new = _fit_layer(xs, target, w, offsets, n_in, n_out, block_size, ridge)
        except ValueError as e:
            raise ValueError(f"refit: the layer at params/{_name(path)}: {e}") from None
        fitted[path] = new.astype(values.dtype)
    if not searching:
        return _with_values(variables, fitted)
    search = traverse_util.flatten_dict(variables["params"])
    for path, new in fitted.items():
        rows = np.asarray(diagonals[path + ("offsets",)])
        full = np.array(search[path + ("values",)])
        full[rows] = new
        search[path + ("values",)] = jnp.asarray(full)
    return {**variables, "params": traverse_util.unflatten_dict(search)}


def _with_values(variables, fitted: dict):
    """``variables`` with ``params/<path>/values`` replaced for every path of ``fitted``."""
    flat = traverse_util.flatten_dict(variables["params"])
    for path, new in fitted.items():
        flat[path + ("values",)] = jnp.asarray(new)
    return {**variables, "params": traverse_util.unflatten_dict(flat)}
