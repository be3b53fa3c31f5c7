"""The training library: loop, resuming, checkpoint shape checks, compile counts, metrics, tasks."""

import json
import os
import shutil
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from training_helpers import CompileCounter, Crash, blobs, comparable, crash_at, train_tiny

from dynadiag_jax import data as D
from dynadiag_jax import models
from dynadiag_jax import training as T
from dynadiag_jax.training import loop


def test_loss_goes_down_and_eval_is_reported(tmp_path):
    result = train_tiny(tmp_path, num_steps=30, eval_every=10)
    records = list(T.read_jsonl(tmp_path / "metrics.jsonl"))
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 31))
    assert np.mean([r["loss"] for r in train[-5:]]) < 0.5 * np.mean([r["loss"] for r in train[:5]])
    assert [r["step"] for r in records if r["kind"] == "eval"] == [10, 20, 30]
    assert result.eval_metrics["count"] == 100 and result.eval_metrics["accuracy"] > 0.8
    assert {"grad_norm", "step_time_s", "examples_per_s"} <= set(train[-1])
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir())[-1] == "30"


class _SlowBatches:
    """``batches`` handing over each batch ``delay`` seconds late: an input-bound run."""

    def __init__(self, batches, delay):
        self.batches, self.delay = batches, delay
        self.global_batch_size = batches.global_batch_size

    def iterate(self, start):
        for batch in self.batches.iterate(start):
            time.sleep(self.delay)
            yield batch


def test_an_input_bound_run_says_so_once(tmp_path, caplog, monkeypatch):
    """Each record has the share of its steps' time spent waiting for input batches; a run whose
    steps mostly wait warns once (the progress bar shows the share)."""
    monkeypatch.setattr(loop, "INPUT_BOUND_SECONDS", 0.1)  # 30 s of logged steps in a run
    train_tiny(tmp_path / "fast", num_steps=8)
    fast = [r for r in T.read_jsonl(tmp_path / "fast" / "metrics.jsonl") if r["kind"] == "train"]
    assert all(0.0 <= r["input_wait_fraction"] <= 1.0 for r in fast[1:]), fast
    # on a loaded host even the fast run's tiny steps can wait on input: only the slow run counts
    caplog.clear()
    slow = _SlowBatches(D.ArrayBatches(blobs(), 16, seed=0), delay=0.05)
    T.train(
        model=models.MLP(4, hidden=(32, 32)),
        optimizer=T.adamw(1e-2, weight_decay=1e-4),
        task=T.Classification(4),
        train_data=slow,
        num_steps=8,
        example_input=jax.ShapeDtypeStruct((16, 16), jnp.float32),
        seed=0,
        workdir=tmp_path / "slow",
        log_every=2,
    )
    records = [r for r in T.read_jsonl(tmp_path / "slow" / "metrics.jsonl") if r["kind"] == "train"]
    assert all(r["input_wait_fraction"] > loop.INPUT_BOUND for r in records[1:]), records
    assert caplog.text.count("waited for input batches") == 1


def test_resumed_run_matches_uninterrupted_run(tmp_path):
    full = train_tiny(tmp_path / "full", num_steps=12, eval_every=4)
    with pytest.raises(Crash):
        train_tiny(tmp_path / "cut", num_steps=12, eval_every=4, hooks=[crash_at(7)])
    resumed = train_tiny(tmp_path / "cut", num_steps=12, eval_every=4)
    assert resumed.start_step == 6  # the last checkpoint before the crash
    assert resumed.eval_metrics == full.eval_metrics
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, full.state.params)
    a = comparable(T.read_jsonl(tmp_path / "full" / "metrics.jsonl"))
    b = comparable(T.read_jsonl(tmp_path / "cut" / "metrics.jsonl"))
    assert a == b  # records written after step 6 by the crashed run were replaced


def test_resumed_log_averages_the_same_steps_as_the_uninterrupted_one(tmp_path):
    # Records every 3 steps; checkpoints at 4, at the freeze (5) and at 8. The crash at step 7
    # resumes from step 5 with steps 4-5 not logged yet; a stop request (SIGINT) after step 10
    # saves step 10 with step 10 not logged yet.
    def stop_at(step):
        def hook(s, state):
            if s == step:
                signal.raise_signal(signal.SIGINT)

        return hook

    run = dict(num_steps=12, sparsity=0.8, freeze_step=5, checkpoint_every=4, log_every=3)
    full = train_tiny(tmp_path / "full", **run)
    with pytest.raises(Crash):
        train_tiny(tmp_path / "cut", **run, hooks=[crash_at(7)])
    with pytest.raises(KeyboardInterrupt, match="stopped at step 10 of 12"):
        train_tiny(tmp_path / "cut", **run, hooks=[stop_at(10)])
    resumed = train_tiny(tmp_path / "cut", **run)
    assert resumed.start_step == 10 and resumed.eval_metrics == full.eval_metrics
    a = comparable(T.read_jsonl(tmp_path / "full" / "metrics.jsonl"))
    b = comparable(T.read_jsonl(tmp_path / "cut" / "metrics.jsonl"))
    assert [r["step"] for r in a if r["kind"] == "train"] == [3, 6, 9, 12]
    assert a == b


