"""``diag_matmul(..., perm=...)``: the product of ``W P``, ``y = x[..., perm] @ W.T``.

Every implementation against the pure-JAX reference (``impl="jax"`` on ``x[..., perm]``, no
``perm``): forward and the gradients in ``x`` and ``values`` (together: the fused backward; apart:
``dx`` and ``dvalues``), element and block diagonals, tall, wide and square, a few rows (the
few-row kernels) and many (the chunked jobs), float32 and bfloat16, under ``jit`` and ``vmap``.
Then the checks: bad shapes and dtypes at trace time, a bad host ``perm`` raising, a bad traced one
poisoning every result, and the CPU handlers' own validation; the lowering (the CPU kernels take
``perm``, the CUDA targets get a gather); and the frozen layer, which now passes its ``perm`` to
the product instead of gathering ``x`` itself.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import dynadiag_jax as dd
from dynadiag_jax.layout import geometry

SHAPES = [  # (in, out, b)
    (48, 80, 1),
    (80, 48, 1),
    (37, 53, 1),
    (64, 64, 1),
    (48, 80, 8),
    (80, 48, 16),
    (64, 64, 16),
]


def _tol(dtype):
    """Relative to the largest reference entry: float32 sums in another order, or one bf16
    rounding of each result (and of the cotangent's products)."""
    return 1e-5 if dtype == jnp.float32 else 2.0**-6


def _operands(rng, in_f, out_f, b, lead, dtype, k=3):
    geo = geometry(in_f, out_f, b)
    offsets = jnp.asarray(rng.choice(geo.num_candidates, min(k, geo.num_candidates), False))
    values = jnp.asarray(rng.standard_normal((len(offsets),) + geo.values_shape), dtype)
    x = jnp.asarray(rng.standard_normal(lead + (in_f,)), dtype)
    dy = jnp.asarray(rng.standard_normal(lead + (out_f,)), dtype)
    perm = jnp.asarray(rng.permutation(in_f), jnp.int32)
    return x, values, offsets.astype(jnp.int32), perm, dy


def _results(product, x, values, dy):
    """y and the gradients of <y, dy>: in (x, values) together, in x alone, in values alone
    (one program: a compile per implementation, not four)."""

    def loss(x, values):
        return jnp.sum(product(x, values).astype(jnp.float32) * dy.astype(jnp.float32))

    def all_results(x, values):
        both = jax.grad(loss, argnums=(0, 1))(x, values)
        dx = jax.grad(loss, argnums=0)(x, values)
        dvalues = jax.grad(loss, argnums=1)(x, values)
        return product(x, values), *both, dx, dvalues

    return jax.jit(all_results)(x, values)


def _assert_close(actual, expected, dtype, what):
    actual, expected = (np.asarray(a, np.float64) for a in (actual, expected))
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=_tol(dtype) * scale, err_msg=what)


