"""Input permutations of DiagonalDense: random and learned, linen and NNX, freeze, Orbax, export."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import scipy.optimize
from flax import nnx, traverse_util

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
    for weight, error in ((-1.0, ValueError), (float("nan"), ValueError), ("1e-3", TypeError)):
        with pytest.raises(error, match="permutation_penalty must be a (finite|number)"):
            DiagonalDense(8, sparsity=0.5, permutation="learned", permutation_penalty=weight)
        with pytest.raises(error, match="permutation_penalty must be a (finite|number)"):
            dd.nnx.DiagonalDense(8, 8, sparsity=0.5, permutation_penalty=weight, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    ("perm", "error", "match"),
    [
        ([0, 1, 2, 3, 4, 5, 6, 6], ValueError, "holds 6 2 times and misses 7"),
        ([0, 1, 2, 3, 4, 5, 6, 8], ValueError, "holds 8, outside \\[0, 8\\)"),
        ([0, 1, 2, 3, 4, 5, 6, -1], ValueError, "holds -1, outside"),
        ([0, 1, 2, 3, 4, 5, 6], ValueError, "perm must be an integer array \\[in\\] = \\[8\\]"),
        (
            np.arange(8, dtype=np.float32),
            TypeError,
            "perm must be an integer array \\[in\\] = \\[8\\].*got float32",
        ),
    ],
)
def test_a_bad_perm_is_a_clear_error_on_the_host_and_nan_under_jit(perm, error, match):
    layer = DiagonalDense(8, sparsity=0.5, permutation="random", init_phase="frozen", impl="jax")
    x = jax.random.normal(jax.random.key(1), (2, 8))
    v = layer.init(jax.random.key(0), x)
    bad = {**v, "diagonals": {**v["diagonals"], "perm": np.asarray(perm)}}
    with pytest.raises(error, match=match):
        layer.apply(bad, x)
    nnx_layer = dd.nnx.DiagonalDense(
        8, 8, sparsity=0.5, permutation="random", init_phase="frozen", rngs=nnx.Rngs(0)
    )
    nnx_layer.perm.set_value(np.asarray(perm))
    with pytest.raises(error, match=match):
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
    # the frozen model is the hard top-K of the search at a hard gate, on the hardened inputs,
    # each value scaled by the soft matrix's entry that the hard permutation kept for its input
    hard = {**v, "params": dict(v["params"])}
    first = dict(hard["params"]["first"])
    perm = fv["diagonals"]["first"]["perm"]
    first["perm_soft"] = jax.nn.one_hot(perm, 24, dtype=jnp.float32)
    kept = np.take_along_axis(np.asarray(P.doubly_stochastic(soft)), np.asarray(perm)[:, None], 1)
    cols = dd.layout.diag_indices(np.arange(first["values"].shape[0]), 24, 32)[1]
    first["values"] = first["values"] * kept[:, 0][cols]
    hard["params"]["first"] = first
    want = model.apply(dd.nn.set_gate(hard, strength=0.0), x)
    np.testing.assert_allclose(model.apply(fv, x), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("block_size", "n_in", "n_out"), CASES)
def test_the_freeze_folds_the_kept_entries_so_the_function_moves_less(block_size, n_in, n_out):
    """From the random start (every row half on its permutation entry) the frozen layer stays
    closer to the search layer at a hard gate than a hardening that drops the kept entries'
    weight (values as they were); linen and NNX freeze alike."""
    kwargs = dict(sparsity=0.5, block_size=block_size, permutation="learned", impl="jax")
    layer = DiagonalDense(n_out, **kwargs)
    x = jax.random.normal(jax.random.key(1), (64, n_in))
    v = layer.init(jax.random.key(0), x)
    v = {
        **v,
        "params": {
            **v["params"],
            "alpha": jax.random.normal(jax.random.key(2), (v["params"]["alpha"].shape)),
        },
    }
    search = layer.apply(dd.nn.set_gate(v, strength=0.0), x)
    frozen_layer, fv = dd.freeze(layer, v)
    folded = frozen_layer.apply(fv, x)
    m = P.doubly_stochastic(v["params"]["perm_soft"])
    kept = np.take_along_axis(np.asarray(m), np.asarray(fv["diagonals"]["perm"])[:, None], 1)
    assert 0.3 < kept.mean() < 0.9  # a soft matrix, not yet a permutation
    offsets = fv["diagonals"]["offsets"]
    unfolded_values = jnp.take(v["params"]["values"], offsets, axis=0)
    unfolded = frozen_layer.apply({**fv, "params": {**fv["params"], "values": unfolded_values}}, x)
    err = lambda y: float(jnp.linalg.norm(y - search) / jnp.linalg.norm(search))  # noqa: E731
    assert err(folded) < 0.5 * err(unfolded), (err(folded), err(unfolded))
    # where the kept entries are 1 (an exact permutation) the fold changes nothing
    exact = {
        **v,
        "params": {**v["params"], "perm_soft": jax.nn.one_hot(fv["diagonals"]["perm"], n_in)},
    }
    _, fe = dd.freeze(layer, exact)
    np.testing.assert_allclose(fe["params"]["values"], unfolded_values, rtol=1e-6)
    # NNX: the same values from the same parameters
    nl = dd.nnx.DiagonalDense(n_in, n_out, rngs=nnx.Rngs(0), **kwargs)
    for name in ("alpha", "values", "perm_soft"):
        getattr(nl, name).set_value(v["params"][name])
    nf = dd.nnx.freeze(nl)
    np.testing.assert_array_equal(nf.perm.get_value(), fv["diagonals"]["perm"])
    np.testing.assert_allclose(nf.values.get_value(), fv["params"]["values"], rtol=1e-6)


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
    assert paths["first"].permutation_relaxation == "sinkhorn"
    assert paths["second"].permutation_relaxation is None
    lines = describe_paths(list(paths.values()))
    assert "learned input permutation" in lines[0] and "random input permutation" in lines[1]
    assert "relaxation" not in " ".join(lines)
    blocks = blocks_layer(16)
    (path,) = model_paths(blocks, jax.random.key(0), x, platform="cpu")
    assert path.permutation_relaxation == "blocks"
    assert "learned input permutation (blocks relaxation)" in describe_paths([path])[0]


# --- the learned relaxation ---------------------------------------------------------------------


def optimal_weight(m, perm):
    return float(np.sum(np.asarray(m, np.float64)[np.arange(len(perm)), np.asarray(perm)]))


def near_permutation(rng, n, noise):
    """A doubly stochastic matrix ``(1 - noise) P + noise * (uniform doubly stochastic)``."""
    target = rng.permutation(n)
    soft = noise * rng.uniform(size=(n, n)) / n * 2
    soft[np.arange(n), target] += 1.0
    return np.asarray(P.doubly_stochastic(jnp.asarray(soft, jnp.float32), iters=20)), target


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_hard_permutation_is_a_bijection_and_the_assignment_solver_s_near_a_permutation(n, rng):
    m, target = near_permutation(rng, n, noise=0.6)
    assert np.all(m.max(axis=1) > 0.5)  # each row's argmax is its own column
    perm = np.asarray(jax.jit(P.hard_permutation)(m))
    rows, cols = scipy.optimize.linear_sum_assignment(m, maximize=True)
    np.testing.assert_array_equal(perm[rows], cols)
    np.testing.assert_array_equal(perm, target)
    # far from a permutation it is still a bijection (on uniform noise, within half the optimum)
    for m in (rng.uniform(size=(n, n)), np.zeros((n, n)), np.full((n, n), np.nan)):
        perm = np.asarray(P.hard_permutation(jnp.asarray(m, jnp.float32)))
        assert perm.dtype == np.int32 and sorted(perm.tolist()) == list(range(n))
        if not np.isnan(m).any():
            rows, cols = scipy.optimize.linear_sum_assignment(m, maximize=True)
            assert optimal_weight(m, perm) >= 0.5 * optimal_weight(m, cols) - 1e-9


def test_hard_permutation_of_stacked_matrices(rng):
    ms, targets = zip(*(near_permutation(rng, 9, 0.3) for _ in range(6)), strict=True)
    perms = P.hard_permutation(jnp.asarray(np.stack(ms)).reshape(2, 3, 9, 9))
    np.testing.assert_array_equal(perms.reshape(6, 9), np.stack(targets))


def test_doubly_stochastic_and_the_l1_l2_penalty(rng):
    soft = jnp.asarray(rng.normal(size=(2, 16, 16)), jnp.float32)
    m = np.asarray(P.doubly_stochastic(soft), np.float64)
    assert np.all(m >= 0)
    np.testing.assert_allclose(m.sum(-2), 1.0, rtol=1e-5)  # columns: the last normalisation
    np.testing.assert_allclose(m.sum(-1), 1.0, rtol=0.1)
    want = sum(np.abs(a).sum(axis) - np.sqrt((a * a).sum(axis)) for a in m for axis in (0, 1)).sum()
    np.testing.assert_allclose(P.l1_l2_penalty(jnp.asarray(m, jnp.float32)), want, rtol=1e-5)
    identity = np.eye(16)[rng.permutation(16)]
    assert float(P.l1_l2_penalty(jnp.asarray(identity, jnp.float32))) == 0.0
    assert float(P.l1_l2_penalty(jnp.asarray(0.9 * identity + 0.1 / 16, jnp.float32))) > 0.1
    with jax.enable_x64(True):  # float64 in, float64 out (it was float32 whatever the input)
        got = P.l1_l2_penalty(jnp.asarray(m))
        assert got.dtype == jnp.float64 and float(got) == pytest.approx(want, rel=1e-12)


def test_the_blocks_straight_through_gradient_keeps_float64():
    """The soft-product surrogate dm = sum_rows dy_g^T x_g in x's precision (float32 at least)."""
    with jax.enable_x64(True):
        rng = np.random.default_rng(0)
        x, dy = (jnp.asarray(rng.normal(size=(5, 8))) for _ in range(2))
        m = jnp.asarray(rng.uniform(size=(2, 4, 4)))
        _, pull = jax.vjp(P.block_permute, x, m)
        _, dm = pull(dy)
        want = np.einsum(
            "rgi,rgj->gij", np.asarray(dy).reshape(5, 2, 4), np.asarray(x).reshape(5, 2, 4)
        )
        assert dm.dtype == jnp.float64
        np.testing.assert_allclose(dm, want, rtol=1e-13)


