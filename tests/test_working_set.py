"""The search's working-set form: the layer's W-sized product, enter / refresh / leave, the freeze
from it, the loop's switch, refresh and resume, and the option's errors."""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx
from training_helpers import (
    NUM_CLASSES,
    Crash,
    assert_resumed_as_uninterrupted,
    blobs,
    crash_at,
    tiny_mlp,
    train_tiny,
)

import dynadiag_jax as dd
from dynadiag_jax import data as D
from dynadiag_jax import training as T
from dynadiag_jax.nn import DiagonalDense
from dynadiag_jax.topk import sparse_soft_topk
from dynadiag_jax.training import loop
from train import baselines, common
from train.configs import common as configs

GATE = "dynadiag"
STORE = T.STORE_COLLECTION


def _variables(layer, x, seed, strength):
    v = layer.init(jax.random.key(seed), x)
    p = v["params"]["alpha"].shape[0]
    alpha = jax.random.normal(jax.random.key(seed + 1), (p,), jnp.float32)
    params = dict(v["params"], alpha=alpha)
    gates = dict(v[GATE], strength=jnp.float32(strength))
    return {**v, "params": params, GATE: gates}


def _in_working_set(variables, ws):
    params = dict(variables["params"], values=variables["params"]["values"][ws])
    return {**variables, "params": params, GATE: dict(variables[GATE], working_set=ws)}


def _loss(layer, variables, x):
    def f(params, x):
        y = layer.apply({**variables, "params": params}, x)
        return jnp.sum(jnp.sin(y.astype(jnp.float32)))

    return jax.value_and_grad(f, argnums=(0, 1))(variables["params"], x)


