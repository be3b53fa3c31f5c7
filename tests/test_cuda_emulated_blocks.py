"""The CUDA block-diagonal kernels (values[K, L_b, b, b]) under the SIMT emulation.

tests/test_diag_matmul_blocks.py runs every implementation, this one included, over the block
contract (shapes, K, repeats, vmap, leading dimensions); here: the CUDA paths themselves (tensor
cores for 16-bit b >= 16, CUDA cores for float32 and b = 8), both panel layouts (outputs along the
long or the short block axis), rows across 128-row slabs, the row-split dvalues and its workspace,
NaN for a bad traced offset and the handlers' block validation. Tolerances as in
tests/test_cuda_emulated.py: float64 exact products, low precision within twice XLA's dense error
plus one ulp of the scale.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynadiag_jax as dd
from dynadiag_jax import launch_plan
from dynadiag_jax.layout import geometry
from dynadiag_jax.ops import cuda
from dynadiag_jax.ops.reference import diag_matmul_dvalues_reference

pytestmark = pytest.mark.skipif(
    "cuda_emulated" not in dd.available_impls(block_size=16),
    reason="emulated CUDA block targets not built",
)

IMPL = "cuda_emulated"
ULPS = {jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-11}
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def dense_w(values, offsets, in_f, out_f):
    w = dd.diag_to_dense(
        jnp.asarray(values, jnp.float32), jnp.asarray(offsets), in_features=in_f, out_features=out_f
    )
    return np.asarray(w, np.float64)


def exact(x, values, offsets, dy, out_f):
    """float64 y, dx, dvalues of sum(y * dy)."""
    in_f, b = x.shape[-1], values.shape[-1]
    w = dense_w(values, offsets, in_f, out_f)
    x64, dy64 = np.asarray(x, np.float64), np.asarray(dy, np.float64)
    dw = dy64.T @ x64
    geo = geometry(in_f, out_f, b)
    t = np.arange(geo.length)
    dv = np.zeros(values.shape)
    for k, d in enumerate(np.asarray(offsets)):
        wrapped = (t + d) % geo.num_candidates
        brow, bcol = (t, wrapped) if geo.tall else (wrapped, t)
        for i in range(geo.length):
            dv[k, i] = dw[brow[i] * b : (brow[i] + 1) * b, bcol[i] * b : (bcol[i] + 1) * b]
    return x64 @ w.T, dy64 @ w, dv


def run(impl, x, values, offsets, dy, out_f):
    def loss(x, v):
        y = dd.diag_matmul(x, v, offsets, out_features=out_f, impl=impl)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, values)
    return (y, *grads)


def check(rng, rows, in_f, out_f, b, offsets, dtype):
    geo = geometry(in_f, out_f, b)
    offsets = jnp.asarray(offsets, jnp.int32)
    x = jnp.asarray(rng.standard_normal((rows, in_f)), dtype)
    values = jnp.asarray(rng.standard_normal((len(offsets), *geo.values_shape)), dtype)
    dy = jnp.asarray(rng.standard_normal((rows, out_f)), dtype)
    want = exact(x, values, offsets, dy, out_f)
    got = run(IMPL, x, values, offsets, dy, out_f)
    lowp = run("dense", x, values, offsets, dy, out_f) if dtype != jnp.float32 else want
    for name, g, e, lp in zip(("y", "dx", "dvalues"), got, want, lowp):
        assert g.dtype == dtype and g.shape == e.shape, name
        g64 = np.asarray(g, np.float64)
        scale = max(1.0, float(np.max(np.abs(e), initial=0)))
        if dtype == jnp.float32:
            bound = 2e-5 * scale
        else:
            bound = 2 * float(np.max(np.abs(np.asarray(lp, np.float64) - e), initial=0))
            bound += ULPS[dtype] * scale
        err = float(np.max(np.abs(g64 - e), initial=0))
        assert err <= bound, (
            f"{name} ({in_f}->{out_f}, b={b}, {dtype.__name__}): {err:.3g} > {bound:.3g}"
        )


SHAPES = [(32, 64), (64, 32), (48, 48), (48, 80), (80, 48)]  # tall, wide, square, L_b % P_b != 0


@pytest.mark.parametrize("in_f,out_f", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
def test_tensor_core_path(in_f, out_f, dtype, rng):
    p_b = min(in_f, out_f) // 16
    check(rng, 20, in_f, out_f, 16, [p_b - 1, 0, 0], dtype)  # repeats add up


@pytest.mark.parametrize("shape", ["tall", "wide", "square"])
@pytest.mark.parametrize("b", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=lambda d: d.__name__)
def test_tensor_core_path_at_every_block_size(shape, b, dtype, rng):
    # tall 2b -> 5b: 3 wraps, the last one short (L_b % P_b != 0), so forward panels have unused
    # columns (b = 16: 3 blocks in a 64-column kernel; b = 64: a second panel of one block) and dx
    # entries past L_b; 37 rows: a partial row slab
    in_f, out_f = {"tall": (2 * b, 5 * b), "wide": (5 * b, 2 * b), "square": (3 * b, 3 * b)}[shape]
    assert launch_plan.block_product_plan("fwd", in_f, out_f, b, dtype).tensor_cores
    p_b = min(in_f, out_f) // b
    check(rng, 37, in_f, out_f, b, [p_b - 1, 0, 0], dtype)


def test_tensor_core_rows_across_slabs_of_both_heights(rng):
    # b = 16, 32 -> 64: 32-column panels (256-row slabs) forward, 16-column ones in dx; 300 rows
    for kind in ("fwd", "dx"):
        assert launch_plan.block_product_plan(kind, 32, 64, 16, jnp.bfloat16).slab_rows == 256
    assert launch_plan.block_product_plan("fwd", 32, 256, 16, jnp.bfloat16).slab_rows == 128
    check(rng, 300, 32, 64, 16, [1, 0], jnp.bfloat16)
    check(rng, 300, 32, 256, 16, [1, 0], jnp.float16)


@pytest.mark.parametrize("in_f,out_f,b", [(32, 64, 8), (64, 32, 16), (48, 80, 16), (64, 128, 32)])
def test_cuda_core_path_in_float32(in_f, out_f, b, rng):
    p_b = min(in_f, out_f) // b
    check(rng, 20, in_f, out_f, b, rng.integers(0, p_b, 3), jnp.float32)


@pytest.mark.parametrize("in_f,out_f", [(32, 64), (64, 32)])
def test_block_size_8_runs_on_cuda_cores_in_16_bit(in_f, out_f, rng):
    plan = launch_plan.block_product_plan("fwd", in_f, out_f, 8, jnp.bfloat16)
    assert not plan.tensor_cores
    check(rng, 20, in_f, out_f, 8, [3, 1], jnp.bfloat16)


@pytest.mark.parametrize("in_f,out_f", [(32, 64), (64, 32)])
def test_k_equal_p_b_and_rows_across_slabs(in_f, out_f, rng):
    # 130 rows: a full 128-row slab and a slab of 2
    check(rng, 130, in_f, out_f, 16, np.arange(min(in_f, out_f) // 16), jnp.bfloat16)


def test_wide_panels_of_several_wraps(rng):
    # 32 -> 256 at b = 16: 8 wraps; a forward panel holds them all (128 columns)
    plan = launch_plan.block_product_plan("fwd", 32, 256, 16, jnp.bfloat16)
    assert plan.out_long and plan.wraps == 8 and plan.wraps_per_panel == 8
    check(rng, 9, 32, 256, 16, [1], jnp.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_dvalues_split_over_rows_and_a_smaller_workspace(dtype, rng):
    rows, in_f, out_f, b = 1100, 32, 64, 16
    offsets = jnp.asarray([1, 0], jnp.int32)
    plan = launch_plan.block_sddmm_plan(rows, in_f, out_f, 2, b, dtype)
    assert plan.splits > 1 and plan.workspace_bytes > 0
    x = jnp.asarray(rng.standard_normal((rows, in_f)), dtype)
    dy = jnp.asarray(rng.standard_normal((rows, out_f)), dtype)
    values = jnp.zeros((2, 4, b, b), dtype)
    want = exact(x, values, offsets, dy, out_f)[2]
    for nbytes in (plan.workspace_bytes, plan.workspace_bytes // 2, 1):
        call = jax.ffi.ffi_call(
            f"{cuda.EMULATED_PREFIX}_dvalues",
            (jax.ShapeDtypeStruct(values.shape, dtype), jax.ShapeDtypeStruct((nbytes,), jnp.uint8)),
        )
        got = np.asarray(call(dy, x, offsets)[0], np.float64)
        tol = (2e-5 if dtype == jnp.float32 else 2e-2) * np.max(np.abs(want))
        assert np.max(np.abs(got - want)) <= tol, nbytes


# one rounding of the result to the dtype, plus float32 sums in another order
DVALUES_TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2.0**-8 + 2e-5, jnp.float16: 2.0**-11 + 2e-5}


def emulated_dvalues(dy, x, offsets, values_shape, nbytes):
    call = jax.ffi.ffi_call(
        f"{cuda.EMULATED_PREFIX}_dvalues",
        (
            jax.ShapeDtypeStruct(values_shape, x.dtype),
            jax.ShapeDtypeStruct((max(nbytes, 1),), jnp.uint8),
        ),
    )
    return np.asarray(call(dy, x, jnp.asarray(offsets, jnp.int32))[0], np.float64)


def check_dvalues(rng, rows, in_f, out_f, b, offsets, dtype, nbytes=None):
    """The emulated dvalues against the pure-JAX reference; NaN for out-of-range offsets."""
    geo = geometry(in_f, out_f, b)
    offsets = np.asarray(offsets)
    x = jnp.asarray(rng.standard_normal((rows, in_f)), dtype)
    dy = jnp.asarray(rng.standard_normal((rows, out_f)), dtype)
    if nbytes is None:
        nbytes = launch_plan.workspace_bytes(
            "dvalues", rows, in_f, out_f, len(offsets), dtype, block_size=b
        )
    got = emulated_dvalues(dy, x, offsets, (len(offsets), *geo.values_shape), nbytes)
    ok = (offsets >= 0) & (offsets < geo.num_candidates)
    want = np.asarray(
        diag_matmul_dvalues_reference(
            dy, x, jnp.asarray(offsets[ok]), block_size=b, dtype=jnp.float32
        ),
        np.float64,
    )
    assert np.isnan(got[~ok]).all()
    tol = DVALUES_TOL[dtype] * max(1.0, float(np.max(np.abs(want))))
    err = float(np.max(np.abs(got[ok] - want)))
    assert err <= tol, f"{in_f}->{out_f}, b={b}, {dtype.__name__}: {err:.3g} > {tol:.3g}"


@pytest.mark.parametrize("shape", ["tall", "wide", "square"])
@pytest.mark.parametrize("b", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_dvalues_at_every_block_size(shape, b, dtype, rng):
    # 2b -> 5b: 3 wraps, the last one short; at b = 128 a CTA's wrap chunk lies past L_b. Rows: two
    # full pipeline stages and a partial one. Offsets: a repeat and one out of range (NaN).
    in_f, out_f = {"tall": (2 * b, 5 * b), "wide": (5 * b, 2 * b), "square": (3 * b, 3 * b)}[shape]
    plan = launch_plan.block_sddmm_plan(64, in_f, out_f, 4, b, dtype)
    assert plan.tensor_cores == (dtype != jnp.float32)
    rows = 2 * plan.stage_rows + 5
    p_b = min(in_f, out_f) // b
    check_dvalues(rng, rows, in_f, out_f, b, [p_b - 1, 0, 0, p_b], dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_dvalues_of_more_diagonals_and_wraps_than_one_cta_holds(dtype, rng):
    # 32 -> 256 at b = 16: 8 wraps a CTA; 12 diagonals in groups (6 on tensor cores)
    plan = launch_plan.block_sddmm_plan(70, 32, 256, 12, 16, dtype)
    assert plan.groups > 1 and plan.wraps_per_cta == 8
    check_dvalues(rng, 70, 32, 256, 16, rng.integers(0, 2, 12), dtype)
    # 64 -> 320 at b = 64: wrap chunks of 2 of the 5 wraps (the last one holds one)
    plan = launch_plan.block_sddmm_plan(40, 64, 320, 3, 64, dtype)
    assert plan.wrap_chunks == 3
    check_dvalues(rng, 40, 64, 320, 64, [0, 0, -1], dtype)


@pytest.mark.parametrize("b", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: d.__name__)
def test_backward_matches_the_gradient_of_the_reference(b, dtype, rng):
    # dx and dvalues of the emulated custom call against jax.grad through the pure-JAX path
    in_f, out_f, rows = 2 * b, 3 * b, 37
    geo = geometry(in_f, out_f, b)
    offsets = jnp.asarray([1, 0], jnp.int32)
    x = jnp.asarray(rng.standard_normal((rows, in_f)), dtype)
    values = jnp.asarray(rng.standard_normal((2, *geo.values_shape)), dtype)
    dy = jnp.asarray(rng.standard_normal((rows, out_f)), dtype)
    got = run(IMPL, x, values, offsets, dy, out_f)[1:]
    want = run("jax", x.astype(jnp.float32), values.astype(jnp.float32), offsets, dy, out_f)[1:]
    for name, g, w in zip(("dx", "dvalues"), got, want):
        w = np.asarray(w, np.float64)
        tol = DVALUES_TOL[dtype] * max(1.0, float(np.max(np.abs(w))))
        assert g.dtype == dtype
        assert float(np.max(np.abs(np.asarray(g, np.float64) - w))) <= tol, name


def test_traced_offset_out_of_range_gives_nan(rng):
    x = jnp.asarray(rng.standard_normal((5, 32)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((2, 4, 16, 16)), jnp.bfloat16)

    def loss(v, off):
        y = dd.diag_matmul(x, v, off, out_features=64, impl=IMPL)
        return jnp.sum(y.astype(jnp.float32)), y

    f = jax.jit(jax.grad(loss, has_aux=True))
    dv, y = f(v, jnp.asarray([1, 0], jnp.int32))
    assert np.isfinite(np.asarray(y, np.float32)).all()
    for bad in (2, -1):
        dv, y = f(v, jnp.asarray([1, bad], jnp.int32))
        assert np.isnan(np.asarray(y, np.float32)).all()
        dv = np.asarray(dv, np.float32)
        assert np.isnan(dv[1]).all() and np.isfinite(dv[0]).all()


@pytest.mark.parametrize(
    "kind,a_shape,b_shape,out_shape,match",
    [
        ("fwd", (3, 32), (2, 8, 4, 4), (3, 64), r"b in \{8, 16, 32, 64, 128\}, got \[2, 8, 4, 4\]"),
        ("fwd", (3, 32), (2, 4, 16, 8), (3, 64), r"values must have shape \[K, L_b, b, b\] with b"),
        ("fwd", (3, 40), (2, 5, 16, 16), (3, 64), r"b = 16 must divide in_features = 40"),
        ("dx", (3, 64), (2, 3, 16, 16), (3, 32), r"values must have shape .* = \[K, 4, 16, 16\]"),
        ("dvalues", (3, 64), (3, 32), (2, 4, 16, 16), r"dvalues must have shape .* = \[3, 4, 16"),
    ],
)
def test_handlers_validate_block_operands(kind, a_shape, b_shape, out_shape, match):
    offsets = jnp.asarray([0, 1, 1], jnp.int32)
    call = jax.ffi.ffi_call(
        f"{cuda.EMULATED_PREFIX}_{kind}",
        (jax.ShapeDtypeStruct(out_shape, jnp.float32), jax.ShapeDtypeStruct((4096,), jnp.uint8)),
    )
    if kind != "dvalues":
        offsets = offsets[: b_shape[0]]
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(call(jnp.ones(a_shape), jnp.ones(b_shape), offsets))


def test_layers_too_large_for_32_bit_indices_are_rejected():
    with pytest.raises(ValueError, match=r"in_features \+ out_features = .* below 2\^31"):
        launch_plan.workspace_bytes("fwd", 4, 2**30, 2**30, 3, jnp.bfloat16)
