"""The C++ CPU kernels, every instruction-set family this CPU runs, against a float64 reference.

`_cpu_ext._run_kernel` runs one family directly (the FFI handlers always use the best one), so the
AVX2 and portable fallbacks are tested on AVX-512 machines too, and the portable family, which runs
the block kernels' AVX-512 tiling, stands in for it on machines without. The sizes cross the
kernels' block boundaries: rows not a multiple of 8 or of the 32-row chunks, widths not a multiple
of the 16-column tiles, wrapped diagonals split inside a tile, several workers adding partial sums;
for block diagonals, rows not a multiple of the register tiles or beyond one chunk, every block
size, K = 1, K = P_b, repeated offsets, K = 0 and no rows. Batches of a few rows (up to 8 for
element diagonals, 16 for blocks) take the few-row kernels, which read the values in place; the
cases include such batches with enough work to split over several tasks. Every product also runs
with an input permutation (`perm`), which the jobs apply where they copy chunks of rows.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_diag_matmul_blocks import design_dense, design_dvalues

import dynadiag_jax as dd
from dynadiag_jax.layout import diag_indices

_cpu_ext = pytest.importorskip("dynadiag_jax._cpu_ext")

ISAS = _cpu_ext.supported_isas()
# float32: sums of at most a few hundred products, relative to the largest reference entry.
F32_RTOL = 2e-5
# bfloat16 results are rounded once from a float32 sum: half an ulp (2**-9) of the entry, with
# room for the float32 sum's own error.
BF16_RTOL = 2.0**-8

CASES = [  # (in, out, rows, k, duplicate offsets)
    (1, 1, 1, 1, False),
    (7, 33, 7, 5, True),
    (33, 7, 33, 7, True),
    (33, 33, 9, 33, False),  # square, K = P
    (33, 257, 20, 257, False),  # tall, K = P
    (257, 33, 257, 40, False),  # wide, rows beyond one 32-row chunk
    (100, 100, 35, 50, False),
    (48, 96, 64, 10, False),  # widths and rows multiples of the blocks
    (300, 700, 70, 400, False),  # over 4096 segments: several tile groups in the fused backward
    (700, 300, 70, 400, False),
    (64, 48, 3, 0, False),  # K = 0
    (17, 9, 0, 4, False),  # no rows
    (300, 700, 5, 400, False),  # a few rows, split over several tasks
    (700, 300, 8, 400, True),
    (70, 331, 16, 60, False),  # the forward writes the long side: a few rows up to 16
    (331, 70, 12, 60, True),  # dx writes the long side
    (33, 257, 2, 257, False),  # two rows, K = P: spans of every length
    (257, 33, 3, 40, False),
]


def _case(rng, in_f, out_f, rows, k, duplicates):
    p, d = max(in_f, out_f), min(in_f, out_f)
    offsets = rng.integers(0, p, k) if duplicates else rng.choice(p, k, replace=False)
    x = rng.standard_normal((rows, in_f)).astype(np.float32)
    dy = rng.standard_normal((rows, out_f)).astype(np.float32)
    values = rng.standard_normal((k, d)).astype(np.float32)
    return x, dy, values, np.asarray(offsets, np.int32)


def _dense(values, offsets, in_f, out_f):
    rows, cols = (np.asarray(a) for a in diag_indices(jnp.asarray(offsets), in_f, out_f))
    w = np.zeros((out_f, in_f))
    np.add.at(w, (rows, cols), values.astype(np.float64))
    return w, rows, cols


def _operand(a, bf16):
    """float32, or bfloat16 bits as uint16 (numpy bfloat16 arrays do not cross DLPack)."""
    a = np.ascontiguousarray(a, np.float32)
    return a.astype(ml_dtypes.bfloat16).view(np.uint16) if bf16 else a


def _result(shape, bf16):
    """A result buffer full of NaN: every entry must be written."""
    return np.full(shape, 0x7FC0, np.uint16) if bf16 else np.full(shape, np.nan, np.float32)


def _as_f64(out, bf16):
    return (out.view(ml_dtypes.bfloat16) if bf16 else out).astype(np.float64)


def _run(op, isa, a, b, offsets, out_shape, in_f, out_f, workers, bf16, perm=None):
    """The kernel's result as float64."""
    out = _result(out_shape, bf16)
    _cpu_ext._run_kernel(
        op, isa, _operand(a, bf16), _operand(b, bf16), offsets, out, in_f, out_f, workers, perm
    )
    return _as_f64(out, bf16)


