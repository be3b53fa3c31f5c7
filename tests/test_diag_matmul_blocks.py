"""Block-diagonal diag_matmul (values[K, L_b, b, b]) against a float64 numpy dense reference.

The reference below is written from the contract's formulas (docs/design.md section 1, "Block
diagonals") with plain loops, independent of dynadiag_jax.layout, so a convention error cannot hide
in both the implementation and the oracle. Every impl that runs block diagonals on this platform
(``dd.available_impls(block_size=b)``) is tested: the kernels join once they declare block support.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynadiag_jax as dd
from dynadiag_jax.ops.products import _BACKENDS

F32_RTOL = 2e-5
LOWP_ERR_FACTOR = 2.0
LOWP_ATOL = 1e-6


def impls(block_size, *, dense=True):
    skip = {"auto"} if dense else {"auto", "dense"}
    return [i for i in dd.available_impls(block_size=block_size) if i not in skip]


def block_coords(d, t, in_f, out_f, b):
    """(block row, block col) of block ``t`` of block diagonal ``d`` (the contract's formulas)."""
    nb_in, nb_out = in_f // b, out_f // b
    if out_f >= in_f:  # tall or square: the chain runs down the block rows
        return t, (t + d) % nb_in
    return (t + d) % nb_out, t  # wide: along the block columns


def design_dense(values, offsets, in_f, out_f):
    """float64 ``W[out, in]``; repeated offsets add up."""
    values = np.asarray(values, np.float64)
    b = values.shape[-1]
    w = np.zeros((out_f, in_f))
    for k, d in enumerate(np.asarray(offsets)):
        for t in range(values.shape[1]):
            r, c = block_coords(int(d), t, in_f, out_f, b)
            w[r * b : (r + 1) * b, c * b : (c + 1) * b] += values[k, t]
    return w


def design_dvalues(dy, x, offsets, in_f, out_f, b):
    """``dvalues[k, t] = dy[:, rows of the block].T @ x[:, cols of the block]`` in float64."""
    dy = np.asarray(dy, np.float64).reshape(-1, out_f)
    x = np.asarray(x, np.float64).reshape(-1, in_f)
    length = max(in_f, out_f) // b
    out = np.zeros((len(offsets), length, b, b))
    for k, d in enumerate(np.asarray(offsets)):
        for t in range(length):
            r, c = block_coords(int(d), t, in_f, out_f, b)
            out[k, t] = dy[:, r * b : (r + 1) * b].T @ x[:, c * b : (c + 1) * b]
    return out


def make_case(rng, in_f, out_f, b, k_kind, batch=(5,), dtype=np.float32):
    p, length = min(in_f, out_f) // b, max(in_f, out_f) // b
    offsets = {
        "one": rng.integers(0, p, 1),
        "all": rng.permutation(p),
        "duplicates": np.concatenate([rng.permutation(p), rng.integers(0, p, 2)]),
    }[k_kind]
    x = rng.standard_normal(batch + (in_f,)).astype(dtype)
    values = rng.standard_normal((len(offsets), length, b, b)).astype(dtype)
    return jnp.asarray(x), jnp.asarray(values), jnp.asarray(offsets, jnp.int32)


def assert_close_f32(actual, expected, what):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    err = float(np.max(np.abs(actual - expected), initial=0.0))
    assert err <= F32_RTOL * scale, f"{what}: max abs error {err:.3g} > {F32_RTOL * scale:.3g}"


SHAPES = [  # (in, out, b): tall, wide, square, one block column/row, P_b = 1, larger b
    (16, 48, 8),
    (48, 16, 8),
    (24, 24, 8),
    (8, 40, 8),
    (40, 8, 8),
    (16, 16, 16),
    (64, 96, 32),
    (96, 32, 16),
]


def test_design_formulas_by_hand():
    # Tall W[6, 4], b = 2 (nb_out = 3, nb_in = 2), diagonal 1: blocks (0, 1), (1, 0), (2, 1).
    values = np.arange(1.0, 13.0).reshape(1, 3, 2, 2)
    w = np.zeros((6, 4))
    w[0:2, 2:4], w[2:4, 0:2], w[4:6, 2:4] = values[0, 0], values[0, 1], values[0, 2]
    np.testing.assert_array_equal(design_dense(values, [1], 4, 6), w)
    got = dd.diag_to_dense(
        jnp.asarray(values, jnp.float32), jnp.asarray([1], jnp.int32), in_features=4, out_features=6
    )
    np.testing.assert_array_equal(np.asarray(got), w)
    # Wide W[4, 6]: blocks (1, 0), (0, 1), (1, 2).
    w = np.zeros((4, 6))
    w[2:4, 0:2], w[0:2, 2:4], w[2:4, 4:6] = values[0, 0], values[0, 1], values[0, 2]
    got = dd.diag_to_dense(
        jnp.asarray(values, jnp.float32), jnp.asarray([1], jnp.int32), in_features=6, out_features=4
    )
    np.testing.assert_array_equal(np.asarray(got), w)


@pytest.mark.parametrize("in_f,out_f,b", SHAPES)
def test_diag_to_dense_follows_the_design_formulas(in_f, out_f, b, rng):
    x, values, offsets = make_case(rng, in_f, out_f, b, "duplicates")
    del x
    w = dd.diag_to_dense(values, offsets, in_features=in_f, out_features=out_f)
    np.testing.assert_allclose(np.asarray(w), design_dense(values, offsets, in_f, out_f), atol=1e-6)


@pytest.mark.parametrize("impl", impls(8))
@pytest.mark.parametrize("in_f,out_f,b", SHAPES)
@pytest.mark.parametrize("k_kind", ["one", "all", "duplicates"])
def test_forward_matches_dense(impl, in_f, out_f, b, k_kind, rng):
    if impl not in impls(b):
        pytest.skip(f"{impl} does not run b = {b} here")
    x, values, offsets = make_case(rng, in_f, out_f, b, k_kind)
    y = jax.jit(lambda x, v, o: dd.diag_matmul(x, v, o, out_features=out_f, impl=impl))(
        x, values, offsets
    )
    assert y.shape == (5, out_f) and y.dtype == jnp.float32
    w = design_dense(values, offsets, in_f, out_f)
    assert_close_f32(y, np.asarray(x, np.float64) @ w.T, f"{impl} y")


@pytest.mark.parametrize("impl", impls(8))
@pytest.mark.parametrize("in_f,out_f,b", [(16, 48, 8), (48, 16, 8), (24, 24, 8), (96, 32, 16)])
def test_gradients_match_dense(impl, in_f, out_f, b, rng):
    x, values, offsets = make_case(rng, in_f, out_f, b, "duplicates", batch=(3, 4))
    dy = jnp.asarray(rng.standard_normal((3, 4, out_f)).astype(np.float32))

    def loss(x, values):
        return jnp.sum(dd.diag_matmul(x, values, offsets, out_features=out_f, impl=impl) * dy)

    dx, dvalues = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, values)
    w = design_dense(values, offsets, in_f, out_f)
    dy64 = np.asarray(dy, np.float64).reshape(-1, out_f)
    assert_close_f32(dx, (dy64 @ w).reshape(x.shape), f"{impl} dx")
    assert_close_f32(dvalues, design_dvalues(dy, x, offsets, in_f, out_f, b), f"{impl} dvalues")