def reference_soft_matrix(soft, iters=P.SINKHORN_ITERS):
    """Sinkhorn written with explicit row and column sums as products with a vector of ones."""
    m = jnp.abs(soft) + 1e-12
    ones = jnp.ones((soft.shape[0],), soft.dtype)
    for _ in range(iters):
        m = m / (m @ ones)[:, None]
        m = m / (ones @ m)[None, :]
    return m


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("block_size", "n_in", "n_out"), [(1, 24, 40), (1, 40, 24), (8, 32, 16)])
def test_soft_phase_forward_and_gradients_against_a_dense_reference(dtype, block_size, n_in, n_out):
    """At strength 0 the gate is the hard top-K: the layer is ``(x @ M.T) @ W.T + bias`` with a
    dense ``W`` of the top-K diagonals, plus 0.01 times the penalty of ``M``."""
    kwargs = dict(sparsity=0.5, block_size=block_size, impl="jax", dtype=dtype)
    layer = DiagonalDense(n_out, permutation="learned", permutation_penalty=0.01, **kwargs)
    x = jax.random.normal(jax.random.key(1), (6, n_in), jnp.float32).astype(dtype)
    v = layer.init(jax.random.key(0), x)
    alpha = jax.random.normal(jax.random.key(2), v["params"]["alpha"].shape)  # distinct scores
    v = {**v, "params": {**v["params"], "alpha": alpha}}
    k = layer.budget(n_in)
    offsets = dd.select_diagonals(v["params"]["alpha"], k)

    def ours(params, x):
        y, aux = layer.apply(
            {**v, "params": params}, x, strength=0.0, mutable=["losses", "intermediates"]
        )
        (penalty,) = aux["losses"]["permutation_penalty"]
        return loss(y) + penalty, (y, aux["intermediates"]["permutation_penalty"][0])

    def reference(params, x):
        m = reference_soft_matrix(params["perm_soft"])
        values = params["values"][offsets].astype(dtype)
        w = dd.diag_to_dense(values, offsets, in_features=n_in, out_features=n_out)
        y = (x @ m.T.astype(dtype)) @ w.T + params["bias"].astype(dtype)[None, :]
        a = jnp.abs(m)
        penalty = sum(jnp.sum(jnp.sum(a, axis) - jnp.sqrt(jnp.sum(m * m, axis))) for axis in (0, 1))
        return loss(y) + 0.01 * penalty, (y, penalty)

    grad = jax.value_and_grad(ours, argnums=(0, 1), has_aux=True)
    (_, (y, penalty)), (dparams, dx) = grad(v["params"], x)
    grad_ref = jax.value_and_grad(reference, argnums=(0, 1), has_aux=True)
    (_, (y_ref, penalty_ref)), (dparams_ref, dx_ref) = grad_ref(v["params"], x)
    tol = TOL[dtype]
    np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(y_ref, np.float32), **tol)
    np.testing.assert_allclose(penalty, penalty_ref, rtol=1e-5)
    pairs = [(dx, dx_ref)] + [(dparams[n], dparams_ref[n]) for n in ("perm_soft", "bias")]
    # the search gives every diagonal a value gradient; the kept ones are the dense W's
    pairs.append((dparams["values"][offsets], dparams_ref["values"][offsets]))
    for a, b in pairs:
        scale = max(float(np.max(np.abs(np.asarray(b, np.float32)))), 1e-6)
        np.testing.assert_allclose(
            np.asarray(a, np.float32) / scale, np.asarray(b, np.float32) / scale, **tol
        )


