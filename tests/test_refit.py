"""dd.refit: the kept diagonals refitted to the dense layers' outputs by ridge least squares.

The references are written out here row by row with NumPy on the masked dense kernel (the
diagonal of each entry from docs/design.md section 1, as in test_from_dense.py), not through the
library's index helpers.
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_from_dense import Block, Single, diagonal_id, random_dense

import dynadiag_jax as dd


class TwoLayers(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(12, name="fc2")(nn.relu(nn.Dense(20, name="fc1")(x)))


def kept_mask(frozen, path, n_in, n_out, b):
    offsets = np.asarray(frozen["diagonals"][path]["offsets"])
    return np.isin(diagonal_id(n_in, n_out, b), offsets)  # [out, in]


def reference_rows(x_in, x_target, w, mask, ridge):
    """Per row r of ``w[out, in]``: the ridge least squares on the columns ``mask[r]``."""
    n = len(x_in)
    s = ridge * np.mean(np.sum(x_in**2, axis=0) / n)
    fit = np.zeros_like(w)
    for r in range(w.shape[0]):
        cs = np.flatnonzero(mask[r])
        a = np.concatenate([x_in[:, cs], np.sqrt(n * s) * np.eye(len(cs))])
        y = np.concatenate([x_target @ w[r], np.sqrt(n * s) * w[r, cs]])
        fit[r, cs] = np.linalg.lstsq(a, y, rcond=None)[0]
    return fit


def layer_weight(model, variables, n_in):
    """``W[out, in]`` of a one-layer model, read off its outputs on the unit vectors."""
    eye = jnp.eye(n_in)
    y = model.apply(variables, eye) - model.apply(variables, jnp.zeros((1, n_in)))
    return np.asarray(y, np.float64).T


def sub_layer_weight(variables, path, n_in, n_out):
    """``W[out, in]`` of layer ``path`` of a sparsified model, run alone as ``Single``'s layer."""
    alone = {c: {"layer": tree[path]} for c, tree in variables.items() if path in tree}
    k = len(variables["diagonals"][path]["offsets"])
    model = dd.nn.sparsify(Single(n_out), [("layer", {"k": k})])
    return layer_weight(model, alone, n_in)


def correlated(key, rows, n):
    """Inputs with correlated features: on white ones the masked kernel is already the fit."""
    k1, k2 = jax.random.split(key)
    return jax.random.normal(k1, (rows, n)) @ jax.random.normal(k2, (n, n)) / np.sqrt(n)


@pytest.mark.parametrize("n_in, n_out", [(16, 48), (48, 16), (32, 32)], ids=["tall", "wide", "sq"])
@pytest.mark.parametrize("b", [1, 8])
def test_each_row_is_the_ridge_least_squares_fit_on_its_kept_inputs(n_in, n_out, b):
    x = correlated(jax.random.key(1), 256, n_in)
    dense = random_dense(Single(n_out), x)
    model = dd.nn.sparsify(Single(n_out), [("layer", {"sparsity": 0.75, "block_size": b})])
    one_shot = dd.from_dense(dense, model.init(jax.random.key(5), x), freeze=True)
    fitted = dd.refit(model, one_shot, Single(n_out), dense, x, ridge=1e-2)
    w = np.asarray(dense["params"]["layer"]["kernel"], np.float64).T
    mask = kept_mask(one_shot, "layer", n_in, n_out, b)
    xs = np.asarray(x, np.float64)
    expect = reference_rows(xs, xs, w, mask, 1e-2)
    np.testing.assert_allclose(layer_weight(model, fitted, n_in), expect, atol=2e-4)
    np.testing.assert_array_equal(
        fitted["params"]["layer"]["bias"], dense["params"]["layer"]["bias"]
    )
    # the refitted layer reproduces the dense layer's outputs better than the masked kernel
    target = Single(n_out).apply(dense, x)
    error = lambda v: float(jnp.mean((model.apply(v, x) - target) ** 2))  # noqa: E731
    assert error(fitted) < 0.9 * error(one_shot)


