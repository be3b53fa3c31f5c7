"""The training loop: search phase, freeze, evaluation, metrics, checkpoints, progress bar.

One function, :func:`train`, used by every script. It takes explicit arguments and never reads a
config. A run with a ``workdir`` resumes from the newest checkpoint there; because data order,
dropout and augmentation depend only on ``(seed, step)`` and the gate schedule only on the step,
a resumed run continues exactly as the uninterrupted one would have; the checkpoint also holds the
sums of the metrics since the last training record, so its log continues exactly too.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import signal
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import flax.linen as nn
import jax
import numpy as np
import optax
import tqdm
from flax import traverse_util

from dynadiag_jax.training.checkpoint import Checkpointer, CheckpointMismatch
from dynadiag_jax.training.metrics import MetricWriter
from dynadiag_jax.training.parallel import (
    batch_sharded,
    check_batch_size,
    data_mesh,
    global_batch,
    replicated,
)
from dynadiag_jax.training.sparsity import GateSchedule, freeze_state, is_searching, kept_offsets
from dynadiag_jax.training.state import TrainState, create_train_state
from dynadiag_jax.training.steps import make_eval_step, make_train_step

__all__ = ["BatchSource", "Interrupted", "TrainResult", "evaluate", "train"]

# Metrics logged from wall-clock time; they differ between runs and are not reproducible.
TIMING_METRICS = ("step_time_s", "examples_per_s")


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


class _StopRequest:
    """The first SIGINT/SIGTERM received (``signum``, None before any)."""

    signum: int | None = None

    def is_set(self) -> bool:
        return self.signum is not None


@contextlib.contextmanager
def _stop_requests():
    """A :class:`_StopRequest` set by the first SIGINT/SIGTERM, so the loop can stop after the
    current step and save; a second SIGINT interrupts at once. Signal handlers only exist in the
    main thread."""
    flag = _StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield flag
        return
    previous = {}

    def handler(signum, frame):
        if flag.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if not flag.is_set():
            flag.signum = signum

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)
    try:
        yield flag
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


def evaluate(eval_step, state: TrainState, eval_data: Iterable, mesh, task) -> dict:
    """Run the jitted ``eval_step`` over ``eval_data`` and summarise with ``task.summarise``."""
    total = None
    for local in eval_data:
        sums = eval_step(state, global_batch(local, mesh))
        total = sums if total is None else jax.tree.map(lambda a, b: a + b, total, sums)
    if total is None:
        raise ValueError("eval_data yielded no batches")
    return task.summarise(jax.device_get(total))


def _abstract(tree, sharding):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)


def _check_args(
    num_steps, freeze_step, eval_every, checkpoint_every, log_every, selection_every, workdir
):
    for name, v in (("num_steps", num_steps),):
        if not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    for name, v in (
        ("eval_every", eval_every),
        ("checkpoint_every", checkpoint_every),
        ("log_every", log_every),
        ("selection_every", selection_every),
    ):
        if not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name} must be an integer >= 0 (0 disables it), got {v!r}")
    if freeze_step is not None and not (
        isinstance(freeze_step, (int, np.integer)) and 0 <= freeze_step <= num_steps
    ):
        raise ValueError(
            f"freeze_step must be None or an integer in [0, num_steps={num_steps}], "
            f"got {freeze_step!r}"
        )
    if checkpoint_every and workdir is None:
        raise ValueError("checkpoint_every needs a workdir to write checkpoints to")


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
      workdir: directory for ``checkpoints/``, ``metrics.jsonl`` and TensorBoard events.
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

    Returns:
      A :class:`TrainResult`.

    Raises:
      ValueError: bad arguments or a batch size not divisible by the device count;
        :class:`CheckpointMismatch` (a ``ValueError``): the newest checkpoint in ``workdir`` was
        written with another ``run_info``, seed or model shape — all before anything is compiled.
      Interrupted: (a ``KeyboardInterrupt``) after SIGINT/SIGTERM, once the current step is
        checkpointed; its ``signum`` says which.
    """
    _check_args(
        num_steps, freeze_step, eval_every, checkpoint_every, log_every, selection_every, workdir
    )
    mesh = data_mesh() if mesh is None else mesh
    check_batch_size(train_data.global_batch_size, mesh, name="batch_size")
    rep, data_sharding = replicated(mesh), batch_sharded(mesh)

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
    # As the checkpoint's JSON gives it back (tuples become lists), to compare on resume.
    run_info = json.loads(json.dumps({**dict(run_info or {}), "seed": int(seed)}))
    is_main = jax.process_index() == 0

    ckpt = (
        Checkpointer(pathlib.Path(workdir) / "checkpoints", max_to_keep=keep_checkpoints)
        if workdir
        else None
    )
    writer = _NullWriter()
    try:
        # The metrics since the last training record: `pending` (device arrays, fetched at once
        # at the next record or save) folded into `interval`, host sums that a checkpoint keeps
        # so that the first record after a resume averages the same steps as without the resume.
        state, resumed_step, interval = _initial_state(
            ckpt, init, initial_variables, abstract, rep, sparse, run_info
        )
        pending = []
        start = resumed_step or 0
        if workdir is not None:
            writer = MetricWriter(
                workdir, start_step=resumed_step, tensorboard=tensorboard, enabled=is_main
            )
        train_step = jax.jit(
            make_train_step(model, optimizer, task, gate=gate),
            in_shardings=(rep, data_sharding),
            out_shardings=(rep, rep),
            donate_argnums=0,
        )
        eval_step = jax.jit(
            make_eval_step(model, task), in_shardings=(rep, data_sharding), out_shardings=rep
        )
        freeze = jax.jit(freeze_state, in_shardings=rep, out_shardings=rep)

        def run_eval(state, log=True):
            metrics = evaluate(eval_step, state, eval_data, mesh, task)
            if log:
                writer.write(int(state.step), "eval", metrics)
            return metrics

        def record_selection(state):
            if selection_every:
                offsets = kept_offsets(state.collections)
                writer.write(int(state.step), "selection", {"offsets": offsets})

        def save(state, frozen):
            if ckpt is not None:
                writer.flush()
                # A copy: the save is asynchronous, and `interval` keeps changing.
                sums = {name: list(total) for name, total in _accumulate(interval, pending).items()}
                ckpt.save(state, meta={"run": run_info, "frozen": frozen, "interval": sums})

        searching = is_searching(state.params)
        if searching and start == 0:
            record_selection(state)
        if searching and freeze_step == start:
            state, searching = freeze(state), False
            save(state, True)

        step, eval_metrics = start, {}
        bar = tqdm.tqdm(
            total=num_steps,
            initial=start,
            unit="step",
            dynamic_ncols=True,
            disable=not (progress and is_main),
            desc="search" if searching else "train",
        )
        with _stop_requests() as stop, contextlib.closing(bar):
            data_iter = iter(train_data.iterate(start))
            timer, timed_steps, fresh = time.perf_counter(), 0, True
            while step < num_steps and not stop.is_set():
                state, metrics = train_step(state, global_batch(next(data_iter), mesh))
                step += 1
                pending.append(metrics)
                if fresh:  # the first step of a phase includes compilation: keep it out of timings
                    jax.block_until_ready(metrics)
                    timer, timed_steps, fresh = time.perf_counter(), 0, False
                else:
                    timed_steps += 1
                if (log_every and step % log_every == 0) or step == num_steps:
                    sums = _accumulate(interval, pending)
                    record = {name: total / count for name, (total, count) in sums.items()}
                    interval.clear()
                    if timed_steps:
                        elapsed = time.perf_counter() - timer
                        record["step_time_s"] = elapsed / timed_steps
                        record["examples_per_s"] = (
                            train_data.global_batch_size * timed_steps / elapsed
                        )
                    if learning_rate is not None:
                        record["learning_rate"] = float(learning_rate(step - 1))
                    writer.write(step, "train", record)
                    bar.set_postfix(loss=f"{record['loss']:.4f}", refresh=False)
                    timer, timed_steps = time.perf_counter(), 0
                if (
                    eval_data is not None
                    and eval_every
                    and step % eval_every == 0
                    and step < num_steps
                ):
                    eval_metrics = run_eval(state)
                    timer, timed_steps = time.perf_counter(), 0
                # The last step is saved after the final evaluation is logged: a run resumed from
                # a checkpoint at num_steps then finds that record in metrics.jsonl.
                last = step == num_steps
                if searching and step == freeze_step:
                    state, searching, fresh = freeze(state), False, True
                    record_selection(state)  # what the freeze kept
                    bar.set_description("frozen")
                    if not last:
                        save(state, True)
                else:
                    if searching and selection_every and step % selection_every == 0:
                        record_selection(state)
                    if checkpoint_every and step % checkpoint_every == 0 and not last:
                        save(state, not searching and sparse)
                        timer, timed_steps = time.perf_counter(), 0
                for hook in hooks:
                    hook(step, state)
                bar.update(1)
            if step < num_steps:
                save(state, not searching and sparse)
                raise Interrupted(
                    f"stopped at step {step} of {num_steps}; "
                    f"{'saved in ' + str(workdir) if workdir else 'no workdir, nothing saved'}",
                    stop.signum,
                )
        if eval_data is not None:  # a run resumed at its last step already logged this evaluation
            eval_metrics = run_eval(state, log=step > start)
        save(state, not searching and sparse)
        return TrainResult(state, eval_metrics, start)
    finally:
        writer.close()
        if ckpt is not None:
            ckpt.close()


