"""dd.from_dense: diagonal layers started from a trained dense model's kernels.

The values must be the dense kernel's entries at the coordinates docs/design.md section 1 gives
each diagonal (written out here entry by entry, not through the library's index helpers); the
one-shot model (frozen at once) must compute what the unedited dense model computes with every
replaced kernel masked to the kept diagonals, which must be the K of largest energy; and a
checkpoint of another model must be refused naming the layer and the shapes.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynadiag_jax as dd
from dynadiag_jax import models


class Single(nn.Module):
    features: int

    @nn.compact
    def __call__(self, x):
        return nn.Dense(self.features, name="layer")(x)


class Block(nn.Module):
    """Attention (DenseGeneral q/k/v [in] -> [heads, head_dim], out [heads, head_dim] -> [in]),
    an MLP of nn.Dense, and a DenseGeneral written directly."""

    @nn.compact
    def __call__(self, x):
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(nn.LayerNorm()(x))
        h = nn.gelu(nn.Dense(64, name="fc1")(nn.LayerNorm()(x)))
        x = x + nn.Dense(32, name="fc2")(h)
        return nn.DenseGeneral((2, 16), name="split")(x)


def random_dense(model, x, seed=0):
    """Dense variables, every leaf N(0, 0.3^2): non-zero biases show a bias copied wrongly."""
    variables = model.init(jax.random.key(seed), x)
    leaves, tree = jax.tree.flatten(variables)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    return jax.tree.unflatten(
        tree, [0.3 * jax.random.normal(k, leaf.shape, leaf.dtype) for k, leaf in zip(keys, leaves)]
    )


def diagonal_id(n_in, n_out, b=1):
    """``ids[out, in]``: the diagonal each entry of ``W`` lies on (docs/design.md 1.1, 1.2)."""
    rows, cols = np.meshgrid(np.arange(n_out // b), np.arange(n_in // b), indexing="ij")
    if b == 1:
        ids = (rows - cols) % n_out if n_out >= n_in else (cols - rows) % n_in
    else:
        ids = (cols - rows) % (n_in // b) if n_out >= n_in else (rows - cols) % (n_out // b)
    return np.kron(ids, np.ones((b, b), int)).astype(int)


# --- the values land on the right diagonals ----------------------------------------------------


@pytest.mark.parametrize(
    "n_in, n_out", [(8, 24), (24, 8), (16, 16)], ids=["tall", "wide", "square"]
)
@pytest.mark.parametrize("b", [1, 8])
def test_values_are_the_kernel_entries_on_each_diagonal(n_in, n_out, b):
    x = jnp.ones((2, n_in))
    dense = random_dense(Single(n_out), x)
    model = dd.nn.sparsify(Single(n_out), [("layer", {"k": 1, "block_size": b})])
    variables = dd.from_dense(dense, model.init(jax.random.key(5), x))
    values = np.asarray(variables["params"]["layer"]["values"])
    w = np.asarray(dense["params"]["layer"]["kernel"]).T  # W[out, in]
    tall = n_out >= n_in
    if b == 1:  # values[d, t] = W[(t + d) % out, t] (tall) or W[t, (t + d) % in] (wide)
        assert values.shape == (max(n_in, n_out), min(n_in, n_out))
        for d in range(values.shape[0]):
            for t in range(values.shape[1]):
                row, col = ((t + d) % n_out, t) if tall else (t, (t + d) % n_in)
                assert values[d, t] == w[row, col]
    else:  # block t of diagonal d: (row t, col (t + d) % nb_in) tall, ((t + d) % nb_out, t) wide
        nb_in, nb_out = n_in // b, n_out // b
        assert values.shape == (min(nb_in, nb_out), max(nb_in, nb_out), b, b)
        for d in range(values.shape[0]):
            for t in range(values.shape[1]):
                br, bc = (t, (t + d) % nb_in) if tall else ((t + d) % nb_out, t)
                np.testing.assert_array_equal(
                    values[d, t], w[br * b : (br + 1) * b, bc * b : (bc + 1) * b]
                )
    np.testing.assert_array_equal(
        variables["params"]["layer"]["bias"], dense["params"]["layer"]["bias"]
    )


@pytest.mark.parametrize("n_in, n_out", [(8, 24), (24, 8)], ids=["tall", "wide"])
@pytest.mark.parametrize("b", [1, 8])
def test_a_random_input_permutation_keeps_the_dense_function(n_in, n_out, b):
    """With every diagonal kept, the permuted layer is the dense layer whatever its perm."""
    x = jax.random.normal(jax.random.key(3), (4, n_in))
    dense = random_dense(Single(n_out), x)
    every = max(n_in, n_out) if b == 1 else min(n_in, n_out) // b
    rule = {"k": every, "block_size": b, "permutation": "random", "impl": "jax"}
    model = dd.nn.sparsify(Single(n_out), [("layer", rule)])
    template = model.init(jax.random.key(5), x)
    assert not np.array_equal(template["diagonals"]["layer"]["perm"], np.arange(n_in))
    frozen = dd.freeze_tree(dd.from_dense(dense, template))
    np.testing.assert_allclose(
        model.apply(frozen, x), Single(n_out).apply(dense, x), rtol=1e-5, atol=1e-5
    )
    learned = dd.nn.sparsify(Single(n_out), [("layer", {**rule, "permutation": "learned"})])
    with pytest.raises(ValueError, match="layer at params/layer learns its input permutation"):
        dd.from_dense(dense, learned.init(jax.random.key(5), x))


@pytest.mark.parametrize("b", [1, 8])
def test_alpha_ranks_by_energy_at_the_gate_value(b):
    n_in, n_out = 16, 40
    x = jnp.ones((2, n_in))
    dense = random_dense(Single(n_out), x)
    model = dd.nn.sparsify(Single(n_out), [("layer", {"sparsity": 0.7, "block_size": b})])
    template = model.init(jax.random.key(5), x)
    w = np.asarray(dense["params"]["layer"]["kernel"]).T
    ids = diagonal_id(n_in, n_out, b)
    energy = np.array([np.sum(w[ids == d] ** 2) for d in range(ids.max() + 1)])
    norms = np.sqrt(energy)
    for gate_value, expect_scale in ((None, 1.0), (0.25, 0.25)):  # init's strength is 1.0
        variables = dd.from_dense(dense, template, gate_value=gate_value)
        alpha = np.asarray(variables["params"]["layer"]["alpha"])
        z = (norms - norms.mean()) / norms.std()
        np.testing.assert_allclose(alpha, expect_scale * z, rtol=1e-5, atol=1e-6)
    k = template["dynadiag"]["layer"]["topk"].shape[0]
    top = np.sort(np.argsort(-energy)[:k])
    np.testing.assert_array_equal(variables["dynadiag"]["layer"]["topk"], top)
    # the search phase runs on them, and the strength set there is the template's
    y = model.apply(variables, x)
    assert y.shape == (2, n_out) and np.all(np.isfinite(y))
    assert variables["dynadiag"]["layer"]["strength"] == template["dynadiag"]["layer"]["strength"]


# --- the one-shot model is the dense model masked to the kept diagonals ------------------------


def masked_dense_params(plain, dense, frozen, x):
    """``dense`` params with each replaced kernel ``[*in, *out]`` zero off the frozen offsets."""
    params = jax.tree.map(lambda a: a, dense["params"])
    for layer in dd.nn.linear_layer_paths(plain, x):
        node, kept = frozen["params"], frozen["diagonals"]
        target = params
        for key in layer.path.split("/"):
            node, kept, target = node[key], kept.get(key, {}), target[key]
        if "offsets" not in kept:
            continue
        n_in, n_out = math.prod(layer.in_shape), math.prod(layer.out_shape)
        b = node["values"].shape[-1] if node["values"].ndim == 4 else 1
        ids = diagonal_id(n_in, n_out, b)
        mask = np.isin(ids, np.asarray(kept["offsets"])).T.reshape(layer.in_shape + layer.out_shape)
        target["kernel"] = target["kernel"] * mask.astype(np.float32)
    return params


def energies(kernel, n_in, n_out, b):
    w = np.asarray(kernel).reshape(n_in, n_out).T
    ids = diagonal_id(n_in, n_out, b)
    return np.array([np.sum(w[ids == d] ** 2) for d in range(ids.max() + 1)])


@pytest.mark.parametrize("b", [1, 16])
def test_one_shot_equals_the_masked_dense_model_through_sparsify(b):
    """An unedited model with nn.Dense and nn.DenseGeneral (attention q/k/v kernels
    [in, heads, head_dim], out [heads, head_dim, in]), sparsified by module path."""
    x = jax.random.normal(jax.random.key(2), (3, 5, 32))
    plain = Block()
    dense = random_dense(plain, x)
    rules = [(r"fc\d|split|.*/(query|key|value|out)", {"sparsity": 0.75, "block_size": b})]
    model = dd.nn.sparsify(Block(), rules)
    frozen = dd.from_dense(dense, model.init(jax.random.key(9), x), freeze=True)
    layers = dd.nn.linear_layer_paths(plain, x)
    assert len(layers) == 7  # q, k, v, out, fc1, fc2, split: every one replaced
    for layer in layers:  # the kept diagonals are the K of largest energy
        node, kernel, kept = frozen["params"], dense["params"], frozen["diagonals"]
        for key in layer.path.split("/"):
            node, kernel, kept = node[key], kernel[key], kept[key]
        offsets = np.asarray(kept["offsets"])
        e = energies(kernel["kernel"], math.prod(layer.in_shape), math.prod(layer.out_shape), b)
        np.testing.assert_array_equal(offsets, np.sort(np.argsort(-e)[: offsets.size]))
        np.testing.assert_array_equal(node["bias"], np.ravel(kernel["bias"]))
    expect = plain.apply({"params": masked_dense_params(plain, dense, frozen, x)}, x)
    np.testing.assert_allclose(model.apply(frozen, x), expect, rtol=1e-4, atol=1e-4)
    # the same variables before the freeze, frozen by dd.freeze_tree, are the same model
    again = dd.freeze_tree(dd.from_dense(dense, model.init(jax.random.key(9), x)))
    assert jax.tree.all(jax.tree.map(lambda a, c: bool(jnp.all(a == c)), again, frozen))


def test_one_shot_of_a_models_mlp_with_by_path():
    """dd.models: the dense MLP's checkpoint into the same MLP with ByPath diagonal layers."""
    x = jax.random.normal(jax.random.key(2), (4, 28, 28))
    plain = models.MLP(10, hidden=(64, 64))
    dense = random_dense(plain, x)
    layer = lambda *a, **k: dd.nn.DiagonalDense(*a, sparsity=0.9, **k)  # noqa: E731
    sparse = plain.clone(dense=models.ByPath((r"hidden_\d+",), sparse=layer))
    frozen = dd.from_dense(dense, sparse.init(jax.random.key(1), x), freeze=True)
    assert frozen["params"]["hidden_0"]["values"].shape == (79, 64)  # K = 79 of 784
    np.testing.assert_array_equal(
        frozen["params"]["head"]["kernel"], dense["params"]["head"]["kernel"]
    )
    expect = plain.apply({"params": masked_dense_params(plain, dense, frozen, x)}, x)
    np.testing.assert_allclose(sparse.apply(frozen, x), expect, rtol=1e-5, atol=1e-5)