@pytest.mark.parametrize("b", [1, 8])
def test_a_kernel_on_the_kept_diagonals_comes_back_exactly(b):
    """Nothing to reconstruct: the dense kernel lives on K diagonals, which from_dense keeps."""
    n_in, n_out = 16, 40
    x = jax.random.normal(jax.random.key(1), (64, n_in))
    dense = random_dense(Single(n_out), x)
    keep = np.isin(diagonal_id(n_in, n_out, b), [0, 2]).T  # [in, out], like the flax kernel
    dense["params"]["layer"]["kernel"] = dense["params"]["layer"]["kernel"] * keep.astype(
        np.float32
    )
    model = dd.nn.sparsify(Single(n_out), [("layer", {"k": 2, "block_size": b})])
    one_shot = dd.from_dense(dense, model.init(jax.random.key(5), x), freeze=True)
    fitted = dd.refit(model, one_shot, Single(n_out), dense, x)
    np.testing.assert_allclose(
        fitted["params"]["layer"]["values"], one_shot["params"]["layer"]["values"], atol=1e-5
    )


def test_sequential_fits_each_layer_on_the_refitted_layers_before_it():
    x = correlated(jax.random.key(1), 200, 24)
    plain = TwoLayers()
    dense = random_dense(plain, x)
    model = dd.nn.sparsify(TwoLayers(), [("fc.", {"sparsity": 0.7})])
    one_shot = dd.from_dense(dense, model.init(jax.random.key(5), x), freeze=True)
    w1 = np.asarray(dense["params"]["fc1"]["kernel"], np.float64).T
    w2 = np.asarray(dense["params"]["fc2"]["kernel"], np.float64).T
    b1 = np.asarray(dense["params"]["fc1"]["bias"], np.float64)
    xs = np.asarray(x, np.float64)
    h_dense = np.maximum(xs @ w1.T + b1, 0)
    fit1 = reference_rows(xs, xs, w1, kept_mask(one_shot, "fc1", 24, 20, 1), 1e-3)
    h_sparse = np.maximum(xs @ fit1.T + b1, 0)
    mask2 = kept_mask(one_shot, "fc2", 20, 12, 1)
    for sequential, h_in in ((True, h_sparse), (False, h_dense)):
        fitted = dd.refit(model, one_shot, plain, dense, x, sequential=sequential)
        np.testing.assert_allclose(sub_layer_weight(fitted, "fc1", 24, 20), fit1, atol=2e-4)
        expect = reference_rows(h_in, h_dense, w2, mask2, 1e-3)
        np.testing.assert_allclose(sub_layer_weight(fitted, "fc2", 20, 12), expect, atol=2e-4)


def test_search_phase_variables_get_the_fit_in_the_rows_the_freeze_keeps():
    x = jax.random.normal(jax.random.key(1), (128, 16))
    dense = random_dense(Single(40), x)
    model = dd.nn.sparsify(Single(40), [("layer", {"sparsity": 0.8})])
    search = dd.from_dense(dense, model.init(jax.random.key(5), x))
    fitted = dd.refit(model, search, Single(40), dense, x)
    direct = dd.refit(model, dd.freeze_tree(search), Single(40), dense, x)
    assert "alpha" in fitted["params"]["layer"]
    offsets = np.asarray(direct["diagonals"]["layer"]["offsets"])
    before, after = search["params"]["layer"]["values"], fitted["params"]["layer"]["values"]
    others = np.setdiff1d(np.arange(before.shape[0]), offsets)
    np.testing.assert_array_equal(after[others], before[others])
    again = dd.freeze_tree(fitted)
    np.testing.assert_array_equal(again["diagonals"]["layer"]["offsets"], offsets)
    np.testing.assert_array_equal(
        again["params"]["layer"]["values"], direct["params"]["layer"]["values"]
    )


