"""train/lora_fa.py: LoRA-FA fine-tuning of a frozen DynaDiag run's checkpoint."""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from training_helpers import fast_compile  # noqa: F401 - fixture

from dynadiag_jax import training as T
from train import baselines, common, fashion_mnist, finetuning, lm
from train import lora_fa as script
from train.configs import fashion_mnist as fashion_config
from train.configs import gpt2_lm
from train.configs import lora_fa as lora_config
from train.configs import sparsify as sparsify_config

# The scripts run in this process, their programs compiled fast (the tests check behaviour).
pytestmark = pytest.mark.usefixtures("fast_compile")

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "train" / "configs"


@pytest.mark.parametrize("name", ["lora_fa", "sparsify"])
def test_runlocal_fine_tunes_have_no_warm_up_longer_than_them(name):
    # one epoch of the local digits leaves the ViT suite a fine-tune of 6 steps, shorter than
    # its 50 warm-up steps: `runlocal,suite=vit` was refused whatever the checkpoint
    module = {"lora_fa": lora_config, "sparsify": sparsify_config}[name]
    assert module.get_config("checkpoint=/x,suite=vit,runlocal").optimizer.warmup_steps == 0
    assert module.get_config("checkpoint=/x,suite=vit").optimizer.warmup_steps == 50


def test_check_fits_names_the_variables_that_differ():
    template = {"params": {"fc": {"values": jnp.zeros((3, 4))}}}
    script.check_fits(template, {"params": {"fc": {"values": jnp.full((3, 4), 7.0)}}})
    wrong = {"params": {"fc": {"values": jnp.zeros((5, 4))}, "extra": {"kernel": jnp.zeros(2)}}}
    with pytest.raises(common.ConfigError, match=r"params/extra/kernel: \(2,\) in the checkpoint"):
        script.check_fits(template, wrong)
    with pytest.raises(common.ConfigError, match=r"params/fc/values: \(5, 4\) in the checkpoint"):
        script.check_fits(template, wrong)


def test_counts_split_diagonals_adapters_and_trained():
    variables = {
        "params": {
            "fc": {"values": jnp.zeros((3, 4)), "bias": jnp.zeros(4), "lora_b": jnp.zeros((4, 2))},
            "head": {"kernel": jnp.zeros((4, 2)).at[0].set(1.0)},
        },
        "lora_frozen": {"fc": {"lora_a": jnp.zeros((2, 4))}},
        "diagonals": {"fc": {"offsets": jnp.zeros(3, jnp.int32)}},
    }
    got = finetuning.counts(variables, [r".*/lora_b"])
    # non-zero: the head's 2 ones and A counted whole (8)
    assert got == {"diagonal": 12, "adapter": 16, "other": 12, "trained": 8, "nonzero": 10}
    assert finetuning.counts(variables, [r".*/lora_b", r".*/values"])["trained"] == 20


def lora_fa_config(frozen_run, arg="rank=4", **lora):
    """The mnist5k MLP's LoRA-FA config (the frozen run's 64-wide hidden layers)."""
    config = lora_config.get_config(f"runlocal,{arg},checkpoint={frozen_run}")
    config.model.hidden = (64, 64)
    config.lora.update(lora)
    return config


def test_lora_fa_recipe_leaves_out_the_sparse_update_factor_its_phase_never_applies():
    """The phase's optimizer scales no update (finetuning.lora_phase), so two values of
    optimizer.sparse_lr_scale trained the same fine-tune but were refused as two recipes."""
    method = baselines.Method("lora_fa", None, None, None, None, None, ("dynadiag",))
    recipes = []
    for mode in ("init_gain", "none"):
        config = lora_fa_config("runs/x")
        config.optimizer.sparse_lr_scale = mode
        recipes.append(common.recipe(config, method))
    assert recipes[0] == recipes[1] and common.SPARSE_LR_KEY not in recipes[0]
    assert recipes[0]["optimizer.learning_rate"] == config.optimizer.learning_rate
    trained = baselines.Method("dynadiag", None, None, None, None, None, ("dynadiag",))
    assert common.recipe(lora_fa_config("runs/x"), trained)[common.SPARSE_LR_KEY] == "init_gain"


