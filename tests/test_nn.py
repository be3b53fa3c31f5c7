"""DiagonalDense: both phases against a dense reference, gate plumbing, metrics, bad input."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dynadiag_jax as dd
from dynadiag_jax.nn import DiagonalDense, set_gate
from dynadiag_jax.nn.search import bucket_sizes

F32_TOL = 1e-5
BF16_TOL = 3e-2
SHAPES = [(16, 24), (24, 16), (20, 20)]  # (in, out): tall, wide, square


def dense_reference(params, x, features, gate, computed, k=None, scaled=None):
    """``x @ W.T + b`` with ``W = sum_{p in computed} gate[p] * values[p]`` built densely; with
    ``k`` the gate is first scaled by the layer's ``scale="rms"`` factor ``sqrt(k / sum(g^2))``
    over the gates the product computes (``scaled``, default ``computed``), constant for the
    gradient."""
    if k is not None:
        g = gate[computed if scaled is None else scaled]
        gate = gate * jax.lax.stop_gradient(jnp.sqrt(k / jnp.sum(g * g)))
    w = dd.diag_to_dense(
        gate[computed][:, None] * params["values"][computed],
        computed,
        in_features=x.shape[-1],
        out_features=features,
    )
    y = x @ w.T
    if "bias" in params:
        y = y + params["bias"].reshape((1,) * (y.ndim - 1) + (-1,))
    return y


def init(layer, n_in, key=0, batch=(5,), **kw):
    x = jax.random.normal(jax.random.key(100 + key), batch + (n_in,))
    return layer.init(jax.random.key(key), x, **kw), x


def perturb(params, rng, scale=0.05):
    """Random alphas (spread > strength so the sparse gate is neither uniform nor hard)."""
    out = dict(params)
    out["alpha"] = jnp.asarray(rng.normal(size=params["alpha"].shape) * scale, jnp.float32)
    out["bias"] = jnp.asarray(rng.normal(size=params["bias"].shape), jnp.float32)
    return out


@pytest.mark.parametrize("n_in,n_out", SHAPES)
def test_init_shapes_and_ranges(n_in, n_out):
    layer = DiagonalDense(n_out, sparsity=0.8, explore="none")
    v, _ = init(layer, n_in)
    p, d_len = max(n_in, n_out), min(n_in, n_out)
    k = dd.num_diagonals(n_in, n_out, 0.8)
    assert jax.tree.map(jnp.shape, v) == {
        "params": {"alpha": (p,), "values": (p, d_len), "bias": (n_out,)},
        "dynadiag": {"strength": (), "topk": (k,), "score": ()},
        "diagonals": {"in_features": ()},
    }
    assert int(v["diagonals"]["in_features"]) == n_in
    alpha = np.asarray(v["params"]["alpha"])
    np.testing.assert_allclose(alpha, 1 / p, rtol=2e-3)
    assert len(np.unique(alpha)) == p  # ties broken by the params RNG
    np.testing.assert_array_equal(v["params"]["bias"], 0)
    assert v["dynadiag"]["topk"].dtype == jnp.int32


def _position_init(key, shape, dtype=jnp.float32):
    """A kernel ``[in, out]`` whose entries say where they are (1, 2, ...), for any key."""
    del key
    return jnp.arange(1, shape[0] * shape[1] + 1, dtype=dtype).reshape(shape)


@pytest.mark.parametrize("phase", ["search", "frozen"])
@pytest.mark.parametrize("fan_in", ["sparse", "dense"])
@pytest.mark.parametrize(
    "block_size,n_in,n_out", [(1, 16, 24), (1, 24, 16), (1, 20, 20), (8, 16, 32), (8, 32, 16)]
)
def test_values_are_the_dense_kernels_entries(phase, fan_in, block_size, n_in, n_out):
    """Each value is the entry of ``kernel_init``'s dense ``[in, out]`` kernel at its place in
    ``W[out, in]``, times ``1 / sqrt(density)`` with ``fan_in="sparse"``."""
    layer = DiagonalDense(
        n_out,
        sparsity=0.8,
        block_size=block_size,
        kernel_init=_position_init,
        fan_in=fan_in,
        init_phase=phase,
        impl="jax",
    )
    v, _ = init(layer, n_in)
    values = np.asarray(v["params"]["values"], np.float64)
    p = values.shape[0] if phase == "search" else None
    offsets = v["diagonals"]["offsets"] if phase == "frozen" else jnp.arange(p, dtype=jnp.int32)
    k = layer.budget(n_in)
    density = k * np.prod(values.shape[1:]) / (n_in * n_out)
    gain = 1 / np.sqrt(density) if fan_in == "sparse" else 1.0
    w = np.asarray(
        dd.diag_to_dense(jnp.asarray(values / gain), offsets, in_features=n_in, out_features=n_out)
    )
    kernel = np.asarray(_position_init(None, (n_in, n_out))).T
    kept = w != 0
    assert kept.sum() == values.size  # distinct entries, none lost
    np.testing.assert_allclose(w[kept], kernel[kept], rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
def test_default_init_keeps_the_dense_layers_output_scale(block_size):
    """``nn.Dense``'s default (lecun normal, variance ``1 / in``) with the sparse fan-in: a frozen
    layer's outputs have unit variance for unit inputs, as the dense layer's have; a masked-dense
    start (``fan_in="dense"``) is ``sqrt(density)`` smaller."""
    x = jax.random.normal(jax.random.key(1), (1024, 256))
    stds = {}
    for fan_in in ("sparse", "dense"):
        layer = DiagonalDense(
            512, sparsity=0.9, block_size=block_size, init_phase="frozen", fan_in=fan_in
        )
        v = layer.init(jax.random.key(0), x)
        stds[fan_in] = float(jnp.std(layer.apply(v, x)))
    density = layer.budget(256) * (256 if block_size == 1 else 512 * block_size) / (256 * 512)
    assert stds["sparse"] == pytest.approx(1.0, rel=0.15)
    assert stds["dense"] / stds["sparse"] == pytest.approx(np.sqrt(density), rel=0.05)


def test_unknown_fan_in_and_scale_are_rejected():
    with pytest.raises(ValueError, match="fan_in"):
        DiagonalDense(8, k=2, fan_in="wide")
    with pytest.raises(ValueError, match="scale"):
        DiagonalDense(8, k=2, scale="mean")


def test_keyword_only_and_budget_k():
    with pytest.raises(TypeError):
        DiagonalDense(8, 0.5)  # sparsity is keyword-only
    v, _ = init(DiagonalDense(8, k=3, explore="none"), 8)
    assert v["dynadiag"]["topk"].shape == (3,)


@pytest.mark.parametrize("n_in,n_out", SHAPES)
@pytest.mark.parametrize("explore", ["buckets", "none", "dense_score"])
def test_search_forward_and_grad_match_dense(rng, n_in, n_out, explore):
    layer = DiagonalDense(n_out, sparsity=0.8, explore=explore, impl="jax")
    v, x = init(layer, n_in, batch=(2, 3))
    params = perturb(v["params"], rng)
    strength = 0.1
    gate = dd.sparse_soft_topk(params["alpha"], layer.budget(n_in), strength=strength)
    support = int(jnp.sum(gate > 0))
    if explore == "buckets":
        computed = jnp.arange(max(n_in, n_out))  # the whole support is always computed
    else:
        computed = jax.lax.top_k(gate, layer.capacity(n_in))[1]
        assert support > layer.capacity(n_in), "the test should exercise truncation"

    def loss(params, apply):
        return jnp.sum(jnp.sin(apply(params)))

    def layer_apply(params):
        return layer.apply(dict(v, params=params), x, strength=strength)

    def ref_apply(params):
        g = dd.sparse_soft_topk(params["alpha"], layer.budget(n_in), strength=strength)
        return dense_reference(params, x, n_out, g, computed, k=layer.budget(n_in))

    # jitted, as a training step runs them (eagerly every op compiles on its own)
    np.testing.assert_allclose(
        np.asarray(jax.jit(layer_apply)(params)),
        np.asarray(ref_apply(params)),
        atol=F32_TOL,
        rtol=F32_TOL,
    )
    grad = jax.jit(jax.grad(loss), static_argnums=1)
    got = grad(params, layer_apply)
    want = grad(params, ref_apply)
    for name in ("alpha", "values", "bias"):
        np.testing.assert_allclose(
            np.asarray(got[name]), np.asarray(want[name]), atol=1e-4, rtol=1e-4, err_msg=name
        )


@pytest.mark.parametrize("explore", ["buckets", "dense_score"])
def test_search_grad_of_grad_matches_dense(rng, explore):
    """Hessian-vector products (reverse over reverse) of a searching layer: its products'
    custom_vjps and the gate differentiate twice as the dense reference does."""
    n_in, n_out = 16, 24
    layer = DiagonalDense(n_out, sparsity=0.8, explore=explore, impl="jax")
    v, x = init(layer, n_in, batch=(2, 3))
    params = perturb(v["params"], rng)
    strength, k = 0.1, layer.budget(n_in)
    gate = dd.sparse_soft_topk(params["alpha"], k, strength=strength)
    if explore == "buckets":
        computed = jnp.arange(max(n_in, n_out))
    else:
        computed = jax.lax.top_k(gate, layer.capacity(n_in))[1]

    def layer_apply(params):
        return layer.apply(dict(v, params=params), x, strength=strength)

    def ref_apply(params):
        g = dd.sparse_soft_topk(params["alpha"], k, strength=strength)
        return dense_reference(params, x, n_out, g, computed, k=k)

    tangent = jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape), a.dtype), params)

    def hvp(apply):
        grad = jax.grad(lambda p: jnp.sum(jnp.sin(apply(p))))
        dot = lambda p: sum(  # noqa: E731
            jnp.vdot(a, b) for a, b in zip(jax.tree.leaves(grad(p)), jax.tree.leaves(tangent))
        )
        return jax.jit(jax.grad(dot))(params)  # one compile, not an eager dispatch per op

    got, want = hvp(layer_apply), hvp(ref_apply)
    for name in ("alpha", "values", "bias"):
        scale = float(jnp.max(jnp.abs(want[name])))
        np.testing.assert_allclose(
            np.asarray(got[name]), np.asarray(want[name]), atol=1e-4 * scale, err_msg=name
        )


@pytest.mark.parametrize("impl", ["jax", "auto"])
def test_search_backward_computes_dx_only_where_x_needs_it(rng, impl):
    """A first layer (``x`` constant) gets ``dvalues`` alone from the bucketed search backward;
    differentiated in ``x`` too, every gradient still matches the dense reference."""
    n_in, n_out = 24, 16
    layer = DiagonalDense(n_out, sparsity=0.8, impl=impl)
    v, x = init(layer, n_in, batch=(3,))
    params = perturb(v["params"], rng)
    strength = 0.1
    k = layer.budget(n_in)

    def loss(params, x):
        return jnp.sum(jnp.sin(layer.apply(dict(v, params=params), x, strength=strength)))

    def reference(params, x):
        g = dd.sparse_soft_topk(params["alpha"], k, strength=strength)
        return jnp.sum(jnp.sin(dense_reference(params, x, n_out, g, jnp.arange(n_in), k=k)))

    got = jax.grad(loss, argnums=(0, 1))(params, x)
    want = jax.grad(reference, argnums=(0, 1))(params, x)
    only = jax.grad(loss)(params, x)
    for name in ("alpha", "values", "bias"):
        for grads in (got[0], only):
            np.testing.assert_allclose(
                np.asarray(grads[name]), np.asarray(want[0][name]), atol=1e-4, rtol=1e-4
            )
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=1e-4, rtol=1e-4)

    def primitives(argnums):
        jaxpr = str(jax.make_jaxpr(jax.grad(loss, argnums=argnums))(params, x))
        return {name for name in ("diag_matmul_bwd", "diag_matmul_dx") if name in jaxpr}

    assert primitives(0) == set()
    assert primitives((0, 1)) != set()


@pytest.mark.parametrize("n_in,n_out", SHAPES)
def test_dense_score_step_gives_exact_gradient_for_every_diagonal(rng, n_in, n_out):
    layer = DiagonalDense(n_out, sparsity=0.8, explore="dense_score", impl="jax")
    v, x = init(layer, n_in)
    params = perturb(v["params"], rng)
    v = set_gate(dict(v, params=params), strength=0.1, score=True)
    k, p = layer.budget(n_in), max(n_in, n_out)
    truncated = jax.lax.top_k(
        dd.sparse_soft_topk(params["alpha"], k, strength=0.1), layer.capacity(n_in)
    )[1]

    def ref(params, computed):
        g = dd.sparse_soft_topk(params["alpha"], k, strength=0.1)
        # scaled as the product computes it: over the truncated gates
        return dense_reference(
            params, x, n_out, g, computed, k=layer.budget(n_in), scaled=truncated
        )

    y = layer.apply(v, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref(params, truncated)), atol=F32_TOL)
    got = jax.grad(lambda q: jnp.sum(layer.apply(dict(v, params=q), x) ** 2 / 2))(params)
    # The gradient of the untruncated layer, evaluated at the truncated output.
    _, pull = jax.vjp(lambda q: ref(q, jnp.arange(p)), params)
    (want,) = pull(y)
    for name in ("alpha", "values"):
        np.testing.assert_allclose(
            np.asarray(got[name]), np.asarray(want[name]), atol=1e-4, rtol=1e-4, err_msg=name
        )


def test_dense_score_step_grad_of_grad_is_the_jacobian_of_its_gradient(rng):
    """A scored step's gradient is no function's derivative (a truncated forward, every diagonal
    in the backward), so grad of grad must be the Jacobian of that gradient: u . H(t) = t . J u,
    J u by finite differences in float64. Its forward rule gave y every diagonal's derivative,
    3-8% off."""
    with jax.enable_x64(True):
        # scale="none": the rms scale takes no gradient, so no gradient field has one then
        layer = DiagonalDense(24, sparsity=0.8, explore="dense_score", scale="none", impl="jax")
        layer = layer.clone(param_dtype=jnp.float64)
        v, _ = init(layer, 16)
        x = jnp.asarray(rng.normal(size=(5, 16)))
        params = jax.tree.map(lambda a: jnp.asarray(a, jnp.float64), perturb(v["params"], rng))
        v = set_gate(dict(v, params=params), strength=0.1, score=True)
        grad = jax.jit(jax.grad(lambda q: jnp.sum(jnp.sin(layer.apply(dict(v, params=q), x)))))
        t, u = (jax.tree.map(lambda a: jnp.asarray(rng.normal(size=a.shape)), params) for _ in "tu")

        def vdot(a, b):
            return sum(jnp.vdot(p, q) for p, q in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

        hvp = jax.jit(jax.grad(lambda q: vdot(grad(q), t)))(params)
        eps = 1e-6
        plus, minus = (
            grad(jax.tree.map(lambda a, d, e=e: a + e * d, params, u)) for e in (eps, -eps)
        )
        ju = jax.tree.map(lambda a, b: (a - b) / (2 * eps), plus, minus)
        np.testing.assert_allclose(float(vdot(u, hvp)), float(vdot(t, ju)), rtol=1e-6)


def test_softmax_gate_and_temperature_collection(rng):
    layer = DiagonalDense(12, sparsity=0.5, gate="softmax", impl="jax")
    v, x = init(layer, 10, temperature=2.0)
    assert set(v["dynadiag"]) == {"temperature", "topk", "score"}
    assert float(v["dynadiag"]["temperature"]) == 2.0
    params = perturb(v["params"], rng, scale=1.0)
    v = dict(v, params=params)
    k = layer.budget(10)
    gate = dd.softmax_topk(params["alpha"], k, temperature=0.7)
    want = dense_reference(params, x, 12, gate, jnp.arange(12), k=k)  # never sparse: all computed
    got = layer.apply(set_gate(v, temperature=0.7), x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=F32_TOL)
    np.testing.assert_allclose(
        np.asarray(layer.apply(v, x, temperature=0.7)), np.asarray(want), atol=F32_TOL
    )


def test_gate_value_from_collection_and_override(rng):
    layer = DiagonalDense(16, sparsity=0.75, explore="none", impl="jax")
    v, x = init(layer, 16)
    assert float(v["dynadiag"]["strength"]) == 1.0  # the documented default
    v = dict(v, params=perturb(v["params"], rng))
    from_collection = layer.apply(set_gate(v, strength=0.02), x)
    np.testing.assert_allclose(
        np.asarray(from_collection), np.asarray(layer.apply(v, x, strength=0.02)), atol=F32_TOL
    )
    assert not np.allclose(from_collection, layer.apply(v, x))
    without = {"params": v["params"]}
    with pytest.raises(ValueError, match="set_gate"):
        layer.apply(without, x)
    np.testing.assert_allclose(
        np.asarray(layer.apply(without, x, strength=0.02)),
        np.asarray(from_collection),
        atol=F32_TOL,
    )
    v3, _ = init(DiagonalDense(16, sparsity=0.75, gate_init=0.3, explore="none"), 16)
    assert float(v3["dynadiag"]["strength"]) == pytest.approx(0.3)


def test_set_gate_is_jittable_and_reaches_nested_layers():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            x = DiagonalDense(16, sparsity=0.5, explore="none", name="a")(x)
            return DiagonalDense(4, sparsity=0.5, gate="softmax", explore="none", name="b")(x)

    model = Model()
    v = model.init(jax.random.key(0), jnp.ones((2, 8)))
    out = jax.jit(lambda v, s, t: set_gate(v, strength=s, temperature=t, score=True))(v, 0.25, 0.5)
    assert float(out["dynadiag"]["a"]["strength"]) == 0.25
    assert float(out["dynadiag"]["b"]["temperature"]) == 0.5
    assert bool(out["dynadiag"]["a"]["score"]) and bool(out["dynadiag"]["b"]["score"])
    assert set_gate(v, strength=0.25)["params"] is v["params"]  # other collections are shared
    with pytest.raises(ValueError, match="no 'dynadiag' collection"):
        set_gate({"params": {}}, strength=1.0)


def test_metrics_are_sown(rng):
    layer = DiagonalDense(32, sparsity=0.9, explore="none", impl="jax")
    v, x = init(layer, 32)
    params = perturb(v["params"], rng)
    _, state = layer.apply(dict(v, params=params), x, strength=0.1, mutable=["intermediates"])
    m = {name: float(value[0]) for name, value in state["intermediates"].items()}
    gate = np.asarray(dd.sparse_soft_topk(params["alpha"], layer.budget(32), strength=0.1))
    kept = np.sort(gate)[::-1][: layer.capacity(32)].sum()
    assert m["gate_nonzero"] == (gate > 0).sum()
    assert m["gate_mass_outside"] == pytest.approx(gate.sum() - kept, abs=1e-5)
    assert m["gate_mean"] == pytest.approx(gate.mean(), abs=1e-6)
    assert m["computed_diagonals"] == layer.capacity(32)
    assert "topk_changed" not in m  # "dynadiag" was not mutable


def test_buckets_compute_the_support_only(rng):
    layer = DiagonalDense(64, sparsity=0.9, num_buckets=4, impl="jax")
    v, x = init(layer, 64)
    sizes = bucket_sizes(layer.capacity(64), 64, 4)
    assert sizes == (9, 18, 34, 64) and layer.capacity(64) == 9  # K = 7
    assert bucket_sizes(8, 64, 1) == (64,) and bucket_sizes(64, 64, 4) == (64,)
    for strength, expected in ((10.0, 64), (1e-4, layer.capacity(64))):
        _, state = layer.apply(
            dict(v, params=perturb(v["params"], rng)),
            x,
            strength=strength,
            mutable=["intermediates"],
        )
        inter = state["intermediates"]
        assert float(inter["computed_diagonals"][0]) == expected
        assert float(inter["gate_mass_outside"][0]) == pytest.approx(0, abs=1e-5)


def test_buckets_with_the_dense_impl_build_w_once_over_every_diagonal(rng):
    """impl="dense" costs the same whatever the number of diagonals: no bucket switch, all P."""
    layer = DiagonalDense(64, sparsity=0.9, impl="dense")
    v, x = init(layer, 48)
    params = perturb(v["params"], rng)
    strength = 0.02
    y, state = layer.apply(dict(v, params=params), x, strength=strength, mutable=["intermediates"])
    assert float(state["intermediates"]["computed_diagonals"][0]) == 64
    gate = dd.sparse_soft_topk(params["alpha"], layer.budget(48), strength=strength)
    assert int(jnp.sum(gate > 0)) < 34  # a bucket of 34 or fewer would hold the support
    want = dense_reference(params, x, 64, gate, jnp.arange(64), k=layer.budget(48))
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), atol=F32_TOL, rtol=F32_TOL)

    def switches(impl):
        other = DiagonalDense(64, sparsity=0.9, impl=impl)
        fn = jax.jit(lambda p: other.apply(dict(v, params=p), x, strength=strength))
        return fn.lower(params).as_text().count("stablehlo.case")

    assert switches("dense") == 0 < switches("jax")


def test_topk_refresh_when_mutable(rng):
    layer = DiagonalDense(16, sparsity=0.75, explore="none", impl="jax")
    v, x = init(layer, 16)
    params = perturb(v["params"], rng)
    _, state = layer.apply(dict(v, params=params), x, mutable=["dynadiag", "intermediates"])
    want = np.sort(np.argsort(-np.asarray(params["alpha"]))[: layer.budget(16)])
    np.testing.assert_array_equal(state["dynadiag"]["topk"], want)
    changed = len(set(want) - set(np.asarray(v["dynadiag"]["topk"]).tolist()))
    assert float(state["intermediates"]["topk_changed"][0]) == changed


@pytest.mark.parametrize("n_in,n_out", SHAPES)
def test_frozen_init_phase(n_in, n_out):
    layer = DiagonalDense(n_out, sparsity=0.7, init_phase="frozen", impl="jax")
    v, x = init(layer, n_in, batch=(3,))
    k, d_len = layer.budget(n_in), min(n_in, n_out)
    assert jax.tree.map(jnp.shape, v) == {
        "params": {"values": (k, d_len), "bias": (n_out,)},
        "diagonals": {"offsets": (k,), "in_features": ()},
    }
    offsets = np.asarray(v["diagonals"]["offsets"])
    assert offsets.dtype == np.int32 and len(set(offsets)) == k
    assert np.all(np.diff(offsets) > 0) and offsets.min() >= 0 and offsets.max() < max(n_in, n_out)
    w = dd.diag_to_dense(v["params"]["values"], offsets, in_features=n_in, out_features=n_out)
    np.testing.assert_allclose(np.asarray(layer.apply(v, x)), np.asarray(x @ w.T), atol=F32_TOL)
    # The same module class in search mode runs frozen variables too (the phase is in the data).
    np.testing.assert_allclose(
        np.asarray(DiagonalDense(n_out, sparsity=0.7).apply(v, x)),
        np.asarray(x @ w.T),
        atol=F32_TOL,
    )


def test_dtype_and_param_dtype():
    layer = DiagonalDense(16, sparsity=0.5, dtype=jnp.bfloat16, explore="none", impl="jax")
    x = jax.random.normal(jax.random.key(0), (4, 8))
    v = layer.init(jax.random.key(1), x)
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(v["params"]))
    y = layer.apply(v, x)
    assert y.dtype == jnp.bfloat16
    y32 = DiagonalDense(16, sparsity=0.5, explore="none", impl="jax").apply(v, x)
    np.testing.assert_allclose(
        np.asarray(y.astype(jnp.float32)), np.asarray(y32), atol=BF16_TOL, rtol=BF16_TOL
    )
    y_in = DiagonalDense(16, sparsity=0.5, explore="none", impl="jax").apply(
        v, x.astype(jnp.bfloat16)
    )
    assert y_in.dtype == jnp.float32  # promoted with param_dtype by default


@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float16])
def test_alpha_keeps_its_init_noise_with_16_bit_params(param_dtype):
    layer = DiagonalDense(8, sparsity=0.9, param_dtype=param_dtype, explore="none", impl="jax")
    variables = layer.init(jax.random.key(0), jnp.ones((2, 64), param_dtype))
    params = variables["params"]
    assert params["values"].dtype == param_dtype and params["bias"].dtype == param_dtype
    assert params["alpha"].dtype == jnp.float32
    assert len(np.unique(np.asarray(params["alpha"]))) == 64
    # without distinct scores a freeze at step 0 would keep the contiguous offsets 0..K-1
    _, frozen = dd.freeze(layer, variables)
    assert not np.array_equal(np.asarray(frozen["diagonals"]["offsets"]), np.arange(7))


def test_jit_grad_and_leading_dims():
    layer = DiagonalDense(12, sparsity=0.6, explore="none", impl="jax")
    v, x = init(layer, 9, batch=(2, 3, 4))

    @jax.jit
    def loss(params, x):
        return jnp.mean(layer.apply(dict(v, params=params), x) ** 2)

    g = jax.grad(loss)(v["params"], x)
    assert layer.apply(v, x).shape == (2, 3, 4, 12)
    assert all(np.all(np.isfinite(np.asarray(leaf))) for leaf in jax.tree.leaves(g))


def test_no_dense_matmul_in_the_graph():
    layer = DiagonalDense(48, sparsity=0.8, use_bias=False, impl="jax")
    v, x = init(layer, 80)
    loss = lambda params: jnp.sum(layer.apply(dict(v, params=params), x))  # noqa: E731
    text = str(jax.make_jaxpr(jax.grad(loss))(v["params"]))
    assert "dot_general" not in text


def test_bad_input():
    x = jnp.ones((2, 8))
    for sparsity in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="sparsity must be in"):
            DiagonalDense(8, sparsity=sparsity)
    with pytest.raises(ValueError, match=r"flax.linen.Dense.*k=P"):
        DiagonalDense(8, sparsity=0)
    for sparsity in ("0.9", True, [0.5]):
        with pytest.raises(TypeError, match="sparsity must be a number"):
            DiagonalDense(8, sparsity=sparsity)
    with pytest.raises(ValueError, match="features must be >= 1"):
        DiagonalDense(0, sparsity=0.5)
    # A wrong type is a TypeError, a wrong value of the right type a ValueError.
    for kwargs, name in (
        (dict(features=8.0), "features"),
        (dict(features=8, num_buckets=2.0), "num_buckets"),
        (dict(features=8, block_size=True), "block_size"),
        (dict(features=8, in_features="8"), "in_features"),
    ):
        with pytest.raises(TypeError, match=f"{name} must be an int"):
            DiagonalDense(**kwargs, sparsity=0.5)
    with pytest.raises(TypeError, match="k must be an int"):
        DiagonalDense(4, k=2.0).init(jax.random.key(0), x)
    with pytest.raises(TypeError, match="strength must be a number"):
        DiagonalDense(8, sparsity=0.5).init(jax.random.key(0), x, strength="1")
    with pytest.raises(ValueError, match="exactly one of"):
        DiagonalDense(8)
    with pytest.raises(ValueError, match="exactly one of"):
        DiagonalDense(8, sparsity=0.5, k=2)
    with pytest.raises(ValueError, match="unknown gate"):
        DiagonalDense(8, sparsity=0.5, gate="topk")
    with pytest.raises(ValueError, match="unknown explore"):
        DiagonalDense(8, sparsity=0.5, explore="rigl")
    with pytest.raises(ValueError, match="unknown init_phase"):
        DiagonalDense(8, sparsity=0.5, init_phase="dense")
    with pytest.raises(ValueError, match="budget k=9"):
        DiagonalDense(4, k=9).init(jax.random.key(0), x)  # P = max(8, 4) = 8
    layer = DiagonalDense(8, sparsity=0.5, explore="none")
    v = layer.init(jax.random.key(0), x)
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="strength must be >= 0"):
            layer.apply(v, x, strength=bad)
        with pytest.raises(ValueError, match="strength must be >= 0"):
            set_gate(v, strength=bad)
        with pytest.raises(ValueError, match="temperature must be >= 0"):
            DiagonalDense(8, sparsity=0.5, gate="softmax").init(
                jax.random.key(0), x, temperature=bad
            )
        with pytest.raises(ValueError, match="gate_init must be >= 0"):
            DiagonalDense(8, sparsity=0.5, gate_init=bad)
    with pytest.raises(ValueError, match="takes strength=, not temperature="):
        layer.apply(v, x, temperature=1.0)
    frozen_layer, frozen = dd.freeze(layer, v)  # the frozen layer checks the same arguments
    frozen_layer.apply(frozen, x, strength=0.5)
    with pytest.raises(ValueError, match="strength must be >= 0"):
        frozen_layer.apply(frozen, x, strength=-1.0)
    with pytest.raises(ValueError, match="takes strength=, not temperature="):
        frozen_layer.apply(frozen, x, temperature=1.0)
    with pytest.raises(ValueError, match="strength="):
        layer.apply({"params": v["params"]}, x)
    with pytest.raises(ValueError, match="temperature="):
        DiagonalDense(8, sparsity=0.5, gate="softmax").apply({"params": v["params"]}, x)
    with pytest.raises(ValueError, match="needs strength="):
        set_gate(v)
    with pytest.raises(TypeError, match="x must be a floating array"):
        layer.apply(v, jnp.ones((2, 8), jnp.int32))
    with pytest.raises(ValueError, match="x must be a floating array"):
        layer.apply(v, jnp.ones((), jnp.float32))
    for slack, error in ((-0.5, ValueError), (float("nan"), ValueError), ("0.25", TypeError)):
        with pytest.raises(error, match="slack must be"):
            DiagonalDense(8, sparsity=0.5, slack=slack)
        with pytest.raises(error, match="slack must be"):
            dd.nnx.DiagonalDense(8, 8, sparsity=0.5, slack=slack, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="x must be a floating array"):
        dd.nnx.DiagonalDense(8, 8, sparsity=0.5, rngs=nnx.Rngs(0))(jnp.ones((2, 8), jnp.int32))
    with pytest.raises(TypeError, match="freeze_tree: variables must be a mapping"):
        dd.freeze_tree([v])
    with pytest.raises(
        ValueError, match="freeze_tree: variables must be variables with a 'params'"
    ):
        dd.freeze_tree({"diagonals": {}})
    with pytest.raises(TypeError, match="freeze: variables must be a mapping"):
        dd.freeze(layer, None)


def test_nnx_bridge():
    """The linen layer runs from NNX via flax.nnx.bridge; "dynadiag" becomes a Variable type."""
    from flax import nnx

    layer = DiagonalDense(16, sparsity=0.75, explore="none", impl="jax")
    x = jax.random.normal(jax.random.key(3), (4, 12))
    model = nnx.bridge.ToNNX(layer, rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(model, x)
    dynadiag = type(model.strength)
    model.strength[...] = jnp.float32(0.05)  # the NNX counterpart of set_gate
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    linen_vars = {"params": params, "dynadiag": nnx.to_pure_dict(nnx.state(model, dynadiag))}
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(
        jnp.shape, layer.init(jax.random.key(0), x)["params"]
    )
    np.testing.assert_allclose(
        np.asarray(model(x)), np.asarray(layer.apply(linen_vars, x)), atol=F32_TOL
    )

    def loss_nnx(m):
        return jnp.sum(m(x) ** 2)

    def loss_linen(p):
        return jnp.sum(layer.apply(dict(linen_vars, params=p), x) ** 2)

    got = nnx.to_pure_dict(nnx.state(nnx.grad(loss_nnx)(model), nnx.Param))
    want = jax.grad(loss_linen)(params)
    for name in ("alpha", "values", "bias"):
        np.testing.assert_allclose(
            np.asarray(got[name]), np.asarray(want[name]), atol=1e-5, err_msg=name
        )


@pytest.mark.skipif("ffi" not in dd.available_impls(), reason="C++ extension not built")
@pytest.mark.parametrize("explore", ["buckets", "dense_score"])
def test_compiled_kernel_matches_jax_path(rng, explore):
    x = jax.random.normal(jax.random.key(1), (3, 24))
    fast = DiagonalDense(16, sparsity=0.8, explore=explore, impl="ffi")
    ref = DiagonalDense(16, sparsity=0.8, explore=explore, impl="jax")
    v = fast.init(jax.random.key(0), x)
    v = set_gate(dict(v, params=perturb(v["params"], rng)), strength=0.1, score=True)
    np.testing.assert_allclose(
        np.asarray(fast.apply(v, x)), np.asarray(ref.apply(v, x)), atol=F32_TOL
    )
    grads = [
        jax.grad(lambda p, m=m: jnp.sum(m.apply(dict(v, params=p), x) ** 2))(v["params"])
        for m in (fast, ref)
    ]
    for name in ("alpha", "values", "bias"):
        np.testing.assert_allclose(
            np.asarray(grads[0][name]),
            np.asarray(grads[1][name]),
            atol=1e-4,
            rtol=1e-4,
            err_msg=name,
        )


def test_gate_value_zero_is_the_hard_topk(rng):
    """strength=0 / temperature=0 are the gates' limits, in the call and from set_gate."""
    layer = DiagonalDense(24, sparsity=0.8, impl="jax")
    v, x = init(layer, 16)
    v = dict(v, params=perturb(v["params"], rng))
    k = layer.budget(16)
    top = np.sort(np.argsort(-np.asarray(v["params"]["alpha"]))[:k])
    hard = dense_reference(v["params"], x, 24, jnp.ones(k), top)
    for y in (layer.apply(v, x, strength=0.0), jax.jit(layer.apply)(set_gate(v, strength=0.0), x)):
        np.testing.assert_allclose(np.asarray(y), np.asarray(hard), atol=F32_TOL)
    soft = DiagonalDense(24, sparsity=0.8, gate="softmax", impl="jax")
    sv = soft.init(jax.random.key(0), x)
    sv = dict(sv, params=perturb(sv["params"], rng))
    best = jnp.argmax(sv["params"]["alpha"])[None]
    # all mass on the arg-max, at the output scale of K diagonals (scale="rms")
    want = dense_reference(sv["params"], x, 24, jnp.ones(1), best, k=soft.budget(16))
    got = jax.jit(soft.apply)(set_gate(sv, temperature=0.0), x)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=F32_TOL)


