"""The training loop's named steps on their own: schedule, metric sums, timer, one step, the
training record, evaluation, selection, checkpoints (save, restore, refusal), stop requests."""

import json
import signal
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from training_helpers import (
    FEATURES,
    NUM_CLASSES,
    CompileCounter,
    blobs,
    fast_compile,  # noqa: F401 - fixture
    tiny_mlp,
)

import dynadiag_jax as dd
from dynadiag_jax import data as D
from dynadiag_jax import training as T
from dynadiag_jax.training import loop
from dynadiag_jax.training.parallel import replicated

pytestmark = pytest.mark.usefixtures("fast_compile")

BATCH = 16


class ListWriter:
    """A metric writer that keeps its records and counts flushes."""

    def __init__(self):
        self.records, self.flushes = [], 0

    def write(self, step, kind, values):
        self.records.append({"step": step, "kind": kind, **values})

    def flush(self):
        self.flushes += 1


class FakeClock:
    """``clock()`` returns the given times in turn."""

    def __init__(self, *times):
        self.times = list(times)

    def __call__(self):
        return self.times.pop(0)


class Run:
    """The pieces of a sparse tiny-MLP run that the steps take: model, init, programs, data."""

    def __init__(self, sparsity=0.8, freeze_step=4):
        self.model = tiny_mlp(sparsity)
        self.optimizer = T.adamw(1e-2, weight_decay=1e-4)
        self.task = T.Classification(NUM_CLASSES)
        self.gate = T.GateSchedule("strength", dd.schedules.cosine(1.0, 0.05, freeze_step))
        self.mesh = T.data_mesh()
        example = jax.ShapeDtypeStruct((BATCH, FEATURES), jnp.float32)
        self.init = lambda variables: T.create_train_state(
            self.model, self.optimizer, example, seed=0, variables=variables
        )
        self.abstract = jax.eval_shape(self.init, None)
        self.programs = loop.jit_programs(
            self.model, self.optimizer, self.task, self.mesh, gate=self.gate
        )
        self.batches = D.ArrayBatches(blobs(), BATCH, seed=0)
        self.eval_data = D.EvalBatches(blobs(100, seed=1), 32)

    def fresh(self):
        return loop.restore_or_create_state(
            None, self.init, self.abstract, {}, replicated(self.mesh), step=None
        )[0]

    def steps(self, state, n, sums=None, timer=None):
        sums = loop.MetricSums() if sums is None else sums
        timer = loop.StepTimer() if timer is None else timer
        batches = iter(self.batches.iterate(int(state.step)))
        for _ in range(n):
            state = loop.train_one_step(
                self.programs.train_step, state, next(batches), self.mesh, sums, timer
            )
        return state, sums


@pytest.fixture(scope="module")
def run():
    return Run()


def events_of(schedule):
    """``{event: [steps]}`` over a whole run, the state frozen from the freeze on."""
    steps = {name: [] for name in loop.Events._fields}
    searching = True
    for step in range(1, schedule.num_steps + 1):
        events = schedule.after(step, searching)
        searching = searching and not events.freeze
        for name, happens in events._asdict().items():
            if happens:
                steps[name].append(step)
    return steps


def test_schedule_names_the_steps_of_each_event():
    # 12 steps, the freeze at 6.
    schedule = loop.Schedule(
        12, 6, log_every=4, eval_every=3, selection_every=2, checkpoint_every=4
    )
    assert events_of(schedule) == {
        "log": [4, 8, 12],
        "evaluate": [3, 6, 9],  # the last step's evaluation comes after the loop
        "enter_working_set": [],
        "refresh_working_set": [],
        "freeze": [6],
        "finetune": [],
        "select": [2, 4, 6],  # at the freeze: what it kept; none once frozen
        "save": [4, 6, 8],  # the freeze saves; the last step is saved after the loop
    }


def test_schedule_at_the_edges():
    # Nothing periodic: the last step is still logged; a freeze at the last step does not save.
    quiet = loop.Schedule(6, 6, log_every=0, eval_every=0, selection_every=0, checkpoint_every=0)
    assert events_of(quiet) == {
        "log": [6],
        "evaluate": [],
        "enter_working_set": [],
        "refresh_working_set": [],
        "freeze": [6],
        "finetune": [],
        "select": [],
        "save": [],
    }
    # A selection record does not replace the save due at the same step.
    both = loop.Schedule(8, None, log_every=8, eval_every=0, selection_every=2, checkpoint_every=2)
    assert events_of(both)["select"] == [2, 4, 6, 8] and events_of(both)["save"] == [2, 4, 6]
    # A dense run never freezes nor records selections.
    dense = both.after(4, searching=False)
    assert not dense.freeze and not dense.select and dense.save


