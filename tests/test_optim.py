"""Optimizer helpers: alpha's own learning rate, no weight decay on alpha, biases or scales."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dynadiag_jax as dd
from dynadiag_jax import optim
from dynadiag_jax import training as T

PARAMS = {
    "layer": {"alpha": jnp.ones(6), "values": jnp.ones((6, 4)), "bias": jnp.ones(6)},
    "norm": {"scale": jnp.ones(6), "bias": jnp.ones(6)},
    "head": {"kernel": jnp.ones((6, 2)), "bias": jnp.ones(2)},
    "other": {"alpha": jnp.ones(3)},  # not beside "values": an ordinary param
}


def test_masks_and_labels():
    assert optim.alpha_mask(PARAMS) == {
        "layer": {"alpha": True, "values": False, "bias": False},
        "norm": {"scale": False, "bias": False},
        "head": {"kernel": False, "bias": False},
        "other": {"alpha": False},
    }
    assert optim.weight_decay_mask(PARAMS) == {
        "layer": {"alpha": False, "values": True, "bias": False},
        "norm": {"scale": False, "bias": False},
        "head": {"kernel": True, "bias": False},
        "other": {"alpha": False},
    }
    labels = optim.param_labels(PARAMS)
    assert labels["layer"]["alpha"] == "alpha" and labels["other"]["alpha"] == "weights"


def test_separate_learning_rates_with_sgd():
    tx = optim.with_alpha_optimizer(optax.sgd(0.1), optax.sgd(2.0))
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS)
    np.testing.assert_allclose(updates["layer"]["alpha"], -2.0)
    np.testing.assert_allclose(updates["layer"]["values"], -0.1)
    np.testing.assert_allclose(updates["other"]["alpha"], -0.1)


def test_diag_optimizer_decay_only_on_weights():
    tx = optim.diag_optimizer(0.1, alpha_learning_rate=0.5, weight_decay=0.5)
    zeros = jax.tree.map(jnp.zeros_like, PARAMS)
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam bias correction mixes dtypes
        updates, _ = tx.update(zeros, tx.init(PARAMS), PARAMS)
    # Zero gradients: only decoupled weight decay moves a param, by -lr * wd * param.
    np.testing.assert_allclose(updates["layer"]["values"], -0.05, rtol=1e-6)
    np.testing.assert_allclose(updates["head"]["kernel"], -0.05, rtol=1e-6)
    for path in (("layer", "alpha"), ("layer", "bias"), ("norm", "scale"), ("head", "bias")):
        np.testing.assert_array_equal(updates[path[0]][path[1]], 0, err_msg=str(path))


def test_diag_optimizer_alpha_step_size():
    tx = optim.diag_optimizer(1e-3, alpha_learning_rate=0.25)
    grads = jax.tree.map(jnp.ones_like, PARAMS)
    with jax.numpy_dtype_promotion("standard"):
        updates, _ = tx.update(grads, tx.init(PARAMS), PARAMS)
    # Adam's first step is -lr * sign(g).
    np.testing.assert_allclose(updates["layer"]["alpha"], -0.25, rtol=1e-5)
    np.testing.assert_allclose(updates["layer"]["values"], -1e-3, rtol=1e-5)


def test_rejects_non_mapping_params():
    with pytest.raises(TypeError, match="nested mapping"):
        optim.alpha_mask([jnp.ones(3)])


def test_weight_decay_mask_takes_path_patterns():
    mask = optim.weight_decay_mask(PARAMS, no_decay=(r"head/.*",))
    assert mask["head"] == {"kernel": False, "bias": False}
    assert mask["layer"] == {"alpha": False, "values": True, "bias": False}
    stacked = {"layers": {0: {"kernel": jnp.ones((2, 2))}}}  # NNX keys a list's items by int
    assert optim.weight_decay_mask(stacked, no_decay=(r"layers/0/.*",)) == {
        "layers": {0: {"kernel": False}}
    }
    trained = optim.path_mask((r".*/bias",))(PARAMS)
    assert trained["norm"] == {"scale": False, "bias": True} and not trained["layer"]["values"]


def test_values_mask_and_init_gain():
    assert optim.values_mask(PARAMS)["layer"] == {"alpha": False, "values": True, "bias": False}
    assert not any(jax.tree.leaves(optim.values_mask({k: PARAMS[k] for k in ("norm", "head")})))
    assert optim.init_gain(0.9) == pytest.approx(10**0.5)
    assert optim.init_gain(0.75) == pytest.approx(2.0)
    assert optim.init_gain(0.0) == 1.0
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="sparsity must be in"):
            optim.init_gain(bad)


def test_diag_optimizer_values_lr_scale_scales_the_values_updates_only():
    grads = jax.tree.map(
        lambda p: jnp.cos(jnp.arange(p.size, dtype=p.dtype)).reshape(p.shape), PARAMS
    )

    def updates(**kwargs):
        tx = optim.diag_optimizer(1e-3, alpha_learning_rate=0.25, weight_decay=0.1, **kwargs)
        state = tx.init(PARAMS)
        with jax.numpy_dtype_promotion("standard"):
            for _ in range(2):  # the second step reads the state the first one wrote
                out, state = tx.update(grads, state, PARAMS)
        return out

    plain, scaled = updates(), updates(values_lr_scale=3.0)
    np.testing.assert_allclose(scaled["layer"]["values"], 3.0 * plain["layer"]["values"], rtol=1e-6)
    assert np.abs(np.asarray(plain["layer"]["values"])).min() > 0

    def drop_values(u):
        return dict(u, layer={k: v for k, v in u["layer"].items() if k != "values"})

    jax.tree.map(np.testing.assert_array_equal, drop_values(scaled), drop_values(plain))
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match="values_lr_scale must be > 0"):
            optim.diag_optimizer(1e-3, alpha_learning_rate=0.1, values_lr_scale=bad)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(values_lr_scale=float("nan")), ValueError, "values_lr_scale must be a finite"),
        (dict(values_lr_scale=float("inf")), ValueError, "values_lr_scale must be a finite"),
        (dict(values_lr_scale="2"), TypeError, "values_lr_scale must be a number"),
        (dict(weight_decay=float("nan")), ValueError, "weight_decay must be a finite"),
        (dict(weight_decay=-0.1), ValueError, "weight_decay must be >= 0"),
        # a NaN rate trained to NaN, "1e-3" failed at the first update, b1=2 was taken
        (dict(learning_rate=float("nan")), ValueError, "learning_rate .* must be a finite"),
        (dict(alpha_learning_rate=-1.0), ValueError, "alpha_learning_rate .* must be >= 0"),
        (dict(learning_rate="1e-3"), TypeError, "learning_rate .* must be a number"),
        (dict(b1=2.0), ValueError, r"b1 must be in \[0, 1\), got 2.0"),
        (dict(eps=-1.0), ValueError, "eps must be >= 0"),
    ],
)
def test_diag_optimizer_refuses_bad_constants_naming_them(kwargs, error, message):
    """NaN and inf scales and a NaN decay trained to NaN; "2" failed in numpy's indexing."""
    with pytest.raises(error, match=f"diag_optimizer: {message}"):
        optim.diag_optimizer(**{"learning_rate": 1e-3, "alpha_learning_rate": 0.1, **kwargs})


