"""Bad input to diag_matmul: clear errors at trace time, an exception (not a crash) at run time."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynadiag_jax as dd

X = jnp.ones((3, 8), jnp.float32)
V = jnp.ones((2, 8), jnp.float32)  # 8 -> 12: tall, P = 12, D = 8
OFF = jnp.asarray([0, 5], jnp.int32)


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(x=jnp.float32(1.0)), ValueError, "x must have shape"),
        (
            dict(values=jnp.ones((8,), jnp.float32)),
            ValueError,
            r"values must have shape \[K, D\] = \[K, 8\]",
        ),
        (
            dict(values=jnp.ones((2, 7), jnp.float32)),
            ValueError,
            r"\[K, min\(in, out\)\] = \[K, 8\]",
        ),
        (
            dict(offsets=jnp.zeros((2, 1), jnp.int32)),
            ValueError,
            r"offsets must have shape \[K\] = \[2\]",
        ),
        (
            dict(offsets=jnp.zeros((3,), jnp.int32)),
            ValueError,
            r"offsets must have shape \[K\] = \[2\]",
        ),
        (dict(offsets=jnp.zeros((2,), jnp.float32)), TypeError, "offsets must be an integer array"),
        (
            dict(values=jnp.ones((2, 8), jnp.bfloat16)),
            TypeError,
            "values dtype bfloat16 must equal x dtype",
        ),
        (
            dict(x=jnp.ones((3, 8), jnp.int32), values=jnp.ones((2, 8), jnp.int32)),
            TypeError,
            "x must be a floating",
        ),
        (dict(out_features=0), ValueError, "out_features must be >= 1"),
        (dict(out_features=12.0), TypeError, "out_features must be an int"),
        (dict(out_features=4), ValueError, r"\[K, min\(in, out\)\] = \[K, 4\]"),
        (
            dict(offsets=jnp.asarray([0, 12], jnp.int32)),
            ValueError,
            r"offsets must lie in \[0, P\) = \[0, 12\)",
        ),
        (dict(offsets=jnp.asarray([-1, 3], jnp.int32)), ValueError, r"\[0, 12\)"),
        (
            dict(values=jnp.ones((2, 8, 1), jnp.float32)),
            ValueError,
            r"values must have shape \[K, D\] = \[K, 8\] \(element diagonals\) or "
            r"\[K, L_b, b, b\] \(block diagonals\), got \(2, 8, 1\)",
        ),
        (
            dict(values=jnp.ones((2, 3, 4, 2), jnp.float32)),
            ValueError,
            r"square b x b blocks; got \(2, 3, 4, 2\)",
        ),
        (
            dict(values=jnp.ones((2, 12, 1, 1), jnp.float32)),
            ValueError,
            r"need b >= 2, got \(2, 12, 1, 1\); element diagonals take values of shape "
            r"\[K, D\] = \[K, 8\]",
        ),
        (
            dict(values=jnp.ones((2, 1, 8, 8), jnp.float32)),
            ValueError,
            r"values of shape \(2, 1, 8, 8\) \(b = 8\): block_size=8 must divide in_features=8 "
            r"and out_features=12; block sizes in \(8, 16, 32, 64, 128\) that fit: none",
        ),
        (
            dict(values=jnp.ones((2, 2, 4, 4), jnp.float32)),
            ValueError,
            r"\[K, L_b, b, b\] = \[K, 3, 4, 4\] \(L_b = max\(in, out\) / b\) for "
            r"in_features=8, out_features=12; got \(2, 2, 4, 4\)",
        ),
        (
            dict(values=jnp.ones((2, 3, 4, 4), jnp.float32), offsets=jnp.asarray([0, 2])),
            ValueError,
            r"offsets must lie in \[0, P_b\) = \[0, 2\); got values in \[0, 2\]",
        ),
        (
            dict(
                values=jnp.ones((2, 3, 4, 4), jnp.float32), offsets=jnp.asarray([0, 1]), impl="ffi"
            ),
            ValueError,
            r"impl='ffi' takes block sizes b in \(8, 16, 32, 64, 128\), got b = 4; "
            r"impl='jax' and impl='dense' run any block size",
        ),
        (dict(impl="cusparse"), ValueError, "impl must be one of"),
        (dict(impl=None), TypeError, "impl must be a str, one of"),
        (dict(impl=3), TypeError, "impl must be a str, one of"),
        (dict(x=[[1.0] * 8]), TypeError, "x must be an array"),
    ],
)
def test_trace_time_errors_name_the_argument(kwargs, error, match):
    args = dict(x=X, values=V, offsets=OFF, out_features=12, impl="auto") | kwargs
    with pytest.raises(error, match=match):
        dd.diag_matmul(args.pop("x"), args.pop("values"), args.pop("offsets"), **args)


@pytest.mark.parametrize(
    "offsets",
    [
        np.asarray([0, 12], np.int32),
        np.asarray([-1, 3], np.int64),
        jax.device_put(np.asarray([0, 12], np.int32), jax.devices("cpu")[0]),
    ],
    ids=["numpy", "numpy int64", "committed to a CPU device"],
)
def test_host_offsets_are_range_checked_at_trace_time(offsets):
    # read on the host even where the default device is an accelerator
    with pytest.raises(ValueError, match=r"offsets must lie in \[0, P\) = \[0, 12\)"):
        dd.diag_matmul(X, V, offsets, out_features=12, impl="jax")


@pytest.mark.parametrize(
    "values,offsets,out_features,error,match",
    [
        (
            jnp.ones((1, 8)),
            jnp.asarray([1, 2]),
            12,
            ValueError,
            r"offsets must have shape \[K\] = \[1\]",
        ),
        (
            jnp.ones((8,)),
            jnp.asarray([1]),
            12,
            ValueError,
            r"values must have shape \[K, D\] = \[K, 8\]",
        ),
        (jnp.ones((1, 9)), jnp.asarray([1]), 12, ValueError, r"\[K, min\(in, out\)\] = \[K, 8\]"),
        (jnp.ones((1, 3, 4, 2)), jnp.asarray([0]), 12, ValueError, "square b x b blocks"),
        (
            jnp.ones((1, 8)),
            jnp.asarray([12]),
            12,
            ValueError,
            r"offsets must lie in \[0, P\) = \[0, 12\)",
        ),
        (jnp.ones((1, 8)), jnp.asarray([1.0]), 12, TypeError, "offsets must be an integer array"),
        (jnp.ones((1, 8), jnp.int32), jnp.asarray([1]), 12, TypeError, "values must be a floating"),
        (jnp.ones((1, 8)), jnp.asarray([1]), 0, ValueError, "out_features"),
    ],
)
def test_diag_to_dense_checks_its_arguments(values, offsets, out_features, error, match):
    with pytest.raises(error, match=match):
        dd.diag_to_dense(values, offsets, in_features=8, out_features=out_features)


def test_diag_to_dense_makes_w_nan_for_a_traced_offset_out_of_range():
    """As diag_matmul's y: never a wrapped diagonal."""
    values = jnp.arange(1.0, 9.0).reshape(1, 8)
    to_dense = jax.jit(lambda o: dd.diag_to_dense(values, o, in_features=8, out_features=12))
    assert bool(jnp.isnan(to_dense(jnp.asarray([12]))).all())
    good = to_dense(jnp.asarray([5]))
    np.testing.assert_array_equal(
        good, dd.diag_to_dense(values, np.asarray([5]), in_features=8, out_features=12)
    )
    x = jnp.ones((2, 8))
    np.testing.assert_allclose(
        x @ good.T, dd.diag_matmul(x, values, jnp.asarray([5]), out_features=12, impl="jax")
    )


