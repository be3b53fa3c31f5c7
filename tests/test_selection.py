"""Selection learns: a student recovers planted diagonals (docs/design.md section 4, issue 3)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import dynadiag_jax as dd
from dynadiag_jax.nn import DiagonalDense, set_gate

N_IN, N_OUT, K = 64, 96, 5
STEPS, BATCH = 300, 64
MATCH_TOL = 0.01  # relative output error of the frozen student


def teacher():
    """A frozen layer with K planted offsets and values of magnitude 0.5..1 (random signs)."""
    layer = DiagonalDense(N_OUT, k=K, init_phase="frozen", use_bias=False, impl="jax")
    variables = layer.init(jax.random.key(0), jnp.zeros((1, N_IN)))
    k_mag, k_sign = jax.random.split(jax.random.key(1))
    shape = variables["params"]["values"].shape
    values = jax.random.uniform(k_mag, shape, minval=0.5, maxval=1.0) * jnp.where(
        jax.random.bernoulli(k_sign, 0.5, shape), 1.0, -1.0
    )
    return layer, {"params": {"values": values}, "diagonals": variables["diagonals"]}


def test_student_recovers_planted_diagonals():
    t_layer, t_vars = teacher()
    planted = np.asarray(t_vars["diagonals"]["offsets"])
    student = DiagonalDense(N_OUT, k=K, use_bias=False, impl="jax")  # default gate and explore
    s_vars = student.init(jax.random.key(2), jnp.zeros((1, N_IN)))
    # Wide start (every gate K/P), narrowed geometrically over the search phase.
    strength = dd.schedules.exponential(1.0, 1e-3, STEPS)
    tx = dd.optim.diag_optimizer(1e-2, alpha_learning_rate=1e-2)

    def step(carry, i):
        params, opt_state, v = carry
        v = set_gate(v, strength=strength(i))
        x = jax.random.normal(jax.random.fold_in(jax.random.key(3), i), (BATCH, N_IN))
        target = t_layer.apply(t_vars, x)
        grads = jax.grad(lambda p: jnp.mean((student.apply(dict(v, params=p), x) - target) ** 2))(
            params
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, v), None

    with jax.numpy_dtype_promotion("standard"):  # optax's Adam bias correction mixes dtypes
        init = (s_vars["params"], tx.init(s_vars["params"]), s_vars)
        (params, _, v), _ = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(STEPS)))(init)

    found = np.asarray(dd.select_diagonals(params["alpha"], K))
    np.testing.assert_array_equal(found, np.sort(planted))
    frozen = dd.freeze_tree(dict(v, params=params))
    np.testing.assert_array_equal(frozen["diagonals"]["offsets"], np.sort(planted))
    x = jax.random.normal(jax.random.key(4), (512, N_IN))
    y_teacher, y_student = t_layer.apply(t_vars, x), student.apply(frozen, x)
    err = float(jnp.linalg.norm(y_student - y_teacher) / jnp.linalg.norm(y_teacher))
    assert err < MATCH_TOL, f"frozen student relative error {err:.4f}"