SHAPES = [  # (in, out, block_size)
    (16, 48, 1),
    (40, 24, 1),
    (32, 32, 1),
    (32, 64, 8),
    (64, 32, 8),
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(("n_in", "n_out", "b"), SHAPES)
def test_forward_and_gradients_equal_the_full_search_restricted_to_the_working_set(
    n_in, n_out, b, dtype
):
    layer = DiagonalDense(n_out, sparsity=0.75, block_size=b, param_dtype=dtype, impl="jax")
    x = jax.random.normal(jax.random.key(3), (5, n_in), dtype)
    full = _variables(layer, x, seed=n_in + n_out, strength=0.05)
    spec = layer.spec(n_in)
    w = T.working_set_width(spec.k, spec.num_candidates, 1.5) + 1
    ws = jnp.sort(jnp.argsort(-full["params"]["alpha"])[:w]).astype(jnp.int32)
    stats = dict(layer.apply(full, x, mutable=["intermediates"])[1]["intermediates"])
    assert float(stats["gate_nonzero"][0]) <= w  # the support is inside the working set
    small = _in_working_set(full, ws)
    (_, (g_full, dx_full)) = _loss(layer, full, x)
    (_, (g_ws, dx_ws)) = _loss(layer, small, x)
    eps = float(jnp.finfo(dtype).eps)
    tol = dict(rtol=8 * eps, atol=8 * eps)
    y_full = layer.apply(full, x).astype(jnp.float32)
    y_ws = layer.apply(small, x).astype(jnp.float32)
    scale = float(jnp.max(jnp.abs(y_full)))
    np.testing.assert_allclose(y_ws / scale, y_full / scale, **tol)

    def close(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        s = max(float(np.max(np.abs(b))), 1e-30)
        np.testing.assert_allclose(a / s, b / s, **tol)

    close(g_ws["values"], g_full["values"][ws])
    close(g_ws["alpha"], g_full["alpha"])
    close(g_ws["bias"], g_full["bias"])
    close(dx_ws, dx_full)


@pytest.mark.parametrize("scale", ["none", "rms"])
def test_gate_mass_outside_is_dropped_and_reported(scale):
    layer = DiagonalDense(32, sparsity=0.75, scale=scale, impl="jax")
    x = jax.random.normal(jax.random.key(0), (4, 32))
    full = _variables(layer, x, seed=0, strength=0.5)
    g = np.asarray(sparse_soft_topk(full["params"]["alpha"], layer.budget(32), strength=0.5))
    free = np.flatnonzero((g > 0) & (g < 1))  # the gate's gradient flows among these
    order = np.argsort(-np.asarray(full["params"]["alpha"]))
    ws = jnp.asarray(np.sort(np.concatenate([free[:3], order[-4:]])), jnp.int32)
    small = _in_working_set(full, ws)
    y, state = layer.apply(small, x, mutable=["intermediates"])
    stats = state["intermediates"]
    # the reference: the full layer's gated sum over the working set only (others' values zero)
    masked = full["params"]["values"] * jnp.zeros(32).at[ws].set(1.0)[:, None]
    reference = DiagonalDense(32, sparsity=0.75, scale="none", impl="jax")
    y_ref = reference.apply({**full, "params": dict(full["params"], values=masked)}, x)
    outside = g.sum() - g[np.asarray(ws)].sum()
    assert outside > 0.1
    np.testing.assert_allclose(stats["gate_mass_outside"][0], outside, rtol=1e-5)
    assert float(stats["computed_diagonals"][0]) == 7
    bias = full["params"]["bias"][None, :]
    c = np.sqrt(layer.budget(32) / np.sum(g[np.asarray(ws)] ** 2)) if scale == "rms" else 1.0
    np.testing.assert_allclose(y - bias, c * (y_ref - bias), rtol=1e-5, atol=1e-5)
    # alpha's gradient still reaches candidates outside the working set, through the gate
    (_, (grads, _)) = _loss(layer, small, x)
    others = np.setdiff1d(np.arange(32), np.asarray(ws))
    assert np.any(np.asarray(grads["alpha"])[others] != 0)


def test_bad_working_sets_are_refused_by_name():
    layer = DiagonalDense(16, sparsity=0.75, impl="jax")
    x = jnp.ones((2, 16))
    full = _variables(layer, x, seed=0, strength=0.1)

    def apply(ws, values=None):
        ws = jnp.asarray(ws)
        if values is None:
            values = full["params"]["values"][:1].repeat(ws.shape[0], axis=0)
        params = dict(full["params"], values=values)
        return layer.apply({**full, "params": params, GATE: dict(full[GATE], working_set=ws)}, x)

    with pytest.raises(ValueError, match="working_set.*holds 3 2 times"):
        apply([1, 3, 3, 5])
    with pytest.raises(ValueError, match="working_set.*holds 16, outside"):
        apply([1, 16])
    with pytest.raises(ValueError, match=r"shape \[W\] with 1 <= W <= P = 16"):
        apply(np.arange(17))
    with pytest.raises(ValueError, match="int32 candidate ids"):
        apply(jnp.asarray([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"params/values must have shape \[W, \*V\] = \[2, 16\]"):
        apply([1, 2], values=jnp.ones((3, 16)))
    # traced, it cannot raise: every output is NaN instead
    bad = jax.jit(lambda ws: apply(ws))(jnp.asarray([1, 3, 3, 5], jnp.int32))
    assert np.all(np.isnan(bad))
    good = jax.jit(lambda ws: apply(ws))(jnp.asarray([1, 3, 4, 5], jnp.int32))
    np.testing.assert_allclose(good, apply([1, 3, 4, 5]), rtol=1e-6)
    assert np.all(np.isfinite(good))


def test_the_nnx_layer_refuses_a_working_set():
    layer = dd.nnx.DiagonalDense(16, 16, sparsity=0.75, impl="jax", rngs=nnx.Rngs(0))
    layer.working_set = dd.nnx.GateState(jnp.arange(5, dtype=jnp.int32))
    with pytest.raises(NotImplementedError, match="working-set form .* linen layer"):
        layer(jnp.ones((2, 16)))


# --- the training state: enter, refresh, leave, freeze -------------------------------------


def _state(seed=0):
    model = tiny_mlp(0.8)
    optimizer = T.adamw(1e-2, weight_decay=1e-4)
    example = jax.ShapeDtypeStruct((8, 16), jnp.float32)
    state = T.create_train_state(model, optimizer, example, seed=seed)
    rng = np.random.default_rng(seed)

    def fill(tree):  # distinct values everywhere: every row is recognisable
        return jax.tree.map(
            lambda a: (
                jnp.asarray(rng.normal(size=a.shape), a.dtype)
                if jnp.issubdtype(a.dtype, jnp.floating) and a.ndim
                else a
            ),
            tree,
        )

    return state._replace(params=fill(state.params), opt_state=fill(state.opt_state))


def _moments(state, layer):
    """Every params-shaped ``values`` leaf of the optimizer state (AdamW's mu and nu)."""
    out = []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state.opt_state)[0]:
        keys = [getattr(k, "key", None) for k in path]
        if keys[-2:] == [layer, "values"] and hasattr(leaf, "shape"):
            out.append(np.asarray(leaf))
    return out


def test_enter_refresh_leave_round_trip_puts_values_and_moments_on_their_rows():
    state = _state()
    enter = jax.jit(functools.partial(T.enter_working_set, factor=1.25))
    ws_state = enter(state)
    for layer in ("hidden_0", "hidden_1"):
        k = state.collections[GATE][layer]["topk"].shape[0]
        alpha = np.asarray(state.params[layer]["alpha"])
        w = T.working_set_width(k, 32, 1.25)
        ws = np.asarray(ws_state.collections[GATE][layer]["working_set"])
        np.testing.assert_array_equal(ws, np.sort(np.argsort(-alpha, kind="stable")[:w]))
        full = np.asarray(state.params[layer]["values"])
        np.testing.assert_array_equal(ws_state.params[layer]["values"], full[ws])
        np.testing.assert_array_equal(ws_state.collections[STORE][layer]["values"], full)
        before, after = _moments(state, layer), _moments(ws_state, layer)
        assert len(after) == 2  # mu and nu
        for m0, m1 in zip(before, after):
            np.testing.assert_array_equal(m1, m0[ws])
    assert T.has_working_set(ws_state.collections)

    # a new order of alpha: two outsiders rise to the top, so the two last members leave
    params = jax.tree.map(lambda a: a, ws_state.params)
    for layer in ("hidden_0", "hidden_1"):
        ws = np.asarray(ws_state.collections[GATE][layer]["working_set"])
        risers = np.setdiff1d(np.arange(32), ws)[[3, 0]]
        params[layer]["alpha"] = params[layer]["alpha"].at[risers].set(jnp.asarray([50.0, 60.0]))
    moved = ws_state._replace(params=params)
    refreshed = jax.jit(T.refresh_working_set)(moved)
    for layer in ("hidden_0", "hidden_1"):
        old = np.asarray(moved.collections[GATE][layer]["working_set"])
        new = np.asarray(refreshed.collections[GATE][layer]["working_set"])
        w = len(old)
        top = np.argsort(-np.asarray(params[layer]["alpha"]), kind="stable")[:w]
        assert set(new) == set(top)
        stay = np.isin(old, new)
        assert stay.sum() == w - 2
        np.testing.assert_array_equal(new[stay], old[stay])  # members keep their slot
        values_old = np.asarray(moved.params[layer]["values"])
        values_new = np.asarray(refreshed.params[layer]["values"])
        store_old = np.asarray(moved.collections[STORE][layer]["values"])
        store_new = np.asarray(refreshed.collections[STORE][layer]["values"])
        np.testing.assert_array_equal(values_new[stay], values_old[stay])
        np.testing.assert_array_equal(values_new[~stay], store_old[new[~stay]])
        np.testing.assert_array_equal(store_new[old], values_old)  # every member written back
        for m0, m1 in zip(_moments(moved, layer), _moments(refreshed, layer)):
            np.testing.assert_array_equal(m1[stay], m0[stay])
            assert not np.any(m1[~stay])  # the entering ones start from zero

    left = jax.jit(T.leave_working_set)(refreshed)
    assert not T.has_working_set(left.collections) and STORE not in left.collections
    for layer in ("hidden_0", "hidden_1"):
        ws = np.asarray(refreshed.collections[GATE][layer]["working_set"])
        expected = np.asarray(refreshed.collections[STORE][layer]["values"]).copy()
        expected[ws] = np.asarray(refreshed.params[layer]["values"])
        np.testing.assert_array_equal(left.params[layer]["values"], expected)
        for m_ws, m_full in zip(_moments(refreshed, layer), _moments(left, layer)):
            want = np.zeros_like(m_full)
            want[ws] = m_ws
            np.testing.assert_array_equal(m_full, want)
    # the structure of the plain search state again
    assert jax.tree.structure(left) == jax.tree.structure(state)
    assert jax.tree.map(jnp.shape, left) == jax.tree.map(jnp.shape, state)


@pytest.mark.parametrize("outside", [False, True])
def test_freeze_from_the_working_set_equals_the_freeze_of_the_full_form(outside):
    """``outside``: one of the kept top K is not in the working set (stored values, zero
    moments)."""
    state = T.enter_working_set(_state(1), 1.25)
    if outside:
        params = jax.tree.map(lambda a: a, state.params)
        ws = np.asarray(state.collections[GATE]["hidden_1"]["working_set"])
        out = int(np.setdiff1d(np.arange(32), ws)[0])
        params["hidden_1"]["alpha"] = params["hidden_1"]["alpha"].at[out].set(100.0)
        state = state._replace(params=params)
    # the equivalent full form, built here from the definition
    params = jax.tree.map(np.asarray, state.params)
    opt_state = jax.tree.map(lambda a: a, state.opt_state)
    collections = {k: v for k, v in state.collections.items() if k != STORE}
    collections[GATE] = {
        layer: {k: v for k, v in entries.items() if k != "working_set"}
        for layer, entries in state.collections[GATE].items()
    }
    full_params = jax.tree.map(lambda a: a, params)
    for layer in ("hidden_0", "hidden_1"):
        ws = np.asarray(state.collections[GATE][layer]["working_set"])
        values = np.asarray(state.collections[STORE][layer]["values"]).copy()
        values[ws] = params[layer]["values"]
        full_params[layer]["values"] = values
    full_shapes = jax.tree.map(jnp.shape, full_params)

    def spread(path, leaf):
        keys = [getattr(k, "key", None) for k in path]
        if keys[-1] == "values" and keys[-2] in ("hidden_0", "hidden_1") and hasattr(leaf, "shape"):
            layer = keys[-2]
            if leaf.shape != full_shapes[layer]["values"]:
                ws = np.asarray(state.collections[GATE][layer]["working_set"])
                out = np.zeros(full_shapes[layer]["values"], leaf.dtype)
                out[ws] = leaf
                return jnp.asarray(out)
        return leaf

    opt_state = jax.tree_util.tree_map_with_path(spread, opt_state)
    full = state._replace(params=full_params, opt_state=opt_state, collections=collections)
    a, b = jax.jit(T.freeze_state)(state), jax.jit(T.freeze_state)(full)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)
    if outside:
        assert out in np.asarray(a.collections["diagonals"]["hidden_1"]["offsets"])


def test_state_functions_refuse_the_wrong_form_and_bad_factors():
    state = _state()
    with pytest.raises(ValueError, match="factor must be >= 1"):
        T.enter_working_set(state, 0.9)
    with pytest.raises(ValueError, match="not in the working-set form"):
        T.refresh_working_set(state)
    ws_state = T.enter_working_set(state, 2.0)
    with pytest.raises(ValueError, match="already in the working-set form"):
        T.enter_working_set(ws_state, 2.0)
    with pytest.raises(ValueError, match="freeze_tree: .*hidden_0 is in the working-set form"):
        dd.freeze_tree(T.variables_of(ws_state))
    assert T.leave_working_set(state) is state
    assert T.working_set_width(10, 100, 1.1) == 11 and T.working_set_width(10, 12, 2.0) == 12


# --- the loop ------------------------------------------------------------------------------

RUN = dict(num_steps=12, sparsity=0.8, freeze_step=8, checkpoint_every=2, log_every=1)
OPTION = T.WorkingSet(1.25, 2, 3)


def test_schedule_enters_at_its_step_and_refreshes_until_the_freeze():
    schedule = loop.Schedule(12, 8, 0, 0, 0, 0, working_set_step=3, refresh_every=2)
    steps = {"enter_working_set": [], "refresh_working_set": []}
    searching = True
    for step in range(1, 13):
        events = schedule.after(step, searching)
        searching = searching and not events.freeze
        for name in steps:
            if getattr(events, name):
                steps[name].append(step)
    assert steps == {"enter_working_set": [3], "refresh_working_set": [5, 7]}


def test_a_run_searches_in_the_working_set_and_resumes_inside_it(tmp_path):
    full = train_tiny(tmp_path / "full", **RUN, working_set=OPTION)
    records = list(T.read_jsonl(tmp_path / "full" / "metrics.jsonl"))
    computed = {
        r["step"]: r.get("computed_diagonals/hidden_1") for r in records if r["kind"] == "train"
    }
    # steps 4..8 run in the working-set form: W = ceil(1.25 * 7) = 9 diagonals of hidden_1
    assert [computed[s] for s in range(4, 9)] == [9.0] * 5
    assert all(computed[s] is None for s in range(9, 13))  # frozen
    meta = T.Checkpointer(tmp_path / "full" / "checkpoints").read_meta(12)
    assert not meta.get("working_set")
    with pytest.raises(Crash):
        train_tiny(
            tmp_path / "cut", **RUN, working_set=OPTION, hooks=[crash_at(7)], keep_checkpoints=10
        )
    ckpt = T.Checkpointer(tmp_path / "cut" / "checkpoints")
    assert ckpt.read_meta(6)["working_set"] and not ckpt.read_meta(2).get("working_set")
    resumed = train_tiny(tmp_path / "cut", **RUN, working_set=OPTION)
    assert resumed.start_step == 6  # a checkpoint of the working-set form
    assert_resumed_as_uninterrupted(resumed, full, tmp_path / "cut", tmp_path / "full")
    # the same run without the option computes something else (the option is not a no-op)
    plain = train_tiny(tmp_path / "plain", **RUN)
    assert not np.array_equal(
        plain.state.params["hidden_1"]["values"], full.state.params["hidden_1"]["values"]
    )


def test_each_step_waits_for_the_program_of_its_own_phase(tmp_path, monkeypatch):
    waited = []
    wait = loop.CompileAhead.wait

    def recording(self, name):
        waited.append(name)
        return wait(self, name)

    monkeypatch.setattr(loop.CompileAhead, "wait", recording)
    train_tiny(tmp_path / "run", **RUN, working_set=OPTION)
    steps = [name[1] for name in waited if isinstance(name, tuple) and name[0] == "step"]
    # the search's first 3 steps, 5 in the working-set form (4..8), 4 frozen (9..12)
    assert steps == [True] * 3 + ["working_set"] * 5 + [False] * 4


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (T.WorkingSet(0.5, 2, 3), "factor must be >= 1"),
        (T.WorkingSet(1.25, 0, 3), "refresh_every must be >= 1"),
        (T.WorkingSet(1.25, 2, 8), "start_step=8 must come before freeze_step=8"),
        ((1.25, 2, 3), "must be a WorkingSet"),
    ],
)
def test_bad_options_are_refused_before_anything_compiles(tmp_path, option, message):
    with pytest.raises((ValueError, TypeError), match=message):
        train_tiny(tmp_path, **RUN, working_set=option)


