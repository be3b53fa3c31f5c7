"""The search options of DiagonalDense: the output scale (``scale="rms"``), the informative
restart of alpha (``alpha_from_values``, ``GateSchedule.rescore``) and the ``output_scale``
diagnostic."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynadiag_jax as dd
from dynadiag_jax.nn import DiagonalDense
from dynadiag_jax.nn import functional as F
from dynadiag_jax.nn.search import gate_inputs, rms_scale, search_forward

SHAPES = [(24, 40, 1), (40, 24, 1), (32, 32, 1), (32, 64, 8), (64, 32, 8)]
STRENGTH = 0.05


def _problem(n_in, n_out, block_size, **spec_options):
    spec = F.LayerSpec(
        n_in, n_out, k=3 if block_size > 1 else 5, block_size=block_size, impl="jax", **spec_options
    )
    p = spec.num_candidates
    alpha = 0.1 * jax.random.normal(jax.random.key(0), (p,))
    values = jax.random.normal(jax.random.key(1), (p, *spec.row_shape))
    x = jax.random.normal(jax.random.key(2), (7, n_in))
    t = jax.random.normal(jax.random.key(3), (7, n_out))
    return spec, alpha, values, x, t


@pytest.mark.parametrize("n_in,n_out,block_size", SHAPES)
def test_rms_scale_multiplies_the_product_and_its_gradients(n_in, n_out, block_size):
    spec, alpha, values, x, t = _problem(n_in, n_out, block_size, scale="rms")
    plain = spec._replace(scale="none")

    def loss(spec, alpha, values, x):
        inputs = gate_inputs(alpha, STRENGTH, gate="sparse_topk", k=spec.k, impl="jax")
        return jnp.sum(search_forward(spec, values, x, inputs)[0] * t)

    gate = dd.sparse_soft_topk(alpha, spec.k, strength=STRENGTH)
    c = float(rms_scale(gate, spec.k))
    np.testing.assert_allclose(c, np.sqrt(spec.k / np.sum(np.square(gate))), rtol=1e-6)
    assert c > 1.0  # soft gates: sum(g^2) < sum(g) = K
    np.testing.assert_allclose(
        loss(spec, alpha, values, x), c * loss(plain, alpha, values, x), 1e-5
    )
    for scaled, unscaled in zip(
        jax.grad(loss, argnums=(2, 3))(spec, alpha, values, x),
        jax.grad(loss, argnums=(2, 3))(plain, alpha, values, x),
    ):
        np.testing.assert_allclose(scaled, c * unscaled, rtol=1e-5, atol=1e-5)


def test_rms_scale_is_the_flat_starts_missing_factor():
    """All gates K/P: ``c = sqrt(P / K)``; K gates at 1: ``c = 1``."""
    p, k = 40, 8
    np.testing.assert_allclose(rms_scale(jnp.full((p,), k / p), k), np.sqrt(p / k), rtol=1e-6)
    np.testing.assert_allclose(rms_scale((jnp.arange(p) < k).astype(jnp.float32), k), 1.0)


@pytest.mark.parametrize("scale,expected", [("none", np.sqrt(8 / 40)), ("rms", 1.0)])
def test_output_scale_at_a_flat_start(scale, expected):
    """Every gate K/P and values of equal norms: the product's scale against the frozen layer's is
    ``sqrt(K / P)`` without the rescale and 1 with it (sown per call as ``output_scale``)."""
    layer = DiagonalDense(40, k=8, scale=scale, kernel_init=jax.nn.initializers.ones, impl="jax")
    x = jnp.ones((2, 40))
    variables = layer.init(jax.random.key(0), x)
    _, state = layer.apply(variables, x, strength=10.0, mutable=["intermediates"])
    (scale_seen,) = state["intermediates"]["output_scale"]
    np.testing.assert_allclose(scale_seen, expected, rtol=1e-5)


@pytest.mark.parametrize("explore", ["none", "dense_score", "buckets"])
def test_the_rescale_and_output_scale_count_the_computed_diagonals_only(explore):
    """explore="none"/"dense_score" compute the top K_cap of P flat gates: the rescale counted
    all P, so the search ran at sqrt(K_cap / P) of the frozen scale (0.35 here) while
    output_scale said 1.02. Measured against the frozen layer, the sown figure is the product's."""
    layer = DiagonalDense(40, k=4, explore=explore, impl="jax", use_bias=False)
    x = jax.random.normal(jax.random.key(1), (4000, 40))
    variables = layer.init(jax.random.key(0), x[:2])  # flat gates
    y, state = layer.apply(variables, x, mutable=["intermediates"])
    frozen = layer.apply(dd.freeze_tree(variables), x)
    measured = float(jnp.sqrt(jnp.mean(y**2) / jnp.mean(frozen**2)))
    (sown,) = state["intermediates"]["output_scale"]
    assert measured == pytest.approx(float(sown), rel=0.05)
    assert measured == pytest.approx(1.0, rel=0.1)


def test_alpha_from_values_ranks_diagonals_by_their_values_norm():
    layer = DiagonalDense(24, k=4, impl="jax")
    x = jnp.ones((2, 16))
    params = layer.init(jax.random.key(0), x)["params"]
    norms = np.linalg.norm(np.asarray(params["values"]), axis=1)
    out = dd.nn.alpha_from_values({"layer": params, "dense": {"kernel": jnp.ones(3)}}, 0.5)
    expected = 0.5 * (norms - norms.mean()) / norms.std()
    np.testing.assert_allclose(out["layer"]["alpha"], expected, rtol=1e-5, atol=1e-6)
    assert out["layer"]["values"] is params["values"] and out["dense"]["kernel"].shape == (3,)
    equal = {**params, "values": jnp.ones_like(params["values"])}
    np.testing.assert_array_equal(dd.nn.alpha_from_values(equal, 0.5)["alpha"], 0)


def test_rescore_happens_on_its_step_only():
    from dynadiag_jax.training import GateSchedule
    from dynadiag_jax.training.sparsity import rescore

    params = {"layer": DiagonalDense(24, k=4).init(jax.random.key(0), jnp.ones((2, 16)))["params"]}
    gate = GateSchedule("strength", lambda step: 0.25, rescore_step=5)
    run = jax.jit(lambda p, step: rescore(p, gate, step))
    np.testing.assert_array_equal(run(params, 4)["layer"]["alpha"], params["layer"]["alpha"])
    np.testing.assert_allclose(
        run(params, 5)["layer"]["alpha"],
        dd.nn.alpha_from_values(params, 0.25)["layer"]["alpha"],
        rtol=1e-5,
        atol=1e-6,
    )
    with pytest.raises(ValueError, match="rescore_step"):
        GateSchedule("strength", lambda step: 1.0, rescore_step=-1).check()


def test_k_cap_is_the_documented_ceiling():
    """1.12 * 25 is 28.000000000000004 in floats: K_cap was 29, one diagonal computed (and sown)
    too many per step; slack=1e308 overflowed in ceil at init."""
    assert DiagonalDense(64, k=25, slack=0.12).capacity(64) == 28
    assert DiagonalDense(64, k=25, slack=0.25).capacity(64) == 32  # ceil(31.25)
    huge = DiagonalDense(64, k=25, slack=1e308)
    assert huge.capacity(64) == 64
    huge.init(jax.random.key(0), jnp.ones((2, 64)))
