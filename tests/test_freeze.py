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
    assert int(fv["diagonals"]["in_features"]) == 12
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


def test_freeze_refuses_a_layer_that_did_not_make_the_variables():
    """dd.freeze froze the budget of the layer it was given (6 of 8 diagonals for variables made
    with K = 4), which applying that layer to them refuses."""
    x = jnp.ones((2, 8))
    v = DiagonalDense(4, sparsity=0.5).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match=r"freeze: dynadiag/topk holds K = 4 .* budget is K = 6"):
        dd.freeze(DiagonalDense(4, sparsity=0.25), v)
    with pytest.raises(ValueError, match=r"bias \[4\]\) were not made by this layer \(features=8"):
        dd.freeze(DiagonalDense(8, sparsity=0.5), v)
    assert dd.freeze(DiagonalDense(4, k=4), v)[1]["params"]["values"].shape == (4, 4)


def test_freeze_tree_whole_model_under_jit():
    model = Model()
    x = jax.random.normal(jax.random.key(1), (5, 16))
    v = random_alpha(model.init(jax.random.key(0), x))
    fv = jax.jit(dd.freeze_tree)(v)
    assert "dynadiag" not in fv
    assert jax.tree.map(jnp.shape, fv["diagonals"]) == {
        "first": {"offsets": (dd.num_diagonals(16, 24, 0.75),), "in_features": ()},
        "Block_0": {"inner": {"offsets": (4,), "in_features": ()}},
    }
    assert int(fv["diagonals"]["Block_0"]["inner"]["in_features"]) == 24
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
    # Idempotent; a frozen model has no gate left to set.
    again = dd.freeze_tree(fv)
    assert jax.tree.map(jnp.shape, again) == jax.tree.map(jnp.shape, fv)
    with pytest.raises(ValueError, match="no 'dynadiag' collection"):
        set_gate(fv, strength=0.1)


@pytest.mark.parametrize("permutation", [None, "learned", "blocks"])
@pytest.mark.parametrize("width,k,block_size", [(8, 2, 1), (32, 2, 8)])
def test_freeze_tree_stacked_layers(width, k, block_size, permutation):
    relaxation = "blocks" if permutation == "blocks" else "sinkhorn"
    permutation = "learned" if permutation == "blocks" else permutation

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scanned = nn.scan(
                lambda mdl, c, _: (mdl(c), None),
                variable_axes={"params": 0, "dynadiag": 0, "diagonals": 0},
                split_rngs={"params": True},
                length=3,
            )
            layer = DiagonalDense(
                width,
                k=k,
                block_size=block_size,
                explore="none",
                impl="jax",
                use_bias=False,
                permutation=permutation,
                permutation_relaxation=relaxation,
            )
            x, _ = scanned(layer, x, None)
            return x

    model = Stack()
    x = jax.random.normal(jax.random.key(1), (4, width))
    v = set_gate(random_alpha(model.init(jax.random.key(0), x)), strength=0.5)
    if relaxation == "blocks":  # blocks away from their identity start
        layer_params = v["params"]["DiagonalDense_0"]
        soft = jax.random.uniform(jax.random.key(5), layer_params["perm_soft"].shape)
        v["params"]["DiagonalDense_0"] = {**layer_params, "perm_soft": soft}
    alpha = v["params"]["DiagonalDense_0"]["alpha"]
    p = width // block_size
    assert alpha.shape == (3, p) and v["dynadiag"]["DiagonalDense_0"]["strength"].shape == (3,)
    fv = dd.freeze_tree(v)
    offsets = fv["diagonals"]["DiagonalDense_0"]["offsets"]
    assert offsets.shape == (3, k)
    np.testing.assert_array_equal(fv["diagonals"]["DiagonalDense_0"]["in_features"], [width] * 3)
    values = v["params"]["DiagonalDense_0"]["values"]
    for i in range(3):
        np.testing.assert_array_equal(offsets[i], dd.select_diagonals(alpha[i], k))
        want = values[i][offsets[i]]
        if permutation:  # each slice hardened (and folded, from the soft matrix) on its own
            soft = v["params"]["DiagonalDense_0"]["perm_soft"][i]
            if relaxation == "blocks":
                base = v["diagonals"]["DiagonalDense_0"]["perm"][i]
                perm = dd.nn.permutation.harden_blocks(soft, base)
                assert not np.array_equal(perm, base)
            else:
                perm, want = dd.nn.permutation.harden_and_fold(soft, want, offsets[i], width)
            np.testing.assert_array_equal(fv["diagonals"]["DiagonalDense_0"]["perm"][i], perm)
        np.testing.assert_allclose(fv["params"]["DiagonalDense_0"]["values"][i], want, rtol=1e-6)
    assert model.apply(fv, x).shape == (4, width)