def test_the_option_needs_a_search_and_comes_after_the_restart(tmp_path):
    with pytest.raises(ValueError, match="needs DiagonalDense layers in the search phase"):
        train_tiny(tmp_path / "a", num_steps=12, working_set=OPTION)
    with pytest.raises(ValueError, match="must come after gate.rescore_step=4"):
        T.train(**_train_args(tmp_path / "b", rescore_step=4, working_set=OPTION))


def test_a_working_set_checkpoint_needs_the_option_to_resume(tmp_path):
    with pytest.raises(Crash):
        train_tiny(tmp_path, **RUN, working_set=OPTION, hooks=[crash_at(5)])
    with pytest.raises(T.CheckpointMismatch, match="working_set"):
        train_tiny(tmp_path, **RUN)


def test_the_step_refuses_a_trained_subset_with_a_working_set():
    model = tiny_mlp(0.8)
    optimizer = T.adamw(1e-2, weight_decay=0.0)
    state = T.enter_working_set(
        T.create_train_state(model, optimizer, jnp.zeros((8, 16)), seed=0), 1.25
    )
    step = T.make_train_step(model, optimizer, T.Classification(4), trained=(r".*/bias",))
    batch = {"image": jnp.zeros((8, 16)), "label": jnp.zeros((8,), jnp.int32)}
    with pytest.raises(ValueError, match="trained= .* does not combine with .* working-set form"):
        step(state, batch)


