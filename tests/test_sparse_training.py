"""Training DynaDiag models: budgets, the freeze, metrics, compile counts, checkpoints."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from training_helpers import CompileCounter, fast_compile, train_tiny  # noqa: F401 - fixture

import dynadiag_jax as dd
from dynadiag_jax import models
from dynadiag_jax import training as T

pytestmark = pytest.mark.usefixtures("fast_compile")

KEY = jax.random.key(0)
MODELS = {
    "mlp": (
        lambda dense: models.MLP(10, hidden=(64, 48), dense=dense),
        (2, 28, 28, 1),
        jnp.float32,
        models.mlp.SPARSE_LAYERS,
    ),
    "vit": (
        lambda dense: models.ViT(10, "mu/4", dense=dense),
        (2, 16, 16, 3),
        jnp.float32,
        models.vit.SPARSE_LAYERS,
    ),
    "mixer": (
        lambda dense: models.MlpMixer(10, "mu/4", dense=dense),
        (2, 16, 16, 3),
        jnp.float32,
        models.mixer.SPARSE_LAYERS,
    ),
    "gpt2": (
        lambda dense: models.GPT2(256, "mu", block_size=16, dense=dense),
        (2, 16),
        jnp.int32,
        models.gpt2.SPARSE_LAYERS,
    ),
}


def _frozen_params(make, shape, dtype, patterns, sparsity):
    sparse = functools.partial(dd.nn.DiagonalDense, sparsity=sparsity)
    model = make(models.ByPath(patterns, sparse=sparse))
    x = jax.ShapeDtypeStruct(shape, dtype)
    variables = jax.eval_shape(lambda x: model.init(KEY, x), x)
    return jax.eval_shape(dd.freeze_tree, variables)["params"]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("sparsity", [0.8, 0.9, 0.95])
def test_parameter_counts_match_the_configured_sparsity(name, sparsity):
    make, shape, dtype, patterns = MODELS[name]
    x = jax.ShapeDtypeStruct(shape, dtype)
    dense_model = make(models.ByPath(patterns, sparse=_dense_like))
    dense = jax.eval_shape(lambda x: dense_model.init(KEY, x), x)["params"]
    frozen = _frozen_params(make, shape, dtype, patterns, sparsity)
    counts = T.parameter_counts(frozen)
    dense_total = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(dense))
    shapes = {p: dense_kernel(dense, p) for p in models.replaceable_layers(dense_model, x)}
    expected_diag = 0
    for path, (fan_in, fan_out) in shapes.items():
        k = dd.num_diagonals(fan_in, fan_out, sparsity)
        values = _at(frozen, path)["values"]
        assert values.shape == (k, min(fan_in, fan_out)), path
        density = values.size / (fan_in * fan_out)
        assert (
            1 - sparsity
            <= density
            < 1 - sparsity + min(fan_in, fan_out) / (fan_in * fan_out) + 1e-9
        )
        expected_diag += values.size
    assert counts.alpha == 0 and counts.diagonal == expected_diag
    assert counts.total == dense_total - sum(i * o for i, o in shapes.values()) + expected_diag


def _dense_like(features, **kwargs):
    return models.mlp.DENSE(features, **kwargs)


def _at(tree, path):
    for key in path.split("/"):
        tree = tree[key]
    return tree


def dense_kernel(params, path):
    return tuple(_at(params, path)["kernel"].shape)


def test_freeze_switches_params_collections_and_optimizer_state(tmp_path):
    result = train_tiny(tmp_path, num_steps=8, sparsity=0.8, freeze_step=4, selection_every=2)
    params, collections = result.state.params, result.state.collections
    assert not T.is_searching(params)
    k = dd.num_diagonals(16, 32, 0.8)
    assert params["hidden_0"]["values"].shape == (k, 16) and "alpha" not in params["hidden_0"]
    assert collections["diagonals"]["hidden_0"]["offsets"].shape == (k,)
    tx = T.adamw(1e-2, weight_decay=1e-4)
    expected = jax.tree.structure(jax.eval_shape(tx.init, params))
    assert jax.tree.structure(result.state.opt_state) == expected
    # Checkpoints every 2 steps (selection records share those steps), the last 3 kept.
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [4, 6, 8]
    records = list(T.read_jsonl(tmp_path / "metrics.jsonl"))
    search = [r for r in records if r["kind"] == "train" and r["step"] <= 4]
    frozen = [r for r in records if r["kind"] == "train" and r["step"] > 4]
    assert all(0 < r["effective_k/hidden_0"] <= 32 for r in search)
    assert all("strength" in r for r in search) and not any(
        "effective_k/hidden_0" in r for r in frozen
    )
    selections = [r for r in records if r["kind"] == "selection"]
    assert [r["step"] for r in selections] == [0, 2, 4]
    np.testing.assert_array_equal(
        selections[-1]["offsets"]["hidden_0"], collections["diagonals"]["hidden_0"]["offsets"]
    )


PROGRAMS = ("jit(train_step)", "jit(eval_step)", "jit(freeze_state)")


@pytest.mark.parametrize("freeze_step", [4, 0])
def test_each_program_compiles_once_and_ahead_of_its_first_call(freeze_step):
    counts = {}
    with CompileCounter() as c:
        train_tiny(
            num_steps=14,
            sparsity=0.8,
            freeze_step=freeze_step,
            eval_every=2,
            hooks=[lambda step, state: counts.setdefault(step, c.count)],
        )
    # The search step and evaluation, the freeze, the frozen step and evaluation were compiled
    # on the background thread before the loop called them: the loop's own calls found them.
    assert [name for name in c.on_caller if name in PROGRAMS] == []
    # The frozen evaluation (step 6) is the last program: nothing compiles after it.
    assert len({counts[s] for s in range(6, 15)}) == 1, counts


def test_restoring_into_another_sparsity_fails_clearly(tmp_path):
    train_tiny(tmp_path, num_steps=4, sparsity=0.8, freeze_step=2)
    with CompileCounter() as c:
        with pytest.raises(T.CheckpointMismatch, match="sparsity: 0.8 in the checkpoint, 0.9"):
            train_tiny(tmp_path, num_steps=6, sparsity=0.9, freeze_step=2)
        # A description that does not tell them apart: the stored shapes still do.
        with pytest.raises(T.CheckpointMismatch) as err:
            train_tiny(
                tmp_path, num_steps=6, sparsity=0.9, freeze_step=2, run_info={"sparsity": 0.8}
            )
    k8, k9 = dd.num_diagonals(16, 32, 0.8), dd.num_diagonals(16, 32, 0.9)
    assert f"params/hidden_0/values: checkpoint ({k8}, 16), this run ({k9}, 16)" in str(err.value)
    assert c.count == 0


def test_dense_score_exploration_sets_the_score_flag_on_schedule():
    gate = T.GateSchedule("strength", dd.schedules.constant(1.0), score_every=3)
    model = models.MLP(
        4,
        hidden=(8,),
        dense=functools.partial(dd.nn.DiagonalDense, sparsity=0.5, explore="dense_score"),
    )
    collections = dict(model.init(KEY, jnp.ones((1, 8))))
    collections.pop("params")
    flags = [
        bool(T.apply_gate(collections, gate, jnp.int32(s))["dynadiag"]["hidden_0"]["score"])
        for s in range(7)
    ]
    assert flags == [True, False, False, True, False, False, True]