def test_errors_also_under_jit():
    with pytest.raises(ValueError, match=r"\[K, min\(in, out\)\] = \[K, 8\]"):
        jax.jit(lambda x, v: dd.diag_matmul(x, v, OFF, out_features=12))(X, jnp.ones((2, 9)))


def test_unsupported_dtype_for_the_kernel_names_the_alternative():
    with jax.enable_x64(True):
        x64, v64 = X.astype(jnp.float64), V.astype(jnp.float64)
        with pytest.raises(TypeError, match="impl='jax' runs every floating dtype"):
            dd.diag_matmul(x64, v64, OFF, out_features=12, impl="ffi")
        assert dd.diag_matmul(x64, v64, OFF, out_features=12).dtype == jnp.float64


# (in, out, values shape, P): element tall and wide (P = 12), block with b = 8 (P_b = 2). The
# products poison y or dx by an extra pass (element y of tall W), through NaN values rows (element
# y of wide W, dx of tall W: values are the smaller operand) or through a NaN x or dy (block: the
# rows are smaller than the values): all three ways are covered.
FORMS = {
    "element tall": (8, 12, (3, 8), 12),
    "element wide": (12, 8, (3, 8), 12),
    "block": (16, 24, (3, 3, 8, 8), 2),
}
OOR_CASES = [
    (impl, form)
    for form, (_, _, shape, _) in FORMS.items()
    for impl in dd.available_impls(block_size=shape[-1] if len(shape) == 4 else 1)
    if impl != "auto"
]


