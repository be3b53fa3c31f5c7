"""train/unedited_vit.py: a ViT written with plain linen layers, made diagonal by path rules."""

import json
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from flax import traverse_util

import dynadiag_jax as dd
from dynadiag_jax import training as T
from train import common
from train import results_runs as R
from train import unedited_vit as U
from train.configs import results as results_config

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    not hasattr(dd.nn, "sparsify"), reason="dd.nn.sparsify is not in this checkout"
)


def _config():
    config = results_config.get_config("quick,models=vit")
    with config.unlocked():
        config.data.source = "mnist5k"
        config.models.vit.model.variant = "mu/7"
        config.unstructured.update_every = 10
        config.speed.repeats, config.speed.warmup = 1, 1
    return config


def test_rules_replace_the_attention_projections_and_the_mlp_only():
    config = _config()
    plain = U.plain_vit(config, 10)
    model = dd.nn.sparsify(plain, U.rules(config.models.vit.dynadiag, 0.9))
    x = jnp.zeros((2, 28, 28, 1))
    params = traverse_util.flatten_dict(model.init(jax.random.key(0), x)["params"], sep="/")
    diagonal = sorted({p.rsplit("/", 1)[0] for p in params if p.endswith("/values")})
    dense = sorted({p.rsplit("/", 1)[0] for p in params if p.endswith("/kernel")})
    size = dd.models.vit.SIZES["mu"]
    assert len(diagonal) == 6 * size.depth  # query, key, value, out, and two MLP layers
    assert all(any(re.fullmatch(r, p) for r in U.RULES) for p in diagonal)
    assert dense == ["Conv_0", "head"]
    # the flattened [width] -> [heads, head_dim] projection keeps K = 10% of its diagonals
    query = dd.freeze_tree(model.init(jax.random.key(0), x))["params"]["block_0"]["attention"]
    k = dd.nn.DiagonalDense(size.width, sparsity=0.9).spec(size.width).k
    assert query["query"]["values"].shape == (k, size.width)


def test_trains_both_models_reports_and_resumes(tmp_path, monkeypatch):
    config = _config()
    timed = []

    def time_frozen(*args, measure=U.time_frozen):
        timed.append(measure(*args))
        return timed[-1]

    monkeypatch.setattr(U, "time_frozen", time_frozen)
    text = U.run(config, tmp_path, seeds=1, sparsity=0.9)
    assert set(timed[0]) == {"ours", "plain", "ours dense", "plain dense"}
    records = [json.loads(line) for line in (tmp_path / "accuracy.jsonl").read_text().splitlines()]
    assert [r["variant"] for r in records] == ["ours", "plain"]
    # the trained, frozen PlainViT keeps K diagonals in every replaced layer, as its frozen init
    plain = dd.nn.sparsify(U.plain_vit(config, 10), U.rules(config.models.vit.dynadiag, 0.9))
    init = dd.freeze_tree(plain.init(jax.random.key(0), jnp.zeros((2, 28, 28, 1))))
    frozen = traverse_util.flatten_dict(init["params"], sep="/")
    diagonal = sum(v.size for p, v in frozen.items() if p.endswith("/values"))
    assert records[1]["diagonal_parameters"] == diagonal
    assert records[1]["parameters"] == sum(v.size for v in frozen.values())
    assert all(0.0 < r["accuracy"] <= 1.0 and r["frozen_step_time_s"] > 0 for r in records)
    assert "| ours |" in text and "| plain |" in text and "1.000x |" in text

    def no_training(*args, **kwargs):
        raise AssertionError("a recorded run was trained again")

    monkeypatch.setattr(U, "train_one", no_training)
    monkeypatch.setattr(U, "time_frozen", lambda *a: timed[0])  # four compiles: timed above
    again = U.run(config, tmp_path, seeds=1, sparsity=0.9)
    ours = next(line for line in again.splitlines() if line.startswith("| ours |"))
    assert (
        ours.split("|")[2]
        == next(line for line in text.splitlines() if line.startswith("| ours |")).split("|")[2]
    )


def _recorded_workdir(tmp_path, config, steps, *, record=None, checkpoint=False):
    """A workdir as a run of ``config`` leaves it: a record of the ``ours`` run of seed 0 in
    accuracy.jsonl (``record``: these fields instead), or only its checkpoint (a stand-in state:
    the recipe is checked before the arrays), as an interrupted run leaves it."""
    recipe = U.recipe(config, "ours", 0.9, steps)
    tmp_path.mkdir()
    if checkpoint:
        rng = jax.random.key_data(jax.random.key(0))
        state = T.TrainState(jnp.asarray(7), {"w": jnp.ones(3)}, (), {}, rng)
        ckpt = T.Checkpointer(tmp_path / "ours_s90_seed0" / "checkpoints")
        ckpt.save(state, meta={"run": {**recipe, "seed": 0}, "frozen": False, "interval": {}})
        ckpt.close()
    else:
        if record is None:
            record = {"variant": "ours", "seed": 0, "sparsity": 0.9, "recipe": recipe}
        (tmp_path / "accuracy.jsonl").write_text(json.dumps(record) + "\n")
    return tmp_path


