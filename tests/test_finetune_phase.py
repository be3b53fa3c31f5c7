"""A run's fine-tuning phase (T.Finetune): LoRA-FA after the freeze, resumed inside the phase, and
the step that differentiates only the trained params."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from training_helpers import (
    FEATURES,
    Crash,
    assert_resumed_as_uninterrupted,
    blobs,
    crash_at,
    tiny_mlp,
    train_tiny,
)

import dynadiag_jax as dd
from dynadiag_jax import training as T

SPARSITY = 0.8
LAYERS = [r"hidden_\d+"]


def phase(start_step=6, *, rank=2, trained=(r".*/lora_b",)):
    # The phase's model initialises in the frozen form, as the state it takes over.
    frozen = tiny_mlp(SPARSITY, init_phase="frozen")
    model = dd.nn.lora_fa(frozen, LAYERS, rank=rank) if rank else frozen
    rate = optax.linear_schedule(3e-2, 0.0, 6)
    return T.Finetune(start_step, model, T.adamw(rate, weight_decay=0.0), trained, rate)


RUN = dict(num_steps=12, sparsity=SPARSITY, freeze_step=4, checkpoint_every=2, eval_every=4)


def test_lora_phase_trains_b_alone_after_the_freeze(tmp_path):
    result = train_tiny(tmp_path, **RUN, finetune=phase(), keep_checkpoints=10)
    params = result.state.params
    assert params["hidden_0"]["lora_b"].shape == (32, 2) and np.any(params["hidden_0"]["lora_b"])
    assert result.state.collections["lora_frozen"]["hidden_0"]["lora_a"].shape == (2, FEATURES)
    switched = T.Checkpointer(tmp_path / "checkpoints").restore_variables(6)
    assert not np.any(switched["params"]["hidden_0"]["lora_b"])  # B = 0 at the switch
    for layer in ("hidden_0", "hidden_1", "head"):
        for name, value in switched["params"][layer].items():
            if name != "lora_b":  # the frozen model is untouched by the phase
                np.testing.assert_array_equal(params[layer][name], value)
    records = list(T.read_jsonl(tmp_path / "metrics.jsonl"))
    # the periodic evaluations and one at the switch (the model before the phase)
    assert [r["step"] for r in records if r["kind"] == "eval"] == [4, 6, 8, 12]
    # the phase's own schedule from its first step (the run's is not given: not logged)
    rates = {r["step"]: r["learning_rate"] for r in records if "learning_rate" in r}
    assert rates == pytest.approx({s: 3e-2 * (1 - (s - 7) / 6) for s in range(7, 13)})


@pytest.mark.parametrize("crash", [7, 9])
def test_resumed_inside_the_phase_matches_the_uninterrupted_run(tmp_path, crash):
    """Crashed one step after the switch (resumes from the switch's checkpoint) or later
    (from a checkpoint of the phase): the same params, evaluation and log."""
    full = train_tiny(tmp_path / "full", **RUN, finetune=phase())
    with pytest.raises(Crash):
        train_tiny(tmp_path / "cut", **RUN, finetune=phase(), hooks=[crash_at(crash)])
    resumed = train_tiny(tmp_path / "cut", **RUN, finetune=phase())
    assert resumed.start_step == crash - 1
    assert_resumed_as_uninterrupted(resumed, full, tmp_path / "cut", tmp_path / "full")


def test_phase_from_frozen_variables_starts_at_once(tmp_path):
    """A run of the frozen model from given variables with the phase at step 0 (what
    train/lora_fa.py does with a checkpoint): the values-only control, no adapters."""
    first = train_tiny(tmp_path / "a", num_steps=4, sparsity=SPARSITY, freeze_step=0)
    variables = T.variables_of(first.state)
    control = phase(0, rank=0, trained=(r".*/values",))
    result = train_tiny(
        tmp_path / "b",
        num_steps=3,
        sparsity=None,
        model=control.model,
        initial_variables=variables,
        finetune=control,
    )
    params = result.state.params
    assert not np.array_equal(
        params["hidden_0"]["values"], variables["params"]["hidden_0"]["values"]
    )
    np.testing.assert_array_equal(params["head"]["kernel"], variables["params"]["head"]["kernel"])
    # the optimizer state covers the values alone
    assert {leaf.shape for leaf in jax.tree.leaves(result.state.opt_state) if leaf.ndim} == {
        params["hidden_0"]["values"].shape,
        params["hidden_1"]["values"].shape,
    }


def test_a_run_crashed_before_its_first_checkpoint_resumes_into_a_phase_at_step_0(tmp_path):
    """Frozen at step 0 and switched into the phase there, the run saved step 0 at the freeze
    and skipped the switch's save (a step is saved once): the resumed run read the frozen model
    without adapters as the phase's and failed ("the patterns ['.*/lora_b'] match no param")."""
    run = dict(num_steps=8, sparsity=SPARSITY, freeze_step=0, checkpoint_every=4)
    full = train_tiny(tmp_path / "full", **run, finetune=phase(0))
    with pytest.raises(Crash):
        train_tiny(tmp_path / "cut", **run, finetune=phase(0), hooks=[crash_at(1)])
    saved = T.Checkpointer(tmp_path / "cut" / "checkpoints").restore_variables(0)
    assert "lora_b" in saved["params"]["hidden_0"]  # step 0 holds the phase's form
    resumed = train_tiny(tmp_path / "cut", **run, finetune=phase(0))
    assert resumed.start_step == 0
    assert_resumed_as_uninterrupted(resumed, full, tmp_path / "cut", tmp_path / "full")


def test_a_phase_added_to_a_finished_run_is_refused_naming_it(tmp_path):
    """It failed inside the first step's trace ("match no param")."""
    train_tiny(tmp_path, num_steps=8, sparsity=SPARSITY, freeze_step=4)
    with pytest.raises(
        T.CheckpointMismatch,
        match="step 8 .* without this run.s fine-tuning phase, which starts at step 6",
    ):
        train_tiny(tmp_path, num_steps=12, sparsity=SPARSITY, freeze_step=4, finetune=phase(6))


def test_bad_phases_are_refused_before_compiling(tmp_path):
    with pytest.raises(ValueError, match=r"finetune.start_step must be an integer in \[0, num"):
        train_tiny(tmp_path, **RUN, finetune=phase(12))
    with pytest.raises(ValueError, match="comes before freeze_step=4"):
        train_tiny(tmp_path, **RUN, finetune=phase(3))
    no_freeze = {**RUN, "freeze_step": None}
    with pytest.raises(ValueError, match="needs the frozen model: pass freeze_step"):
        train_tiny(tmp_path, **no_freeze, finetune=phase())
    other = T.Finetune(
        6, tiny_mlp(SPARSITY, hidden=(16, 32), init_phase="frozen"), optax.sgd(1.0), [".*"]
    )
    with pytest.raises(ValueError, match="does not extend the run's"):
        train_tiny(tmp_path / "other", **RUN, finetune=other)


def _step_jaxpr(trained):
    ft = phase(0, trained=trained)
    example = jax.ShapeDtypeStruct((8, FEATURES), jnp.float32)
    state = T.create_train_state(ft.model, ft.optimizer, example, seed=0, trained=ft.trained)
    step = T.make_train_step(ft.model, ft.optimizer, T.Classification(4), trained=ft.trained)
    batch = {k: v[:8] for k, v in blobs(8).items()}
    return str(jax.make_jaxpr(step)(state, batch))


def test_b_alone_computes_no_values_gradient():
    """LoRA-FA's saving: with B alone trained the diagonal layers' backward is dx only (the
    second layer's, towards the first one's adapter); no dvalues product, so x is not kept for
    one. Training the values too brings the fused backward (dx and dvalues) back."""
    b_only = _step_jaxpr((r".*/lora_b",))
    assert "diag_matmul_dx" in b_only
    assert "diag_matmul_dvalues" not in b_only and "diag_matmul_bwd" not in b_only
    with_values = _step_jaxpr((r".*/lora_b", r".*/values"))
    assert "diag_matmul_bwd" in with_values or "diag_matmul_dvalues" in with_values


def test_split_and_merge_params_round_trip():
    params = {"a": {"lora_b": jnp.ones(2), "values": jnp.zeros(3)}, "b": {}, "c": {"w": 1.0}}
    fit, fixed = T.split_params(params, [r".*/lora_b"])
    assert fit == {"a": {"lora_b": params["a"]["lora_b"]}}
    assert set(fixed) == {"a", "b", "c"} and "lora_b" not in fixed["a"]
    assert jax.tree.structure(T.merge_params(fit, fixed)) == jax.tree.structure(params)
    with pytest.raises(ValueError, match="match no param"):
        T.split_params(params, [r".*/kernel"])
