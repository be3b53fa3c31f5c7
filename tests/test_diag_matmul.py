"""diag_matmul against the float64 dense reference, for every implementation in this build."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynadiag_jax as dd
from dynadiag_jax.layout import diag_indices

# Implementations under test: "ffi" must exist (the extension is part of every install).
KERNEL_IMPLS = [i for i in dd.available_impls() if i not in ("auto", "dense", "jax")]
ALL_IMPLS = ["jax", "dense", *KERNEL_IMPLS]

# Relative-to-scale tolerances for float32 results (sums of up to a few hundred products).
F32_RTOL = 2e-5
# bfloat16: the kernel may be at most this many times as wrong as the reference run in bfloat16.
LOWP_ERR_FACTOR = 2.0
LOWP_ATOL = 1e-6

SHAPES = [  # (in, out): square, tall, wide, odd sizes
    (1, 1),
    (1, 7),
    (7, 1),
    (7, 7),
    (7, 33),
    (33, 7),
    (33, 33),
    (33, 257),
    (257, 33),
    (64, 48),
]


def dense_reference(x, values, offsets, out_features):
    """float64 numpy ``x @ W.T`` with ``W`` scattered from the diagonals."""
    in_features = x.shape[-1]
    rows, cols = (np.asarray(a) for a in diag_indices(offsets, in_features, out_features))
    w = np.zeros((out_features, in_features))
    np.add.at(w, (rows, cols), np.asarray(values, np.float64))
    return np.asarray(x, np.float64) @ w.T, w


def make_case(rng, in_f, out_f, k, batch=(5,), dtype=np.float32, duplicates=False):
    p, d = max(in_f, out_f), min(in_f, out_f)
    if duplicates:
        offsets = rng.integers(0, p, k)
    elif k == p:
        offsets = rng.permutation(p)
    else:
        offsets = rng.choice(p, k, replace=False)
    x = rng.standard_normal(batch + (in_f,)).astype(dtype)
    values = rng.standard_normal((k, d)).astype(dtype)
    return jnp.asarray(x), jnp.asarray(values), jnp.asarray(offsets, jnp.int32)


def assert_close_f32(actual, expected, what):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    err = float(np.max(np.abs(actual - expected), initial=0.0))
    assert err <= F32_RTOL * scale, f"{what}: max abs error {err:.3g} > {F32_RTOL * scale:.3g}"


@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize("in_f,out_f", SHAPES)
@pytest.mark.parametrize("k_kind", ["one", "some", "all", "duplicates"])
def test_forward_matches_dense(impl, in_f, out_f, k_kind, rng):
    p = max(in_f, out_f)
    k = {"one": 1, "some": max(1, p // 3), "all": p, "duplicates": p + 3}[k_kind]
    x, values, offsets = make_case(rng, in_f, out_f, k, duplicates=k_kind == "duplicates")
    y = dd.diag_matmul(x, values, offsets, out_features=out_f, impl=impl)
    assert y.shape == (5, out_f) and y.dtype == jnp.float32
    assert_close_f32(y, dense_reference(x, values, offsets, out_f)[0], f"{impl} y")


@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize("in_f,out_f", [(7, 33), (33, 7), (33, 33), (1, 1)])
def test_gradients_match_dense(impl, in_f, out_f, rng):
    x, values, offsets = make_case(rng, in_f, out_f, max(in_f, out_f) // 2 + 1, batch=(3, 4))
    dy = jnp.asarray(rng.standard_normal((3, 4, out_f)).astype(np.float32))

    def loss(x, values):
        return jnp.sum(dd.diag_matmul(x, values, offsets, out_features=out_f, impl=impl) * dy)

    dx, dvalues = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, values)
    _, w = dense_reference(x, values, offsets, out_f)
    dy64 = np.asarray(dy, np.float64).reshape(-1, out_f)
    x64 = np.asarray(x, np.float64).reshape(-1, in_f)
    rows, cols = (np.asarray(a) for a in diag_indices(offsets, in_f, out_f))
    assert_close_f32(dx, (dy64 @ w).reshape(x.shape), f"{impl} dx")
    assert_close_f32(dvalues, (dy64.T @ x64)[rows, cols], f"{impl} dvalues")


@pytest.mark.parametrize("impl", [*KERNEL_IMPLS, "jax"])
@pytest.mark.parametrize("in_f,out_f", [(33, 257), (257, 33), (48, 48)])
def test_bfloat16_within_twice_the_bf16_reference_error(impl, in_f, out_f, rng):
    x, values, offsets = make_case(rng, in_f, out_f, 9, batch=(17,))
    exact, _ = dense_reference(x, values, offsets, out_f)
    xb, vb = x.astype(jnp.bfloat16), values.astype(jnp.bfloat16)
    exact_b, _ = dense_reference(xb.astype(jnp.float32), vb.astype(jnp.float32), offsets, out_f)
    lowp_ref = dd.diag_matmul(xb, vb, offsets, out_features=out_f, impl="dense")
    y = dd.diag_matmul(xb, vb, offsets, out_features=out_f, impl=impl)
    assert y.dtype == jnp.bfloat16
    ref_err = np.max(np.abs(np.asarray(lowp_ref, np.float64) - exact_b))
    err = np.max(np.abs(np.asarray(y, np.float64) - exact_b))
    assert err <= LOWP_ERR_FACTOR * ref_err + LOWP_ATOL, (
        f"{impl}: bf16 error {err} vs ref {ref_err}"
    )
    del exact


@pytest.mark.parametrize("impl", [*KERNEL_IMPLS, "jax"])
@pytest.mark.parametrize("in_f,out_f", [(33, 257), (257, 33), (48, 48)])
def test_bfloat16_gradients_within_twice_the_bf16_reference_error(impl, in_f, out_f, rng):
    x, values, offsets = make_case(rng, in_f, out_f, 9, batch=(17,))
    xb, vb = x.astype(jnp.bfloat16), values.astype(jnp.bfloat16)
    dyb = jnp.asarray(rng.standard_normal((17, out_f)), jnp.bfloat16)
    _, w = dense_reference(xb.astype(jnp.float32), vb.astype(jnp.float32), offsets, out_f)
    dy64, x64 = np.asarray(dyb, np.float64), np.asarray(xb, np.float64)
    rows, cols = (np.asarray(a) for a in diag_indices(offsets, in_f, out_f))
    exact = {"dx": dy64 @ w, "dvalues": (dy64.T @ x64)[rows, cols]}

    def grads(impl):
        def loss(x, v):
            y = dd.diag_matmul(x, v, offsets, out_features=out_f, impl=impl)
            return jnp.sum((y * dyb).astype(jnp.float32))

        dx, dv = jax.jit(jax.grad(loss, argnums=(0, 1)))(xb, vb)
        return {"dx": dx, "dvalues": dv}

    got, ref = grads(impl), grads("dense")
    for name in ("dx", "dvalues"):
        assert got[name].dtype == jnp.bfloat16, name
        ref_err = np.max(np.abs(np.asarray(ref[name], np.float64) - exact[name]))
        err = np.max(np.abs(np.asarray(got[name], np.float64) - exact[name]))
        assert err <= LOWP_ERR_FACTOR * ref_err + LOWP_ATOL, f"{impl} {name}: {err} vs {ref_err}"


@pytest.mark.parametrize("impl", [*KERNEL_IMPLS, "jax"])
def test_leading_dims_and_empty_batch(impl, rng):
    x, values, offsets = make_case(rng, 7, 33, 5, batch=(2, 3, 4))
    y = dd.diag_matmul(x, values, offsets, out_features=33, impl=impl)
    assert y.shape == (2, 3, 4, 33)
    assert_close_f32(y, dense_reference(x, values, offsets, 33)[0], "leading dims")
    empty = jnp.zeros((0, 7), jnp.float32)
    assert dd.diag_matmul(empty, values, offsets, out_features=33, impl=impl).shape == (0, 33)
    g = jax.grad(lambda v: jnp.sum(dd.diag_matmul(empty, v, offsets, out_features=33, impl=impl)))
    np.testing.assert_array_equal(g(values), np.zeros(values.shape, np.float32))


@pytest.mark.parametrize("impl", [*KERNEL_IMPLS, "jax"])
@pytest.mark.parametrize("block_size", [1, 8], ids=["element", "block"])
def test_vmap_over_each_argument(impl, block_size, rng):
    if impl not in dd.available_impls(block_size=block_size):
        pytest.skip(f"{impl} has no block-diagonal kernels here")
    n, k = 3, 4
    if block_size == 1:  # values [K, 9], P = 14
        in_f, out_f, vshape, p = 9, 14, (k, 9), 14
    else:  # values [K, 3, 8, 8], P_b = 2 (repeated offsets)
        in_f, out_f, vshape, p = 16, 24, (k, 3, 8, 8), 2
    xs = jnp.asarray(rng.standard_normal((n, 5, in_f)).astype(np.float32))
    vs = jnp.asarray(rng.standard_normal((n,) + vshape).astype(np.float32))
    offs = jnp.asarray(np.stack([rng.choice(p, k, replace=p < k) for _ in range(n)]), jnp.int32)

    def f(x, v, o):
        return dd.diag_matmul(x, v, o, out_features=out_f, impl=impl)

    cases = {
        "x": (xs, vs[0], offs[0], (0, None, None)),
        "values": (xs[0], vs, offs[0], (None, 0, None)),
        "offsets": (xs[0], vs[0], offs, (None, None, 0)),
        "all": (xs, vs, offs, (0, 0, 0)),
        "x on axis 1": (jnp.moveaxis(xs, 0, 1), vs[0], offs[0], (1, None, None)),
    }
    for name, (x, v, o, axes) in cases.items():
        got = jax.jit(jax.vmap(f, in_axes=axes))(x, v, o)
        assert got.shape == (n, 5, out_f), name
        for i in range(n):
            xi, vi, oi = (
                a if ax is None else jnp.take(a, i, axis=ax) for a, ax in zip((x, v, o), axes)
            )
            w = dd.diag_to_dense(vi, oi, in_features=in_f, out_features=out_f)  # see test_layout
            expected = np.asarray(xi, np.float64) @ np.asarray(w, np.float64).T
            assert_close_f32(got[i], expected, f"vmap over {name}")


@pytest.mark.parametrize("impl", [*KERNEL_IMPLS, "jax"])
def test_per_example_gradients_with_vmap_of_grad(impl, rng):
    x, values, offsets = make_case(rng, 6, 10, 3, batch=(4,))

    def loss(v, xi):
        return jnp.sum(jnp.sin(dd.diag_matmul(xi, v, offsets, out_features=10, impl=impl)))

    per_example = jax.vmap(jax.grad(loss), in_axes=(None, 0))(values, x)
    expected = jax.vmap(
        jax.grad(
            lambda v, xi: jnp.sum(
                jnp.sin(dd.diag_matmul(xi, v, offsets, out_features=10, impl="dense"))
            )
        ),
        in_axes=(None, 0),
    )(values, x)
    assert per_example.shape == (4, 3, 6)
    assert_close_f32(per_example, expected, "per-example dvalues")


def test_auto_uses_the_kernel_when_built():
    assert "ffi" in dd.available_impls(), "the C++ extension is part of every install"

    def lowered(dtype, rows=2, out_f=4):
        x = jnp.ones((rows, 4), dtype)
        v, o = jnp.ones((1, 4), dtype), jnp.zeros((1,), jnp.int32)
        f = jax.jit(lambda x: dd.diag_matmul(x, v, o, out_features=out_f))
        return f.lower(x).as_text()

    # "auto" stays in the program and is decided in the lowering, for the platform lowered for
    assert "dynadiag_diag_matmul_v2_fwd" in lowered(jnp.float32)
    # a tall element layer at a few rows too
    assert "dynadiag_diag_matmul_v2_fwd" in lowered(jnp.float32, rows=4, out_f=8)
    # float64 has no compiled kernel: auto falls back to the pure-JAX path.
    with jax.enable_x64(True):
        assert "custom_call" not in lowered(jnp.float64)


def test_hand_computed_single_diagonal():
    # W[4, 2] tall, diagonal 3: W[(j + 3) % 4, j] = v[j] -> W[3, 0] = 2, W[0, 1] = 5.
    x = jnp.asarray([[1.0, 10.0]], jnp.float32)
    for impl in ALL_IMPLS:
        y = dd.diag_matmul(
            x,
            jnp.asarray([[2.0, 5.0]], jnp.float32),
            jnp.asarray([3], jnp.int32),
            out_features=4,
            impl=impl,
        )
        np.testing.assert_allclose(np.asarray(y), [[50.0, 0.0, 0.0, 2.0]], err_msg=impl)


def test_cpu_backward_is_one_fused_kernel_call():
    x, v, off = jnp.ones((4, 6), jnp.float32), jnp.ones((2, 6), jnp.float32), jnp.arange(2)

    def loss(x, v):
        return jnp.sum(dd.diag_matmul(x, v, off.astype(jnp.int32), out_features=9, impl="ffi"))

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, v).as_text()
    assert 'dynadiag_diag_matmul_v2_bwd"' in hlo or "@dynadiag_diag_matmul_v2_bwd(" in hlo
    assert "dynadiag_diag_matmul_v2_dvalues(" not in hlo