def test_frozen_wide_layer_checks_its_input_width():
    """DiagonalDense(32, sparsity=0.8) on 64 inputs, frozen, run on 63."""
    layer = DiagonalDense(32, sparsity=0.8, impl="jax")
    x = jax.random.normal(jax.random.key(0), (4, 64))
    init = jax.jit(layer.init)
    for seed in range(5):  # the user saw 3 of 5 seeds run silently
        v = init(jax.random.key(seed), x)
        frozen_layer, fv = dd.freeze(layer, v)
        assert int(fv["diagonals"]["in_features"]) == 64
        for module, variables in ((layer, v), (frozen_layer, fv)):
            for width in (63, 65, 31):
                with pytest.raises(ValueError, match=f"x has width {width}, the layer expects 64"):
                    module.apply(variables, x[:, :1].repeat(width, axis=1))
    assert frozen_layer.apply(fv, x).shape == (4, 32)
    # Under jit the search phase's width comes from the shapes; a frozen wide layer's stored width
    # is a traced value there, so a wrong width gives NaN outputs instead of an error.
    apply = jax.jit(layer.apply)
    with pytest.raises(ValueError, match="x has width 63, the layer expects 64"):
        apply(v, x[:, :63])
    assert np.all(np.isnan(np.asarray(apply(fv, x[:, :63]))))
    assert np.all(np.isfinite(np.asarray(apply(fv, x))))
    with pytest.raises(ValueError, match="x has width 31, the layer expects at least 32"):
        apply(fv, x[:, :31])


