"""DiagonalDense with block diagonals (block_size = b >= 2): both phases against dense W."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynadiag_jax as dd
from dynadiag_jax.nn import DiagonalDense, set_gate

F32_TOL = 1e-5
BF16_TOL = 3e-2
B = 8
# (in, out) with b = 8: tall (P_b = 3, L_b = 6), wide (P_b = 3, L_b = 6), square (P_b = L_b = 4).
SHAPES = [(24, 48), (48, 24), (32, 32)]


def block_geometry(n_in, n_out):
    """``(P_b, L_b)``."""
    return min(n_in, n_out) // B, max(n_in, n_out) // B


def dense_reference(params, x, n_out, gate, computed, k):
    """``x @ W.T + b`` with ``W = sum_{p in computed} c gate[p] * values[p]`` built densely, ``c``
    the layer's ``scale="rms"`` factor ``sqrt(k / sum(gate^2))`` (constant for the gradient)."""
    gate = gate * jax.lax.stop_gradient(jnp.sqrt(k / jnp.sum(gate * gate)))
    w = dd.diag_to_dense(
        gate[computed][:, None, None, None] * params["values"][computed],
        computed,
        in_features=x.shape[-1],
        out_features=n_out,
    )
    y = x @ w.T
    if "bias" in params:
        y = y + params["bias"].reshape((1,) * (y.ndim - 1) + (-1,))
    return y


def init(layer, n_in, key=0, batch=(5,)):
    x = jax.random.normal(jax.random.key(100 + key), batch + (n_in,))
    return layer.init(jax.random.key(key), x), x


def perturb(params, rng, scale=0.05):
    out = dict(params)
    out["alpha"] = jnp.asarray(rng.normal(size=params["alpha"].shape) * scale, jnp.float32)
    out["bias"] = jnp.asarray(rng.normal(size=params["bias"].shape), jnp.float32)
    return out


@pytest.mark.parametrize("n_in,n_out", SHAPES)
def test_init_shapes(n_in, n_out):
    layer = DiagonalDense(n_out, sparsity=0.7, block_size=B, impl="jax")
    v, _ = init(layer, n_in)
    p, length = block_geometry(n_in, n_out)
    k = dd.num_diagonals(n_in, n_out, 0.7, block_size=B)
    assert jax.tree.map(jnp.shape, v) == {
        "params": {"alpha": (p,), "values": (p, length, B, B), "bias": (n_out,)},
        "dynadiag": {"strength": (), "topk": (k,), "score": ()},
        "diagonals": {"in_features": ()},
    }
    assert float(jnp.std(v["params"]["values"])) > 0
    assert layer.budget(n_in) == k and 1 <= k <= p


@pytest.mark.parametrize(
    "explore,n_in,n_out",
    [("buckets", *shape) for shape in SHAPES] + [("none", *SHAPES[1]), ("dense_score", *SHAPES[2])],
)
def test_search_forward_and_grad_match_dense(rng, n_in, n_out, explore):
    layer = DiagonalDense(n_out, k=1, block_size=B, explore=explore, impl="jax")
    v, x = init(layer, n_in, batch=(2, 3))
    params = perturb(v["params"], rng)
    strength = 0.02
    p = block_geometry(n_in, n_out)[0]
    gate = dd.sparse_soft_topk(params["alpha"], 1, strength=strength)
    if explore == "buckets":
        computed = jnp.arange(p)
    else:
        computed = jax.lax.top_k(gate, layer.capacity(n_in))[1]
    score = explore == "dense_score"
    v = set_gate(dict(v, params=params), strength=strength, score=score)

    def loss(q, apply):
        return jnp.sum(jnp.sin(apply(q)))

    def layer_apply(q):
        return layer.apply(dict(v, params=q), x)

    def ref_apply(q, computed=computed):
        g = dd.sparse_soft_topk(q["alpha"], 1, strength=strength)
        return dense_reference(q, x, n_out, g, computed, 1)

    # jitted, as a training step runs them (eagerly every op compiles on its own)
    np.testing.assert_allclose(
        np.asarray(jax.jit(layer_apply)(params)),
        np.asarray(ref_apply(params)),
        atol=F32_TOL,
        rtol=F32_TOL,
    )
    grad = jax.jit(jax.grad(loss), static_argnums=1)
    got = grad(params, layer_apply)
    # A scored step gives every diagonal the gradient of the untruncated product.
    want_apply = functools.partial(ref_apply, computed=jnp.arange(p)) if score else ref_apply
    if score:
        y = layer_apply(params)
        _, pull = jax.vjp(want_apply, params)
        (want,) = pull(jnp.cos(y))
    else:
        want = grad(params, want_apply)
    for name in ("alpha", "values", "bias"):
        np.testing.assert_allclose(
            np.asarray(got[name]), np.asarray(want[name]), atol=1e-4, rtol=1e-4, err_msg=name
        )