def test_freeze_tree_needs_k():
    model = Model()
    v = model.init(jax.random.key(0), jnp.ones((1, 16)))
    bare = {"params": v["params"]}
    with pytest.raises(ValueError, match="cannot tell K"):
        dd.freeze_tree(bare)
    fv = dd.freeze_tree(bare, budgets={("first",): 5, ("Block_0", "inner"): 4})
    assert fv["diagonals"]["first"]["offsets"].shape == (5,)
    # Without the "diagonals" collection the width follows from the bias.
    assert int(fv["diagonals"]["Block_0"]["inner"]["in_features"]) == 24
    # ... which a rectangular layer without bias does not fix.
    layer = DiagonalDense(24, sparsity=0.7, use_bias=False, impl="jax")
    params = layer.init(jax.random.key(0), jnp.ones((1, 16)))["params"]
    with pytest.raises(ValueError, match="cannot tell the input width"):
        dd.freeze_tree({"params": params}, budgets={(): layer.budget(16)})


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
    assert int(restored["diagonals"]["first"]["in_features"]) == 16
    with pytest.raises(ValueError, match="x has width 15, the layer expects 16"):
        model.apply(restored, x[:, :15])


@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1)),
        lambda: optax.sgd(0.1, momentum=0.9),
        lambda: dd.optim.diag_optimizer(1e-3, alpha_learning_rate=1e-2, values_lr_scale=3.0),
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


def test_freeze_opt_state_refuses_factored_statistics_and_makes_abstract_templates():
    layer = DiagonalDense(64, k=8, explore="none", impl="jax")
    v = random_alpha(layer.init(jax.random.key(0), jnp.ones((1, 64))))
    fv = dd.freeze_tree(v)
    # adafactor keeps factored row and column statistics of values[64, 64]: cutting only what is
    # shaped like the values left them for 64 rows (the next update failed), or, where it does
    # not factor, a (1,) placeholder where the frozen state has the values' shape
    for tx in (optax.adafactor(1e-3, min_dim_size_to_factor=32), optax.adafactor(1e-3)):
        with pytest.raises(ValueError, match=r"statistic of shape \[.*tx.init\(params_after\)"):
            dd.freeze_opt_state(tx.init(v["params"]), v["params"], fv["params"])
    # abstract arguments (a restore template) give the abstract result of the concrete ones
    tx = optax.adamw(1e-3)
    state = tx.init(v["params"])
    concrete = dd.freeze_opt_state(state, v["params"], fv["params"])
    abstract = jax.eval_shape(lambda: (state, v["params"], fv["params"]))
    template = dd.freeze_opt_state(*abstract)
    assert jax.tree.structure(template) == jax.tree.structure(concrete)
    assert jax.tree.map(lambda a: (a.shape, a.dtype), template) == jax.tree.map(
        lambda a: (a.shape, a.dtype), concrete
    )


def test_freeze_refuses_non_finite_alpha():
    model = Model()
    x = jax.random.normal(jax.random.key(1), (5, 16))
    v = random_alpha(model.init(jax.random.key(0), x))
    inner = v["params"]["Block_0"]["inner"]
    bad = dict(
        v,
        params=dict(
            v["params"], Block_0={"inner": dict(inner, alpha=inner["alpha"].at[3].set(jnp.nan))}
        ),
    )
    with pytest.raises(
        ValueError,
        match="alpha of the DiagonalDense at params path Block_0/inner holds 1 non-finite",
    ):
        dd.freeze_tree(bad)
    # Inside jit alpha cannot be read (a host callback once failed with "INTERNAL:
    # CpuCallback error"): that layer's frozen values are NaN, so the model's outputs are.
    frozen = jax.jit(dd.freeze_tree)(bad)
    assert np.all(np.isnan(frozen["params"]["Block_0"]["inner"]["values"]))
    assert np.all(np.isfinite(frozen["params"]["first"]["values"]))
    assert np.all(np.isnan(model.apply(frozen, x)))
    assert np.all(np.isfinite(model.apply(jax.jit(dd.freeze_tree)(v), x)))
    layer = DiagonalDense(8, k=2, impl="jax")
    lv = layer.init(jax.random.key(0), jnp.ones((1, 8)))
    lv = dict(lv, params=dict(lv["params"], alpha=jnp.full((8,), jnp.inf)))
    with pytest.raises(ValueError, match=r"path \(root\) holds 8 non-finite"):
        dd.freeze(layer, lv)
    # The selection itself is defined: NaN scores rank last.
    np.testing.assert_array_equal(
        dd.select_diagonals(jnp.array([jnp.nan, 1.0, 0.0, 2.0]), 2), [1, 3]
    )