@pytest.mark.parametrize("n_in,n_out", SHAPES)
def test_every_shape_checks_width_in_both_phases(n_in, n_out):
    layer = DiagonalDense(n_out, sparsity=0.7, impl="jax")
    x = jnp.ones((2, n_in))
    v = layer.init(jax.random.key(0), x)
    _, fv = dd.freeze(layer, v)
    for variables in (v, fv):
        with pytest.raises(ValueError, match=f"x has width {n_in + 1}, the layer expects {n_in}"):
            layer.apply(variables, jnp.ones((2, n_in + 1)))


def test_frozen_variables_without_width_say_where_it_lives():
    """Offsets restored without the frozen layer's in_features."""
    layer = DiagonalDense(24, sparsity=0.7, impl="jax")
    x = jnp.ones((2, 16))
    _, fv = dd.freeze(layer, layer.init(jax.random.key(0), x))
    without = dict(fv, diagonals={"offsets": fv["diagonals"]["offsets"]})
    with pytest.raises(ValueError, match=r"its width is missing.*'diagonals' collection"):
        layer.apply(without, x)


def test_frozen_params_without_offsets_say_where_they_live():
    """Only "params" saved after the freeze."""
    layer = DiagonalDense(32, sparsity=0.8, impl="jax")
    x = jnp.ones((2, 64))
    _, fv = dd.freeze(layer, layer.init(jax.random.key(0), x))
    for kwargs in ({}, {"strength": 0.5}):
        with pytest.raises(ValueError, match=r"offsets are missing.*'diagonals' collection"):
            layer.apply({"params": fv["params"]}, x, **kwargs)