def test_a_stop_request_during_the_last_step_still_stops(tmp_path):
    """The loop ended on its count and the request was swallowed: results.py's timing went on to
    its next run after a Ctrl-C (seen in CI). Now the last step is saved, the final evaluation
    skipped, and a rerun only evaluates."""

    def stop_at_last(step, state):
        if step == 6:
            signal.raise_signal(signal.SIGINT)

    with pytest.raises(T.Interrupted, match=r"stopped at step 6 of 6 \(the last; its final"):
        train_tiny(tmp_path, num_steps=6, eval_every=0, hooks=[stop_at_last])
    assert (tmp_path / "checkpoints" / "6").is_dir()
    assert not [r for r in T.read_jsonl(tmp_path / "metrics.jsonl") if r["kind"] == "eval"]
    rerun = train_tiny(tmp_path, num_steps=6, eval_every=0)
    assert rerun.start_step == 6 and rerun.eval_metrics["count"] == 100


def test_compile_first_times_steps_with_no_compile_beside_them_and_trains_the_same(tmp_path):
    run = dict(num_steps=10, sparsity=0.8, freeze_step=5, eval_every=5, log_every=1)
    plain = train_tiny(tmp_path / "plain", **run)
    first = train_tiny(tmp_path / "first", **run, compile_first=True)
    jax.tree.map(np.testing.assert_array_equal, first.state.params, plain.state.params)
    assert comparable(T.read_jsonl(tmp_path / "first" / "metrics.jsonl")) == comparable(
        T.read_jsonl(tmp_path / "plain" / "metrics.jsonl")
    )
    for name, beside in (("plain", {0.0, 1.0}), ("first", {0.0})):
        records = [
            r for r in T.read_jsonl(tmp_path / name / "metrics.jsonl") if r["kind"] == "train"
        ]
        timed = [r for r in records if "step_time_s" in r]
        # every timed interval says whether a compile ran beside it; with compile_first none did
        assert timed and all(r["beside_compile"] in beside for r in timed), name


def test_intervals_after_a_background_save_say_so(tmp_path):
    # Saves at 3 and 6: Orbax writes them on a background thread, beside the next steps.
    train_tiny(tmp_path / "saved", num_steps=9, checkpoint_every=3, log_every=1)
    timed = {
        r["step"]: r["beside_save"]
        for r in T.read_jsonl(tmp_path / "saved" / "metrics.jsonl")
        if "step_time_s" in r
    }
    assert set(timed) == set(range(2, 10)) and set(timed.values()) <= {0.0, 1.0}
    assert timed[2] == timed[3] == 0.0  # nothing written yet
    assert timed[4] == timed[7] == 1.0  # the interval right after each save
    train_tiny(None, num_steps=5, log_every=1)  # no workdir: nothing is ever written


def test_checkpointer_knows_whether_a_write_ran_since_a_time(tmp_path):
    clock = iter(range(100, 200)).__next__
    rng = jax.random.key_data(jax.random.key(0))
    state = T.TrainState(jnp.asarray(1), {"w": jnp.ones(3)}, (), {}, rng)
    ckpt = T.Checkpointer(tmp_path / "a", clock=clock)
    assert not ckpt.writing_since(-1e9)  # nothing written
    ckpt.save(state, meta={})
    while ckpt.writing_since(float("inf")):  # True only while the write runs
        time.sleep(0.01)
    # it was found finished at t=100: an interval begun before then saw it, a later one did not
    assert ckpt.writing_since(99.5) and not ckpt.writing_since(100)
    ckpt.close()
    sync = T.Checkpointer(tmp_path / "b", async_save=False, clock=clock)
    sync.save(state, meta={})  # written before save returns: no step runs beside it
    assert not sync.writing_since(-1e9)
    sync.close()


def test_crash_at_the_last_step_resumes_before_the_final_evaluation(tmp_path):
    full = train_tiny(tmp_path / "full", num_steps=12, eval_every=4)
    with pytest.raises(Crash):
        train_tiny(tmp_path / "cut", num_steps=12, eval_every=4, hooks=[crash_at(12)])
    resumed = train_tiny(tmp_path / "cut", num_steps=12, eval_every=4)
    # The crash at step 12 came before its checkpoint (which precedes the final evaluation): the
    # resumed run redoes steps 11-12 and logs that evaluation itself.
    assert resumed.start_step == 10 and resumed.eval_metrics == full.eval_metrics
    a = comparable(T.read_jsonl(tmp_path / "full" / "metrics.jsonl"))
    b = comparable(T.read_jsonl(tmp_path / "cut" / "metrics.jsonl"))
    assert a == b and a[-1]["kind"] == "eval" and a[-1]["step"] == 12


class _BrokenEvalData:
    """Evaluation batches whose first read fails, as a missing validation shard does."""

    def __iter__(self):
        raise OSError("validation shard missing")