def test_a_run_without_the_phase_leaves_the_lora_section_out_of_its_recipe():
    """fashion_mnist.py's dense comparison run trains no LoRA-FA phase: adding one to the config
    refused to resume it as another recipe."""
    dense = baselines.Method("dense", None, None, None, None, None, ())
    config = fashion_config.get_config()
    without = common.recipe(config, dense, phase=False)
    config.lora.steps = 4
    assert common.recipe(config, dense, phase=False) == without
    assert not any(k.startswith("lora.") for k in without)
    assert common.recipe(config, dense)["lora.steps"] == 4  # a run with the phase keeps it


def test_lora_fa_script_fine_tunes_a_frozen_run(run_python, tmp_path):
    """A frozen mnist5k DynaDiag MLP: the table (before: the run's own final accuracy; the
    weights counted), the adapted checkpoint (B moved, the diagonal layers not), B + values,
    the control without adapters, a rerun that resumes, and a checkpoint of another size refused
    naming the variables."""
    config = fashion_config.get_config("sparsity=0.9,epochs=1")
    config.data.source = "mnist5k"
    config.compare_dense = False
    config.model.hidden = (64, 64)
    fashion_mnist.run(config, tmp_path / "run", progress=False)
    frozen_run = tmp_path / "run" / "dynadiag_s90"
    rows = script.run(lora_fa_config(frozen_run), tmp_path / "b", progress=False)
    table = json.loads((tmp_path / "b" / "lora_fa.json").read_text())
    assert table == rows
    # Run again: it resumes from its own last checkpoint (adapters and B-only optimizer state),
    # the source spelled another way included (it was refused as another recipe).
    script.run(lora_fa_config(f"{frozen_run}/checkpoints/"), tmp_path / "b", progress=False)
    assert json.loads((tmp_path / "b" / "lora_fa.json").read_text()) == table
    with pytest.raises(common.ConfigError, match="--workdir is the checkpoint's own run"):
        script.prepare(lora_fa_config(frozen_run), frozen_run)
    dense = tmp_path / "dense"  # a dense run's recipe: its layers do not fit, and it says why
    shutil.copytree(frozen_run, dense)
    for meta in (dense / "checkpoints").glob("*/meta/metadata"):
        meta.write_text(meta.read_text().replace('"method": "dynadiag"', '"method": "dense"'))
    with pytest.raises(common.ConfigError, match="is a dense run; lora_fa.py adapts a frozen"):
        script.prepare(lora_fa_config(dense))
    assert [row["model"] for row in table] == ["dynadiag_s90 frozen", "+ LoRA-FA r=4 (B)"]
    before, after = table
    evals = [r for r in T.read_jsonl(frozen_run / "metrics.jsonl") if r["kind"] == "eval"]
    assert before["accuracy"] == pytest.approx(evals[-1]["accuracy"])  # the run's own model
    assert before["adapter"] == 0
    # r * (in + out) per adapted layer (784 -> 64, 64 -> 64); B alone is trained
    assert after["adapter"] == 4 * (784 + 64) + 4 * (64 + 64)
    assert after["trained"] == 4 * 64 * 2 and after["steps"] == 8  # 25% of 31 steps
    assert after["diagonal"] == before["diagonal"] and after["other"] == before["other"]
    variables = T.Checkpointer(tmp_path / "b" / "checkpoints").restore_variables()
    assert variables["params"]["hidden_0"]["lora_b"].shape == (64, 4)
    assert np.any(variables["params"]["hidden_0"]["lora_b"])
    assert variables["lora_frozen"]["hidden_0"]["lora_a"].shape == (4, 784)
    start = common.restore_run_variables(frozen_run)
    for name in ("values", "bias"):  # B only: the diagonal layer itself is untouched
        np.testing.assert_array_equal(
            variables["params"]["hidden_0"][name], start["params"]["hidden_0"][name]
        )
    script.run(lora_fa_config(frozen_run, train_values=True), tmp_path / "bv", progress=False)
    table = json.loads((tmp_path / "bv" / "lora_fa.json").read_text())
    assert table[1]["model"] == "+ LoRA-FA r=4 (B + values)"
    assert table[1]["trained"] == 4 * 64 * 2 + table[1]["diagonal"]
    control = lora_fa_config(frozen_run, "rank=0", train_values=True)
    script.run(control, tmp_path / "v", progress=False)
    table = json.loads((tmp_path / "v" / "lora_fa.json").read_text())
    assert table[1]["model"] == "+ values, no adapter" and table[1]["adapter"] == 0
    assert table[1]["trained"] == table[1]["diagonal"]
    # The command line (a fresh process): the control without train_values is refused.
    proc = run_python(
        [
            str(ROOT / "train" / "lora_fa.py"),
            f"--config={CONFIGS / 'lora_fa.py'}:runlocal,rank=0,checkpoint={frozen_run}",
            "--config.model.hidden=(64, 64)",
            f"--workdir={tmp_path / 'none'}",
            "--noprogress",
        ],
        check=False,
    )
    assert proc.returncode == 2 and "trains nothing" in proc.stderr, proc.stderr[-2000:]
    bad = lora_config.get_config(f"runlocal,rank=4,checkpoint={frozen_run}")  # 256-wide MLP
    with pytest.raises(
        common.ConfigError, match="does not fit the frozen model.*params/hidden_0/values"
    ):
        script.prepare(bad)