def test_schedule_of_a_fine_tuning_phase():
    # The freeze at 4, the phase from 6: evaluated and saved at the switch, then periodic again.
    schedule = loop.Schedule(
        10, 4, log_every=0, eval_every=4, selection_every=0, checkpoint_every=4, finetune_step=6
    )
    tuning, steps = False, []
    for step in range(1, 11):
        events = schedule.after(step, step < 4, tuning)
        tuning = tuning or events.finetune
        steps.append((step, events.evaluate, events.finetune, events.save))
    picked = {name: [s for s, *flags in steps if flags[i]] for i, name in enumerate("efs")}
    assert picked == {"e": [4, 6, 8], "f": [6], "s": [4, 6, 8]}


def test_metric_sums_average_each_metric_over_the_steps_that_report_it():
    sums = loop.MetricSums()
    sums.add({"loss": jnp.float32(1.0), "alpha/layer": jnp.float32(0.5)})
    sums.add({"loss": jnp.float32(2.0), "alpha/layer": jnp.float32(1.5)})
    sums.add({"loss": jnp.float32(6.0)})  # frozen: no gate metrics any more
    assert sums.means() == {"loss": 3.0, "alpha/layer": 1.0}
    assert sums.means() == {} and sums.totals() == {}


def test_metric_sums_do_not_depend_on_when_they_are_folded_or_resumed():
    values = [np.float32(v) for v in (0.1, 0.7, 1e-3, 3.3)]
    whole = loop.MetricSums()
    for v in values:
        whole.add({"loss": jnp.asarray(v)})
    expected = whole.totals()
    assert expected == {"loss": [sum(float(v) for v in values), 4]}  # float64, step by step
    # Folded after two steps, saved as a checkpoint's JSON, and continued elsewhere.
    first = loop.MetricSums()
    for v in values[:2]:
        first.add({"loss": jnp.asarray(v)})
    saved = first.totals()
    saved["loss"][0] = -1.0  # a copy: what a checkpoint holds does not change with the sums
    resumed = loop.MetricSums(json.loads(json.dumps(first.totals())))
    for v in values[2:]:
        resumed.add({"loss": jnp.asarray(v)})
    assert resumed.totals() == expected and resumed.means() == whole.means()


def test_step_timer_leaves_out_the_first_step_of_each_phase():
    metrics = {"loss": jnp.float32(0.0)}
    # Times read: construction, the first step's restart, two rates, the record's restart, the
    # first step after the freeze, the last rates.
    timer = loop.StepTimer(clock=FakeClock(0.0, 10.0, 16.0, 16.0, 17.0, 30.0, 33.0))
    timer.stepped(metrics)  # compiles: starts the interval at t=10
    assert timer.rates(8) == {}
    for _ in range(3):
        timer.stepped(metrics)
    assert timer.rates(8) == {"step_time_s": 2.0, "examples_per_s": 4.0}
    assert timer.rates(8) == {"step_time_s": 2.0, "examples_per_s": 4.0}
    timer.restart()
    timer.stepped(metrics)  # timed since t=17, then discarded by the freeze
    timer.new_phase()
    timer.stepped(metrics)  # the frozen program compiles: starts the interval at t=30
    timer.stepped(metrics)
    assert timer.rates(8) == {"step_time_s": 3.0, "examples_per_s": 8 / 3}