@pytest.mark.parametrize("impl", impls(8, dense=False))
@pytest.mark.parametrize("in_f,out_f", [(32, 96), (96, 32), (48, 48)])
def test_bfloat16_within_twice_the_bf16_reference_error(impl, in_f, out_f, rng):
    b = 8
    x, values, offsets = make_case(rng, in_f, out_f, b, "duplicates", batch=(17,))
    xb, vb = x.astype(jnp.bfloat16), values.astype(jnp.bfloat16)
    dyb = jnp.asarray(rng.standard_normal((17, out_f)), jnp.bfloat16)
    w = design_dense(np.asarray(vb, np.float32), offsets, in_f, out_f)
    x64, dy64 = np.asarray(xb, np.float64), np.asarray(dyb, np.float64)
    exact = {
        "y": x64 @ w.T,
        "dx": dy64 @ w,
        "dvalues": design_dvalues(dy64, x64, offsets, in_f, out_f, b),
    }

    def run(impl):
        def loss(x, v):
            y = dd.diag_matmul(x, v, offsets, out_features=out_f, impl=impl)
            return jnp.sum((y * dyb).astype(jnp.float32)), y

        (_, y), (dx, dv) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(xb, vb)
        return {"y": y, "dx": dx, "dvalues": dv}

    got, ref = run(impl), run("dense")
    for name in ("y", "dx", "dvalues"):
        assert got[name].dtype == jnp.bfloat16, name
        ref_err = np.max(np.abs(np.asarray(ref[name], np.float64) - exact[name]))
        err = np.max(np.abs(np.asarray(got[name], np.float64) - exact[name]))
        assert err <= LOWP_ERR_FACTOR * ref_err + LOWP_ATOL, f"{impl} {name}: {err} vs {ref_err}"


@pytest.mark.parametrize("impl", impls(8, dense=False))
def test_leading_dims_and_empty_batch(impl, rng):
    x, values, offsets = make_case(rng, 16, 40, 8, "all", batch=(2, 3, 4))
    y = dd.diag_matmul(x, values, offsets, out_features=40, impl=impl)
    assert y.shape == (2, 3, 4, 40)
    w = design_dense(values, offsets, 16, 40)
    assert_close_f32(y, np.asarray(x, np.float64) @ w.T, "leading dims")
    empty = jnp.zeros((0, 16), jnp.float32)
    assert dd.diag_matmul(empty, values, offsets, out_features=40, impl=impl).shape == (0, 40)
    g = jax.grad(lambda v: jnp.sum(dd.diag_matmul(empty, v, offsets, out_features=40, impl=impl)))
    np.testing.assert_array_equal(g(values), np.zeros(values.shape, np.float32))


