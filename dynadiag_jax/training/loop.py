"""The training loop: search phase, freeze, evaluation, metrics, checkpoints, progress bar.

:func:`train`, used by every script, takes explicit arguments and never reads a config. It composes
small steps, each usable on its own: :func:`restore_or_create_state`, :func:`jit_programs` (the
jitted step, evaluation and freeze), :func:`compile_ahead` (the programs a phase will need,
compiled on a background thread while the run goes on), :func:`train_one_step` (with
:class:`MetricSums` and :class:`StepTimer`), :func:`log_train`, :func:`evaluate`,
:func:`record_selection`, :func:`save_checkpoint`, :func:`finetune_programs` (a fine-tuning phase
at the end of the run, e.g. LoRA-FA) and :func:`stop_requests`; :class:`Schedule` says which of
them follow each step (including the switch to the search's working-set form and its refresh,
:mod:`dynadiag_jax.training.working_set`).

A run with a ``workdir`` resumes from the newest checkpoint there; because data order, dropout and
augmentation depend only on ``(seed, step)`` and the gate schedule only on the step, a resumed run
continues exactly as the uninterrupted one would have; the checkpoint also holds the sums of the
metrics since the last training record, so its log continues exactly too.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import logging
import os
import pathlib
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tqdm

from dynadiag_jax._checks import check_variables, int_at_least, int_in_range
from dynadiag_jax.optim import compile_patterns
from dynadiag_jax.training.ahead import CompileAhead
from dynadiag_jax.training.checkpoint import (
    RESUME_ADVICE,
    Checkpointer,
    CheckpointMismatch,
    UnreadableCheckpoint,
    exclusive_workdir,
)
from dynadiag_jax.training.finetune import Finetune, enter_finetune
from dynadiag_jax.training.metrics import MetricWriter
from dynadiag_jax.training.parallel import (
    StopAgreement,
    abstract_batch,
    batch_sharded,
    check_batch_size,
    data_mesh,
    global_batch_shape,
    replicated,
    step_batch,
)
from dynadiag_jax.training.sparsity import GateSchedule, freeze_state, is_searching, kept_offsets
from dynadiag_jax.training.state import TrainState, create_train_state
from dynadiag_jax.training.steps import make_eval_step, make_train_step
from dynadiag_jax.training.working_set import (
    WorkingSet,
    enter_working_set,
    has_working_set,
    refresh_working_set,
)

__all__ = [
    "BatchSource",
    "Events",
    "Interrupted",
    "MetricSums",
    "PackedMetrics",
    "Programs",
    "Schedule",
    "StepTimer",
    "StopRequest",
    "TrainResult",
    "evaluate",
    "finetune_programs",
    "jit_programs",
    "log_train",
    "phase_key",
    "record_selection",
    "restore_or_create_state",
    "save_checkpoint",
    "stop_requests",
    "train",
    "train_one_step",
]

# A run whose logged steps waited for their input batches this share of the time or more, over
# INPUT_BOUND_SECONDS of them at least (one interval's share swings with the host's hiccups), is
# input-bound: the progress bar shows the share, and the run warns once.
INPUT_BOUND = 0.5
INPUT_BOUND_SECONDS = 30.0

# Metrics logged from wall-clock time; they differ between runs and are not reproducible.
TIMING_METRICS = (
    "step_time_s",
    "examples_per_s",
    "input_wait_fraction",
    "beside_compile",
    "beside_save",
)


class BatchSource(Protocol):
    """Training batches as a function of the step.

    ``global_batch_size`` is the batch of one step summed over processes; ``iterate(start)`` yields
    this process's share of the batches of steps ``start, start + 1, ...`` (numpy dicts).
    """

    global_batch_size: int

    def iterate(self, start_step: int) -> Iterable[Mapping[str, np.ndarray]]: ...


class TrainResult(NamedTuple):
    """What :func:`train` returns.

    Attributes:
      state: the final state (frozen form if the freeze happened).
      eval_metrics: the final evaluation (``{}`` without ``eval_data``).
      start_step: the step this run started from (> 0 when it resumed from a checkpoint).
    """

    state: TrainState
    eval_metrics: dict
    start_step: int


class _NullWriter:
    def write(self, *args, **kwargs):
        pass

    def logged(self, step, kind):
        return False

    def flush(self):
        pass

    def close(self):
        pass


class Interrupted(KeyboardInterrupt):
    """What :func:`train` raises when a signal asked it to stop, once the step is checkpointed.

    Attributes:
      signum: that signal, ``signal.SIGINT`` or ``signal.SIGTERM`` (scripts exit 128 + signum).
    """

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class StopRequest:
    """The first SIGINT/SIGTERM received (``signum``, None before any)."""

    signum: int | None = None

    def is_set(self) -> bool:
        return self.signum is not None


@contextlib.contextmanager
def stop_requests():
    """A :class:`StopRequest` set by the first SIGINT/SIGTERM, so the loop can stop after the
    current step and save; a second SIGINT interrupts at once. Signal handlers only exist in the
    main thread."""
    flag = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = {}

    def handler(signum, frame):
        if flag.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt(
                "a second Ctrl-C stopped the run at once; the last checkpoint is kept"
            )
        if not flag.is_set():
            flag.signum = signum

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)
    try:
        yield flag
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


@jax.tree_util.register_pytree_node_class
class PackedMetrics:
    """One step's scalar metrics as one array: ``values[n]`` (float32, float64 if any metric is)
    with their ``names`` as static data. A step that returned its metrics as a dict of scalars
    gave every one its own output buffer, created at each step and fetched one by one at each
    record: 2-10 us per metric per step on the 2-core host, where the MLP suite's search step has
    16 metrics (six gate metrics per layer) and its frozen step 3 metrics in 0.3-0.4 ms."""

    def __init__(self, names: tuple[str, ...], values):
        self.names, self.values = names, values

    @classmethod
    def pack(cls, metrics: Mapping[str, jax.Array]) -> PackedMetrics:
        """``metrics`` (scalars) as one array, by name (the order of a dict a jitted function
        returns)."""
        names = tuple(sorted(metrics))
        wide = any(jnp.result_type(v) == np.float64 for v in metrics.values())
        dtype = np.float64 if wide else np.float32
        values = [jnp.asarray(metrics[name], dtype) for name in names]
        return cls(names, jnp.stack(values) if values else jnp.zeros((0,), dtype))

    def unpack(self) -> dict:
        """``{name: value}`` (on the host after ``jax.device_get``: numpy scalars)."""
        return dict(zip(self.names, self.values))

    def tree_flatten(self):
        return (self.values,), self.names

    @classmethod
    def tree_unflatten(cls, names, children):
        return cls(names, *children)


def packed(train_step: Callable) -> Callable:
    """``train_step`` with its metrics as :class:`PackedMetrics`."""

    @functools.wraps(train_step)
    def step(state, batch):
        state, metrics = train_step(state, batch)
        return state, PackedMetrics.pack(metrics)

    return step


class Programs(NamedTuple):
    """A run's jitted functions, parameters replicated and batches split over the mesh.

    Attributes:
      train_step: ``(state, batch) -> (state, metrics)``, one optimizer step; donates ``state``;
        ``metrics`` a :class:`PackedMetrics`.
      eval_step: ``(state, batch) -> sums``, the task's additive evaluation sums of a batch.
      freeze: ``state -> state``, the frozen form (params, collections and optimizer state).
      enter_working_set: ``state -> state``, the working-set form
        (:func:`~dynadiag_jax.training.enter_working_set`), or None (the run has none).
      refresh_working_set: ``state -> state``, the working sets moved to the top ``W`` by alpha
        (:func:`~dynadiag_jax.training.refresh_working_set`; donates ``state``), or None.
    """

    train_step: Callable
    eval_step: Callable
    freeze: Callable
    enter_working_set: Callable | None = None
    refresh_working_set: Callable | None = None


def jit_programs(
    model: nn.Module,
    optimizer,
    task,
    mesh,
    *,
    gate=None,
    trained=None,
    working_set: WorkingSet | None = None,
) -> Programs:
    """The jitted step, evaluation and freeze of a run (each compiles at its first call);
    ``trained``: the step differentiates only these params (:func:`make_train_step`);
    ``working_set``: also the switch to the working-set form and its refresh."""
    rep, data_sharding = replicated(mesh), batch_sharded(mesh)
    enter = refresh = None
    if working_set is not None:
        enter = jax.jit(
            functools.partial(enter_working_set, factor=working_set.factor),
            in_shardings=rep,
            out_shardings=rep,
        )
        refresh = jax.jit(
            refresh_working_set, in_shardings=rep, out_shardings=rep, donate_argnums=0
        )
    return Programs(
        train_step=jax.jit(
            packed(make_train_step(model, optimizer, task, gate=gate, trained=trained)),
            in_shardings=(rep, data_sharding),
            out_shardings=(rep, rep),
            donate_argnums=0,
        ),
        eval_step=jax.jit(
            make_eval_step(model, task), in_shardings=(rep, data_sharding), out_shardings=rep
        ),
        freeze=jax.jit(freeze_state, in_shardings=rep, out_shardings=rep),
        enter_working_set=enter,
        refresh_working_set=refresh,
    )


def finetune_programs(
    finetune: Finetune | None, abstract: TrainState, task, mesh, *, example_input, seed: int
) -> tuple[Programs | None, Callable | None, TrainState | None]:
    """``(programs, enter, abstract state)`` of a run's fine-tuning phase (all None without one):
    its jitted step (differentiating only ``finetune.trained``) and evaluation, the jitted
    switch ``state -> state`` (:func:`enter_finetune`) and the phase's abstract state, reached
    from ``abstract`` (the run's initial state) through the freeze if it is searching."""
    if finetune is None:
        return None, None, None
    rep = replicated(mesh)
    programs = jit_programs(
        finetune.model, finetune.optimizer, task, mesh, trained=tuple(finetune.trained)
    )
    enter = jax.jit(
        functools.partial(enter_finetune, phase=finetune, example_input=example_input, seed=seed),
        in_shardings=rep,
        out_shardings=rep,
    )
    frozen = jax.eval_shape(freeze_state, abstract) if is_searching(abstract.params) else abstract
    return programs, enter, jax.eval_shape(enter, frozen)


def compile_ahead(
    ahead: CompileAhead,
    programs: Programs,
    state,
    batch,
    mesh,
    *,
    searching: bool,
    steps: bool = False,
    evaluates: bool = False,
    freezes: bool = False,
    eval_data: Iterable | None = None,
    enters: bool = False,
    evaluates_working_set: bool = False,
) -> None:
    """Submit to ``ahead`` the programs a run will call, in the order it calls them.

    Names: ``("step", phase)``, ``("eval", phase)`` with ``phase`` the state's :func:`phase_key`
    (``searching``, or ``"working_set"``), ``"enter_working_set"``, ``"refresh_working_set"`` and
    ``"freeze"``; the loop waits for a name before the call it stands for
    (:meth:`CompileAhead.wait`).

    Args:
      ahead: the run's :class:`CompileAhead`.
      programs: the run's :class:`Programs`.
      state: the state (or its ``jax.eval_shape``) of the phase the run is in.
      batch: the training batch's :func:`abstract_batch` (shapes, dtypes and shardings are all a
        compile needs: nothing is transferred).
      mesh: the run's mesh (the state is replicated over it).
      searching: whether ``state`` is in the search phase.
      steps: the training step of this phase.
      evaluates: the evaluation of this phase (needs ``eval_data``).
      freezes: the freeze, and the frozen phase's step and (with ``eval_data``) evaluation.
      eval_data: the run's evaluation batches; the first is read on the worker thread.
      enters: the switch to the working-set form (``programs.enter_working_set``), that form's
        step and refresh; ``freezes`` then freezes from that form.
      evaluates_working_set: the evaluation of the working-set form.
    """
    rep = replicated(mesh)
    now = _abstract(state, rep)
    key = phase_key(now, searching)

    def eval_batch():
        return step_batch(next(iter(eval_data)), mesh)

    if steps:
        ahead.submit(("step", key), programs.train_step, now, batch)
    if evaluates and eval_data is not None:
        ahead.submit(("eval", key), programs.eval_step, now, eval_batch)
    if enters:
        before, now = now, _abstract(jax.eval_shape(programs.enter_working_set, now), rep)
        ahead.submit("enter_working_set", programs.enter_working_set, before)
        ahead.submit(("step", "working_set"), programs.train_step, now, batch)
        ahead.submit("refresh_working_set", programs.refresh_working_set, now)
        if evaluates_working_set and eval_data is not None:
            ahead.submit(("eval", "working_set"), programs.eval_step, now, eval_batch)
    if freezes:
        frozen = _abstract(jax.eval_shape(freeze_state, now), rep)
        ahead.submit("freeze", programs.freeze, now)
        ahead.submit(("step", False), programs.train_step, frozen, batch)
        if eval_data is not None:
            ahead.submit(("eval", False), programs.eval_step, frozen, eval_batch)


def phase_key(state, searching: bool):
    """``"working_set"`` for a state in the working-set form, else ``searching``: the phase part
    of :func:`compile_ahead`'s names."""
    return "working_set" if searching and has_working_set(state.collections) else searching


class MetricSums:
    """The training metrics since the last record.

    Host sums ``{name: [sum, count]}``, and the device arrays of the steps not fetched yet (fetched
    together at the next record or save, so that steps are dispatched without waiting). A
    checkpoint keeps :meth:`totals`, so the first record after a resume averages the same steps as
    without the resume.

    Args:
      totals: the sums to continue from (a checkpoint's), or None.
    """

    def __init__(self, totals: Mapping[str, Sequence[float]] | None = None):
        self._totals = {name: list(total) for name, total in (totals or {}).items()}
        self._pending = []

    def add(self, metrics: Mapping[str, jax.Array] | PackedMetrics) -> None:
        """One step's scalar metrics (left on the device until the next fold)."""
        self._pending.append(metrics)

    def totals(self) -> dict[str, list]:
        """A copy of ``{name: [sum, count]}`` over the steps added since the last :meth:`means`.

        Added one step at a time in float64, so the sums do not depend on when they are folded (at
        a record, at a save, before or after a resume); a metric counts only the steps that report
        it (per-layer gate metrics stop at the freeze).
        """
        for record in jax.device_get(self._pending):
            if isinstance(record, PackedMetrics):
                record = record.unpack()
            for name, value in record.items():
                total = self._totals.setdefault(name, [0.0, 0])
                total[0] += float(value)
                total[1] += 1
        self._pending.clear()
        return {name: list(total) for name, total in self._totals.items()}

    def means(self) -> dict[str, float]:
        """``{name: sum / count}`` since the last call, which starts the next interval."""
        record = {name: total / count for name, (total, count) in self.totals().items()}
        self._totals.clear()
        return record


class StepTimer:
    """Wall-clock seconds per step since the last :meth:`restart`, leaving out the first step of
    each phase (it includes the compilation), and the share of them spent waiting for the input
    batches fetched through :meth:`fetch`.

    Args:
      clock: ``() -> seconds``.
      busy: ``(start) -> bool``, whether a background compile ran since ``start`` (a time of
        ``clock``), e.g. :meth:`CompileAhead.busy_since`; its answer is logged as
        ``beside_compile`` (1.0 or 0.0), since such an interval's steps shared the cores with it.
      writing: ``(start) -> bool``, whether a checkpoint was written in the background since
        ``start``, e.g. :meth:`Checkpointer.writing_since`; logged as ``beside_save``.
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        busy: Callable[[float], bool] | None = None,
        writing: Callable[[float], bool] | None = None,
    ):
        self._clock, self._busy, self._writing = clock, busy, writing
        self._start, self._steps, self._fresh = clock(), 0, True
        self._wait = None  # seconds in fetch() this interval; None: nothing fetched through it
        self._counted = False  # this interval is in the run's totals
        self.logged_seconds = 0.0  # the logged intervals' time, summed over the run
        self.logged_wait = 0.0  # and the part of it spent in fetch()

    def fetch(self, batches: Iterator):
        """``next(batches)``, the time it blocks counted as waiting for input: steps are
        dispatched asynchronously, so a pipeline that keeps up hands over a prefetched batch at
        once, and one that does not holds the loop here."""
        begin = self._clock()
        batch = next(batches)
        self._wait = (self._wait or 0.0) + self._clock() - begin
        return batch

    def new_phase(self) -> None:
        """The next step compiles another program (the first after the freeze)."""
        self._fresh = True

    def stepped(self, metrics) -> None:
        """Count a dispatched step whose output is ``metrics``; a phase's first step is waited for
        and starts the interval instead."""
        if self._fresh:
            jax.block_until_ready(metrics)
            self._fresh = False
            self.restart()
        else:
            self._steps += 1

    def input_bound(self) -> float | None:
        """The share of the logged steps' time spent waiting for input, once it is at least
        :data:`INPUT_BOUND` over :data:`INPUT_BOUND_SECONDS` of them; else None."""
        if self.logged_seconds < INPUT_BOUND_SECONDS:
            return None
        share = self.logged_wait / self.logged_seconds
        return share if share >= INPUT_BOUND else None

    def restart(self) -> None:
        """Start a new interval: after a record, and after work that is not a step (an evaluation,
        a save)."""
        self._start, self._steps, self._wait, self._counted = self._clock(), 0, None, False

    def rates(self, batch_size: int) -> dict[str, float]:
        """``step_time_s``, ``examples_per_s``, ``input_wait_fraction`` (when batches came through
        :meth:`fetch`) and (with ``busy``, ``writing``) ``beside_compile`` and ``beside_save`` of
        the interval (``{}`` before a timed step)."""
        if not self._steps:
            return {}
        elapsed = self._clock() - self._start
        rates = {
            "step_time_s": elapsed / self._steps,
            "examples_per_s": batch_size * self._steps / elapsed,
        }
        if self._wait is not None:
            rates["input_wait_fraction"] = min(1.0, self._wait / elapsed)
            if not self._counted:
                self.logged_seconds += elapsed
                self.logged_wait += self._wait
                self._counted = True
        if self._busy is not None:
            rates["beside_compile"] = float(self._busy(self._start))
        if self._writing is not None:
            rates["beside_save"] = float(self._writing(self._start))
        return rates


def train_one_step(
    train_step, state: TrainState, local_batch, mesh, sums: MetricSums, timer: StepTimer
) -> TrainState:
    """Take one optimizer step on this process's share of the global batch; its metrics go to
    ``sums`` and its time to ``timer``."""
    state, metrics = train_step(state, step_batch(local_batch, mesh))
    sums.add(metrics)
    timer.stepped(metrics)
    return state


def log_train(
    writer,
    step: int,
    sums: MetricSums,
    timer: StepTimer,
    *,
    batch_size: int,
    learning_rate: Callable | None = None,
    task=None,
) -> dict:
    """Write and return the ``"train"`` record of ``step``: the metrics averaged since the last
    record (through ``task.summarise_train`` where the task has one, e.g. a language model's
    perplexity of the mean loss), the step time, and the learning rate of the step just taken
    (``learning_rate(step - 1)``). Starts the next interval of ``sums`` and ``timer``."""
    record = sums.means()
    summarise = getattr(task, "summarise_train", None)
    if summarise is not None:
        record = summarise(record)
    record.update(timer.rates(batch_size))
    if learning_rate is not None:
        record["learning_rate"] = float(learning_rate(step - 1))
    writer.write(step, "train", record)
    timer.restart()
    return record


def evaluate(eval_step, state: TrainState, eval_data: Iterable, mesh, task) -> dict:
    """Run the jitted ``eval_step`` over ``eval_data`` and summarise with ``task.summarise``.
    Each host batch passes ``task.check_batch`` first, where the task has one (a label no class
    of the task's gave a NaN loss)."""
    total = None
    check = getattr(task, "check_batch", None)
    for local in eval_data:
        if check is not None:
            try:
                check(local)
            except ValueError as e:
                raise ValueError(f"eval_data: {e}") from None
        # said by name: JAX's IndivisibleError named a sharding, not eval_data
        rows = global_batch_shape(np.shape(jax.tree.leaves(local)[0]), mesh)[0]
        check_batch_size(rows, mesh, name="an eval_data batch's rows")
        sums = eval_step(state, step_batch(local, mesh))
        total = sums if total is None else jax.tree.map(lambda a, b: a + b, total, sums)
    if total is None:
        raise ValueError("eval_data yielded no batches")
    return task.summarise(jax.device_get(total))


def record_selection(writer, state: TrainState) -> None:
    """Write a ``"selection"`` record: each layer's current top-K offsets (the kept ones once
    frozen)."""
    writer.write(int(state.step), "selection", {"offsets": kept_offsets(state.collections)})


@jax.jit
def all_finite(tree) -> jax.Array:
    """Whether every floating entry of ``tree`` is finite (a bool scalar)."""
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.asarray(True)


def save_checkpoint(
    ckpt: Checkpointer | None,
    writer,
    state: TrainState,
    *,
    run_info: Mapping[str, Any],
    frozen: bool,
    sums: MetricSums,
    finetune: bool = False,
) -> None:
    """Save ``state`` with what a resume needs besides it: the run's description, the phase
    (``frozen``, ``finetune``: in the fine-tuning phase; ``working_set`` when the state is in the
    working-set form, read from it) and the metric sums not logged yet. The
    log is flushed first, so that every record up to the checkpoint's step is on disk when it
    commits (a resume keeps those). Nothing without ``ckpt``.
    """
    if ckpt is None:
        return
    writer.flush()
    meta = {"run": run_info, "frozen": frozen, "interval": sums.totals()}
    if has_working_set(state.collections):
        meta["working_set"] = True
    ckpt.save(state, meta={**meta, "finetune": True} if finetune else meta)


def restore_or_create_state(
    ckpt: Checkpointer | None,
    init: Callable,
    abstract: TrainState,
    run_info: Mapping[str, Any],
    sharding,
    initial_variables=None,
    finetuned=None,
    *,
    step: int | None,
    working_set: WorkingSet | None = None,
) -> tuple[TrainState, int | None, MetricSums]:
    """The state of checkpoint ``step``, or a fresh one.

    Args:
      ckpt: where checkpoints are (only read with a ``step``).
      init: ``variables -> TrainState``, the run's ``create_train_state``.
      abstract: ``jax.eval_shape(init, initial_variables)``; a checkpoint is restored into it, or
        into its frozen form if the checkpoint was written after the freeze.
      run_info: the run's description as a checkpoint stores it (after a JSON round trip).
      sharding: the state's sharding.
      initial_variables: passed to ``init`` for a fresh state (an argument of the compiled init,
        not a constant).
      finetuned: the abstract state of the run's fine-tuning phase (None: it has none); a
        checkpoint written in that phase is restored into it.
      step: the checkpoint to restore (the caller's ``ckpt.latest_step()``), or None for a fresh
        state. If it cannot be read (a file truncated or deleted after its commit), the newest
        earlier committed step that can is restored instead, with a warning naming the step and
        why, and the unreadable steps are renamed out of the way (:meth:`Checkpointer.set_aside`:
        kept, and the run can save those steps again). Once the newest step is restored, steps
        beyond the checkpointer's ``max_to_keep`` (left by a kill between a save and Orbax's
        deletion) are deleted.
      working_set: the run's working-set option; a checkpoint written in the working-set form is
        restored into ``abstract``'s working-set form of this factor.

    Returns:
      ``(state, step, sums)``: the checkpoint's state, step and metric sums; or the fresh state,
      None and empty sums.

    Raises:
      CheckpointMismatch: the checkpoint was written with another ``run_info`` or other shapes
        (before any array is read or anything compiled).
      UnreadableCheckpoint: no committed step up to ``step`` can be read (the message names
        ``step``; nothing is renamed).
    """
    if step is None:
        return jax.jit(init, out_shardings=sharding)(initial_variables), None, MetricSums()
    unreadable = []
    for candidate in sorted((s for s in ckpt.all_steps() if s <= step), reverse=True):
        try:
            state, sums = _restore_step(
                ckpt, candidate, abstract, run_info, sharding, finetuned, working_set
            )
        except UnreadableCheckpoint as e:
            unreadable.append(e)
            continue
        for e in unreadable:
            kept = ckpt.set_aside(e.step)
            logging.getLogger(__name__).warning(
                "checkpoint %s step %d cannot be read (%s); resuming from step %d, the "
                "unreadable step kept as %s",
                ckpt.directory,
                e.step,
                e.reason,
                candidate,
                kept,
            )
        if candidate == max(ckpt.all_steps()):
            ckpt.drop_surplus()
        return state, candidate, sums
    newest, *earlier = unreadable
    advice = RESUME_ADVICE
    if earlier:
        steps = ", ".join(str(e.step) for e in earlier)
        advice += (
            f" (the earlier step{'s' if len(earlier) > 1 else ''} {steps} cannot be read either)"
        )
    raise UnreadableCheckpoint(ckpt.directory, newest.step, newest.reason, advice)


def _restore_step(ckpt, step, abstract, run_info, sharding, finetuned, working_set):
    """``(state, metric sums)`` of checkpoint ``step``, as :func:`restore_or_create_state` takes
    them (its checks and its choice of the stored form included)."""
    meta = ckpt.check_run(step, run_info)
    target = abstract
    if meta.get("finetune"):
        if finetuned is None:
            raise CheckpointMismatch(
                f"checkpoint {ckpt.directory}/{step} was written in a fine-tuning phase, which "
                "this run does not have: use another workdir"
            )
        target = finetuned
    elif meta.get("frozen") and is_searching(abstract.params):
        target = jax.eval_shape(freeze_state, abstract)
    elif meta.get("working_set"):
        if working_set is None:
            raise CheckpointMismatch(
                f"checkpoint {ckpt.directory}/{step} was written in the working-set form, and "
                "this run has no working_set: resume with the one it was written with"
            )
        target = jax.eval_shape(
            functools.partial(enter_working_set, factor=working_set.factor), abstract
        )
    state = ckpt.restore(step, _abstract(target, sharding))
    return state, MetricSums(meta.get("interval"))


def _abstract(tree, sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


class Events(NamedTuple):
    """What the loop does after a step, in this order: write the training record, evaluate,
    switch to the working-set form or refresh it, freeze, start the fine-tuning phase, write a
    selection record, save."""

    log: bool
    evaluate: bool
    enter_working_set: bool
    refresh_working_set: bool
    freeze: bool
    finetune: bool
    select: bool
    save: bool


class Schedule(NamedTuple):
    """When the loop does what: every ``*_every`` is a period in steps, 0 for never
    (``eval_every`` is 0 without evaluation data); ``finetune_step``: the step the fine-tuning
    phase starts at (None: the run has none); ``working_set_step``: the step the search switches
    to the working-set form at (None: never), refreshed every ``refresh_every`` steps after it
    until the freeze."""

    num_steps: int
    freeze_step: int | None
    log_every: int
    eval_every: int
    selection_every: int
    checkpoint_every: int
    finetune_step: int | None = None
    working_set_step: int | None = None
    refresh_every: int = 0

    def after(self, step: int, searching: bool, tuning: bool = False) -> Events:
        """The events after step ``step``; ``searching``: the state is not frozen yet;
        ``tuning``: it is in the fine-tuning phase.

        The last step is logged, but evaluated and saved only after the loop: its checkpoint comes
        before the final evaluation (a failing evaluation then costs a rerun of itself, not of the
        steps), and a run resumed from it writes that evaluation's record if the log lacks it. The
        freeze step saves the frozen state, and its selection record is what the freeze kept. The
        fine-tuning phase's start is evaluated (the model before it; the loop evaluates only with
        evaluation data) and saved once switched. The working set is not refreshed at the freeze
        (the freeze reads all ``P`` candidates anyway).
        """
        last = step == self.num_steps
        freeze = searching and step == self.freeze_step
        finetune = not tuning and step == self.finetune_step
        ws = self.working_set_step
        in_working_set = searching and ws is not None and step > ws
        return Events(
            log=_every(step, self.log_every) or last,
            evaluate=(_every(step, self.eval_every) or finetune) and not last,
            enter_working_set=searching and step == ws,
            refresh_working_set=in_working_set
            and not freeze
            and _every(step - ws, self.refresh_every),
            freeze=freeze,
            finetune=finetune,
            select=bool(self.selection_every)
            and (freeze or (searching and _every(step, self.selection_every))),
            save=not last and (freeze or finetune or _every(step, self.checkpoint_every)),
        )

    def evaluates_between(self, step: int, end: int) -> bool:
        """Whether a step in ``(step, end]`` is followed by an evaluation of the state it left
        (the periodic ones; the final one comes after the loop)."""
        if not self.eval_every:
            return False
        next_eval = (step // self.eval_every + 1) * self.eval_every
        return next_eval <= end and next_eval < self.num_steps


def _every(step: int, period: int) -> bool:
    return bool(period) and step % period == 0


def _check_args(
    num_steps,
    freeze_step,
    eval_every,
    checkpoint_every,
    log_every,
    selection_every,
    workdir,
    finetune=None,
    working_set=None,
):
    int_at_least(num_steps, "num_steps", 1)
    for name, v in (
        ("eval_every", eval_every),
        ("checkpoint_every", checkpoint_every),
        ("log_every", log_every),
        ("selection_every", selection_every),
    ):
        int_at_least(v, f"{name} (0 disables it)", 0)
    if freeze_step is not None and int_at_least(freeze_step, "freeze_step", 0) > num_steps:
        raise ValueError(
            f"freeze_step must be None or in [0, num_steps={num_steps}], got {freeze_step!r}"
        )
    if checkpoint_every and workdir is None:
        raise ValueError("checkpoint_every needs a workdir to write checkpoints to")
    if finetune is not None:
        if not isinstance(finetune, Finetune):
            raise TypeError(f"finetune must be a Finetune or None, got {type(finetune).__name__}")
        start = finetune.start_step
        if not (isinstance(start, (int, np.integer)) and 0 <= start < num_steps):
            raise ValueError(
                f"finetune.start_step must be an integer in [0, num_steps={num_steps}), "
                f"got {start!r}"
            )
        if freeze_step is not None and start < freeze_step:
            raise ValueError(
                f"finetune.start_step={start} comes before freeze_step={freeze_step}: the "
                "fine-tuning phase starts from the frozen model"
            )
        compile_patterns(finetune.trained, "finetune.trained")
    if working_set is not None:
        if not isinstance(working_set, WorkingSet):
            raise TypeError(
                f"working_set must be a WorkingSet or None, got {type(working_set).__name__}"
            )
        start = working_set.check().start_step
        end = freeze_step if freeze_step is not None else num_steps
        if start >= end:
            raise ValueError(
                f"working_set.start_step={start} must come before "
                f"{'freeze_step' if freeze_step is not None else 'num_steps'}={end}: the working "
                "set is a form of the search phase"
            )


def _check_kinds(
    model,
    optimizer,
    task,
    train_data,
    example_input,
    seed,
    eval_data,
    gate,
    workdir,
    keep_checkpoints,
    learning_rate,
    hooks,
    initial_variables,
):
    """What :func:`train` takes besides the step counts, periods and phases
    (:func:`_check_args`), each checked before anything is traced: an argument of the wrong kind
    would otherwise fail deep in JAX or pathlib, or only after the first step (a hook)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a flax.linen Module, got {type(model).__name__}")
    if not all(callable(getattr(optimizer, m, None)) for m in ("init", "update")):
        raise TypeError(
            "optimizer must be an optax GradientTransformation (init and update), "
            f"got {type(optimizer).__name__}"
        )
    # The evaluation's methods are called only with eval_data.
    methods = ("train_inputs", "loss")
    if eval_data is not None:
        methods += ("eval_inputs", "eval_sums", "summarise")
    missing = [m for m in methods if not callable(getattr(task, m, None))]
    if missing:
        raise TypeError(
            f"task must be a task such as Classification or LanguageModeling, got "
            f"{type(task).__name__} (without {', '.join(missing)})"
        )
    if not (
        hasattr(train_data, "global_batch_size") and callable(getattr(train_data, "iterate", None))
    ):
        raise TypeError(
            "train_data must be a BatchSource (global_batch_size and iterate(start_step)), such "
            f"as dynadiag_jax.data.ArrayBatches, got {type(train_data).__name__}"
        )
    if not (hasattr(example_input, "shape") and hasattr(example_input, "dtype")):
        raise TypeError(
            "example_input must be an array or a jax.ShapeDtypeStruct, "
            f"got {type(example_input).__name__}"
        )
    int_in_range(seed, "seed", -(2**63), 2**63 - 1)
    if eval_data is not None and not isinstance(eval_data, Iterable):
        raise TypeError(
            f"eval_data must be re-iterable batches or None, got {type(eval_data).__name__}"
        )
    if isinstance(eval_data, Iterator):  # each evaluation, and the compile ahead, iterate it
        raise TypeError(
            f"eval_data must be re-iterable batches (a list, dynadiag_jax.data.EvalBatches), "
            f"got a one-shot iterator ({type(eval_data).__name__}): the first evaluation would "
            "use it up"
        )
    if gate is not None and not isinstance(gate, GateSchedule):
        raise TypeError(f"gate must be a GateSchedule or None, got {type(gate).__name__}")
    if workdir is not None and not isinstance(workdir, (str, os.PathLike)):
        raise TypeError(
            f"workdir must be a path (str or os.PathLike) or None, got {type(workdir).__name__}"
        )
    if workdir is not None and not os.fspath(workdir):
        # "" once meant no checkpoints yet metrics.jsonl in the current directory
        raise ValueError("workdir must be a directory path or None (no workdir), got ''")
    int_at_least(keep_checkpoints, "keep_checkpoints", 1)
    if learning_rate is not None and not callable(learning_rate):
        raise TypeError(
            "learning_rate must be a schedule step -> rate (only logged) or None, "
            f"got {type(learning_rate).__name__}"
        )
    if not isinstance(hooks, Sequence) or isinstance(hooks, str):
        raise TypeError(
            f"hooks must be a sequence of hook(step, state), got {type(hooks).__name__}"
        )
    for i, hook in enumerate(hooks):
        if not callable(hook):
            raise TypeError(f"hooks[{i}] must be callable as hook(step, state), got {hook!r}")
    if initial_variables is not None:
        check_variables(initial_variables, "initial_variables", "train")


def train(
    *,
    model: nn.Module,
    optimizer: optax.GradientTransformation,
    task,
    train_data: BatchSource,
    num_steps: int,
    example_input,
    seed: int,
    eval_data: Iterable | None = None,
    eval_every: int = 0,
    freeze_step: int | None = None,
    gate: GateSchedule | None = None,
    workdir=None,
    checkpoint_every: int = 0,
    keep_checkpoints: int = 3,
    run_info: Mapping[str, Any] | None = None,
    log_every: int = 50,
    selection_every: int = 0,
    learning_rate: Callable | None = None,
    mesh=None,
    progress: bool = True,
    tensorboard: bool = True,
    hooks: Sequence[Callable[[int, TrainState], None]] = (),
    initial_variables=None,
    finetune: Finetune | None = None,
    working_set: WorkingSet | None = None,
    compile_first: bool = False,
) -> TrainResult:
    """Train ``model`` for ``num_steps`` optimizer steps (resuming from ``workdir`` if possible).

    Args:
      model: flax.linen model called as ``model(x, train=bool)``.
      optimizer: optax transformation (e.g. :func:`dynadiag_jax.training.adamw`).
      task: :class:`~dynadiag_jax.training.Classification` or ``LanguageModeling``.
      train_data: a :class:`BatchSource`.
      num_steps: total optimizer steps of the run (not of this invocation).
      example_input: array or ``jax.ShapeDtypeStruct`` with the model input's global shape.
      seed: seeds initialisation, dropout and augmentation.
      eval_data: re-iterable evaluation batches with a ``"mask"`` (padding), or ``None``.
      eval_every: evaluate every this many steps (and always at the end).
      freeze_step: the step at which DiagonalDense layers switch to the frozen form (the state
        with ``step == freeze_step`` and every later one is frozen); ``None``: never.
      gate: the gate schedule of the search phase (required when the model has search-phase
        layers).
      workdir: directory for ``checkpoints/``, ``metrics.jsonl`` and TensorBoard events;
        ``None``: nothing is written (``""`` is refused).
      checkpoint_every: save every this many steps (and at the freeze, at the end and on
        SIGINT/SIGTERM).
      keep_checkpoints: how many checkpoints to keep.
      run_info: JSON-able description of the run (model, sparsity, recipe, ...), stored with
        checkpoints; a checkpoint written with another description (or seed) is not resumed.
      log_every: write training metrics every this many steps (averaged over the interval).
      selection_every: record each layer's current top-K diagonals every this many search steps
        (``"selection"`` records in ``metrics.jsonl``; also at step 0 and at the freeze).
      learning_rate: the learning-rate schedule, only to log its value.
      mesh: device mesh with a ``"data"`` axis (default: every device).
      progress: show a tqdm progress bar (on the first process).
      tensorboard: also write TensorBoard events.
      hooks: ``hook(step, state)`` called after every completed step.
      initial_variables: the model's variables to start from instead of its init (e.g.
        :func:`dynadiag_jax.from_dense`'s, to fine-tune); a checkpoint in ``workdir`` still
        wins, so an interrupted fine-tune resumes.
      finetune: the run's last phase (:class:`~dynadiag_jax.training.Finetune`, e.g. LoRA-FA
        adapters on the frozen model), from its ``start_step`` to ``num_steps``: the state
        switches to it (:func:`~dynadiag_jax.training.enter_finetune`) after an evaluation of the
        model before it, is saved, and trains only the phase's params with its optimizer;
        checkpoints of the phase resume into it.
      working_set: a :class:`~dynadiag_jax.training.WorkingSet` (None: off): at its
        ``start_step`` (after ``gate.rescore_step``) the search switches to the working-set form
        (:func:`~dynadiag_jax.training.enter_working_set`), in which each step is ``W``-sized, and
        refreshes it every ``refresh_every`` steps (a separate program) until the freeze, which
        starts from the plain form rebuilt; checkpoints of that form resume into it.
      compile_first: after the first step, wait until every later program (evaluation, freeze,
        the next phase's step) is compiled before taking the second. By default they compile on a
        background thread while the run trains, which is faster over the whole run but shares the
        cores with the steps: on a small host the logged ``step_time_s`` of those intervals is
        then the steps' time beside a compile (each record says so in ``beside_compile``). With
        ``compile_first`` no logged interval is; Orbax's background writes of the checkpoints
        still share the cores with the steps after a save (``beside_save``).

    Returns:
      A :class:`TrainResult`.

    Raises:
      TypeError: a step count, period or seed that is not an int, or an argument of the wrong kind
        (a model that is not a Module, a train_data that is not a BatchSource, a hook not callable,
        an eval_data that is a one-shot iterator).
      ValueError: a step count or period out of range, other bad arguments, a training or
        evaluation batch size not divisible by the device count, a first batch the task refuses
        (``check_batch``: labels that are no class) or whose model inputs differ from
        ``example_input`` beyond the first axis; a ``train_data`` that runs out before
        ``num_steps`` (its last step saved);
        :class:`CheckpointMismatch` (a ``ValueError``): the newest checkpoint in ``workdir`` was
        written with another ``run_info``, seed or model shape, or past ``num_steps``, no
        committed checkpoint there can be read (one that cannot while an earlier one can is set
        aside, with a warning, and the run resumes from the earlier one), or ``workdir`` cannot
        hold checkpoints (a file, not writable) — all before anything is compiled.
      Interrupted: (a ``KeyboardInterrupt``) after SIGINT/SIGTERM, once the current step is
        checkpointed; its ``signum`` says which.
    """
    _check_args(
        num_steps,
        freeze_step,
        eval_every,
        checkpoint_every,
        log_every,
        selection_every,
        workdir,
        finetune,
        working_set,
    )
    _check_kinds(
        model,
        optimizer,
        task,
        train_data,
        example_input,
        seed,
        eval_data,
        gate,
        workdir,
        keep_checkpoints,
        learning_rate,
        hooks,
        initial_variables,
    )
    mesh = data_mesh() if mesh is None else mesh
    check_batch_size(train_data.global_batch_size, mesh, name="batch_size")
    # what can be known of the evaluation's batches without reading them: said now, not at the
    # first evaluation (the end of the run by default)
    if hasattr(eval_data, "global_batch_size"):
        check_batch_size(eval_data.global_batch_size, mesh, name="eval_data's batch size")
    elif isinstance(eval_data, Sequence):
        for batch in eval_data:
            # this process's share of each batch: the global batch is every process's
            rows = {np.shape(v)[0] for v in jax.tree.leaves(batch) if np.ndim(v)}
            for n in sorted(rows):
                check_batch_size(
                    global_batch_shape((n,), mesh)[0], mesh, name="an eval_data batch's rows"
                )

    def init(variables):
        return create_train_state(model, optimizer, example_input, seed=seed, variables=variables)

    abstract = jax.eval_shape(init, initial_variables)
    sparse = is_searching(abstract.params)
    if sparse and gate is None:
        raise ValueError(
            "the model has DiagonalDense layers in the search phase: pass gate=GateSchedule(...)"
        )
    if gate is not None:
        gate.check()
        end = num_steps if freeze_step is None else freeze_step
        if sparse and gate.rescore_step and gate.rescore_step >= end:  # 0: never
            # the restart runs only while the layers search: it would never come
            raise ValueError(
                f"gate.rescore_step={gate.rescore_step} must come before "
                f"{'freeze_step' if freeze_step is not None else 'num_steps'}={end}"
            )
    if sparse and finetune is not None and freeze_step is None:
        raise ValueError("a fine-tuning phase needs the frozen model: pass freeze_step")
    if working_set is not None:
        if not sparse:
            raise ValueError(
                "working_set needs DiagonalDense layers in the search phase; this model has none"
            )
        if gate.rescore_step and working_set.start_step <= gate.rescore_step:
            raise ValueError(
                f"working_set.start_step={working_set.start_step} must come after "
                f"gate.rescore_step={gate.rescore_step}: the restart of alpha reads all P values"
            )
    info = {**dict(run_info or {}), "seed": int(seed)}
    if working_set is not None:
        info["working_set"] = [float(working_set.factor), *working_set[1:]]
    # As the checkpoint's JSON gives it back (tuples become lists), to compare on resume.
    run_info = json.loads(json.dumps(info))
    is_main = jax.process_index() == 0
    schedule = Schedule(
        num_steps,
        freeze_step,
        log_every,
        eval_every if eval_data is not None else 0,
        selection_every,
        checkpoint_every,
        None if finetune is None else finetune.start_step,
        None if working_set is None else working_set.start_step,
        0 if working_set is None else working_set.refresh_every,
    )

    held = contextlib.ExitStack()  # the workdir, for this run alone
    if workdir is not None and is_main:
        held.enter_context(exclusive_workdir(workdir))
    ckpt, writer, ahead = None, _NullWriter(), CompileAhead()
    try:
        if workdir is not None:
            ckpt = Checkpointer(pathlib.Path(workdir) / "checkpoints", max_to_keep=keep_checkpoints)
        programs = jit_programs(model, optimizer, task, mesh, gate=gate, working_set=working_set)
        tuned_programs, enter, tuned_abstract = finetune_programs(
            finetune, abstract, task, mesh, example_input=example_input, seed=seed
        )
        batches = None
        latest = None if ckpt is None else ckpt.latest_step()
        if latest is None:
            # A fresh run: its first step is compiled while its initial state is.
            batches = iter(train_data.iterate(0))
            first = next(batches)
            if hasattr(task, "check_batch"):  # e.g. labels no class of the task's
                task.check_batch(first)
            inputs, _ = jax.eval_shape(lambda b: task.train_inputs(b, jax.random.key(0)), first)
            if hasattr(inputs, "shape") and inputs.shape[1:] != tuple(example_input.shape[1:]):
                raise ValueError(
                    f"example_input has shape {list(example_input.shape)}, but train_data's "
                    f"batches give the model inputs of shape {list(inputs.shape)} (the first "
                    "axis aside, they must agree: the model is built for example_input)"
                )
            batches = itertools.chain([first], batches)
            frozen_first = sparse and freeze_step == 0
            tuned_first = finetune is not None and finetune.start_step == 0
            enters_first = working_set is not None and working_set.start_step == 0
            compile_ahead(
                ahead,
                programs,
                abstract,
                abstract_batch(first, mesh),
                mesh,
                searching=sparse,
                steps=not (frozen_first or tuned_first or enters_first),
                freezes=frozen_first,
                eval_data=eval_data,
                enters=enters_first,
            )
        state, resumed_step, sums = restore_or_create_state(
            ckpt,
            init,
            abstract,
            run_info,
            replicated(mesh),
            initial_variables,
            tuned_abstract,
            step=latest,
            working_set=working_set,
        )
        start = resumed_step or 0
        if start > num_steps:  # it would return that run's state as this one's result
            raise CheckpointMismatch(
                f"the checkpoint at step {start} in {workdir} is past this run's "
                f"num_steps={num_steps}: it was written by a longer run; resume with that run's "
                "settings, or use another workdir"
            )
        if workdir is not None:
            writer = MetricWriter(
                workdir, start_step=resumed_step, tensorboard=tensorboard, enabled=is_main
            )

        searching = is_searching(state.params)
        if searching and freeze_step is not None and start > freeze_step:
            # it would search to the end: the freeze fires only at its step
            raise CheckpointMismatch(
                f"the checkpoint at step {start} in {workdir} is still searching, but this run "
                f"freezes at step {freeze_step}: it was written by a run with a later freeze "
                f"(another freeze step or number of steps); resume with that run's settings, or "
                f"use another workdir"
            )
        # In the phase if the checkpoint was written in it (its params are the phase's form),
        # whatever its step: a checkpoint of the phase's start step may have been saved before
        # the switch, and a finished run given a phase it did not have holds none.
        tuning = (
            finetune is not None
            and resumed_step is not None
            and jax.tree.structure(state.params) == jax.tree.structure(tuned_abstract.params)
        )
        if finetune is not None and not tuning and start > finetune.start_step:
            raise CheckpointMismatch(
                f"the checkpoint at step {start} in {workdir} was written without this run's "
                f"fine-tuning phase, which starts at step {finetune.start_step}: it was written by "
                f"a run without that phase (or with a later one); resume with that run's "
                f"settings, or use another workdir"
            )

        unsaved = []  # the steps whose non-finite parameters were not saved

        def save(state):
            if ckpt is not None and not bool(all_finite(state.params)):
                # a diverged run would rotate every finite checkpoint out (keep_checkpoints)
                if not unsaved:
                    logging.getLogger(__name__).warning(
                        "step %d: the parameters are not finite, so no checkpoint is saved from "
                        "here on (the last saved step, %s, stays in %s)",
                        int(state.step),
                        ckpt.latest_step(),
                        workdir,
                    )
                unsaved.append(int(state.step))
                return
            save_checkpoint(
                ckpt,
                writer,
                state,
                run_info=run_info,
                frozen=not searching and sparse,
                sums=sums,
                finetune=tuning,
            )

        if searching and start == 0 and selection_every:
            record_selection(writer, state)
        if (
            searching
            and working_set is not None
            and working_set.start_step == start
            and not has_working_set(state.collections)
        ):
            ahead.wait("enter_working_set")
            state = programs.enter_working_set(state)
        switched = False  # saved once after both switches: a step is saved only once
        if searching and freeze_step == start:
            ahead.wait("freeze")
            state, searching, switched = programs.freeze(state), False, True
        if finetune is not None and not tuning and finetune.start_step == start:
            state, tuning, switched = enter(state), True, True
        if switched:
            save(state)

        # Updated where the form changes, not read from the state's collections every step (a
        # flatten of them: about 20 us of a 0.6 ms MLP search step).
        key_now = phase_key(state, searching)

        def phase():
            """The programs and compile-ahead key of the phase the run is in."""
            if tuning:
                return tuned_programs, "finetune"
            return programs, key_now

        def phase_learning_rate():
            """The schedule to log: the fine-tuning phase's counts from its start."""
            if not tuning:
                return learning_rate
            rate = finetune.learning_rate
            return None if rate is None else (lambda t: rate(t - finetune.start_step))

        def rest_of_run_ahead(state, batch):
            # After the phase's first step, so that its compile does not compete with them.
            freezes = searching and freeze_step is not None
            end = freeze_step if freezes else num_steps
            enters = (
                searching and working_set is not None and not has_working_set(state.collections)
            )
            switch = working_set.start_step if enters else end
            compile_ahead(
                ahead,
                programs,
                state,
                batch,
                mesh,
                searching=searching,
                evaluates=schedule.evaluates_between(step, switch) or not (freezes or enters),
                freezes=freezes,
                eval_data=eval_data,
                enters=enters,
                evaluates_working_set=enters
                and (schedule.evaluates_between(switch, end) or not freezes),
            )

        step, diverged, input_bound = start, False, False
        bar = tqdm.tqdm(
            total=num_steps,
            initial=start,
            unit="step",
            dynamic_ncols=True,
            disable=not (progress and is_main),
            desc="finetune" if tuning else "search" if searching else "train",
        )
        with stop_requests() as request, contextlib.closing(bar):
            stop = StopAgreement(request, last_step=num_steps)
            if batches is None:
                batches = iter(train_data.iterate(start))
            timer = StepTimer(
                busy=ahead.busy_since,
                writing=(lambda start: False) if ckpt is None else ckpt.writing_since,
            )
            while step < num_steps and not stop(step):
                progs, key = phase()
                ahead.wait(("step", key))
                try:
                    local = timer.fetch(batches)
                except StopIteration:  # a bare StopIteration named neither the data nor the step
                    save(state)
                    kept = f"step {step} saved in {workdir}" if workdir else "no workdir"
                    raise ValueError(
                        f"train_data.iterate({start}) ended after {step - start} batches, at step "
                        f"{step} of num_steps={num_steps} ({kept}): it must yield a batch for "
                        "every step"
                    ) from None
                state = train_one_step(progs.train_step, state, local, mesh, sums, timer)
                step += 1
                if step == start + 1 and not tuning:
                    rest_of_run_ahead(state, abstract_batch(local, mesh))
                    if compile_first:
                        for name in ahead.pending():
                            ahead.wait(name)
                        timer.restart()
                events = schedule.after(step, searching, tuning)
                if events.log:
                    record = log_train(
                        writer,
                        step,
                        sums,
                        timer,
                        batch_size=train_data.global_batch_size,
                        learning_rate=phase_learning_rate(),
                        task=task,
                    )
                    loss = record.get("loss")  # a custom task's metrics may not name one
                    postfix = {} if loss is None else {"loss": f"{loss:.4f}"}
                    waiting = timer.input_bound()
                    if waiting is not None:
                        postfix["input wait"] = f"{100 * waiting:.0f}%"
                        if not input_bound:
                            input_bound = True  # said once
                            logging.getLogger(__name__).warning(
                                "the logged steps up to %d waited for input batches %.0f%% of "
                                "the time: the input pipeline, not the model, sets this run's "
                                "speed (more reader threads or processes would help)",
                                step,
                                100 * waiting,
                            )
                    bar.set_postfix(postfix, refresh=False)
                    if not (diverged or loss is None or np.isfinite(loss)):
                        diverged = True  # said once: every later record would repeat it
                        logging.getLogger(__name__).warning(
                            "the training loss is %s in the steps up to %d (learning rate %s); "
                            "the run goes on, but has likely diverged: a lower learning rate, or "
                            "the data? Checkpoints of non-finite parameters are not saved: the "
                            "last finite ones stay",
                            loss,
                            step,
                            record.get("learning_rate", "not logged"),
                        )
                if events.evaluate and eval_data is not None:
                    ahead.wait(("eval", key))
                    writer.write(
                        step, "eval", evaluate(progs.eval_step, state, eval_data, mesh, task)
                    )
                    timer.restart()
                if events.enter_working_set and not has_working_set(state.collections):
                    ahead.wait("enter_working_set")
                    state = programs.enter_working_set(state)
                    key_now = phase_key(state, searching)
                    timer.new_phase()
                if events.refresh_working_set:
                    # timed with the steps around it: its cost is the search's
                    ahead.wait("refresh_working_set")
                    state = programs.refresh_working_set(state)
                if events.freeze:
                    ahead.wait("freeze")
                    state, searching = programs.freeze(state), False
                    key_now = phase_key(state, searching)
                    timer.new_phase()
                    bar.set_description("frozen")
                if events.finetune:
                    state, tuning = enter(state), True
                    timer.new_phase()
                    bar.set_description("finetune")
                if events.select:
                    record_selection(writer, state)
                if events.save:
                    save(state)
                    timer.restart()
                for hook in hooks:
                    hook(step, state)
                bar.update(1)
            # A request during the last step ends the loop as its count does: it still stops the
            # program (it was swallowed, and a caller went on to its next run).
            if stop(step):
                save(state)
                if ckpt is not None:
                    # under the handler: a second Ctrl-C during the save says what it kept,
                    # instead of failing Orbax's save thread after "saved" was printed
                    ckpt.wait()
                last = " (the last; its final evaluation was not run)" if step == num_steps else ""
                if not workdir:
                    kept = "no workdir, nothing saved"
                elif unsaved and unsaved[-1] == step:
                    kept = f"not saved (non-finite parameters; {workdir} keeps step "
                    kept += f"{ckpt.latest_step()})"
                else:
                    kept = f"saved in {workdir}"
                raise Interrupted(
                    f"stopped at step {step} of {num_steps}{last}; {kept}", stop.signum
                )
        # Saved before the final evaluation: an evaluation that fails (a bad validation file)
        # then costs a rerun of the evaluation, not the steps since the last checkpoint.
        save(state)
        eval_metrics = {}
        if eval_data is not None:
            progs, key = phase()
            ahead.wait(("eval", key))
            eval_metrics = evaluate(progs.eval_step, state, eval_data, mesh, task)
            if not writer.logged(step, "eval"):  # a rerun of a finished run has logged it
                writer.write(step, "eval", eval_metrics)
        return TrainResult(state, eval_metrics, start)
    except BaseException:
        # An interrupt (or an error) must not wait for a compile in progress to end.
        ahead.close(wait=False)
        raise
    finally:
        ahead.close()
        writer.close()
        if ckpt is not None:
            ckpt.close()
        held.close()