@pytest.mark.parametrize("impl,form", OOR_CASES)
@pytest.mark.parametrize("bad", ["P", "-1"])
def test_traced_offset_out_of_range_gives_nan_with_every_impl(impl, form, bad, rng):
    """One rule: y, dx and tangents all NaN, dvalues NaN in the bad rows only; never wrapped."""
    in_f, out_f, vshape, p = FORMS[form]
    x = jnp.asarray(rng.standard_normal((4, in_f)), jnp.float32)
    values = jnp.asarray(rng.standard_normal(vshape), jnp.float32)
    dy = jnp.asarray(rng.standard_normal((4, out_f)), jnp.float32)
    good = jnp.asarray([0, p - 1, 0], jnp.int32)
    offsets = good.at[1].set(p if bad == "P" else -1)

    def loss(x, v, off):
        y = dd.diag_matmul(x, v, off, out_features=out_f, impl=impl)
        return jnp.sum(y * dy), y

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))
    tangent = jax.jit(lambda x, v, off: jax.jvp(lambda x, v: loss(x, v, off)[1], (x, v), (x, v))[1])
    (_, y), (dx, dv) = step(x, values, good)
    assert all(np.isfinite(np.asarray(a)).all() for a in (y, dx, dv, tangent(x, values, good)))
    (_, y), (dx, dv) = step(x, values, offsets)
    assert np.isnan(np.asarray(y)).all(), "y"
    assert np.isnan(np.asarray(dx)).all(), "dx"
    assert np.isnan(np.asarray(tangent(x, values, offsets))).all(), "jvp"
    # a tangent in values alone (impl="dense" left the outputs the clamped diagonal misses at 0)
    values_only = jax.jit(lambda v, off: jax.jvp(lambda v: loss(x, v, off)[1], (v,), (v,))[1])
    assert np.isnan(np.asarray(values_only(values, offsets))).all(), "jvp in values alone"
    dv = np.asarray(dv)
    assert np.isnan(dv[1]).all(), "the bad offset's dvalues"
    # the other rows are the exact gradient of the good diagonals
    _, (_, dv_good) = step(x, values, good)
    np.testing.assert_allclose(np.delete(dv, 1, axis=0), np.delete(np.asarray(dv_good), 1, axis=0))


def _tile_bound(nz, j, tile=16):
    """``[n]`` bool: where the CUDA element tensor-core path may spread a non-finite input column
    ``j`` of a product with non-zero pattern ``nz[n, m]`` (``W`` for y, ``W.T`` for dx): the
    outputs reading ``j``, and every output of each ``tile``-wide block holding an output that
    reads any column of ``j``'s ``tile``-column group (its packed tile multiplies them all)."""
    n = nz.shape[0]
    group = nz[:, j - j % tile : j - j % tile + tile].any(axis=1)
    blocks = np.pad(group, (0, -n % tile)).reshape(-1, tile).any(axis=1)
    return np.repeat(blocks, tile)[:n] | nz[:, j]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("impl,form", OOR_CASES)