def _initial_state(ckpt, init, initial_variables, abstract, rep, sparse, run_info):
    """``(state, step, interval sums)``: the newest checkpoint restored into the right phase's
    structure, its step and the metric sums it holds; or a fresh state (from
    ``initial_variables`` if given: an argument, not a constant of the compiled init), None and
    {}."""
    latest = None if ckpt is None else ckpt.latest_step()
    if latest is None:
        return jax.jit(init, out_shardings=rep)(initial_variables), None, {}
    meta = ckpt.read_meta(latest)
    differences = _differences(meta.get("run", {}), run_info)
    if differences:
        shown = "\n  ".join(differences)
        raise CheckpointMismatch(
            f"checkpoint {ckpt.directory}/{latest} was written by another run:\n  {shown}\n"
            "resume with the settings it was written with, or use another workdir"
        )
    target = abstract
    if meta.get("frozen") and sparse:
        target = jax.eval_shape(freeze_state, abstract)
    state = ckpt.restore(latest, _abstract(target, rep))
    return state, latest, dict(meta.get("interval", {}))


def _differences(stored: Mapping, current: Mapping) -> list[str]:
    """``"key: X in the checkpoint, Y in this run"`` for each entry (nested keys dotted) on which
    two run descriptions differ."""
    a, b = (
        traverse_util.flatten_dict(t, keep_empty_nodes=True, sep=".") for t in (stored, current)
    )

    def show(tree, key):
        if key not in tree:
            return "absent"
        return "{}" if tree[key] is traverse_util.empty_node else repr(tree[key])

    return [
        f"{key}: {show(a, key)} in the checkpoint, {show(b, key)} in this run"
        for key in sorted(set(a) | set(b))
        if key not in a or key not in b or a[key] != b[key]
    ]


def _accumulate(interval: dict, pending: list) -> dict:
    """Move the per-step metrics of ``pending`` into ``interval``'s ``{name: [sum, count]}``.

    Added one step at a time in float64, so the sums do not depend on when they are folded (at a
    record, at a save, before or after a resume); a metric counts only the steps that report it
    (per-layer gate metrics stop at the freeze).
    """
    for record in jax.device_get(pending):
        for name, value in record.items():
            total = interval.setdefault(name, [0.0, 0])
            total[0] += float(value)
            total[1] += 1
    pending.clear()
    return interval
