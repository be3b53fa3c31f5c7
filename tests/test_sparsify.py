"""dd.nn.sparsify / dd.nnx.sparsify: diagonal layers in models written the usual way, unedited.

Each model trains a few steps (the loss goes down), is frozen, and must then compute exactly what
the *original* dense model computes with the frozen diagonals written into its kernels (the dense
oracle); every replaced layer keeps K*D values.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dynadiag_jax as dd
from dynadiag_jax.kernel_stats import model_paths

# explore="none": one product per layer, so the search step compiles in a second or two
SPARSE = {"sparsity": 0.75, "explore": "none"}
STEPS = 8


# --- models written the usual way --------------------------------------------------------------


class Mlp(nn.Module):
    """nn.Dense and nn.DenseGeneral, [in] -> [heads, dim] -> [out]."""

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(32)(x))
        h = nn.DenseGeneral((4, 8), name="split")(h)
        h = nn.DenseGeneral(16, axis=(-2, -1), name="merge")(nn.relu(h))
        return nn.Dense(4, name="head")(h)


class Attention(nn.Module):
    """A pre-norm Transformer block on [batch, tokens, width]."""

    @nn.compact
    def __call__(self, x):
        x = x + nn.MultiHeadDotProductAttention(num_heads=2)(nn.LayerNorm()(x))
        h = nn.gelu(nn.Dense(32)(nn.LayerNorm()(x)))
        return x + nn.Dense(16)(h)


class Shared(nn.Module):
    """One nn.Dense called twice, and one passed to two children."""

    def setup(self):
        self.shared = nn.Dense(16)
        self.proj = nn.Dense(16)
        self.left = Child(self.proj)
        self.right = Child(self.proj)

    def __call__(self, x):
        x = nn.relu(self.shared(x))
        x = nn.relu(self.shared(x))
        return self.left(x) + self.right(x)


class Child(nn.Module):
    layer: nn.Module

    @nn.compact
    def __call__(self, x):
        return self.layer(x)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        return x + nn.Dense(16)(nn.relu(nn.Dense(32)(x))), None


class Stacked(nn.Module):
    """Two scanned blocks (every collection scanned) and a rematerialised one."""

    @nn.compact
    def __call__(self, x):
        scanned = nn.scan(Block, variable_axes={True: 0}, split_rngs={"params": True}, length=2)
        x, _ = scanned(name="layers")(x, None)
        x, _ = nn.remat(Block)(name="last")(x)
        return x


def sequential():
    return nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(16), nn.relu, nn.Dense(4)])


# --- helpers -----------------------------------------------------------------------------------


def path_get(tree, path: str):
    for key in path.split("/"):
        tree = tree[key]
    return tree


def path_set(tree, path: str, value):
    keys = path.split("/")
    for key in keys[:-1]:
        tree = tree[key]
    tree[keys[-1]] = value


def copy_tree(tree):
    return {k: copy_tree(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def dense_oracle_params(model, frozen, x):
    """The params of the unedited ``model`` holding each replaced layer's frozen diagonals as its
    kernel (``W.T`` reshaped to the layer's ``[*in, *out]``) and its bias reshaped; the other
    params are the frozen model's own."""
    params = copy_tree(frozen["params"])
    for layer in dd.nn.linear_layer_paths(model, x):
        node = path_get(frozen["params"], layer.path)
        if "values" not in node:
            continue
        offsets = path_get(frozen["diagonals"], layer.path)["offsets"]
        n_in, n_out = math.prod(layer.in_shape), math.prod(layer.out_shape)

        def kernel(values, offsets, n_in=n_in, n_out=n_out, layer=layer):
            w = dd.diag_to_dense(values, offsets, in_features=n_in, out_features=n_out)
            return w.T.reshape(layer.in_shape + layer.out_shape)

        for _ in range(offsets.ndim - 1):  # stacked layers (nn.scan): one kernel per slice
            kernel = jax.vmap(kernel)
        lead = offsets.shape[:-1]
        kernel = jax.jit(kernel)(node["values"], offsets)
        path_set(
            params,
            layer.path,
            {"kernel": kernel, "bias": node["bias"].reshape(lead + layer.out_shape)},
        )
    return params


def train(model, x, y, variables, steps=STEPS):
    """README's loop: search steps, the freeze with the optimizer state carried over, frozen
    steps. Returns the frozen variables and the losses of both phases."""
    strength = dd.schedules.exponential(1.0, 0.1, steps)  # a slow anneal: 8 steps is short
    tx = dd.optim.diag_optimizer(1e-2, alpha_learning_rate=1e-2)
    opt_state = tx.init(variables["params"])

    def step(variables, opt_state):
        def loss_fn(params):
            return jnp.mean((model.apply({**variables, "params": params}, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(variables["params"])
        updates, opt_state = tx.update(grads, opt_state, variables["params"])
        params = optax.apply_updates(variables["params"], updates)
        return {**variables, "params": params}, opt_state, loss

    @jax.jit
    def search_step(variables, opt_state, i):
        return step(dd.nn.set_gate(variables, strength=strength(i)), opt_state)

    frozen_step = jax.jit(step)
    search, after = [], []
    # optax's Adam raises its decay (a float) to its int32 count, which the suite's strict
    # promotion rejects inside optax (not in our code).
    with jax.numpy_dtype_promotion("standard"):
        for i in range(steps):
            variables, opt_state, loss = search_step(variables, opt_state, i)
            search.append(float(loss))
        frozen = dd.freeze_tree(variables)
        opt_state = dd.freeze_opt_state(opt_state, variables["params"], frozen["params"])
        for _ in range(steps // 2):
            frozen, opt_state, loss = frozen_step(frozen, opt_state)
            after.append(float(loss))
    return frozen, search, after


def check_sparsified(model, rules, x, replaced, variables=None):
    """Init, train, freeze; the frozen model equals the dense oracle; K*D values per layer."""
    sparse = dd.nn.sparsify(model, rules)
    if variables is None:
        variables = jax.jit(sparse.init)(jax.random.key(0), x)
    y = jax.jit(model.init_with_output)(jax.random.key(2), x)[0]  # a dense teacher
    frozen, search, after = train(sparse, x, y, variables)
    assert search[-1] < 0.9 * search[0] and after[-1] < after[0], (search, after)
    layers = {layer.path: layer for layer in dd.nn.linear_layer_paths(model, x)}
    assert set(replaced) <= set(layers)
    for path in layers:
        node = path_get(frozen["params"], path)
        if path not in replaced:
            assert set(node) == {"kernel", "bias"}, path
            continue
        assert set(node) == {"values", "bias"}, path
        n_in, n_out = math.prod(layers[path].in_shape), math.prod(layers[path].out_shape)
        k = dd.num_diagonals(n_in, n_out, SPARSE["sparsity"])
        stack = node["values"].shape[:-2]
        assert node["values"].shape == stack + (k, min(n_in, n_out)), path
        assert path_get(frozen["diagonals"], path)["offsets"].shape == stack + (k,)
    want = jax.jit(model.apply)({"params": dense_oracle_params(model, frozen, x)}, x)
    np.testing.assert_allclose(jax.jit(sparse.apply)(frozen, x), want, rtol=1e-5, atol=1e-5)
    return sparse, frozen


# --- linen -------------------------------------------------------------------------------------


def test_mlp_dense_and_dense_general():
    x = jax.random.normal(jax.random.key(1), (32, 12))
    rules = [(r"Dense_0|split|merge", SPARSE)]
    v = jax.jit(dd.nn.sparsify(Mlp(), rules).init)(jax.random.key(0), x)
    assert set(v["params"]["split"]) == {"alpha", "values", "bias"}
    assert v["params"]["split"]["bias"].shape == (32,)  # prod(features): a DiagonalDense's bias
    assert v["params"]["merge"]["values"].shape == (32, 16)  # [P, D] over 32 -> 16
    assert set(v["dynadiag"]["merge"]) == {"strength", "topk", "score"}
    check_sparsified(Mlp(), rules, x, ["Dense_0", "split", "merge"], variables=v)


def test_static_random_diagonals_through_a_rule():
    """``init_phase="frozen"`` in a rule: random offsets at init, no gate, trained as they are,
    and the model equals the dense oracle with those diagonals in its kernels."""
    x = jax.random.normal(jax.random.key(1), (32, 12))
    y = jax.random.normal(jax.random.key(2), (32, 4))
    sparse = dd.nn.sparsify(Mlp(), [(r"Dense_0|merge", {"sparsity": 0.75, "init_phase": "frozen"})])
    v = jax.jit(sparse.init)(jax.random.key(0), x)
    assert "dynadiag" not in v and set(v["params"]["Dense_0"]) == {"values", "bias"}
    offsets = v["diagonals"]["merge"]["offsets"]  # 32 -> 16: K = 8 distinct of P = 32
    assert offsets.shape == (8,) and len(set(np.asarray(offsets).tolist())) == 8
    tx = optax.adam(1e-2)
    opt_state = tx.init(v["params"])

    @jax.jit
    def step(params, opt_state):
        loss, g = jax.value_and_grad(
            lambda p: jnp.mean((sparse.apply({**v, "params": p}, x) - y) ** 2)
        )(params)
        updates, opt_state = tx.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params, losses = v["params"], []
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam, as in train() above
        for _ in range(STEPS):
            params, opt_state, loss = step(params, opt_state)
            losses.append(float(loss))
    assert losses[-1] < losses[0]
    trained = {**v, "params": params}
    assert dd.freeze_tree(trained)["diagonals"]["merge"]["offsets"].tolist() == offsets.tolist()
    want = Mlp().apply({"params": dense_oracle_params(Mlp(), trained, x)}, x)
    np.testing.assert_allclose(sparse.apply(trained, x), want, rtol=1e-5, atol=1e-5)


def test_attention_block():
    x = jax.random.normal(jax.random.key(1), (8, 6, 16))
    rules = [(r".*/(query|key|value|out)", SPARSE)]  # the MLP's Dense layers stay dense
    attention = [f"MultiHeadDotProductAttention_0/{n}" for n in ("query", "key", "value", "out")]
    check_sparsified(Attention(), rules, x, attention)


def test_sequential():
    x = jax.random.normal(jax.random.key(1), (32, 12))
    check_sparsified(sequential(), [("layers_[02]", SPARSE)], x, ["layers_0", "layers_2"])


def test_shared_layers():
    x = jax.random.normal(jax.random.key(1), (32, 16))
    model = Shared()
    assert [layer.path for layer in dd.nn.linear_layer_paths(model, x)] == ["shared", "proj"]
    check_sparsified(model, [("shared|proj", SPARSE)], x, ["shared", "proj"])


def test_scan_and_remat_blocks():
    x = jax.random.normal(jax.random.key(1), (32, 16))
    paths = ["layers/Dense_0", "layers/Dense_1", "last/Dense_0", "last/Dense_1"]
    sparse, frozen = check_sparsified(Stacked(), [(".*", SPARSE)], x, paths)
    assert frozen["params"]["layers"]["Dense_1"]["values"].shape[0] == 2  # one slice per block


def test_checkpoint_export_and_kernel_paths(tmp_path):
    import orbax.checkpoint as ocp

    x = jax.random.normal(jax.random.key(1), (4, 12))
    sparse = dd.nn.sparsify(Mlp(), [("Dense_0|merge", SPARSE)])
    init = jax.jit(sparse.init)
    v = dd.nn.set_gate(init(jax.random.key(0), x), strength=0.3)
    fv = dd.freeze_tree(v)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "search", v)
    ckpt.save(tmp_path / "frozen", fv)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "search", init(jax.random.key(7), x))
    np.testing.assert_array_equal(sparse.apply(restored, x), sparse.apply(v, x))
    frozen_template = dd.freeze_tree(init(jax.random.key(8), x))
    restored = ckpt.restore(tmp_path / "frozen", frozen_template)
    np.testing.assert_array_equal(sparse.apply(restored, x), sparse.apply(fv, x))

    exported = dd.export(jax.jit(sparse.apply))(fv, x)
    y = jax.export.deserialize(exported.serialize()).call(fv, x)
    np.testing.assert_allclose(y, sparse.apply(fv, x), rtol=1e-6, atol=1e-6)

    paths = model_paths(sparse, jax.random.key(0), x)  # the start-up report sees them too
    assert [p.path for p in paths] == ["Dense_0", "merge"]


class Encoder(nn.Module):
    def setup(self):
        self.embed = nn.Dense(16)
        self.proj = nn.Dense(4)

    def encode(self, x):
        return self.embed(x)

    def __call__(self, x):
        return self.proj(nn.relu(self.encode(x)))


class Classifier(nn.Module):
    backbone: nn.Module

    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(self.backbone(x))


def test_other_methods_and_use_as_a_submodule():
    x = jnp.ones((2, 12))
    sparse = dd.nn.sparsify(Encoder(), [("embed", SPARSE)])
    v = jax.jit(sparse.init)(jax.random.key(0), x)
    assert sparse.apply(v, x, method="encode").shape == (2, 16)
    assert sparse.apply(v, x, method=Encoder.encode).shape == (2, 16)
    # rules match paths relative to the sparsified module, wherever it sits
    shapes = jax.eval_shape(Classifier(sparse).init, jax.random.key(0), x)["params"]
    assert set(shapes["backbone"]["embed"]) == {"alpha", "values", "bias"}
    assert set(shapes["backbone"]["proj"]) == {"kernel", "bias"}


def test_rule_that_matches_nothing_lists_the_layers():
    x = jnp.ones((2, 12))
    sparse = dd.nn.sparsify(Mlp(), [("Dense_0", SPARSE), ("MlpBlock_0/.*", SPARSE)])
    with pytest.raises(ValueError, match="'MlpBlock_0/.\\*' match no linear layer") as e:
        jax.eval_shape(sparse.init, jax.random.key(0), x)
    assert "\n  Dense_0\n  split\n  merge\n  head" in str(e.value)
    # re.fullmatch: a pattern for part of a path matches nothing
    with pytest.raises(ValueError, match="'Dense' match no linear layer"):
        jax.eval_shape(dd.nn.sparsify(Mlp(), [("Dense", SPARSE)]).init, jax.random.key(0), x)

    class MyDense(nn.Dense):
        pass

    class Custom(nn.Module):
        @nn.compact
        def __call__(self, x):
            return MyDense(4, name="fc")(x)

    # it said "(none)", nothing on why the model's layer was not one
    with pytest.raises(ValueError, match=r"\(none; a subclass of the layer classes is not one\)"):
        jax.eval_shape(dd.nn.sparsify(Custom(), [("fc", SPARSE)]).init, jax.random.key(0), x)


def test_sizes_a_rule_cannot_take_name_the_layer():
    x = jnp.ones((2, 12))
    sparse = dd.nn.sparsify(Mlp(), [("Dense_0", {"sparsity": 0.9, "block_size": 16})])
    with pytest.raises(ValueError, match="Dense_0: block_size=16 must divide in_features=12"):
        jax.eval_shape(sparse.init, jax.random.key(0), x)


class Unmappable(nn.Module):
    axis: tuple = (-2, -1)
    batch_dims: tuple = ()

    @nn.compact
    def __call__(self, x):
        return nn.DenseGeneral(8, axis=self.axis, batch_dims=self.batch_dims, name="proj")(x)


@pytest.mark.parametrize(
    "model, match",
    [
        (Unmappable(axis=(0, 2)), "'proj' contracts axes \\(0, 2\\) of an input of shape"),
        (Unmappable(axis=-1, batch_dims=(0,)), "'proj' has batch_dims=\\(0,\\)"),
    ],
)
def test_dense_general_that_cannot_map_names_the_layer(model, match):
    sparse = dd.nn.sparsify(model, [("proj", SPARSE)])
    with pytest.raises(ValueError, match=match):
        jax.eval_shape(sparse.init, jax.random.key(0), jnp.ones((2, 3, 4)))


class ParamsOnlyScan(nn.Module):
    @nn.compact
    def __call__(self, x):
        scanned = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=2)
        return scanned(name="layers")(x, None)[0]


def test_scan_without_the_collections_says_how_to_carry_them():
    x = jnp.ones((2, 16))
    with pytest.raises(ValueError, match="'layers/Dense_.' sits in a lifted transform.*'dynadiag'"):
        jax.eval_shape(
            dd.nn.sparsify(ParamsOnlyScan(), [(".*", SPARSE)]).init, jax.random.key(0), x
        )


@pytest.mark.parametrize(
    "rules, error, match",
    [
        ("Dense_0", TypeError, "sequence of \\(regex, kwargs\\) pairs"),
        ([("Dense_0",)], TypeError, "rules\\[0\\] must be a \\(regex, kwargs\\) pair"),
        ([("(", SPARSE)], ValueError, "pattern '\\(' is invalid"),
        ([("Dense_0", {"sparsity": 0.9, "featurs": 3})], TypeError, "does not take: \\['featurs'"),
        ([("Dense_0", {"features": 3, "sparsity": 0.9})], ValueError, "sets \\['features'\\]"),
        ([("Dense_0", {"sparsity": 1.5})], ValueError, "rules\\[0\\] \\('Dense_0'\\): sparsity"),
        ([("Dense_0", {})], ValueError, "exactly one of sparsity="),
        ([], ValueError, "rules is empty"),  # the module came back unchanged
        ({}, ValueError, "rules is empty"),
    ],
)
def test_malformed_rules_fail_at_once(rules, error, match):
    with pytest.raises(error, match=match):
        dd.nn.sparsify(Mlp(), rules)


def test_module_must_be_unbound_and_sparsified_once():
    sparse = dd.nn.sparsify(Mlp(), {"Dense_0": SPARSE})  # an ordered mapping works too
    with pytest.raises(ValueError, match="already sparsified"):
        dd.nn.sparsify(sparse, {"head": SPARSE})
    with pytest.raises(TypeError, match="must be unbound"):
        dd.nn.sparsify(Mlp().bind({}), {"head": SPARSE})


# --- NNX ---------------------------------------------------------------------------------------


class NnxModel(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(num_heads=2, in_features=16, decode=False, rngs=rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(16, 32, rngs=rngs), nnx.relu, nnx.Linear(32, 16, rngs=rngs)
        )
        self.shared = nnx.Linear(16, 16, rngs=rngs)
        self.again = self.shared  # one layer, two paths ("again" comes first in nnx.state)
        self.head = nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(x)
        x = x + self.mlp(x)
        return self.head(nnx.relu(self.again(nnx.relu(self.shared(x)))))


def nnx_dense_oracle(make, frozen):
    """The unedited model holding the frozen model's params, diagonals written as kernels."""
    params = nnx.to_pure_dict(nnx.state(frozen, nnx.Param))
    for path, layer in nnx.iter_graph(frozen):
        if isinstance(layer, dd.nnx.DiagonalDense):
            spec = layer.spec
            w = dd.diag_to_dense(
                layer.values.get_value(),
                layer.offsets.get_value(),
                in_features=spec.in_features,
                out_features=spec.out_features,
            )
            in_shape = getattr(layer, "in_shape", (spec.in_features,))
            out_shape = getattr(layer, "out_shape", (spec.out_features,))
            node = params
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = {
                "kernel": w.T.reshape(in_shape + out_shape),
                "bias": layer.bias.get_value().reshape(out_shape),
            }
    dense = make()
    state = nnx.state(dense, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(dense, state)
    return dense


def test_nnx_model_trains_freezes_and_equals_the_dense_oracle():
    def make():
        return NnxModel(nnx.Rngs(0))

    x = jax.random.normal(jax.random.key(1), (8, 6, 16))
    y = NnxModel(nnx.Rngs(2))(x)  # a dense teacher
    model = make()
    rules = [(r"attn/(query|key|value|out)", SPARSE), (r"mlp/layers/\d|shared", SPARSE)]
    assert dd.nnx.sparsify(model, rules, rngs=nnx.Rngs(1)) is model
    assert isinstance(model.attn.query, dd.nnx.DiagonalDenseGeneral)
    assert isinstance(model.mlp.layers[2], dd.nnx.DiagonalDense)
    assert model.again is model.shared and isinstance(model.shared, dd.nnx.DiagonalDense)
    assert type(model.head) is nnx.Linear

    strength = dd.schedules.exponential(1.0, 0.1, STEPS)
    tx = dd.optim.diag_optimizer(1e-2, alpha_learning_rate=1e-2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    def loss(model):
        return jnp.mean((model(x) - y) ** 2)

    @nnx.jit
    def search_step(model, optimizer, i):
        dd.nnx.set_gate(model, strength=strength(i))
        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    @nnx.jit
    def frozen_step(model, optimizer):
        value, grads = nnx.value_and_grad(loss)(model)
        optimizer.update(model, grads)
        return value

    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes dtypes (see train)
        search = [float(search_step(model, optimizer, i)) for i in range(STEPS)]
        frozen = dd.nnx.freeze(model)
        optimizer = dd.nnx.freeze_opt_state(optimizer, model, frozen)
        after = [float(frozen_step(frozen, optimizer)) for _ in range(STEPS // 2)]
    assert search[-1] < 0.9 * search[0] and after[-1] < after[0], (search, after)
    assert frozen.again is frozen.shared
    for layer in (frozen.attn.query, frozen.attn.out, frozen.mlp.layers[0], frozen.shared):
        spec = layer.spec
        k = dd.num_diagonals(spec.in_features, spec.out_features, SPARSE["sparsity"])
        d = min(spec.in_features, spec.out_features)
        assert layer.values.get_value().shape == (k, d)
    np.testing.assert_allclose(frozen(x), nnx_dense_oracle(make, frozen)(x), rtol=1e-5, atol=1e-5)


def test_nnx_errors_name_the_pattern_or_the_layer():
    model = NnxModel(nnx.Rngs(0))
    with pytest.raises(ValueError, match="'fc1' match no linear layer") as e:
        dd.nnx.sparsify(model, [("head", SPARSE), ("fc1", SPARSE)], rngs=nnx.Rngs(1))
    assert "\n  again = shared\n" in str(e.value) and "\n  attn/query\n" in str(e.value)
    assert type(model.head) is nnx.Linear  # nothing replaced
    with pytest.raises(ValueError, match="head: block_size=16 must divide in_features=16 and out"):
        dd.nnx.sparsify(model, [("head", {"k": 1, "block_size": 16})], rngs=nnx.Rngs(1))
    with pytest.raises(TypeError, match="does not take: \\['featurs'\\]"):
        dd.nnx.sparsify(model, [("head", {"k": 1, "featurs": 2})], rngs=nnx.Rngs(1))


class NnxGeneral(nnx.Module):
    def __init__(self, axis, batch_axis, rngs):
        self.proj = nnx.LinearGeneral((3, 4), 8, axis=axis, batch_axis=batch_axis or {}, rngs=rngs)


@pytest.mark.parametrize(
    "axis, batch_axis, match",
    [
        ((-3, -1), None, "'proj' contracts axes \\(-3, -1\\) of x"),
        ((-2, -1), {0: 2}, "'proj' has batch_axis=\\{0: 2\\}"),
    ],
)
def test_nnx_linear_general_that_cannot_map_names_the_layer(axis, batch_axis, match):
    model = NnxGeneral(axis, batch_axis, nnx.Rngs(0))
    with pytest.raises(ValueError, match=match):
        dd.nnx.sparsify(model, [("proj", SPARSE)], rngs=nnx.Rngs(1))
    # positive axes depend on x's rank: checked on the call
    model = NnxGeneral((1, 3), None, nnx.Rngs(0))
    dd.nnx.sparsify(model, [("proj", SPARSE)], rngs=nnx.Rngs(1))
    with pytest.raises(ValueError, match="proj: a diagonal layer maps the trailing axes"):
        model.proj(jnp.ones((2, 3, 5, 4)))
    model = NnxGeneral((2, 3), None, nnx.Rngs(0))
    dd.nnx.sparsify(model, [("proj", SPARSE)], rngs=nnx.Rngs(1))
    assert model.proj(jnp.ones((2, 5, 3, 4))).shape == (2, 5, 8)