def test_set_gate_refuses_arguments_no_layer_takes():
    """set_gate used to return the variables unchanged."""
    x = jnp.ones((2, 8))
    sparse = DiagonalDense(8, sparsity=0.5).init(jax.random.key(0), x)
    soft = DiagonalDense(8, sparsity=0.5, gate="softmax").init(jax.random.key(0), x)
    with pytest.raises(
        ValueError, match=r"strength=.*matches no layer.*temperature= \(gate='softmax'\) in 1 layer"
    ):
        set_gate(soft, strength=0.5)
    with pytest.raises(
        ValueError, match=r"temperature=.*matches no layer.*strength= \(gate='sparse_topk'\)"
    ):
        set_gate(sparse, temperature=0.5)
    _, frozen = dd.freeze(DiagonalDense(8, sparsity=0.5), sparse)
    for variables in (frozen, {"params": sparse["params"]}):
        with pytest.raises(ValueError, match="no 'dynadiag' collection"):
            set_gate(variables, strength=0.5)
    assert float(set_gate(sparse, strength=0.0)["dynadiag"]["strength"]) == 0.0


def test_frozen_layer_and_phase_mix_ups_are_errors_under_jit_too():
    """As a user ran it: ``DiagonalDense(32, k=4)`` frozen at width 64 and run
    under jit on width 48 gave all-NaN; the frozen layer silently ran the search product on
    search-phase variables; search params beside frozen offsets gave Flax's shape error."""
    layer = DiagonalDense(32, k=4, impl="jax")
    x = jax.random.normal(jax.random.key(0), (2, 64))
    v = layer.init(jax.random.key(1), x)
    frozen_layer, fv = dd.freeze(layer, v)
    assert frozen_layer.in_features == 64  # static: known while tracing
    apply = jax.jit(frozen_layer.apply)
    with pytest.raises(ValueError, match="x has width 48, the layer expects 64"):
        apply(fv, x[:, :48])
    with pytest.raises(ValueError, match="init_phase='frozen'.*given search-phase variables"):
        apply(v, x)
    with pytest.raises(ValueError, match="mixed phases: params hold a search-phase layer"):
        jax.jit(layer.apply)({**v, "diagonals": fv["diagonals"]}, x)
    np.testing.assert_allclose(apply(fv, x), layer.apply(fv, x), atol=F32_TOL)
    with pytest.raises(ValueError, match="x has width 63, the layer expects 64"):
        DiagonalDense(32, k=4, in_features=64).init(jax.random.key(0), x[:, :63])
    with pytest.raises(ValueError, match="in_features must be >= 1, got 0"):
        DiagonalDense(32, k=4, in_features=0)


