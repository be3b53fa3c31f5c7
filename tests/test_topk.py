"""sparse_soft_topk (exact capped-simplex projection, closed-form VJP) and softmax_topk."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import dynadiag_jax as dd

F32_TOL = 1e-5  # sums / values of a projection computed in float32
BF16_TOL = 2e-2
GRAD_TOL = 2e-2  # check_grads in float32 (finite differences)

# Jitted once per (shape, k): eager calls would dispatch the search op by op.
topk = jax.jit(lambda s, k, t: dd.sparse_soft_topk(s, k, strength=t), static_argnums=1)


def brute_force_projection(z, k):
    """argmin ||y - z||^2 over {0 <= y <= 1, sum y = k} by enumerating every active set.

    The optimum has some entries at 1 (A), some at 0, and the rest free with y = z - tau; each
    assignment gives one candidate, the feasible candidate closest to z is the projection.
    """
    z = np.asarray(z, np.float64)
    n = z.size
    best, best_dist = None, np.inf
    for labels in itertools.product((0, 1, 2), repeat=n):  # 0: zero, 1: one, 2: free
        labels = np.array(labels)
        ones, free = labels == 1, labels == 2
        y = ones.astype(np.float64)
        if free.any():
            tau = (z[free].sum() + ones.sum() - k) / free.sum()
            y[free] = z[free] - tau
        if abs(y.sum() - k) > 1e-9 or y.min() < -1e-12 or y.max() > 1 + 1e-12:
            continue
        dist = np.sum((y - z) ** 2)
        if dist < best_dist:
            best, best_dist = y, dist
    return best


@pytest.mark.parametrize("n,k", [(2, 1), (5, 2), (6, 3), (6, 5), (7, 1)])
def test_matches_brute_force_qp(rng, n, k):
    for _ in range(5):
        scores = rng.normal(size=n).astype(np.float32)
        strength = float(rng.choice([0.05, 0.5, 2.0]))
        y = topk(jnp.asarray(scores), k, strength)
        ref = brute_force_projection(scores / strength, k)
        np.testing.assert_allclose(
            np.asarray(y),
            ref,
            atol=F32_TOL,
            rtol=0,
            err_msg=f"scores={scores}, strength={strength}",
        )


def test_hand_computed_case():
    y = dd.sparse_soft_topk(jnp.array([0.3, 0.1, 0.9, 0.5, 0.5]), 2, strength=0.3)
    np.testing.assert_allclose(np.asarray(y), [0, 0, 1, 0.5, 0.5], atol=F32_TOL)


@pytest.mark.parametrize("n,k", [(10, 1), (64, 7), (300, 31), (1000, 999)])
@pytest.mark.parametrize("strength", [1e-3, 0.1, 1.0, 30.0])
def test_sum_range_and_zero_pattern(rng, n, k, strength):
    scores = rng.normal(size=(3, n)).astype(np.float32)
    y = np.asarray(topk(jnp.asarray(scores), k, strength))
    np.testing.assert_allclose(y.sum(-1), k, rtol=F32_TOL * 10)
    assert y.min() >= 0 and y.max() <= 1
    for row_s, row_y in zip(scores, y):
        order = np.argsort(-row_s)
        # Monotone in the scores, zero exactly on a suffix of the ranking.
        assert np.all(np.diff(row_y[order]) <= 1e-6)
        nonzero = row_y[order] > 0
        assert nonzero[: nonzero.sum()].all()
        assert nonzero.sum() >= k


def test_small_strength_is_hard_topk(rng):
    scores = rng.permutation(50).astype(np.float32) / 50  # distinct, gaps 0.02
    y = dd.sparse_soft_topk(jnp.asarray(scores), 7, strength=1e-4)
    expected = np.zeros(50)
    expected[np.argsort(-scores)[:7]] = 1
    np.testing.assert_array_equal(np.asarray(y), expected)


def test_large_strength_is_uniform():
    y = dd.sparse_soft_topk(jnp.array([0.0, 1e-3, -2e-3, 5e-4]), 2, strength=1e3)
    np.testing.assert_allclose(np.asarray(y), 0.5, atol=1e-5)


def test_ties():
    assert np.allclose(dd.sparse_soft_topk(jnp.ones(7), 3, strength=1.0), 3 / 7, atol=F32_TOL)
    y = np.asarray(dd.sparse_soft_topk(jnp.array([2.0, 1.0, 1.0, 1.0, 0.0]), 2, strength=1e-3))
    np.testing.assert_allclose(y, [1, 1 / 3, 1 / 3, 1 / 3, 0], atol=F32_TOL)


def test_k_equals_n_is_all_ones():
    x = jnp.array([0.3, -1.0, 2.0])
    np.testing.assert_array_equal(dd.sparse_soft_topk(x, 3, strength=0.1), np.ones(3))
    np.testing.assert_array_equal(
        jax.grad(lambda s: dd.sparse_soft_topk(s, 3, strength=0.1)[0])(x), np.zeros(3)
    )


def test_jit_vmap_and_leading_dims(rng):
    scores = jnp.asarray(rng.normal(size=(2, 3, 20)).astype(np.float32))
    f = jax.jit(lambda s: dd.sparse_soft_topk(s, 4, strength=0.3))
    full = f(scores)
    mapped = jax.vmap(jax.vmap(f))(scores)
    rows = np.stack([[f(scores[i, j]) for j in range(3)] for i in range(2)])
    np.testing.assert_allclose(np.asarray(full), rows, atol=F32_TOL)
    np.testing.assert_allclose(np.asarray(mapped), rows, atol=F32_TOL)


def test_traced_strength(rng):
    scores = jnp.asarray(rng.normal(size=12).astype(np.float32))
    f = jax.jit(lambda s, t: dd.sparse_soft_topk(s, 3, strength=t))
    np.testing.assert_allclose(
        np.asarray(f(scores, jnp.float32(0.2))),
        np.asarray(dd.sparse_soft_topk(scores, 3, strength=0.2)),
        atol=F32_TOL,
    )


def _away_from_kinks(rng, n, k, strength, margin=0.05):
    while True:
        scores = rng.normal(size=n).astype(np.float32)
        y = np.asarray(topk(jnp.asarray(scores), k, strength))
        z = scores / strength
        tau = np.median(z[(y > 0) & (y < 1)] - y[(y > 0) & (y < 1)])
        near = np.minimum(np.abs(z - tau), np.abs(z - tau - 1))
        free = ((y > 0) & (y < 1)).sum()
        if near.min() > margin and free >= 2:
            return jnp.asarray(scores)


def test_closed_form_jacobian(rng):
    strength = 0.7
    scores = _away_from_kinks(rng, 9, 3, strength)
    y = np.asarray(dd.sparse_soft_topk(scores, 3, strength=strength))
    jac = jax.jit(jax.jacobian(lambda s: dd.sparse_soft_topk(s, 3, strength=strength)))(scores)
    jac = np.asarray(jac)
    free = (y > 0) & (y < 1)
    expected = np.zeros((9, 9))
    idx = np.flatnonzero(free)
    expected[np.ix_(idx, idx)] = (np.eye(idx.size) - 1.0 / idx.size) / strength
    np.testing.assert_allclose(jac, expected, atol=1e-5)


@pytest.mark.parametrize("n,k,strength", [(6, 2, 0.5), (15, 4, 1.0), (40, 10, 3.0)])
def test_check_grads_away_from_kinks(rng, n, k, strength):
    scores = _away_from_kinks(rng, n, k, strength)
    w = jnp.asarray(rng.normal(size=n).astype(np.float32))
    f = jax.jit(lambda s, t: jnp.sum(w * dd.sparse_soft_topk(s, k, strength=t)))
    check_grads(
        f,
        (scores, jnp.float32(strength)),
        order=1,
        modes=("rev",),
        eps=1e-3,
        atol=GRAD_TOL,
        rtol=GRAD_TOL,
    )


@pytest.mark.parametrize("n,k,strength", [(9, 3, 0.7), (32, 8, 0.2), (40, 10, 3.0)])
def test_second_derivatives_are_the_projections(rng, n, k, strength):
    """The gate is piecewise linear, so the Hessian of f = (gate . c)^2 is 2 (J^T c)(J^T c)^T with
    J the closed-form Jacobian. Grad of grad differentiated the custom VJP's forward rule, a plain
    clip, and missed J's centring (2% off at n = 32)."""
    with jax.enable_x64(True):
        scores = jnp.asarray(_away_from_kinks(rng, n, k, strength), jnp.float64)
        c, t = (jnp.asarray(rng.normal(size=n)) for _ in range(2))
        gate = lambda s: dd.sparse_soft_topk(s, k, strength=strength)  # noqa: E731
        y = np.asarray(gate(scores))
        free = np.flatnonzero((y > 0) & (y < 1))
        jac = np.zeros((n, n))
        jac[np.ix_(free, free)] = (np.eye(free.size) - 1.0 / free.size) / strength
        f = lambda s: jnp.sum(gate(s) * c) ** 2  # noqa: E731
        u = jac.T @ np.asarray(c)
        hessian = 2 * np.outer(u, u)
        # jitted: one compile instead of eager dispatch of every op of the nested derivatives
        np.testing.assert_allclose(jax.jit(jax.jacrev(jax.grad(f)))(scores), hessian, atol=1e-9)
        hvp = jax.jit(jax.grad(lambda s: jnp.vdot(jax.grad(f)(s), t)))(scores)
        np.testing.assert_allclose(hvp, hessian @ np.asarray(t), atol=1e-9)