@pytest.mark.parametrize("b", [1, 8])
def test_a_random_input_permutation_is_fitted_in_the_permuted_coordinates(b):
    """The layer applies its W to x[..., perm]: a dense kernel that is diagonal there comes back."""
    n_in, n_out = 16, 40
    x = jax.random.normal(jax.random.key(1), (64, n_in))
    dense = random_dense(Single(n_out), x)
    rule = {"k": 2, "block_size": b, "permutation": "random"}
    model = dd.nn.sparsify(Single(n_out), [("layer", rule)])
    template = model.init(jax.random.key(5), x)
    perm = np.asarray(template["diagonals"]["layer"]["perm"])
    on_diagonals = np.isin(diagonal_id(n_in, n_out, b), [1, 3])  # of W[:, perm], [out, in]
    mask = np.zeros_like(on_diagonals)
    mask[:, perm] = on_diagonals
    dense["params"]["layer"]["kernel"] = dense["params"]["layer"]["kernel"] * mask.T.astype(
        np.float32
    )
    one_shot = dd.from_dense(dense, template, freeze=True)
    fitted = dd.refit(model, one_shot, Single(n_out), dense, x)
    np.testing.assert_allclose(
        model.apply(fitted, x), Single(n_out).apply(dense, x), rtol=1e-4, atol=1e-4
    )


def test_attention_and_dense_general_layers_of_an_unedited_model():
    x = jax.random.normal(jax.random.key(2), (64, 5, 32))
    dense = random_dense(Block(), x)
    rules = [(r"fc\d|split|.*/(query|key|value|out)", {"sparsity": 0.75})]
    model = dd.nn.sparsify(Block(), rules)
    one_shot = dd.from_dense(dense, model.init(jax.random.key(9), x), freeze=True)
    fitted = dd.refit(model, one_shot, Block(), dense, x)
    target = Block().apply(dense, x)
    error = lambda v: float(jnp.mean((model.apply(v, x) - target) ** 2))  # noqa: E731
    assert error(fitted) < 0.5 * error(one_shot)


def test_bad_inputs_are_refused_with_the_reason():
    x = jax.random.normal(jax.random.key(1), (32, 16))
    dense = random_dense(Single(40), x)
    model = dd.nn.sparsify(Single(40), [("layer", {"sparsity": 0.8})])
    one_shot = dd.from_dense(dense, model.init(jax.random.key(5), x), freeze=True)
    for ridge, error, match in (
        (-1.0, ValueError, "ridge must be >= 0"),
        (float("inf"), ValueError, "ridge must be a finite number"),
        ("1e-3", TypeError, "ridge must be a number"),
    ):
        with pytest.raises(error, match=match):
            dd.refit(model, one_shot, Single(40), dense, x, ridge=ridge)
    with pytest.raises(TypeError, match="refit: sequential must be True or False, got str"):
        dd.refit(model, one_shot, Single(40), dense, x, sequential="no")
    with pytest.raises(ValueError, match="variables must be variables with a 'params'"):
        dd.refit(model, {"diagonals": {}}, Single(40), dense, x)
    with pytest.raises(TypeError, match="refit: dense_variables must be a mapping"):
        dd.refit(model, one_shot, Single(40), [dense], x)
    other = random_dense(TwoLayers(), x)
    with pytest.raises(ValueError, match="calls no nn.Dense / nn.DenseGeneral at params/layer"):
        dd.refit(model, one_shot, TwoLayers(), other, x)
    with pytest.raises(ValueError, match="calls no frozen DiagonalDense"):
        dd.refit(Single(40), dense, Single(40), dense, x)
    with pytest.raises(ValueError, match="non-finite activations at the diagonal layer"):
        dd.refit(model, one_shot, Single(40), dense, x.at[0, 0].set(jnp.nan))
    diverged = jax.tree.map(lambda a: a, dense)
    diverged["params"]["layer"]["kernel"] = dense["params"]["layer"]["kernel"].at[2, 3].set(jnp.inf)
    with pytest.raises(
        ValueError, match="refit: the dense kernel at params/layer holds NaN or inf"
    ):
        dd.refit(model, one_shot, Single(40), diverged, x)
    # one row cannot determine a row's kept weights: numpy's "Singular matrix" had no hint
    with pytest.raises(
        ValueError,
        match=r"params/layer: the fit of output row \d+ is singular.*"
        r"ridge > 0",
    ):
        dd.refit(model, one_shot, Single(40), dense, x[:1], ridge=0.0)


