"""LoRA-FA adapters (dd.nn.lora_fa): equal to the base model at init, only B trained, A frozen.

Each case adapts one layer kind: nn.Dense, DiagonalDense in the search phase, frozen, and with
block diagonals (block_size=16).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dynadiag_jax as dd
from dynadiag_jax import training as T

IN, HIDDEN, OUT = 32, 48, 8
SPARSE = {"sparsity": 0.75, "explore": "none"}


class Net(nn.Module):
    """``head(relu(hidden(x)))``; ``hidden`` is made by ``layer`` (Dense or DiagonalDense)."""

    layer: str = "dense"
    block_size: int = 1

    @nn.compact
    def __call__(self, x, *, train: bool = False):
        del train
        if self.layer == "dense":
            hidden = nn.Dense(HIDDEN, name="hidden")
        else:
            hidden = dd.nn.DiagonalDense(
                HIDDEN, name="hidden", block_size=self.block_size, **SPARSE
            )
        return nn.Dense(OUT, name="head")(nn.relu(hidden(x)))


CASES = {
    "dense": (Net("dense"), False),
    "search": (Net("diag"), False),
    "frozen": (Net("diag"), True),
    "block16": (Net("diag", block_size=16), True),
}


def _base_variables(name):
    model, frozen = CASES[name]
    x = jax.random.normal(jax.random.key(1), (4, IN), jnp.float32)
    variables = dict(model.init(jax.random.key(0), x))
    if frozen:
        variables = dict(dd.freeze_tree(variables))
    return model, variables, x


def _adapted(name, rank=4, alpha=8.0):
    """``(base, base variables, adapted model, adapted variables, x)``: the adapted variables are
    the base ones plus the adapter's."""
    base, variables, x = _base_variables(name)
    adapted = dd.nn.lora_fa(base, ["hidden", "head"], rank=rank, alpha=alpha)
    fresh = adapted.init(jax.random.key(2), x)
    merged = dict(variables)
    merged["params"] = jax.tree.map(lambda a: a, dict(variables["params"]))
    for layer in ("hidden", "head"):
        merged["params"][layer] = {
            **variables["params"][layer],
            "lora_b": fresh["params"][layer]["lora_b"],
        }
    merged["lora_frozen"] = fresh["lora_frozen"]
    return base, variables, adapted, merged, x


