"""The results command: method selection by config, the report, and a tiny end-to-end run."""

import json

import jax
import jax.numpy as jnp
import pytest

import dynadiag_jax as dd
from dynadiag_jax import baselines as B
from train import baselines, common, results_report, speed
from train import results_runs as results
from train.configs import results as results_config

HAS_LAYER = hasattr(dd, "nn")
needs_layer = pytest.mark.skipif(
    not HAS_LAYER, reason="dd.nn.DiagonalDense is not in this checkout"
)


def _config(arg="quick,models=mlp"):
    config = results_config.get_config(arg)
    with config.unlocked():
        config.data.source = "mnist5k"
        config.unstructured.update_every = 10
        config.speed.repeats = 1
        config.speed.warmup = 1
        config.speed.inference_batches = (1, 8)
    return config


def _build(config, method, sparsity=0.9, steps=100):
    m = config.models.mlp
    return baselines.build(
        method,
        model_cfg=m.model,
        dynadiag_cfg=m.dynadiag,
        unstructured_cfg=config.unstructured,
        optimizer_cfg=m.optimizer,
        sparsity=sparsity,
        num_steps=steps,
        warmup_steps=0,
        seed=0,
        num_classes=10,
    )


@pytest.mark.parametrize("method", sorted(baselines.UNSTRUCTURED))
def test_unstructured_methods_sparsify_exactly_the_configured_layers(method):
    built = _build(_config(), method)
    params = built.model.init(jax.random.key(0), jnp.zeros((2, 28, 28, 1)))["params"]
    state = built.optimizer.init(params)
    assert isinstance(state, B.SparseState)
    masks = state.masks
    assert masks["head"]["kernel"] is None and masks["hidden_0"]["bias"] is None
    for layer, size in (("hidden_0", 784 * 256), ("hidden_1", 256 * 256)):
        assert int(masks[layer]["kernel"].sum()) == B.num_active(size, 0.9)
    assert built.gate is None and built.freeze_step is None


def test_dense_method_is_a_plain_model_and_optimizer():
    built = _build(_config(), "dense")
    params = built.model.init(jax.random.key(0), jnp.zeros((2, 28, 28, 1)))["params"]
    assert not isinstance(built.optimizer.init(params), B.SparseState)
    assert set(params) == {"hidden_0", "hidden_1", "head"}


@needs_layer
def test_diagonal_methods_use_diagonal_layers():
    config = _config()
    static = _build(config, "static_diagonals")
    variables = static.model.init(jax.random.key(0), jnp.zeros((2, 28, 28, 1)))
    assert (
        set(variables["params"]["hidden_0"]) >= {"values"}
        and "alpha" not in variables["params"]["hidden_0"]
    )
    assert static.gate is None and static.freeze_step is None
    learned = _build(config, "dynadiag")
    assert learned.gate is not None and learned.freeze_step == round(0.3 * 100)


def test_kernel_include_matches_layer_paths_not_biases_or_the_head():
    include = baselines.kernel_include((r"hidden_\d+",))
    leaf = jnp.zeros((3, 3))
    assert include("hidden_0/kernel", leaf) and include("hidden_12/kernel", leaf)
    assert not include("head/kernel", leaf) and not include("hidden_0/bias", jnp.zeros(3))
    assert not include("x/hidden_0/kernel", leaf)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("method", "magnitude", "method must be one of"),
        ("distribution", "gaussian", "distribution"),
        ("end_fraction", 0.0, "end_fraction"),
        ("update_every", 0, "update_every"),
    ],
)
def test_bad_method_settings_raise_config_errors(field, value, match):
    config = _config()
    method = "rigl"
    with config.unlocked():
        if field == "method":
            method = value
        else:
            config.unstructured[field] = value
    with pytest.raises(common.ConfigError, match=match):
        _build(config, method)


def test_run_plan_trains_dense_once_per_seed():
    config = _config("seeds=2,models=mlp,methods=dense+rigl,sparsities=0.8+0.9")
    plan = results.run_plan(config)
    assert plan.count(("mlp", "dense", 0.0, 0)) == 1
    assert len(plan) == 2 * (1 + 2)


def _records_and_timings():
    records = []
    acc = {
        "dense": 0.90,
        "dynadiag": 0.895,
        "static_diagonals": 0.88,
        "rigl": 0.89,
        "set": 0.885,
        "mest": 0.89,
    }
    for seed in range(3):
        for method, a in acc.items():
            for s in (0.0,) if method == "dense" else (0.8, 0.9, 0.95):
                records.append(
                    {
                        "model": "mlp",
                        "method": method,
                        "sparsity": s,
                        "seed": seed,
                        "accuracy": a + 0.001 * seed - max(0.0, s - 0.8) / 10,
                        "seconds": 10.0,
                        "density": 1 - s,
                        "step_time_s": 0.002,
                    }
                )
    group = {
        v: {"train": t, "infer_b1": t / 10}
        for v, t in (
            ("dense", 2e-3),
            ("diagonal", 1e-3),
            ("unstructured_masked", 2.2e-3),
            ("unstructured_bcoo", 5e-3),
        )
    }
    timings = {
        "machine": speed.machine(),
        "repeats": 3,
        "seconds": 60.0,
        "models": {"mlp": {f"{s:g}": group for s in (0.8, 0.9, 0.95)}},
    }
    return records, timings