def test_an_evaluation_that_fails_at_the_end_keeps_the_last_step(tmp_path):
    """The last step was saved only after the final evaluation: one that failed (a bad
    validation file) lost every step since the last checkpoint, and each rerun again."""
    full = train_tiny(tmp_path / "full", num_steps=12, checkpoint_every=5)
    with pytest.raises(OSError, match="validation shard missing"):
        train_tiny(tmp_path / "cut", num_steps=12, checkpoint_every=5, eval_data=_BrokenEvalData())
    resumed = train_tiny(tmp_path / "cut", num_steps=12, checkpoint_every=5)
    assert resumed.start_step == 12 and resumed.eval_metrics == full.eval_metrics
    again = train_tiny(tmp_path / "cut", num_steps=12, checkpoint_every=5)  # a finished run
    assert again.start_step == 12 and again.eval_metrics == full.eval_metrics
    a = comparable(T.read_jsonl(tmp_path / "full" / "metrics.jsonl"))
    b = comparable(T.read_jsonl(tmp_path / "cut" / "metrics.jsonl"))
    assert a == b and [r["kind"] for r in b].count("eval") == 1


def test_a_loss_that_stops_being_finite_is_said_once(caplog):
    with caplog.at_level("WARNING", logger=loop.__name__):
        result = train_tiny(num_steps=8, optimizer=optax.sgd(1e30))
    said = [r.getMessage() for r in caplog.records if "the training loss is" in r.getMessage()]
    assert len(said) == 1 and "has likely diverged" in said[0], said
    assert not np.isfinite(result.eval_metrics["loss"])
    with caplog.at_level("WARNING", logger=loop.__name__):
        caplog.clear()
        train_tiny(num_steps=4)
    assert not [r for r in caplog.records if "the training loss is" in r.getMessage()]


def _events(directory) -> list:
    """Every TensorBoard event of the event files in ``directory`` (TFRecord framing: length,
    its CRC, the event, its CRC)."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            n = int.from_bytes(data[at : at + 8], "little")
            events.append(event_pb2.Event.FromString(data[at + 12 : at + 12 + n]))
            at += 12 + n + 4
    return events


def test_a_diverged_run_keeps_its_finite_checkpoints_and_logs_its_nan_loss(tmp_path, caplog):
    """Non-finite parameters were saved every checkpoint_every steps and rotated every finite
    checkpoint out (keep_checkpoints); TensorBoard dropped every non-finite scalar, so a
    diverged run showed no loss there; the warning named the logging step as the step."""
    rate = optax.piecewise_constant_schedule(1e-2, {5: 1e32})  # step 6 blows up
    with caplog.at_level("WARNING", logger=loop.__name__):
        train_tiny(
            tmp_path, num_steps=12, optimizer=optax.sgd(rate), checkpoint_every=2, log_every=4
        )
    said = [r.getMessage() for r in caplog.records]
    assert any("the training loss is nan in the steps up to 8" in m for m in said), said
    ckpt = T.Checkpointer(tmp_path / "checkpoints", read_only=True)
    steps = ckpt.all_steps()
    assert steps and max(steps) < 12, steps  # 12 saved nothing, and nothing rotated 2-6 out
    last = "the parameters are not finite, so no checkpoint is saved from here on (the last "
    assert any(f"{last}saved step, {max(steps)}, stays" in m for m in said), said
    for step in steps:
        params = ckpt.restore_variables(step)["params"]
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(params)), step
    losses = {(e.step, v.tag): v.simple_value for e in _events(tmp_path) for v in e.summary.value}
    assert np.isnan(losses[(8, "train/loss")]) and np.isnan(losses[(12, "eval/loss")])


def test_metric_write_failures_raise_naming_the_file_and_start_no_thread(tmp_path, monkeypatch):
    """tensorboardX's writer thread died on a full disk and its queue then blocked the training
    loop for good (SIGTERM could not stop it)."""
    import threading

    from tensorboardX.event_file_writer import EventsWriter

    before = threading.active_count()
    writer = T.MetricWriter(tmp_path)
    assert threading.active_count() == before  # events written in the caller's thread
    writer.write(1, "train", {"loss": 1.0})

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(EventsWriter, "write_event", full)
    with pytest.raises(OSError, match=f"cannot write the TensorBoard events of {tmp_path}: No"):
        writer.write(2, "train", {"loss": 0.5})
    writer.close()  # no second error hiding the first
    monkeypatch.undo()
    writer = T.MetricWriter(tmp_path, start_step=1, tensorboard=False)

    class Full:
        def write(self, text):
            full()

        def close(self):
            full()

    writer._file.close()
    writer._file = Full()
    with pytest.raises(OSError, match=f"cannot write the metrics.jsonl of {tmp_path}: No space"):
        writer.write(2, "train", {"loss": 0.5})
    writer.close()


def test_a_second_run_in_a_workdir_in_use_is_refused(tmp_path):
    """Two runs in one workdir deleted each other's checkpoints and log (the second, started
    later, silently resumed from the first's checkpoint)."""
    from dynadiag_jax.training.checkpoint import exclusive_workdir

    with (
        exclusive_workdir(tmp_path),
        pytest.raises(
            T.CheckpointMismatch,
            match=f"another run \\(process {os.getpid()}\\) is training in {tmp_path}",
        ),
    ):
        train_tiny(tmp_path, num_steps=2)
    assert train_tiny(tmp_path, num_steps=2).start_step == 0  # released: the run goes ahead
    assert train_tiny(tmp_path, num_steps=2).start_step == 2  # and after a run, too