def test_lm_run_with_a_lora_phase_and_lora_fa_on_its_checkpoint(tmp_path, capsys):
    """train/lm.py with lora.steps: the LoRA-FA phase after the run's steps (evaluated at the
    switch, B in the checkpoint, the values as they were at the switch); then train/lora_fa.py
    with suite=gpt on a run of the same model (validation perplexity before and after)."""
    run = tmp_path / "lm"
    config = gpt2_lm.get_config("runlocal")
    config.lora.update(steps=4, rank=2)
    config.train.keep_checkpoints = 10
    lm.report(config, run, *lm.train_and_evaluate(config, run, progress=False))
    out = capsys.readouterr().out
    assert "LoRA-FA phase (+ LoRA-FA r=2 (B), 4 steps): validation perplexity" in out
    # A and B counted, as fashion_mnist.py and lora_fa.py count them (it counted B alone)
    variables = T.Checkpointer(run / "checkpoints").restore_variables(10)
    adapter = finetuning.counts(variables, [])["adapter"]
    a = sum(x.size for x in jax.tree.leaves(variables["lora_frozen"]))
    flat = jax.tree_util.tree_flatten_with_path(variables["params"])[0]
    b = sum(x.size for path, x in flat if "lora_b" in jax.tree_util.keystr(path))
    assert a and b and adapter == a + b
    assert f"({adapter:,} in adapters)" in out
    evals = [r["step"] for r in T.read_jsonl(run / "metrics.jsonl") if r["kind"] == "eval"]
    assert evals == [6, 10]  # at the switch (after the run's 6 steps) and at the end
    ckpt = T.Checkpointer(run / "checkpoints")
    switched, end = ckpt.restore_variables(6), ckpt.restore_variables(10)
    layer = ("block_0", "attn", "c_attn")
    pick = lambda v, name: v["params"][layer[0]][layer[1]][layer[2]][name]  # noqa: E731
    assert not np.any(pick(switched, "lora_b")) and np.any(pick(end, "lora_b"))
    np.testing.assert_array_equal(pick(switched, "values"), pick(end, "values"))
    frozen = tmp_path / "frozen"
    result, _ = lm.train_and_evaluate(gpt2_lm.get_config("runlocal"), frozen, progress=False)
    config = lora_config.get_config(f"suite=gpt,rank=2,train_values,checkpoint={frozen}")
    config.model.variant = "mu"
    config.data.update(seq_len=32, eval_windows=16)
    config.train.update(batch_size=8, eval_batch_size=8, num_steps=8)
    out = tmp_path / "ft"
    capsys.readouterr()
    rows = script.run(config, out, progress=False)
    assert f"source: step 6 of {frozen.resolve()} (dynadiag)\n" in capsys.readouterr().out
    before, after = json.loads((out / "lora_fa.json").read_text())
    assert [before, after] == rows
    assert after["model"] == "+ LoRA-FA r=2 (B + values)" and after["steps"] == 2  # 25% of 8
    assert before["perplexity"] == pytest.approx(result.eval_metrics["perplexity"], rel=1e-5)
    assert after["perplexity"] != before["perplexity"] and after["adapter"] > 0