class Net(nn.Module):
    @nn.compact
    def __call__(self, x, train=False):
        del train
        x = DiagonalDense(16, sparsity=0.5, permutation="learned", impl="jax", name="hidden")(x)
        return nn.Dense(4)(nn.relu(x))


def test_the_training_step_adds_the_sown_penalty_to_the_loss():
    from dynadiag_jax import training as T

    model, tx = Net(), optax.sgd(0.1)
    batch = {
        "image": jax.random.normal(jax.random.key(1), (8, 12)),
        "label": jnp.arange(8, dtype=jnp.int32) % 4,
    }
    state = T.create_train_state(model, tx, batch["image"], seed=0)
    gate = T.GateSchedule("strength", lambda step: 0.5)
    step = jax.jit(T.make_train_step(model, tx, T.Classification(4), gate=gate))
    after, metrics = step(state, batch)
    assert "losses" not in after.collections  # sown per step, not state
    m = P.doubly_stochastic(state.params["hidden"]["perm_soft"])
    penalty = P.l1_l2_penalty(m)
    np.testing.assert_allclose(metrics["aux_loss"], np.float32(P.DEFAULT_PENALTY) * penalty, 1e-5)
    np.testing.assert_allclose(metrics["permutation_penalty/hidden"], penalty, rtol=1e-6)

    def task_loss(params):
        variables = {"params": params, **state.collections}
        logits = model.apply(dd.nn.set_gate(variables, strength=0.5), batch["image"])
        return T.Classification(4).loss(logits, jax.nn.one_hot(batch["label"], 4), batch)[0]

    def penalty_of(soft):
        return np.float32(P.DEFAULT_PENALTY) * P.l1_l2_penalty(P.doubly_stochastic(soft))

    # SGD: the step moved perm_soft by the gradient of the task loss plus the penalty's
    want = jax.grad(task_loss)(state.params)["hidden"]["perm_soft"]
    want = want + jax.grad(penalty_of)(state.params["hidden"]["perm_soft"])
    moved = (state.params["hidden"]["perm_soft"] - after.params["hidden"]["perm_soft"]) / 0.1
    np.testing.assert_allclose(moved, want, rtol=1e-3, atol=1e-6)


