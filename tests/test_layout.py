"""The index maths against docs/design.md section 1, written out as plain loops (no shared helpers).

Every other test builds its dense oracle from ``diag_indices``/``diag_to_dense``; these tests pin
those to the contract itself, so a convention error cannot hide in both the kernels and the oracle.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynadiag_jax as dd
from dynadiag_jax.layout import block_indices, coverage, geometry, transpose_diagonals


def design_dense(values, offsets, in_features, out_features):
    """``W[out, in]`` from docs/design.md section 1, entry by entry; repeated offsets add up."""
    w = np.zeros((out_features, in_features))
    for k, d in enumerate(offsets):
        if out_features >= in_features:  # tall or square: one entry per column
            for j in range(in_features):
                w[(j + d) % out_features, j] += values[k][j]
        else:  # wide: one entry per row
            for i in range(out_features):
                w[i, (i + d) % in_features] += values[k][i]
    return w


@pytest.mark.parametrize("in_f,out_f", [(1, 1), (3, 5), (5, 3), (4, 4), (7, 33), (33, 7), (9, 9)])
def test_diag_to_dense_follows_the_design_formulas(in_f, out_f, rng):
    p, d = max(in_f, out_f), min(in_f, out_f)
    offsets = np.concatenate([rng.permutation(p), rng.integers(0, p, 2)])  # every id, 2 repeats
    values = rng.standard_normal((len(offsets), d))
    w = dd.diag_to_dense(
        jnp.asarray(values, jnp.float32),
        jnp.asarray(offsets, jnp.int32),
        in_features=in_f,
        out_features=out_f,
    )
    np.testing.assert_allclose(np.asarray(w), design_dense(values, offsets, in_f, out_f), 1e-6)


def test_distinct_diagonals_cover_the_matrix_exactly_once():
    for in_f, out_f in [(3, 5), (5, 3), (4, 4)]:
        p, d = max(in_f, out_f), min(in_f, out_f)
        cover = sum(
            design_dense(np.ones((1, d)), [o], in_f, out_f) for o in range(p)
        )  # P * D = in * out entries
        np.testing.assert_array_equal(cover, np.ones((out_f, in_f)))


@pytest.mark.parametrize("impl", [i for i in dd.available_impls() if i != "auto"])
def test_wide_and_square_hand_cases(impl):
    # Wide W[2, 4], diagonal 3: W[i, (i + 3) % 4] = v[i] -> W[0, 3] = 2, W[1, 0] = 5.
    x = jnp.asarray([[1.0, 10.0, 100.0, 1000.0]], jnp.float32)
    y = dd.diag_matmul(
        x,
        jnp.asarray([[2.0, 5.0]], jnp.float32),
        jnp.asarray([3], jnp.int32),
        out_features=2,
        impl=impl,
    )
    np.testing.assert_allclose(np.asarray(y), [[2000.0, 5.0]], err_msg=impl)
    # Square 3x3, diagonal 1: W[(j + 1) % 3, j] = v[j] -> W[1, 0] = 1, W[2, 1] = 2, W[0, 2] = 3.
    x = jnp.asarray([[1.0, 10.0, 100.0]], jnp.float32)
    y = dd.diag_matmul(
        x,
        jnp.asarray([[1.0, 2.0, 3.0]], jnp.float32),
        jnp.asarray([1], jnp.int32),
        out_features=3,
        impl=impl,
    )
    np.testing.assert_allclose(np.asarray(y), [[300.0, 1.0, 20.0]], err_msg=impl)


@pytest.mark.parametrize("in_f,out_f", [(3, 5), (5, 3), (6, 6)])
def test_transpose_closure(in_f, out_f, rng):
    p, d = max(in_f, out_f), min(in_f, out_f)
    offsets = rng.choice(p, 3, replace=False)
    values = rng.standard_normal((3, d))
    vt, ot = transpose_diagonals(jnp.asarray(values), jnp.asarray(offsets), in_f, out_f)
    w_t = design_dense(np.asarray(vt), np.asarray(ot), out_f, in_f)  # [in, out]
    np.testing.assert_allclose(w_t, design_dense(values, offsets, in_f, out_f).T, atol=1e-12)
    if in_f != out_f:
        np.testing.assert_array_equal(np.asarray(ot), offsets)


# The authors' budget rule, worked examples (docs/design.md section 1.3).
BUDGETS = [
    (768, 3072, 0.9, 308),
    (768, 768, 0.9, 77),
    (3072, 768, 0.9, 308),
    (768, 2304, 0.8, 461),
    (768, 2304, 0.9, 231),
    (768, 2304, 0.95, 116),
    (784, 256, 0.8, 157),
    (784, 256, 0.9, 79),
    (784, 256, 0.95, 40),
    (256, 256, 0.8, 52),
    (256, 256, 0.9, 26),
    (256, 256, 0.95, 13),
    (4, 4, 0.99, 1),  # never fewer than one diagonal
]


@pytest.mark.parametrize("in_f,out_f,s,k", BUDGETS)
def test_num_diagonals_worked_examples(in_f, out_f, s, k):
    assert dd.num_diagonals(in_f, out_f, s) == k
    density = k * min(in_f, out_f) / (in_f * out_f)
    assert density >= 1 - s - 1e-12 or k == 1


@pytest.mark.parametrize("bad", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_num_diagonals_rejects_sparsity_outside_the_open_interval(bad):
    with pytest.raises(ValueError, match="sparsity must be in \\(0, 1\\)"):
        dd.num_diagonals(8, 8, bad)


@pytest.mark.parametrize("bad", ["0.5", True, None, [0.5]])
def test_num_diagonals_rejects_a_sparsity_that_is_not_a_number(bad):
    with pytest.raises(TypeError, match="sparsity must be a number in \\(0, 1\\)"):
        dd.num_diagonals(8, 8, bad)


# --- block diagonals (docs/design.md section 1, "Block diagonals") ---------------------------


def design_block_dense(values, offsets, in_features, out_features):
    """``W[out, in]`` from the block formulas, block by block; repeated offsets add up."""
    b = values.shape[-1]
    nb_in, nb_out = in_features // b, out_features // b
    w = np.zeros((out_features, in_features))
    for k, d in enumerate(offsets):
        for t in range(max(nb_in, nb_out)):
            if out_features >= in_features:  # tall or square: chain down the block rows
                r, c = t, (t + d) % nb_in
            else:  # wide: chain along the block columns
                r, c = (t + d) % nb_out, t
            w[r * b : (r + 1) * b, c * b : (c + 1) * b] += values[k][t]
    return w


@pytest.mark.parametrize("in_f,out_f,b", [(4, 12, 2), (12, 4, 2), (6, 6, 2), (6, 4, 2), (9, 3, 3)])
def test_block_diagonals_cover_the_matrix_exactly_once(in_f, out_f, b):
    geo = geometry(in_f, out_f, b)
    assert geo.num_candidates == min(in_f, out_f) // b
    assert geo.length == max(in_f, out_f) // b
    ones = np.ones((1, geo.length, b, b))
    cover = sum(design_block_dense(ones, [d], in_f, out_f) for d in range(geo.num_candidates))
    np.testing.assert_array_equal(cover, np.ones((out_f, in_f)))
    # every block diagonal touches every block row and block column
    for d in range(geo.num_candidates):
        rows, cols = (np.asarray(a) for a in block_indices(jnp.asarray([d]), in_f, out_f, b))
        assert set(rows[0]) == set(range(out_f // b)) and set(cols[0]) == set(range(in_f // b))


@pytest.mark.parametrize("in_f,out_f,b", [(4, 12, 2), (12, 4, 2), (6, 6, 2), (12, 12, 3)])
def test_block_transpose_closure(in_f, out_f, b, rng):
    geo = geometry(in_f, out_f, b)
    offsets = np.concatenate([rng.permutation(geo.num_candidates), [0]])
    values = rng.standard_normal((len(offsets), geo.length, b, b)).astype(np.float32)
    vt, ot = transpose_diagonals(jnp.asarray(values), jnp.asarray(offsets), in_f, out_f)
    w_t = design_block_dense(np.asarray(vt), np.asarray(ot), out_f, in_f)  # [in, out]
    np.testing.assert_allclose(w_t, design_block_dense(values, offsets, in_f, out_f).T, atol=1e-12)
    if in_f != out_f:  # same offsets, every block transposed
        np.testing.assert_array_equal(np.asarray(ot), offsets)
        np.testing.assert_array_equal(np.asarray(vt), np.swapaxes(values, -1, -2))
    else:  # offsets (-d) % nb, value rows rolled by d
        nb = in_f // b
        np.testing.assert_array_equal(np.asarray(ot), (-offsets) % nb)
        for k, d in enumerate(offsets):
            np.testing.assert_array_equal(
                np.asarray(vt[k]), np.swapaxes(np.roll(values[k], d, axis=0), -1, -2)
            )


BLOCK_BUDGETS = [  # (in, out, s, b, K, P_b)
    (768, 3072, 0.9, 16, 5, 48),
    (3072, 768, 0.9, 16, 5, 48),
    (768, 768, 0.9, 16, 5, 48),
    (768, 3072, 0.9, 32, 3, 24),
    (768, 3072, 0.5, 64, 6, 12),
    (768, 768, 0.99, 128, 1, 6),  # never fewer than one
    (64, 64, 0.001, 32, 2, 2),  # never more than P_b
]


@pytest.mark.parametrize("in_f,out_f,s,b,k,p", BLOCK_BUDGETS)
def test_block_budget_worked_examples(in_f, out_f, s, b, k, p):
    assert dd.num_diagonals(in_f, out_f, s, block_size=b) == k
    assert geometry(in_f, out_f, b).num_candidates == p
    density = k * max(in_f, out_f) * b / (in_f * out_f)
    assert density >= 1 - s - 1e-12 or k == 1


def test_block_size_one_is_the_element_budget():
    assert dd.num_diagonals(768, 3072, 0.9, block_size=1) == dd.num_diagonals(768, 3072, 0.9)


@pytest.mark.parametrize(
    "in_f,out_f,b,fits",
    [(48, 96, 32, "8, 16"), (100, 64, 16, "none"), (768, 3072, 40, "8, 16, 32, 64, 128")],
)
def test_block_size_that_does_not_divide_names_the_sizes_that_fit(in_f, out_f, b, fits):
    match = (
        rf"block_size={b} must divide in_features={in_f} and out_features={out_f}; "
        rf"block sizes in \(8, 16, 32, 64, 128\) that fit: {fits}"
    )
    with pytest.raises(ValueError, match=match):
        dd.num_diagonals(in_f, out_f, 0.9, block_size=b)


@pytest.mark.parametrize(
    "b,error,match",
    [(0, ValueError, "block_size must be >= 1"), (16.0, TypeError, "block_size must be an int")],
)
def test_block_size_argument_checks(b, error, match):
    with pytest.raises(error, match=match):
        dd.num_diagonals(64, 64, 0.9, block_size=b)


@pytest.mark.parametrize(
    "in_f,out_f,b,offsets",
    [(4, 12, 1, [0, 1]), (12, 4, 1, [3, 11]), (6, 6, 1, [2]), (16, 32, 8, [1]), (32, 16, 8, [0])],
)
def test_coverage_counts_the_nonzeros_of_each_row_and_column(in_f, out_f, b, offsets, rng):
    off = np.asarray(offsets)
    shape = (len(off), geometry(in_f, out_f, b).length) + ((b, b) if b > 1 else ())
    w = np.asarray(
        dd.diag_to_dense(jnp.ones(shape), jnp.asarray(off), in_features=in_f, out_features=out_f)
    )
    rows, cols = coverage(off, in_f, out_f, block_size=b)
    np.testing.assert_array_equal(rows, (w != 0).sum(1))
    np.testing.assert_array_equal(cols, (w != 0).sum(0))


def test_coverage_of_a_tall_layer_can_leave_rows_empty_and_checks_offsets():
    rows, cols = coverage([0, 1], 4, 12)  # diagonals 0 and 1 of a 12x4 W reach rows 0..4 only
    assert (rows == 0).sum() == 7 and (cols == 2).all()
    with pytest.raises(ValueError, match=r"\[0, 12\)"):
        coverage([12], 4, 12)


def test_the_block_size_hint_names_sizes_the_layer_takes():
    """The hint once said "the pure-JAX path takes any common divisor >= 2", yet the
    layer refuses block_size=4; it now lists the sizes DiagonalDense takes, and one works."""
    x = jax.ShapeDtypeStruct((2, 784), jnp.float32)

    def init(b):
        layer = dd.nn.DiagonalDense(256, sparsity=0.9, block_size=b)
        return jax.eval_shape(lambda x: layer.init(jax.random.key(0), x), x)

    with pytest.raises(ValueError, match=r"that fit: 8, 16 \(DiagonalDense and the kernels take "):
        init(64)
    assert init(16)["params"]["values"].shape == (16, 49, 16, 16)


def test_index_functions_check_offsets_they_can_read():
    """Host offsets outside [0, P) wrapped modulo P (12 of P = 12 gave offset 0's coordinates),
    float offsets were truncated and 2-D ones gave a broadcasting error."""
    for bad in ([12], [-1]):
        with pytest.raises(ValueError, match=r"offsets must lie in \[0, P\) = \[0, 12\)"):
            dd.layout.diag_indices(np.asarray(bad), 4, 12)
    with pytest.raises(ValueError, match=r"offsets must lie in \[0, P_b\) = \[0, 2\)"):
        block_indices(jnp.asarray([2]), 4, 12, 2)
    with pytest.raises(TypeError, match=r"offsets must be an integer array \[K\].*float32\[1\]"):
        dd.layout.diag_indices(jnp.asarray([1.5]), 4, 12)
    with pytest.raises(ValueError, match=r"offsets must be an integer array \[K\].*int32\[2, 2\]"):
        block_indices(jnp.zeros((2, 2), jnp.int32), 4, 12, 2)
    # Traced offsets (the library's products, inside jit) cannot be read: they wrap, as documented.
    rows, _ = jax.jit(lambda o: dd.layout.diag_indices(o, 4, 12))(jnp.asarray([12, 1]))
    np.testing.assert_array_equal(rows, [[0, 1, 2, 3], [1, 2, 3, 4]])


def test_transpose_diagonals_checks_values_and_offsets():
    """Values of the wrong D, a values/offsets K mismatch and offsets out of range ran."""
    values, offsets = jnp.ones((2, 4)), jnp.asarray([0, 1])
    with pytest.raises(ValueError, match=r"values must have shape \[K, D\] = \[K, 4\].*\[2, 5\]"):
        transpose_diagonals(jnp.ones((2, 5)), offsets, 4, 12)
    with pytest.raises(
        ValueError, match=r"values must have shape \[K, L_b, b, b\] = \[K, 6, 2, 2\]"
    ):
        transpose_diagonals(jnp.ones((2, 5, 2, 2)), offsets, 4, 12)
    with pytest.raises(ValueError, match=r"offsets must have shape \[K\] = \[2\] to match values"):
        transpose_diagonals(values, jnp.asarray([0]), 4, 4)
    with pytest.raises(ValueError, match=r"offsets must lie in \[0, P\) = \[0, 4\)"):
        transpose_diagonals(values, jnp.asarray([0, 4]), 4, 4)
    with pytest.raises(TypeError, match="values must be an array"):
        transpose_diagonals([[1.0]], [0], 1, 1)
    _, offsets_t = jax.jit(lambda v, o: transpose_diagonals(v, o, 4, 4))(values, offsets)
    np.testing.assert_array_equal(offsets_t, [0, 3])


def test_coverage_is_host_only_and_checks_offsets():
    """Float offsets were accepted, and traced ones gave TracerArrayConversionError."""
    with pytest.raises(TypeError, match="offsets must be an integer array"):
        coverage([0.5], 4, 12)
    with pytest.raises(TypeError, match="coverage: offsets must be concrete.*outside jit"):
        jax.jit(lambda o: coverage(o, 4, 12)[0])(jnp.asarray([1]))
