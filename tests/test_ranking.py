"""``gate_rank`` (ops/ranking.py): the CPU kernel against the pure-JAX reference, the reference
against its definitions, and the transformations a layer puts it through."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynadiag_jax as dd
from dynadiag_jax import _extension
from dynadiag_jax.nn import functional as F
from dynadiag_jax.nn.search import gate_inputs
from dynadiag_jax.ops import ranking

needs_kernel = pytest.mark.skipif(
    not _extension.has_cpu_kernels() or jax.default_backend() != "cpu",
    reason="the CPU kernel is not built",
)


def _scores(rng, rows, p, kind):
    a = rng.normal(size=(rows, p))
    if kind == "ties":
        a = np.round(a * 2) / 2
    if kind == "equal":
        a = np.zeros((rows, p))
    if kind == "wide":
        a = a * 1e4
    return a


def _compare(x, y, atol):
    for name in ranking.Ranking._fields:
        u, v = np.asarray(getattr(x, name)), np.asarray(getattr(y, name))
        assert u.shape == v.shape and u.dtype == v.dtype, name
        if u.dtype.kind == "i":
            np.testing.assert_array_equal(u, v, err_msg=name)
        else:
            np.testing.assert_allclose(u, v, atol=atol, rtol=0, err_msg=name)


@needs_kernel
@pytest.mark.parametrize("kind", ["normal", "ties", "equal", "wide"])
@pytest.mark.parametrize("p, k", [(1, 1), (7, 7), (64, 3), (300, 30), (1536, 154)])
@pytest.mark.parametrize("sparse", [True, False])
def test_cpu_kernel_matches_the_reference(rng, kind, p, k, sparse):
    a = jnp.asarray(_scores(rng, 3, p, kind), jnp.float32)
    hyper = jnp.asarray([1e-3, 0.5, 0.0], jnp.float32)  # 0: the hard gate's row
    old = jnp.asarray(rng.integers(-1, p + 1, size=(3, k)), jnp.int32)
    got = ranking.gate_rank(a, hyper, old, sparse=sparse)
    want = ranking.gate_rank(a, hyper, old, sparse=sparse, impl="jax")
    # tau: sums of up to P terms in float32, in another order
    _compare(got, want, atol=5e-6 * (1 + p / 100))


@needs_kernel
def test_cpu_kernel_matches_the_reference_in_float64(rng):
    with jax.enable_x64(True):
        a = jnp.asarray(rng.normal(size=(2, 500)), jnp.float64)
        old = jnp.zeros((2, 50), jnp.int32)
        got = ranking.gate_rank(a, 0.3, old, sparse=True)
        want = ranking.gate_rank(a, 0.3, old, sparse=True, impl="jax")
        assert got.tau.dtype == jnp.float64
        _compare(got, want, atol=1e-12)


@needs_kernel
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_cpu_kernel_matches_the_reference_on_signed_zeros_and_infinities(rng, dtype):
    """The kernel sorts integer keys of the scores: -0 must tie with +0 (lower index first) and
    the infinities sit at the ends, exactly as the reference's comparison sorts them."""
    a = np.round(rng.normal(size=(2, 40)))  # many ties, zeros among them
    a[:, ::5] = -0.0
    a[0, [3, 17]] = np.inf
    a[0, [8, 30]] = -np.inf
    a[1, 11] = np.nan
    with jax.enable_x64(dtype == jnp.float64):
        scores = jnp.asarray(a, dtype)
        old = jnp.zeros((2, 6), jnp.int32)
        got = ranking.gate_rank(scores, 0.5, old, sparse=True)
        want = ranking.gate_rank(scores, 0.5, old, sparse=True, impl="jax")
        for name in ("order", "rank", "topk", "changed"):
            np.testing.assert_array_equal(getattr(got, name), getattr(want, name), err_msg=name)
        for name in ("kth", "tau", "share"):
            np.testing.assert_allclose(getattr(got, name), getattr(want, name), atol=1e-6)


