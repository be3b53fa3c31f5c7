"""RigL, SET, MEST and the fixed mask: hand-checked mask updates and the invariants of the optax
wrappers."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from dynadiag_jax import baselines as B

# One 8-weight layer: 4 active; inactive weights are zero, as during training.
MASK = jnp.array([1, 0, 1, 1, 0, 0, 1, 0], bool)
W = jnp.array([0.5, 0.0, -3.0, 0.1, 0.0, 0.0, -1.0, 0.0])
G = jnp.array([0.2, -4.0, 0.1, 0.0, 2.5, -0.3, 1.0, 0.7])


# Drop by |w| among {0: .5, 2: 3, 3: .1, 6: 1}; grow by |g| among the rest.
@pytest.mark.parametrize(
    "num_drop,expected",
    [
        (0, [1, 0, 1, 1, 0, 0, 1, 0]),
        (1, [1, 1, 1, 0, 0, 0, 1, 0]),  # drop 3; grow 1 (|g| = 4)
        (2, [0, 1, 1, 0, 1, 0, 1, 0]),  # drop 3, 0; grow 1, 4
        (3, [0, 1, 1, 0, 1, 0, 1, 0]),  # drop 3, 0, 6; grow 1, 4 and 6 again (|g| = 1 > .7)
        (4, [0, 1, 0, 0, 1, 0, 1, 1]),  # drop all; grow the 4 largest |g|
    ],
)
def test_rigl_drop_and_grow_hand_case(num_drop, expected):
    new = B.drop_and_grow(MASK, jnp.abs(W), jnp.abs(G), num_drop)
    np.testing.assert_array_equal(new, np.array(expected, bool))


@pytest.mark.parametrize(
    "drop_fraction,expected",
    [
        (0.25, [1, 1, 1, 0, 0, 0, 1, 0]),
        (0.3, [1, 1, 1, 0, 0, 0, 1, 0]),  # round(1.2) = 1
        (0.5, [0, 1, 1, 0, 1, 0, 1, 0]),
        (1.0, [0, 1, 0, 0, 1, 0, 1, 1]),
    ],
)
def test_rigl_wrapper_update_matches_hand_case(drop_fraction, expected):
    tx = B.rigl(
        optax.sgd(0.0),
        distribution=functools.partial(B.uniform, sparsity=0.5, include=lambda p, x: True),
        key=jax.random.key(0),
        update_every=1,
        start_step=0,
        end_step=10,
        drop_fraction=lambda t: drop_fraction,
    )
    params = {"w": W}
    state = tx.init(params)._replace(masks={"w": MASK})
    updates, state = tx.update({"w": G}, state, params)
    np.testing.assert_array_equal(state.masks["w"], np.array(expected, bool))
    new_params = optax.apply_updates(params, updates)["w"]
    np.testing.assert_array_equal(new_params, jnp.where(state.masks["w"], W, 0.0))


def test_set_keeps_the_largest_weights_and_grows_at_random():
    shape = (40, 50)
    params = {"w": jax.random.normal(jax.random.key(3), shape)}
    dist = functools.partial(B.uniform, sparsity=0.9)

    def run(key):
        tx = B.set_(
            optax.sgd(0.0),
            distribution=dist,
            key=key,
            update_every=1,
            start_step=0,
            end_step=10,
            drop_fraction=lambda t: 0.5,
        )
        state = tx.init(params)
        p = B.apply_masks(params, state.masks)
        _, new = tx.update({"w": jnp.ones(shape)}, state, p)
        return state.masks["w"], new.masks["w"], p["w"]

    old, new, p = run(jax.random.key(0))
    n = int(old.sum())
    assert int(new.sum()) == n == 200
    survivors = old & new
    kept = B.top_n_mask(jnp.where(old, jnp.abs(p), -jnp.inf), n // 2)
    assert bool(jnp.all(new[kept])), "the 100 largest active weights must survive"
    assert int(survivors.sum()) >= n // 2
    _, new_other_key, _ = run(jax.random.key(1))
    assert bool(jnp.any(new != new_other_key)), "growth must depend on the key"


# MEST prune-and-grow, same layer; grow scores stand in for the random draw.
RAND = jnp.array([0.9, 0.1, 0.5, 0.3, 0.8, 0.2, 0.4, 0.7])


def test_mest_soft_bound_grows_above_budget_then_prunes_back():
    grown = B.prune_and_grow(MASK, jnp.abs(W), RAND, 4, 2)
    np.testing.assert_array_equal(grown, np.array([1, 0, 1, 1, 1, 0, 1, 1], bool))
    trained = jnp.array([0.5, 0.0, -3.0, 0.1, 2.0, 0.0, -1.0, -0.05])
    back = B.prune_and_grow(grown, jnp.abs(trained), RAND, 4, 0)
    np.testing.assert_array_equal(back, np.array([1, 0, 1, 0, 1, 0, 1, 0], bool))


def test_mest_hard_bound_mutates_at_budget():
    new = B.prune_and_grow(MASK, jnp.abs(W), RAND, 2, 2)
    np.testing.assert_array_equal(new, np.array([1, 0, 1, 0, 1, 0, 1, 0], bool))


PARAM_SHAPES = {"a": (12, 20), "b": (20, 7), "conv": (3, 3, 2, 4)}


def _params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        k: {"kernel": jnp.asarray(rng.standard_normal(s, np.float32)), "bias": jnp.zeros(s[-1:])}
        for k, s in PARAM_SHAPES.items()
    }


def _run(tx, steps, *, seed=0):
    """Yields (count, state, params, grads) after every jitted update with random gradients."""
    params = _params(seed)
    state = jax.jit(tx.init)(params)
    params = B.apply_masks(params, state.masks)

    @jax.jit
    def step(params, state, grads):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    rng = np.random.default_rng(seed)
    for t in range(steps):
        grads = jax.tree.map(lambda p: rng.standard_normal(p.shape, np.float32), params)
        params, state = step(params, state, grads)
        yield t, state, params


def _check_masked(state, params):
    for m, p in zip(jax.tree.leaves(state.masks), [params[k]["kernel"] for k in sorted(params)]):
        assert not np.any(np.asarray(p)[~np.asarray(m)] != 0), "inactive weights must be zero"


def _counts(state):
    return [int(np.sum(m)) for m in jax.tree.leaves(state.masks)]


DISTS = {"uniform": B.uniform, "erk": B.erk}


# Each case compiles its own update; the sparsity sweep beyond 90% runs with the slow tests.
SWEEP = [0.9, pytest.param(0.5, marks=pytest.mark.slow), pytest.param(0.95, marks=pytest.mark.slow)]


@pytest.mark.parametrize("sparsity", SWEEP)
@pytest.mark.parametrize("dist", sorted(DISTS))
@pytest.mark.parametrize("method", ["rigl", "set_", "mest_hard"])
def test_active_count_stays_at_budget_after_every_update(method, dist, sparsity):
    distribution = functools.partial(DISTS[dist], sparsity=sparsity)
    kw = dict(distribution=distribution, key=jax.random.key(1), update_every=2, end_step=9)
    if method == "mest_hard":
        tx = B.mest(optax.sgd(0.1, momentum=0.9), soft_bound=False, mutation_ratio=0.5, **kw)
    else:
        tx = getattr(B, method)(optax.sgd(0.1, momentum=0.9), drop_fraction=0.5, **kw)
    budget = jax.tree.leaves(B.budgets(distribution, _params()))
    changed = 0
    previous = None
    for _, state, params in _run(tx, 12):
        assert _counts(state) == budget
        _check_masked(state, params)
        if previous is not None:
            changed += sum(
                int(jnp.sum(a != b))
                for a, b in zip(jax.tree.leaves(previous), jax.tree.leaves(state.masks))
            )
        previous = state.masks
    assert changed > 0, "the masks never changed"


@pytest.mark.parametrize("sparsity", [0.9, pytest.param(0.5, marks=pytest.mark.slow)])
def test_mest_soft_bound_within_bound_between_and_at_budget_after_prune_back(sparsity):
    distribution = functools.partial(B.erk, sparsity=sparsity)
    ratio = 0.5
    tx = B.mest(
        optax.sgd(0.1),
        distribution=distribution,
        key=jax.random.key(2),
        update_every=3,
        start_step=2,
        end_step=11,
        mutation_ratio=lambda t: ratio,
    )
    budget = jax.tree.leaves(B.budgets(distribution, _params()))
    bound = [n + round(ratio * n) for n in budget]
    sizes = [int(np.prod(s)) for _, s in sorted(PARAM_SHAPES.items())]
    saw_above = False
    for t, state, params in _run(tx, 14):
        counts = _counts(state)
        _check_masked(state, params)
        if t < 2 or t >= 11:
            assert counts == budget, (t, counts)  # before the first grow; after the final prune
        else:
            assert counts == [min(b, s) for b, s in zip(bound, sizes)], (t, counts)
            saw_above |= counts != budget
    assert saw_above


def test_mest_prunes_back_the_smallest_of_all_active_weights():
    distribution = functools.partial(B.uniform, sparsity=0.8)
    tx = B.mest(
        optax.sgd(0.1),
        distribution=distribution,
        key=jax.random.key(4),
        update_every=2,
        start_step=1,
        end_step=9,
        mutation_ratio=lambda t: 0.25,
    )
    history = list(_run(tx, 6))
    budget = jax.tree.leaves(B.budgets(distribution, _params()))
    # The mutation at step 3 judges the weights left by step 2 (grown at step 1, trained since).
    _, before, params = history[2]
    _, after, _ = history[3]
    for k, n in zip(sorted(PARAM_SHAPES), budget):
        old, new, p = before.masks[k]["kernel"], after.masks[k]["kernel"], params[k]["kernel"]
        best = B.top_n_mask(jnp.where(old, jnp.abs(p), -jnp.inf), n)
        assert bool(jnp.all(new[best])), k
        assert int((old & new).sum()) >= n


def _sgd_momentum_case(tx):
    params = {"w": jax.random.normal(jax.random.key(0), (6, 8))}
    state = tx.init(params)
    params = B.apply_masks(params, state.masks)
    # A trace of ones everywhere: resets are visible as zeros before this step's gradient.
    state = state._replace(inner_state=jax.tree.map(jnp.ones_like, state.inner_state))
    grads = {"w": jax.random.normal(jax.random.key(1), (6, 8))}
    _, new = tx.update(grads, state, params)
    return state.masks["w"], new, grads["w"]


def test_moments_of_regrown_weights_restart_from_zero_sgd_momentum():
    tx = B.rigl(
        optax.sgd(0.1, momentum=0.9),
        distribution=functools.partial(B.uniform, sparsity=0.5),
        key=jax.random.key(0),
        update_every=1,
        start_step=0,
        end_step=5,
        drop_fraction=lambda t: 0.5,
    )
    old, new, g = _sgd_momentum_case(tx)
    m = new.masks["w"]
    grown, kept, off = m & ~old, m & old, ~m
    assert int(grown.sum()) > 0
    trace = new.inner_state[0].trace["w"]
    np.testing.assert_allclose(trace[grown], g[grown], rtol=1e-6)
    np.testing.assert_allclose(trace[kept], g[kept] + 0.9, rtol=1e-6)
    np.testing.assert_allclose(trace[off], 0.9, rtol=1e-6)


@pytest.mark.parametrize(
    "make_inner",
    [
        lambda: optax.adam(1e-3),
        lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3, weight_decay=0.1)),
        lambda: optax.multi_transform(
            {"a": optax.adam(1e-3), "b": optax.sgd(1e-3)}, {"w": "a", "v": "b"}
        ),
    ],
)
def test_reset_moments_finds_every_params_shaped_state(make_inner):
    inner = make_inner()
    params = {"w": jnp.ones((3, 4)), "v": jnp.ones((5,))}
    state = jax.tree.map(jnp.ones_like, inner.init(params))
    grown = {"w": jnp.arange(12).reshape(3, 4) % 5 == 0, "v": False}
    reset = B.reset_moments(state, grown)
    leaves_w = []
    for before, after in zip(jax.tree.leaves(state), jax.tree.leaves(reset)):
        if after.shape == (3, 4):
            leaves_w.append(after)
            np.testing.assert_array_equal(after, jnp.where(grown["w"], 0.0, 1.0))
        else:
            np.testing.assert_array_equal(after, before)
    assert leaves_w, "no moment of w was found"


def test_moments_of_regrown_weights_are_zero_with_adam():
    tx = B.rigl(
        optax.adam(1e-3),
        distribution=functools.partial(B.uniform, sparsity=0.5),
        key=jax.random.key(0),
        update_every=1,
        start_step=0,
        end_step=5,
        drop_fraction=lambda t: 0.5,
    )
    params = {"w": jax.random.normal(jax.random.key(0), (6, 8))}
    state = tx.init(params)
    state = state._replace(inner_state=jax.tree.map(jnp.ones_like, state.inner_state))
    zero_grads = {"w": jnp.zeros((6, 8))}
    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int and float internally
        _, new = tx.update(zero_grads, state, B.apply_masks(params, state.masks))
    grown = new.masks["w"] & ~state.masks["w"]
    assert int(grown.sum()) > 0
    for name in ("mu", "nu"):
        acc = getattr(new.inner_state[0], name)["w"]
        assert not bool(jnp.any(acc[grown] != 0)), name
        assert bool(jnp.all(acc[~grown] != 0)), name


def test_no_update_outside_the_schedule_and_state_is_checkpointable():
    distribution = functools.partial(B.uniform, sparsity=0.9)
    tx = B.rigl(
        optax.sgd(0.1),
        distribution=distribution,
        key=jax.random.key(0),
        update_every=3,
        start_step=3,
        end_step=7,
    )
    states = [s for _, s, _ in _run(tx, 10)]
    first = states[0].masks
    changes = [
        t
        for t in range(1, 10)
        if any(
            bool(jnp.any(a != b))
            for a, b in zip(jax.tree.leaves(states[t - 1].masks), jax.tree.leaves(states[t].masks))
        )
    ]
    assert set(changes) <= {3, 6}
    assert 3 in changes
    assert all(
        bool(jnp.all(a == b))
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(states[2].masks))
    )
    for leaf in jax.tree.leaves(states[-1]):
        assert isinstance(leaf, jax.Array)
    assert states[-1].key.dtype == jnp.uint32 and int(states[-1].count) == 10


def test_static_mask_is_the_first_mask_of_set_and_never_changes():
    distribution = functools.partial(B.uniform, sparsity=0.9)
    key = jax.random.key(4)
    static = list(_run(B.static_mask(optax.sgd(0.1), distribution=distribution, key=key), 12))
    # SET with no drops: the same first mask, updates that change nothing, the same weights
    kw = dict(distribution=distribution, key=key, update_every=2, end_step=11, drop_fraction=0.0)
    no_drops = B.set_(optax.sgd(0.1), **kw)
    first = jax.jit(no_drops.init)(_params()).masks
    budget = jax.tree.leaves(B.budgets(distribution, _params()))
    for (_, state, params), (_, _, p_set) in zip(static, _run(no_drops, 12)):
        assert _counts(state) == budget
        _check_masked(state, params)
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(state.masks)):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(p_set)):
            np.testing.assert_array_equal(a, b)


def test_same_key_same_run():
    def masks(seed):
        tx = B.set_(
            optax.sgd(0.1),
            distribution=functools.partial(B.erk, sparsity=0.9),
            key=jax.random.key(seed),
            update_every=1,
            start_step=0,
            end_step=8,
        )
        return [s.masks for _, s, _ in _run(tx, 1)][-1]

    a, b, c = masks(0), masks(0), masks(1)
    assert all(bool(jnp.all(x == y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert any(bool(jnp.any(x != y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(c)))


def test_cosine_drop_fraction_decays_to_zero_at_end():
    f = B.cosine_decay(0.3, 100)
    np.testing.assert_allclose(
        [f(jnp.int32(t)) for t in (0, 50, 100, 200)], [0.3, 0.15, 0.0, 0.0], atol=1e-7
    )


def test_periodic_schedule():
    is_update = B.periodic(3, 2, 11)
    assert [t for t in range(15) if is_update(jnp.int32(t))] == [2, 5, 8]
    with_end = B.periodic(3, 2, 11, include_end=True)
    assert [t for t in range(15) if with_end(jnp.int32(t))] == [2, 5, 8, 11]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(update_every=0, end_step=5), "update_every"),
        (dict(update_every=2, end_step=1), "end_step"),
        (dict(update_every=2, end_step=5, drop_fraction=1.5), "drop_fraction"),
        (dict(update_every=2.5, end_step=5), "update_every"),
        (dict(update_every=2, end_step=5, key=0), "key must be a jax.random.key .*got int"),
        # each once a message that did not name the argument, or accepted ("0.3", True: all)
        (dict(update_every=2, end_step=5, drop_fraction=None), "drop_fraction must be a number"),
        (dict(update_every=2, end_step=5, drop_fraction="0.3"), "drop_fraction must be a number"),
        (dict(update_every=2, end_step=5, drop_fraction=True), "drop_fraction must be a number"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        B.rigl(
            optax.sgd(0.1),
            distribution=functools.partial(B.uniform, sparsity=0.9),
            **{"key": jax.random.key(0), **kwargs},
        )


def test_a_distribution_that_is_no_function_is_named():
    """A sparsity in place of the function failed at init: 'float' object is not callable."""
    with pytest.raises(TypeError, match="distribution must be a function, got float"):
        B.rigl(optax.sgd(0.1), distribution=0.9, key=jax.random.key(0), update_every=1, end_step=5)


def test_update_needs_params():
    tx = B.rigl(
        optax.sgd(0.1),
        distribution=functools.partial(B.uniform, sparsity=0.9),
        key=jax.random.key(0),
        update_every=2,
        end_step=5,
    )
    params = _params()
    with pytest.raises(ValueError, match="params"):
        tx.update(params, tx.init(params))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(grad_weight=float("nan")), ValueError, "grad_weight must be a finite number"),
        (dict(grad_weight=-1.0), ValueError, "grad_weight must be >= 0"),
        (dict(mutation_ratio=float("inf")), ValueError, "mutation_ratio must be a finite number"),
        (dict(mutation_ratio="0.2"), TypeError, "mutation_ratio must be a number"),
        (dict(soft_bound="no"), TypeError, "soft_bound must be True or False"),  # once soft
    ],
)
def test_mest_refuses_bad_constants_naming_them(kwargs, error, match):
    """A NaN grad_weight made every prune score NaN, and the prune-back then dropped nearly the
    whole mask; a NaN mutation ratio was reported as the cosine decay's init_value."""
    with pytest.raises(error, match=match):
        B.mest(
            optax.sgd(0.1),
            distribution=functools.partial(B.uniform, sparsity=0.5),
            key=jax.random.key(0),
            update_every=1,
            end_step=4,
            **kwargs,
        )