def test_step_timer_counts_the_wait_for_input_batches():
    """fetch() times next(batches): the interval's share spent waiting, the first step of a
    phase left out as its time is, and nothing reported when no batch came through fetch()."""
    metrics = {"loss": jnp.float32(0.0)}
    # construction; fetch 1 (begin, end); the first step's restart; fetch 2; fetch 3; rates
    timer = loop.StepTimer(clock=FakeClock(0.0, 1.0, 5.0, 5.0, 6.0, 7.0, 7.0, 8.0, 11.0))
    batches = iter(range(3))
    assert timer.fetch(batches) == 0  # waited 4 s, the compiling step's: not counted
    timer.stepped(metrics)
    assert [timer.fetch(batches), timer.fetch(batches)] == [1, 2]  # waited 1 s and 1 s
    timer.stepped(metrics)
    timer.stepped(metrics)
    # 2 steps in 11 - 5 = 6 s, 2 of them waiting
    assert timer.rates(8) == {
        "step_time_s": 3.0,
        "examples_per_s": 8 / 3,
        "input_wait_fraction": 1 / 3,
    }
    assert (timer.logged_seconds, timer.logged_wait) == (6.0, 2.0)  # the run's totals
    assert timer.input_bound() is None  # 1/3 of 6 s: neither enough time nor enough waiting
    timer.logged_seconds, timer.logged_wait = loop.INPUT_BOUND_SECONDS, loop.INPUT_BOUND_SECONDS / 2
    assert timer.input_bound() == 0.5
    plain = loop.StepTimer(clock=FakeClock(0.0, 1.0, 3.0))
    plain.stepped(metrics)
    plain.stepped(metrics)
    assert "input_wait_fraction" not in plain.rates(8)


def test_log_train_writes_the_interval_averages_timing_and_learning_rate():
    sums, writer = loop.MetricSums(), ListWriter()
    timer = loop.StepTimer(clock=FakeClock(0.0, 1.0, 5.0, 6.0))
    for loss in (4.0, 2.0):
        sums.add({"loss": jnp.float32(loss)})
        timer.stepped({"loss": jnp.float32(loss)})
    record = loop.log_train(
        writer, 7, sums, timer, batch_size=16, learning_rate=lambda step: 0.5 * step
    )
    # The learning rate of step 7's update is the schedule's value at 6 (optax counts from 0).
    assert record == {"loss": 3.0, "step_time_s": 4.0, "examples_per_s": 4.0, "learning_rate": 3.0}
    assert list(record) == ["loss", "step_time_s", "examples_per_s", "learning_rate"]
    assert writer.records == [{"step": 7, "kind": "train", **record}]
    assert timer.rates(16) == {} and sums.totals() == {}  # the next interval has begun


def test_the_run_step_returns_its_metrics_as_one_array(run):
    """One output buffer for all the scalars (each a buffer of its own cost microseconds per
    step), unpacked to the metrics of ``make_train_step`` jitted (a dict by name), and summed as
    those would be."""
    state = run.fresh()
    batch = next(iter(run.batches.iterate(0)))
    plain = jax.jit(T.make_train_step(run.model, run.optimizer, run.task, gate=run.gate))
    _, want = plain(state, batch)
    _, got = run.programs.train_step(run.fresh(), batch)
    assert isinstance(got, loop.PackedMetrics) and len(jax.tree.leaves(got)) == 1
    assert got.values.shape == (len(want),) and got.values.dtype == jnp.float32
    unpacked = jax.device_get(got).unpack()
    assert list(unpacked) == list(want) and len(want) > 3  # the layers' gate metrics too
    for name, value in want.items():
        np.testing.assert_array_equal(unpacked[name], value, err_msg=name)
    sums = {}
    for metrics in (want, got):
        acc = loop.MetricSums()
        acc.add(metrics)
        acc.add(metrics)
        sums[type(metrics)] = acc.means()
    assert sums[dict] == sums[loop.PackedMetrics]
    assert loop.PackedMetrics.pack({}).values.shape == (0,)


def test_one_step_trains_and_feeds_the_sums_and_the_timer(run):
    start = run.fresh()
    timer = loop.StepTimer()
    state, sums = run.steps(start, 3, timer=timer)
    assert int(state.step) == 3 and T.is_searching(state.params)
    record = sums.means()
    assert {"loss", "grad_norm", "strength"} <= set(record)
    # The gate value is the schedule's, averaged over steps 0, 1 and 2.
    expected = np.mean([float(run.gate.schedule(s)) for s in range(3)])
    assert record["strength"] == pytest.approx(expected)
    assert timer.rates(BATCH)["step_time_s"] > 0  # two timed steps: the first one compiled
    # Steps depend only on (seed, step): two steps and one more equal three at once.
    two, _ = run.steps(run.fresh(), 2)
    three, _ = run.steps(two, 1)
    jax.tree.map(np.testing.assert_array_equal, three.params, state.params)