def test_a_non_finite_input_reaches_the_outputs_its_diagonals_read(impl, form, dtype, rng):
    """docs/kernel_abi.md: the sparse paths make non-finite only the outputs whose kept diagonals
    read the column (dx: the inputs the output's column reaches); the dense path every output of
    the row; the CUDA element tensor-core path (16-bit) at most the 16-wide blocks its packed
    tiles cover (:func:`_tile_bound`). Either way the row is non-finite."""
    in_f, out_f, vshape, p = FORMS[form]
    x = jnp.asarray(rng.standard_normal((3, in_f)), dtype)
    x = x.at[0, 1].set(jnp.nan).at[1, in_f - 1].set(jnp.inf)
    dy = jnp.asarray(rng.standard_normal((3, out_f)), dtype).at[0, 2].set(jnp.nan)
    values = jnp.asarray(rng.standard_normal(vshape), dtype)[:2]
    offsets = jnp.asarray([0, p - 1], jnp.int32)
    y, pull = jax.vjp(
        lambda x: dd.diag_matmul(x, values, offsets, out_features=out_f, impl=impl), x
    )
    (dx,) = pull(dy)
    # the outputs that read each column: the dense W's non-zero pattern
    w = dd.diag_matmul(jnp.eye(in_f), jnp.ones(values.shape), offsets, out_features=out_f)
    nz = np.asarray(w).T != 0  # [out, in]
    want_y = np.stack([nz[:, 1], nz[:, in_f - 1], np.zeros(out_f, bool)])
    want_dx = np.stack([nz[2], np.zeros(in_f, bool), np.zeros(in_f, bool)])
    bad_y = ~np.isfinite(np.asarray(y, np.float32))
    bad_dx = ~np.isfinite(np.asarray(dx, np.float32))
    if impl == "cuda_emulated" and dtype == jnp.bfloat16 and not form.startswith("block"):
        bound_y = np.stack([_tile_bound(nz, 1), _tile_bound(nz, in_f - 1), want_y[2]])
        bound_dx = np.stack([_tile_bound(nz.T, 2), want_dx[1], want_dx[2]])
        for bad, want, bound in ((bad_y, want_y, bound_y), (bad_dx, want_dx, bound_dx)):
            assert np.all(bad >= want) and np.all(bad <= bound), (bad, want, bound)
        return
    if impl == "dense":
        want_y[:2], want_dx[0] = True, True
    np.testing.assert_array_equal(bad_y, want_y)
    np.testing.assert_array_equal(bad_dx, want_dx)


@pytest.mark.skipif("cuda_emulated" not in dd.available_impls(), reason="no emulated targets")
@pytest.mark.parametrize("in_f,out_f,offsets", [(40, 72, [2, 62, 69]), (72, 40, [37, 40, 48])])
def test_the_cuda_tensor_core_path_spreads_a_nan_over_16_wide_blocks_only(
    in_f, out_f, offsets, rng
):
    """Wider than one block: at most the blocks whose packed tiles cover the column's 16-column
    group turn non-finite in that row, the others stay finite (docs/kernel_abi.md)."""
    offsets = jnp.asarray(offsets, jnp.int32)
    values = jnp.asarray(rng.standard_normal((3, min(in_f, out_f))), jnp.bfloat16)
    x = jnp.asarray(rng.standard_normal((2, in_f)), jnp.bfloat16).at[1, 5].set(jnp.nan)
    y = dd.diag_matmul(x, values, offsets, out_features=out_f, impl="cuda_emulated")
    w = dd.diag_matmul(jnp.eye(in_f), jnp.ones(values.shape), offsets, out_features=out_f)
    reads = np.asarray(w)[5] != 0  # [out]: the outputs that read column 5
    bad = ~np.isfinite(np.asarray(y, np.float32))
    bound = _tile_bound(np.asarray(w).T != 0, 5)
    assert np.all(bad[1] >= reads) and np.all(bad[1] <= bound) and not bound.all()
    assert bad[1].sum() > reads.sum() and not bad[0].any()  # the tiles did spread it


@pytest.mark.parametrize("impl", [i for i in dd.available_impls() if i != "auto"])
def test_bad_offsets_of_one_vmapped_element_poison_only_that_element(impl):
    offsets = jnp.asarray([[0, 5], [0, 12]], jnp.int32)
    f = jax.jit(jax.vmap(lambda off: dd.diag_matmul(X, V, off, out_features=12, impl=impl)))
    y = np.asarray(f(offsets))
    assert np.isfinite(y[0]).all() and np.isnan(y[1]).all()