@pytest.mark.parametrize("name", list(CASES))
def test_zero_init_equals_the_base_model_exactly(name):
    base, variables, adapted, merged, x = _adapted(name)
    assert merged["params"]["hidden"]["lora_b"].shape == (HIDDEN, 4)
    assert merged["lora_frozen"]["hidden"]["lora_a"].shape == (4, IN)
    assert not np.any(merged["params"]["hidden"]["lora_b"])
    want = base.apply(variables, x)
    got = jax.jit(adapted.apply)(merged, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("name", list(CASES))
def test_adapter_adds_scaled_low_rank_term(name):
    base, variables, adapted, merged, x = _adapted(name, rank=4, alpha=8.0)
    key = jax.random.key(3)
    b = 0.1 * jax.random.normal(key, (HIDDEN, 4), jnp.float32)
    merged["params"]["hidden"]["lora_b"] = b
    a = merged["lora_frozen"]["hidden"]["lora_a"]

    def hidden_out(model, v):
        _, state = model.apply(v, x, capture_intermediates=lambda m, _: m.name == "hidden")
        return state["intermediates"]["hidden"]["__call__"][0]

    delta = hidden_out(adapted, merged) - hidden_out(base, variables)
    np.testing.assert_allclose(delta, (8.0 / 4) * (x @ a.T) @ b.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_only_b_is_trained_and_a_is_untouched(name):
    """A jitted training step with train_only: A is not a param (no gradient, no optimizer
    state), both B get a gradient at once (A is not zero), and only B moves."""
    _, _, adapted, merged, x = _adapted(name)
    assert "lora_a" not in str(jax.tree_util.tree_structure(merged["params"]))
    labels = jnp.arange(4) % OUT
    params = merged["params"]
    collections = {k: v for k, v in merged.items() if k != "params"}
    tx = T.train_only(optax.adam(1e-2), [r".*/lora_b"])
    opt_state = tx.init(params)

    @jax.jit
    def step(params, opt_state):
        def loss(p):
            logits = adapted.apply({"params": p, **collections}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        grads = jax.grad(loss)(params)
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction (as steps.py)
            updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, grads

    new, _, grads = step(params, opt_state)
    assert np.any(grads["hidden"]["lora_b"]) and np.any(grads["head"]["lora_b"])
    flat_new = dict(jax.tree_util.tree_flatten_with_path(new)[0])
    for path, old in jax.tree_util.tree_flatten_with_path(params)[0]:
        changed = not np.array_equal(np.asarray(old), np.asarray(flat_new[path]))
        assert changed == (path[-1].key == "lora_b"), jax.tree_util.keystr(path)


def test_train_only_can_train_diagonal_values_too():
    _, _, adapted, merged, x = _adapted("frozen")
    params = merged["params"]
    tx = T.train_only(optax.sgd(1.0), [r".*/lora_b", r".*/values"])
    grads = jax.tree.map(jnp.ones_like, params)
    updates, _ = tx.update(grads, tx.init(params), params)
    assert np.all(updates["hidden"]["values"] == -1.0)
    assert np.all(updates["hidden"]["lora_b"] == -1.0)
    assert not np.any(updates["hidden"]["bias"]) and not np.any(updates["head"]["kernel"])


def test_adapts_a_sparsified_model_once_in_either_order():
    """A Dense replaced by sparsify's DiagonalDense is one layer: one adapter, not two."""
    x = jnp.ones((2, IN), jnp.float32)
    plain = Net("dense")
    for model in (
        dd.nn.lora_fa(dd.nn.sparsify(plain, [("hidden", SPARSE)]), ["hidden"], rank=2),
        dd.nn.sparsify(dd.nn.lora_fa(plain, ["hidden"], rank=2), [("hidden", SPARSE)]),
    ):
        variables = model.init(jax.random.key(0), x)
        assert set(variables["params"]["hidden"]) == {"alpha", "values", "bias", "lora_b"}
        b = jnp.ones_like(variables["params"]["hidden"]["lora_b"])
        variables = {**variables, "params": {**variables["params"]}}
        variables["params"]["hidden"] = {**variables["params"]["hidden"], "lora_b": b}
        a = variables["lora_frozen"]["hidden"]["lora_a"]
        _, state = model.apply(variables, x, capture_intermediates=lambda m, _: m.name == "hidden")
        zero = {**variables["params"]["hidden"], "lora_b": jnp.zeros_like(b)}
        _, base = model.apply(
            {**variables, "params": {**variables["params"], "hidden": zero}},
            x,
            capture_intermediates=lambda m, _: m.name == "hidden",
        )
        delta = (
            state["intermediates"]["hidden"]["__call__"][0]
            - (base["intermediates"]["hidden"]["__call__"][0])
        )
        np.testing.assert_allclose(delta, (x @ a.T) @ b.T, rtol=1e-5, atol=1e-4)


def test_freeze_tree_keeps_the_adapter():
    model = dd.nn.lora_fa(Net("diag"), ["hidden"], rank=4)
    x = jnp.ones((2, IN), jnp.float32)
    variables = model.init(jax.random.key(0), x)
    frozen = dd.freeze_tree(variables)
    assert frozen["params"]["hidden"]["lora_b"].shape == (HIDDEN, 4)
    assert frozen["lora_frozen"]["hidden"]["lora_a"].shape == (4, IN)
    assert model.apply(frozen, x).shape == (2, OUT)


def test_freeze_state_keeps_the_adapter_and_its_optimizer_state():
    """An adapter trained through the freeze (T.freeze_state inside the loop): B, A and B's
    moments carry over, alpha goes."""
    model = dd.nn.lora_fa(Net("diag"), ["hidden"], rank=4)
    tx = T.train_only(optax.adam(1e-3), [r".*/lora_b", r".*/values", r".*/alpha"])
    example = jax.ShapeDtypeStruct((2, IN), jnp.float32)
    state = T.create_train_state(model, tx, example, seed=0)
    frozen = T.freeze_state(state)
    assert "alpha" not in frozen.params["hidden"]
    assert frozen.params["hidden"]["lora_b"].shape == (HIDDEN, 4)
    np.testing.assert_array_equal(
        frozen.collections["lora_frozen"]["hidden"]["lora_a"],
        state.collections["lora_frozen"]["hidden"]["lora_a"],
    )
    moments = [leaf.shape for leaf in jax.tree.leaves(frozen.opt_state)]
    assert moments.count((HIDDEN, 4)) == 2  # Adam's mu and nu of B
    out = model.apply(T.variables_of(frozen), jnp.ones((2, IN), jnp.float32))
    assert out.shape == (2, OUT) and np.all(np.isfinite(out))


def test_pattern_matching_no_layer_names_it_and_lists_the_layers():
    model = dd.nn.lora_fa(Net("diag"), ["hidden", "mlp/fc.*"], rank=2)
    with pytest.raises(ValueError, match=r"'mlp/fc\.\*'") as e:
        model.init(jax.random.key(0), jnp.ones((2, IN), jnp.float32))
    assert "hidden" in str(e.value) and "head" in str(e.value)


class _Attention(nn.Module):
    """Only nn.DenseGeneral projections (nn.MultiHeadDotProductAttention's)."""

    @nn.compact
    def __call__(self, x):
        return nn.MultiHeadDotProductAttention(num_heads=2, name="mha")(x)


def test_a_pattern_on_dense_general_layers_says_they_take_no_adapter():
    """The error listed "(none)" although the model has four such layers."""
    model = dd.nn.lora_fa(_Attention(), ["mha/query"], rank=2)
    with pytest.raises(
        ValueError,
        match=r"(?s)'mha/query'.*\(none.*nn.DenseGeneral layers, "
        r"which take no adapter.*mha/query\n  mha/key",
    ):
        model.init(jax.random.key(0), jnp.ones((2, 3, 8), jnp.float32))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(alpha="x"), TypeError, "lora_fa: alpha must be a number"),
        (dict(alpha=float("nan")), ValueError, "lora_fa: alpha must be a finite number"),
        (dict(param_dtype=jnp.int32), TypeError, "lora_fa: param_dtype must be a floating dtype"),
        (dict(a_init=3), TypeError, "lora_fa: a_init must be an initializer"),
        # B's gradient is scaled by alpha: an adapter that never trains
        (dict(alpha=0.0), ValueError, "lora_fa: alpha=0 scales the adapter to nothing"),
    ],
)
def test_bad_adapter_arguments_are_refused_at_once_by_name(kwargs, error, match):
    with pytest.raises(error, match=match):
        dd.nn.lora_fa(Net(), ["hidden"], rank=2, **kwargs)
    with pytest.raises(error, match=match.replace("lora_fa", "dd.nnx.lora_fa")):
        dd.nnx.lora_fa(nnx.Linear(4, 4, rngs=nnx.Rngs(0)), [""], rank=2, rngs=nnx.Rngs(0), **kwargs)


