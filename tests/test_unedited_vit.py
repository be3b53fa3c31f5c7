"""train/unedited_vit.py: a ViT written with plain linen layers, made diagonal by path rules."""

import json
import re

import jax
import jax.numpy as jnp
import pytest
from flax import traverse_util

import dynadiag_jax as dd
from train import unedited_vit as U
from train.configs import results as results_config

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
