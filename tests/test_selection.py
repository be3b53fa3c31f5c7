"""Selection learns: a student recovers planted diagonals (docs/design.md section 4).

Element diagonals (64 -> 96, K = 5 of 96) and block diagonals (128 -> 256 with b = 8, K = 3 of 16
candidate chains of 32 blocks), each with the default gate and exploration, and the training
recipe's restart of alpha from the values early in the search (``dynadiag.rescore_fraction``; this
problem restarts at 20% of its 400 steps).
Without the restart, the default ``fan_in="sparse"`` start misses planted element diagonals here
(its large starting values push every score down first); ``fan_in="dense"`` finds them either way.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dynadiag_jax as dd
from dynadiag_jax.nn import DiagonalDense, set_gate

STEPS, BATCH = 400, 64
RESCORE_STEP = STEPS // 5
MATCH_TOL = 0.01  # relative output error of the frozen student


def teacher(n_in, n_out, k, block_size):
    """A frozen layer with K planted offsets and values of magnitude 0.5..1 (random signs),
    scaled by 1/sqrt(b) so that every output has the same scale for element and block layers."""
    layer = DiagonalDense(
        n_out, k=k, block_size=block_size, init_phase="frozen", use_bias=False, impl="jax"
    )
    variables = layer.init(jax.random.key(0), jnp.zeros((1, n_in)))
    k_mag, k_sign = jax.random.split(jax.random.key(1))
    shape = variables["params"]["values"].shape
    values = jax.random.uniform(k_mag, shape, minval=0.5, maxval=1.0) * jnp.where(
        jax.random.bernoulli(k_sign, 0.5, shape), 1.0, -1.0
    )
    return layer, {
        "params": {"values": values / np.sqrt(block_size)},
        "diagonals": variables["diagonals"],
    }


@pytest.mark.parametrize(
    "fan_in,rescore", [("sparse", True), ("dense", False)], ids=["default", "dense-fan-in"]
)
@pytest.mark.parametrize(
    "n_in,n_out,k,block_size", [(64, 96, 5, 1), (128, 256, 3, 8)], ids=["element", "block"]
)
def test_student_recovers_planted_diagonals(n_in, n_out, k, block_size, fan_in, rescore):
    t_layer, t_vars = teacher(n_in, n_out, k, block_size)
    planted = np.asarray(t_vars["diagonals"]["offsets"])
    student = DiagonalDense(
        n_out, k=k, block_size=block_size, use_bias=False, fan_in=fan_in, impl="jax"
    )
    s_vars = student.init(jax.random.key(2), jnp.zeros((1, n_in)))
    # Wide start (every gate K/P), narrowed geometrically over the search phase.
    strength = dd.schedules.exponential(1.0, 1e-3, STEPS)
    tx = dd.optim.diag_optimizer(1e-2, alpha_learning_rate=1e-2)

    def step(carry, i):
        params, opt_state, v = carry
        v = set_gate(v, strength=strength(i))
        if rescore:
            params = jax.lax.cond(
                i == RESCORE_STEP,
                lambda p: dd.nn.alpha_from_values(p, strength(i)),
                lambda p: p,
                params,
            )
        x = jax.random.normal(jax.random.fold_in(jax.random.key(3), i), (BATCH, n_in))
        target = t_layer.apply(t_vars, x)
        grads = jax.grad(lambda p: jnp.mean((student.apply(dict(v, params=p), x) - target) ** 2))(
            params
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, v), None

    with jax.numpy_dtype_promotion("standard"):  # optax's Adam bias correction mixes dtypes
        init = (s_vars["params"], tx.init(s_vars["params"]), s_vars)
        (params, _, v), _ = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(STEPS)))(init)

    found = np.asarray(dd.select_diagonals(params["alpha"], k))
    np.testing.assert_array_equal(found, np.sort(planted))
    frozen = dd.freeze_tree(dict(v, params=params))
    np.testing.assert_array_equal(frozen["diagonals"]["offsets"], np.sort(planted))
    x = jax.random.normal(jax.random.key(4), (512, n_in))
    y_teacher, y_student = t_layer.apply(t_vars, x), student.apply(frozen, x)
    err = float(jnp.linalg.norm(y_student - y_teacher) / jnp.linalg.norm(y_teacher))
    assert err < MATCH_TOL, f"frozen student relative error {err:.4f}"