@pytest.mark.parametrize(
    "schedule",
    [
        lambda n: dd.schedules.cosine(1.0, 0.0, n),
        lambda n: dd.schedules.linear(1.0, 0.0, n),
        lambda n: optax.cosine_decay_schedule(1.0, n),
        lambda n: lambda i: 1.0 - 2.0 * i / n,  # overshoots to -1
    ],
    ids=["cosine", "linear", "optax_cosine", "negative"],
)
def test_gate_schedule_reaching_zero_inside_jit(schedule):
    """A strength schedule that reaches 0 used to turn the whole model NaN."""
    model = Model()
    steps = 8
    x = jax.random.normal(jax.random.key(1), (6, 16))
    y = jax.random.normal(jax.random.key(2), (6, 3))
    v = model.init(jax.random.key(0), x)
    strength, temperature = schedule(steps), schedule(steps)
    tx = dd.optim.diag_optimizer(1e-2, alpha_learning_rate=1e-1)

    def step(carry, i):
        params, opt_state, _ = carry
        gated = set_gate(dict(v, params=params), strength=strength(i), temperature=temperature(i))
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((model.apply(dict(gated, params=p), x) - y) ** 2)
        )(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, gated), loss

    with jax.numpy_dtype_promotion("standard"):
        carry = (v["params"], tx.init(v["params"]), v)
        (params, _, gated), losses = jax.jit(
            lambda c: jax.lax.scan(step, c, jnp.arange(steps + 3))
        )(carry)
    assert float(gated["dynadiag"]["first"]["strength"]) <= 0.0  # the schedule's end was reached
    assert np.all(np.isfinite(np.asarray(losses)))
    assert all(np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree.leaves(params))
    searched = dict(gated, params=params)
    fv = jax.jit(dd.freeze_tree)(searched)
    for path, k in ((("first",), dd.num_diagonals(16, 24, 0.75)), (("Block_0", "inner"), 4)):
        alpha, offsets = params, fv["diagonals"]
        for key in path:
            alpha, offsets = alpha[key], offsets[key]
        want = np.sort(np.argsort(-np.asarray(alpha["alpha"]))[:k])
        np.testing.assert_array_equal(offsets["offsets"], want)
    # At strength 0 the search gate of the sparse layer is the hard top-K: the frozen layer agrees.
    first = DiagonalDense(24, sparsity=0.75, explore="none", impl="jax")
    sub = {"params": params["first"], "dynadiag": gated["dynadiag"]["first"]}
    frozen_sub = {"params": fv["params"]["first"], "diagonals": fv["diagonals"]["first"]}
    np.testing.assert_allclose(
        np.asarray(first.apply(sub, x, strength=0.0)),
        np.asarray(first.apply(frozen_sub, x)),
        atol=F32_TOL,
    )


class BlockModel(nn.Module):
    """A tall sparse-gate block layer and a wide softmax-gate block layer without bias."""

    @nn.compact
    def __call__(self, x):
        x = DiagonalDense(48, sparsity=0.6, block_size=8, impl="jax", name="up")(x)
        return DiagonalDense(
            16, k=1, block_size=8, gate="softmax", use_bias=False, impl="jax", name="down"
        )(nn.relu(x))


