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
    dv = np.asarray(dv)
    assert np.isnan(dv[1]).all(), "the bad offset's dvalues"
    # the other rows are the exact gradient of the good diagonals
    _, (_, dv_good) = step(x, values, good)
    np.testing.assert_allclose(np.delete(dv, 1, axis=0), np.delete(np.asarray(dv_good), 1, axis=0))


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