@pytest.mark.parametrize("gate", ["sparse_topk", "softmax"])
def test_a_nan_gate_value_raises_eagerly_and_gives_nan_outputs_under_jit(gate):
    """A NaN strength/temperature raises where it can be read (the call,
    set_gate, eagerly); traced, the layer cannot raise, and its outputs are NaN rather than the
    finite product of some other gate. A traced negative value still acts as 0."""
    layer = DiagonalDense(8, sparsity=0.5, gate=gate, impl="jax")
    name = layer.hyper_name
    x = jax.random.normal(jax.random.key(0), (3, 8))
    v = layer.init(jax.random.key(1), x)
    with pytest.raises(ValueError, match=f"{name} must be >= 0"):
        layer.apply(v, x, **{name: float("nan")})
    with pytest.raises(ValueError, match=f"{name} must be >= 0"):
        set_gate(v, **{name: float("nan")})
    by_call = jax.jit(lambda v, h: layer.apply(v, x, **{name: h}))
    by_set_gate = jax.jit(lambda v, h: layer.apply(set_gate(v, **{name: h}), x))
    for f in (by_call, by_set_gate):
        assert np.all(np.isnan(np.asarray(f(v, jnp.nan))))
        np.testing.assert_array_equal(f(v, -1.0), f(v, 0.0))
        assert np.all(np.isfinite(np.asarray(f(v, -1.0))))