def test_softmax_gate_matches_dense(rng):
    layer = DiagonalDense(32, k=2, block_size=B, gate="softmax", impl="jax")
    v, x = init(layer, 32)
    params = perturb(v["params"], rng, scale=1.0)
    gate = dd.softmax_topk(params["alpha"], 2, temperature=0.7)
    want = dense_reference(params, x, 32, gate, jnp.arange(4), 2)  # never sparse: all computed
    got = layer.apply(set_gate(dict(v, params=params), temperature=0.7), x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=F32_TOL)


@pytest.mark.parametrize("n_in,n_out", SHAPES)
def test_k_one_and_all_frozen_match_dense(n_in, n_out):
    p = block_geometry(n_in, n_out)[0]
    x = jax.random.normal(jax.random.key(1), (3, n_in))
    for k in (1, p):
        layer = DiagonalDense(n_out, k=k, block_size=B, init_phase="frozen", impl="jax")
        v = layer.init(jax.random.key(0), x)
        offsets = np.asarray(v["diagonals"]["offsets"])
        assert offsets.shape == (k,) and len(set(offsets)) == k and offsets.max() < p
        assert v["params"]["values"].shape == (k, max(n_in, n_out) // B, B, B)
        w = dd.diag_to_dense(v["params"]["values"], offsets, in_features=n_in, out_features=n_out)
        np.testing.assert_allclose(np.asarray(layer.apply(v, x)), np.asarray(x @ w.T), atol=F32_TOL)
    # K = P_b keeps every block: W has no zero entry left.
    assert np.count_nonzero(np.asarray(w)) == n_in * n_out


@pytest.mark.parametrize("n_in,n_out", SHAPES)
def test_freeze_is_the_hard_topk_and_checks_width(rng, n_in, n_out):
    layer = DiagonalDense(n_out, sparsity=0.7, block_size=B, impl="jax")
    v, x = init(layer, n_in)
    v = dict(v, params=perturb(v["params"], rng, scale=1.0))
    k = layer.budget(n_in)
    frozen_layer, fv = dd.freeze(layer, v)
    want = np.sort(np.argsort(-np.asarray(v["params"]["alpha"]))[:k])
    np.testing.assert_array_equal(fv["diagonals"]["offsets"], want)
    assert int(fv["diagonals"]["in_features"]) == n_in
    np.testing.assert_array_equal(fv["params"]["values"], v["params"]["values"][want])
    hard = layer.apply(v, x, strength=0.0)
    for module in (layer, frozen_layer):
        np.testing.assert_allclose(np.asarray(module.apply(fv, x)), np.asarray(hard), atol=F32_TOL)
    for variables in (v, fv):
        with pytest.raises(ValueError, match=f"x has width {n_in + B}, the layer expects {n_in}"):
            layer.apply(variables, jnp.ones((2, n_in + B)))


def test_jit_grad_vmap_and_leading_dims():
    layer = DiagonalDense(24, sparsity=0.6, block_size=B, impl="jax")
    v, x = init(layer, 16, batch=(2, 3, 4))
    assert layer.apply(v, x).shape == (2, 3, 4, 24)

    @jax.jit
    def loss(params, x):
        return jnp.mean(layer.apply(dict(v, params=params), x) ** 2)

    g = jax.grad(loss)(v["params"], x)
    assert all(np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree.leaves(g))
    mapped = jax.vmap(lambda xi: layer.apply(v, xi))(x)
    np.testing.assert_allclose(np.asarray(mapped), np.asarray(layer.apply(v, x)), atol=F32_TOL)
    _, fv = dd.freeze(layer, v)
    mapped = jax.jit(jax.vmap(lambda xi: layer.apply(fv, xi)))(x)
    np.testing.assert_allclose(np.asarray(mapped), np.asarray(layer.apply(fv, x)), atol=F32_TOL)


def test_bfloat16_params():
    layer = DiagonalDense(16, sparsity=0.5, block_size=B, param_dtype=jnp.bfloat16, impl="jax")
    x = jax.random.normal(jax.random.key(0), (4, 32), jnp.bfloat16)
    v = layer.init(jax.random.key(1), x)
    assert v["params"]["values"].dtype == jnp.bfloat16 and v["params"]["alpha"].dtype == jnp.float32
    y = layer.apply(v, x)
    assert y.dtype == jnp.bfloat16
    as32 = jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, v)
    y32 = DiagonalDense(16, sparsity=0.5, block_size=B, impl="jax").apply(
        as32, x.astype(jnp.float32)
    )
    np.testing.assert_allclose(
        np.asarray(y.astype(jnp.float32)), np.asarray(y32), atol=BF16_TOL, rtol=BF16_TOL
    )
    _, fv = dd.freeze(layer, v)
    assert fv["params"]["values"].dtype == jnp.bfloat16
    assert layer.apply(fv, x).dtype == jnp.bfloat16


