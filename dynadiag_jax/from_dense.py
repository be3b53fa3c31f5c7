"""Diagonal layers from a trained dense model (docs/design.md section 4.6).

:func:`from_dense` turns the variables of a dense model into those of the same model with
``DiagonalDense`` layers in place of some of its ``nn.Dense`` / ``nn.DenseGeneral`` layers (a
model built with ``dd.nn.sparsify`` or ``dd.models.ByPath``): each diagonal layer's ``values``
are the dense kernel's entries on every candidate diagonal, its ``alpha`` ranks the diagonals by
energy, and everything else is copied. Freezing the result keeps, per layer, the K diagonals of
largest energy: the dense model masked to them (the one-shot model); a search and a fine-tune can
start from it instead.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from dynadiag_jax._checks import boolean, check_variables, host_array
from dynadiag_jax.freeze import freeze_tree
from dynadiag_jax.nn.functional import (
    DIAGONALS_COLLECTION,
    GATE_COLLECTION,
    HYPER_NAME,
    LAYER_COLLECTIONS,
    select_diagonals,
)
from dynadiag_jax.nn.gate_state import alpha_from_values, check_scale
from dynadiag_jax.ops.reference import dense_to_diag

__all__ = ["from_dense"]


def _name(path: tuple) -> str:
    return "/".join(path) or "(root)"


def _shape(leaf) -> tuple:
    return tuple(np.shape(leaf))


def _diagonal_layers(flat: dict) -> list[tuple]:
    """Paths of the search-phase layers (``alpha`` beside ``values``) of flattened params."""
    return sorted(k[:-1] for k in flat if k[-1] == "alpha" and k[:-1] + ("values",) in flat)


def _refuse_frozen(flat: dict, layers: list[tuple], diagonals: dict) -> None:
    """A frozen template layer already fixed its diagonals (at random): there is nothing to rank."""
    for key in flat:
        path = key[:-1]
        if key[-1] == "values" and path not in layers and path + ("offsets",) in diagonals:
            raise ValueError(
                f"from_dense: the template's layer at params/{_name(path)} is frozen (values "
                f"{_shape(flat[key])}, no alpha): initialise the diagonal model in the search "
                f"phase (the default init_phase) so that from_dense chooses its diagonals"
            )


def _layer_matrix(path: tuple, kernel, lead: tuple, n_in: int, n_out: int):
    """The dense kernel ``[*lead, *in_shape, *out_shape]`` as ``W[*lead, out, in]``.

    ``in_shape`` must flatten to ``n_in`` and ``out_shape`` to ``n_out`` (row-major, as
    ``sparsify`` flattens a ``DenseGeneral``); any other kernel is the wrong model's.
    """
    shape = _shape(kernel)
    axes = shape[len(lead) :]
    fits = shape[: len(lead)] == lead and any(
        math.prod(axes[:i]) == n_in and math.prod(axes[i:]) == n_out for i in range(len(axes) + 1)
    )
    if not fits:
        raise ValueError(
            f"from_dense: the dense kernel at params/{_name(path)} has shape {shape}, but the "
            f"DiagonalDense there maps {n_in} -> {n_out} features (a kernel [{n_in}, {n_out}], "
            f"or [*in, *out] axes that flatten to those"
            + (f", after the stacked axes {lead}" if lead else "")
            + "): the checkpoint is of another model or size"
        )
    w = jnp.asarray(kernel).reshape(lead + (n_in, n_out))
    return jnp.swapaxes(w, -1, -2)


def _layer_params(path, template: dict, dense: dict, in_features, gate_value, perm) -> dict:
    """A search-phase layer's params from the dense layer's ``kernel`` (and ``bias``); with an
    input permutation ``perm[..., in]`` the diagonals are those of ``W[:, perm]``, the matrix
    that the layer applies to ``x[..., perm]``."""
    alpha, values = template["alpha"], template["values"]
    lead = _shape(alpha)[:-1]
    kernel = dense.get("kernel")
    unused = sorted(set(dense) - {"kernel", "bias"})
    if kernel is None or unused:
        raise ValueError(
            f"from_dense: the template has a DiagonalDense at params/{_name(path)}, but the dense "
            f"params there hold {sorted(dense) or 'nothing'}, not a dense layer's 'kernel' "
            f"(and 'bias'): the checkpoint is of another model (or not of a dense one)"
        )
    host = host_array(kernel)
    if host is not None and not np.isfinite(host).all():
        raise ValueError(
            f"from_dense: the dense kernel at params/{_name(path)} holds NaN or inf, which has no "
            f"ranking of its diagonals by energy: the dense run diverged"
        )
    n_in = int(np.asarray(in_features).reshape(-1)[0])
    n_out = math.prod(_shape(values)[len(lead) :]) // n_in  # the P diagonals tile W[out, in]
    w = _layer_matrix(path, kernel, lead, n_in, n_out)
    if perm is not None:
        columns = jnp.asarray(perm, jnp.int32)[..., None, :]
        w = jnp.take_along_axis(w, jnp.broadcast_to(columns, _shape(w)), axis=-1)
    block_size = _shape(values)[-1] if values.ndim - alpha.ndim == 3 else 1
    every = jnp.arange(_shape(alpha)[-1], dtype=jnp.int32)
    diag = lambda m: dense_to_diag(m, every, block_size=block_size)  # noqa: E731
    for _ in lead:
        diag = jax.vmap(diag)
    params = {"alpha": alpha, "values": diag(w).astype(values.dtype)}
    if "bias" in template or "bias" in dense:
        bias = _same_size(path + ("bias",), template.get("bias"), dense.get("bias"), reshape=True)
        params["bias"] = bias
    # alpha = gate value x z-score of each diagonal's norm: the order of the diagonals' energies,
    # spread over a few gate values, so the first gate already favours the strongest diagonals.
    scored = alpha_from_values({"alpha": alpha, "values": params["values"]}, gate_value)
    params["alpha"] = scored["alpha"]
    return params


def _same_size(path: tuple, target, source, *, reshape: bool = False):
    """``source`` cast to ``target``'s dtype; with ``reshape``, to its shape too (same size)."""
    if source is None or target is None:
        where, absent = ("diagonal", "dense") if source is None else ("dense", "diagonal")
        raise ValueError(
            f"from_dense: {_name(path)} exists in the {where} model but not in the {absent} "
            f"model (a layer with and one without bias?)"
        )
    fits = np.size(source) == np.size(target) if reshape else _shape(source) == _shape(target)
    if not fits:
        raise ValueError(
            f"from_dense: {_name(path)} has shape {_shape(source)} in the dense model and "
            f"{_shape(target)} in the diagonal model: the checkpoint is of another model or size"
        )
    return jnp.asarray(source).reshape(_shape(target)).astype(target.dtype)