@pytest.mark.parametrize("impl,form", OOR_CASES)
def test_in_range_variant_skips_the_rule_and_matches_on_good_offsets(impl, form, rng):
    """The search's entry (offsets from a ranking of all P) gives the same product and
    derivatives in every mode, with a smaller program (no out-of-range passes)."""
    from dynadiag_jax.ops.diag_matmul import diag_matmul_in_range  # noqa: PLC0415

    in_f, out_f, vshape, p = FORMS[form]
    x = jnp.asarray(rng.standard_normal((4, in_f)), jnp.float32)
    values = jnp.asarray(rng.standard_normal(vshape), jnp.float32)
    offsets = jnp.asarray([0, p - 1, 1], jnp.int32)

    def run(fn):
        def f(x, v):
            return jnp.sum(jnp.sin(fn(x, v, offsets, out_features=out_f, impl=impl)))

        grads = jax.grad(f, argnums=(0, 1))(x, values)
        _, tangent = jax.jvp(f, (x, values), (x, values))
        text = jax.jit(jax.grad(f, argnums=(0, 1))).lower(x, values).as_text()
        return (f(x, values), *grads, tangent), text.count("\n")

    checked, checked_lines = run(dd.diag_matmul)
    trusted, trusted_lines = run(diag_matmul_in_range)
    for a, b in zip(checked, trusted):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    if impl == "ffi" and jax.default_backend() == "cpu":
        # the CPU kernels check the offsets themselves: no guard ops around the call to skip
        assert trusted_lines == checked_lines
    else:
        assert trusted_lines < checked_lines


def test_x_of_the_wrong_width_is_named_with_the_width_values_imply():
    with pytest.raises(
        ValueError,
        match=r"x must have shape \[\.\.\., 8\] to match values of shape \(2, 8\) and "
        r"out_features=12, got \(3, 9\); or else values must have shape "
        r"\[K, min\(in, out\)\] = \[K, 9\]",
    ):
        jax.jit(lambda x: dd.diag_matmul(x, V, OFF, out_features=12))(jnp.ones((3, 9)))


@pytest.mark.parametrize(
    "x,values,out_features,match",
    [
        # values [K, L_b, b, b] with L_b * b = 24 > out: in = 24
        (jnp.ones((3, 16)), jnp.ones((2, 3, 8, 8)), 16, r"x must have shape \[\.\.\., 24\]"),
        # D = out: any in >= out fits values
        (jnp.ones((3, 8)), jnp.ones((2, 12)), 12, r"with in_features >= 12 to match values"),
        (
            jnp.ones((3, 0)),
            V,
            12,
            r"x must have shape \[\.\.\., in_features\] with in_features >= 1",
        ),
    ],
    ids=["block", "element, values as wide as out", "zero width"],
)
def test_x_width_messages(x, values, out_features, match):
    with pytest.raises(ValueError, match=match):
        dd.diag_matmul(x, values, OFF, out_features=out_features)


@pytest.mark.parametrize("impl", [i for i in dd.available_impls() if i != "auto"])
def test_traced_int64_offsets_and_perm_beyond_int32_give_nan(impl):
    """Narrowed to int32 they would wrap into range (2**32 + 5 to 5); they are out of range."""
    dy = jnp.ones((3, 12), jnp.float32)

    @jax.jit
    def step(offsets, perm):
        def loss(x, v):
            y = dd.diag_matmul(x, v, offsets, out_features=12, impl=impl, perm=perm)
            return jnp.sum(y * dy), y

        (_, y), (dx, dv) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(X, V)
        return y, dx, dv

    with jax.enable_x64(True):
        good = jnp.asarray([0, 5], jnp.int64)
        identity = jnp.arange(8, dtype=jnp.int64)
        for perm in (None, identity):
            assert all(np.isfinite(np.asarray(a)).all() for a in step(good, perm))
        for offset in (2**32 + 5, -(2**32) + 5):
            y, dx, dv = (np.asarray(a) for a in step(good.at[1].set(offset), None))
            assert np.isnan(y).all() and np.isnan(dx).all(), offset
            assert np.isnan(dv[1]).all() and np.isfinite(dv[0]).all(), offset
        for a in step(good, identity.at[7].set(2**32 + 7)):
            assert np.isnan(np.asarray(a)).all()


_B, _N = jax.export.symbolic_shape("b, n")


