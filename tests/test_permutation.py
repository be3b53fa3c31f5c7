"""Input permutations of DiagonalDense: random and learned, linen and NNX, freeze, Orbax, export."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import dynadiag_jax as dd
from dynadiag_jax.kernel_stats import describe_paths, model_paths
from dynadiag_jax.nn import DiagonalDense
from dynadiag_jax.nn import permutation as P

TOL = {jnp.float32: dict(rtol=2e-5, atol=2e-5), jnp.bfloat16: dict(rtol=3e-2, atol=3e-2)}


def without_perm(variables):
    """The variables with the permutation taken out (a permutation-free layer's)."""
    out = {c: dict(v) for c, v in variables.items()}
    out["diagonals"].pop("perm", None)
    out["params"].pop("perm_soft", None)
    return out


def loss(y):
    return jnp.sum(jnp.sin(y.astype(jnp.float32)))


CASES = [(1, 24, 40), (1, 40, 24), (8, 32, 16), (8, 16, 32)]


@pytest.mark.parametrize("phase", ["search", "frozen"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("block_size", "n_in", "n_out"), CASES)
def test_random_permutation_is_the_plain_layer_on_permuted_inputs(
    phase, dtype, block_size, n_in, n_out
):
    kwargs = dict(sparsity=0.5, block_size=block_size, init_phase=phase, impl="jax", dtype=dtype)
    layer = DiagonalDense(n_out, permutation="random", **kwargs)
    plain = DiagonalDense(n_out, **kwargs)
    x = jax.random.normal(jax.random.key(1), (3, 5, n_in), jnp.float32).astype(dtype)
    variables = layer.init(jax.random.key(0), x)
    perm = variables["diagonals"]["perm"]
    assert perm.dtype == jnp.int32 and perm.shape == (n_in,)
    assert sorted(np.asarray(perm).tolist()) == list(range(n_in))
    assert not np.array_equal(perm, np.arange(n_in))  # drawn, not the identity
    rest = without_perm(variables)

    def ours(params, x):
        return loss(layer.apply({**variables, "params": params}, x))

    def reference(params, x):
        return loss(plain.apply({**rest, "params": params}, x[..., perm]))

    tol = TOL[dtype]
    y = layer.apply(variables, x)
    np.testing.assert_allclose(
        np.asarray(y, np.float32),
        np.asarray(plain.apply(rest, x[..., perm]), np.float32),
        **tol,
    )
    got = jax.grad(ours, argnums=(0, 1))(variables["params"], x)
    want = jax.grad(reference, argnums=(0, 1))(rest["params"], x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)


def test_the_permutation_comes_from_the_init_key():
    layer = DiagonalDense(16, sparsity=0.5, permutation="random", impl="jax")
    x = jnp.ones((2, 16))
    a, b, c = (layer.init(jax.random.key(s), x)["diagonals"]["perm"] for s in (0, 0, 1))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_permute_inputs_gradient_is_the_gather_vjp():
    perm = jax.random.permutation(jax.random.key(0), 37).astype(jnp.int32)
    x = jax.random.normal(jax.random.key(1), (4, 37))
    dy = jax.random.normal(jax.random.key(2), (4, 37))
    _, vjp = jax.vjp(lambda x: P.permute_inputs(x, perm), x)
    _, ref = jax.vjp(lambda x: x[..., perm], x)
    np.testing.assert_array_equal(vjp(dy)[0], ref(dy)[0])


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (None, "permutation must be one of \\(None, 'random', 'learned'\\)"),
        ("shuffle", "permutation must be one of"),
        (1, "permutation must be one of"),
    ],
)
def test_bad_permutation_argument_is_named_in_linen_and_nnx(bad, match):
    if bad is None:
        bad = "Random"
    with pytest.raises(ValueError, match=match):
        DiagonalDense(8, sparsity=0.5, permutation=bad)
    with pytest.raises(ValueError, match=match):
        dd.nnx.DiagonalDense(8, 8, sparsity=0.5, permutation=bad, rngs=nnx.Rngs(0))
    for weight in (-1.0, float("nan"), "1e-3"):
        with pytest.raises(ValueError, match="permutation_penalty must be a finite float >= 0"):
            DiagonalDense(8, sparsity=0.5, permutation="learned", permutation_penalty=weight)
        with pytest.raises(ValueError, match="permutation_penalty must be a finite float >= 0"):
            dd.nnx.DiagonalDense(8, 8, sparsity=0.5, permutation_penalty=weight, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    ("perm", "match"),
    [
        ([0, 1, 2, 3, 4, 5, 6, 6], "holds 6 2 times and misses 7"),
        ([0, 1, 2, 3, 4, 5, 6, 8], "holds 8, outside \\[0, 8\\)"),
        ([0, 1, 2, 3, 4, 5, 6, -1], "holds -1, outside"),
        ([0, 1, 2, 3, 4, 5, 6], "perm must be an integer array \\[in\\] = \\[8\\]"),
        (np.arange(8, dtype=np.float32), "perm must be an integer array \\[in\\] = \\[8\\]"),
    ],
)
def test_a_bad_perm_is_a_clear_error_on_the_host_and_nan_under_jit(perm, match):
    layer = DiagonalDense(8, sparsity=0.5, permutation="random", init_phase="frozen", impl="jax")
    x = jax.random.normal(jax.random.key(1), (2, 8))
    v = layer.init(jax.random.key(0), x)
    bad = {**v, "diagonals": {**v["diagonals"], "perm": np.asarray(perm)}}
    with pytest.raises(ValueError, match=match):
        layer.apply(bad, x)
    nnx_layer = dd.nnx.DiagonalDense(
        8, 8, sparsity=0.5, permutation="random", init_phase="frozen", rngs=nnx.Rngs(0)
    )
    nnx_layer.perm.set_value(np.asarray(perm))
    with pytest.raises(ValueError, match=match):
        nnx_layer(x)
    if np.shape(perm) == (8,) and np.issubdtype(np.asarray(perm).dtype, np.integer):
        y = jax.jit(layer.apply)(bad, x)  # traced: cannot raise, so every output is NaN
        assert np.all(np.isnan(y))
        good = jax.jit(layer.apply)(v, x)
        np.testing.assert_allclose(good, layer.apply(v, x), rtol=1e-6)