def test_eval_labels_are_checked_and_a_task_may_log_no_loss(tmp_path):
    """A label no class of the task's gave a NaN eval loss without a word; a task whose metrics
    named no "loss" failed with KeyError after its last step, before the final save."""
    bad = blobs(100, seed=1)
    bad["label"][5] = 7
    with pytest.raises(ValueError, match=r"eval_data: Classification: labels must be in \[0, "):
        train_tiny(num_steps=2, eval_data=D.EvalBatches(bad, 32))

    class Renamed(T.Classification):
        def loss(self, logits, targets, batch):
            loss, metrics = super().loss(logits, targets, batch)
            return loss, {"xent": metrics["loss"]}

    result = T.train(
        model=models.MLP(4, hidden=(8,)),
        optimizer=optax.sgd(1e-2),
        task=Renamed(4),
        train_data=D.ArrayBatches(blobs(), 16, seed=0),
        num_steps=3,
        example_input=jax.ShapeDtypeStruct((16, 16), jnp.float32),
        seed=0,
        workdir=tmp_path,
        log_every=1,
        checkpoint_every=0,
    )
    assert result.state.step == 3
    assert [r["step"] for r in T.read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert T.Checkpointer(tmp_path / "checkpoints", read_only=True).latest_step() == 3


def test_a_language_models_train_perplexity_is_that_of_the_mean_loss():
    """It was the mean of the steps' perplexities (110.8 against exp(4.44) = 85.0)."""
    means = {"loss": 4.0, "token_loss": 2.0, "soft_loss": 1.0}
    lm = T.LanguageModeling()
    assert lm.summarise_train(means) == {"loss": 4.0, "soft_loss": 1.0, "perplexity": np.exp(2.0)}
    assert lm.summarise_train({"token_loss": float("nan")})["perplexity"] == float("inf")
    distilled = T.Distillation(lm, teacher=lambda x: x)
    assert distilled.summarise_train(means)["perplexity"] == np.exp(2.0)
    assert T.Distillation(T.Classification(4), teacher=lambda x: x).summarise_train(means) == means


def test_run_killed_before_its_first_checkpoint_starts_a_new_log(tmp_path):
    # A kill after the first metrics flush but before the first checkpoint committed leaves a
    # log and no checkpoint; the restarted run must not append to that log.
    full = train_tiny(
        tmp_path / "full", num_steps=6, sparsity=0.8, freeze_step=4, selection_every=2
    )
    (tmp_path / "cut").mkdir()
    log = (tmp_path / "full" / "metrics.jsonl").read_text()
    (tmp_path / "cut" / "metrics.jsonl").write_text(log)
    again = train_tiny(
        tmp_path / "cut", num_steps=6, sparsity=0.8, freeze_step=4, selection_every=2
    )
    assert again.start_step == 0 and again.eval_metrics == full.eval_metrics
    a = comparable(T.read_jsonl(tmp_path / "full" / "metrics.jsonl"))
    b = comparable(T.read_jsonl(tmp_path / "cut" / "metrics.jsonl"))
    assert a == b and [r["step"] for r in a if r["kind"] == "selection"] == [0, 2, 4]


def test_restoring_another_shape_fails_clearly(tmp_path):
    train_tiny(tmp_path, num_steps=2)
    wider = models.MLP(4, hidden=(32, 48))
    with CompileCounter() as compiles, pytest.raises(ValueError) as err:
        T.train(
            model=wider,
            optimizer=T.adamw(1e-2, weight_decay=0.0),
            task=T.Classification(4),
            train_data=D.ArrayBatches(blobs(), 16, seed=0),
            num_steps=4,
            example_input=jax.ShapeDtypeStruct((16, 16), jnp.float32),
            seed=0,
            workdir=tmp_path,
            progress=False,
            run_info={"sparsity": None},  # train_tiny's: the description does not tell them apart
        )
    message = str(err.value)
    assert "does not fit this model" in message
    assert "params/hidden_1/kernel: checkpoint (32, 32), this run (32, 48)" in message
    assert compiles.count == 0


def test_other_seed_in_the_same_workdir_is_refused(tmp_path):
    train_tiny(tmp_path, num_steps=2)
    with pytest.raises(T.CheckpointMismatch, match="seed: 0 in the checkpoint, 1 in this run"):
        train_tiny(tmp_path, num_steps=4, seed=1)


def test_other_run_description_in_the_same_workdir_is_refused(tmp_path):
    train_tiny(tmp_path, num_steps=2, run_info={"optimizer": {"lr": 1e-2}, "layers": ("a", "b")})
    # Tuples come back from the checkpoint's JSON as lists: the same description.
    same = train_tiny(
        tmp_path, num_steps=2, run_info={"optimizer": {"lr": 1e-2}, "layers": ("a", "b")}
    )
    assert same.start_step == 2
    with CompileCounter() as compiles, pytest.raises(T.CheckpointMismatch) as err:
        train_tiny(tmp_path, num_steps=4, run_info={"optimizer": {"lr": 3e-2}, "epochs": 2})
    message = str(err.value)
    assert "optimizer.lr: 0.01 in the checkpoint, 0.03 in this run" in message
    assert "epochs: absent in the checkpoint, 2 in this run" in message
    assert "layers: ['a', 'b'] in the checkpoint, absent in this run" in message
    assert "sparsity" not in message and "use another workdir" in message
    assert compiles.count == 0


def test_no_recompilation_as_training_goes_on():
    counts = []
    for steps in (3, 9):
        with CompileCounter() as c:
            train_tiny(num_steps=steps, eval_every=2)
        counts.append(c.count)
    assert counts[0] == counts[1], f"compilations grew with the number of steps: {counts}"


def test_bad_arguments_fail_before_compiling(tmp_path):
    with CompileCounter() as c:
        with pytest.raises(
            ValueError, match="batch_size=6 is not divisible by the number of devices"
        ):
            train_tiny(batch_size=6, mesh=_fake_mesh(4))
        with pytest.raises(ValueError, match="freeze_step must be"):
            train_tiny(freeze_step=13)
        with pytest.raises(TypeError, match="freeze_step must be an int, got float"):
            train_tiny(freeze_step=2.0)
        with pytest.raises(TypeError, match="num_steps must be an int, got str"):
            train_tiny(num_steps="3")
        with pytest.raises(ValueError, match="num_steps must be >= 1, got 0"):
            train_tiny(num_steps=0)
        with pytest.raises(TypeError, match=r"eval_every \(0 disables it\) must be an int"):
            train_tiny(eval_every=1.5)
        with pytest.raises(ValueError, match=r"log_every \(0 disables it\) must be >= 0"):
            train_tiny(log_every=-1)
        with pytest.raises(ValueError, match="checkpoint_every needs a workdir"):
            T.train(
                model=None,
                optimizer=None,
                task=None,
                train_data=None,
                num_steps=2,
                example_input=None,
                seed=0,
                checkpoint_every=2,
            )
    assert c.count == 0


def _fake_mesh(n):
    class FakeMesh:  # only .devices.size is consulted before anything else
        devices = np.empty(n)

    return FakeMesh()


def test_metric_writer_drops_records_after_the_resume_step(tmp_path):
    w = T.MetricWriter(tmp_path, tensorboard=False)
    for s in (1, 2, 3):
        w.write(s, "train", {"loss": np.float32(s), "v": jnp.arange(2)})
    w.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "kind": "tra')  # torn line from a kill mid-write
    w = T.MetricWriter(tmp_path, start_step=2, tensorboard=False)
    w.write(3, "train", {"loss": 30.0})
    w.close()
    records = list(T.read_jsonl(tmp_path / "metrics.jsonl"))
    assert [(r["step"], r["loss"]) for r in records] == [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert records[0]["v"] == [0, 1]
    with pytest.raises(ValueError, match="metrics writer of .* is closed"):  # an AttributeError
        w.write(4, "train", {"loss": 4.0})
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("3\n")  # valid JSON, no record: a resume died in an AttributeError
    assert len(list(T.read_jsonl(tmp_path / "metrics.jsonl"))) == 3
    T.MetricWriter(tmp_path, start_step=3, tensorboard=False).close()


def test_metric_writer_of_a_fresh_run_drops_every_earlier_record(tmp_path):
    w = T.MetricWriter(tmp_path, tensorboard=False)
    w.write(0, "selection", {"offsets": [1, 2]})
    w.close()
    w = T.MetricWriter(tmp_path, tensorboard=False)
    w.write(0, "selection", {"offsets": [3]})
    w.close()
    records = list(T.read_jsonl(tmp_path / "metrics.jsonl"))
    assert records == [{"step": 0, "kind": "selection", "offsets": [3]}]


def test_tensorboard_events_are_written(tmp_path):
    w = T.MetricWriter(tmp_path)
    w.write(1, "train", {"loss": 1.5, "note": "text is skipped"})
    w.close()
    assert list(tmp_path.glob("events.out.tfevents.*"))
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["note"] == "text is skipped"


def test_mixup_and_cutmix_keep_target_mass():
    key = jax.random.key(0)
    images = jax.random.normal(key, (8, 16, 16, 3))
    targets = jax.nn.one_hot(jnp.arange(8) % 4, 4)
    for mix in (T.MixupCutmix(0.8, 0.0), T.MixupCutmix(0.0, 1.0), T.MixupCutmix()):
        mixed = jax.jit(lambda *a, mix=mix: mix(*a))
        for k in range(4):
            out_i, out_t = mixed(jax.random.key(k), images, targets)
            assert out_i.shape == images.shape and out_t.shape == targets.shape
            np.testing.assert_allclose(out_t.sum(-1), 1.0, rtol=1e-6)
            lam = float(out_t[0, 0])  # example 0 (class 0) is paired with example 7 (class 3)
            if mix.mixup_alpha == 0:  # cutmix: pixels come from exactly one of the two images
                same = np.isclose(out_i, images) | np.isclose(out_i, images[::-1])
                assert same.all()
                np.testing.assert_allclose(
                    np.isclose(out_i[0], images[0]).all(-1).mean(), lam, atol=1e-6
                )
    assert T.MixupCutmix(0.0, 0.0)(key, images, targets)[0] is images


def test_classification_and_lm_tasks():
    task = T.Classification(3, label_smoothing=0.1, normalize=((0.5,) * 3, (0.25,) * 3))
    batch = {
        "image": jnp.full((2, 4, 4, 3), 255, jnp.uint8),
        "label": jnp.array([0, 2]),
        "mask": jnp.array([1.0, 0.0]),
    }
    x, t = task.train_inputs(batch, jax.random.key(0))
    np.testing.assert_allclose(x, 2.0)
    np.testing.assert_allclose(t[0], [0.1 / 3 + 0.9, 0.1 / 3, 0.1 / 3], rtol=1e-6)
    logits = jnp.array([[5.0, 0, 0], [5.0, 0, 0]])
    sums = task.eval_sums(logits, batch)
    assert task.summarise(sums) == pytest.approx(
        {
            "loss": float(
                optax.softmax_cross_entropy_with_integer_labels(logits[:1], jnp.array([0]))[0]
            ),
            "accuracy": 1.0,
            "count": 1,
        }
    )
    lm = T.LanguageModeling()
    tokens = jnp.array([[1, 2, 3, 4]])
    inputs, targets = lm.train_inputs({"tokens": tokens}, None)
    assert inputs.tolist() == [[1, 2, 3]] and targets.tolist() == [[2, 3, 4]]
    uniform = jnp.zeros((1, 3, 8))
    summary = lm.summarise(lm.eval_sums(uniform, {"tokens": tokens}))
    assert summary["perplexity"] == pytest.approx(8.0) and summary[
        "bits_per_token"
    ] == pytest.approx(3.0)


def test_optimizer_decays_only_matrices_outside_no_decay():
    params = {
        "dense": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)},
        "ln": {"scale": jnp.ones(2)},
        "layer": {"alpha": jnp.ones(3), "values": jnp.ones((3, 2))},
        "pos_embed": jnp.ones((1, 2, 2)),
    }
    tx = T.adamw(1.0, weight_decay=0.5)
    zeros = jax.tree.map(jnp.zeros_like, params)
    with jax.numpy_dtype_promotion("standard"):
        updates, _ = tx.update(zeros, tx.init(params), params)
    decayed = jax.tree.map(lambda u: bool((u != 0).any()), updates)
    assert decayed == {
        "dense": {"kernel": True, "bias": False},
        "ln": {"scale": False},
        "layer": {"alpha": False, "values": True},
        "pos_embed": False,
    }
    tx = T.adamw(1.0, weight_decay=0.0, alpha_lr_scale=0.1)
    grads = jax.tree.map(jnp.ones_like, params)
    with jax.numpy_dtype_promotion("standard"):
        updates, _ = tx.update(grads, tx.init(params), params)
    np.testing.assert_allclose(
        updates["layer"]["alpha"], 0.1 * updates["layer"]["values"][:, 0], rtol=1e-6
    )