class ByKeyword(nn.Module):
    """A dense layer called with its input by keyword, and one contracting three axes."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, name="first")(inputs=x.reshape(x.shape[0], -1))
        return nn.DenseGeneral(8, axis=(-3, -2, -1), name="second")(h.reshape(-1, 2, 2, 4))


def test_keyword_inputs_and_several_contracted_axes_are_refitted():
    """A layer called as layer(inputs=x) was skipped on the diagonal side and "not called" on
    the dense one; a DenseGeneral over three axes "did not flatten to its 16 features"."""
    x = jax.random.normal(jax.random.key(1), (256, 16))
    dense = random_dense(ByKeyword(), x)
    model = dd.nn.sparsify(ByKeyword(), [(".*", {"sparsity": 0.5})])
    one_shot = dd.from_dense(dense, model.init(jax.random.key(5), x), freeze=True)
    refitted = dd.refit(model, one_shot, ByKeyword(), dense, x)
    for name in ("first", "second"):
        before = one_shot["params"][name]["values"]
        assert not np.allclose(refitted["params"][name]["values"], before)
    err = lambda v: float(jnp.mean((model.apply(v, x) - ByKeyword().apply(dense, x)) ** 2))  # noqa: E731
    assert err(refitted) < err(one_shot)


@pytest.mark.parametrize("dense_width", [32, 8, 24])
def test_a_dense_model_of_another_width_is_refused(dense_width):
    """16 -> 24 fitted from a 16 -> 32 kernel (meaningless values), 16 -> 16 returned [8, 8]
    values from a 16 -> 8 one, 16 -> 32 from 16 -> 24 failed on an offset."""
    x = jax.random.normal(jax.random.key(1), (32, 16))
    width = {32: 24, 8: 16, 24: 32}[dense_width]
    model = dd.nn.sparsify(Single(width), [("layer", {"sparsity": 0.5})])
    variables = dd.freeze_tree(model.init(jax.random.key(5), x))
    dense = random_dense(Single(dense_width), x)
    message = (
        rf"kernel at params/layer has shape \(16, {dense_width}\), the diagonal layer maps "
        rf"16 -> {width}"
    )
    with pytest.raises(ValueError, match=message):
        dd.refit(model, variables, Single(dense_width), dense, x)


def test_a_learned_sinkhorn_permutation_is_refitted_frozen_only():
    """The freeze folds the soft matrix into the values: values fitted on the frozen form and
    written back into the search phase's were folded twice (the refitted model 1.65 away)."""
    x = jax.random.normal(jax.random.key(1), (32, 16))
    dense = random_dense(Single(40), x)
    model = dd.nn.sparsify(Single(40), [("layer", {"sparsity": 0.5, "permutation": "learned"})])
    search = model.init(jax.random.key(5), x)
    with pytest.raises(ValueError, match="perm_soft.*freeze first .*refit the frozen variables"):
        dd.refit(model, search, Single(40), dense, x)
    frozen = dd.refit(model, dd.freeze_tree(search), Single(40), dense, x)
    assert "perm" in frozen["diagonals"]["layer"]


def test_stacked_layers_are_refused_before_any_call():
    """Under nn.scan a layer's input is traced: capturing it crashed with a
    TracerArrayConversionError before the documented error could be raised."""

    class Cell(nn.Module):
        dense: bool = False

        @nn.compact
        def __call__(self, x, _):
            make = nn.Dense if self.dense else functools.partial(dd.nn.DiagonalDense, sparsity=0.75)
            return jnp.tanh(make(32, name="fc")(x)), None

    class Stack(nn.Module):
        dense: bool = False

        @nn.compact
        def __call__(self, x):
            scan = nn.scan(Cell, variable_axes={True: 0}, split_rngs={"params": True}, length=3)
            return scan(self.dense, name="layers")(x, None)[0]

    x = jnp.ones((8, 32))
    dense = Stack(True).init(jax.random.key(0), x)
    variables = dd.from_dense(dense, Stack().init(jax.random.key(0), x))
    with pytest.raises(ValueError, match=r"params/layers/fc is stacked \(offsets \(3, 8\)"):
        dd.refit(Stack(), variables, Stack(True), dense, x)
