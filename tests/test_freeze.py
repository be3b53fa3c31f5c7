"""freeze / freeze_tree / freeze_opt_state, and Orbax round trips of both phases."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dynadiag_jax as dd
from dynadiag_jax.nn import DiagonalDense, set_gate

F32_TOL = 1e-5


class Model(nn.Module):
    """Two diagonal layers (one inside a submodule) around a dense head."""

    @nn.compact
    def __call__(self, x):
        x = DiagonalDense(24, sparsity=0.75, explore="none", impl="jax", name="first")(x)
        x = Block()(nn.relu(x))
        return nn.Dense(3)(x)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return DiagonalDense(10, k=4, gate="softmax", explore="none", impl="jax", name="inner")(x)


def random_alpha(variables, seed=0):
    """Give every alpha distinct random values (a trained-looking selection)."""
    rng = np.random.default_rng(seed)

    def visit(tree):
        if isinstance(tree, dict):
            return {
                k: (
                    jnp.asarray(rng.normal(size=v.shape), jnp.float32) if k == "alpha" else visit(v)
                )
                for k, v in tree.items()
            }
        return tree

    return dict(variables, params=visit(variables["params"]))


def test_freeze_single_layer_is_the_hard_topk_product():
    layer = DiagonalDense(20, sparsity=0.8, explore="none", impl="jax")
    x = jax.random.normal(jax.random.key(1), (6, 12))
    v = random_alpha(layer.init(jax.random.key(0), x))
    k = layer.budget(12)
    frozen_layer, fv = dd.freeze(layer, v)
    assert frozen_layer.init_phase == "frozen"
    want = np.sort(np.argsort(-np.asarray(v["params"]["alpha"]))[:k])
    np.testing.assert_array_equal(fv["diagonals"]["offsets"], want)
    assert fv["diagonals"]["offsets"].dtype == jnp.int32
    assert set(fv) == {"params", "diagonals"} and set(fv["params"]) == {"values", "bias"}
    np.testing.assert_array_equal(fv["params"]["values"], v["params"]["values"][want])
    n_params = sum(leaf.size for leaf in jax.tree.leaves(fv["params"]))
    assert n_params == k * 12 + 20
    w = dd.diag_to_dense(v["params"]["values"][want], want, in_features=12, out_features=20)
    expected = x @ w.T + v["params"]["bias"][None, :]
    for module in (frozen_layer, layer):  # the phase is read from the variables
        np.testing.assert_allclose(
            np.asarray(module.apply(fv, x)), np.asarray(expected), atol=F32_TOL
        )
    # With a tiny strength the search gate is already the hard top-K: freezing changes nothing.
    np.testing.assert_allclose(
        np.asarray(layer.apply(v, x, strength=1e-6)), np.asarray(expected), atol=F32_TOL
    )
    assert dd.freeze(layer, fv)[1] is fv  # already frozen


def test_freeze_template_has_frozen_shapes():
    layer = DiagonalDense(20, sparsity=0.8, explore="none")
    x = jnp.ones((1, 12))
    frozen_layer, fv = dd.freeze(layer, layer.init(jax.random.key(0), x))
    template = frozen_layer.init(jax.random.key(1), x)
    assert jax.tree.map(jnp.shape, template) == jax.tree.map(jnp.shape, fv)


def test_freeze_tree_whole_model_under_jit():
    model = Model()
    x = jax.random.normal(jax.random.key(1), (5, 16))
    v = random_alpha(model.init(jax.random.key(0), x))
    fv = jax.jit(dd.freeze_tree)(v)
    assert "dynadiag" not in fv
    assert jax.tree.map(jnp.shape, fv["diagonals"]) == {
        "first": {"offsets": (dd.num_diagonals(16, 24, 0.75),)},
        "Block_0": {"inner": {"offsets": (4,)}},
    }
    assert set(fv["params"]["Block_0"]["inner"]) == {"values", "bias"}
    np.testing.assert_array_equal(
        fv["params"]["Dense_0"]["kernel"], v["params"]["Dense_0"]["kernel"]
    )
    # Frozen model == search model whose gates are the hard top-K (computed densely here).
    for path in (("first",), ("Block_0", "inner")):
        p = v["params"]
        f = fv["params"]
        for key in path:
            p, f = p[key], f[key]
        offsets = fv["diagonals"]
        for key in path:
            offsets = offsets[key]
        offsets = offsets["offsets"]
        np.testing.assert_array_equal(f["values"], p["values"][offsets])
        np.testing.assert_array_equal(offsets, dd.select_diagonals(p["alpha"], len(offsets)))
    assert model.apply(fv, x).shape == (5, 3)
    # Idempotent, and set_gate on a frozen model is a no-op.
    again = dd.freeze_tree(fv)
    assert jax.tree.map(jnp.shape, again) == jax.tree.map(jnp.shape, fv)
    assert set_gate(fv, strength=0.1) is fv


def test_freeze_tree_stacked_layers():
    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scanned = nn.scan(
                lambda mdl, c, _: (mdl(c), None),
                variable_axes={"params": 0, "dynadiag": 0, "diagonals": 0},
                split_rngs={"params": True},
                length=3,
            )
            layer = DiagonalDense(8, k=2, explore="none", impl="jax", use_bias=False)
            x, _ = scanned(layer, x, None)
            return x

    model = Stack()
    x = jax.random.normal(jax.random.key(1), (4, 8))
    v = set_gate(random_alpha(model.init(jax.random.key(0), x)), strength=0.5)
    alpha = v["params"]["DiagonalDense_0"]["alpha"]
    assert alpha.shape == (3, 8) and v["dynadiag"]["DiagonalDense_0"]["strength"].shape == (3,)
    fv = dd.freeze_tree(v)
    offsets = fv["diagonals"]["DiagonalDense_0"]["offsets"]
    assert offsets.shape == (3, 2)
    for i in range(3):
        np.testing.assert_array_equal(offsets[i], dd.select_diagonals(alpha[i], 2))
    assert model.apply(fv, x).shape == (4, 8)


def test_freeze_tree_needs_k():
    model = Model()
    v = model.init(jax.random.key(0), jnp.ones((1, 16)))
    bare = {"params": v["params"]}
    with pytest.raises(ValueError, match="cannot tell K"):
        dd.freeze_tree(bare)
    fv = dd.freeze_tree(bare, budgets={("first",): 5, ("Block_0", "inner"): 4})
    assert fv["diagonals"]["first"]["offsets"].shape == (5,)


def test_freeze_opt_state():
    model = Model()
    x = jax.random.normal(jax.random.key(1), (5, 16))
    v = model.init(jax.random.key(0), x)
    tx = dd.optim.diag_optimizer(1e-2, alpha_learning_rate=1e-1, weight_decay=0.1)

    @jax.jit
    def step(v, state):
        grads = jax.grad(lambda p: jnp.mean(model.apply(dict(v, params=p), x) ** 2))(v["params"])
        updates, state = tx.update(grads, state, v["params"])
        return dict(v, params=optax.apply_updates(v["params"], updates)), state, updates

    with jax.numpy_dtype_promotion("standard"):  # optax's Adam bias correction mixes dtypes
        state = tx.init(v["params"])
        for _ in range(3):
            v, state, _ = step(v, state)
        fv = dd.freeze_tree(v)
        fstate = jax.jit(dd.freeze_opt_state)(state, v["params"], fv["params"])
        assert jax.tree.structure(fstate) == jax.tree.structure(tx.init(fv["params"]))
        adam = fstate.inner_states["weights"].inner_state[0]
        old = state.inner_states["weights"].inner_state[0]
        offsets = fv["diagonals"]["first"]["offsets"]
        for moment, old_moment in ((adam.mu, old.mu), (adam.nu, old.nu)):
            np.testing.assert_array_equal(
                moment["first"]["values"], old_moment["first"]["values"][offsets]
            )
            np.testing.assert_array_equal(moment["first"]["bias"], old_moment["first"]["bias"])
        assert int(adam.count) == 3
        # No arrays left for alpha anywhere.
        alpha_state = fstate.inner_states["alpha"]
        assert not [leaf for leaf in jax.tree.leaves(alpha_state) if np.ndim(leaf) > 0]
        _, _, updates = step(fv, fstate)
        assert jax.tree.structure(updates) == jax.tree.structure(fv["params"])


def test_orbax_round_trip_both_phases(tmp_path):
    import orbax.checkpoint as ocp

    model = Model()
    x = jax.random.normal(jax.random.key(1), (5, 16))
    v = set_gate(random_alpha(model.init(jax.random.key(0), x)), strength=0.3, temperature=0.7)
    fv = dd.freeze_tree(v)
    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "search", v)
    ckpt.save(tmp_path / "frozen", fv)
    ckpt.wait_until_finished()

    template = model.init(jax.random.key(7), x)
    restored = ckpt.restore(tmp_path / "search", template)
    np.testing.assert_array_equal(
        np.asarray(model.apply(restored, x)), np.asarray(model.apply(v, x))
    )
    assert float(restored["dynadiag"]["first"]["strength"]) == pytest.approx(0.3)

    frozen_template = dd.freeze_tree(model.init(jax.random.key(8), x))
    restored = ckpt.restore(tmp_path / "frozen", frozen_template)
    np.testing.assert_array_equal(
        np.asarray(model.apply(restored, x)), np.asarray(model.apply(fv, x))
    )
    assert restored["diagonals"]["first"]["offsets"].dtype == jnp.int32


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1)),
        lambda: optax.sgd(0.1, momentum=0.9),
    ],
)
def test_freeze_opt_state_plain_optax(make_tx):
    layer = DiagonalDense(12, k=3, explore="none", impl="jax")
    v = random_alpha(layer.init(jax.random.key(0), jnp.ones((1, 12))))
    tx = make_tx()
    fv = dd.freeze_tree(v)
    with jax.numpy_dtype_promotion("standard"):
        state = tx.init(v["params"])
        fstate = dd.freeze_opt_state(state, v["params"], fv["params"])
        assert jax.tree.structure(fstate) == jax.tree.structure(tx.init(fv["params"]))
        tx.update(fv["params"], fstate, fv["params"])