def _damage(step_dir, how):
    """Damage a committed checkpoint as a disk or a user might, after its commit."""
    if how == "truncated array file":
        data = max((step_dir / "state" / "ocdbt.process_0" / "d").iterdir(), key=os.path.getsize)
        data.write_bytes(data.read_bytes()[:100])
    elif how == "meta deleted":
        (step_dir / "meta" / "metadata").unlink()
    elif how == "meta garbled":
        (step_dir / "meta" / "metadata").write_text("garbage{")
    elif how == "state metadata deleted":  # a TypeError inside the shape check before
        (step_dir / "state" / "_METADATA").unlink()
    elif how == "state removed":
        shutil.rmtree(step_dir / "state")
    else:  # an empty step directory
        shutil.rmtree(step_dir)
        step_dir.mkdir()


@pytest.mark.parametrize(
    "how",
    [
        "truncated array file",
        "meta deleted",
        "meta garbled",
        "state metadata deleted",
        "state removed",
        "empty directory",
    ],
)
def test_unreadable_newest_checkpoint_resumes_from_the_one_before(tmp_path, caplog, how):
    full = train_tiny(tmp_path / "full", num_steps=8, eval_every=4)
    with pytest.raises(Crash):
        train_tiny(tmp_path / "cut", num_steps=8, eval_every=4, hooks=[crash_at(7)])
    checkpoints = tmp_path / "cut" / "checkpoints"
    _damage(checkpoints / "6", how)
    resumed = train_tiny(tmp_path / "cut", num_steps=8, eval_every=4)
    assert resumed.start_step == 4 and resumed.eval_metrics == full.eval_metrics
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, full.state.params)
    a = comparable(T.read_jsonl(tmp_path / "full" / "metrics.jsonl"))
    assert comparable(T.read_jsonl(tmp_path / "cut" / "metrics.jsonl")) == a
    [warning] = [r.getMessage() for r in caplog.records if r.name == loop.__name__]
    assert f"{checkpoints} step 6 cannot be read (" in warning and "\n" not in warning
    assert "resuming from step 4" in warning
    # kept under a name Orbax does not read, and step 6 written again by the resumed run
    assert (checkpoints / "6.unreadable").is_dir() and (checkpoints / "6" / "state").is_dir()