@pytest.mark.parametrize("in_f,out_f,b", SHAPES, ids=lambda v: str(v))
@pytest.mark.parametrize("lead", [(1,), (5,), (3, 70)], ids=["1row", "5rows", "210rows"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_every_impl_matches_the_gathered_reference(in_f, out_f, b, lead, dtype, rng):
    x, values, offsets, perm, dy = _operands(rng, in_f, out_f, b, lead, dtype)

    def reference(x, values):
        return dd.diag_matmul(x[..., perm], values, offsets, out_features=out_f, impl="jax")

    expected = _results(reference, x, values, dy)
    for impl in dd.available_impls(block_size=b):

        def product(x, values, impl=impl):
            return dd.diag_matmul(x, values, offsets, out_features=out_f, impl=impl, perm=perm)

        names = ("y", "dx (bwd)", "dvalues (bwd)", "dx", "dvalues")
        for name, got, want in zip(names, _results(product, x, values, dy), expected):
            assert got.shape == want.shape and got.dtype == want.dtype, (impl, name)
            _assert_close(got, want, dtype, f"impl={impl}: {name}")


@pytest.mark.parametrize("impl", ["ffi", "jax", "dense"])
@pytest.mark.parametrize("b", [1, 16])
def test_vmap_over_rows_and_over_perm(impl, b, rng):
    if impl not in dd.available_impls(block_size=b):
        pytest.skip(f"impl={impl!r} is not built here")
    x, values, offsets, perm, _ = _operands(rng, 64, 32, b, (4, 6), jnp.float32)
    perms = jnp.stack([perm, jnp.roll(perm, 5), perm[::-1], jnp.arange(64, dtype=jnp.int32)])

    def product(x, perm):
        return dd.diag_matmul(x, values, offsets, out_features=32, impl=impl, perm=perm)

    rows = jax.vmap(product, in_axes=(0, None))(x, perm)
    each = jax.vmap(product)(x, perms)
    for i in range(4):
        ref = dd.diag_matmul(x[i][:, perm], values, offsets, out_features=32, impl="jax")
        _assert_close(rows[i], ref, jnp.float32, f"rows {i}")
        ref = dd.diag_matmul(x[i][:, perms[i]], values, offsets, out_features=32, impl="jax")
        _assert_close(each[i], ref, jnp.float32, f"perm {i}")


def test_second_order_derivatives_go_through_the_permuted_products(rng):
    x, values, offsets, perm, _ = _operands(rng, 40, 24, 1, (6,), jnp.float32)

    def loss(impl):
        def f(x, values):
            y = dd.diag_matmul(x, values, offsets, out_features=24, impl=impl, perm=perm)
            return jnp.sum(jnp.sin(y))

        return f

    for argnums in (0, 1):
        impl = "ffi" if dd.has_cpu_kernels() else "jax"
        got = jax.jit(jax.hessian(loss(impl), argnums))(x, values)  # one compile, not eager ops
        want = jax.jit(jax.hessian(loss("dense"), argnums))(x, values)
        _assert_close(got, want, jnp.float32, f"hessian in argument {argnums}")


# --- bad arguments -------------------------------------------------------------------------------


def _call(perm, impl="auto", x=None):
    x = jnp.ones((3, 16), jnp.float32) if x is None else x
    values = jnp.ones((2, 8), jnp.float32)
    offsets = jnp.array([0, 5], jnp.int32)
    return dd.diag_matmul(x, values, offsets, out_features=8, impl=impl, perm=perm)


@pytest.mark.parametrize(
    "perm,error,match",
    [
        (np.arange(15, dtype=np.int32), ValueError, r"perm must have shape \[in\] = \[16\]"),
        (np.arange(16).reshape(2, 8), ValueError, r"perm must have shape \[in\] = \[16\]"),
        (np.arange(16, dtype=np.float32), TypeError, "perm must be an integer array"),
        (np.r_[0, np.arange(15)], ValueError, r"permutation of range\(16\): it holds 0 2 times"),
        (np.r_[np.arange(15), 16], ValueError, r"permutation of range\(16\): it holds 16, outside"),
        ("no", TypeError, "perm must be an array"),
    ],
    ids=["short", "rank2", "float", "repeat", "outside", "str"],
)
def test_bad_perm_is_refused_at_trace_time(perm, error, match):
    with pytest.raises(error, match=match):
        _call(perm)
    if error is ValueError and "shape" in match:  # shapes are checked while tracing, too
        with pytest.raises(error, match=match):
            jax.jit(_call)(jnp.asarray(perm))


@pytest.mark.parametrize("impl", ["auto", "jax", "dense", "ffi"])
def test_traced_non_permutation_poisons_every_result(impl):
    if impl not in dd.available_impls():
        pytest.skip(f"impl={impl!r} is not built here")
    bad = jnp.asarray(np.r_[0, np.arange(15)], jnp.int32)
    x = jnp.ones((3, 16), jnp.float32)

    def loss(x, values, perm):
        y = dd.diag_matmul(
            x, values, jnp.array([0, 5], jnp.int32), out_features=8, impl=impl, perm=perm
        )
        return jnp.sum(y), y

    values = jnp.ones((2, 8), jnp.float32)
    run = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    (dx, dvalues), y = run(x, values, bad)
    assert np.all(np.isnan(y)) and np.all(np.isnan(dx)) and np.all(np.isnan(dvalues))
    (dx, dvalues), y = run(x, values, jnp.arange(16, dtype=jnp.int32)[::-1])
    assert np.all(np.isfinite(y)) and np.all(np.isfinite(dx)) and np.all(np.isfinite(dvalues))


_cpu = pytest.mark.skipif(not dd.has_cpu_kernels(), reason="the CPU kernels are not built")


@_cpu
@pytest.mark.parametrize(
    "perm,match",
    [
        (jnp.arange(15, dtype=jnp.int32), r"perm must have shape \[in\] = \[16\], got \[15\]"),
        (jnp.arange(16, dtype=jnp.int64 if jax.config.jax_enable_x64 else jnp.uint32), "S32"),
    ],
    ids=["shape", "dtype"],
)
def test_cpu_handlers_validate_perm(perm, match):
    """The permuted targets check perm's shape and dtype themselves (an ffi::Error, not a crash);
    its values may be traced, so a non-permutation poisons the results instead
    (tests/test_cpu_kernels.py)."""
    x, values = jnp.ones((4, 16), jnp.float32), jnp.ones((2, 8), jnp.float32)
    offsets = jnp.array([0, 5], jnp.int32)
    out = jax.ShapeDtypeStruct((4, 8), jnp.float32)
    call = jax.ffi.ffi_call("dynadiag_diag_matmul_permuted_v1_fwd", out)
    with pytest.raises(jax.errors.JaxRuntimeError, match=match):
        jax.block_until_ready(call(x, values, offsets, perm))


@_cpu
def test_kernel_test_hook_refuses_a_non_permutation():
    from dynadiag_jax import _cpu_ext  # noqa: PLC0415

    x, values = np.zeros((4, 16), np.float32), np.zeros((2, 8), np.float32)
    y, offsets = np.zeros((4, 8), np.float32), np.array([0, 5], np.int32)
    isa = _cpu_ext.supported_isas()[0]
    with pytest.raises(ValueError, match="perm must be a permutation"):
        _cpu_ext._run_kernel("fwd", isa, x, values, offsets, y, 16, 8, 1, np.zeros(16, np.int32))


# --- lowering ------------------------------------------------------------------------------------


@_cpu
@pytest.mark.parametrize("b", [1, 8])
def test_cpu_lowering_passes_perm_to_the_kernels_without_a_gather(b):
    x, values, offsets, perm, _ = _operands(np.random.default_rng(0), 64, 32, b, (9,), jnp.float32)

    def loss(x, values, perm):
        y = dd.diag_matmul(x, values, offsets, out_features=32, impl="ffi", perm=perm)
        return jnp.sum(y * y)

    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, values, perm).as_text()
    assert "dynadiag_diag_matmul_permuted_v1_fwd" in hlo
    assert "dynadiag_diag_matmul_permuted_v1_bwd" in hlo
    assert "dynadiag_diag_matmul_v2_" not in hlo
    # the permutation check (a scatter-add count) remains; x itself is never gathered
    assert "gather" not in hlo


def test_cuda_lowering_gathers_around_the_plain_targets():
    x, values, offsets, perm, _ = _operands(np.random.default_rng(0), 64, 32, 1, (9,), jnp.float32)

    def product(x, perm):
        return dd.diag_matmul(x, values, offsets, out_features=32, impl="auto", perm=perm)

    exported = jax.export.export(jax.jit(product), platforms=("cuda",))(x, perm)
    text = exported.mlir_module()
    assert "permuted" not in text
    assert "gather" in text or "dot_general" in text  # a gather or the dense fold


@_cpu
def test_export_round_trip_with_perm(rng):
    x, values, offsets, perm, _ = _operands(rng, 48, 80, 8, (7,), jnp.float32)

    def product(x, values, perm):
        return dd.diag_matmul(x, values, offsets, out_features=80, impl="ffi", perm=perm)

    exported = dd.export(jax.jit(product), platforms=("cpu",))(x, values, perm)
    restored = jax.export.deserialize(exported.serialize())
    want = dd.diag_matmul(x[:, perm], values, offsets, out_features=80, impl="jax")
    _assert_close(restored.call(x, values, perm), want, jnp.float32, "exported y")


# --- the frozen layer ----------------------------------------------------------------------------


def _frozen_linen(block_size, rng):
    layer = dd.nn.DiagonalDense(
        64, sparsity=0.75, block_size=block_size, init_phase="frozen", permutation="random"
    )
    x = jnp.asarray(rng.standard_normal((5, 96)), jnp.float32)
    return layer, layer.init(jax.random.key(1), x), x


@pytest.mark.parametrize("block_size", [1, 16])
def test_frozen_layer_matches_the_gather_then_product(block_size, rng):
    layer, variables, x = _frozen_linen(block_size, rng)
    perm = variables["diagonals"]["perm"]
    plain = layer.clone(permutation=None)
    unpermuted = {
        c: {k: v for k, v in tree.items() if k != "perm"} for c, tree in variables.items()
    }

    def permuted_loss(params, x, collections):
        return jnp.sum(jnp.sin(layer.apply({**collections, "params": params}, x)))

    def gathered_loss(params, x):
        return jnp.sum(jnp.sin(plain.apply({**unpermuted, "params": params}, x[:, perm])))

    rest = {c: t for c, t in variables.items() if c != "params"}
    # the variables as jit arguments: perm is traced (checked at run time)
    got = jax.jit(jax.value_and_grad(permuted_loss, argnums=(0, 1)))(variables["params"], x, rest)
    want = jax.value_and_grad(gathered_loss, argnums=(0, 1))(unpermuted["params"], x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        _assert_close(g, w, jnp.float32, "layer")
    eager = layer.apply(variables, x)
    _assert_close(eager, plain.apply(unpermuted, x[:, perm]), jnp.float32, "eager")


def test_frozen_layer_with_a_traced_bad_perm_gives_nan(rng):
    layer, variables, x = _frozen_linen(1, rng)
    bad = variables["diagonals"]["perm"].at[0].set(variables["diagonals"]["perm"][1])
    variables = {**variables, "diagonals": {**variables["diagonals"], "perm": bad}}
    assert np.all(np.isnan(jax.jit(layer.apply)(variables, x)))
    with pytest.raises(ValueError, match="perm is not a permutation"):
        layer.apply(variables, x)


def test_nnx_frozen_layer_matches_the_gather_then_product(rng):
    layer = dd.nnx.DiagonalDense(
        96, 64, sparsity=0.75, init_phase="frozen", permutation="random", rngs=nnx.Rngs(0)
    )
    x = jnp.asarray(rng.standard_normal((5, 96)), jnp.float32)
    perm = layer.perm.get_value()
    spec = layer.spec
    want = dd.nn.functional.frozen_forward(
        spec, layer.values.get_value(), layer.offsets.get_value(), x[:, perm]
    )
    if layer.bias is not None:
        want = want + layer.bias.get_value()[None, :]
    _assert_close(nnx.jit(lambda m, x: m(x))(layer, x), want, jnp.float32, "nnx")