@pytest.mark.parametrize("score", ["no", 3.7, 1, np.float32(1), jnp.asarray(1)])
def test_set_gate_refuses_a_score_that_is_not_a_bool(score):
    layer = DiagonalDense(8, sparsity=0.5, explore="dense_score", impl="jax")
    v, _ = init(layer, 8)
    with pytest.raises(TypeError, match="set_gate: score must be a bool"):
        set_gate(v, score=score)
    model = dd.nnx.DiagonalDense(8, 8, sparsity=0.5, explore="dense_score", rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="set_gate: score must be a bool"):
        dd.nnx.set_gate(model, score=score)


def test_set_gate_takes_python_numpy_and_traced_bools():
    layer = DiagonalDense(8, sparsity=0.5, explore="dense_score", impl="jax")
    v, _ = init(layer, 8)
    for score in (True, np.bool_(True), jnp.asarray(True)):
        assert bool(set_gate(v, score=score)["dynadiag"]["score"])
    at_step = jax.jit(lambda v, step: set_gate(v, score=step % 3 == 0)["dynadiag"]["score"])
    assert bool(at_step(v, 3)) and not bool(at_step(v, 4))
    model = dd.nnx.DiagonalDense(8, 8, sparsity=0.5, explore="dense_score", rngs=nnx.Rngs(0))
    for score in (np.bool_(False), True):
        dd.nnx.set_gate(model, score=score)
        assert bool(model.score.get_value()) is bool(score)