def test_the_learned_permutation_starts_half_on_a_random_permutation_or_uniform():
    n = 32
    soft = np.asarray(P.init_soft(jax.random.key(0), (n, n)))
    perm = np.argmax(soft, axis=1)
    assert sorted(perm.tolist()) == list(range(n)) and perm.tolist() != list(range(n))
    ones = np.zeros((n, n), bool)
    ones[np.arange(n), perm] = True
    assert np.all((soft[ones] >= 0.5) & (soft[ones] <= 0.5 + 0.5 / n))
    assert np.all((soft[~ones] >= 0.25 / n) & (soft[~ones] <= 0.5 / n))
    # the hardening at the start keeps that permutation; another key draws another one
    np.testing.assert_array_equal(P.harden(soft), perm)
    other = np.argmax(np.asarray(P.init_soft(jax.random.key(1), (n, n))), axis=1)
    assert other.tolist() != perm.tolist()
    uniform = np.asarray(P.init_soft(jax.random.key(0), (n, n), start="uniform"))
    assert np.all((uniform >= 0.5 / n) & (uniform <= 1.0 / n))
    # the layers draw perm_soft with their permutation_start
    x = jnp.ones((2, n))
    for start in P.PERMUTATION_STARTS:
        layer = DiagonalDense(n, sparsity=0.5, permutation="learned", permutation_start=start)
        soft = layer.init(jax.random.key(0), x)["params"]["perm_soft"]
        assert (float(jnp.max(soft)) >= 0.5) == (start == "random")
        model = dd.nnx.DiagonalDense(
            n, n, sparsity=0.5, permutation="learned", permutation_start=start, rngs=nnx.Rngs(0)
        )
        assert (float(jnp.max(model.perm_soft[...])) >= 0.5) == (start == "random")
    for bad in ("identity", None):
        with pytest.raises(ValueError, match="permutation_start must be one of"):
            DiagonalDense(n, sparsity=0.5, permutation="learned", permutation_start=bad)
        with pytest.raises(ValueError, match="permutation_start must be one of"):
            dd.nnx.DiagonalDense(n, n, sparsity=0.5, permutation_start=bad, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("start", ["random", "uniform"])
def test_the_penalty_drives_the_soft_matrix_to_the_permutation_the_freeze_keeps(start):
    """Minimising the penalty alone from the init ends near a permutation matrix: the hardened
    perm is then what the soft product computes (the freeze keeps the function)."""
    n = 16
    soft = P.init_soft(jax.random.key(0), (n, n), start=start)
    tx = optax.adam(0.05)
    opt = tx.init(soft)

    def penalty(soft):
        return P.l1_l2_penalty(P.doubly_stochastic(soft))

    @jax.jit
    def step(soft, opt):
        g = jax.grad(penalty)(soft)
        with jax.numpy_dtype_promotion("standard"):  # optax's int32 count beside floats
            updates, opt = tx.update(g, opt)
        return optax.apply_updates(soft, updates), opt

    uniform = float(penalty(jnp.ones((n, n))))
    for _ in range(300):
        soft, opt = step(soft, opt)
    assert float(penalty(soft)) < 0.05 * uniform
    perm = P.harden(soft)
    assert sorted(np.asarray(perm).tolist()) == list(range(n))
    x = jax.random.normal(jax.random.key(1), (4, n))
    np.testing.assert_allclose(
        P.soft_permute(x, P.doubly_stochastic(soft)), x[:, perm], rtol=0.05, atol=0.05
    )


def test_nnx_training_with_the_penalty_then_freeze_and_continue():
    # from the uniform start, where the penalty has the most to fall
    model = dd.nnx.DiagonalDense(
        12, 20, sparsity=0.5, permutation="learned", permutation_start="uniform", rngs=nnx.Rngs(0)
    )
    x = jax.random.normal(jax.random.key(1), (8, 12))
    with jax.numpy_dtype_promotion("standard"):  # nnx.Optimizer hands optax an int32 count
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer):
            def loss(m):
                return jnp.mean(m(x) ** 2) + dd.nnx.permutation_penalty(m)

            optimizer.update(model, nnx.grad(loss)(model))

        start = float(dd.nnx.permutation_penalty(model))
        for _ in range(5):
            step(model, optimizer)
        assert float(dd.nnx.permutation_penalty(model)) < start
        frozen = dd.nnx.freeze(model)
        continued = dd.nnx.freeze_opt_state(optimizer, model, frozen)
        flat = traverse_util.flatten_dict(nnx.to_pure_dict(nnx.state(continued)))
        paths = {"/".join(map(str, p)) for p in flat}
        assert not any("perm_soft" in p or "alpha" in p for p in paths)
        step(frozen, continued)
    assert int(continued.step.get_value()) == 6
    assert sorted(np.asarray(frozen.perm.get_value()).tolist()) == list(range(12))