def test_variables_that_do_not_match_the_permutation_argument_raise():
    x = jnp.ones((2, 8))
    random = DiagonalDense(8, sparsity=0.5, permutation="random", impl="jax")
    plain = DiagonalDense(8, sparsity=0.5, impl="jax")
    learned = DiagonalDense(8, sparsity=0.5, permutation="learned", impl="jax")
    with pytest.raises(ValueError, match="hold an input permutation .diagonals/perm. but"):
        plain.apply(random.init(jax.random.key(0), x), x)
    with pytest.raises(ValueError, match="permutation='random' needs its permutation"):
        random.apply(plain.init(jax.random.key(0), x), x)
    with pytest.raises(ValueError, match="perm_soft .* this one has permutation='random'"):
        random.apply(learned.init(jax.random.key(0), x), x)


@pytest.mark.parametrize("permutation", ["random", "learned"])
@pytest.mark.parametrize(("block_size", "n_in", "n_out"), [(1, 24, 40), (8, 32, 16)])
def test_nnx_layer_computes_what_the_linen_layer_does(permutation, block_size, n_in, n_out):
    kwargs = dict(sparsity=0.5, block_size=block_size, permutation=permutation, impl="jax")
    layer = dd.nnx.DiagonalDense(n_in, n_out, rngs=nnx.Rngs(0), **kwargs)
    linen = DiagonalDense(n_out, **kwargs)
    x = jax.random.normal(jax.random.key(1), (5, n_in))
    params = {k: v.get_value() for k, v in nnx.state(layer, nnx.Param).items()}
    variables = {
        "params": params,
        "diagonals": {"in_features": layer.in_features.get_value()},
        "dynadiag": {"strength": layer.strength.get_value()},
    }
    if permutation == "random":
        variables["diagonals"]["perm"] = layer.perm.get_value()
    np.testing.assert_allclose(layer(x), linen.apply(variables, x), rtol=1e-5, atol=1e-6)
    frozen = dd.nnx.freeze(layer)
    assert not hasattr(frozen, "perm_soft")
    perm = frozen.perm.get_value()
    assert sorted(np.asarray(perm).tolist()) == list(range(n_in))
    fv = {
        "params": {k: v.get_value() for k, v in nnx.state(frozen, nnx.Param).items()},
        "diagonals": {
            "in_features": frozen.in_features.get_value(),
            "offsets": frozen.offsets.get_value(),
            "perm": perm,
        },
    }
    np.testing.assert_allclose(frozen(x), linen.apply(fv, x), rtol=1e-5, atol=1e-6)
    if permutation == "learned":
        m = P.doubly_stochastic(params["perm_soft"])
        want = np.float32(P.DEFAULT_PENALTY) * P.l1_l2_penalty(m)
        np.testing.assert_allclose(dd.nnx.permutation_penalty(layer), want, rtol=1e-6)
        assert float(dd.nnx.permutation_penalty(frozen)) == 0.0