@pytest.mark.parametrize(
    "scale, error",
    [(0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError), ("1", TypeError)],
)
def test_alpha_from_values_refuses_a_scale_that_erases_or_reverses_the_ranking(scale, error):
    params = DiagonalDense(24, k=4).init(jax.random.key(0), jnp.ones((2, 16)))["params"]
    with pytest.raises(error, match="alpha_from_values: scale must be"):
        dd.nn.alpha_from_values(params, scale)
    with pytest.raises(ValueError, match="scale must be > 0"):
        dd.nn.alpha_from_values(params, jnp.asarray([0.5, -0.5]))


def test_alpha_from_values_under_jit_is_nan_for_a_scale_that_is_not_positive():
    params = DiagonalDense(24, k=4).init(jax.random.key(0), jnp.ones((2, 16)))["params"]
    restart = jax.jit(lambda p, s: dd.nn.alpha_from_values(p, s)["alpha"])
    for scale in (0.0, -1.0, jnp.nan):
        assert np.all(np.isnan(np.asarray(restart(params, scale))))
    np.testing.assert_allclose(
        restart(params, 0.5), dd.nn.alpha_from_values(params, 0.5)["alpha"], rtol=1e-6
    )


def test_search_variables_of_another_budget_features_or_block_size_are_refused():
    """DiagonalDense(32, sparsity=0.9) ran silently on variables made with sparsity 0.5 (and
    freeze_tree then froze topk's old count); another features gave Flax's shape error."""
    x = jnp.ones((2, 16))
    v = DiagonalDense(32, sparsity=0.5, impl="jax").init(jax.random.key(0), x)
    sparser = DiagonalDense(32, sparsity=0.9, impl="jax")
    for apply in (sparser.apply, jax.jit(sparser.apply)):
        with pytest.raises(
            ValueError, match=r"DiagonalDense: dynadiag/topk holds K = 16 .*budget is K = 4"
        ):
            apply(v, x)
    with pytest.raises(ValueError, match=r"params/bias has shape \[32\].*features=16"):
        DiagonalDense(16, sparsity=0.5).apply(v, x)
    bare = DiagonalDense(32, sparsity=0.5, use_bias=False).init(jax.random.key(0), x)
    for layer in (
        DiagonalDense(24, sparsity=0.5, use_bias=False),
        DiagonalDense(32, sparsity=0.5, use_bias=False, block_size=8),
    ):
        with pytest.raises(ValueError, match=r"values \[P, 16\]\) were made by a layer with other"):
            layer.apply(bare, x)


