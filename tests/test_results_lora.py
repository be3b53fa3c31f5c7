"""The results command's LoRA-FA methods: the name grammar, a tiny run's row, resumption."""

import functools

import numpy as np
import pytest
from test_results import _config, needs_layer, parse
from training_helpers import Crash, crash_at

from train import common, fashion_mnist, results_report
from train import results_runs as results
from train.configs import fashion_mnist as fashion_config

TINY = "quick,models=mlp,methods=dynadiag_lorafa_r4,sparsities=0.9"


def test_lorafa_methods_parse_to_their_diagonal_method_and_rank():
    for method, base, block, permutation, rank in (
        ("dynadiag_lorafa_r8", "dynadiag", 1, None, 8),
        ("dynadiag_b16_lorafa_r16", "dynadiag", 16, None, 16),
        ("dynadiag_b16_random_perm_lorafa_r4", "dynadiag", 16, "random", 4),
        ("static_diagonals_lorafa_r4", "static_diagonals", 1, None, 4),
        ("dynadiag", "dynadiag", 1, None, 0),
    ):
        assert parse(method) == (base, block)
        assert results.method_permutation(method) == permutation
        assert results.method_rank(method) == rank
    for bad in ("rigl_lorafa_r4", "dynadiag_lorafa_r0", "dynadiag_lorafa", "dynadiag_lorafa_r8_b8"):
        with pytest.raises(common.ConfigError, match="unknown method"):
            results.method_rank(bad)
    assert results_report.method_name("dynadiag_lorafa_r8") == "DynaDiag + LoRA-FA r=8"


def test_the_phase_length_and_fingerprint_follow_the_lora_section():
    config = _config("models=mlp")
    m = config.models.mlp
    assert results.lora_steps(m, "dynadiag_lorafa_r8", 1000) == 250
    assert results.lora_steps(m, "dynadiag", 1000) == 0
    fp = lambda method: results.fingerprint(config, "mlp", method, 100)  # noqa: E731
    before = {x: fp(x) for x in ("dynadiag", "dynadiag_lorafa_r4", "dynadiag_lorafa_r8")}
    assert len(set(before.values())) == 3
    with config.unlocked():
        m.lora.learning_rate = 1e-3
    assert fp("dynadiag") == before["dynadiag"]
    assert fp("dynadiag_lorafa_r8") != before["dynadiag_lorafa_r8"]


@pytest.mark.parametrize(
    "field, value, match", [("fraction", 0.0, "lora.fraction"), ("learning_rate", 0.0, "lora")]
)
def test_a_bad_lora_section_is_a_config_error(field, value, match):
    config = _config(TINY)
    with config.unlocked():
        config.models.mlp.lora[field] = value
    with pytest.raises(common.ConfigError, match=match):
        results.prepare(config)


def test_density_counts_a_and_b_of_every_adapted_layer():
    params = {
        "a": {"values": np.ones((2, 4)), "lora_b": np.zeros((8, 2))},
        "b": {"kernel": np.array([[1.0, 0.0], [0.0, 2.0]])},
    }
    frozen = {"a": {"lora_a": np.ones((2, 4))}}
    shapes = {"a": (4, 8), "b": (2, 2)}
    # B counts although it is still zero: the adapter's weights are stored whatever their value
    assert results.sparse_layer_density(params, shapes, frozen) == pytest.approx(
        (8 + 2 * (4 + 8) + 2) / (32 + 4)
    )
    assert results.sparse_layer_density(params, shapes) == pytest.approx((8 + 16 + 2) / 36)


def _run(config, data, workdir):
    (spec,) = results.run_plan(config)
    steps = results.steps_of(config.models.mlp, data)
    fp = results.fingerprint(config, "mlp", spec[1], steps)
    return steps, results.train_run(config, data, spec, steps, workdir, fp)


@needs_layer
@pytest.mark.slow
def test_a_tiny_lorafa_run_counts_its_adapters_and_resumes_inside_the_phase(tmp_path, monkeypatch):
    config = _config(TINY)
    data = results.prepare(config)
    steps, full = _run(config, data, tmp_path / "full")
    phase = round(0.25 * steps)
    assert (full["steps"], full["lora_steps"]) == (steps + phase, phase)
    assert 0.0 <= full["accuracy_before_lora"] <= 1.0 and 0.0 <= full["accuracy"] <= 1.0
    # 784 -> 256 -> 256 at 90%, plus A[4, in] and B[out, 4] on both layers
    shapes = {"hidden_0": (784, 256), "hidden_1": (256, 256)}
    dense = sum(i * o for i, o in shapes.values())
    adapters = sum(4 * (i + o) for i, o in shapes.values())
    assert full["density"] == pytest.approx(0.1 + adapters / dense, abs=0.002)

    train = results.T.train
    monkeypatch.setattr(results.T, "train", functools.partial(train, hooks=[crash_at(steps + 2)]))
    with pytest.raises(Crash):
        _run(config, data, tmp_path / "cut")
    monkeypatch.setattr(results.T, "train", train)
    _, resumed = _run(config, data, tmp_path / "cut")
    # from the checkpoint saved as the phase began
    assert resumed["resumed_at"] == steps
    for key in ("accuracy", "accuracy_before_lora", "loss", "density", "steps"):
        assert resumed[key] == full[key], key