def test_no_gradient_outside_free_set(rng):
    scores = jnp.asarray(rng.normal(size=30).astype(np.float32))
    y = dd.sparse_soft_topk(scores, 5, strength=0.1)
    g = jax.jit(
        jax.grad(lambda s: jnp.sum(jnp.arange(30.0) * dd.sparse_soft_topk(s, 5, strength=0.1)))
    )(scores)
    off = (np.asarray(y) == 0) | (np.asarray(y) == 1)
    assert off.any()
    np.testing.assert_array_equal(np.asarray(g)[off], 0)


def test_bfloat16_input(rng):
    scores = jnp.asarray(rng.normal(size=64), jnp.bfloat16)
    y = dd.sparse_soft_topk(scores, 8, strength=0.5)
    assert y.dtype == jnp.bfloat16
    np.testing.assert_allclose(float(jnp.sum(y.astype(jnp.float32))), 8, rtol=BF16_TOL)


def test_softmax_topk_formula(rng):
    scores = jnp.asarray(rng.normal(size=(2, 10)).astype(np.float32))
    y = dd.softmax_topk(scores, 3, temperature=0.5)
    expected = np.clip(3 * jax.nn.softmax(scores / 0.5, axis=-1), 0, 1)
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), atol=1e-6)
    assert np.all(np.asarray(y) > 0) and np.all(np.asarray(y).sum(-1) <= 3 + 1e-5)
    g = jax.grad(lambda s: dd.softmax_topk(s, 3, temperature=0.5)[0, 0])(scores)
    assert np.all(np.isfinite(np.asarray(g)))