def test_freeze_keeps_the_largest_alpha_and_its_selection_record_says_so(run):
    searched, _ = run.steps(run.fresh(), 4)
    writer = ListWriter()
    loop.record_selection(writer, searched)
    frozen = run.programs.freeze(searched)
    loop.record_selection(writer, frozen)
    assert not T.is_searching(frozen.params) and int(frozen.step) == 4
    during, kept = writer.records
    assert during["step"] == kept["step"] == 4 and kept["kind"] == "selection"
    assert set(kept["offsets"]) == {"hidden_0", "hidden_1"} == set(during["offsets"])
    for layer, offsets in kept["offsets"].items():
        alpha = np.asarray(searched.params[layer]["alpha"])
        largest = np.sort(np.argsort(-alpha, kind="stable")[: len(offsets)])
        np.testing.assert_array_equal(offsets, largest)
        assert len(offsets) == len(during["offsets"][layer])
        assert frozen.params[layer]["values"].shape[0] == len(offsets)


def test_evaluate_counts_every_example_once(run):
    metrics = loop.evaluate(run.programs.eval_step, run.fresh(), run.eval_data, run.mesh, run.task)
    assert metrics["count"] == 100 and 0 <= metrics["accuracy"] <= 1
    with pytest.raises(ValueError, match="eval_data yielded no batches"):
        loop.evaluate(run.programs.eval_step, run.fresh(), [], run.mesh, run.task)


def test_save_and_restore_a_frozen_state_with_its_pending_metrics(run, tmp_path):
    info = {"sparsity": 0.8, "seed": 0}
    state, sums = run.steps(run.fresh(), 4)
    frozen = run.programs.freeze(state)
    writer = T.MetricWriter(tmp_path, tensorboard=False)
    writer.write(4, "train", {"loss": 1.0})
    ckpt = T.Checkpointer(tmp_path / "checkpoints")
    loop.save_checkpoint(ckpt, writer, frozen, run_info=info, frozen=True, sums=sums)
    # The log reaches the disk before the checkpoint: a resume from step 4 keeps its records.
    assert [r["step"] for r in T.read_jsonl(tmp_path / "metrics.jsonl")] == [4]
    totals = sums.totals()
    sums.add({"loss": jnp.float32(100.0)})  # after the save: not in the checkpoint
    ckpt.close()
    writer.close()

    ckpt = T.Checkpointer(tmp_path / "checkpoints")
    restored, step, resumed = loop.restore_or_create_state(
        ckpt, run.init, run.abstract, info, replicated(run.mesh), step=ckpt.latest_step()
    )
    ckpt.close()
    assert step == 4 and resumed.totals() == totals and totals["loss"][1] == 4
    # Restored into the frozen structure although `abstract` is the search phase's.
    assert not T.is_searching(restored.params)
    jax.tree.map(np.testing.assert_array_equal, restored, frozen)


def test_a_checkpoint_of_another_run_is_refused_before_compiling(run, tmp_path):
    ckpt = T.Checkpointer(tmp_path)
    loop.save_checkpoint(
        ckpt,
        ListWriter(),
        run.fresh(),
        run_info={"sparsity": 0.8, "seed": 0},
        frozen=False,
        sums=loop.MetricSums(),
    )
    ckpt.wait()
    with CompileCounter() as compiles, pytest.raises(T.CheckpointMismatch) as err:
        loop.restore_or_create_state(
            ckpt,
            run.init,
            run.abstract,
            {"sparsity": 0.9, "seed": 0},
            replicated(run.mesh),
            step=ckpt.latest_step(),
        )
    ckpt.close()
    assert "sparsity: 0.8 in the checkpoint, 0.9 in this run" in str(err.value)
    assert compiles.count == 0


def test_without_a_checkpointer_the_state_is_fresh_and_nothing_is_saved(run):
    variables = T.variables_of(run.fresh())
    shifted = jax.tree.map(lambda v: v + jnp.ones_like(v), variables)
    state, step, sums = loop.restore_or_create_state(
        None, run.init, run.abstract, {}, replicated(run.mesh), shifted, step=None
    )
    assert step is None and sums.totals() == {} and int(state.step) == 0
    jax.tree.map(np.testing.assert_array_equal, T.variables_of(state), shifted)
    writer = ListWriter()
    loop.save_checkpoint(None, writer, state, run_info={}, frozen=False, sums=sums)
    assert writer.flushes == 0