@pytest.mark.parametrize(
    "rank,error", [(0, ValueError), (-1, ValueError), (2.0, TypeError), (True, TypeError)]
)
def test_bad_rank_is_refused_at_once(rank, error):
    with pytest.raises(error, match="rank"):
        dd.nn.lora_fa(Net(), ["hidden"], rank=rank)


def test_rank_above_the_layer_width_names_rank_and_the_layer():
    model = dd.nn.lora_fa(Net(), ["head"], rank=OUT + 1)
    with pytest.raises(ValueError, match=r"rank=9 exceeds min\(in, out\) = 8.*'head'"):
        model.init(jax.random.key(0), jnp.ones((2, IN), jnp.float32))


def test_bad_patterns_and_double_wrapping_are_refused():
    with pytest.raises(TypeError, match="sequence of regular expressions"):
        dd.nn.lora_fa(Net(), "hidden", rank=2)
    with pytest.raises(ValueError, match="invalid"):
        dd.nn.lora_fa(Net(), ["hid(den"], rank=2)
    with pytest.raises(ValueError, match="layers is empty"):
        dd.nn.lora_fa(Net(), [], rank=2)
    with pytest.raises(ValueError, match="already adapted"):
        dd.nn.lora_fa(dd.nn.lora_fa(Net(), ["hidden"], rank=2), ["head"], rank=2)