def _spec(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def test_symbolic_rows_are_accepted():
    exported = dd.export(lambda x: dd.diag_matmul(x, V, OFF, out_features=12))(_spec(_B, 8))
    assert exported.out_avals[0].shape == (_B, 12)
    x = jnp.arange(40, dtype=jnp.float32).reshape(5, 8)
    want = dd.diag_matmul(x, V, OFF, out_features=12, impl="jax")
    np.testing.assert_allclose(exported.call(x), want, rtol=1e-6)


@pytest.mark.parametrize(
    "args,out_features,match",
    [
        (
            (_spec(3, _N), V, OFF),
            12,
            r"x has the symbolic shape \(3, n\): its last dimension \(in_features\) must be "
            "concrete",
        ),
        ((X, _spec(_N, 8), OFF), 12, r"values has the symbolic shape \(n, 8\): values must be"),
        ((X, V, _spec(_N, dtype=jnp.int32)), 12, r"offsets has the symbolic shape \(n,\)"),
        ((X, V, OFF, _spec(_N, dtype=jnp.int32)), 12, r"perm has the symbolic shape \(n,\)"),
        ((_spec(_B, 8), V, OFF), _B, "out_features must be a concrete integer, got b"),
    ],
    ids=["in_features", "values", "offsets", "perm", "out_features"],
)
def test_symbolic_dimensions_other_than_rows_are_refused(args, out_features, match):
    def product(x, values, offsets, perm=None):
        return dd.diag_matmul(x, values, offsets, out_features=out_features, perm=perm)

    only = r"; only the leading \(row\) dimensions of x may be symbolic"
    with pytest.raises(ValueError, match=match + ".*" + only):
        dd.export(product)(*args)


# --- the CPU targets, called directly --------------------------------------------------------
#
# (kind, results, operands, in, message) for dynadiag_diag_matmul_{v2,permuted_v1}_{kind}; the
# permuted targets get perm = arange(in) as their last operand. Element diagonals are 8 -> 12
# (D = 8) unless noted, block diagonals 16 -> 16 with b = 8. Only calls with a non-empty result
# reach a handler (XLA elides the others).


def _f32(*shape):
    return np.zeros(shape, np.float32)


def _results(*shapes, dtype=jnp.float32):
    return [jax.ShapeDtypeStruct(s, dtype) for s in shapes]


_OFF3, _OFF1 = np.asarray([0, 1, 2], np.int32), np.asarray([0], np.int32)
_BF16 = jnp.zeros((4, 0), jnp.bfloat16), jnp.zeros((3, 0), jnp.bfloat16)
_WIDTHS = r"feature dimensions must lie in \[1, 2\^31\): "
_DX = r"dx must have shape \[\.\.\., in\] = \[4, 8\] with the leading dimensions of dy \[4, 12\], "
RAW_SHAPE_ERRORS = {
    "fwd in=0": ("fwd", _results((4, 12)), (_f32(4, 0), _f32(3, 0), _OFF3), 0, _WIDTHS + "in = 0"),
    "fwd in=0 bf16": (
        "fwd",
        _results((4, 12), dtype=jnp.bfloat16),
        (*_BF16, _OFF3),
        0,
        _WIDTHS + r"in = 0 \(x \[4, 0\]\), out = 12 \(y \[4, 12\]\)",
    ),
    "fwd in=0 K=0": ("fwd", _results((4, 12)), (_f32(4, 0), _f32(0, 0), _OFF3[:0]), 0, _WIDTHS),
    "fwd block in=0": (
        "fwd",
        _results((4, 16)),
        (_f32(4, 0), _f32(1, 2, 8, 8), _OFF1),
        0,
        _WIDTHS + "in = 0",
    ),
    "fwd y rows": (
        "fwd",
        _results((5, 12)),
        (_f32(4, 8), _f32(3, 8), _OFF3),
        8,
        r"y must have shape \[\.\.\., out\] = \[4, 12\] with the leading dimensions of x",
    ),
    "dx out=0": ("dx", _results((4, 8)), (_f32(4, 0), _f32(3, 0), _OFF3), 8, _WIDTHS + "in = 8"),
    "dx rows": ("dx", _results((2, 2, 8)), (_f32(4, 12), _f32(3, 8), _OFF3), 8, _DX + r"got \[2"),
    "dvalues block in=0": (
        "dvalues",
        _results((1, 2, 8, 8)),
        (_f32(4, 16), _f32(4, 0), _OFF1),
        0,
        _WIDTHS + r"in = 0 \(x \[4, 0\]\), out = 16 \(dy \[4, 16\]\)",
    ),
    # no rows: nothing is allocated, and dvalues (zeros) is still a result
    "dvalues in=2^31": (
        "dvalues",
        _results((1, 12)),
        (_f32(0, 12), _f32(0, 2**31), _OFF1),
        8,
        _WIDTHS + "in = 2147483648",
    ),
    "dvalues x rows": (
        "dvalues",
        _results((3, 8)),
        (_f32(4, 12), _f32(5, 8), _OFF3),
        8,
        r"x must have shape \[\.\.\., in\] = \[4, 8\] with the leading dimensions of dy",
    ),
    "dvalues width": (
        "dvalues",
        _results((3, 7)),
        (_f32(4, 12), _f32(4, 8), _OFF3),
        8,
        r"dvalues must have shape \[K, min\(in, out\)\] = \[3, 8\]",
    ),
    "bwd out=0": (
        "bwd",
        _results((4, 8), (3, 0)),
        (_f32(4, 0), _f32(4, 8), _f32(3, 0), _OFF3),
        8,
        _WIDTHS + "in = 8 \\(x \\[4, 8\\]\\), out = 0",
    ),
    "bwd block in=0": (
        "bwd",
        _results((4, 0), (1, 2, 8, 8)),
        (_f32(4, 16), _f32(4, 0), _f32(1, 2, 8, 8), _OFF1),
        0,
        _WIDTHS + "in = 0",
    ),
    "bwd dx narrow": (
        "bwd",
        _results((4, 7), (3, 8)),
        (_f32(4, 12), _f32(4, 8), _f32(3, 8), _OFF3),
        8,
        _DX + r"got \[4, 7\]",
    ),
    "bwd dx wide": (
        "bwd",
        _results((4, 9), (3, 8)),
        (_f32(4, 12), _f32(4, 8), _f32(3, 8), _OFF3),
        8,
        _DX + r"got \[4, 9\]",
    ),
    "bwd dx rows": (
        "bwd",
        _results((5, 8), (3, 8)),
        (_f32(4, 12), _f32(4, 8), _f32(3, 8), _OFF3),
        8,
        _DX + r"got \[5, 8\]",
    ),
    "bwd block dx narrow": (
        "bwd",
        _results((4, 8), (1, 2, 8, 8)),
        (_f32(4, 16), _f32(4, 16), _f32(1, 2, 8, 8), _OFF1),
        16,
        r"dx must have shape \[\.\.\., in\] = \[4, 16\] .*, got \[4, 8\]",
    ),
    "bwd x rows": (
        "bwd",
        _results((4, 8), (3, 8)),
        (_f32(4, 12), _f32(5, 8), _f32(3, 8), _OFF3),
        8,
        r"x must have shape \[\.\.\., in\] = \[4, 8\] with the leading dimensions of dy",
    ),
    "bwd dvalues width": (
        "bwd",
        _results((4, 8), (3, 9)),
        (_f32(4, 12), _f32(4, 8), _f32(3, 8), _OFF3),
        8,
        r"dvalues must have shape \[K, min\(in, out\)\] = \[3, 8\] \(K from offsets\), "
        r"got \[3, 9\]",
    ),
}
_CPU_PREFIXES = ("v2", "permuted_v1")
_needs_cpu_kernels = pytest.mark.skipif(
    not dd.has_cpu_kernels() or jax.default_backend() != "cpu", reason="no CPU kernels"
)


@_needs_cpu_kernels
@pytest.mark.parametrize("prefix", _CPU_PREFIXES)
@pytest.mark.parametrize("case", sorted(RAW_SHAPE_ERRORS))
def test_cpu_targets_reject_bad_shapes(prefix, case):
    kind, results, operands, in_f, match = RAW_SHAPE_ERRORS[case]
    target = f"dynadiag_diag_matmul_{prefix}_{kind}"
    if prefix == "permuted_v1":
        operands = (*operands, np.arange(in_f, dtype=np.int32))
    call = jax.ffi.ffi_call(target, results)
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"INVALID_ARGUMENT: {target}: {match}"):
        jax.block_until_ready(call(*operands))