@pytest.mark.parametrize(
    "fn,kw", [(dd.sparse_soft_topk, "strength"), (dd.softmax_topk, "temperature")]
)
def test_bad_input(fn, kw):
    x = jnp.ones(5)
    for bad, error in ((-1.0, ValueError), (float("nan"), ValueError), ("0.5", TypeError)):
        with pytest.raises(error, match=f"{kw} must be"):
            fn(x, 2, **{kw: bad})
    with pytest.raises(TypeError, match=f"{kw} must be"):
        fn(x, 2, **{kw: True})
    with pytest.raises(TypeError, match=f"{kw} is required"):
        fn(x, 2, **{kw: None})
    for bad_k in (0, 6, -1):
        with pytest.raises(ValueError, match="k must be in"):
            fn(x, bad_k, **{kw: 1.0})
    with pytest.raises(TypeError, match="floating"):
        fn(jnp.arange(5), 2, **{kw: 1.0})
    with pytest.raises(ValueError, match="scalar"):
        fn(jnp.float32(1.0), 1, **{kw: 1.0})


def test_zero_strength_is_the_hard_limit(rng):
    scores = jnp.asarray(rng.permutation(40).astype(np.float32) / 40)  # distinct, gaps 0.025
    hard = np.zeros(40)
    hard[np.argsort(-np.asarray(scores))[:6]] = 1
    np.testing.assert_array_equal(np.asarray(dd.sparse_soft_topk(scores, 6, strength=0.0)), hard)
    np.testing.assert_array_equal(np.asarray(topk(scores, 6, 1e-4)), hard)  # the limit
    # Ties at the boundary share the rest of the budget, as they do for any small strength.
    ties = jnp.array([2.0, 1.0, 1.0, 1.0, 0.0])
    np.testing.assert_allclose(
        np.asarray(dd.sparse_soft_topk(ties, 2, strength=0.0)), [1, 1 / 3, 1 / 3, 1 / 3, 0]
    )
    np.testing.assert_allclose(  # a fractional budget: ceil(k) - 1 ones and the remainder
        np.asarray(dd.sparse_soft_topk(jnp.array([3.0, 2.0, 1.0, 0.0]), 2.5, strength=0.0)),
        [1, 1, 0.5, 0],
    )