def test_report_tables_goals_plots_and_kept_notes(tmp_path):
    config = _config("models=mlp")
    records, timings = _records_and_timings()
    path = results_report.write(tmp_path, config, records, timings, data_name="test")
    text = path.read_text()
    assert "| DynaDiag | 89.60 ± 0.10 (3) | 88.60 ± 0.10 (3) | 88.10 ± 0.10 (3) |" in text
    assert (
        "DynaDiag within 1 point of dense: **missed** (dense 90.10%, DynaDiag 88.60%, gap +1.50"
        in text
    )
    assert "at least as accurate as SET and RigL: **met**" in text
    assert "Faster training step than dense" in text and "**met** (0.50×" in text
    assert "over whole runs, search phase included, 1.00×" in text
    assert (
        "| 90% | Diagonal (DynaDiag frozen, static diagonals) | 1.000 | 0.50 | 0.100 | 0.50 |"
        in text
    )
    assert (tmp_path / "results_accuracy.png").stat().st_size > 0
    assert (tmp_path / "results_speed.png").stat().st_size > 0
    path.write_text(
        text.replace("<!-- notes -->\n", "<!-- notes -->\nWhy: hand-written analysis.\n")
    )
    results_report.write(tmp_path, config, records, timings, data_name="test")
    assert "Why: hand-written analysis." in path.read_text()


def test_sparse_layer_density_counts_nonzeros_and_diagonals():
    params = {
        "a": {"kernel": jnp.array([[1.0, 0.0], [0.0, 2.0]])},
        "b": {"values": jnp.ones((2, 4))},
    }
    assert results.sparse_layer_density(params, {"a": (2, 2), "b": (4, 8)}) == pytest.approx(
        (2 + 8) / (4 + 32)
    )
    with pytest.raises(ValueError, match="neither"):
        results.sparse_layer_density(
            {"c": {"alpha": jnp.ones(3), "values": jnp.ones((3, 3))}}, {"c": (3, 3)}
        )


@pytest.mark.slow
def test_end_to_end_tiny_run_and_timings(tmp_path):
    methods = (
        "dense+dynadiag+static_diagonals+rigl+set+mest" if HAS_LAYER else "dense+rigl+set+mest"
    )
    config = _config(f"quick,models=mlp,methods={methods},sparsities=0.9")
    data = results.prepare(config)
    assert data.name.startswith("mnist5k")
    records = []
    for spec in results.run_plan(config):
        steps = results.steps_of(config.models[spec[0]], data)
        fp = results.fingerprint(config, spec[0], spec[1], steps)
        records.append(results.train_run(config, data, spec, steps, tmp_path / spec[1], fp))
    for r in records:
        assert 0.0 <= r["accuracy"] <= 1.0
        want = 1.0 if r["method"] == "dense" else 0.1
        assert r["density"] == pytest.approx(want, abs=0.002), r
    timings = speed.measure(config, data, results.build, results.steps_of, progress=False)
    group = timings["models"]["mlp"]["0.9"]
    assert set(group) == set(speed.VARIANTS)
    assert all(t > 0 for v in group.values() for t in v.values())
    json.dumps(timings)
    path = results_report.write(tmp_path / "docs", config, records, timings, data_name=data.name)
    assert "## Speed" in path.read_text()


@pytest.mark.parametrize("method", baselines.METHODS)
def test_fashion_mnist_script_selects_the_method_by_config(method):
    from train import fashion_mnist
    from train.configs import fashion_mnist as fashion_config

    config = fashion_config.get_config(f"method={method}")
    with config.unlocked():
        config.data.source = "mnist5k"
    _, _, _, models = fashion_mnist.prepare(config)
    assert list(models) == (["dense"] if method == "dense" else ["dense", f"{method}_s90"])
    built, dyn = models[list(models)[-1]]
    assert built.name == method and dyn.sparsity == (0.0 if method == "dense" else 0.9)


def test_fingerprint_changes_only_for_methods_that_read_the_changed_setting():
    config = _config("models=mlp")
    methods = baselines.METHODS

    def prints(c):
        return {m: results.fingerprint(c, "mlp", m, 100) for m in methods}

    before = prints(config)
    with config.unlocked():
        config.models.mlp.dynadiag.gate_schedule.end_value = 0.5
    after_gate = prints(config)
    assert [m for m in methods if before[m] != after_gate[m]] == ["dynadiag"]
    with config.unlocked():
        config.unstructured.drop_fraction = 0.1
    after_drop = prints(config)
    assert sorted(m for m in methods if after_gate[m] != after_drop[m]) == ["mest", "rigl", "set"]
    assert results.fingerprint(config, "mlp", "dense", 200) != after_drop["dense"]