@_needs_cpu_kernels
@pytest.mark.parametrize("perm_length", [7, 9])
def test_permuted_bwd_rejects_a_perm_of_another_length(perm_length):
    target = "dynadiag_diag_matmul_permuted_v1_bwd"
    call = jax.ffi.ffi_call(target, _results((4, 8), (3, 8)))
    operands = (_f32(4, 12), _f32(4, 8), _f32(3, 8), _OFF3, np.arange(perm_length, dtype=np.int32))
    match = rf"{target}: perm must have shape \[in\] = \[8\], got \[{perm_length}\]"
    with pytest.raises(jax.errors.JaxRuntimeError, match=match):
        jax.block_until_ready(call(*operands))


def _gate_results(rows, p, k, **changed):
    shapes = {
        "order": ((rows, p), jnp.int32),
        "rank": ((rows, p), jnp.int32),
        "topk": ((rows, k), jnp.int32),
        "changed": ((rows,), jnp.float32),
        "kth": ((rows,), jnp.float32),
        "tau": ((rows,), jnp.float32),
        "share": ((rows,), jnp.float32),
    } | changed
    return [jax.ShapeDtypeStruct(*s) for s in shapes.values()]


@_needs_cpu_kernels
@pytest.mark.parametrize(
    "p,k,changed,match",
    [
        (0, 1, {}, r"alpha must have shape \[R, P\] with P in \[1, 2\^31\), got \[2, 0\]"),
        (6, 0, {}, r"old_topk must have shape \[R, K\] with R = 2 and 1 <= K <= P = 6"),
        (
            6,
            3,
            {"order": ((2, 5), jnp.int32)},
            r"order must have shape \[R, P\] = \[2, 6\] and dtype S32, got \[2, 5\] S32",
        ),
        (6, 3, {"topk": ((2, 4), jnp.int32)}, r"topk must have shape \[R, K\] = \[2, 3\]"),
        (6, 3, {"share": ((2,), jnp.int32)}, r"share must have shape \[R\] = \[2\] and dtype F32"),
    ],
    ids=["P=0", "K=0", "order", "topk", "share dtype"],
)
def test_gate_rank_target_rejects_bad_shapes(p, k, changed, match):
    from dynadiag_jax.ops import ranking  # noqa: PLC0415

    call = jax.ffi.ffi_call(ranking.TARGET, _gate_results(2, p, k, **changed))
    operands = (_f32(2, p), _f32(2), np.zeros((2, k), np.int32))
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"{ranking.TARGET}: {match}"):
        jax.block_until_ready(call(*operands, sparse=True))