def test_zero_temperature_is_the_argmax_limit(rng):
    scores = jnp.asarray(rng.normal(size=12).astype(np.float32))
    want = np.zeros(12)
    want[np.argmax(np.asarray(scores))] = 1
    np.testing.assert_array_equal(np.asarray(dd.softmax_topk(scores, 4, temperature=0.0)), want)
    np.testing.assert_allclose(
        np.asarray(dd.softmax_topk(scores, 4, temperature=1e-4)), want, atol=1e-6
    )
    ties = jnp.array([1.0, 3.0, 3.0, 3.0, 0.0])  # k / m = 2 / 3 on each of the maxima
    np.testing.assert_allclose(
        np.asarray(dd.softmax_topk(ties, 2, temperature=0.0)), [0, 2 / 3, 2 / 3, 2 / 3, 0]
    )
    np.testing.assert_allclose(
        np.asarray(dd.softmax_topk(ties, 5, temperature=0.0)), [0, 1, 1, 1, 0]
    )


@pytest.mark.parametrize(
    "fn,kw", [(dd.sparse_soft_topk, "strength"), (dd.softmax_topk, "temperature")]
)
def test_every_traced_value_is_finite(rng, fn, kw):
    """Schedules reaching 0 (or overshooting it) inside jit: defined gates, finite gradients."""
    scores = jnp.asarray(rng.normal(size=(2, 30)).astype(np.float32))
    w = jnp.asarray(rng.normal(size=(1, 30)).astype(np.float32))

    def loss(s, h):
        return jnp.sum(w * fn(s, 5, **{kw: h}))

    gate = jax.jit(lambda s, h: fn(s, 5, **{kw: h}))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1)))
    at_zero = np.asarray(gate(scores, jnp.float32(0.0)))
    for h in (0.0, -0.5, float("nan"), float("-inf"), 1e-30, 1e-12, 0.5, float("inf")):
        y = np.asarray(gate(scores, jnp.float32(h)))
        assert np.all(np.isfinite(y)) and y.min() >= 0 and y.max() <= 1, h
        assert np.all(y.sum(-1) <= 5 + 1e-4), h
        if not h > 0:  # negative, NaN: the value at 0
            np.testing.assert_array_equal(y, at_zero)
        d_scores, d_h = grads(scores, jnp.float32(h))
        assert np.all(np.isfinite(np.asarray(d_scores))) and np.isfinite(float(d_h)), h
        if not h > 0:
            np.testing.assert_array_equal(np.asarray(d_scores), 0)
            assert float(d_h) == 0


INF, NAN = float("inf"), float("nan")

# (scores, k, gate): an infinite ceil(k)-th largest score; the limit as the infinite scores grow
# is the hard gate, whatever the strength
SPARSE_HARD = [
    ([INF, INF, 1.0, 0.0, -1.0], 2, [1, 1, 0, 0, 0]),  # the +inf scores take the budget
    ([INF, INF, INF, 0.0, -1.0], 2, [2 / 3, 2 / 3, 2 / 3, 0, 0]),  # and share it as ties
    ([1.0, -INF, -INF, -INF, -INF], 2, [1, 0.25, 0.25, 0.25, 0.25]),  # -inf: the rest, shared
    ([INF] * 5, 2, [0.4] * 5),
    ([-INF] * 5, 2, [0.4] * 5),
]


@pytest.mark.parametrize("scores, k, want", SPARSE_HARD)
def test_sparse_gate_of_an_infinite_kth_score_is_the_hard_gate(scores, k, want):
    s = jnp.asarray(scores, jnp.float32)
    w = jnp.arange(5, dtype=jnp.float32)
    grad = jax.jit(jax.grad(lambda s, h: jnp.sum(w * topk(s, k, h)), argnums=(0, 1)))
    for strength in (0.0, 1e-3, 0.5, 30.0):
        np.testing.assert_allclose(topk(s, k, strength), want, rtol=1e-6)
        d_scores, d_strength = grad(s, jnp.float32(strength))
        np.testing.assert_array_equal(d_scores, 0)
        assert float(d_strength) == 0