class Model(nn.Module):
    """A learned-permutation element layer, then a random-permutation block layer, then a head."""

    @nn.compact
    def __call__(self, x):
        x = DiagonalDense(32, sparsity=0.75, permutation="learned", impl="jax", name="first")(x)
        x = DiagonalDense(
            16, sparsity=0.5, block_size=8, permutation="random", impl="jax", name="second"
        )(nn.relu(x))
        return nn.Dense(3)(x)


def trained_looking(variables, seed=0):
    """Distinct alphas, and a soft matrix near a known permutation (as the penalty leaves it)."""
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda a: a, variables["params"])
    for name, layer in params.items():
        if "alpha" in layer:
            layer["alpha"] = jnp.asarray(rng.normal(size=layer["alpha"].shape), jnp.float32)
        if "perm_soft" in layer:
            n = layer["perm_soft"].shape[0]
            target = rng.permutation(n)
            soft = 0.05 * rng.uniform(size=(n, n))
            soft[np.arange(n), target] += 1.0
            layer["perm_soft"] = jnp.asarray(soft, jnp.float32)
            params[name] = layer
    return {**variables, "params": params}


def test_freeze_tree_hardens_the_learned_permutation_and_keeps_the_random_one():
    model = Model()
    x = jax.random.normal(jax.random.key(1), (5, 24))
    v = trained_looking(model.init(jax.random.key(0), x))
    fv = jax.jit(dd.freeze_tree)(v)
    assert "perm_soft" not in fv["params"]["first"]
    soft = np.asarray(v["params"]["first"]["perm_soft"])
    np.testing.assert_array_equal(fv["diagonals"]["first"]["perm"], np.argmax(soft, axis=1))
    np.testing.assert_array_equal(
        fv["diagonals"]["second"]["perm"], v["diagonals"]["second"]["perm"]
    )
    for name, n in (("first", 24), ("second", 32)):
        perm = fv["diagonals"][name]["perm"]
        assert perm.dtype == jnp.int32 and sorted(np.asarray(perm).tolist()) == list(range(n))
    # the frozen model is the hard top-K of the search at a hard gate, on the hardened inputs
    hard = {**v, "params": dict(v["params"])}
    first = dict(hard["params"]["first"])
    first["perm_soft"] = jax.nn.one_hot(fv["diagonals"]["first"]["perm"], 24, dtype=jnp.float32)
    hard["params"]["first"] = first
    want = model.apply(dd.nn.set_gate(hard, strength=0.0), x)
    np.testing.assert_allclose(model.apply(fv, x), want, rtol=1e-4, atol=1e-5)


