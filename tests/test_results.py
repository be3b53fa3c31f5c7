"""The results command: method selection by config, the report, and a tiny end-to-end run."""

import csv
import importlib
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dynadiag_jax as dd
from dynadiag_jax import baselines as B
from dynadiag_jax import training as T
from train import baselines, common, results_report, speed
from train import results_runs as results
from train.configs import common as config_common
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
        for m in config.models.values():
            m.inference_batches = (1, 8)
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


@pytest.mark.parametrize("method", ["rigl", "set", "mest"])
def test_a_run_too_short_for_one_mask_update_names_the_keys(method):
    """update_every=10 with end_fraction 0.75 of 12 steps: no update before step 9 (the
    optimizer's own error named no config key)."""
    with pytest.raises(common.ConfigError, match=r"unstructured\.update_every=10 until "):
        _build(_config(), method, steps=12)
    assert _build(_config(), method, steps=16).optimizer is not None  # 10 < 12: one update


@pytest.mark.parametrize(
    "module,tiny", [("train.configs.vit_imagenet", "mu/4"), ("train.configs.gpt2_lm", "mu")]
)
def test_runlocal_smoke_runs_the_variant_given_and_updates_masks(module, tiny):
    get_config = importlib.import_module(module).get_config
    assert get_config("runlocal").model.variant == tiny
    assert get_config("runlocal,variant=S/16").model.variant == "S/16"
    config = get_config("runlocal,method=rigl")
    end = round(config.unstructured.end_fraction * config.train.num_steps)
    assert config.unstructured.update_every < end


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
    fraction = config.models.mlp.dynadiag.search_fraction
    assert fraction == config_common.SHORT_SEARCH
    assert learned.gate is not None and learned.freeze_step == round(fraction * 100)


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


def test_run_plan_goal_sparsity_first_block_methods_there_only_fewer_sweep_seeds():
    config = _config("models=vit+gpt")
    with config.unlocked():
        for m in config.models.values():
            m.seeds, m.sweep_seeds = 3, 1
    plan = results.run_plan(config, ["vit"])
    assert {p[0] for p in plan} == {"vit"}
    goal = [p for p in plan if p[2] in (0.0, 0.9)]
    assert plan[: len(goal)] == goal, "the goal sparsity's runs come first"
    assert [p for p in goal if p[3] == 0] == [
        ("vit", m, 0.0 if m == "dense" else 0.9, 0)
        for m in (
            *results_config.ELEMENT_METHODS[:-1],  # the ViT has no MEST
            *results_config.PERMUTED_METHODS,
            "dynadiag_b16",
            *results_config.LORA_METHODS,
        )
    ]
    assert {p[3] for p in goal} == {0, 1, 2}
    sweep = plan[len(goal) :]
    assert {p[2] for p in sweep} == {0.8, 0.95} and {p[3] for p in sweep} == {0}
    # the permuted methods at every sparsity, block diagonals and LoRA-FA at the goal only
    assert not any(
        (parse(p[1])[1] > 1 and not results.method_permutation(p[1])) or results.method_rank(p[1])
        for p in sweep
    )
    assert [p[1] for p in sweep if p[2] == 0.95] == [
        *results_config.ELEMENT_METHODS[1:-1],
        *results_config.PERMUTED_METHODS,
    ]
    assert len(sweep) == 2 * (5 + 5)


def parse(method):
    return results.parse_method(method)


def test_parse_method_reads_block_variants_and_refuses_unknown_names():
    assert parse("dynadiag_b16") == ("dynadiag", 16)
    assert parse("static_diagonals_b8") == ("static_diagonals", 8)
    assert parse("rigl") == ("rigl", 1)
    for bad in ("dynadiag_b1", "dynadiag_b", "rigl_b16", "magnitude"):
        with pytest.raises(common.ConfigError, match="unknown method"):
            parse(bad)
    cfg = results.method_dynadiag(_config().models.mlp, "dynadiag_b16")
    assert cfg.block_size == 16


def test_permuted_methods_set_the_permutation_and_refuse_what_cannot_harden():
    mlp = _config().models.mlp
    for method, base, block, permutation in (
        ("dynadiag_random_perm", "dynadiag", 1, "random"),
        ("dynadiag_b16_learned_perm", "dynadiag", 16, "learned"),
        ("static_diagonals_b8_random_perm", "static_diagonals", 8, "random"),
        ("dynadiag", "dynadiag", 1, None),
    ):
        assert parse(method) == (base, block)
        assert results.method_permutation(method) == permutation
        cfg = results.method_dynadiag(mlp, method)
        assert cfg.permutation == (permutation or "none")
        assert cfg.get("block_size", 1) == block
    for bad in ("static_diagonals_learned_perm", "rigl_random_perm", "dynadiag_shuffled_perm"):
        with pytest.raises(common.ConfigError, match="unknown method"):
            results.method_permutation(bad)
    # a permuted method's runs are runs of their own
    config = _config("models=mlp")
    fp = lambda method: results.fingerprint(config, "mlp", method, 100)  # noqa: E731
    named = fp("static_diagonals_random_perm"), fp("dynadiag_b16_learned_perm")
    assert len({*named, fp("static_diagonals"), fp("dynadiag_b16")}) == 4


def test_suite_selection_and_config_errors():
    config = _config("models=mlp+gpt")
    assert results.selected_suites(config, ["all"]) == ["mlp", "gpt"]
    assert results.selected_suites(config, ["gpt", "mlp"]) == ["mlp", "gpt"]
    with pytest.raises(common.ConfigError, match="--suite names \\['vit'\\]"):
        results.selected_suites(config, ["vit"])
    with config.unlocked():
        config.models.gpt.bogus = 1
    with pytest.raises(common.ConfigError, match="models.gpt: unknown config keys: bogus"):
        results.prepare(config)


def test_a_suite_plan_that_would_count_a_run_twice_or_share_its_directory_is_refused():
    config = _config("models=mlp")
    with pytest.raises(ValueError, match="seeds='0' must be an int >= 1"):
        results_config.get_config("models=mlp,seeds=0")  # was: the suite's default seeds
    for field, value, match in (
        ("sparsities", (0.9, 0.9), "must differ in their whole percent, got \\(0.9, 0.9\\)"),
        ("sparsities", (0.875, 0.885), "must differ in their whole percent"),  # both _s88_
        ("methods", ("dense", "rigl", "rigl"), "name rigl more than once"),
        ("goal_methods", ("static_diagonals",), "name static_diagonals more than once"),
    ):
        bad = _config("models=mlp")
        with bad.unlocked():
            bad.models.mlp[field] = value
        with pytest.raises(common.ConfigError, match=f"models.mlp.*{match}"):
            results.prepare(bad)
    with pytest.raises(common.ConfigError, match="--suite names no suite"):
        results.selected_suites(config, [])
    with pytest.raises(common.ConfigError, match="--suite=all stands alone"):
        results.selected_suites(config, ["all", "mlp"])