def test_stop_requests_remember_the_first_signal_and_restore_the_handlers():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with loop.stop_requests() as stop:
        assert not stop.is_set()
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)  # a second SIGTERM changes nothing
        assert stop.is_set() and stop.signum == signal.SIGTERM
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)  # a second request by SIGINT: stop at once
    assert {sig: signal.getsignal(sig) for sig in before} == before
    with loop.stop_requests() as stop:
        signal.raise_signal(signal.SIGINT)
        assert stop.signum == signal.SIGINT


def test_stop_requests_outside_the_main_thread_install_nothing():
    seen = []

    def body():
        with loop.stop_requests() as stop:
            seen.append((stop.is_set(), signal.getsignal(signal.SIGTERM)))

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [(False, signal.getsignal(signal.SIGTERM))]


def _mesh(n):
    """A stand-in for a mesh of ``n`` devices: only ``.devices.size`` is read before the
    refusals the tests expect."""
    return type("FakeMesh", (), {"devices": np.empty(n)})()


def _train_arguments(**changes):
    """Arguments of a tiny dense :func:`T.train` run, with ``changes``."""
    return {
        "model": tiny_mlp(),
        "optimizer": T.adamw(1e-2, weight_decay=0.0),
        "task": T.Classification(NUM_CLASSES),
        "train_data": D.ArrayBatches(blobs(), BATCH, seed=0),
        "num_steps": 2,
        "example_input": jax.ShapeDtypeStruct((BATCH, FEATURES), jnp.float32),
        "seed": 0,
        "progress": False,
        **changes,
    }


@pytest.mark.parametrize(
    "changes, error, message",
    [
        (dict(seed="x"), TypeError, "seed must be an int, got str"),
        (dict(seed=None), TypeError, "seed must be an int, got NoneType"),
        (dict(seed=1.5), TypeError, "seed must be an int, got float"),
        (dict(seed=2**64), ValueError, "seed must be in"),
        (dict(model="mlp"), TypeError, "model must be a flax.linen Module, got str"),
        (dict(optimizer=None), TypeError, "optimizer must be an optax GradientTransformation"),
        (dict(task=None), TypeError, "task must be a task such as Classification"),
        (dict(train_data=[blobs()]), TypeError, "train_data must be a BatchSource .* got list"),
        (dict(example_input=(BATCH, FEATURES)), TypeError, "example_input must be an array"),
        (dict(eval_data=5), TypeError, "eval_data must be re-iterable batches or None"),
        (dict(hooks=[5]), TypeError, r"hooks\[0\] must be callable"),
        (dict(hooks=print), TypeError, "hooks must be a sequence"),
        (dict(workdir=5), TypeError, "workdir must be a path"),
        (dict(workdir=""), ValueError, r"workdir must be a directory path or None .* got ''"),
        (dict(keep_checkpoints="3"), TypeError, "keep_checkpoints must be an int, got str"),
        (dict(keep_checkpoints=0), ValueError, "keep_checkpoints must be >= 1"),
        (dict(learning_rate=1e-2), TypeError, "learning_rate must be a schedule"),
        (dict(gate="strength"), TypeError, "gate must be a GateSchedule or None"),
        (dict(finetune=3), TypeError, "finetune must be a Finetune or None"),
        (dict(initial_variables=[1]), TypeError, "initial_variables must be a mapping"),
        # a generator lost its first batch to the compile ahead of the evaluation
        (
            dict(eval_data=(b for b in D.EvalBatches(blobs(64), 32))),
            TypeError,
            "eval_data must be re-iterable batches .* got a one-shot iterator",
        ),
        (dict(eval_data=D.EvalBatches(blobs(64), 7), mesh=_mesh(2)), ValueError, None),
        (dict(example_input=jax.ShapeDtypeStruct((BATCH, 3), jnp.float32)), ValueError, None),
    ],
)
def test_train_refuses_arguments_of_the_wrong_kind_before_compiling(changes, error, message):
    """Each once failed deep in JAX or pathlib, only after the first step (a hook), or not at all
    (a str keep_checkpoints; an empty workdir, which wrote metrics.jsonl into the current
    directory and no checkpoint); eval batches that do not split over the devices failed at the
    first evaluation, an example_input of another width in flax's parameter shapes."""
    message = message or {
        "eval_data": "eval_data's batch size=7 is not divisible by the number of devices",
        "example_input": r"example_input has shape \[16, 3\], but train_data's batches give "
        r"the model inputs of shape \[16, 16\]",
    }.get(next(iter(changes)))
    with CompileCounter() as c, pytest.raises(error, match=message):
        T.train(**_train_arguments(**changes))
    assert c.count == 0