def _copy_collection(name: str, template, dense, skip: set) -> dict:
    """``template``'s leaves with the dense model's values (same paths, shapes), but ``skip``."""
    flat_t = traverse_util.flatten_dict(template)
    flat_d = {k: v for k, v in traverse_util.flatten_dict(dense).items() if k[:-1] not in skip}
    missing = sorted(_name(k) for k in flat_t if k[:-1] not in skip and k not in flat_d)
    extra = sorted(_name(k) for k in flat_d if k not in flat_t)
    if missing or extra:
        parts = [f"missing in the dense model: {', '.join(missing)}"] if missing else []
        parts += [f"absent in the diagonal model: {', '.join(extra)}"] if extra else []
        raise ValueError(
            f"from_dense: the '{name}' collections differ ({'; '.join(parts)}): the checkpoint is "
            f"of another model, or the diagonal layers sit at other paths than its dense layers"
        )
    out = dict(flat_t)
    for key, leaf in flat_d.items():
        out[key] = _same_size((name, *key), flat_t[key], leaf)
    return out


def _with_kept_norm(values, kept):
    """``values[*lead, P, *V]`` scaled per layer (per slice of a stack) so that the diagonals
    ``kept[*lead, K]`` carry the Frobenius norm of all ``P``."""
    lead = kept.ndim - 1
    flat = values.astype(jnp.float32).reshape(values.shape[: lead + 1] + (-1,))
    energy = jnp.sum(jnp.square(flat), axis=-1)
    kept_energy = jnp.take_along_axis(energy, kept, axis=-1).sum(-1)
    scale = jnp.sqrt(energy.sum(-1) / jnp.maximum(kept_energy, jnp.finfo(jnp.float32).tiny))
    return (values * scale.reshape(scale.shape + (1,) * (values.ndim - lead))).astype(values.dtype)