def test_diverged_runs_count_and_are_marked_and_the_header_says_the_seeds_run(tmp_path):
    config = _config("models=mlp,sparsities=0.8")  # the goal sparsity (90%) is not trained
    with config.unlocked():
        config.models.mlp.sweep_seeds = 2
    records, timings = _records_and_timings()
    records = [r for r in records if r["sparsity"] in (0.0, 0.8) and r["seed"] < 2]
    for r in records:
        r["loss"] = 0.3
    diverged = next(r for r in records if r["method"] == "rigl")
    diverged.update(loss=float("nan"), accuracy=0.1)
    text = results_report.write(tmp_path, config, records, timings, data_name="t").read_text()
    assert "batch 128; 2 seeds. Sparse layers" in text  # not "3 seeds at 90% and for dense"
    assert "| RigL | 49.55 ± 55.93 (2, 1 diverged) |" in text
    assert "1 run diverged (a final evaluation loss that is not finite)" in text
    assert "| SET | 88.55 ± 0.07 (2) |" in text
    cores = timings["machine"]["cores_visible"]
    assert f"({cores} cores: above {cores}, other programs" in text


def test_a_record_after_a_torn_last_line_is_kept(tmp_path):
    path = tmp_path / "accuracy.jsonl"
    path.write_text('{"a": 1}\n{"torn": ')  # a kill mid-write
    T.append_jsonl(path, {"b": np.float32(2.5), "c": (1, 2)})
    T.append_jsonl(path, {"d": 3})
    assert list(T.read_jsonl(path)) == [{"a": 1}, {"b": 2.5, "c": [1, 2]}, {"d": 3}]


def test_the_wikitext_corpus_takes_its_path_and_the_path_is_recipe(tmp_path):
    """``data.corpus=wikitext`` was accepted, but the config had no key for its directory."""
    for split in ("train", "valid"):
        (tmp_path / f"wiki.{split}.raw").write_text(f" = {split} = \n" * 4000)
    config = _config("quick,models=gpt")
    fp = results.fingerprint(config, "gpt", "dense", 10)
    with config.unlocked():
        config.data.update(corpus="wikitext", path=str(tmp_path))
    assert results.prepare(config).corpus.name == f"wikitext ({tmp_path})"
    assert results.fingerprint(config, "gpt", "dense", 10) != fp
    with config.unlocked():
        config.data.update(corpus="auto", path="")
    assert results.fingerprint(config, "gpt", "dense", 10) == fp  # runs before the key


def test_retiming_a_suite_drops_its_old_clean_runs():
    """--timing_only of a suite with no run at the goal sparsity kept its old clean runs under
    the new recipe, so the report judged the search-cost goals on them."""
    old = {
        "models": {"mlp": {"0.9": 1}, "vit": {"0.9": 2}},
        "clean_runs": {"mlp": {"old": 1}, "vit": {"kept": 2}},
        "recipes": {"mlp": "a", "vit": "b"},
    }
    merged = results.merge_timings(old, {"models": {"mlp": {"0.8": 3}}}, {}, {"mlp": "c"})
    assert merged["models"] == {"mlp": {"0.8": 3}, "vit": {"0.9": 2}}
    assert merged["clean_runs"] == {"vit": {"kept": 2}}
    assert merged["recipes"] == {"mlp": "c", "vit": "b"}
    fresh = results.merge_timings(None, {"models": {"mlp": {}}}, {"mlp": {"new": 0}}, {"mlp": "c"})
    assert fresh["clean_runs"] == {"mlp": {"new": 0}}


def test_goal_sparsity_is_checked_and_the_clean_runs_train_at_it():
    """goal_sparsity=1.5 passed (a report headed "Goals at 150% sparsity"); the clean runs were
    at 90% whatever the goal, and judged the 80% goals."""
    config = _config("quick,models=mlp,sparsities=0.8+0.9")
    with config.unlocked():
        config.goal_sparsity = 1.5
    with pytest.raises(common.ConfigError, match=r"goal_sparsity must be in \(0, 1\), got 1.5"):
        results.prepare(config)
    with config.unlocked():
        config.goal_sparsity = 0.8
    assert results.clean_specs(config, ["mlp"]) == [
        ("mlp", "dense", 0.0, 0),
        ("mlp", "static_diagonals", 0.8, 0),
        ("mlp", "dynadiag", 0.8, 0),
    ]
    with config.unlocked():
        config.goal_sparsity = 0.7  # no run of the suite at it: no clean runs
    assert results.clean_specs(config, ["mlp"]) == []


def test_static_diagonals_of_another_block_size_do_not_reuse_element_runs():
    """Its fingerprint took the block size from the method's name only, so
    dynadiag.block_size=16 reused the element-diagonal runs as blocks."""
    config = _config("quick,models=mlp")
    before = results.fingerprint(config, "mlp", "static_diagonals", 10)
    with config.unlocked():
        config.models.mlp.dynadiag.block_size = 16
    assert results.fingerprint(config, "mlp", "static_diagonals", 10) != before
    with config.unlocked():
        config.models.mlp.dynadiag.block_size = 1
    assert results.fingerprint(config, "mlp", "static_diagonals", 10) == before


def test_a_diverged_language_model_ranks_last_whatever_the_order():
    """A NaN loss gave a NaN perplexity, and min(nan, x) is nan but min(x, nan) is x: the GPT
    goal was met or missed by which baseline diverged."""
    summary = T.LanguageModeling.summarise({"loss": float("nan"), "count": 4})
    assert summary["perplexity"] == summary["bits_per_token"] == float("inf")
    verdicts = set()
    for diverged in ("rigl", "set"):
        records = [
            {"model": "gpt", "method": m, "sparsity": 0.9, "perplexity": v}
            for m, v in (("dynadiag", 6.0), ("rigl", 6.1), ("set", 6.2))
        ]
        records.append(
            {"model": "gpt", "method": diverged, "sparsity": 0.9, "perplexity": float("nan")}
        )
        stats = results_report.metric_stats(records, "perplexity")
        assert stats[("gpt", diverged, 0.9)][0] == float("inf")
        line = results_report.gpt_goals(stats)[0]
        verdicts.add(line.split("**")[1])
    assert verdicts == {"met"}  # a diverged baseline's mean is inf: the other one is the best