def test_an_eval_batch_the_devices_cannot_split_is_named():
    """An eval_data without a global_batch_size failed in JAX with an IndivisibleError naming a
    sharding, after every training step."""
    from dynadiag_jax.training import loop

    devices = np.array([type("Device", (), {"process_index": 0})()] * 2, dtype=object)
    mesh = type("FakeMesh", (), {"devices": devices})()
    batches = [
        {"x": np.ones((8, 3)), "mask": np.ones(8)},
        {"x": np.ones((7, 3)), "mask": np.ones(7)},
    ]
    message = r"an eval_data batch's rows=7 is not divisible by the number of devices \(2\)"
    with pytest.raises(ValueError, match=message):
        loop.evaluate(lambda state, batch: {"n": 1}, None, batches, mesh, None)


def test_labels_that_are_no_class_are_refused_or_give_a_nan_loss():
    """A label outside [0, C) had an all-zero target: loss 0, as if learned; a [B, 1] label
    broadcast the loss against every example's logits."""
    batch = {k: v[:BATCH] for k, v in blobs().items()}
    task = T.Classification(NUM_CLASSES)
    outside = {**batch, "label": batch["label"] + NUM_CLASSES}
    with pytest.raises(ValueError, match=r"labels must be in \[0, num_classes=4\), the batch "):
        task.check_batch(outside)
    with CompileCounter() as c, pytest.raises(ValueError, match="labels must be in"):
        T.train(
            **_train_arguments(
                train_data=D.ArrayBatches(
                    {**blobs(), "label": blobs()["label"] + NUM_CLASSES}, BATCH, seed=0
                )
            )
        )
    assert c.count == 0
    logits = jnp.zeros((BATCH, NUM_CLASSES), jnp.float32)
    inputs, targets = jax.jit(task.train_inputs)(outside, jax.random.key(0))
    assert np.isnan(float(task.loss(logits, targets, outside)[0]))
    column = {**batch, "label": batch["label"][:, None]}
    with pytest.raises(ValueError, match=r"batch\['label'\] must have shape \[B\] = \[16\]"):
        task.train_inputs(column, jax.random.key(0))
    with pytest.raises(ValueError, match=r"batch\['label'\] must have shape \[B\]"):
        task.eval_sums(logits, column)


def test_a_train_data_that_ends_early_names_the_step_and_keeps_it(tmp_path):
    class Short:
        global_batch_size = BATCH

        def iterate(self, start):
            batches = D.ArrayBatches(blobs(), BATCH, seed=0).iterate(start)
            return (next(batches) for _ in range(3 - start))

    with pytest.raises(ValueError, match=r"iterate\(0\) ended after 3 batches, at step 3 of "):
        T.train(**_train_arguments(train_data=Short(), num_steps=5, workdir=tmp_path))
    assert (tmp_path / "checkpoints" / "3").is_dir()


def test_a_checkpoint_past_num_steps_is_refused(tmp_path):
    T.train(**_train_arguments(num_steps=3, workdir=tmp_path, checkpoint_every=1))
    with pytest.raises(T.CheckpointMismatch, match="step 3 .* past this run's num_steps=2"):
        T.train(**_train_arguments(num_steps=2, workdir=tmp_path, checkpoint_every=1))
    assert T.train(**_train_arguments(num_steps=3, workdir=tmp_path)).start_step == 3


def test_path_patterns_must_be_a_sequence_of_regexes():
    """A bare string was a sequence of one-letter patterns: "head/kernel" decayed head/kernel."""
    params = {"head": {"kernel": jnp.ones((2, 2))}}
    with pytest.raises(TypeError, match="no_decay must be a sequence of path patterns"):
        dd.optim.weight_decay_mask(params, no_decay="head/kernel")
    with pytest.raises(TypeError, match="no_decay must be a sequence"):
        T.adamw(1e-3, weight_decay=0.1, no_decay="head/kernel")
    with pytest.raises(ValueError, match=r"trained: '\*/lora_b' is not a regex"):
        T.split_params(params, ("*/lora_b",))
    assert dd.optim.weight_decay_mask(params, no_decay=("head/kernel",))["head"]["kernel"] is False