def test_block_layers_freeze_tree_opt_state_and_orbax(tmp_path):
    import orbax.checkpoint as ocp

    model = BlockModel()
    x = jax.random.normal(jax.random.key(1), (5, 24))
    v = model.init(jax.random.key(0), x)
    tx = dd.optim.diag_optimizer(1e-2, alpha_learning_rate=1e-1, weight_decay=0.1)

    @jax.jit
    def step(v, state):
        grads = jax.grad(lambda p: jnp.mean(model.apply(dict(v, params=p), x) ** 2))(v["params"])
        updates, state = tx.update(grads, state, v["params"])
        return dict(v, params=optax.apply_updates(v["params"], updates)), state

    with jax.numpy_dtype_promotion("standard"):
        state = tx.init(v["params"])
        v = set_gate(random_alpha(v), strength=0.3, temperature=0.7)
        for _ in range(2):
            v, state = step(v, state)
        fv = jax.jit(dd.freeze_tree)(v)
        k_up = dd.num_diagonals(24, 48, 0.6, block_size=8)
        assert jax.tree.map(jnp.shape, fv["params"]) == {
            "up": {"values": (k_up, 6, 8, 8), "bias": (48,)},
            "down": {"values": (1, 6, 8, 8)},
        }
        for name, n_in in (("up", 24), ("down", 48)):
            offsets = fv["diagonals"][name]["offsets"]
            np.testing.assert_array_equal(
                offsets, dd.select_diagonals(v["params"][name]["alpha"], len(offsets))
            )
            np.testing.assert_array_equal(
                fv["params"][name]["values"], v["params"][name]["values"][offsets]
            )
            assert int(fv["diagonals"][name]["in_features"]) == n_in
        fstate = dd.freeze_opt_state(state, v["params"], fv["params"])
        assert jax.tree.structure(fstate) == jax.tree.structure(tx.init(fv["params"]))
        adam = fstate.inner_states["weights"].inner_state[0]
        old = state.inner_states["weights"].inner_state[0]
        offsets = fv["diagonals"]["up"]["offsets"]
        np.testing.assert_array_equal(adam.mu["up"]["values"], old.mu["up"]["values"][offsets])
        step(fv, fstate)  # the frozen model trains with the converted state

    ckpt = ocp.StandardCheckpointer()
    ckpt.save(tmp_path / "search", v)
    ckpt.save(tmp_path / "frozen", fv)
    ckpt.wait_until_finished()
    restored = ckpt.restore(tmp_path / "search", model.init(jax.random.key(7), x))
    np.testing.assert_array_equal(
        np.asarray(model.apply(restored, x)), np.asarray(model.apply(v, x))
    )
    restored = ckpt.restore(tmp_path / "frozen", dd.freeze_tree(model.init(jax.random.key(8), x)))
    np.testing.assert_array_equal(
        np.asarray(model.apply(restored, x)), np.asarray(model.apply(fv, x))
    )


class SearchVariants(nn.Module):
    """An element and a block layer with the same search options."""

    options: dict

    @nn.compact
    def __call__(self, x):
        x = DiagonalDense(32, sparsity=0.75, impl="jax", name="element", **self.options)(x)
        x = nn.relu(x)
        return DiagonalDense(16, k=1, block_size=8, impl="jax", name="block", **self.options)(x)


@pytest.mark.parametrize("options", [{"scale": "none"}, {"scale": "rms"}], ids=["none", "rms"])
def test_loss_is_continuous_across_the_freeze_at_hard_gates(options):
    """At strength 0 (the hard top-K gate) the search product is the frozen product: the loss
    right before and right after the freeze agree, whatever the search's scale."""
    model = SearchVariants(options)
    x = jax.random.normal(jax.random.key(1), (6, 16))
    target = jax.random.normal(jax.random.key(2), (6, 16))
    variables = random_alpha(model.init(jax.random.key(0), x))
    variables = set_gate(variables, strength=0.0)

    def loss(v):
        return jnp.mean((model.apply(v, x) - target) ** 2)

    frozen = dd.freeze_tree(variables)
    assert "alpha" not in frozen["params"]["element"]
    np.testing.assert_allclose(loss(frozen), loss(variables), rtol=F32_TOL)


def test_select_diagonals_checks_k_and_alpha():
    """k = -1 gave P - 1 offsets, k > P was clamped, k = 0 gave none; a float k, integer,
    scalar or list alpha gave errors that named neither argument."""
    alpha = jnp.linspace(0.0, 1.0, 32)
    for k in (-1, 0, 33):
        with pytest.raises(ValueError, match=r"k must be in \[1, P\] = \[1, 32\], got"):
            dd.select_diagonals(alpha, k)
    with pytest.raises(TypeError, match="k must be an int, got float"):
        dd.select_diagonals(alpha, 2.5)
    for bad, error in ((jnp.arange(32), TypeError), (jnp.float32(1.0), ValueError)):
        with pytest.raises(error, match=r"alpha must be a floating array \[\.\.\., P\]"):
            dd.select_diagonals(bad, 1)
    with pytest.raises(TypeError, match="alpha must be a floating array .*got list"):
        dd.select_diagonals([1.0, 2.0], 1)
    np.testing.assert_array_equal(dd.select_diagonals(alpha, 32), np.arange(32))