def test_another_recipe_in_the_workdir_is_refused_with_the_settings_that_differ(
    tmp_path, monkeypatch
):
    config = _config()
    with config.unlocked():  # RigL's schedule would not fit in 62 steps: no longer checked
        config.unstructured.update_every = 100
    data = R.prepare(U.trained_config(config, 0.9))
    steps = R.steps_of(config.models.vit, data)
    with pytest.raises(common.ConfigError, match=f"{steps} training steps leave no room"):
        R.prepare(config)  # which plans RigL and SET
    faster = config.copy_and_resolve_references()
    faster.models.vit.optimizer.learning_rate = 0.05

    def no_training(*args, **kwargs):
        raise AssertionError("a run of another recipe was trained or reported")

    monkeypatch.setattr(R, "train_built", no_training)
    monkeypatch.setattr(U, "time_frozen", no_training)
    recorded = _recorded_workdir(tmp_path / "recorded", config, steps)
    with pytest.raises(common.ConfigError) as err:
        U.run(faster, recorded, seeds=1, sparsity=0.9)
    assert "records the ours run of seed 0 with another recipe" in str(err.value)
    assert "optimizer.learning_rate: 0.001 in accuracy.jsonl, 0.05 in this run" in str(err.value)
    old = {"variant": "ours", "seed": 0, "sparsity": 0.9, "accuracy": 0.5}
    unknown = _recorded_workdir(tmp_path / "old", config, steps, record=old)
    with pytest.raises(common.ConfigError, match="without its recipe"):
        U.run(config, unknown, seeds=1, sparsity=0.9)
    interrupted = _recorded_workdir(tmp_path / "interrupted", config, steps, checkpoint=True)
    monkeypatch.undo()  # the checkpoint's recipe is what T.train checks
    with pytest.raises(common.ConfigError) as err:
        U.run(faster, interrupted, seeds=1, sparsity=0.9)
    assert "optimizer.learning_rate: 0.001 in the checkpoint, 0.05 in this run" in str(err.value)
    (tmp_path / "file").write_text("")
    with pytest.raises(common.ConfigError, match="--workdir: .* is a file, not a directory"):
        U.run(config, tmp_path / "file", seeds=1, sparsity=0.9)


def test_script_refuses_to_resume_another_recipe_in_one_message(run_python, tmp_path):
    config = _config()
    data = R.prepare(U.trained_config(config, 0.9))
    workdir = _recorded_workdir(
        tmp_path / "run", config, R.steps_of(config.models.vit, data), checkpoint=True
    )
    proc = run_python(
        [
            str(ROOT / "train" / "unedited_vit.py"),
            "--seeds=1",
            f"--config={ROOT / 'train' / 'configs' / 'results.py'}:quick,models=vit",
            "--config.data.source=mnist5k",
            "--config.models.vit.model.variant=mu/7",
            "--config.models.vit.optimizer.learning_rate=0.05",
            f"--workdir={workdir}",
            "--noprogress",
        ],
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"error: checkpoint {workdir / 'ours_s90_seed0' / 'checkpoints'}/7 was written" in (
        proc.stderr
    )
    assert "optimizer.learning_rate: 0.001 in the checkpoint, 0.05 in this run" in proc.stderr


def test_settings_the_script_does_not_read_are_named():
    """A dynadiag.layers override reached the suite's ViT and not the plain one (two sparsity
    patterns compared), and the config's sparsities trained at --sparsity without a word."""
    assert U.unread_settings(_config()) == []
    config = _config()
    with config.unlocked():
        config.models.vit.dynadiag.layers = (".*/attn/qkv",)
        config.models.vit.sparsities = (0.8,)
    assert U.unread_settings(config) == [
        "models.vit.sparsities",
        "models.vit.dynadiag.layers (the plain ViT's layers are RULES)",
    ]
    config = _config()
    with config.unlocked():
        config.speed.repeats = 0  # a median of nothing: the report printed "nanx"
    with pytest.raises(common.ConfigError, match="speed.repeats must be >= 1, got 0"):
        R.prepare(U.trained_config(config, 0.9))


def test_train_one_passes_the_progress_bar_on(monkeypatch, tmp_path):
    """--progress (the default) shows a bar over each run's steps; it had none."""
    seen = {}

    def train_built(*args, progress=False):
        seen["progress"] = progress
        raise T.CheckpointMismatch("stop here")

    monkeypatch.setattr(R, "train_built", train_built)
    for progress in (True, False):
        with pytest.raises(common.ConfigError, match="stop here"):
            U.train_one(None, None, None, 0, 10, tmp_path, {}, progress=progress)
        assert seen["progress"] is progress