def test_mixup_checks_its_fields_and_mixes_integer_images_as_floats():
    for field, value, message in (
        ("mixup_alpha", float("nan"), "mixup_alpha must be a finite"),
        ("cutmix_alpha", -1.0, "cutmix_alpha must be >= 0"),
        ("prob", 5.0, r"prob must be in \[0, 1\]"),
        ("switch_prob", float("nan"), "switch_prob must be a finite"),
    ):
        with pytest.raises(ValueError, match=f"MixupCutmix: {message}"):
            T.Classification(NUM_CLASSES, mixup=T.MixupCutmix(**{field: value}))
    images = jnp.asarray(np.random.default_rng(0).integers(1, 255, (4, 6, 6, 3)), jnp.uint8)
    targets = jnp.eye(4, dtype=jnp.float32)
    mixed, _ = T.MixupCutmix(0.8, 0.0)(jax.random.key(0), images, targets)
    assert mixed.dtype == jnp.float32 and float(jnp.min(mixed)) > 0  # were all zeros


def test_train_takes_an_iterable_eval_data_and_hooks_as_documented():
    seen = []
    result = T.train(
        **_train_arguments(
            eval_data=list(D.EvalBatches(blobs(64, seed=1), 32)),
            hooks=(lambda step, state: seen.append(step),),
        )
    )
    assert seen == [1, 2] and result.eval_metrics["count"] == 64


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((0,), ValueError, "Classification: num_classes must be >= 2, got 0"),
        ((10.0,), TypeError, "Classification: num_classes must be an int, got float"),
        ((10, 2.0), ValueError, r"Classification: label_smoothing must be in \[0, 1\), got 2.0"),
        ((10, float("nan")), ValueError, "Classification: label_smoothing must be a finite"),
        ((10, "0.1"), TypeError, "Classification: label_smoothing must be a number"),
        ((10, 0.0, 3), TypeError, "Classification: mixup must be a MixupCutmix or None"),
    ],
)
def test_classification_refuses_bad_arguments_naming_them(args, error, message):
    with pytest.raises(error, match=message):
        T.Classification(*args)


def test_classification_names_a_num_classes_that_differs_from_the_logits():
    """It was "incompatible shapes (32, 5), (32, 10)" from inside the loss."""
    task = T.Classification(NUM_CLASSES + 1)
    batch = {k: v[:BATCH] for k, v in blobs().items()}
    _, targets = task.train_inputs(batch, jax.random.key(0))
    logits = jnp.zeros((BATCH, NUM_CLASSES), jnp.float32)
    message = f"num_classes={NUM_CLASSES + 1} differs from the width of the model's logits \\(4\\)"
    with pytest.raises(ValueError, match=message):
        jax.jit(lambda: task.loss(logits, targets, batch))()
    with pytest.raises(ValueError, match=message):
        task.eval_sums(logits, batch)
    with pytest.raises(ValueError, match=message):
        T.train(**_train_arguments(task=task))


def test_selection_helpers_name_an_argument_that_is_not_a_mapping():
    with pytest.raises(TypeError, match="kept_offsets: collections must be a mapping .* int"):
        T.kept_offsets(5)
    with pytest.raises(TypeError, match="parameter_counts: params must be a mapping .* NoneType"):
        T.parameter_counts(None)
    assert T.kept_offsets({}) == {} and T.parameter_counts({}).total == 0