@pytest.mark.parametrize(
    "sparsity, error", [("0.9", TypeError), (float("nan"), ValueError), (1.0, ValueError)]
)
def test_init_gain_refuses_what_is_not_a_sparsity(sparsity, error):
    with pytest.raises(error, match="init_gain: sparsity must be"):
        optim.init_gain(sparsity)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(learning_rate=float("nan")), ValueError, "learning_rate must be a finite number"),
        (dict(learning_rate=-1.0), ValueError, "learning_rate must be > 0, got -1.0"),
        (dict(learning_rate=0.0), ValueError, "learning_rate must be > 0"),
        (dict(learning_rate="fast"), TypeError, "learning_rate must be a number or a schedule"),
        (dict(weight_decay=-1.0), ValueError, "weight_decay must be >= 0"),
        (dict(weight_decay=float("inf")), ValueError, "weight_decay must be a finite number"),
        (dict(b1=2.0), ValueError, r"b1 must be in \[0, 1\), got 2.0"),
        (dict(b2=1.0), ValueError, r"b2 must be in \[0, 1\)"),
        (dict(b1="0.9"), TypeError, "b1 must be a number"),
        (dict(eps=-1e-8), ValueError, "eps must be >= 0"),
        (dict(clip_norm=-1.0), ValueError, "clip_norm .* must be >= 0"),
        (dict(clip_norm=float("nan")), ValueError, "clip_norm .* must be a finite number"),
        (dict(alpha_lr_scale=float("nan")), ValueError, "alpha_lr_scale must be a finite number"),
        (dict(alpha_lr_scale=0.0), ValueError, "alpha_lr_scale must be > 0"),
        (dict(values_lr_scale=float("nan")), ValueError, "values_lr_scale must be a finite"),
    ],
)
def test_adamw_refuses_bad_constants_naming_them(kwargs, error, message):
    """optax took each of these without a word: NaN rates trained to NaN, a negative rate or
    clip norm ascended the loss, b1 >= 1 divided by zero in the bias correction."""
    kwargs = {"learning_rate": 1e-3, "weight_decay": 0.0, **kwargs}
    with pytest.raises(error, match=message):
        T.adamw(kwargs.pop("learning_rate"), **kwargs)