def _perm(rng, in_f, permuted):
    """A random input permutation of ``in_f`` columns, or None."""
    return rng.permutation(in_f).astype(np.int32) if permuted else None


def _gathered(x, perm):
    """``x[:, perm]``: the rows the product of ``W P`` reads."""
    return x if perm is None else x[:, perm]


def _scattered(dx, perm):
    """``out[:, perm[j]] = dx[:, j]``: dx of ``W P`` from dx of ``W``."""
    if perm is None:
        return dx
    out = np.empty_like(dx)
    out[:, perm] = dx
    return out


def _assert_close(actual, expected, bf16, what):
    scale = max(1.0, float(np.max(np.abs(expected), initial=0.0)))
    bound = F32_RTOL * scale + (BF16_RTOL * np.abs(expected) if bf16 else 0.0)
    err = np.abs(actual - expected)
    assert np.all(err <= bound), f"{what}: max abs error {float(np.max(err, initial=0)):.3g}"


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "{}x{}-r{}-k{}".format(*c) + "-dup" * c[4])
@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("permuted", [False, True], ids=["", "perm"])
def test_kernel_family_matches_dense(isa, case, bf16, workers, permuted, rng):
    in_f, out_f, rows, k, duplicates = case
    x, dy, values, offsets = _case(rng, in_f, out_f, rows, k, duplicates)
    if bf16:  # the reference sees the same (rounded) inputs
        x, dy, values = (v.astype(ml_dtypes.bfloat16).astype(np.float32) for v in (x, dy, values))
    w, wr, wc = _dense(values, offsets, in_f, out_f)
    d = min(in_f, out_f)
    perm = _perm(rng, in_f, permuted)
    xp = _gathered(x, perm).astype(np.float64)

    y = _run("fwd", isa, x, values, offsets, (rows, out_f), in_f, out_f, workers, bf16, perm)
    _assert_close(y, xp @ w.T, bf16, f"{isa} y")
    dx = _run("dx", isa, dy, values, offsets, (rows, in_f), in_f, out_f, workers, bf16, perm)
    _assert_close(dx, _scattered(dy.astype(np.float64) @ w, perm), bf16, f"{isa} dx")
    dvalues = _run("dvalues", isa, dy, x, offsets, (k, d), in_f, out_f, workers, bf16, perm)
    dw = dy.astype(np.float64).T @ xp
    _assert_close(dvalues, dw[wr, wc], bf16, f"{isa} dvalues")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "{}x{}-r{}-k{}".format(*c) + "-dup" * c[4])
@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("permuted", [False, True], ids=["", "perm"])
def test_fused_backward_matches_dense(isa, case, bf16, workers, permuted, rng):
    in_f, out_f, rows, k, duplicates = case
    x, dy, values, offsets = _case(rng, in_f, out_f, rows, k, duplicates)
    if bf16:
        x, dy, values = (v.astype(ml_dtypes.bfloat16).astype(np.float32) for v in (x, dy, values))
    w, wr, wc = _dense(values, offsets, in_f, out_f)
    perm = _perm(rng, in_f, permuted)
    dx, dvalues = _result((rows, in_f), bf16), _result((k, min(in_f, out_f)), bf16)
    _cpu_ext._run_backward(
        isa,
        _operand(dy, bf16),
        _operand(x, bf16),
        _operand(values, bf16),
        offsets,
        dx,
        dvalues,
        workers,
        perm,
    )
    dx_ref = _scattered(dy.astype(np.float64) @ w, perm)
    _assert_close(_as_f64(dx, bf16), dx_ref, bf16, f"{isa} dx")
    dw = dy.astype(np.float64).T @ _gathered(x, perm).astype(np.float64)
    _assert_close(_as_f64(dvalues, bf16), dw[wr, wc], bf16, f"{isa} dvalues")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize(
    "in_f,out_f,block,rows",
    [
        (300, 700, 1, 8),
        (700, 300, 1, 5),
        (300, 700, 1, 16),
        (1500, 4000, 1, 1),  # one row, enough work for several tasks
        (256, 512, 16, 16),
        (512, 256, 32, 4),
    ],
)
def test_few_row_results_do_not_depend_on_the_task_split(isa, in_f, out_f, block, rows, rng):
    """The few-row kernels split the outputs (and dvalues) between tasks, never a sum: one task or
    three give the same bits."""
    if block == 1:
        x, dy, values, offsets = _case(rng, in_f, out_f, rows, 400, False)
    else:
        x, dy, values, offsets = _block_case(rng, in_f, out_f, block, rows, "all")
    for op, a, b, shape in (
        ("fwd", x, values, (rows, out_f)),
        ("dx", dy, values, (rows, in_f)),
        ("dvalues", dy, x, values.shape),
    ):
        for bf16 in (False, True):
            one, three = (
                _run(op, isa, a, b, offsets, shape, in_f, out_f, workers, bf16)
                for workers in (1, 3)
            )
            np.testing.assert_array_equal(one, three, err_msg=f"{op} bf16={bf16}")