def test_a_model_with_scanned_layers_trains_across_the_freeze_and_logs_each_member(tmp_path):
    """nn.scan stacks three layers: their sown metrics have shape (3,), which the step's packed
    metrics (scalars) refused in the first search step."""
    import flax.linen as nn  # noqa: PLC0415

    class Cell(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return jnp.tanh(dd.nn.DiagonalDense(32, sparsity=0.75)(x)), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            scan = nn.scan(Cell, variable_axes={True: 0}, split_rngs={"params": True}, length=3)
            return nn.Dense(4)(scan(name="layers")(x, None)[0])

    rng = np.random.default_rng(0)
    data = {
        "image": rng.normal(size=(64, 32)).astype(np.float32),
        "label": rng.integers(0, 4, 64).astype(np.int32),
    }
    result = T.train(
        model=Stack(),
        optimizer=T.adamw(1e-2, weight_decay=0.0),
        task=T.Classification(4),
        train_data=D.ArrayBatches(data, 8, seed=0),
        num_steps=6,
        freeze_step=3,
        seed=0,
        example_input=jax.ShapeDtypeStruct((8, 32), jnp.float32),
        gate=T.GateSchedule("strength", dd.schedules.cosine(1.0, 0.05, 3)),
        workdir=tmp_path,
        log_every=1,
        progress=False,
        tensorboard=False,
    )
    assert result.state.collections["diagonals"]["layers"]["DiagonalDense_0"]["offsets"].shape == (
        3,
        8,
    )
    records = [r for r in T.read_jsonl(tmp_path / "metrics.jsonl") if r.get("kind") == "train"]
    searching = [r for r in records if r["step"] <= 3]
    assert searching and all(
        f"effective_k/layers/DiagonalDense_0/{i}" in r for r in searching for i in range(3)
    )


def test_seeds_beyond_32_bits_draw_their_own_weights():
    """jax.random.key keeps a seed's low 32 bits: seeds 5 and 2**32 + 5 trained from the same
    weights, -1 and 2**32 - 1 too. Seeds in [0, 2**32) keep their keys."""
    x = jax.ShapeDtypeStruct((BATCH, FEATURES), jnp.float32)
    tx = T.adamw(1e-2, weight_decay=0.0)

    def kernel(seed):
        state = T.create_train_state(tiny_mlp(), tx, x, seed=seed)
        return np.asarray(state.params["hidden_0"]["kernel"])

    init_key = jax.random.split(jax.random.key(5))[0]
    as_before = tiny_mlp().init({"params": init_key, "dropout": init_key}, jnp.zeros(x.shape))
    np.testing.assert_array_equal(kernel(5), as_before["params"]["hidden_0"]["kernel"])
    assert not np.array_equal(kernel(5), kernel(2**32 + 5))
    assert not np.array_equal(kernel(-1), kernel(2**32 - 1))


@pytest.mark.parametrize(
    "gate, error, match",
    [
        # 2.5 scored at steps 0, 5, 10; a rescore at 2.5 never came; "3" failed while tracing
        (dict(score_every=2.5), TypeError, "score_every must be an int"),
        (dict(score_every="3"), TypeError, "score_every must be an int"),
        (dict(rescore_step=2.5), TypeError, "rescore_step must be an int"),
        (dict(rescore_step=True), TypeError, "rescore_step must be an int"),
        (dict(schedule=0.5), TypeError, "GateSchedule.schedule must be a function"),
        (dict(score_every=-1), ValueError, "score_every must be >= 0"),
    ],
)
def test_a_gate_schedule_of_the_wrong_kind_is_named(gate, error, match):
    fields = {"name": "strength", "schedule": dd.schedules.constant(1.0), **gate}
    with pytest.raises(error, match=match):
        T.GateSchedule(**fields).check()


def test_a_rescore_after_the_search_is_refused_before_compiling():
    """The restart runs only while the layers search: at or after the freeze it never came."""
    gate = T.GateSchedule("strength", dd.schedules.cosine(1.0, 0.05, 3), rescore_step=3)
    arguments = _train_arguments(model=tiny_mlp(0.5), num_steps=6, freeze_step=3, gate=gate)
    with CompileCounter() as c, pytest.raises(ValueError, match="rescore_step=3 must come before"):
        T.train(**arguments)
    assert c.count == 0


def test_a_models_own_parameter_named_alpha_is_no_search():
    """Any param called alpha made a dense model 'in the search phase' (train asked for a gate)."""
    assert not T.is_searching({"alpha": jnp.ones(()), "Dense_0": {"kernel": jnp.ones((2, 2))}})
    assert T.is_searching({"layer": {"alpha": jnp.ones(4), "values": jnp.ones((4, 2))}})
    assert T.is_searching({"stack": {"alpha": jnp.ones((3, 4)), "values": jnp.ones((3, 4, 2))}})