def test_missing_frozen_collection_is_a_clear_error():
    model = dd.nn.lora_fa(Net(), ["hidden"], rank=2)
    x = jnp.ones((2, IN), jnp.float32)
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="'lora_frozen' collection"):
        model.apply({"params": variables["params"]}, x)


# --- NNX ---------------------------------------------------------------------------------------


class NnxNet(nnx.Module):
    def __init__(self, layer, *, block_size=1, rngs):
        if layer == "dense":
            self.hidden = nnx.Linear(IN, HIDDEN, rngs=rngs)
        else:
            self.hidden = dd.nnx.DiagonalDense(
                IN, HIDDEN, block_size=block_size, **SPARSE, rngs=rngs
            )
        self.head = nnx.Linear(HIDDEN, OUT, rngs=rngs)

    def __call__(self, x):
        return self.head(jax.nn.relu(self.hidden(x)))


def _nnx_model(name):
    layer = "dense" if name == "dense" else "diag"
    model = NnxNet(layer, block_size=16 if name == "block16" else 1, rngs=nnx.Rngs(0))
    return dd.nnx.freeze(model) if CASES[name][1] else model


@pytest.mark.parametrize("name", list(CASES))
def test_nnx_zero_init_equals_the_base_and_only_b_trains(name):
    model = _nnx_model(name)
    x = jax.random.normal(jax.random.key(1), (4, IN), jnp.float32)
    want = model(x)
    assert dd.nnx.lora_fa(model, ["hidden", "head"], rank=4, rngs=nnx.Rngs(5)) is model
    assert isinstance(model.hidden, dd.nnx.LoRAFA) and model.hidden.lora_b.shape == (HIDDEN, 4)
    assert model.hidden.lora_a.shape == (4, IN)
    np.testing.assert_array_equal(np.asarray(nnx.jit(lambda m: m(x))(model)), np.asarray(want))

    wrt = nnx.All(nnx.Param, nnx.PathContains("lora_b"))
    with jax.numpy_dtype_promotion("standard"):  # optax's bias correction, as in test_nnx.py
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=wrt)
    labels = jnp.arange(4) % OUT

    @nnx.jit
    def step(model, optimizer):
        def loss(m):
            logits = m(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

        grads = nnx.grad(loss, argnums=nnx.DiffState(0, wrt))(model)
        with jax.numpy_dtype_promotion("standard"):
            optimizer.update(model, grads)

    def weights():  # copies: the state's variables are the model's own
        state = nnx.state(model, nnx.Any(nnx.Param, dd.nnx.LoRAFrozen))
        return {path: np.array(v.get_value()) for path, v in nnx.to_flat_state(state)}

    before = weights()
    step(model, optimizer)
    after = weights()
    for path, old in before.items():
        assert (not np.array_equal(old, after[path])) == (path[-1] == "lora_b"), path


def test_nnx_errors_name_the_pattern_rank_and_layer():
    model = NnxNet("diag", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"'fc9'.*\n.*hidden") as e:
        dd.nnx.lora_fa(model, ["hidden", "fc9"], rank=2, rngs=nnx.Rngs(1))
    assert "head" in str(e.value)
    with pytest.raises(ValueError, match=r"rank=9 exceeds min\(in, out\) = 8.*'head'"):
        dd.nnx.lora_fa(model, ["hidden", "head"], rank=9, rngs=nnx.Rngs(1))
    assert isinstance(model.hidden, dd.nnx.DiagonalDense)  # nothing wrapped when anything fails
    with pytest.raises(ValueError, match="rank must be an int >= 1"):
        dd.nnx.lora_fa(model, ["hidden"], rank=0, rngs=nnx.Rngs(1))