@pytest.mark.parametrize(
    ("n", "b"), [(784, 56), (256, 64), (160, 40), (640, 64), (16, 16), (97, 1), (128, 64)]
)
def test_the_blocks_relaxation_s_block_is_the_largest_divisor_up_to_64(n, b):
    assert P.soft_block_size(n) == b


def near_block_permutations(rng, g, b, lead=()):
    """``(m[*lead, g, b, b], targets[*lead, g, b])``: blocks near known permutations."""
    targets = np.stack([rng.permutation(b) for _ in range(int(np.prod(lead, dtype=int)) * g)])
    targets = targets.reshape((*lead, g, b))
    m = 0.05 * rng.uniform(size=(*lead, g, b, b))
    np.put_along_axis(m, targets[..., None], 1.0, axis=-1)
    return jnp.asarray(m, jnp.float32), targets


def test_block_assignment_is_each_block_s_argmax_and_always_a_bijection(rng):
    g, b = 3, 8
    m, targets = near_block_permutations(rng, g, b)
    want = (targets + np.arange(g)[:, None] * b).ravel()
    np.testing.assert_array_equal(P.block_assignment(m), want)
    np.testing.assert_array_equal(jax.jit(P.block_assignment)(m), want)
    stacked, targets = near_block_permutations(rng, g, b, lead=(2,))
    np.testing.assert_array_equal(
        P.block_assignment(stacked), (targets + np.arange(g)[:, None] * b).reshape(2, g * b)
    )
    # every row's largest entry in column 0: the argmax is no bijection, the greedy one is
    clash = rng.uniform(size=(g, b, b))
    clash[..., 0] += 1.0
    for m in (clash, np.full((g, b, b), np.nan)):
        h = np.asarray(jax.jit(P.block_assignment)(jnp.asarray(m, jnp.float32))).reshape(g, b)
        for i in range(g):
            assert sorted((h[i] - i * b).tolist()) == list(range(b))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_block_permute_is_the_hard_gather_with_a_straight_through_gradient(dtype, rng):
    g, b = 3, 8
    n = g * b
    m = P.doubly_stochastic(near_block_permutations(rng, g, b)[0])
    x = jax.random.normal(jax.random.key(1), (2, 5, n), dtype)
    c = jax.random.normal(jax.random.key(2), (2, 5, n), jnp.float32)  # dy of a linear loss
    h = P.block_assignment(m)
    np.testing.assert_array_equal(P.block_permute(x, m), x[..., h])

    def loss(x, m):
        return jnp.sum(c * P.block_permute(x, m).astype(jnp.float32))

    def soft(m):  # the product the gradient of m is taken through: x_g @ m_g.T per block
        xb = x.astype(jnp.float32).reshape(2, 5, g, b)
        return jnp.sum(c * jnp.einsum("...gj,gij->...gi", xb, m).reshape(2, 5, n))

    dx, dm = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, m)
    assert dx.dtype == dtype and dm.dtype == m.dtype
    gather = jax.grad(lambda x: jnp.sum(c * x[..., h].astype(jnp.float32)))(x)
    np.testing.assert_array_equal(dx, gather)
    np.testing.assert_allclose(dm, jax.grad(soft)(m), **TOL[dtype])