@needs_kernel
def test_cpu_kernel_orders_nan_last_and_stays_finite_elsewhere(rng):
    a = rng.normal(size=(1, 200))
    a[0, ::4] = np.nan
    a = jnp.asarray(a, jnp.float32)
    old = jnp.arange(20, dtype=jnp.int32)[None]
    for impl in ("auto", "jax"):
        got = ranking.gate_rank(a, 0.5, old, sparse=True, impl=impl)
        order = np.asarray(got.order[0])
        assert np.isnan(np.asarray(a[0])[order[-50:]]).all()  # the 50 NaN last
        assert np.isfinite(np.asarray(got.tau)).all()


def test_reference_follows_its_definitions(rng):
    p, k = 100, 12
    a = np.round(rng.normal(size=(2, p)) * 3) / 3  # many ties
    old = rng.integers(0, p, size=(2, k))
    got = ranking.gate_rank(jnp.asarray(a, jnp.float32), 0.7, jnp.asarray(old), sparse=True)
    for r in range(2):
        order = np.argsort(-a[r], kind="stable")  # ties: lower index first
        np.testing.assert_array_equal(got.order[r], order)
        np.testing.assert_array_equal(np.asarray(got.order[r])[got.rank[r]], np.arange(p))
        np.testing.assert_array_equal(got.topk[r], np.sort(order[:k]))
        assert got.changed[r] == k - len(set(old[r]) & set(order[:k].tolist()))
        kth = np.sort(a[r].astype(np.float32))[-k]
        np.testing.assert_allclose(got.kth[r], kth)
        above, tied = np.sum(a[r] > kth + 1e-6), np.sum(np.abs(a[r] - kth) < 1e-6)
        np.testing.assert_allclose(got.share[r], (k - above) / tied, rtol=1e-6)


@pytest.mark.parametrize("impl", ["auto", "jax"])
@pytest.mark.parametrize("strength", [1.0, 0.05, 0.0])
def test_gate_from_the_ranking_is_the_sparse_gate(rng, impl, strength):
    alpha = jnp.asarray(rng.normal(size=(300,)) * 0.1, jnp.float32)
    coef = jnp.asarray(rng.normal(size=(300,)), jnp.float32)
    k = 30

    def ours(a):
        return jnp.sum(gate_inputs(a, strength, gate="sparse_topk", k=k, impl=impl).gate * coef)

    def public(a):
        return jnp.sum(dd.sparse_soft_topk(a, k, strength=strength) * coef)

    inputs = gate_inputs(alpha, strength, gate="sparse_topk", k=k, impl=impl)
    np.testing.assert_allclose(
        inputs.gate, dd.sparse_soft_topk(alpha, k, strength=strength), atol=2e-6
    )
    np.testing.assert_allclose(jnp.sum(inputs.gate), k, rtol=1e-5)
    np.testing.assert_allclose(jax.grad(ours)(alpha), jax.grad(public)(alpha), atol=1e-4)
    assert float(inputs.gate_nonzero) == int(jnp.sum(inputs.gate > 0))


def test_gate_rank_under_jit_vmap_and_leading_dims(rng):
    a = jnp.asarray(rng.normal(size=(4, 3, 50)), jnp.float32)
    hyper = jnp.asarray(rng.uniform(0.1, 1, size=(4, 3)), jnp.float32)
    old = jnp.zeros((4, 3, 5), jnp.int32)
    whole = ranking.gate_rank(a, hyper, old, sparse=True)
    mapped = jax.jit(jax.vmap(lambda x, h, o: ranking.gate_rank(x, h, o, sparse=True)))(
        a, hyper, old
    )
    _compare(whole, mapped, atol=0)
    assert whole.order.shape == (4, 3, 50) and whole.tau.shape == (4, 3)
    one = ranking.gate_rank(a[2, 1], hyper[2, 1], old[2, 1], sparse=True)
    np.testing.assert_array_equal(one.order, whole.order[2, 1])
    np.testing.assert_allclose(one.tau, whole.tau[2, 1], atol=1e-6)