def test_a_search_checkpoint_past_this_runs_freeze_step_is_refused(tmp_path):
    """Resumed with an earlier freeze step (or fewer steps, e.g. another data set), the run
    searched to its end: the freeze fires only at its step."""
    train_tiny(tmp_path, num_steps=6, sparsity=0.8, freeze_step=5, checkpoint_every=2)
    for step in (6, 5):  # the frozen checkpoints: the run resumes from 4 below
        shutil.rmtree(tmp_path / "checkpoints" / str(step), ignore_errors=True)
    with pytest.raises(
        T.CheckpointMismatch,
        match=r"checkpoint at step 4 .* still searching, but this run freezes at step 3",
    ):
        train_tiny(tmp_path, num_steps=6, sparsity=0.8, freeze_step=3, checkpoint_every=2)
    resumed = train_tiny(tmp_path, num_steps=6, sparsity=0.8, freeze_step=4, checkpoint_every=2)
    assert resumed.start_step == 4 and not T.is_searching(resumed.state.params)


def test_a_resumed_run_keeps_no_more_checkpoints_than_asked(tmp_path):
    # a run killed after its last save committed and before Orbax deleted the oldest one left
    # one step too many; resumed with nothing left to train, it saved nothing that would trim it
    def steps():
        return sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir())

    train_tiny(tmp_path, num_steps=8, keep_checkpoints=4)
    assert steps() == [2, 4, 6, 8]
    resumed = train_tiny(tmp_path, num_steps=8, keep_checkpoints=2)
    assert resumed.start_step == 8 and steps() == [6, 8]