def blocks_layer(n_out, **kwargs):
    kw = dict(sparsity=0.5, permutation="learned", permutation_relaxation="blocks", impl="jax")
    return DiagonalDense(n_out, **{**kw, **kwargs})


@pytest.mark.parametrize(("block_size", "n_in", "n_out"), [(1, 24, 40), (8, 32, 16)])
def test_the_blocks_relaxation_is_a_random_permutation_followed_by_block_ones(
    block_size, n_in, n_out, rng
):
    """The search layer is the "random" layer on ``perm[block_assignment(M)]``, which the freeze
    keeps (no fold: the forward was hard), so the frozen layer is the search layer at a hard
    gate; NNX computes and freezes the same."""
    layer = blocks_layer(n_out, block_size=block_size)
    x = jax.random.normal(jax.random.key(1), (6, n_in))
    v = layer.init(jax.random.key(0), x)
    bsz = P.soft_block_size(n_in)
    assert v["params"]["perm_soft"].shape == (n_in // bsz, bsz, bsz)
    base = v["diagonals"]["perm"]
    assert sorted(np.asarray(base).tolist()) == list(range(n_in))
    random = layer.clone(permutation="random")
    np.testing.assert_array_equal(
        P.block_assignment(P.doubly_stochastic(v["params"]["perm_soft"])), np.arange(n_in)
    )  # the start: each block's identity
    np.testing.assert_allclose(layer.apply(v, x), random.apply(without_soft(v), x), rtol=1e-6)
    soft, targets = near_block_permutations(rng, n_in // bsz, bsz)
    alpha = jax.random.normal(jax.random.key(2), v["params"]["alpha"].shape)
    v = {**v, "params": {**v["params"], "perm_soft": soft, "alpha": alpha}}
    moved = np.asarray(base)[(targets + np.arange(n_in // bsz)[:, None] * bsz).ravel()]
    as_random = without_soft(v)
    as_random["diagonals"]["perm"] = jnp.asarray(moved)
    np.testing.assert_allclose(layer.apply(v, x), random.apply(as_random, x), rtol=1e-6)
    frozen_layer, fv = dd.freeze(layer, v)
    np.testing.assert_array_equal(fv["diagonals"]["perm"], moved)
    kept = jnp.take(v["params"]["values"], fv["diagonals"]["offsets"], axis=0)
    np.testing.assert_array_equal(fv["params"]["values"], kept)
    hard = layer.apply(dd.nn.set_gate(v, strength=0.0), x)
    np.testing.assert_allclose(frozen_layer.apply(fv, x), hard, rtol=1e-5, atol=1e-6)
    kwargs = dict(sparsity=0.5, block_size=block_size, permutation="learned", impl="jax")
    nl = dd.nnx.DiagonalDense(
        n_in, n_out, permutation_relaxation="blocks", rngs=nnx.Rngs(0), **kwargs
    )
    assert nl.perm_soft.get_value().shape == soft.shape
    for name in ("alpha", "values", "perm_soft", "bias"):
        getattr(nl, name).set_value(v["params"][name])
    nl.perm.set_value(base)
    nl.strength.set_value(v["dynadiag"]["strength"])
    np.testing.assert_allclose(nl(x), layer.apply(v, x), rtol=1e-5, atol=1e-6)
    nf = dd.nnx.freeze(nl)
    assert not hasattr(nf, "perm_soft")
    np.testing.assert_array_equal(nf.perm.get_value(), moved)
    np.testing.assert_allclose(nf(x), frozen_layer.apply(fv, x), rtol=1e-5, atol=1e-6)


def without_soft(variables):
    out = {c: dict(v) for c, v in variables.items()}
    out["params"].pop("perm_soft")
    return out


def test_the_blocks_relaxation_trains_its_soft_blocks_and_checks_its_arguments():
    layer = blocks_layer(8)
    x = jax.random.normal(jax.random.key(1), (4, 16))
    v = layer.init(jax.random.key(0), x)

    def loss_of(params):
        y, sown = layer.apply({**v, "params": params}, x, mutable=["losses", "intermediates"])
        return loss(y) + sum(jax.tree.leaves(sown["losses"]))

    grads = jax.grad(loss_of)(v["params"])
    assert float(jnp.linalg.norm(grads["perm_soft"])) > 0
    with pytest.raises(ValueError, match="permutation_relaxation must be one of"):
        blocks_layer(8, permutation_relaxation="sinkhorn_blocks")
    with pytest.raises(ValueError, match="permutation_relaxation must be one of"):
        dd.nnx.DiagonalDense(8, 8, sparsity=0.5, permutation_relaxation=None, rngs=nnx.Rngs(0))
    sinkhorn = layer.clone(permutation_relaxation="sinkhorn")
    with pytest.raises(
        ValueError, match=r"perm_soft must have shape \[16, 16\].*got \(1, 16, 16\)"
    ):
        sinkhorn.apply(v, x)
    with pytest.raises(ValueError, match=r"perm_soft must have shape \[1, 16, 16\]"):
        layer.apply(sinkhorn.init(jax.random.key(0), x), x)
