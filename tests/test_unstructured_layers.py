"""MaskedDense and BCOODense: unstructured speed baselines behind the DiagonalDense interface."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynadiag_jax import baselines as B

RTOL = 1e-5  # float32 products of a few hundred terms
ATOL = 1e-5


def _dense_from_bcoo(variables, shape):
    data = variables["params"]["data"]
    idx = variables["sparsity"]["indices"]
    return jnp.zeros(shape, data.dtype).at[idx[:, 0], idx[:, 1]].set(data)


@pytest.mark.parametrize("in_f,out_f,sparsity", [(16, 24, 0.9), (24, 16, 0.5), (7, 5, 0.95)])
def test_masked_dense_matches_reference_and_keeps_exact_budget(in_f, out_f, sparsity, rng):
    layer = B.MaskedDense(out_f, sparsity=sparsity)
    x = jnp.asarray(rng.standard_normal((2, 3, in_f), np.float32))
    variables = layer.init(jax.random.key(0), x)
    mask = variables["sparsity"]["mask"]
    assert mask.shape == (in_f, out_f) and mask.dtype == jnp.bool_
    assert int(mask.sum()) == B.num_active(in_f * out_f, sparsity)
    variables = jax.tree.map(lambda a: a, variables)
    variables["params"]["bias"] = jnp.asarray(rng.standard_normal(out_f, np.float32))
    w = jnp.where(mask, variables["params"]["kernel"], 0.0)
    expected = x @ w + variables["params"]["bias"][None, None]
    np.testing.assert_allclose(jax.jit(layer.apply)(variables, x), expected, rtol=RTOL, atol=ATOL)
    grad = jax.grad(lambda p: jnp.sum(layer.apply({**variables, "params": p}, x) ** 2))(
        variables["params"]
    )
    assert not np.any(np.asarray(grad["kernel"])[~np.asarray(mask)] != 0)


@pytest.mark.parametrize("in_f,out_f,sparsity", [(16, 24, 0.9), (24, 16, 0.5), (7, 5, 0.95)])
def test_bcoo_dense_matches_dense_reference_forward_and_grad(in_f, out_f, sparsity, rng):
    layer = B.BCOODense(out_f, sparsity=sparsity)
    x = jnp.asarray(rng.standard_normal((4, in_f), np.float32))
    variables = layer.init(jax.random.key(1), x)
    n = B.num_active(in_f * out_f, sparsity)
    idx = np.asarray(variables["sparsity"]["indices"])
    assert idx.shape == (n, 2) and variables["params"]["data"].shape == (n,)
    flat = idx[:, 0] * out_f + idx[:, 1]
    assert np.all(np.diff(flat) > 0), "indices must be unique and row-major sorted"
    variables["params"]["bias"] = jnp.asarray(rng.standard_normal(out_f, np.float32))

    def reference(params):
        w = _dense_from_bcoo({"params": params, "sparsity": variables["sparsity"]}, (in_f, out_f))
        return x @ w + params["bias"][None]

    np.testing.assert_allclose(
        jax.jit(layer.apply)(variables, x), reference(variables["params"]), rtol=RTOL, atol=ATOL
    )

    def loss(f):
        return lambda p: jnp.sum(jnp.sin(f(p)))

    got = jax.grad(loss(lambda p: layer.apply({**variables, "params": p}, x)))(variables["params"])
    want = jax.grad(loss(reference))(variables["params"])
    for k in ("data", "bias"):
        np.testing.assert_allclose(got[k], want[k], rtol=RTOL, atol=ATOL, err_msg=k)


def test_bcoo_and_masked_dense_agree_on_the_same_structure(rng):
    x = jnp.asarray(rng.standard_normal((5, 2, 12), np.float32))
    bcoo = B.BCOODense(9, sparsity=0.8, use_bias=False)
    bv = bcoo.init(jax.random.key(2), x)
    w = _dense_from_bcoo(bv, (12, 9))
    masked = B.MaskedDense(9, sparsity=0.8, use_bias=False)
    mv = {"params": {"kernel": w}, "sparsity": {"mask": w != 0}}
    np.testing.assert_allclose(bcoo.apply(bv, x), masked.apply(mv, x), rtol=RTOL, atol=ATOL)
    assert bcoo.apply(bv, x).shape == (5, 2, 9)


def test_bcoo_init_values_follow_the_dense_initialiser():
    layer = B.BCOODense(256, sparsity=0.5)
    data = layer.init(jax.random.key(3), jnp.ones((1, 256)))["params"]["data"]
    # LeCun normal: std 1/sqrt(fan_in) = 1/16.
    assert abs(float(jnp.std(data)) - 1 / 16) < 0.1 / 16


@pytest.mark.parametrize("cls", [B.MaskedDense, B.BCOODense])
def test_layers_respect_dtype(cls, rng):
    layer = cls(8, sparsity=0.5, dtype=jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((3, 6), np.float32))
    variables = layer.init(jax.random.key(0), x)
    assert jax.tree.leaves(variables["params"])[0].dtype == jnp.float32
    assert layer.apply(variables, x).dtype == jnp.bfloat16


@pytest.mark.parametrize("cls", [B.MaskedDense, B.BCOODense])
def test_layers_reject_bad_input(cls):
    x = jnp.ones((2, 4))
    with pytest.raises(ValueError, match="sparsity"):
        cls(3, sparsity=1.0).init(jax.random.key(0), x)
    with pytest.raises(TypeError):
        cls(3, 0.5)  # sparsity is keyword-only, as in DiagonalDense
    with pytest.raises(TypeError, match="floating"):
        cls(3, sparsity=0.5).init(jax.random.key(0), jnp.ones((2, 4), jnp.int32))
    variables = cls(3, sparsity=0.5).init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="'sparsity' collection"):
        cls(3, sparsity=0.5).apply({"params": variables["params"]}, x)