@pytest.mark.parametrize(
    "scores, k", [([INF, INF, 1.0, 0.0, -1.0], 2.5), ([3.0, 2.0, 1.0, -INF, -INF], 2)]
)
def test_sparse_gate_of_infinite_scores_around_a_finite_kth_is_their_limit(scores, k):
    """+inf scores get 1 and -inf ones 0, as very large finite ones would; the others' gate and
    gradient are finite."""
    s = jnp.asarray(scores, jnp.float32)
    large = jnp.clip(s, -1e6, 1e6)
    grad = jax.jit(jax.grad(lambda s, h: jnp.sum(jnp.sin(topk(s, k, h))), argnums=(0, 1)))
    for strength in (0.0, 1e-3, 0.5, 30.0):
        np.testing.assert_allclose(topk(s, k, strength), topk(large, k, strength), atol=1e-6)
        d_scores, d_strength = grad(s, jnp.float32(strength))
        assert np.all(np.isfinite(np.asarray(d_scores))) and np.isfinite(float(d_strength))
        np.testing.assert_array_equal(np.asarray(d_scores)[np.isinf(scores)], 0)


@pytest.mark.parametrize(
    "scores, k, want",
    [
        ([INF, INF, 1.0, 0.0], 1, [0.5, 0.5, 0, 0]),  # min(1, k / m) on the +inf scores
        ([INF, INF, 1.0, 0.0], 3, [1, 1, 0, 0]),
        ([-INF] * 4, 2, [0.5] * 4),
    ],
)
def test_softmax_gate_of_an_infinite_maximum_is_the_hard_limit(scores, k, want):
    s = jnp.asarray(scores, jnp.float32)
    w = jnp.arange(4, dtype=jnp.float32)
    grad = jax.jit(
        jax.grad(lambda s, t: jnp.sum(w * dd.softmax_topk(s, k, temperature=t)), argnums=(0, 1))
    )
    for temperature in (0.0, 0.5, 30.0):
        np.testing.assert_allclose(dd.softmax_topk(s, k, temperature=temperature), want)
        d_scores, d_temperature = grad(s, jnp.float32(temperature))
        np.testing.assert_array_equal(d_scores, 0)
        assert float(d_temperature) == 0


@pytest.mark.parametrize("value", [1e38, INF])
def test_a_huge_strength_or_temperature_is_the_smooth_limit(value):
    """inf / inf was NaN for an infinite score, and above ~1/tiny a finite score's quotient was
    denormal: five gates of 1 for k = 2."""
    s = jnp.asarray([INF, 1.0, 0.5, 0.2, -0.3, 0.0], jnp.float32)
    for big in (value, jnp.float32(value)):
        y = np.asarray(jax.jit(lambda s, h: topk(s, 2, h))(s, big))
        np.testing.assert_allclose(y, topk(s, 2, 1e30), atol=1e-6)
        assert np.isfinite(y).all() and y.sum() == pytest.approx(2)
    s = jnp.asarray([1.0, 0.5, 0.2, -0.3, 0.0, -INF], jnp.float32)
    y = np.asarray(dd.softmax_topk(s, 2, temperature=value))
    np.testing.assert_allclose(y, [0.4] * 5 + [0], atol=1e-6)


def test_softmax_gate_gives_minus_inf_scores_nothing():
    s = jnp.asarray([2.0, 1.0, -INF, -INF])
    y = np.asarray(dd.softmax_topk(s, 2, temperature=0.5))
    assert np.all(np.isfinite(y)) and np.all(y[2:] == 0) and np.all(y[:2] > 0)