def test_settings_the_phase_would_not_read_are_refused(tmp_path):
    """optimizer.learning_rate / warmup_steps were replaced by lora.learning_rate and no warm-up
    without a word, lora.alpha=0 trained nothing, and another script's config died in an
    AttributeError."""
    for key, value in (("learning_rate", 0.5), ("warmup_steps", 3)):
        config = lora_fa_config("runs/x")
        config.optimizer[key] = value
        with pytest.raises(common.ConfigError, match=f"optimizer.{key} is not read"):
            script.prepare(config)
    with pytest.raises(common.ConfigError, match="lora.alpha=0 scales the adapters to nothing"):
        script.prepare(lora_fa_config("runs/x", alpha=0.0))
    with pytest.raises(common.ConfigError, match="no 'suite' entry: give train/configs/lora_fa"):
        script.prepare(gpt2_lm.get_config("runlocal"))


def test_lm_lora_phase_is_checked_before_training():
    dense = gpt2_lm.get_config("runlocal,sparsity=0")
    dense.lora.steps = 2
    with pytest.raises(common.ConfigError, match="method 'dense' has none"):
        lm.prepare(dense)
    config = gpt2_lm.get_config("runlocal")
    config.lora.update(steps=2, layers=[r".*/nowhere"])
    with pytest.raises(common.ConfigError, match=r"lora.layers / lora.rank: .*nowhere"):
        lm.prepare(config)
    config.lora.update(layers=list(gpt2_lm.SPARSE_LAYERS), rank=0)
    with pytest.raises(common.ConfigError, match="trains nothing"):
        lm.prepare(config)
    config.lora.update(rank=2, steps=3)
    *_, phase, num_steps = lm.prepare(config)
    assert phase.start_step == 6 and num_steps == 9 and phase.trained == (r".*/lora_b",)
    # Without a phase the lora section is no part of the recipe (old checkpoints still resume).
    plain = gpt2_lm.get_config("runlocal")
    method = lm.prepare(plain)[0]
    assert not any(k.startswith("lora.") for k in common.recipe(plain, method))
    assert "lora.rank" in common.recipe(config, method)


def test_the_adapters_follow_the_diagonal_layers_by_default():
    """lora.layers held a copy of the patterns: with dynadiag.layers narrowed to hidden_0, the
    phase adapted the dense hidden_1 too."""
    config = fashion_config.get_config()
    config.data.source = "mnist5k"
    config.dynadiag.layers = ("hidden_0",)
    config.lora.steps = 5
    _, _, example, runs = fashion_mnist.prepare(config)
    (phase,) = [run.phase for run in runs.values() if run.phase is not None]
    variables = jax.eval_shape(
        lambda x: phase.model.init(jax.random.key(0), x, train=False), example
    )
    adapted = sorted(k for k in variables["params"] if "lora_b" in variables["params"][k])
    assert adapted == ["hidden_0"]


def test_fashion_mnist_names_the_values_control_apart_and_checks_every_workdir_first(
    tmp_path, monkeypatch
):
    """The rank-0 control (values alone) took the plain run's subdirectory, whose checkpoint it
    was refused against; another recipe in the sparse run's workdir was refused only after the
    dense run had trained."""
    config = fashion_config.get_config()
    config.data.source = "mnist5k"
    config.lora.update(steps=5, rank=0, train_values=True)
    names = list(fashion_mnist.prepare(config)[3])
    assert names == ["dense", "dynadiag_s90_lorafa_r0_values"]
    config.lora.update(rank=8, train_values=False)
    assert list(fashion_mnist.prepare(config)[3])[-1] == "dynadiag_s90_lorafa_r8"
    checked, trained = [], []

    def check(workdir, run_info):
        checked.append(workdir.name)
        if workdir.name != "dense":
            raise common.ConfigError(f"checkpoint of {workdir.name} was written by another run")

    monkeypatch.setattr(common, "check_workdir", check)
    monkeypatch.setattr(common, "train_from_config", lambda *a, **k: trained.append(k))
    with pytest.raises(common.ConfigError, match="dynadiag_s90_lorafa_r8 was written"):
        fashion_mnist.run(config, tmp_path, progress=False)
    assert checked == ["dense", "dynadiag_s90_lorafa_r8"] and not trained