def test_freeze_opt_state_drops_the_soft_matrix():
    model = Model()
    x = jnp.ones((2, 24))
    v = model.init(jax.random.key(0), x)
    tx = optax.adam(1e-3)
    opt_state = tx.init(v["params"])
    fv = dd.freeze_tree(v)
    frozen_state = dd.freeze_opt_state(opt_state, v["params"], fv["params"])
    assert jax.tree.structure(frozen_state) == jax.tree.structure(tx.init(fv["params"]))


def test_single_layer_freeze_and_orbax_round_trip(tmp_path):
    import orbax.checkpoint as ocp

    layer = DiagonalDense(20, sparsity=0.5, permutation="learned", impl="jax")
    x = jax.random.normal(jax.random.key(1), (4, 12))
    v = layer.init(jax.random.key(0), x)
    frozen_layer, fv = dd.freeze(layer, v)
    assert sorted(np.asarray(fv["diagonals"]["perm"]).tolist()) == list(range(12))
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "search", v)
    ckpt.save(tmp_path / "frozen", fv)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "search", layer.init(jax.random.key(5), x))
    np.testing.assert_array_equal(layer.apply(restored, x), layer.apply(v, x))
    template = frozen_layer.init(jax.random.key(6), x)  # a random perm, replaced by the restore
    assert set(template["diagonals"]) == {"in_features", "offsets", "perm"}
    restored = ckpt.restore(tmp_path / "frozen", template)
    np.testing.assert_array_equal(restored["diagonals"]["perm"], fv["diagonals"]["perm"])
    np.testing.assert_array_equal(frozen_layer.apply(restored, x), frozen_layer.apply(fv, x))


def test_nnx_orbax_round_trip_of_the_hardened_permutation(tmp_path):
    import orbax.checkpoint as ocp

    def make():
        return dd.nnx.DiagonalDense(
            12, 20, sparsity=0.5, permutation="learned", impl="jax", rngs=nnx.Rngs(0)
        )

    frozen = dd.nnx.freeze(make())
    x = jax.random.normal(jax.random.key(1), (4, 12))
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(tmp_path / "ckpt", nnx.state(frozen))
    graphdef, abstract = nnx.split(dd.nnx.freeze(nnx.eval_shape(make)))
    with ocp.StandardCheckpointer() as ckpt:
        state = ckpt.restore(tmp_path / "ckpt", abstract)
    restored = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(restored.perm.get_value(), frozen.perm.get_value())
    np.testing.assert_array_equal(restored(x), frozen(x))


def test_export_round_trip_of_a_frozen_permuted_model():
    model = Model()
    x = jax.random.normal(jax.random.key(1), (5, 24))
    fv = dd.freeze_tree(trained_looking(model.init(jax.random.key(0), x)))
    exported = dd.export(jax.jit(model.apply))(fv, x)
    again = jax.export.deserialize(exported.serialize())
    np.testing.assert_allclose(again.call(fv, x), model.apply(fv, x), rtol=1e-6)
    # the permutation is an argument of the exported function, checked there as under jit
    bad = jax.tree.map(lambda a: a, fv)
    bad["diagonals"]["second"]["perm"] = jnp.zeros((32,), jnp.int32)
    assert np.all(np.isnan(again.call(bad, x)))


def test_model_paths_report_the_permutation():
    x = jnp.ones((4, 24))
    paths = {p.path: p for p in model_paths(Model(), jax.random.key(0), x, platform="cpu")}
    assert paths["first"].permutation == "learned"
    assert paths["second"].permutation == "random"
    lines = describe_paths(list(paths.values()))
    assert "learned input permutation" in lines[0] and "random input permutation" in lines[1]