@pytest.mark.parametrize(
    "fn,kw", [(dd.sparse_soft_topk, "strength"), (dd.softmax_topk, "temperature")]
)
@pytest.mark.parametrize("k", [2, 5])
def test_a_nan_score_makes_its_row_nan_with_zero_gradient(fn, kw, k):
    s = jnp.asarray([[NAN, 2.0, 1.0, 0.0, -1.0], [3.0, 2.0, 1.0, 0.0, NAN], [3, 2, 1, 0, -1]])
    w = jnp.arange(15, dtype=jnp.float32).reshape(3, 5)
    gate = jax.jit(lambda s, h: fn(s, k, **{kw: h}))
    grad = jax.jit(jax.grad(lambda s, h: jnp.nansum(w * fn(s, k, **{kw: h})), argnums=(0, 1)))
    for h in (0.0, 0.5):
        y = np.asarray(gate(s, jnp.float32(h)))
        assert np.all(np.isnan(y[:2])) and np.all(np.isfinite(y[2]))
        np.testing.assert_array_equal(y[2], gate(s[2:], jnp.float32(h))[0])
        d_scores, d_h = grad(s, jnp.float32(h))
        np.testing.assert_array_equal(d_scores[:2], 0)
        assert np.all(np.isfinite(np.asarray(d_scores))) and np.isfinite(float(d_h))


@pytest.mark.parametrize("k", [2, 5])
def test_the_projection_of_a_row_with_a_nan_score_is_nan(k):
    """As the sparse gate's (it returned [nan, 0, 1, 1], a row made up around the NaN)."""
    z = jnp.asarray([[NAN, 1.0, 2.0, 3.0, 0.0], [3.0, 2.0, 1.0, 0.0, -1.0]])
    y = np.asarray(jax.jit(lambda z: dd.capped_simplex_projection(z, k))(z))
    assert np.all(np.isnan(y[0])) and np.all(np.isfinite(y[1]))
    np.testing.assert_array_equal(y[1], dd.capped_simplex_projection(z[1:], k)[0])


@pytest.mark.parametrize("gate", ["sparse_topk", "softmax"])
@pytest.mark.parametrize("impl", ["jax", "auto"])
def test_a_layer_with_infinite_scores_runs_the_hard_gate(gate, impl):
    layer = dd.nn.DiagonalDense(16, k=4, gate=gate, impl=impl)
    x = jax.random.normal(jax.random.key(0), (3, 16))
    v = layer.init(jax.random.key(1), x)
    name = layer.hyper_name
    apply = jax.jit(lambda v, h: layer.apply(v, x, **{name: h}))
    p = v["params"]["alpha"].shape[0]
    mixed = jnp.where(jnp.arange(p) % 3 == 0, INF, -INF)
    for alpha in (jnp.full(p, INF), jnp.full(p, -INF), mixed):
        scored = dict(v, params=dict(v["params"], alpha=alpha))
        y = np.asarray(apply(scored, 0.5))
        assert np.all(np.isfinite(y))
        np.testing.assert_allclose(y, apply(scored, 0.0), rtol=1e-5, atol=1e-5)
        grads = jax.grad(
            lambda q, scored=scored: jnp.sum(layer.apply(dict(scored, params=q), x, **{name: 0.5}))
        )(v["params"])
        assert all(np.all(np.isfinite(np.asarray(g))) for g in jax.tree.leaves(grads))
    nan_alpha = jnp.where(jnp.arange(p) == 5, NAN, 0.0)
    assert np.all(
        np.isnan(np.asarray(apply(dict(v, params=dict(v["params"], alpha=nan_alpha)), 0.5)))
    )


def test_a_bfloat16_strength_is_a_number():
    y = dd.sparse_soft_topk(jnp.ones(4), 2, strength=jnp.bfloat16(0.5))
    np.testing.assert_allclose(y, 0.5)
    with pytest.raises(TypeError, match="strength must be a number"):
        dd.sparse_soft_topk(jnp.ones(4), 2, strength=1 + 2j)


def test_a_traced_gate_value_must_be_a_scalar_as_an_eager_one():
    """A shape is static: a (3,) strength was refused eagerly and applied under jit."""
    scores, strength = jnp.ones((3, 5)), jnp.ones(3)
    with pytest.raises(ValueError, match=r"strength must be a scalar, got shape \(3,\)"):
        dd.sparse_soft_topk(scores, 2, strength=strength)
    with pytest.raises(ValueError, match=r"strength must be a scalar, got shape \(3,\)"):
        jax.jit(lambda s: dd.sparse_soft_topk(scores, 2, strength=s))(strength)
    layer = dd.nn.DiagonalDense(8, sparsity=0.75)
    variables = layer.init(jax.random.key(0), jnp.ones((2, 8)))
    with pytest.raises(ValueError, match=r"set_gate: strength must be a scalar"):
        jax.jit(lambda s: dd.nn.set_gate(variables, strength=s))(strength)