def test_gate_rank_has_no_gradient(rng):
    a = jnp.asarray(rng.normal(size=(40,)), jnp.float32)

    def f(x):
        r = ranking.gate_rank(x, 0.5, jnp.zeros((4,), jnp.int32), sparse=True)
        return r.kth + r.tau + r.share

    np.testing.assert_array_equal(jax.grad(f)(a), np.zeros(40))
    _, tangent = jax.jvp(f, (a,), (jnp.ones_like(a),))
    assert tangent == 0


def test_gate_rank_rejects_a_budget_outside_the_candidates():
    with pytest.raises(ValueError, match="1 <= K <= P = 5"):
        ranking.gate_rank(jnp.zeros((5,)), 1.0, jnp.zeros((6,), jnp.int32), sparse=True)


@needs_kernel
@pytest.mark.parametrize(
    "operands, message",
    [
        (
            (np.zeros((2, 8), np.int32), np.zeros(2, np.int32), np.zeros((2, 3), np.int32)),
            "F32 or F64",
        ),
        (
            (np.zeros((2, 8), np.float32), np.zeros(3, np.float32), np.zeros((2, 3), np.int32)),
            "hyper",
        ),
        (
            (np.zeros((2, 8), np.float32), np.zeros(2, np.float32), np.zeros((2, 9), np.int32)),
            "old_topk",
        ),
        (
            (np.zeros((2, 8), np.float32), np.zeros(2, np.float32), np.zeros((2, 3), np.float32)),
            "S32",
        ),
    ],
)
def test_cpu_handler_rejects_bad_operands(operands, message):
    alpha, _, old = operands
    rows, p = alpha.shape
    k = old.shape[-1]
    dtype = alpha.dtype if alpha.dtype != np.int32 else np.float32
    results = [
        jax.ShapeDtypeStruct((rows, p), jnp.int32),
        jax.ShapeDtypeStruct((rows, p), jnp.int32),
        jax.ShapeDtypeStruct((rows, k), jnp.int32),
        jax.ShapeDtypeStruct((rows,), jnp.float32),
        *[jax.ShapeDtypeStruct((rows,), dtype)] * 3,
    ]
    call = jax.ffi.ffi_call(ranking.TARGET, results)
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(call(*operands, sparse=True))


def test_select_diagonals_breaks_ties_to_the_lower_offset():
    alpha = jnp.zeros((100,), jnp.float32).at[jnp.asarray([90, 95, 99])].set(1.0)
    np.testing.assert_array_equal(F.select_diagonals(alpha, 5), [0, 1, 90, 95, 99])


def test_search_layer_compiles_one_ranking_call_per_layer():
    """The layer's ranking and gate threshold are one custom call on CPU, not a sort per use."""
    if not _extension.has_cpu_kernels() or jax.default_backend() != "cpu":
        pytest.skip("the CPU kernel is not built")
    layer = dd.nn.DiagonalDense(64, sparsity=0.9)
    x = jnp.ones((4, 96))
    variables = layer.init(jax.random.key(0), x)

    def loss(params):
        y, _ = layer.apply(
            {**variables, "params": params}, x, mutable=["dynadiag", "intermediates"]
        )
        return jnp.sum(y)

    text = jax.jit(jax.grad(loss)).lower(variables["params"]).as_text()
    assert text.count(ranking.TARGET) == 1
    assert "stablehlo.sort" not in text and "stablehlo.while" not in text


@pytest.mark.parametrize("impl", ["jax", "auto"])
def test_a_half_precision_alpha_is_refused_by_name(impl):
    """The reference took bfloat16 and the CPU kernel refused it only when the program ran."""
    alpha = jnp.zeros((2, 6), jnp.bfloat16)
    with pytest.raises(
        TypeError, match="gate_rank: alpha must be float32 or float64, got bfloat16"
    ):
        ranking.gate_rank(alpha, 1.0, jnp.zeros((2, 3), jnp.int32), sparse=True, impl=impl)