def _fashion(arg="", **lora):
    config = fashion_config.get_config(arg)
    config.data.source = "mnist5k"
    config.lora.update(lora)
    return config


def test_fashion_mnist_continues_the_sparse_run_with_the_configured_phase():
    _, steps, _, models = fashion_mnist.prepare(_fashion(steps=5, rank=4))
    assert list(models) == ["dense", "dynadiag_s90_lorafa_r4"]
    dense, ours = models.values()
    assert dense.phase is None and dense.num_steps == steps
    assert ours.phase.start_step == steps and ours.num_steps == steps + 5
    assert ours.phase.trained == (r".*/lora_b",)
    for arg in ("method=rigl", "sparsity=0"):
        with pytest.raises(common.ConfigError, match="frozen diagonal model"):
            fashion_mnist.prepare(_fashion(arg, steps=5))


@needs_layer
@pytest.mark.slow
def test_fashion_mnist_phase_run_counts_the_adapters(tmp_path, capsys):
    """The same sparse run without and with a phase: the printed weights differ by A and B."""
    runs = {}
    for arg, lora in (("runlocal", {}), ("runlocal", dict(steps=4, rank=4))):
        config = _fashion(arg, **lora)
        config.compare_dense = False
        ((name, acc, params, _),) = fashion_mnist.run(
            config, tmp_path / str(len(runs)), progress=False
        )
        assert 0.0 <= acc <= 1.0
        runs[name] = params
    assert list(runs) == ["dynadiag_s90", "dynadiag_s90_lorafa_r4"]
    assert runs["dynadiag_s90_lorafa_r4"] == runs["dynadiag_s90"] + 4 * (784 + 256 + 256 + 256)
    assert "LoRA-FA phase (+ LoRA-FA r=4 (B), 4 steps): test accuracy" in capsys.readouterr().out


def test_lora_goals_compare_each_rank_with_rigl_and_set():
    config = _config("models=mlp+gpt")
    stats = {
        ("mlp", "rigl", 0.9): (0.870, 0.002, 3),
        ("mlp", "set", 0.9): (0.872, 0.002, 3),
        ("mlp", "dynadiag_lorafa_r4", 0.9): (0.871, 0.001, 3),
        ("mlp", "dynadiag_lorafa_r16", 0.9): (0.875, 0.001, 3),
    }
    ppl = {
        ("gpt", "rigl", 0.9): (10.3, 0.1, 2),
        ("gpt", "set", 0.9): (10.1, 0.1, 2),
        ("gpt", "dynadiag_lorafa_r8", 0.9): (9.9, 0.1, 2),
    }
    assert results_report.lora_goals(config, stats, ppl) == [
        "- mlp: DynaDiag + LoRA-FA r=4 at least max(RigL, SET): **missed** "
        "(87.10 ± 0.10% against 87.20%).",
        "- mlp: DynaDiag + LoRA-FA r=16 at least max(RigL, SET): **met** "
        "(87.50 ± 0.10% against 87.20%).",
        "- gpt: DynaDiag + LoRA-FA r=8 perplexity below RigL's and SET's: **met** "
        "(9.900 against 10.100).",
    ]
    assert results_report.lora_goals(config, {}, {}) == []


def test_steps_replace_the_epochs_of_an_image_suite_for_a_same_steps_control():
    config = _config(TINY)
    data = results.prepare(config)
    m = config.models.mlp
    by_epochs = results.steps_of(m, data)
    assert by_epochs == int(m.epochs) * (len(data.images.train["label"]) // int(m.batch_size))
    fp = results.fingerprint(config, "mlp", "dynadiag", by_epochs)
    with config.unlocked():
        m.steps = by_epochs + 7
    assert results.steps_of(m, data) == by_epochs + 7
    assert results.fingerprint(config, "mlp", "dynadiag", by_epochs + 7) != fp
    with config.unlocked():
        m.steps = -1
    with pytest.raises(common.ConfigError, match="steps must be > 0"):
        results.steps_of(m, data)