class Stacked(nn.Module):
    @nn.compact
    def __call__(self, x):
        block = nn.scan(
            lambda module, x, _: (nn.relu(nn.Dense(16, name="fc")(x)), None),
            variable_axes={True: 0},
            split_rngs={"params": True},
            length=3,
        )
        return block(self, x, None)[0]


def test_stacked_layers_take_their_own_slices():
    """nn.scan: kernel [3, in, out], values [3, P, D]; each slice keeps its own top-K."""
    x = jax.random.normal(jax.random.key(2), (4, 16))
    dense = random_dense(Stacked(), x)
    model = dd.nn.sparsify(Stacked(), [("fc", {"sparsity": 0.75})])
    frozen = dd.from_dense(dense, model.init(jax.random.key(1), x), freeze=True)
    fc, offsets = dense["params"]["fc"], np.asarray(frozen["diagonals"]["fc"]["offsets"])
    assert offsets.shape == (3, 4)
    y = x
    for i in range(3):
        e = energies(fc["kernel"][i], 16, 16, 1)
        np.testing.assert_array_equal(offsets[i], np.sort(np.argsort(-e)[:4]))
        w = fc["kernel"][i] * np.isin(diagonal_id(16, 16), offsets[i]).T.astype(np.float32)
        y = jax.nn.relu(y @ w + fc["bias"][i][None])
    np.testing.assert_allclose(model.apply(frozen, x), y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("b", [1, 8])
def test_keep_norm_gives_the_kept_diagonals_the_kernels_whole_norm(b):
    """keep_norm: every diagonal of a layer scaled by one factor, sqrt(E / E_K), so that the K
    kept ones hold the dense kernel's Frobenius norm; the kept set and alpha do not change."""
    x = jax.random.normal(jax.random.key(2), (4, 32))
    dense = random_dense(Single(64), x)
    model = dd.nn.sparsify(Single(64), [("layer", {"sparsity": 0.8, "block_size": b})])
    template = model.init(jax.random.key(1), x)
    plain = dd.from_dense(dense, template)
    kept = dd.from_dense(dense, template, keep_norm=True)
    np.testing.assert_array_equal(
        kept["params"]["layer"]["alpha"], plain["params"]["layer"]["alpha"]
    )
    frozen = dd.freeze_tree(kept)
    np.testing.assert_array_equal(
        frozen["diagonals"]["layer"]["offsets"],
        dd.freeze_tree(plain)["diagonals"]["layer"]["offsets"],
    )
    total = np.sum(np.square(dense["params"]["layer"]["kernel"]))
    np.testing.assert_allclose(
        np.sum(np.square(frozen["params"]["layer"]["values"])), total, rtol=1e-5
    )
    ratio = np.asarray(kept["params"]["layer"]["values"]) / np.asarray(
        plain["params"]["layer"]["values"]
    )
    np.testing.assert_allclose(ratio, ratio.flat[0], rtol=1e-5)
    assert ratio.flat[0] > 1


def test_keep_norm_scales_each_slice_of_a_stack_on_its_own():
    x = jax.random.normal(jax.random.key(2), (4, 16))
    dense = random_dense(Stacked(), x)
    model = dd.nn.sparsify(Stacked(), [("fc", {"sparsity": 0.75})])
    frozen = dd.from_dense(dense, model.init(jax.random.key(1), x), keep_norm=True, freeze=True)
    kept = np.sum(np.square(frozen["params"]["fc"]["values"]), axis=(1, 2))
    total = np.sum(np.square(dense["params"]["fc"]["kernel"]), axis=(1, 2))
    np.testing.assert_allclose(kept, total, rtol=1e-5)


# --- a checkpoint of another model -------------------------------------------------------------


def test_a_checkpoint_of_another_model_or_size_is_refused():
    x = jnp.ones((2, 784))
    layer = lambda *a, **k: dd.nn.DiagonalDense(*a, sparsity=0.9, **k)  # noqa: E731
    by_path = models.ByPath((r"hidden_\d+",), sparse=layer)
    template = models.MLP(10, hidden=(64, 64), dense=by_path).init(jax.random.key(0), x)

    def dense_of(**kwargs):
        return models.MLP(**{"num_classes": 10, "hidden": (64, 64), **kwargs}).init(
            jax.random.key(0), x
        )

    wider = dense_of(hidden=(128, 64))
    with pytest.raises(ValueError, match=r"params/hidden_0 has shape \(784, 128\).*784 -> 64"):
        dd.from_dense(wider, template)
    deeper = dense_of(hidden=(64, 64, 64))
    with pytest.raises(ValueError, match=r"absent in the diagonal model: hidden_2/bias"):
        dd.from_dense(deeper, template)
    other_head = dense_of(num_classes=5)
    with pytest.raises(ValueError, match=r"params/head/kernel has shape \(64, 5\) in the dense"):
        dd.from_dense(other_head, template)
    with pytest.raises(ValueError, match=r"params/hidden_0.*hold \['alpha', 'bias', 'values'\]"):
        dd.from_dense(template, template)  # a DynaDiag checkpoint is not a dense one
    no_bias = dense_of()
    del no_bias["params"]["hidden_1"]["bias"]
    with pytest.raises(ValueError, match="hidden_1/bias exists in the diagonal model but not"):
        dd.from_dense(no_bias, template)
    frozen_template = dd.freeze_tree(template)
    with pytest.raises(ValueError, match="params/hidden_0 is frozen"):
        dd.from_dense(dense_of(), frozen_template)
    with pytest.raises(ValueError, match="no search-phase DiagonalDense"):
        dd.from_dense(dense_of(), dense_of())
    with pytest.raises(TypeError, match="from_dense: dense_variables must be a mapping"):
        dd.from_dense([dense_of()], template)
    with pytest.raises(ValueError, match="from_dense: template must be variables with a 'params'"):
        dd.from_dense(dense_of(), {"diagonals": {}})


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_dense_kernel_with_nan_or_inf_is_refused(bad):
    """It gave every diagonal alpha = 0: the ranking by energy silently erased."""
    x = jnp.ones((2, 16))
    dense = random_dense(Single(40), x)
    kernel = dense["params"]["layer"]["kernel"]
    dense["params"]["layer"]["kernel"] = kernel.at[3, 5].set(bad)
    template = dd.nn.sparsify(Single(40), [("layer", {"sparsity": 0.7})]).init(jax.random.key(5), x)
    with pytest.raises(ValueError, match="from_dense: the dense kernel at params/layer holds NaN"):
        dd.from_dense(dense, template)


@pytest.mark.parametrize(
    "gate_value, error, message",
    [
        (0.0, ValueError, "gate_value must be > 0"),
        (-1.0, ValueError, "gate_value must be > 0"),
        (float("nan"), ValueError, "gate_value must be > 0"),
        (jnp.float32(0), ValueError, "gate_value must be > 0"),
        ("1", TypeError, "gate_value must be a number > 0"),
        (True, TypeError, "gate_value must be a number > 0"),
    ],
)
def test_a_gate_value_that_would_erase_or_reverse_the_ranking_is_refused(
    gate_value, error, message
):
    x = jnp.ones((2, 16))
    dense = random_dense(Single(40), x)
    template = dd.nn.sparsify(Single(40), [("layer", {"sparsity": 0.7})]).init(jax.random.key(5), x)
    with pytest.raises(error, match=f"from_dense: {message}"):
        dd.from_dense(dense, template, gate_value=gate_value)


def test_switches_that_are_not_bools_are_refused():
    """keep_norm="no" rescaled the values and freeze="no" froze them: a string is truthy."""
    x = jnp.ones((2, 16))
    dense = random_dense(Single(40), x)
    template = dd.nn.sparsify(Single(40), [("layer", {"sparsity": 0.7})]).init(jax.random.key(5), x)
    for name in ("keep_norm", "freeze"):
        with pytest.raises(TypeError, match=f"from_dense: {name} must be True or False, got str"):
            dd.from_dense(dense, template, **{name: "no"})


def test_a_template_whose_gate_starts_at_zero_needs_a_gate_value():
    x = jnp.ones((2, 16))
    dense = random_dense(Single(40), x)
    rule = {"sparsity": 0.7, "gate_init": 0.0}
    template = dd.nn.sparsify(Single(40), [("layer", rule)]).init(jax.random.key(5), x)
    with pytest.raises(ValueError, match=r"0.0 at dynadiag/layer/strength.*pass gate_value > 0"):
        dd.from_dense(dense, template)
    alpha = dd.from_dense(dense, template, gate_value=0.5)["params"]["layer"]["alpha"]
    assert np.all(np.isfinite(alpha)) and np.ptp(np.asarray(alpha)) > 0