@pytest.mark.parametrize("in_f,out_f", [(96, 320), (320, 96), (256, 256)])
def test_gradients_are_bitwise_reproducible(in_f, out_f, rng):
    """The backward's workers run on XLA's thread pool and add partial sums of dvalues: repeated
    calls must give the same bits whichever worker runs first, so training runs repeat exactly."""
    k = dd.num_diagonals(in_f, out_f, 0.8)
    x, _, values, offsets = _case(rng, in_f, out_f, 2048, k, False)

    def loss(values, x):
        y = dd.diag_matmul(x, values, jnp.asarray(offsets), out_features=out_f, impl="ffi")
        return jnp.sum(jnp.sin(y))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    first = [np.asarray(g) for g in grad(values, x)]
    for _ in range(10):
        for name, g, g0 in zip(("dvalues", "dx"), grad(values, x), first):
            np.testing.assert_array_equal(np.asarray(g), g0, err_msg=name)


@pytest.mark.parametrize("in_f,out_f", [(96, 320), (320, 96), (160, 160)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fused_backward_target(in_f, out_f, dtype, rng):
    """The `dynadiag_diag_matmul_v2_bwd` target (dy, x, values, offsets) -> (dx, dvalues) agrees
    with the `dx` and `dvalues` targets."""
    k = dd.num_diagonals(in_f, out_f, 0.8)
    x, dy, values, offsets = _case(rng, in_f, out_f, 133, k, False)
    dy, x, values = (jnp.asarray(v, dtype) for v in (dy, x, values))
    offsets = jnp.asarray(offsets)
    d = min(in_f, out_f)

    def call(name, shapes, *args):
        out = tuple(jax.ShapeDtypeStruct(s, dtype) for s in shapes)
        return jax.ffi.ffi_call(name, out, vmap_method="sequential")(*args)

    dx, dvalues = call("dynadiag_diag_matmul_v2_bwd", [(133, in_f), (k, d)], dy, x, values, offsets)
    (dx_ref,) = call("dynadiag_diag_matmul_v2_dx", [(133, in_f)], dy, values, offsets)
    (dv_ref,) = call("dynadiag_diag_matmul_v2_dvalues", [(k, d)], dy, x, offsets)
    # Same float32 sums in a different order: equal up to float32 (and one bf16) rounding.
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(
        np.asarray(dx, np.float32), np.asarray(dx_ref, np.float32), rtol=tol, atol=tol
    )
    np.testing.assert_allclose(
        np.asarray(dvalues, np.float32), np.asarray(dv_ref, np.float32), rtol=tol, atol=tol * 10
    )


# (in, out, values shape, P): element diagonals of a tall W and block diagonals of b = 8
POISON_FORMS = {"element": (8, 12, (3, 8), 12), "block": (16, 24, (3, 3, 8, 8), 2)}


def _target_results(target, form, dtype, rows=4):
    in_f, out_f, vshape, _ = POISON_FORMS[form]
    shapes = {
        "fwd": [(rows, out_f)],
        "dx": [(rows, in_f)],
        "dvalues": [vshape],
        "bwd": [(rows, in_f), vshape],
    }[target]
    return [jax.ShapeDtypeStruct(s, dtype) for s in shapes]


def _target_operands(target, form, dtype, rng, rows=4):
    in_f, out_f, vshape, _ = POISON_FORMS[form]
    x = jnp.asarray(rng.standard_normal((rows, in_f)), dtype)
    dy = jnp.asarray(rng.standard_normal((rows, out_f)), dtype)
    values = jnp.asarray(rng.standard_normal(vshape), dtype)
    return {"fwd": (x, values), "dx": (dy, values), "dvalues": (dy, x), "bwd": (dy, x, values)}[
        target
    ]


@pytest.mark.parametrize("target", ["fwd", "dx", "dvalues", "bwd"])
@pytest.mark.parametrize("form", sorted(POISON_FORMS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("bad", [-1, "P"])
def test_targets_poison_offsets_out_of_range(target, form, dtype, bad, rng):
    """An offset outside [0, P) is no error (it may be traced): y and dx are NaN everywhere,
    dvalues NaN in its row and, in the others, what the same call with that offset at 0 gives."""
    p = POISON_FORMS[form][3]
    good = np.array([0, p - 1, 1 % p], np.int32)
    offsets = good.copy()
    offsets[1] = p if bad == "P" else -1
    clamped = good.copy()
    clamped[1] = 0
    call = jax.ffi.ffi_call(
        f"dynadiag_diag_matmul_v2_{target}", _target_results(target, form, dtype)
    )
    operands = _target_operands(target, form, dtype, rng)
    got = [np.asarray(r, np.float32) for r in call(*operands, jnp.asarray(offsets))]
    want = [np.asarray(r, np.float32) for r in call(*operands, jnp.asarray(clamped))]
    for kind, g, w in zip({"bwd": ["dx", "dvalues"]}.get(target, [target]), got, want):
        if kind == "dvalues":
            assert np.isnan(g[1]).all()
            np.testing.assert_array_equal(np.delete(g, 1, axis=0), np.delete(w, 1, axis=0))
            assert np.isfinite(np.delete(g, 1, axis=0)).all()
        else:
            assert np.isnan(g).all(), kind


@pytest.mark.parametrize("target", ["fwd", "dx", "dvalues", "bwd"])
@pytest.mark.parametrize("form", sorted(POISON_FORMS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_permuted_targets_poison_every_result_of_a_non_permutation(target, form, dtype, rng):
    in_f = POISON_FORMS[form][0]
    call = jax.ffi.ffi_call(
        f"dynadiag_diag_matmul_permuted_v1_{target}", _target_results(target, form, dtype)
    )
    operands = _target_operands(target, form, dtype, rng)
    offsets = jnp.asarray([0, 1, 0], jnp.int32)
    for perm in (np.r_[0, np.arange(in_f - 1)], np.r_[np.arange(in_f - 1), in_f]):
        for r in call(*operands, offsets, jnp.asarray(perm, jnp.int32)):
            assert np.isnan(np.asarray(r, np.float32)).all()
    for r in call(*operands, offsets, jnp.arange(in_f, dtype=jnp.int32)[::-1]):
        assert np.isfinite(np.asarray(r, np.float32)).all()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("in_f,out_f", [(40, 72), (72, 40), (72, 72)])
def test_inf_reaches_only_the_outputs_its_diagonals_touch(isa, in_f, out_f, rng):
    """Lanes outside a segment's mask are never read: an inf elsewhere cannot leak as 0 * inf."""
    x, dy, values, offsets = _case(rng, in_f, out_f, 9, 5, False)
    x[:, 13] = np.inf
    dy[:, 29] = np.inf
    w, _, _ = _dense(values, offsets, in_f, out_f)
    y = _run("fwd", isa, x, values, offsets, (9, out_f), in_f, out_f, 1, False)
    touched = w[:, 13] != 0
    assert np.all(np.isinf(y[:, touched])) and np.all(np.isfinite(y[:, ~touched]))
    dx = _run("dx", isa, dy, values, offsets, (9, in_f), in_f, out_f, 1, False)
    touched = w[29, :] != 0
    assert np.all(np.isinf(dx[:, touched])) and np.all(np.isfinite(dx[:, ~touched]))


@pytest.mark.parametrize("in_f,out_f,sparsity", [(96, 320, 0.9), (320, 96, 0.5), (160, 160, 0.8)])
@pytest.mark.parametrize("batch", [(257,), (3, 50)])
def test_ffi_op_at_block_sized_batches(in_f, out_f, sparsity, batch, rng):
    """Through dd.diag_matmul (the FFI handlers, thread pool and custom VJP) at batches that
    fill whole 8-row blocks and 32-row chunks plus a remainder."""
    k = dd.num_diagonals(in_f, out_f, sparsity)
    p = max(in_f, out_f)
    offsets = jnp.asarray(rng.choice(p, k, replace=False), jnp.int32)
    values = jnp.asarray(rng.standard_normal((k, min(in_f, out_f))), jnp.float32)
    x = jnp.asarray(rng.standard_normal(batch + (in_f,)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal(batch + (out_f,)), jnp.float32)

    def layer(x, values):
        return dd.diag_matmul(x, values, offsets, out_features=out_f, impl="ffi")

    y, vjp = jax.vjp(jax.jit(layer), x, values)
    dx, dvalues = vjp(dy)
    w, wr, wc = _dense(np.asarray(values), np.asarray(offsets), in_f, out_f)
    x64 = np.asarray(x, np.float64).reshape(-1, in_f)
    dy64 = np.asarray(dy, np.float64).reshape(-1, out_f)
    _assert_close(np.asarray(y).reshape(-1, out_f), x64 @ w.T, False, "y")
    _assert_close(np.asarray(dx).reshape(-1, in_f), dy64 @ w, False, "dx")
    _assert_close(np.asarray(dvalues), (dy64.T @ x64)[wr, wc], False, "dvalues")


SMALL_BATCH_LAYERS = [  # (in, out, b): tall, wide and square, sizes no tile divides
    (70, 331, 1),
    (331, 70, 1),
    (131, 131, 1),
    (48, 208, 16),
    (208, 48, 16),
    (96, 96, 16),
    (64, 224, 32),
    (224, 64, 32),
]


@pytest.mark.parametrize("in_f,out_f,b", SMALL_BATCH_LAYERS, ids=lambda v: str(v))
@pytest.mark.parametrize("rows", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_small_batches_match_the_pure_jax_path(in_f, out_f, b, rows, dtype, rng):
    """Batches of 1-16 rows (the few-row kernels, or the planned ones past their limit) through
    dd.diag_matmul: the forward and both gradients agree with impl="jax"."""
    k = dd.num_diagonals(in_f, out_f, 0.7, block_size=b)
    if b == 1:
        x, dy, values, offsets = _case(rng, in_f, out_f, rows, k, False)
    else:
        x, dy, values, offsets = _block_case(rng, in_f, out_f, b, rows, "all")
        values = values[:k]
        offsets = offsets[:k]
    x, dy, values = (jnp.asarray(a, dtype) for a in (x, dy, values))
    offsets = jnp.asarray(offsets)

    def run(impl):
        def layer(x, values):
            return dd.diag_matmul(x, values, offsets, out_features=out_f, impl=impl)

        y, vjp = jax.vjp(jax.jit(layer), x, values)
        return [np.asarray(a, np.float64) for a in (y, *vjp(dy))]

    bf16 = dtype == jnp.bfloat16
    for name, got, want in zip(("y", "dx", "dvalues"), run("ffi"), run("jax")):
        # Both paths round once from float32 sums: at most an ulp of bfloat16 apart.
        _assert_close(got, want, bf16, f"{name} (rows={rows})")


def test_run_kernel_rejects_inconsistent_operands():
    x = np.zeros((4, 8), np.float32)
    values = np.zeros((2, 8), np.float32)
    y = np.zeros((4, 16), np.float32)
    with pytest.raises(ValueError, match="offsets"):
        _cpu_ext._run_kernel("fwd", ISAS[0], x, values, np.array([0, 16], np.int32), y, 8, 16, 1)
    with pytest.raises(ValueError, match="out must have shape"):
        _cpu_ext._run_kernel(
            "fwd", ISAS[0], x, values, np.array([0, 1], np.int32), y[:, :9], 8, 16, 1
        )


# --- block diagonals: values[K, L_b, b, b] -------------------------------------------------------

BLOCK_CASES = [  # (in, out, b, rows, offsets: "one" | "all" (K = P_b) | "duplicates" | "none")
    (48, 80, 16, 13, "duplicates"),  # tall, block counts 3 -> 5, ragged register tiles
    (80, 48, 16, 7, "all"),  # wide, K = P_b
    (48, 80, 8, 25, "one"),  # K = 1
    (64, 64, 8, 30, "all"),  # square
    (32, 96, 8, 250, "duplicates"),  # rows beyond one product chunk
    (96, 32, 8, 300, "all"),  # rows beyond one dvalues chunk
    (64, 256, 32, 19, "all"),
    (256, 128, 64, 11, "duplicates"),
    (128, 256, 128, 5, "one"),
    (128, 256, 32, 600, "all"),  # enough work for several tasks
    (64, 128, 16, 3, "none"),  # K = 0
    (64, 128, 16, 0, "all"),  # no rows
    (256, 512, 16, 16, "all"),  # a few rows, split over several tasks
    (512, 256, 32, 9, "duplicates"),
    # output blocks that read the same input blocks share tiles (BlockPlanView::group): a group
    # of 5 (tiles of 4 and 1), of 7 (4, 2 and 1), and 7 in a wide layer's dx
    (32, 160, 8, 37, "duplicates"),
    (48, 336, 16, 29, "one"),
    (224, 32, 16, 9, "duplicates"),
]


def _block_case(rng, in_f, out_f, b, rows, kind):
    p, length = min(in_f, out_f) // b, max(in_f, out_f) // b
    offsets = {
        "one": rng.integers(0, p, 1),
        "all": rng.permutation(p),
        "duplicates": np.concatenate([rng.permutation(p)[: max(1, p // 2)], rng.integers(0, p, 2)]),
        "none": np.zeros(0, np.int64),
    }[kind]
    x = rng.standard_normal((rows, in_f)).astype(np.float32)
    dy = rng.standard_normal((rows, out_f)).astype(np.float32)
    values = rng.standard_normal((len(offsets), length, b, b)).astype(np.float32)
    return x, dy, values, np.asarray(offsets, np.int32)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", BLOCK_CASES, ids=lambda c: "{}x{}-b{}-r{}-{}".format(*c))
@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("permuted", [False, True], ids=["", "perm"])
def test_block_kernel_family_matches_dense(isa, case, bf16, workers, permuted, rng):
    in_f, out_f, b, rows, kind = case
    x, dy, values, offsets = _block_case(rng, in_f, out_f, b, rows, kind)
    if bf16:
        x, dy, values = (v.astype(ml_dtypes.bfloat16).astype(np.float32) for v in (x, dy, values))
    w = design_dense(values, offsets, in_f, out_f)
    perm = _perm(rng, in_f, permuted)
    xp = _gathered(x, perm)
    dvalues_ref = design_dvalues(dy, xp, offsets, in_f, out_f, b)
    dx_ref = _scattered(dy.astype(np.float64) @ w, perm)

    y = _run("fwd", isa, x, values, offsets, (rows, out_f), in_f, out_f, workers, bf16, perm)
    _assert_close(y, xp.astype(np.float64) @ w.T, bf16, f"{isa} y")
    dx = _run("dx", isa, dy, values, offsets, (rows, in_f), in_f, out_f, workers, bf16, perm)
    _assert_close(dx, dx_ref, bf16, f"{isa} dx")
    dvalues = _run("dvalues", isa, dy, x, offsets, values.shape, in_f, out_f, workers, bf16, perm)
    _assert_close(dvalues, dvalues_ref, bf16, f"{isa} dvalues")
    # The backward target: dx and dvalues from one job.
    dx, dvalues = _result((rows, in_f), bf16), _result(values.shape, bf16)
    _cpu_ext._run_backward(
        isa, *(_operand(a, bf16) for a in (dy, x, values)), offsets, dx, dvalues, workers, perm
    )
    _assert_close(_as_f64(dx, bf16), dx_ref, bf16, f"{isa} bwd dx")
    _assert_close(_as_f64(dvalues, bf16), dvalues_ref, bf16, f"{isa} bwd dvalues")


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("shift", [0, 1, 8], ids=lambda s: f"shift{s}")
def test_block_forward_into_aligned_and_unaligned_outputs(isa, shift, rng):
    """An output of 8 MiB or more (``kStreamOutputBytes``) is written with streaming stores where
    its vectors are all aligned; shifted by 1 or 8 floats from a 64-byte boundary it is stored
    plainly. Every entry is written, and right, either way."""
    in_f, out_f, b, rows = 256, 1024, 16, 2050
    x, _, values, offsets = _block_case(rng, in_f, out_f, b, rows, "duplicates")
    buffer = np.full(rows * out_f + 32, np.nan, np.float32)
    start = (-buffer.ctypes.data // 4) % 16 + shift  # 64-byte aligned, then shifted
    y = buffer[start : start + rows * out_f].reshape(rows, out_f)
    _cpu_ext._run_kernel("fwd", isa, x, values, offsets, y, in_f, out_f, 2, None)
    w = design_dense(values, offsets, in_f, out_f)
    _assert_close(y.astype(np.float64), x.astype(np.float64) @ w.T, False, f"{isa} y")
    assert np.isnan(buffer[:start]).all() and np.isnan(buffer[start + rows * out_f :]).all()


@pytest.mark.parametrize(
    "in_f,out_f,b,kind,batch",
    [
        (48, 80, 16, "all", (257,)),
        (80, 48, 8, "duplicates", (3, 50)),
        (64, 64, 16, "one", (2, 3, 5)),
        (48, 80, 8, "none", (6,)),
        (80, 48, 16, "all", (0,)),
    ],
)
def test_block_ffi_op_matches_the_reference_and_dense(in_f, out_f, b, kind, batch, rng):
    """dd.diag_matmul(impl="ffi") on block diagonals (the handlers, the thread pool and the
    custom VJP with the backward target) against the pure-JAX path and float64 dense."""
    x, dy, values, offsets = _block_case(rng, in_f, out_f, b, 1, kind)
    x = jnp.asarray(rng.standard_normal(batch + (in_f,)), jnp.float32)
    dy = jnp.asarray(rng.standard_normal(batch + (out_f,)), jnp.float32)
    values, offsets = jnp.asarray(values), jnp.asarray(offsets)

    def run(impl):
        def layer(x, values):
            return dd.diag_matmul(x, values, offsets, out_features=out_f, impl=impl)

        y, vjp = jax.vjp(jax.jit(layer), x, values)
        return (y, *vjp(dy))

    got, ref = run("ffi"), run("jax")
    w = design_dense(values, offsets, in_f, out_f)
    x64 = np.asarray(x, np.float64).reshape(-1, in_f)
    dy64 = np.asarray(dy, np.float64).reshape(-1, out_f)
    exact = (x64 @ w.T, dy64 @ w, design_dvalues(dy64, x64, offsets, in_f, out_f, b))
    for name, g, r, e in zip(("y", "dx", "dvalues"), got, ref, exact):
        g64 = np.asarray(g, np.float64).reshape(e.shape)
        _assert_close(g64, e, False, f"{name} vs dense")
        _assert_close(g64, np.asarray(r, np.float64).reshape(e.shape), False, f"{name} vs jax")


@pytest.mark.parametrize("in_f,out_f", [(96, 320), (320, 96)])
def test_block_gradients_are_bitwise_reproducible(in_f, out_f, rng):
    b = 16
    x, _, values, offsets = _block_case(rng, in_f, out_f, b, 2048, "duplicates")

    def loss(values, x):
        y = dd.diag_matmul(x, values, jnp.asarray(offsets), out_features=out_f, impl="ffi")
        return jnp.sum(jnp.sin(y))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    first = [np.asarray(g) for g in grad(values, x)]
    for _ in range(5):
        for name, g, g0 in zip(("dvalues", "dx"), grad(values, x), first):
            np.testing.assert_array_equal(np.asarray(g), g0, err_msg=name)


def _ffi(target, results, *args):
    out = tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in results)
    call = jax.ffi.ffi_call(f"dynadiag_diag_matmul_v2_{target}", out, vmap_method="sequential")
    return jax.block_until_ready(call(*args))


def _zeros(*shape):
    return np.zeros(shape, np.float32)


OK_OFFSETS = np.array([0, 1], np.int32)
BLOCK_ERRORS = [  # (target, result shapes, operands, message): in = 16, out = 64 unless noted
    (
        "fwd",
        [(4, 64)],
        (_zeros(4, 16), _zeros(2, 16, 4, 4), OK_OFFSETS),
        r"values has blocks of b=4 \(shape \[2, 16, 4, 4\]\); block diagonals take b in "
        r"\{8, 16, 32, 64, 128\}",
    ),
    ("fwd", [(4, 64)], (_zeros(4, 16), _zeros(2, 64, 1, 1), OK_OFFSETS), r"has blocks of b=1"),
    (
        "dx",
        [(4, 16)],
        (_zeros(4, 64), _zeros(2, 8, 8, 16), OK_OFFSETS),
        r"values must have shape \[K, L_b, b, b\] \(square blocks\), got \[2, 8, 8, 16\]",
    ),
    (
        "fwd",
        [(4, 64)],
        (_zeros(4, 40), _zeros(2, 4, 16, 16), OK_OFFSETS),
        r"block size b=16 \(from values \[2, 4, 16, 16\]\) must divide in=40 and out=64",
    ),
    (
        "fwd",
        [(4, 64)],
        (_zeros(4, 16), _zeros(2, 7, 8, 8), OK_OFFSETS),
        r"values must have shape \[K, L_b, b, b\] = \[2, 8, 8, 8\] \(K from offsets, "
        r"L_b = max\(in, out\) / b\), got \[2, 7, 8, 8\]",
    ),
    (
        "dx",
        [(4, 16)],
        (_zeros(4, 64), _zeros(3, 8, 8, 8), OK_OFFSETS),
        r"values must have shape \[K, L_b, b, b\] = \[2, 8, 8, 8\]",
    ),
    (
        "dvalues",
        [(2, 4, 8, 8)],
        (_zeros(4, 64), _zeros(4, 16), OK_OFFSETS),
        r"dvalues must have shape \[K, L_b, b, b\] = \[2, 8, 8, 8\]",
    ),
    (
        "bwd",
        [(4, 16), (2, 16)],
        (_zeros(4, 64), _zeros(4, 16), _zeros(2, 8, 8, 8), OK_OFFSETS),
        r"dvalues must have shape \[K, L_b, b, b\] = \[2, 8, 8, 8\]",
    ),
    (
        "bwd",
        [(4, 16), (2, 8, 8, 8)],
        (_zeros(4, 64), _zeros(4, 16), _zeros(2, 8, 8, 4), OK_OFFSETS),
        r"values must have shape \[K, L_b, b, b\] "
        r"\(square blocks\)",
    ),
]


@pytest.mark.parametrize("target,results,operands,message", BLOCK_ERRORS)
def test_block_handlers_reject_bad_operands(target, results, operands, message):
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"dynadiag_diag_matmul_v2_{target}: "):
        _ffi(target, results, *operands)
    with pytest.raises(jax.errors.JaxRuntimeError, match=message):
        _ffi(target, results, *operands)


@pytest.mark.parametrize(
    "target, results, operand, operands",
    [
        ("fwd", [(256, 64)], 0, (np.ones((256, 64), np.float32), np.ones((3, 64), np.float32))),
        ("dx", [(256, 64)], 0, (np.ones((256, 64), np.float32), np.ones((3, 64), np.float32))),
        # 3 rows: x has dvalues' shape
        ("dvalues", [(3, 64)], 1, (np.ones((3, 64), np.float32), np.ones((3, 64), np.float32))),
        (
            "bwd",
            [(256, 64), (3, 64)],
            1,
            (np.ones((256, 64), np.float32),) * 2 + (np.ones((3, 64), np.float32),),
        ),
    ],
)
def test_a_result_aliasing_an_operand_is_refused(target, results, operand, operands):
    """input_output_aliases in a direct call: the kernels read x while they wrote y over it
    (a square layer's fwd was 34 off the product)."""
    offsets = np.array([0, 5, 17], np.int32)
    out = tuple(jax.ShapeDtypeStruct(s, jnp.float32) for s in results)
    call = jax.ffi.ffi_call(
        f"dynadiag_diag_matmul_v2_{target}", out, input_output_aliases={operand: 0}
    )
    with pytest.raises(jax.errors.JaxRuntimeError, match="must not share memory with"):
        jax.block_until_ready(jax.jit(lambda *a: call(*a, offsets))(*operands))


@pytest.mark.parametrize("block_size", [1, 16])
def test_float16_auto_runs_the_kernels_in_float32(block_size, rng):
    """A float16 model on CPU (it once took the pure-JAX path, slower than dense): impl="auto"
    lowers every product to the kernels on float32 copies and rounds each result to float16 once,
    so it agrees with the float32 kernels on the same (float16) inputs."""
    in_f, out_f, rows = 96, 320, 40
    k = dd.num_diagonals(in_f, out_f, 0.8, block_size=block_size)
    p = dd.layout.geometry(in_f, out_f, block_size).num_candidates
    offsets = jnp.asarray(rng.choice(p, k, replace=False), jnp.int32)
    shape = (k, in_f) if block_size == 1 else (k, out_f // block_size, block_size, block_size)
    x, values, dy = (
        jnp.asarray(rng.standard_normal(s), jnp.float16)
        for s in ((rows, in_f), shape, (rows, out_f))
    )

    def run(x, values, dy):
        def f(x, values):
            return dd.diag_matmul(x, values, offsets, out_features=out_f)

        y, vjp = jax.vjp(f, x, values)
        return (y, *vjp(dy))

    step = jax.jit(run)
    text = step.lower(x, values, dy).compile().as_text()
    for target in ("fwd", "bwd"):
        assert f"dynadiag_diag_matmul_v2_{target}" in text, target
    got = step(x, values, dy)
    want = jax.jit(run)(*(a.astype(jnp.float32) for a in (x, values, dy)))
    for name, g, w in zip(("y", "dx", "dvalues"), got, want):
        assert g.dtype == jnp.float16 and g.shape == w.shape, name
        # one rounding to float16 (half an ulp, 2**-11 relative) of the float32 result
        np.testing.assert_allclose(
            np.asarray(g, np.float32), w, rtol=2.0**-11, atol=1e-6, err_msg=name
        )