def test_freeze_tree_checks_budgets():
    """budgets={(): -1} froze 31 of 32 diagonals, 2.5 failed obscurely and a path that is no
    layer's was ignored."""
    model = Model()
    v = model.init(jax.random.key(0), jnp.ones((1, 16)))
    layer = DiagonalDense(32, k=4, impl="jax")
    lv = layer.init(jax.random.key(0), jnp.ones((1, 16)))
    for k in (-1, 0, 33):
        with pytest.raises(ValueError, match=r"budgets\[\(\)\] must be in \[1, P\] = \[1, 32\]"):
            dd.freeze_tree(lv, budgets={(): k})
    with pytest.raises(TypeError, match=r"budgets\[\(\)\] must be an int, got float"):
        dd.freeze_tree(lv, budgets={(): 2.5})
    with pytest.raises(TypeError, match="budgets must be a mapping"):
        dd.freeze_tree(lv, budgets=4)
    with pytest.raises(
        ValueError,
        match=r"budgets has the path \('Block_0',\).*layers are at: \('Block_0', 'inner'\), "
        r"\('first',\)",
    ):
        dd.freeze_tree(v, budgets={("Block_0",): 2})
    fv = dd.freeze_tree(v, budgets={("first",): 3})
    assert fv["diagonals"]["first"]["offsets"].shape == (3,)
    assert dd.freeze_tree(fv, budgets={("first",): 3})["params"].keys() == fv["params"].keys()


def test_freeze_opt_state_checks_its_params():
    """The whole variables, the two params swapped or ints came back unchanged (or with an
    AssertionError) and failed later in tx.update."""
    model = Model()
    v = random_alpha(model.init(jax.random.key(0), jnp.ones((1, 16))))
    fv = dd.freeze_tree(v)
    tx = optax.sgd(0.1, momentum=0.9)
    state = tx.init(v["params"])
    with pytest.raises(ValueError, match="params_after holds a 'params' collection"):
        dd.freeze_opt_state(state, v["params"], fv)
    with pytest.raises(ValueError, match="params_before holds a 'params' collection"):
        dd.freeze_opt_state(state, v, fv["params"])
    with pytest.raises(ValueError, match="params_after holds a search-phase.*swapped"):
        dd.freeze_opt_state(state, fv["params"], v["params"])
    with pytest.raises(TypeError, match="params_before must be a params tree.*got int"):
        dd.freeze_opt_state(state, 1, 2)
    other = dd.freeze_tree(Model().init(jax.random.key(0), jnp.ones((1, 12))))["params"]
    with pytest.raises(ValueError, match=r"params_after's first/values has shape \[\d+, 12\]"):
        dd.freeze_opt_state(state, v["params"], other)
    without_head = {key: value for key, value in fv["params"].items() if key != "Dense_0"}
    with pytest.raises(ValueError, match="params_after has no entry Dense_0/bias"):
        dd.freeze_opt_state(state, v["params"], without_head)
    first = {key: value for key, value in v["params"]["first"].items() if key != "alpha"}
    odd = tx.init(dict(v["params"], first=first))
    with pytest.raises(ValueError, match="opt_state holds a params tree without the alpha.*first"):
        dd.freeze_opt_state(odd, v["params"], fv["params"])
    converted = dd.freeze_opt_state(state, v["params"], fv["params"])
    again = dd.freeze_opt_state(converted, v["params"], fv["params"])  # already frozen: kept
    assert jax.tree.structure(again) == jax.tree.structure(tx.init(fv["params"]))


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"block_size": 8}, {"permutation": "learned"}, {"permutation": "random"}],
    ids=["element", "b8", "learned", "random"],
)
def test_abstract_variables_freeze_to_the_frozen_template(kwargs):
    """The template a frozen checkpoint restores into, from jax.eval_shape of init (it raised
    "ShapeDtypeStruct is not a valid JAX type"); freeze() gives it too."""
    layer = dd.nn.DiagonalDense(24, sparsity=0.75, **kwargs)
    x = jnp.ones((2, 16))
    abstract = jax.eval_shape(layer.init, jax.random.key(0), x)
    concrete = dd.freeze_tree(layer.init(jax.random.key(0), x))
    for template in (dd.freeze_tree(abstract), dd.freeze(layer, abstract)[1]):
        assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(template))
        assert jax.tree.map(lambda a: (a.shape, a.dtype), template) == jax.tree.map(
            lambda a: (a.shape, a.dtype), concrete
        )