@pytest.mark.parametrize("impl", impls(8, dense=False))
def test_per_example_gradients_with_vmap_of_grad(impl, rng):
    x, values, offsets = make_case(rng, 24, 16, 8, "all", batch=(4,))

    def loss(v, xi, impl=impl):
        return jnp.sum(jnp.sin(dd.diag_matmul(xi, v, offsets, out_features=16, impl=impl)))

    per_example = jax.jit(jax.vmap(jax.grad(loss), in_axes=(None, 0)))(values, x)
    expected = jax.vmap(jax.grad(lambda v, xi: loss(v, xi, "dense")), in_axes=(None, 0))(values, x)
    assert per_example.shape == (4,) + values.shape
    assert_close_f32(per_example, expected, "per-example dvalues")


def test_any_common_divisor_runs_on_the_jax_path(rng):
    x, values, offsets = make_case(rng, 6, 10, 2, "duplicates")
    w = design_dense(values, offsets, 6, 10)
    for impl in ("jax", "dense"):
        y = jax.jit(lambda x, v, o, impl=impl: dd.diag_matmul(x, v, o, out_features=10, impl=impl))(
            x, values, offsets
        )
        assert_close_f32(y, np.asarray(x, np.float64) @ w.T, impl)
    assert "jax" in dd.available_impls(block_size=2)


@pytest.mark.parametrize("in_f,out_f", [(16, 48), (48, 16)])
def test_jax_path_builds_no_dense_matrix(in_f, out_f, rng):
    x, values, offsets = make_case(rng, in_f, out_f, 8, "all", batch=(7,))

    def loss(x, v):
        return jnp.sum(dd.diag_matmul(x, v, offsets, out_features=out_f, impl="jax") ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, values)
    text = str(jaxpr)
    for shape in ((out_f, in_f), (in_f, out_f)):
        assert f"[{shape[0]},{shape[1]}]" not in text, f"dense {shape} array in the jaxpr"


def test_auto_uses_block_kernels_only_where_the_platform_has_them(rng):
    x, values, offsets = make_case(rng, 16, 48, 8, "all")
    f = jax.jit(lambda x, v: dd.diag_matmul(x, v, offsets, out_features=48))
    text = f.lower(x, values).as_text()  # "auto" is decided in the lowering, for its platform
    if "ffi" in dd.available_impls(block_size=8):
        assert "custom_call @dynadiag_diag_matmul_v2_fwd" in text
    else:
        assert "custom_call" not in text  # the pure-JAX path
        if "ffi" in dd.available_impls():
            with pytest.raises(ValueError, match="no block-diagonal kernels"):
                dd.diag_matmul(x, values, offsets, out_features=48, impl="ffi")


def test_kernels_reject_block_sizes_outside_the_kernel_set(rng):
    if "ffi" not in dd.available_impls():
        pytest.skip("no compiled kernels")
    x, values, offsets = make_case(rng, 12, 24, 4, "all")
    with pytest.raises(ValueError, match=r"block sizes b in \(8, 16, 32, 64, 128\), got b = 4"):
        dd.diag_matmul(x, values, offsets, out_features=24, impl="ffi")
    y = dd.diag_matmul(x, values, offsets, out_features=24)  # auto: the jax path
    assert_close_f32(y, np.asarray(x, np.float64) @ design_dense(values, offsets, 12, 24).T, "b=4")


@pytest.mark.parametrize("in_f,out_f,b", [(16, 48, 8), (64, 32, 16)])
def test_ffi_targets_take_rank4_values(in_f, out_f, b, rng):
    """The block forms lower to the same three targets, with rank-4 values and dvalues."""
    if "ffi" not in dd.available_impls():
        pytest.skip("no compiled kernels")
    backend = _BACKENDS["ffi"]
    x, values, offsets = make_case(rng, in_f, out_f, b, "all", batch=(6,))
    dy = jnp.ones((6, out_f), jnp.float32)

    def products(x, v, o, dy):
        y = backend.fwd(x, v, o, out_features=out_f)
        dx = backend.dx(dy, v, o, in_features=in_f)
        return y, dx, backend.dvalues(dy, x, o, block_size=b), backend.bwd(dy, x, v, o)

    lowered = jax.jit(products).lower(x, values, offsets, dy)
    vshape = "x".join(map(str, values.shape))
    hlo = lowered.as_text()
    for kind in ("fwd", "dx", "dvalues"):
        assert f"dynadiag_diag_matmul_v2_{kind}" in hlo, kind
    assert f"tensor<{vshape}xf32>" in hlo
    shapes = [o.shape for o in jax.tree.leaves(lowered.out_info)]
    assert shapes == [(6, out_f), (6, in_f), values.shape, (6, in_f), values.shape]