def test_no_readable_checkpoint_is_an_error_that_names_the_newest_and_deletes_nothing(tmp_path):
    train_tiny(tmp_path, num_steps=6)  # checkpoints 2, 4, 6
    for step in (4, 6):
        _damage(tmp_path / "checkpoints" / str(step), "meta deleted")
    (tmp_path / "checkpoints" / "2" / "state").rename(tmp_path / "state")  # 2 lacks its state
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    with CompileCounter() as compiles, pytest.raises(T.CheckpointMismatch) as err:
        train_tiny(tmp_path, num_steps=8)
    message = str(err.value)
    assert message.startswith(f"checkpoint {tmp_path / 'checkpoints'} step 6 cannot be read (meta")
    assert "; delete it or use another workdir" in message and "steps 4, 2" in message
    assert "\n" not in message and compiles.count == 0
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


def test_another_recipe_is_refused_even_when_the_newest_checkpoint_is_unreadable(tmp_path):
    train_tiny(tmp_path, num_steps=4, run_info={"lr": 0.1})  # checkpoints 2, 4
    _damage(tmp_path / "checkpoints" / "4", "truncated array file")
    with pytest.raises(T.CheckpointMismatch, match="lr: 0.1 in the checkpoint, 0.2 in this run"):
        train_tiny(tmp_path, num_steps=6, run_info={"lr": 0.2})
    assert (tmp_path / "checkpoints" / "4").is_dir()  # set aside only for a resumed run


def test_checkpointer_checks_its_directory_up_front(tmp_path):
    (tmp_path / "file").write_text("")
    for path, problem in (
        (tmp_path / "file", "is a file, not a directory"),
        (tmp_path / "file" / "checkpoints", f"{tmp_path / 'file'} is a file, not a directory"),
    ):
        with pytest.raises(T.CheckpointMismatch, match=problem):
            T.Checkpointer(path)
    with pytest.raises(T.CheckpointMismatch, match=r"/proc/nope cannot be created \("):
        T.Checkpointer("/proc/nope")
    # a run's workdir that is a file: refused before anything is compiled
    with CompileCounter() as compiles, pytest.raises(T.CheckpointMismatch, match="is a file"):
        train_tiny(tmp_path / "file", num_steps=2)
    assert compiles.count == 0
    reader = T.Checkpointer(tmp_path / "absent", read_only=True)  # a reader creates nothing
    assert reader.latest_step() is None and not (tmp_path / "absent").exists()
    with pytest.raises(ValueError, match="read_only"):
        reader.save(None, meta={})
    reader.close()


