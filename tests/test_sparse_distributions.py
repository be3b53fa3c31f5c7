"""Per-layer sparsity distributions and exact-count masks of the unstructured baselines."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dynadiag_jax import baselines as B

SHAPES = {"l1": (784, 256), "l2": (256, 256), "l3": (256, 10), "conv": (3, 3, 16, 32)}


def _params():
    return {
        name: {
            "kernel": jax.ShapeDtypeStruct(shape, jnp.float32),
            "bias": jax.ShapeDtypeStruct(shape[-1:], jnp.float32),
        }
        for name, shape in SHAPES.items()
    }


def _totals(params, sparsities):
    kept = total = 0
    for s, p in zip(jax.tree.leaves(sparsities), [params[k]["kernel"] for k in sorted(params)]):
        kept += B.num_active(math.prod(p.shape), s)
        total += math.prod(p.shape)
    return kept, total


@pytest.mark.parametrize("sparsity", [0.0, 0.5, 0.8, 0.9, 0.95, 0.99])
@pytest.mark.parametrize("dist", [B.uniform, B.erk])
def test_distribution_hits_requested_overall_sparsity(dist, sparsity):
    params = _params()
    sparsities = dist(params, sparsity)
    assert all(sparsities[k]["bias"] is None for k in SHAPES)
    kept, total = _totals(params, sparsities)
    # Each layer rounds its count by less than one weight.
    assert abs(kept - (1 - sparsity) * total) <= len(SHAPES), (kept, total)


def test_uniform_gives_every_selected_leaf_the_same_sparsity():
    s = B.uniform(_params(), 0.9)
    assert {s[k]["kernel"] for k in SHAPES} == {0.9}


def test_erk_density_follows_sum_over_product_of_dims():
    s = B.erk(_params(), 0.9)
    density = {k: 1 - s[k]["kernel"] for k in SHAPES}
    ratio = {k: sum(SHAPES[k]) / math.prod(SHAPES[k]) for k in SHAPES}
    eps = {k: density[k] / ratio[k] for k in SHAPES if density[k] < 1}
    np.testing.assert_allclose(list(eps.values()), next(iter(eps.values())), rtol=1e-12)
    assert density["l3"] > density["l2"] > density["l1"]


def test_erk_makes_a_layer_dense_when_its_density_would_exceed_one():
    params = {"big": {"kernel": jnp.zeros((1000, 1000))}, "tiny": {"kernel": jnp.zeros((4, 2))}}
    s = B.erk(params, 0.5)
    assert s["tiny"]["kernel"] == 0.0
    kept = sum(B.num_active(p["kernel"].size, s[k]["kernel"]) for k, p in params.items())
    assert abs(kept - 0.5 * (1000 * 1000 + 8)) <= 2


@pytest.mark.parametrize(
    "power, error", [(float("nan"), ValueError), (float("inf"), ValueError), ("1", TypeError)]
)
def test_erk_refuses_a_power_that_is_not_a_finite_number(power, error):
    """NaN made every leaf dense; inf divided by zero."""
    with pytest.raises(error, match="erk: power must be a"):
        B.erk(_params(), 0.8, power=power)


def test_erk_power_zero_is_uniform():
    s = B.erk(_params(), 0.8, power=0.0)
    np.testing.assert_allclose([s[k]["kernel"] for k in SHAPES], 0.8, rtol=1e-12)


def test_include_paths_selects_by_regex_and_skips_vectors():
    include = B.include_paths([r"l[12]/"])
    s = B.uniform(_params(), 0.9, include=include)
    assert s["l1"]["kernel"] == 0.9 and s["l2"]["kernel"] == 0.9
    assert s["l3"]["kernel"] is None and s["conv"]["kernel"] is None
    assert s["l1"]["bias"] is None


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5])
@pytest.mark.parametrize("dist", [B.uniform, B.erk])
def test_distribution_rejects_bad_sparsity(dist, bad):
    with pytest.raises(ValueError, match="sparsity"):
        dist(_params(), bad)


@pytest.mark.parametrize("bad", ["0.9", True, None])
@pytest.mark.parametrize("dist", [B.uniform, B.erk])
def test_distribution_rejects_a_sparsity_that_is_not_a_number(dist, bad):
    with pytest.raises(TypeError, match="sparsity must be a number"):
        dist(_params(), bad)


def test_distribution_rejects_empty_selection():
    with pytest.raises(ValueError, match="no parameter leaf"):
        B.uniform(_params(), 0.9, include=lambda path, leaf: False)


def test_include_paths_rejects_a_bare_string():
    with pytest.raises(TypeError, match="sequence"):
        B.include_paths("l1")


@pytest.mark.parametrize(
    "size,sparsity,expected", [(10, 0.9, 1), (8, 0.5, 4), (200704, 0.9, 20071), (3, 0.99, 1)]
)
def test_num_active(size, sparsity, expected):
    assert B.num_active(size, sparsity) == expected


@pytest.mark.parametrize(
    "size, sparsity, error, match",
    [
        (10.5, 0.5, TypeError, "size must be an int"),  # gave 5.5 weights
        (0, 0.5, ValueError, "size must be >= 1"),
        (10, "0.5", TypeError, "sparsity must be a number, got str"),
        (10, float("nan"), ValueError, r"sparsity must be in \[0, 1\)"),
    ],
)
def test_num_active_refuses_what_is_not_a_size_or_a_sparsity(size, sparsity, error, match):
    with pytest.raises(error, match=match):
        B.num_active(size, sparsity)


def test_top_n_mask_hand_case_and_ties():
    scores = jnp.array([[0.5, -jnp.inf, 2.0], [2.0, 0.1, -1.0]])
    np.testing.assert_array_equal(B.top_n_mask(scores, 2), [[0, 0, 1], [1, 0, 0]])
    # Ties go to the lower flat index; -inf only when nothing finite is left.
    np.testing.assert_array_equal(B.top_n_mask(jnp.zeros(4), 2), [1, 1, 0, 0])
    np.testing.assert_array_equal(B.top_n_mask(scores, 6), np.ones((2, 3)))
    np.testing.assert_array_equal(B.top_n_mask(scores, 0), np.zeros((2, 3)))


def test_top_n_mask_takes_a_traced_count():
    f = jax.jit(lambda s, n: B.top_n_mask(s, n))
    s = jax.random.normal(jax.random.key(0), (7, 5))
    for n in (0, 1, 17, 35):
        m = f(s, n)
        assert int(m.sum()) == n
        if 0 < n < 35:
            assert float(s[m].min()) >= float(s[~m].max())


def test_random_mask_exact_count_and_key_dependence():
    a = B.random_mask(jax.random.key(0), (30, 40), 123)
    b = B.random_mask(jax.random.key(1), (30, 40), 123)
    assert int(a.sum()) == int(b.sum()) == 123
    assert bool(jnp.any(a != b))
    np.testing.assert_array_equal(a, B.random_mask(jax.random.key(0), (30, 40), 123))