def test_plot_labels_keep_a_permutation_apart_and_block_rows_follow_the_records():
    """The speed plot labelled "diagonal" and "diagonal_perm" both "Diagonal"; a one-suite
    report listed n/a block rows of every other suite."""
    assert results_report.speed_label("diagonal") != results_report.speed_label("diagonal_perm")
    assert results_report.speed_label("diagonal_b16_perm").endswith(", input permutation")
    assert "(" not in results_report.speed_label("diagonal_b16")
    config = _config("quick,models=mlp+vit")
    records, timings = _records_and_timings()
    stats = results_report.metric_stats(records)
    rows = results_report.block_table(config, records, stats, {}, timings)
    assert rows[2:] and all(row.startswith("| mlp |") for row in rows[2:]), rows


def test_timings_of_another_recipe_or_an_unreadable_file_are_not_reported(tmp_path):
    config = _config("models=mlp")
    data = results.prepare(config)
    records, timings = _records_and_timings()
    recipe = results.timing_recipe(config, "mlp", data)
    timings["recipes"] = {"mlp": recipe}
    assert results.stale_timings(config, data, timings) == []
    with config.unlocked():
        config.models.mlp.seeds = 5  # how many runs train: the timings still hold
    assert results.timing_recipe(config, "mlp", data) == recipe
    with config.unlocked():
        config.models.mlp.batch_size = 64
    assert results.stale_timings(config, data, timings) == ["mlp"]
    del timings["recipes"]  # taken before the recipes were recorded
    assert results.stale_timings(config, data, timings) == ["mlp"]
    results.write_timings(tmp_path, timings)
    assert results.read_timings(tmp_path) == json.loads(json.dumps(timings))
    (tmp_path / results.SPEED_FILE).write_text('{"models": {"mlp": ')
    with pytest.raises(common.ConfigError, match="speed.json cannot be read .*--timing_only"):
        results.read_timings(tmp_path)


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
                        "cpu_seconds": 15.0,
                        "load_average": [1.0, 3.0],
                        "density": 1 - s,
                        "step_time_s": 0.002,
                    }
                )
        # At 90%: element diagonals 88.60, b = 8 88.20, b = 16 88.00 (mean over seeds).
        for method, a in (("dynadiag_b8", 0.881), ("dynadiag_b16", 0.879)):
            records.append(
                {
                    "model": "mlp",
                    "method": method,
                    "sparsity": 0.9,
                    "seed": seed,
                    "accuracy": a + 0.001 * seed,
                    "seconds": 10.0,
                    "density": 0.125,
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
    timings["models"]["mlp"]["0.9"] = {**group, "diagonal_b16": {"train": 5e-4, "infer_b1": 4e-5}}
    # runs that compiled every program first: their logged phase times judge the search's cost
    timings["clean_runs"] = {
        "mlp": {
            "static_diagonals": {"step_time_s": 1e-3, "repeats": 3},
            "dynadiag": {"search_step_time_s": 1.2e-3, "frozen_step_time_s": 1.05e-3, "repeats": 3},
        }
    }
    return records, timings


def _transformer_records():
    """ViT (3 seeds) and GPT (2 seeds) at 90%: DynaDiag 0.1 points under RigL, 0.5 over static
    diagonals (spread 0.1), blocks 0.3 under; GPT perplexity 1% above SET's, blocks 3% above
    element diagonals."""
    records = []
    vit = {
        "dense": 0.88,
        "dynadiag": 0.861,
        "static_diagonals": 0.856,
        "rigl": 0.862,
        "set": 0.86,
        "dynadiag_b16": 0.858,
    }
    for seed in range(3):
        for method, a in vit.items():
            records.append(
                {
                    "model": "vit",
                    "method": method,
                    "sparsity": 0.0 if method == "dense" else 0.9,
                    "seed": seed,
                    "accuracy": a + 0.001 * (seed - 1),
                    "seconds": 60.0,
                    "steps": 100,
                    "density": 1.0 if method == "dense" else 0.1,
                    # the training loss every 10 steps, drawn in results_vit_loss.png
                    "loss_curve": [[step, 2.3 / (1 + step / 50) + a] for step in range(0, 101, 10)],
                }
            )
    gpt = {
        "dense": 5.0,
        "dynadiag": 6.06,
        "static_diagonals": 6.5,
        "rigl": 6.1,
        "set": 6.0,
        "dynadiag_b16": 6.06 * 1.03,
    }
    for seed in range(2):
        for method, ppl in gpt.items():
            records.append(
                {
                    "model": "gpt",
                    "method": method,
                    "sparsity": 0.0 if method == "dense" else 0.9,
                    "seed": seed,
                    "perplexity": ppl,
                    "bits_per_byte": float(np.log2(ppl)),
                    "seconds": 40.0,
                    "steps": 200,
                    "density": 1.0 if method == "dense" else 0.1,
                    "curve": [[100, 3.5], [200, float(np.log2(ppl))]],
                }
            )
    return records


def test_the_freeze_line_is_at_dynadiag_s_own_freeze_beside_longer_lora_runs():
    config = _config("models=gpt")
    records = _transformer_records()
    fraction = float(config.models.gpt.dynadiag.search_fraction)
    freeze = dd.schedules.freeze_step(200, search_fraction=fraction)
    records.append(
        {
            "model": "gpt",
            "method": "dynadiag_lorafa_r8",
            "sparsity": 0.9,
            "steps": 250,
            "lora_steps": 50,
        }
    )
    assert results_report.dynadiag_freeze(config, records, "gpt", 0.9) == freeze
    assert results_report.dynadiag_freeze(config, records, "gpt", 0.8) is None


def test_report_tables_goals_plots_and_kept_notes(tmp_path):
    config = _config("models=mlp+vit+gpt")
    records, timings = _records_and_timings()
    records += _transformer_records()
    path = results_report.write(tmp_path, config, records, timings, data_name="test")
    text = path.read_text()
    assert "| DynaDiag | 89.60 ± 0.10 (3) | 88.60 ± 0.10 (3) | 88.10 ± 0.10 (3) |" in text
    assert "| DynaDiag, blocks 16x16 | n/a | 88.00 ± 0.10 (3) | n/a |" in text
    assert (
        "DynaDiag within 1 point of dense: **missed** (dense 90.10%, DynaDiag 88.60%, gap +1.50"
        in text
    )
    assert "at least as accurate as SET and RigL: **met**" in text
    assert "Faster training step than dense" in text and "**met** (0.50×" in text
    assert (
        "mlp: search step at most 1.3x the frozen step: **met** (1.14x, the fastest of 3 runs "
        "for each phase's logged mean, every program compiled before the second step)" in text
    )
    assert (
        "mlp: logged step after the freeze within 10% of static diagonals': **met** (1.05x)" in text
    )
    assert "over whole runs, search phase included, 1.00×" in text
    # The whole-run goal shows static diagonals' run beside it: the floor of any search.
    assert (
        "mlp: whole DynaDiag run at most 0.6x dense (wall time, compilation included): "
        "**missed** (1.00x; logged steps 1.00x; static diagonals, no search: 1.00x)" in text
    )
    assert (
        "| 90% | Diagonal (DynaDiag frozen, static diagonals) | 1.000 | 0.50 | 0.100 | 0.50 |"
        in text
    )
    assert "| 90% | Block diagonals 16x16 (DynaDiag frozen) | 0.500 | 0.25 | 0.040 | 0.20 |" in text
    # Blocks of 16 trail element diagonals by 0.6 points (goal: 0.5); b = 8 has no goal line.
    assert "mlp: blocks 16x16 within 0.5 points of element diagonals: **missed**" in text
    assert "(88.00 ± 0.10% against 88.60 ± 0.10%, -0.60 points)" in text
    assert "mlp: blocks 8x8 within" not in text
    assert "| mlp | DynaDiag, blocks 16x16 | 88.00 ± 0.10 (3) | 12.50% | 0.25× | 0.20× |" in text
    # The ViT goals: against RigL/SET and against static diagonals.
    assert "ViT: DynaDiag at least max(RigL, SET) - 0.2 points: **met**" in text
    assert "better than static random diagonals by more than the seed spread: **met**" in text
    assert "+0.50 points against a spread of 0.10" in text
    assert (
        "GPT: DynaDiag's validation perplexity within 2% of the better of RigL and SET: "
        "**met** (DynaDiag 6.060, RigL 6.100, SET 6.000; +1.00%)" in text
    )
    assert "vit: blocks 16x16 within 0.5 points of element diagonals: **met**" in text
    assert "gpt: blocks 16x16 within 2% of element diagonals' perplexity: **missed**" in text
    assert "| DynaDiag | n/a | 6.060 ± 0.000 (2) | n/a |" in text
    assert "| Dense | 10 s (1.00×; CPU 1.00×) |" in text and "range 1.0-3.0" in text
    assert "![ViT training loss vs step](results_vit_loss.png)" in text
    for name in results_report.PLOTS.values():
        assert (tmp_path / name).stat().st_size > 0
    path.write_text(
        text.replace("<!-- notes -->\n", "<!-- notes -->\nWhy: hand-written analysis.\n")
    )
    results_report.write(tmp_path, config, records, timings, data_name="test")
    assert "Why: hand-written analysis." in path.read_text()


def test_resumed_runs_are_left_out_of_whole_run_times():
    """A resumed run's seconds count from its last start: one interrupted DynaDiag run turned
    the MLP's whole-run goal from missed (2.05x) to met (0.39x)."""
    config = _config("models=mlp")
    records, timings = _records_and_timings()
    mlp = [r for r in records if r["model"] == "mlp"]
    dynadiag = [r for r in mlp if (r["method"], r["sparsity"]) == ("dynadiag", 0.9)]
    whole = "mlp: whole DynaDiag run at most 0.6x dense (wall time, compilation included): "
    goals = results_report.search_goals(config, {}, {}, mlp)
    assert any(line.startswith(f"- {whole}**missed** (1.00x") for line in goals), goals
    dynadiag[0].update(resumed_at=48, seconds=1.0)  # this start's seconds only
    goals = results_report.search_goals(config, {}, {}, mlp)
    line = next(x for x in goals if whole in x)
    assert "**missed** (1.00x" in line and "1 resumed runs left out" in line
    table = results_report.whole_run_table(mlp, "mlp", ["dense", "dynadiag"], [0.9], 2)
    assert "Resumed runs are left out; 1 resumed runs left out." in table
    for r in dynadiag:
        r["resumed_at"] = 48
    goals = results_report.search_goals(config, {}, {}, mlp)
    assert any("whole DynaDiag run against dense: not measured" in x for x in goals), goals


def test_a_search_too_short_to_log_is_said_not_measured():
    config = _config("models=mlp")
    records, _ = _records_and_timings()
    mlp = [r for r in records if r["model"] == "mlp"]
    for r in mlp:
        if r["method"] == "dynadiag":
            r.update(search_step_time_s=None, frozen_step_time_s=1e-3)  # quick: 46 search steps
    goals = results_report.search_goals(config, {}, {}, mlp)
    assert "- mlp: search step at most 1.3x the frozen step: not measured" in "\n".join(goals)


def test_quick_keeps_the_seeds_it_is_given():
    assert {m.seeds for m in results_config.get_config("quick").models.values()} == {1}
    assert {m.seeds for m in results_config.get_config("quick,seeds=2").models.values()} == {2}


def test_permutation_goals_compare_learned_with_the_baselines_and_the_random_permutation():
    config = _config("models=mlp+gpt")
    stats = {
        ("mlp", "rigl", 0.9): (0.870, 0.002, 3),
        ("mlp", "set", 0.9): (0.872, 0.002, 3),
        ("mlp", "dynadiag_learned_perm", 0.9): (0.875, 0.001, 3),
        ("mlp", "dynadiag_random_perm", 0.9): (0.873, 0.003, 3),
        # at 80% the learned one wins by more than the spread; 95% has one seed: no spread
        ("mlp", "dynadiag_learned_perm", 0.8): (0.890, 0.001, 3),
        ("mlp", "dynadiag_random_perm", 0.8): (0.880, 0.002, 3),
        ("mlp", "dynadiag_learned_perm", 0.95): (0.870, 0.0, 1),
        ("mlp", "dynadiag_random_perm", 0.95): (0.860, 0.0, 1),
    }
    ppl = {
        ("gpt", "dynadiag", 0.9): (10.0, 0.1, 2),
        ("gpt", "dynadiag_b16_learned_perm", 0.9): (10.5, 0.2, 2),
        ("gpt", "dynadiag_b16_random_perm", 0.9): (10.2, 0.3, 2),
    }
    lines = results_report.permutation_goals(config, stats, ppl)
    assert lines == [
        "- mlp: DynaDiag + learned permutation at least max(RigL, SET): **met** "
        "(87.50 ± 0.10% against 87.20%).",
        "- mlp: DynaDiag with a learned permutation better than with a random one by more than "
        "the seed spread somewhere: **met** (90%: 87.500 against 87.300, spread 0.300 points; "
        "80%: 89.000 against 88.000, spread 0.200 points).",
        "- gpt: blocks 16x16 + learned permutation within 2% of element diagonals' perplexity: "
        "**missed** (10.500 against 10.000, +5.00%).",
        "- gpt: DynaDiag, blocks 16x16 with a learned permutation better than with a random one "
        "by more than the seed spread somewhere: **missed** (90%: 10.500 against 10.200, "
        "spread 0.300).",
    ]
    assert results_report.permutation_goals(config, {}, {}) == []


def test_control_lines_compare_each_selection_with_its_fixed_layout():
    config = _config("models=mlp+gpt")
    stats = {
        ("mlp", "dynadiag", 0.9): (0.875, 0.001, 3),
        ("mlp", "static_diagonals", 0.9): (0.874, 0.002, 3),
        ("mlp", "static_unstructured", 0.9): (0.871, 0.002, 3),
        ("mlp", "set", 0.9): (0.876, 0.002, 3),
        ("mlp", "mest", 0.9): (0.880, 0.002, 3),
    }
    ppl = {
        ("gpt", "dynadiag", 0.9): (10.0, 0.1, 2),
        ("gpt", "static_diagonals", 0.9): (10.2, 0.1, 2),
        ("gpt", "static_unstructured", 0.9): (10.1, 0.1, 2),
        ("gpt", "rigl", 0.9): (10.3, 0.1, 2),
    }
    assert results_report.control_lines(config, stats, ppl) == [
        "- mlp: over the fixed control (points; DynaDiag against static diagonals, the others "
        "against the static unstructured mask): DynaDiag +0.10, SET +0.50, MEST +0.90. Static "
        "diagonals against the static unstructured mask: +0.30.",
        "- gpt: over the fixed control (perplexity; DynaDiag against static diagonals, the "
        "others against the static unstructured mask): DynaDiag -0.20, RigL +0.20. Static "
        "diagonals against the static unstructured mask: +0.10.",
    ]
    assert results_report.control_lines(config, {}, {}) == []
    records = [
        {"model": "mlp", "method": m, "sparsity": 0.9, "seed": seed, "accuracy": a}
        for m, accs in (
            ("dynadiag", (0.876, 0.874, 0.875)),
            ("static_diagonals", (0.873, 0.875, 0.874)),
        )
        for seed, a in enumerate(accs)
    ] + [
        {"model": "gpt", "method": m, "sparsity": 0.9, "seed": seed, "perplexity": p}
        for m, ppls in (("dynadiag", (9.9, 10.1)), ("static_diagonals", (10.1, 10.3)))
        for seed, p in enumerate(ppls)
    ]
    lines = results_report.control_lines(config, stats, ppl, records=records)
    # seed by seed: +0.3, -0.1, +0.1 points; -0.2, -0.2 perplexity (lower is better)
    assert "DynaDiag +0.10 (by seed +0.10 ± 0.20, better in 2 of 3), SET +0.50, MEST" in lines[0]
    assert "DynaDiag -0.20 (by seed -0.20 ± 0.00, better in 2 of 2), RigL +0.20." in lines[1]


def test_paired_difference_reads_the_seeds_both_methods_have():
    records = [
        {"model": "vit", "method": "a", "sparsity": 0.9, "seed": 0, "accuracy": 0.80},
        {"model": "vit", "method": "a", "sparsity": 0.9, "seed": 1, "accuracy": 0.82},
        {"model": "vit", "method": "a", "sparsity": 0.9, "seed": 2, "accuracy": 0.90},
        {"model": "vit", "method": "b", "sparsity": 0.9, "seed": 0, "accuracy": 0.81},
        {"model": "vit", "method": "b", "sparsity": 0.9, "seed": 1, "accuracy": 0.80},
        {"model": "vit", "method": "b", "sparsity": 0.95, "seed": 2, "accuracy": 0.50},
        {"model": "mlp", "method": "b", "sparsity": 0.9, "seed": 2, "accuracy": 0.50},
    ]
    mean, std, better, n = results_report.paired_difference(
        records, "vit", "a", "b", 0.9, "accuracy"
    )
    assert (better, n) == (1, 2)  # seed 2 of b is at another sparsity or another suite
    assert mean == pytest.approx(0.005) and std == pytest.approx(np.std([-0.01, 0.02], ddof=1))
    one_seed = [r for r in records if r["seed"] != 1]
    assert results_report.paired_difference(one_seed, "vit", "a", "b", 0.9, "accuracy") is None
    assert results_report.paired_difference(records, "vit", "a", "c", 0.9, "accuracy") is None
    ppl = [
        {"model": "gpt", "method": m, "sparsity": 0.9, "seed": s, "perplexity": v}
        for m, vs in (("a", (9.0, 9.5, 9.0)), ("b", (9.2, 9.4, 9.0)))
        for s, v in enumerate(vs)
    ]
    assert results_report.paired_difference(ppl, "gpt", "a", "b", 0.9, "perplexity")[2:] == (1, 3)


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
        "dense+dynadiag+static_diagonals+rigl+set+mest+static_diagonals_random_perm"
        if HAS_LAYER
        else "dense+rigl+set+mest"
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
        steps = [s for s, _ in r["loss_curve"]]  # every logged interval's mean training loss
        assert steps == sorted(steps) and steps[-1] == r["steps"], r["loss_curve"]
        assert all(np.isfinite(loss) and loss > 0 for _, loss in r["loss_curve"])
        want = 1.0 if r["method"] == "dense" else 0.1
        assert r["density"] == pytest.approx(want, abs=0.002), r
    # the clean runs (fresh processes, 15-20 s each): tests/test_scripts.py, the smoke run
    timings = speed.measure(config, data, progress=False)
    group = timings["models"]["mlp"]["0.9"]
    # a permuted method adds its frozen layers with the permutation
    assert set(group) == {*speed.VARIANTS, *(("diagonal_perm",) if HAS_LAYER else ())}
    assert all(t > 0 for v in group.values() for t in v.values())
    json.dumps(timings)
    path = results_report.write(tmp_path / "docs", config, records, timings, data_name=data.name)
    assert "## Speed" in path.read_text()


def test_clean_runs_keep_the_fastest_repeat_and_every_value():
    # the host's slow spells only add time, so the least of the repeats is the closest to the steps
    runs = {
        ("mlp", "dynadiag"): [
            {"search_step_time_s": None, "frozen_step_time_s": 3.0, "seconds": 9.0},
            {"search_step_time_s": 2.0, "frozen_step_time_s": 1.0, "seconds": 12.0},
        ],
        ("mlp", "dense"): [{"step_time_s": 5.0, "seconds": 7.0}],
    }
    out = results.least_over_repeats(runs, "jemalloc")
    assert out["mlp"]["dynadiag"] == {
        "search_step_time_s": 2.0,
        "search_step_time_s_runs": [2.0],
        "frozen_step_time_s": 1.0,
        "frozen_step_time_s_runs": [3.0, 1.0],
        "seconds": 9.0,
        "seconds_runs": [9.0, 12.0],
        "allocator": "jemalloc",
        "repeats": 2,
    }
    assert out["mlp"]["dense"]["step_time_s"] == 5.0 and out["mlp"]["dense"]["repeats"] == 1
    never = results.least_over_repeats({("mlp", "dynadiag"): [{"search_step_time_s": None}]}, "x")
    assert never["mlp"]["dynadiag"]["search_step_time_s"] is None  # a run too short to log one


def test_clean_runs_save_no_checkpoint_per_epoch(monkeypatch):
    """A results run saves every epoch (resumable); a clean run (``checkpoints=False``) only
    where the loop must, since a save's background write slows the steps after it."""
    config = _config("quick,models=mlp,methods=dense,sparsities=0.9")
    data = results.prepare(config)
    steps = results.steps_of(config.models["mlp"], data)
    built = results.build(config, "mlp", "dense", 0.0, 0, data, steps)
    seen = []
    monkeypatch.setattr(results.T, "train", lambda **kw: seen.append(kw["checkpoint_every"]))
    for checkpoints in (True, False):
        results.train_built(config, data, "mlp", built, 0, steps, None, checkpoints=checkpoints)
    assert seen == [steps // int(config.models["mlp"].epochs), 0]


def test_mean_step_time_leaves_out_intervals_beside_a_save(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [(10, 1.0, 0.0), (20, 1.0, 0.0), (30, 9.0, 1.0), (40, 1.0, 0.0), (50, 5.0, 1.0)]
    records = [{"step": s, "kind": "train", "step_time_s": t, "beside_save": b} for s, t, b in rows]
    records.insert(2, {"step": 20, "kind": "eval", "loss": 1.0})
    records.append({"step": 60, "kind": "train", "step_time_s": 3.0})  # logged before the flag
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert results.mean_step_time(path) == pytest.approx(1.5)  # 1, 1, 1 and 3
    assert results.mean_step_time(path, 20, 40) == pytest.approx(1.0)
    # a range with no interval clear of a save keeps them all
    assert results.mean_step_time(path, 40, 50) == pytest.approx(5.0)
    assert results.mean_step_time(path, 60) is None


@pytest.mark.parametrize("method", baselines.METHODS)
def test_fashion_mnist_script_selects_the_method_by_config(method):
    from train import fashion_mnist
    from train.configs import fashion_mnist as fashion_config

    config = fashion_config.get_config(f"method={method}")
    with config.unlocked():
        config.data.source = "mnist5k"
    _, steps, _, models = fashion_mnist.prepare(config)
    assert list(models) == (["dense"] if method == "dense" else ["dense", f"{method}_s90"])
    run = models[list(models)[-1]]
    assert run.method.name == method and run.dynadiag.sparsity == (
        0.0 if method == "dense" else 0.9
    )
    assert run.phase is None and run.num_steps == steps


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
    with config.unlocked():
        config.unstructured.distribution = "erk"  # the fixed mask reads where its weights go
    after_dist = prints(config)
    assert sorted(m for m in methods if after_drop[m] != after_dist[m]) == [
        "mest",
        "rigl",
        "set",
        "static_unstructured",
    ]
    assert results.fingerprint(config, "mlp", "dense", 200) != after_drop["dense"]


def test_fingerprint_of_block_methods_differs_per_size_and_element_ignores_block_size_one():
    config = _config("models=mlp")
    fp = lambda method: results.fingerprint(config, "mlp", method, 100)  # noqa: E731
    prints = {fp(m) for m in ("dynadiag", "dynadiag_b8", "dynadiag_b16", "static_diagonals_b16")}
    assert len(prints) == 4
    element = fp("dynadiag")
    with config.unlocked():
        config.models.mlp.dynadiag.block_size = 1
    assert fp("dynadiag") == element


def test_fingerprint_of_runs_without_a_working_set_hashes_as_before_it_existed():
    config = _config("models=mlp")
    fp = lambda: results.fingerprint(config, "mlp", "dynadiag", 100)  # noqa: E731
    before = fp()
    with config.unlocked():
        section = config.models.mlp.dynadiag
        section.working_set_refresh, section.working_set_start = 7, 0.3  # read only when on
    assert fp() == before
    with config.unlocked():
        del section["working_set"], section["working_set_refresh"], section["working_set_start"]
    assert fp() == before  # off is the section without the keys
    with config.unlocked():
        section.working_set, section.working_set_refresh, section.working_set_start = 1.25, 20, 0.1
    on = fp()
    with config.unlocked():
        section.working_set_refresh = 10
    assert len({before, on, fp()}) == 3


def test_fingerprint_of_permutations_and_runs_without_one_hash_as_before():
    config = _config("models=mlp")
    methods = baselines.METHODS
    fp = lambda method: results.fingerprint(config, "mlp", method, 100)  # noqa: E731
    before = {m: fp(m) for m in methods}
    with config.unlocked():
        section = config.models.mlp.dynadiag
        del section["permutation"], section["permutation_penalty"], section["permutation_start"]
        del section["permutation_relaxation"]
    assert {m: fp(m) for m in methods} == before  # "none" is the section without the keys
    with config.unlocked():
        section.permutation, section.permutation_penalty = "random", 1e-3
    random = {m: fp(m) for m in methods}
    assert sorted(m for m in methods if random[m] != before[m]) == ["dynadiag", "static_diagonals"]
    with config.unlocked():
        # only a learned permutation reads them
        section.permutation_penalty, section.permutation_start = 0.5, "uniform"
    assert fp("dynadiag") == random["dynadiag"]
    with config.unlocked():
        section.permutation = "learned"
    uniform = fp("dynadiag")
    with config.unlocked():
        section.permutation_start = "random"
    learned = fp("dynadiag")
    assert learned != uniform
    with config.unlocked():
        section.permutation_penalty = 1e-3
    assert len({learned, fp("dynadiag"), random["dynadiag"], before["dynadiag"]}) == 4
    with config.unlocked():  # the default relaxation hashes as before the key existed
        section.permutation_relaxation = "sinkhorn"
    sinkhorn = fp("dynadiag")
    with config.unlocked():
        del section["permutation_relaxation"]
    assert fp("dynadiag") == sinkhorn
    with config.unlocked():
        section.permutation_relaxation = "blocks"
    assert fp("dynadiag") != sinkhorn
    with config.unlocked():
        section.permutation = "random"
    assert fp("dynadiag") == random["dynadiag"]  # only a learned permutation reads it


@pytest.mark.skipif(not HAS_LAYER, reason="needs dynadiag_jax.nn")
def test_rows_moved_compares_the_frozen_perm_with_the_soft_start():
    from dynadiag_jax.nn import permutation as perms

    n = 10
    soft = perms.init_soft(jax.random.key(3), (n, n))
    drawn = np.asarray(perms.random_permutation(jax.random.split(jax.random.key(3))[1], n))
    start = results.start_permutations({"a": {"perm_soft": soft, "values": jnp.ones((4, 2))}})
    assert list(start) == ["a"]
    np.testing.assert_array_equal(start["a"], drawn)  # the random start's permutation
    frozen = drawn.copy()
    frozen[[0, 1]] = frozen[[1, 0]]
    assert results.rows_moved(start, {"a": {"perm": frozen}}) == {"a": pytest.approx(0.2)}
    assert results.rows_moved(start, {"a": {"perm": drawn, "offsets": [0]}}) == {"a": 0.0}
    with pytest.raises(ValueError, match="no frozen perm for the learned layers"):
        results.rows_moved(start, {"b": {"perm": drawn}})
    # the "blocks" relaxation: its base permutation in the diagonals, then each block's
    blocks = perms.init_block_soft(jax.random.key(4), (2, 5, 5))
    base = np.asarray(perms.random_permutation(jax.random.key(5), n))
    start = results.start_permutations({"a": {"perm_soft": blocks}}, {"a": {"perm": base}})
    np.testing.assert_array_equal(start["a"], base)  # each block starts on its identity


@pytest.mark.skipif(not HAS_LAYER, reason="needs dynadiag_jax.nn")
@pytest.mark.parametrize("relaxation", ["sinkhorn", "blocks"])
def test_a_learned_permutation_run_records_the_rows_it_moved(tmp_path, relaxation):
    config = _config("quick,models=mlp,methods=dynadiag_learned_perm,sparsities=0.9")
    with config.unlocked():
        config.models.mlp.dynadiag.permutation_relaxation = relaxation
    data = results.prepare(config)
    (spec,) = results.run_plan(config)
    steps = results.steps_of(config.models.mlp, data)
    fp = results.fingerprint(config, "mlp", spec[1], steps)
    record = results.train_run(config, data, spec, steps, tmp_path, fp)
    moved = record["perm_rows_moved"]
    assert set(moved) == {"hidden_0", "hidden_1"}
    assert all(0.0 <= v <= 1.0 for v in moved.values())
    json.dumps(record)
    lines = results_report.permutation_moves(config, [record, dict(record, sparsity=0.8)])
    mean = 100 * np.mean(list(moved.values()))
    assert lines == [
        f"- mlp: rows the learned permutation moved from its random start: DynaDiag "
        f"{mean:.1f}% (largest layer {100 * max(moved.values()):.1f}%, 2 runs)."
    ]
    other = dict(record, method="dynadiag_random_perm")
    assert results_report.permutation_moves(config, [other]) == []


@pytest.mark.parametrize("method", ["dynadiag", "static_diagonals"])
@pytest.mark.parametrize("permutation", ["random", "learned", "none"])
def test_dynadiag_permutation_reaches_every_sparse_layer(method, permutation):
    config = _config("models=mlp")
    m = config.models.mlp
    with config.unlocked():
        m.dynadiag.permutation = permutation

    if method == "static_diagonals" and permutation == "learned":
        with pytest.raises(common.ConfigError, match="permutation='random'"):
            _build(config, method)
        return
    built = _build(config, method)
    x = jnp.ones((2, 28, 28, 1), jnp.float32)
    variables = jax.eval_shape(lambda: built.model.init(jax.random.key(0), x))
    layers = dict(variables["diagonals"])
    assert layers
    for name, entry in layers.items():
        assert ("perm" in entry) == (permutation == "random"), name
        has_soft = "perm_soft" in variables["params"][name]
        assert has_soft == (permutation == "learned"), name


def test_a_bad_dynadiag_permutation_is_a_config_error():
    config = _config("models=mlp")
    with config.unlocked():
        config.models.mlp.dynadiag.permutation = "shuffled"
    with pytest.raises(
        common.ConfigError, match="dynadiag.permutation must be one of none, random"
    ):
        common.sparse_layer(config.models.mlp.dynadiag)


@pytest.mark.slow
def test_end_to_end_tiny_transformer_suites(tmp_path, run_python):
    """The ViT and GPT suites shrunk to the ``mu`` models: records, curves, timings, report."""
    config = _config("quick,models=vit+gpt,methods=dense+dynadiag+rigl,sparsities=0.9")
    with config.unlocked():
        config.data.corpus = "stdlib"
        config.models.vit.model.variant = "mu/7"
        gpt = config.models.gpt
        gpt.model.variant, gpt.seq_len, gpt.batch_size, gpt.steps = "mu", 16, 8, 30
        gpt.eval_windows, gpt.eval_batch_size, gpt.eval_every = 16, 8, 10
        gpt.optimizer.warmup_steps = 5
    data = results.prepare(config)
    assert data.corpus.name.startswith("stdlib")
    records = []
    for spec in results.run_plan(config, ["gpt"]):
        steps = results.steps_of(config.models[spec[0]], data)
        fp = results.fingerprint(config, spec[0], spec[1], steps)
        records.append(results.train_run(config, data, spec, steps, tmp_path / spec[1], fp))
    assert [r["method"] for r in records] == ["dense", "dynadiag", "rigl"]
    for r in records:
        assert r["bits_per_byte"] == pytest.approx(np.log2(r["perplexity"]))
        assert [s for s, _ in r["curve"]] == [10, 20, 30]
        assert r["curve"][-1][1] == pytest.approx(r["bits_per_byte"])
        assert r["density"] == pytest.approx(1.0 if r["method"] == "dense" else 0.1, abs=0.01)
    # bench/coverage.py reads the frozen layers of the runs' last checkpoints.
    cov = tmp_path / "coverage.csv"
    script = pathlib.Path(__file__).resolve().parents[1] / "bench" / "coverage.py"
    proc = run_python([str(script), str(tmp_path / "dynadiag"), "--out", str(cov)])
    assert "all layers: empty output rows" in proc.stdout, proc.stdout
    with open(cov) as fh:
        layers = list(csv.DictReader(fh))
    depth, width = dd.models.gpt2.SIZES["mu"].depth, dd.models.gpt2.SIZES["mu"].width
    assert len(layers) == 4 * depth
    qkv = [r for r in layers if r["layer"].endswith("attn/c_attn")]
    assert [(int(r["in"]), int(r["out"])) for r in qkv] == [(width, 3 * width)] * depth
    assert all(0 <= int(r["empty_rows"]) <= int(r["out"]) for r in layers)
    timings = speed.measure(config, data, ["gpt"], progress=False)
    assert set(timings["models"]["gpt"]["0.9"]["dense"]) == {"train", "infer_b1", "infer_b8"}
    path = results_report.write(tmp_path / "docs", config, records, timings, data_name=data.name)
    text = path.read_text()
    assert "### gpt: byte-level GPT" in text and "Validation bits per byte:" in text
    assert (tmp_path / "docs" / results_report.PLOTS["curves"]).stat().st_size > 0


def test_sparse_update_scale_is_the_init_gain_of_sparse_weights_only():
    config = _config()
    opt = config.models.mlp.optimizer
    assert opt.sparse_lr_scale == "init_gain"
    assert baselines.sparse_update_scale("set", opt, "sparse", 0.9) == pytest.approx(10**0.5)
    assert baselines.sparse_update_scale("dynadiag", opt, "sparse", 0.75) == pytest.approx(2.0)
    assert baselines.sparse_update_scale("dynadiag", opt, "dense", 0.9) == 1.0
    assert baselines.sparse_update_scale("dense", opt, "sparse", 0.9) == 1.0
    with config.unlocked():
        opt.sparse_lr_scale = "none"
    assert baselines.sparse_update_scale("dynadiag", opt, "sparse", 0.9) == 1.0
    with config.unlocked():
        opt.sparse_lr_scale = "fan_in"
    with pytest.raises(common.ConfigError, match="sparse_lr_scale must be one of"):
        baselines.sparse_update_scale("dynadiag", opt, "sparse", 0.9)


@pytest.mark.skipif(not HAS_LAYER, reason="needs dynadiag_jax.nn")
@pytest.mark.parametrize("method", ["dynadiag", "static_diagonals", "set"])
def test_init_gain_scales_the_sparse_weights_updates_and_nothing_else(method):
    config = _config()
    data = results.prepare(config)
    m = config.models.mlp
    steps = results.steps_of(m, data)

    def first_update(mode):
        with config.unlocked():
            m.optimizer.sparse_lr_scale = mode
        built = results.build(config, "mlp", method, 0.9, 0, data, steps)
        state = results.initial_state(built, results.example_input(m, data), 0)
        grads = jax.tree.map(
            lambda p: jnp.cos(jnp.arange(p.size, dtype=p.dtype)).reshape(p.shape), state.params
        )
        with jax.numpy_dtype_promotion("standard"):  # optax's bias correction mixes dtypes
            opt_state = built.optimizer.init(state.params)
            updates, _ = built.optimizer.update(grads, opt_state, state.params)
        return {"/".join(k): np.asarray(v) for k, v in flax_flat(updates).items()}

    plain, scaled = first_update("none"), first_update("init_gain")
    weight = "kernel" if method == "set" else "values"
    sparse = {k for k in plain if k.startswith("hidden_") and k.endswith(f"/{weight}")}
    assert sparse == {f"hidden_0/{weight}", f"hidden_1/{weight}"}
    for k in plain:
        want = plain[k] * (10**0.5 if k in sparse else 1.0)
        np.testing.assert_allclose(scaled[k], want, rtol=1e-5, atol=1e-12, err_msg=k)


def flax_flat(tree):
    from flax import traverse_util  # noqa: PLC0415

    return traverse_util.flatten_dict(tree)


def test_fingerprint_of_sparse_lr_scale_none_hashes_as_before_it_existed():
    config = _config("models=mlp")
    fp = lambda: results.fingerprint(config, "mlp", "dynadiag", 100)  # noqa: E731
    default = fp()
    with config.unlocked():
        config.models.mlp.optimizer.sparse_lr_scale = "none"
    before = fp()
    assert before != default
    with config.unlocked():
        del config.models.mlp.optimizer["sparse_lr_scale"]
    assert fp() == before


def test_contradicting_mode_flags_are_refused(run_python, tmp_path):
    """--timing_only --report_only ran as --report_only ("speed.json is missing: run with
    --timing_only first"); --timing_only --notiming timed against the --notiming given."""
    script = pathlib.Path(__file__).resolve().parents[1] / "train" / "results.py"
    run = tmp_path / "run"
    for flags, message in (
        (["--timing_only", "--report_only"], "--report_only and --timing_only exclude each other"),
        (["--timing_only", "--notiming"], "--timing_only and --notiming exclude each other"),
    ):
        proc = run_python([str(script), *flags, f"--workdir={run}"], check=False)
        assert proc.returncode == 2, proc.stderr[-2000:]
        last = proc.stderr.strip().splitlines()[-1]
        assert last.startswith(f"error: {message}"), last
        assert "Traceback" not in proc.stderr and not run.exists()