def _train_args(workdir, *, rescore_step, working_set):
    return dict(
        model=tiny_mlp(0.8),
        optimizer=T.adamw(1e-2, weight_decay=1e-4),
        task=T.Classification(NUM_CLASSES),
        train_data=D.ArrayBatches(blobs(), 16, seed=0),
        num_steps=12,
        example_input=jax.ShapeDtypeStruct((16, 16), jnp.float32),
        seed=0,
        freeze_step=8,
        gate=T.GateSchedule(
            "strength", dd.schedules.cosine(1.0, 0.05, 8), rescore_step=rescore_step
        ),
        workdir=workdir,
        progress=False,
        working_set=working_set,
    )


# --- the configs ---------------------------------------------------------------------------


def _section(**overrides):
    section = configs.dynadiag(0.9, [r"hidden_\d+"])
    section.update(overrides)
    return ml_collections.ConfigDict(section)


def test_the_config_option_is_off_by_default_and_read_explicitly():
    cfg = _section()
    gate = common.gate_schedule(cfg, 1000, 4000)
    assert common.working_set(cfg, gate, 1000, 4000) is None
    on = _section(working_set=1.25, working_set_refresh=10, working_set_start=0.1)
    option = common.working_set(on, common.gate_schedule(on, 1000, 4000), 1000, 4000)
    assert option == T.WorkingSet(1.25, 10, 100) and gate.rescore_step == 50
    assert baselines.READS["dynadiag"] == ("dynadiag",)  # part of a DynaDiag run's recipe
    for bad, message in (
        (dict(working_set=0.5), "factor must be >= 1"),
        (dict(working_set=1.25, working_set_refresh=0), "refresh_every must be >= 1"),
        (
            dict(working_set=1.25, working_set_start=0.05),
            r"working_set_start must be in \(rescore_fraction=0.05",
        ),
    ):
        cfg = _section(**bad)
        with pytest.raises(common.ConfigError, match=message):
            common.working_set(cfg, common.gate_schedule(cfg, 1000, 4000), 1000, 4000)
