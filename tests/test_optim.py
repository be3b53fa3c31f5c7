"""Optimizer helpers: alpha's own learning rate, no weight decay on alpha, biases or scales."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dynadiag_jax import optim

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