def test_adamw_takes_schedules_and_clip_norm_none_or_zero_as_no_clipping():
    schedule = optax.cosine_decay_schedule(1e-3, 10)
    params = {"head": {"kernel": jnp.ones((6, 2))}}
    grads = {"head": {"kernel": jnp.full((6, 2), 100.0)}}

    def update(**kwargs):
        tx = T.adamw(schedule, weight_decay=0.0, **kwargs)
        with jax.numpy_dtype_promotion("standard"):
            return tx.update(grads, tx.init(params), params)[0]["head"]["kernel"]

    off = update()
    assert np.all(np.isfinite(off)) and np.all(np.asarray(off) < 0)
    np.testing.assert_array_equal(update(clip_norm=0.0), off)
    np.testing.assert_array_equal(update(clip_norm=None), off)


def test_a_tree_of_bools_as_decay_mask_serves_the_frozen_params():
    """A static mask kept alpha's entry: the first update after the freeze failed on the pytree
    structure (a function of the params never did)."""
    layer = dd.nn.DiagonalDense(8, sparsity=0.5)
    variables = layer.init(jax.random.key(0), jnp.ones((2, 8)))
    params = variables["params"]
    static = dd.optim.weight_decay_mask(params)
    tx = dd.optim.diag_optimizer(0.1, alpha_learning_rate=0.3, weight_decay=0.5, decay_mask=static)
    by_function = dd.optim.diag_optimizer(0.1, alpha_learning_rate=0.3, weight_decay=0.5)
    frozen = dd.freeze_tree(variables)["params"]
    grads = jax.tree.map(jnp.ones_like, frozen)
    updates = []
    for t in (tx, by_function):
        state = dd.freeze_opt_state(t.init(params), params, frozen)
        with jax.numpy_dtype_promotion("standard"):  # optax's Adam bias correction mixes dtypes
            updates.append(t.update(grads, state, frozen)[0])
    jax.tree.map(np.testing.assert_array_equal, *updates)
    with pytest.raises(ValueError, match="decay_mask has no entry for params/bias"):
        dd.optim.diag_optimizer(0.1, alpha_learning_rate=0.3, decay_mask={"values": True}).init(
            params
        )