def test_search_variables_of_the_transposed_shape_are_refused_by_their_stored_width():
    """An 8 -> 4 layer's values [8, 4] are also the shape of a 4 -> 8 layer's: without a bias
    only diagonals/in_features tells them apart (a features=8 layer ran them as 4 -> 8)."""
    v = DiagonalDense(4, sparsity=0.5, use_bias=False).init(jax.random.key(0), jnp.ones((2, 8)))
    other = DiagonalDense(8, sparsity=0.5, use_bias=False)
    with pytest.raises(
        ValueError, match=r"made for inputs of width 8 .*features=8 reads .* as a 4 -> 8 layer"
    ):
        other.apply(v, jnp.ones((2, 4)))
    # inside jit the stored width is traced: the outputs are NaN, as for a frozen layer
    y = jax.jit(other.apply)(v, jnp.ones((2, 4)))
    assert y.shape == (2, 8) and bool(jnp.isnan(y).all())
    right = jax.jit(DiagonalDense(4, sparsity=0.5, use_bias=False).apply)(v, jnp.ones((2, 8)))
    assert bool(jnp.isfinite(right).all())
    with pytest.raises(ValueError, match=r"freeze: the variables .* were not made by this layer"):
        dd.freeze(other, v)


def test_alpha_from_values_of_non_finite_values_is_nan_and_freezing_refuses_it():
    """NaN values gave alpha = 0 everywhere (a NaN std failed `std > 0`), and the freeze then
    kept the first K diagonals, NaN among them."""
    v = DiagonalDense(4, sparsity=0.5).init(jax.random.key(0), jnp.ones((2, 8)))
    for bad in (jnp.nan, jnp.inf):
        params = {**v["params"], "values": v["params"]["values"].at[3, 0].set(bad)}
        restarted = dd.nn.alpha_from_values(params, 1.0)
        assert bool(jnp.isnan(restarted["alpha"]).all())
        with pytest.raises(ValueError, match="the search diverged"):
            dd.freeze_tree({**v, "params": restarted})
    flat = {**v["params"], "values": jnp.ones_like(v["params"]["values"])}
    np.testing.assert_array_equal(dd.nn.alpha_from_values(flat, 1.0)["alpha"], 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(param_dtype=jnp.int32), "param_dtype must be a floating dtype.*got int32"),
        (dict(dtype=jnp.int32), "dtype must be a floating dtype.*got int32"),
        (dict(dtype="foo"), "dtype must be a floating dtype.*got 'foo'"),
        (dict(kernel_init=3), "kernel_init must be an initializer.*got 3"),
        (dict(bias_init=None), "bias_init must be an initializer.*got None"),
        (dict(use_bias="no"), "use_bias must be True or False, got str"),  # made a bias
    ],
)
def test_dtype_and_initializer_arguments_are_checked(kwargs, match):
    """param_dtype=int32 gave values of zeros and an output of exactly 0; the others named x, or
    nothing."""
    with pytest.raises(TypeError, match=match):
        DiagonalDense(8, sparsity=0.5, **kwargs)
    with pytest.raises(TypeError, match=match):
        dd.nnx.DiagonalDense(8, 8, sparsity=0.5, rngs=nnx.Rngs(0), **kwargs)


@pytest.mark.parametrize(
    "axes, init_phase, missing",
    [
        ({"params": 0}, "search", "['dynadiag', 'diagonals']"),
        ({"params": 0, "diagonals": 0}, "search", "['dynadiag']"),
        ({"params": 0}, "frozen", "['diagonals']"),
        ({"params": 0, "diagonals": 0}, "frozen", None),
        ({True: 0}, "search", None),
    ],
)
def test_a_lifted_transform_must_carry_the_layer_collections(axes, init_phase, missing):
    """Flax's own error named one entry of one collection ("Tried to access 'in_features' from
    collection 'diagonals' ... the collection is empty"); a frozen layer needs no gate state."""

    class Cell(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            layer = dd.nn.DiagonalDense(32, sparsity=0.75, init_phase=init_phase)
            return jnp.tanh(layer(h)), None

    scan = nn.scan(Cell, variable_axes=axes, split_rngs={"params": True}, length=3)()
    h = jnp.ones((4, 32))
    if missing is None:
        variables = scan.init(jax.random.key(0), h, None)
        assert scan.apply(variables, h, None)[0].shape == (4, 32)
        return
    with pytest.raises(ValueError, match=r"does not carry the collections " + re.escape(missing)):
        scan.init(jax.random.key(0), h, None)


@pytest.mark.parametrize("phase", ["search", "frozen"])
def test_remat_policies_can_save_the_product_by_name(phase, capsys):
    """Not a dot_general, the product escaped dots_saveable and was always recomputed; its name
    lets a policy keep it (the one [rows, out] residual) with the same gradients."""
    layer = dd.nn.DiagonalDense(48, sparsity=0.75)
    x = jax.random.normal(jax.random.key(1), (4, 32))
    variables = layer.init(jax.random.key(0), x)
    if phase == "frozen":
        variables = dd.freeze_tree(variables)

    def loss(params):
        return jnp.sum(jnp.sin(layer.apply({**variables, "params": params}, x)))

    def residuals(policy):
        jax.ad_checkpoint.print_saved_residuals(
            jax.checkpoint(loss, policy=policy), variables["params"]
        )
        return [
            line for line in capsys.readouterr().out.splitlines() if line.startswith("f32[4,48]")
        ]

    assert residuals(jax.checkpoint_policies.nothing_saveable) == []
    policy = jax.checkpoint_policies.save_only_these_names(dd.nn.PRODUCT_NAME)
    assert len(residuals(policy)) == 1
    g = jax.grad(jax.checkpoint(loss, policy=policy))(variables["params"])
    want = jax.grad(loss)(variables["params"])
    for name in want:
        np.testing.assert_allclose(g[name], want[name], rtol=1e-5, atol=1e-6)