@_needs_cpu_kernels
def test_bad_shape_cases_cover_every_registered_cpu_target():
    from dynadiag_jax import _cpu_ext  # noqa: PLC0415
    from dynadiag_jax.ops import ranking  # noqa: PLC0415

    kinds = {case[0] for case in RAW_SHAPE_ERRORS.values()}
    covered = {f"dynadiag_diag_matmul_{p}_{kind}" for p in _CPU_PREFIXES for kind in kinds}
    assert set(_cpu_ext.registrations()) == covered | {ranking.TARGET}
    # every product target has a zero or out-of-range feature width among its cases
    assert {c[0] for c in RAW_SHAPE_ERRORS.values() if c[4].startswith(_WIDTHS)} == kinds


@pytest.mark.parametrize(
    "block_size, error, match",
    [
        (True, TypeError, "block_size must be an int, got bool"),
        (1.5, TypeError, "block_size must be an int, got float"),
        ("16", TypeError, "block_size must be an int, got str"),
        (0, ValueError, "block_size must be >= 1, got 0"),
        (-1, ValueError, "block_size must be >= 1, got -1"),
    ],
)
def test_available_impls_checks_its_block_size(block_size, error, match):
    """It listed jax and dense as able to run b = 0, -1 or 1.5."""
    with pytest.raises(error, match=match):
        dd.available_impls(block_size=block_size)


def test_float8_runs_on_the_jax_path_by_name_as_auto_runs_it():
    """impl='jax' refused float8, which impl='auto' ran on that very path."""
    x = jnp.ones((2, 9), jnp.float8_e4m3fn)
    v = jnp.ones((3, 9), jnp.float8_e4m3fn)
    offsets = jnp.asarray([0, 3, 10], jnp.int32)
    y = dd.diag_matmul(x, v, offsets, out_features=17, impl="jax")
    ref = dd.diag_matmul(x, v, offsets, out_features=17, impl="dense")
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(ref, np.float32))
