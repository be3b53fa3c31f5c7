"""The CUDA kernels, run on the CPU through the SIMT emulation (impl="cuda_emulated").

The emulated targets are the CUDA source and handler code compiled for the host, so these tests
check the logic a GPU would run: custom_vjp -> forward, dx and dvalues kernels, the tile structure
the device computes, both kernel paths, and the handlers' validation. Every result is compared with
a float64 dense reference; low-precision results may be at most twice as wrong as XLA's dense dot
in the same dtype (an error budget relative to the dense reference, not a fixed tolerance).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynadiag_jax as dd
from dynadiag_jax import gpu_cost, launch_plan
from dynadiag_jax.layout import diag_indices, geometry
from dynadiag_jax.ops import cuda

pytestmark = pytest.mark.skipif(
    "cuda_emulated" not in dd.available_impls(), reason="emulated CUDA targets not built"
)

IMPL = "cuda_emulated"
F32_RTOL = 2e-5  # relative to the largest reference magnitude
LOWP_ERR_FACTOR = 2.0  # low precision: at most this times the dense dot's own error ...
LOWP_ULPS = {jnp.bfloat16: 2.0**-8, jnp.float16: 2.0**-11}  # ... plus one ulp of the scale
LOWP_DTYPES = [jnp.bfloat16, jnp.float16]
DTYPES = [jnp.float32, *LOWP_DTYPES]

SHAPES = [(1, 1), (7, 7), (7, 33), (33, 7), (33, 33), (48, 100), (100, 48), (130, 130)]


def offsets_of(kind, rng, p):
    """Diagonal ids: one, random (scattered), band (adjacent: tensor cores), all, repeated."""
    if kind == "one":
        return np.array([p // 2])
    if kind == "random":
        return rng.choice(p, max(1, p // 4), replace=False)
    if kind == "band":  # top diagonal = 1 mod 16: it alone enters some tiles, at one corner entry
        return (16 * (p // 48) + 2 + np.arange(min(p, 16))) % p
    if kind == "all":
        return rng.permutation(p)
    if kind == "repeated":
        return np.concatenate([rng.integers(0, p, max(1, p // 5)), [0, 0, p - 1, p - 1]])
    raise ValueError(kind)


def dense_w(values, offsets, in_f, out_f):
    rows, cols = (np.asarray(a) for a in diag_indices(jnp.asarray(offsets), in_f, out_f))
    w = np.zeros((out_f, in_f))
    np.add.at(w, (rows, cols), np.asarray(values, np.float64))
    return w


def reference(x, values, offsets, dy, out_f):
    """float64 y, dx, dvalues of sum(diag_matmul(x, values) * dy)."""
    in_f = x.shape[-1]
    w = dense_w(values, offsets, in_f, out_f)
    x64 = np.asarray(x, np.float64).reshape(-1, in_f)
    dy64 = np.asarray(dy, np.float64).reshape(-1, out_f)
    rows, cols = (np.asarray(a) for a in diag_indices(jnp.asarray(offsets), in_f, out_f))
    y = (x64 @ w.T).reshape(x.shape[:-1] + (out_f,))
    return y, (dy64 @ w).reshape(x.shape), (dy64.T @ x64)[rows, cols]


def run(impl, x, values, offsets, dy, out_f):
    """y and (dx, dvalues) of sum(y * dy) under jit."""

    def loss(x, v):
        y = dd.diag_matmul(x, v, offsets, out_features=out_f, impl=impl)
        return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32)), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, values)
    return (y, *grads)


def assert_close(got, exact, what, dtype, lowp_ref=None):
    got = np.asarray(got, np.float64)
    scale = max(1.0, float(np.max(np.abs(exact), initial=0.0)))
    err = float(np.max(np.abs(got - exact), initial=0.0))
    if dtype == jnp.float32:
        bound = F32_RTOL * scale
    else:
        ref_err = float(np.max(np.abs(np.asarray(lowp_ref, np.float64) - exact), initial=0.0))
        bound = LOWP_ERR_FACTOR * ref_err + LOWP_ULPS[dtype] * scale
    assert err <= bound, f"{what}: max abs error {err:.3g} > {bound:.3g}"


def make(rng, shape, in_f, out_f, offsets, dtype):
    d = min(in_f, out_f)
    x = jnp.asarray(rng.standard_normal(shape + (in_f,)), dtype)
    values = jnp.asarray(rng.standard_normal((len(offsets), d)), dtype)
    dy = jnp.asarray(rng.standard_normal(shape + (out_f,)), dtype)
    return x, values, jnp.asarray(offsets, jnp.int32), dy


def check_all(rng, shape, in_f, out_f, kind, dtype):
    offsets = offsets_of(kind, rng, max(in_f, out_f))
    x, values, off, dy = make(rng, shape, in_f, out_f, offsets, dtype)
    # the exact products of the rounded inputs
    exact = reference(x, values, offsets, dy, out_f)
    got = run(IMPL, x, values, off, dy, out_f)
    lowp = run("dense", x, values, off, dy, out_f) if dtype != jnp.float32 else (None,) * 3
    for name, g, e, lp in zip(("y", "dx", "dvalues"), got, exact, lowp):
        assert g.dtype == dtype and g.shape == e.shape, name
        assert_close(g, e, f"{name} ({kind}, {in_f}->{out_f}, {jnp.dtype(dtype).name})", dtype, lp)


OFFSET_KINDS = ["one", "random", "band", "all", "repeated"]


@pytest.mark.parametrize("dtype", LOWP_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("in_f,out_f", SHAPES)
@pytest.mark.parametrize("kind", OFFSET_KINDS)
def test_forward_and_gradients_match_dense(kind, in_f, out_f, dtype, rng):
    check_all(rng, (9,), in_f, out_f, kind, dtype)


# float32 (the diagonal path only) also runs the case matrix of tests/test_diag_matmul.py.
@pytest.mark.parametrize("in_f,out_f", [(7, 33), (33, 7), (33, 33)])
@pytest.mark.parametrize("kind", OFFSET_KINDS)
def test_float32_forward_and_gradients_match_dense(kind, in_f, out_f, rng):
    check_all(rng, (9,), in_f, out_f, kind, jnp.float32)


# A single row or column of W: the float32 matrix gets these shapes from tests/test_diag_matmul.py.
@pytest.mark.parametrize("dtype", LOWP_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("in_f,out_f", [(1, 7), (7, 1)])
@pytest.mark.parametrize("kind", ["all", "repeated"])
def test_one_row_or_column_matches_dense(kind, in_f, out_f, dtype, rng):
    check_all(rng, (9,), in_f, out_f, kind, dtype)


@pytest.mark.parametrize("dtype", LOWP_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_leading_dims_and_two_batch_tiles(dtype, rng):
    # 2 * 3 * 12 = 72 rows: the kernels' 64-row batch tiles split the batch
    check_all(rng, (2, 3, 12), 40, 24, "band", dtype)
    check_all(rng, (2, 3, 12), 24, 40, "random", dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_dvalues_split_over_rows(dtype, rng):
    # many rows, small K * D: the SDDMM splits the rows and sums the partials in a second kernel
    assert launch_plan.sddmm_splits(600, 40, 24, 8) > 1
    check_all(rng, (600,), 40, 24, "band", dtype)


@pytest.mark.parametrize("in_f,out_f", [(33, 33), (48, 100), (100, 48)])
def test_both_paths_are_exercised(in_f, out_f, rng):
    const = launch_plan.constants()
    p = max(in_f, out_f)
    band = offsets_of("band", rng, p)
    lone = [p // 3]  # one diagonal: 1/16 of a tile at most
    geo = geometry(in_f, out_f)
    for kind in ("fwd", "dx"):
        path = gpu_cost.element_structure(band, kind, geo, jnp.bfloat16).path
        assert (path == const.PATH_TENSOR_CORE).any()
        path = gpu_cost.element_structure(lone, kind, geo, jnp.bfloat16).path
        assert (path == const.PATH_DIAGONAL).any()


def emulated_call(kind, a, b, offsets, out_shape, out_dtype, in_f, out_f, nbytes=None):
    """Call one emulated target directly (with the planned workspace unless ``nbytes`` is given).

    Returns (result, workspace).
    """
    rows = int(np.prod(a.shape[:-1]))
    values_shape = out_shape if kind == "dvalues" else b.shape
    block_size = values_shape[-1] if len(values_shape) == 4 else 1
    if nbytes is None:
        k = offsets.shape[0]
        nbytes = launch_plan.workspace_bytes(
            kind, rows, in_f, out_f, k, a.dtype, block_size=block_size
        )
    call = jax.ffi.ffi_call(
        f"{cuda.EMULATED_PREFIX}_{kind}",
        (
            jax.ShapeDtypeStruct(out_shape, out_dtype),
            jax.ShapeDtypeStruct((max(nbytes, 1),), jnp.uint8),
        ),
    )
    return call(a, b, offsets)


@pytest.mark.parametrize("in_f,out_f", [(33, 33), (48, 100), (100, 48), (7, 130)])
@pytest.mark.parametrize("kind", ["fwd", "dx"])
def test_device_plan_equals_the_cost_models_structure(kind, in_f, out_f, rng):
    const = launch_plan.constants()
    # the plan kernel's lists, touched tiles, paths and packed tiles, read back from the workspace
    p = max(in_f, out_f)
    offsets = np.concatenate([offsets_of("band", rng, p), rng.choice(p, 5), [3, 3]])
    k = len(offsets)
    layout = launch_plan.product_layout(kind, in_f, out_f, k, jnp.bfloat16)
    a_f, o_f = (in_f, out_f) if kind == "fwd" else (out_f, in_f)
    a = jnp.ones((3, a_f), jnp.bfloat16)
    values = rng.integers(-4, 5, (k, min(in_f, out_f)))  # small integers: exact sums in bfloat16
    _, ws = emulated_call(
        kind,
        a,
        jnp.asarray(values, jnp.bfloat16),
        jnp.asarray(offsets, jnp.int32),
        (3, o_f),
        jnp.bfloat16,
        in_f,
        out_f,
    )
    ws = np.asarray(ws)

    def seg(at, n, dtype=np.int32):
        return ws[at : at + np.dtype(dtype).itemsize * n].view(dtype)

    st = gpu_cost.element_structure(offsets, kind, geometry(in_f, out_f), jnp.bfloat16)
    rows, cols = (np.asarray(x) for x in diag_indices(jnp.asarray(offsets), in_f, out_f))
    o_idx, q_idx = (rows, cols) if kind == "fwd" else (cols, rows)
    n_ob, n_qb = layout.n_ob, layout.n_qb
    if layout.lists:
        nlist = seg(layout.nlist_at, n_ob)
        lists = seg(layout.list_at, n_ob * k).reshape(n_ob, k)
        np.testing.assert_array_equal(nlist, st.n_list)
        for ob in range(n_ob):
            touching = np.nonzero((o_idx // const.TILE == ob).any(axis=1))[0]
            np.testing.assert_array_equal(lists[ob, : nlist[ob]], touching)
    ntiles = seg(layout.ntiles_at, n_ob)
    np.testing.assert_array_equal(ntiles, st.n_tiles)
    np.testing.assert_array_equal(seg(layout.path_at, n_ob), st.path)
    assert (st.path == const.PATH_TENSOR_CORE).any()
    tiles = seg(layout.tiles_at, n_ob * n_qb).reshape(n_ob, n_qb)
    packed = seg(layout.packed_at, n_ob * n_qb * 256, np.uint16).astype(np.uint32) << 16
    packed = packed.view(np.float32).reshape(n_ob, n_qb, const.TILE, const.TILE)
    m = np.zeros((n_ob * const.TILE, n_qb * const.TILE))
    np.add.at(m, (o_idx, q_idx), values)
    for ob in range(n_ob):
        touched = np.unique(q_idx[o_idx // const.TILE == ob] // const.TILE)
        np.testing.assert_array_equal(tiles[ob, : ntiles[ob]], touched)
        if st.path[ob] != const.PATH_TENSOR_CORE:
            continue
        for slot, qb in enumerate(touched):
            want = m[
                ob * const.TILE : (ob + 1) * const.TILE,
                qb * const.TILE : (qb + 1) * const.TILE,
            ]
            np.testing.assert_array_equal(packed[ob, slot], want)


def test_float32_products_along_the_fixed_axis_need_no_workspace(rng):
    # wide fwd: outputs on the fixed axis, every diagonal touches every output: no plan at all;
    # wide dx: outputs on the moving axis: the plan lists the diagonals of each output block
    in_f, out_f, rows = 40, 24, 5
    assert launch_plan.workspace_bytes("fwd", rows, in_f, out_f, 9, jnp.float32) == 0
    assert 0 < launch_plan.workspace_bytes("dx", rows, in_f, out_f, 9, jnp.float32)
    assert launch_plan.workspace_bytes(
        "dx", rows, in_f, out_f, 9, jnp.float32
    ) < launch_plan.workspace_bytes("dx", rows, in_f, out_f, 9, jnp.bfloat16)
    offsets = offsets_of("band", rng, in_f)[:9]
    x, values, off, _ = make(rng, (rows,), in_f, out_f, offsets, jnp.float32)
    y_exact = reference(x, values, offsets, jnp.zeros((rows, out_f)), out_f)[0]
    got, _ = emulated_call("fwd", x, values, off, y_exact.shape, jnp.float32, in_f, out_f, nbytes=1)
    assert_close(got, y_exact, "fwd with a 1-byte workspace", jnp.float32)


def test_dvalues_with_a_smaller_workspace_splits_less(rng):
    # the handler plans with the workspace it is given: fewer row splits, the same sums
    rows, in_f, out_f = 600, 40, 24
    offsets = offsets_of("band", rng, in_f)
    x, values, off, dy = make(rng, (rows,), in_f, out_f, offsets, jnp.float32)
    planned = launch_plan.workspace_bytes("dvalues", rows, in_f, out_f, len(offsets))
    assert planned > 0
    exact = reference(x, values, offsets, dy, out_f)[2]
    for nbytes in (planned, planned // 2, 1):
        got, _ = emulated_call(
            "dvalues", dy, x, off, values.shape, jnp.float32, in_f, out_f, nbytes=nbytes
        )
        assert_close(got, exact, f"dvalues with {nbytes} workspace bytes", jnp.float32)


def test_workspace_bytes_is_the_cpp_plan_of_the_dtype():
    from dynadiag_jax import _plan_ext  # noqa: PLC0415 - present whenever this module runs

    element = [(1, 1), (7, 33), (33, 7), (768, 3072), (3072, 768), (130, 130)]
    block = [(32, 64, 16), (64, 32, 8), (768, 3072, 16), (3072, 768, 32), (128, 128, 64)]
    for rows in (0, 1, 100, 600, 5000, 100000):
        for in_f, out_f, b in [(i, o, 1) for i, o in element] + block:
            for k in (0, 1, 9, 300):
                for kind in ("fwd", "dx", "dvalues"):
                    for dtype in DTYPES:
                        tc = dtype != jnp.float32
                        want = _plan_ext.workspace_bytes(kind, rows, in_f, out_f, k, tc, b)
                        got = launch_plan.workspace_bytes(
                            kind, rows, in_f, out_f, k, dtype, block_size=b
                        )
                        assert got == want, (kind, rows, in_f, out_f, k, dtype, b)
                    # without a dtype: the most any dtype needs
                    most = max(
                        _plan_ext.workspace_bytes(kind, rows, in_f, out_f, k, tc, b)
                        for tc in (False, True)
                    )
                    assert (
                        launch_plan.workspace_bytes(kind, rows, in_f, out_f, k, block_size=b)
                        == most
                    )


def test_vmap_over_x_and_over_values(rng):
    in_f, out_f = 20, 36
    offsets = jnp.asarray(offsets_of("band", rng, out_f), jnp.int32)
    xs = jnp.asarray(rng.standard_normal((3, 5, in_f)), jnp.bfloat16)
    vs = jnp.asarray(rng.standard_normal((3, len(offsets), in_f)), jnp.bfloat16)

    def f(x, v):
        return dd.diag_matmul(x, v, offsets, out_features=out_f, impl=IMPL)

    for axes in ((0, None), (None, 0), (0, 0)):
        got = jax.jit(jax.vmap(f, in_axes=axes))(xs, vs if axes[1] == 0 else vs[0])
        for i in range(3):
            v = vs[i] if axes[1] == 0 else vs[0]
            x = xs[i] if axes[0] == 0 else xs
            exact = np.asarray(x, np.float64) @ dense_w(v, offsets, in_f, out_f).T
            lowp = dd.diag_matmul(x, v, offsets, out_features=out_f, impl="dense")
            assert_close(got[i], exact, f"vmap {axes}", jnp.bfloat16, lowp)


@pytest.mark.parametrize("dtype", LOWP_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_vmap_over_offsets(dtype, rng):
    # band offsets (tensor-core path) and scattered ones (diagonal path), element by element
    n, in_f, out_f = 3, 40, 24
    offs = np.stack([offsets_of("band", rng, in_f), rng.choice(in_f, 16, replace=False)] * 2)[:n]
    offs = jnp.asarray(offs, jnp.int32)
    xs = jnp.asarray(rng.standard_normal((n, 5, in_f)), dtype)
    vs = jnp.asarray(rng.standard_normal((n, offs.shape[1], out_f)), dtype)

    def f(impl):
        return lambda x, v, o: dd.diag_matmul(x, v, o, out_features=out_f, impl=impl)

    for axes in ((None, None, 0), (0, 0, 0)):
        args = [a if ax == 0 else a[0] for a, ax in zip((xs, vs, offs), axes)]
        got, lowp = (jax.jit(jax.vmap(f(impl), in_axes=axes))(*args) for impl in (IMPL, "dense"))
        for i in range(n):
            x, v, o = (a[i] if ax == 0 else a for a, ax in zip(args, axes))
            exact = np.asarray(x, np.float64) @ dense_w(v, o, in_f, out_f).T
            assert_close(got[i], exact, f"vmap {axes}, element {i}", dtype, lowp[i])


@pytest.mark.parametrize("dtype", LOWP_DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_per_example_gradients_with_vmap_of_grad(dtype, rng):
    n, in_f, out_f = 3, 24, 40
    offsets = np.concatenate([offsets_of("band", rng, out_f), [5, 5]])
    x, values, off, dy = make(rng, (n, 4), in_f, out_f, offsets, dtype)

    def grads(impl):
        def loss(x, v, dy):
            y = dd.diag_matmul(x, v, off, out_features=out_f, impl=impl)
            return jnp.sum(y.astype(jnp.float32) * dy.astype(jnp.float32))

        return jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None, 0))(x, values, dy)

    got, lowp = (jax.jit(functools.partial(grads, impl))() for impl in (IMPL, "dense"))
    assert got[1].shape == (n, *values.shape)
    for i in range(n):
        _, dx, dvalues = reference(x[i], values, offsets, dy[i], out_f)
        assert_close(got[0][i], dx, f"dx of example {i}", dtype, lowp[0][i])
        assert_close(got[1][i], dvalues, f"dvalues of example {i}", dtype, lowp[1][i])


def test_zero_rows_and_zero_diagonals():
    x = jnp.zeros((0, 20), jnp.bfloat16)
    v = jnp.ones((2, 20), jnp.bfloat16)
    off = jnp.asarray([1, 2], jnp.int32)
    assert dd.diag_matmul(x, v, off, out_features=36, impl=IMPL).shape == (0, 36)
    g = jax.grad(
        lambda v: jnp.sum(dd.diag_matmul(x, v, off, out_features=36, impl=IMPL).astype(jnp.float32))
    )(v)
    np.testing.assert_array_equal(np.asarray(g, np.float32), 0.0)
    x = jnp.ones((3, 20), jnp.float16)
    y = dd.diag_matmul(
        x, jnp.ones((0, 20), jnp.float16), jnp.zeros((0,), jnp.int32), out_features=36, impl=IMPL
    )
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.zeros((3, 36)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_traced_offset_out_of_range_gives_nan_without_a_host_sync(dtype):
    # A GPU kernel cannot report a bad offset without synchronising; it writes NaN instead.
    x = jnp.ones((3, 8), dtype)
    v = jnp.ones((16, 8), dtype)

    def loss(v, off):
        y = dd.diag_matmul(x, v, off, out_features=12, impl=IMPL)
        return jnp.sum(y.astype(jnp.float32)), y

    f = jax.jit(jax.grad(loss, has_aux=True))
    good = jnp.arange(16, dtype=jnp.int32) % 12
    dv, y = f(v, good)
    assert np.isfinite(np.asarray(y, np.float32)).all()
    assert np.isfinite(np.asarray(dv, np.float32)).all()
    for bad in (12, -1):
        dv, y = f(v, good.at[5].set(bad))
        assert np.isnan(np.asarray(y, np.float32)).all()  # every output
        dv = np.asarray(dv, np.float32)  # the bad diagonal's row of dvalues
        assert np.isnan(dv[5]).all() and np.isfinite(np.delete(dv, 5, axis=0)).all()


@pytest.mark.parametrize(
    "kind,a_shape,b_shape,out_shape,match",
    [
        (
            "fwd",
            (3, 8),
            (2, 7),
            (3, 12),
            r"values must have shape \[K, min\(in, out\)\] = \[K, 8\]",
        ),
        (
            "fwd",
            (3, 8),
            (2, 8),
            (4, 12),
            r"y \[4, 12\] must have the leading dimensions of x \[3, 8\]",
        ),
        ("dx", (3, 12), (2, 8), (3, 8), r"offsets must have shape \[K\] = \[2\], got \[3\]"),
        (
            "dvalues",
            (3, 12),
            (3, 8),
            (2, 7),
            r"dvalues must have shape \[K, min\(in, out\)\] = \[3, 8\]",
        ),
        ("dvalues", (3, 12), (4, 8), (3, 8), r"x \[4, 8\] must have the leading dimensions of dy"),
    ],
)
def test_handlers_validate_their_operands(kind, a_shape, b_shape, out_shape, match):
    offsets = jnp.asarray([0, 5, 1], jnp.int32)
    call = jax.ffi.ffi_call(
        f"{cuda.EMULATED_PREFIX}_{kind}",
        (jax.ShapeDtypeStruct(out_shape, jnp.float32), jax.ShapeDtypeStruct((4096,), jnp.uint8)),
    )
    with pytest.raises(Exception, match=match):
        jax.block_until_ready(call(jnp.ones(a_shape), jnp.ones(b_shape), offsets))


def test_handlers_reject_a_small_workspace_and_a_foreign_dtype():
    off = jnp.asarray([0, 5], jnp.int32)
    need = launch_plan.workspace_bytes("fwd", 3, 8, 12, 2)
    small = jax.ffi.ffi_call(
        f"{cuda.EMULATED_PREFIX}_fwd",
        (jax.ShapeDtypeStruct((3, 12), jnp.bfloat16), jax.ShapeDtypeStruct((need - 1,), jnp.uint8)),
    )
    with pytest.raises(Exception, match=f"workspace must have at least {need} bytes"):
        jax.block_until_ready(
            small(jnp.ones((3, 8), jnp.bfloat16), jnp.ones((2, 8), jnp.bfloat16), off)
        )
    mixed = jax.ffi.ffi_call(
        f"{cuda.EMULATED_PREFIX}_fwd",
        (jax.ShapeDtypeStruct((3, 12), jnp.float32), jax.ShapeDtypeStruct((need,), jnp.uint8)),
    )
    with pytest.raises(
        Exception, match=r"values must have the dtype of x \(float32\), got bfloat16"
    ):
        jax.block_until_ready(mixed(jnp.ones((3, 8)), jnp.ones((2, 8), jnp.bfloat16), off))


@pytest.mark.parametrize("kind", ["fwd", "dx", "dvalues"])
def test_handlers_name_a_foreign_offsets_or_workspace_dtype(kind):
    """Bound as typed buffers, they were refused by XLA's decoder as "bad operands at: 2" /
    "at: 4" (the workspace is a result); an int32 x was "an unsupported dtype"."""
    a, b, out = {"fwd": ((3, 8), (2, 8), (3, 12)), "dx": ((3, 12), (2, 8), (3, 8))}.get(
        kind, ((3, 12), (3, 8), (2, 8))
    )

    def call(offsets, workspace=jnp.uint8, a_dtype=jnp.float32):
        f = jax.ffi.ffi_call(
            f"{cuda.EMULATED_PREFIX}_{kind}",
            (jax.ShapeDtypeStruct(out, jnp.float32), jax.ShapeDtypeStruct((4096,), workspace)),
        )
        return jax.block_until_ready(f(jnp.ones(a, a_dtype), jnp.ones(b), offsets))

    for dtype, name in ((jnp.uint32, "uint32"), (jnp.float32, "float32")):
        with pytest.raises(Exception, match=f"offsets must be an int32 array \\[K\\], got {name}"):
            call(jnp.asarray([0, 5], dtype))
    with pytest.raises(
        Exception, match=r"workspace must be a uint8 array \[W\], got int8 \[4096\]"
    ):
        call(jnp.asarray([0, 5], jnp.int32), workspace=jnp.int8)
    first = "x" if kind == "fwd" else "dy"
    with pytest.raises(Exception, match=f"{first} must be float32, bfloat16 or float16, got int32"):
        call(jnp.asarray([0, 5], jnp.int32), a_dtype=jnp.int32)


@pytest.mark.parametrize(
    "kind, aliases, message",
    [
        ("fwd", {0: 0}, "y must not share memory with x"),
        ("dx", {0: 0}, "dx must not share memory with dy"),
        ("dvalues", {1: 0}, "dvalues must not share memory with x"),
    ],
)
def test_handlers_refuse_a_result_aliased_to_an_operand(kind, aliases, message):
    """A result aliased to an operand (input_output_aliases) gave garbage (63901 against outputs
    of at most 26), where the CPU targets refuse it."""
    n = 64
    shapes = {"fwd": (n, n), "dx": (n, n), "dvalues": (n, n)}
    call = jax.ffi.ffi_call(
        f"{cuda.EMULATED_PREFIX}_{kind}",
        (
            jax.ShapeDtypeStruct((130, n), jnp.float32)
            if kind != "dvalues"
            else jax.ShapeDtypeStruct(shapes[kind], jnp.float32),
            jax.ShapeDtypeStruct((1 << 16,), jnp.uint8),
        ),
        input_output_aliases=aliases,
    )
    a = jnp.ones((130, n)) if kind != "dvalues" else jnp.ones((n, n))
    b = jnp.ones((n, n))
    offsets = jnp.arange(n, dtype=jnp.int32)
    donate = next(iter(aliases))
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(jax.jit(call, donate_argnums=donate)(a + 0, b + 0, offsets))


def test_more_diagonals_than_one_dvalues_launch_is_refused_at_lowering():
    """524,281 diagonals (repeated offsets) failed at run time, after compiling; the lowering
    now gives the handler's limit."""
    k = 524_281
    with pytest.raises(ValueError, match=r"dvalues target .*too many diagonals for one launch"):
        launch_plan.workspace_bytes("dvalues", 2, 1, 2, k, jnp.float32)
    x, values = jnp.ones((2, 1)), jnp.ones((k, 1))
    offsets = jnp.asarray(np.arange(k) % 2, jnp.int32)

    def loss(v):
        return dd.diag_matmul(x, v, offsets, out_features=2, impl=IMPL).sum()

    with pytest.raises(ValueError, match="too many diagonals for one launch"):
        jax.jit(jax.grad(loss)).lower(values)
    assert launch_plan.workspace_bytes("dvalues", 2, 1, 2, k - 1, jnp.float32) >= 0