def from_dense(
    dense_variables, template, *, gate_value=None, keep_norm: bool = False, freeze: bool = False
):
    """The variables of a diagonal model started from a trained dense model's (not jit-able).

    Every search-phase ``DiagonalDense`` of ``template`` takes the dense layer at its own params
    path: ``values[P, *V]`` are the kernel's entries on all ``P`` candidate diagonals
    (``V = (D,)`` element, ``(L_b, b, b)`` block diagonals; the flax kernel ``[in, out]`` is
    ``W.T``, a ``DenseGeneral`` kernel ``[*in, *out]`` is flattened row-major as
    ``dd.nn.sparsify`` flattens its input), ``bias`` is the dense bias (flattened), and
    ``alpha[P] = g * z`` with ``z`` the z-score of each diagonal's norm (its energy's order) and
    ``g`` the gate value the search starts at, so the top-K by alpha are the K diagonals of
    largest energy. Every other leaf of ``"params"`` and of collections the dense model has is
    copied; the ``"dynadiag"`` and ``"diagonals"`` collections come from ``template``, with each
    ``topk`` set to the top-K by the new alpha.

    Args:
      dense_variables: ``{"params": ..., ...}`` of the dense model (e.g. restored from a
        checkpoint).
      template: ``model.init(...)`` of the model with diagonal layers (``dd.nn.sparsify`` of the
        same module, or a ``dd.models`` model with ``ByPath``), in the search phase; only its
        structure, shapes, dtypes and gate state are used.
      gate_value: the strength (``gate="sparse_topk"``) or temperature (``"softmax"``) that
        scales the scores, a number > 0; default: each layer's value in
        ``template["dynadiag"]`` (its ``gate_init``), the value a search continued with
        ``dd.nn.set_gate`` should start at (it must then be > 0 too).
      keep_norm: scale each layer's values by ``sqrt(E / E_K)``, with ``E`` the energy of all
        its diagonals and ``E_K`` that of the K it keeps, so that the kept diagonals carry the
        dense kernel's whole Frobenius norm (otherwise the one-shot layer's outputs shrink by
        about ``sqrt(E_K / E)``; docs/training.md measures both on the suites).
      freeze: also freeze (``dd.freeze_tree``): the one-shot model, whose layers compute the
        dense layers' products restricted to their K highest-energy diagonals.

    Returns:
      Variables of the structure of ``template`` (search phase), or of ``freeze_tree`` of it.

    Raises:
      TypeError: a ``gate_value`` that is not a number, a ``keep_norm`` or ``freeze`` that is not
        a bool.
      ValueError: a ``gate_value`` <= 0 or NaN (or, without one, a template's gate value <= 0),
        which would erase or reverse the ranking; a checkpoint of another model or size: a
        diagonal layer without a dense kernel at its path, a kernel whose shape does not flatten
        to the layer's ``[in, out]``, params or collections present in one model only, or shapes
        that differ; a template with frozen layers; a dense kernel with NaN or inf. Each
        message names the path and the shapes.
    """
    for name, variables in (("dense_variables", dense_variables), ("template", template)):
        check_variables(variables, name, "from_dense")
    boolean(keep_norm, "from_dense: keep_norm")
    boolean(freeze, "from_dense: freeze")
    if gate_value is not None:
        check_scale(gate_value, "gate_value", "from_dense")
    flat_t = traverse_util.flatten_dict(template["params"])
    layers = _diagonal_layers(flat_t)
    diagonals = traverse_util.flatten_dict(template.get(DIAGONALS_COLLECTION, {}))
    _refuse_frozen(flat_t, layers, diagonals)
    if not layers:
        raise ValueError(
            "from_dense: the template has no search-phase DiagonalDense (params 'alpha' beside "
            "'values'); pass the init variables of the model with diagonal layers"
        )
    dense_params = traverse_util.flatten_dict(dense_variables["params"])
    gates = traverse_util.flatten_dict(template.get(GATE_COLLECTION, {}))
    params = _copy_collection("params", template["params"], dense_variables["params"], set(layers))
    topk = dict(gates)
    for path in layers:
        width = diagonals.get(path + ("in_features",))
        if width is None:
            raise ValueError(
                f"from_dense: the template lacks diagonals/{_name(path)}/in_features, the "
                f"layer's input width; pass every collection of model.init"
            )
        value = gate_value
        if value is None:
            hyper = next((path + (g,) for g in HYPER_NAME.values() if path + (g,) in gates), None)
            value = 1.0 if hyper is None else gates[hyper]
            if not np.all(np.asarray(value) > 0):
                raise ValueError(
                    f"from_dense: gate_value defaults to the template's gate value, "
                    f"{np.asarray(value).tolist()} at {GATE_COLLECTION}/{_name(hyper)}, which "
                    f"would erase the ranking by energy (it scales alpha); pass gate_value > 0"
                )
        value = jnp.expand_dims(jnp.asarray(value, jnp.float32), -1)  # per slice of a stack
        layer_t = {k[-1]: v for k, v in flat_t.items() if k[:-1] == path}
        layer_d = {k[-1]: v for k, v in dense_params.items() if k[:-1] == path}
        perm = diagonals.get(path + ("perm",))
        if "perm_soft" in layer_t:
            raise ValueError(
                f"from_dense: the template's layer at params/{_name(path)} learns its input "
                f"permutation (perm_soft), whose soft start mixes every input, so the dense "
                f"layer's function cannot be carried over; use permutation=None or 'random'"
            )
        for key, leaf in _layer_params(path, layer_t, layer_d, width, value, perm).items():
            params[path + (key,)] = leaf
        if path + ("topk",) in gates:
            k = _shape(gates[path + ("topk",)])[-1]
            topk[path + ("topk",)] = select_diagonals(params[path + ("alpha",)], k)
            if keep_norm:
                kept = topk[path + ("topk",)]
                params[path + ("values",)] = _with_kept_norm(params[path + ("values",)], kept)
        elif keep_norm:
            raise ValueError(
                f"from_dense: keep_norm needs the layer's budget, but the template lacks "
                f"dynadiag/{_name(path)}/topk; pass every collection of model.init"
            )
    out = {}
    for name, collection in template.items():
        if name == "params":
            out[name] = traverse_util.unflatten_dict(params)
        elif name == GATE_COLLECTION:
            out[name] = traverse_util.unflatten_dict(topk)
        elif name in LAYER_COLLECTIONS or name not in dense_variables:
            out[name] = collection
        else:
            flat = _copy_collection(name, collection, dense_variables[name], set())
            out[name] = traverse_util.unflatten_dict(flat)
    return freeze_tree(out) if freeze else out