def test_block_errors():
    for bad in (2, 3, 12):
        with pytest.raises(ValueError, match="block_size must be 1 .* or one of"):
            DiagonalDense(16, sparsity=0.5, block_size=bad)
    for bad in (True, 8.0):
        with pytest.raises(TypeError, match="block_size must be an int"):
            DiagonalDense(16, sparsity=0.5, block_size=bad)
    layer = DiagonalDense(24, sparsity=0.5, block_size=16)
    with pytest.raises(
        ValueError, match=r"block_size=16 must divide in_features=40 and out_features=24.*fit: 8"
    ):
        layer.init(jax.random.key(0), jnp.ones((1, 40)))
    with pytest.raises(ValueError, match=r"budget k=4 must be in \[1, P\] with P = 3"):
        DiagonalDense(24, k=4, block_size=8).init(jax.random.key(0), jnp.ones((1, 48)))


def test_frozen_repeated_offsets_add_up():
    """Hand-built frozen variables may name an offset twice: the two chains of blocks add up."""
    layer = DiagonalDense(48, k=2, block_size=B, init_phase="frozen", use_bias=False, impl="jax")
    x = jax.random.normal(jax.random.key(0), (3, 24))
    v = layer.init(jax.random.key(1), x)
    values = v["params"]["values"]
    twice = dict(v, diagonals=dict(v["diagonals"], offsets=jnp.array([1, 1], jnp.int32)))
    once = DiagonalDense(48, k=1, block_size=B, init_phase="frozen", use_bias=False, impl="jax")
    merged = {
        "params": {"values": values.sum(axis=0, keepdims=True)},
        "diagonals": dict(v["diagonals"], offsets=jnp.array([1], jnp.int32)),
    }
    w = dd.diag_to_dense(values, jnp.array([1, 1]), in_features=24, out_features=48)
    got = layer.apply(twice, x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(x @ w.T), atol=F32_TOL)
    np.testing.assert_allclose(np.asarray(got), np.asarray(once.apply(merged, x)), atol=F32_TOL)


def test_frozen_tall_layer_checks_width_eagerly_and_under_jit():
    """A frozen tall block layer's values [K, L_b, b, b] fix only in <= out; the stored width
    does the rest, and under jit (where it is traced) a wrong width gives NaN or a budget error."""
    layer = DiagonalDense(48, sparsity=0.5, block_size=B, impl="jax")
    x = jnp.ones((2, 24))
    _, fv = dd.freeze(layer, layer.init(jax.random.key(0), x))
    assert fv["params"]["values"].shape == (2, 6, B, B)
    for width in (16, 56, 4):
        with pytest.raises(ValueError, match=f"x has width {width}, the layer expects 24"):
            layer.apply(fv, jnp.ones((2, width)))
    apply = jax.jit(layer.apply)
    with pytest.raises(ValueError, match="x has width 56, the layer expects at most 48"):
        apply(fv, jnp.ones((2, 56)))
    with pytest.raises(ValueError, match="x has width 4, the layer expects at least 8"):
        apply(fv, jnp.ones((2, 4)))
    with pytest.raises(ValueError, match=r"block_size=8 must divide in_features=20"):
        apply(fv, jnp.ones((2, 20)))
    with pytest.raises(ValueError, match=r"\[K\] = \[1\] \(the budget of a 16 -> 48 layer\)"):
        apply(fv, jnp.ones((2, 16)))
    assert np.all(np.isnan(np.asarray(apply(fv, jnp.ones((2, 32))))))
    np.testing.assert_allclose(np.asarray(apply(fv, x)), np.asarray(layer.apply(fv, x)), atol=1e-6)