def test_checkpointer_names_a_missing_step_a_bad_max_to_keep_and_a_changed_optimizer(tmp_path):
    with pytest.raises(TypeError, match="max_to_keep must be an int, got str"):
        T.Checkpointer(tmp_path / "c", max_to_keep="a")
    with pytest.raises(TypeError, match="max_to_keep must be an int, got float"):
        T.Checkpointer(tmp_path / "c", max_to_keep=2.5)  # was kept as 2
    train_tiny(tmp_path, num_steps=2, checkpoint_every=0)
    reader = T.Checkpointer(tmp_path / "checkpoints", read_only=True)
    with pytest.raises(FileNotFoundError, match=r"holds no checkpoint of step 5 \(steps: \[2\]\)"):
        reader.read_meta(5)  # was: "step 5 cannot be read (it has no state/); delete it"
    reader.close()
    # the same number of arrays in another structure: the message names where they differ
    with pytest.raises(
        T.CheckpointMismatch, match=r"14 arrays stored, 14 expected; differing, e\.g"
    ):
        train_tiny(
            tmp_path,
            num_steps=2,
            checkpoint_every=0,
            optimizer=optax.chain(optax.clip_by_global_norm(1.0), T.adamw(1e-2, weight_decay=1e-4)),
        )


def test_restore_variables_of_an_unreadable_step_names_it(tmp_path):
    train_tiny(tmp_path, num_steps=2, checkpoint_every=0)
    _damage(tmp_path / "checkpoints" / "2", "truncated array file")
    with pytest.raises(T.CheckpointMismatch) as err:
        T.Checkpointer(tmp_path / "checkpoints").restore_variables()
    message = str(err.value)
    assert message.startswith(f"checkpoint {tmp_path / 'checkpoints'} step 2 cannot be read (state")
    assert "\n" not in message


def test_a_second_ctrl_c_says_what_it_did():
    with loop.stop_requests():
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt, match="second Ctrl-C stopped the run at once"):
            signal.raise_signal(signal.SIGINT)


def test_a_second_ctrl_c_during_the_stop_save_says_what_it_did(tmp_path, monkeypatch):
    """The stop's save was waited for after the handler was gone: Orbax's save thread failed
    with a traceback after "saved in ..." was printed."""
    wait = T.Checkpointer.wait

    def interrupted_wait(self):
        signal.raise_signal(signal.SIGINT)  # the second Ctrl-C, while the save is pending
        wait(self)

    def ctrl_c(step, state):
        if step == 3:
            monkeypatch.setattr(T.Checkpointer, "wait", interrupted_wait)
            signal.raise_signal(signal.SIGINT)

    with pytest.raises(KeyboardInterrupt, match="second Ctrl-C stopped the run at once") as e:
        train_tiny(tmp_path, num_steps=8, hooks=[ctrl_c])
    assert not isinstance(e.value, T.Interrupted)  # not "stopped at step 3; saved in ..."
    monkeypatch.setattr(T.Checkpointer, "wait", wait)
    assert train_tiny(tmp_path, num_steps=8).start_step in (2, 3)


def test_run_differences_list_changed_entries_before_absent_ones():
    from dynadiag_jax.training.checkpoint import run_differences

    stored = {"method": "dynadiag", "dynadiag": {"sparsity": 0.9, "gate": "sparse_topk"}}
    current = {"method": "dense", "dynadiag": {"sparsity": 0.0}, "optimizer": {"lr": 1e-3}}
    lines = run_differences(stored, current)
    assert [line.split(":")[0] for line in lines] == [
        "dynadiag.sparsity",
        "method",
        "dynadiag.gate",
        "optimizer.lr",
    ]
    assert lines[1] == "method: 'dynadiag' in the checkpoint, 'dense' in this run"
    # a section one method reads and the other does not: one line per side, by name
    stored["dynadiag"].update(slack=0.25, gate_schedule={"name": "exponential"})
    current["unstructured"] = {"drop_fraction": 0.3}
    assert run_differences(stored, current)[1:] == [
        "method: 'dynadiag' in the checkpoint, 'dense' in this run",
        "dynadiag: 3 entries in the checkpoint only: gate, gate_schedule.name, slack",
        "optimizer.lr: absent in the checkpoint, 0.001 in this run",
        "unstructured.drop_fraction: absent in the checkpoint, 0.3 in this run",
    ]


def test_a_read_is_watched_for_failed_read_reports_from_its_start(tmp_path):
    """A failed read's pending reads were reported (a traceback on stderr, once in CI) when they
    failed before the read's error reached the filter's registration; a step that reads is not
    watched afterwards, and the hooks are installed once, not once per read."""
    from dynadiag_jax.training import checkpoint as C

    train_tiny(tmp_path / "run", num_steps=4)
    ckpt = T.Checkpointer(tmp_path / "run" / "checkpoints")
    watched = f"{ckpt.directory / '4'}/"
    ckpt.restore_variables(4)
    hook = sys.unraisablehook
    with ckpt._reading(4, "state"):
        assert watched in C._UNREADABLE
    ckpt.read_meta(4)
    assert watched not in C._UNREADABLE and sys.unraisablehook is hook
    ckpt.close()
