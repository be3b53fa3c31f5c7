"""Checkpoints with Orbax's ``CheckpointManager``: keep the last N, asynchronous, atomic.

A checkpoint holds the :class:`~dynadiag_jax.training.state.TrainState` and a JSON ``meta``
record (what the training loop needs besides the state: the phase, the run's description, the
metrics not logged yet). A checkpoint interrupted mid-write stays a temporary directory that Orbax
ignores, so the latest *committed* step is always complete. Restoring checks every stored shape
against the expected one first and names the mismatching parameters instead of failing deep inside
TensorStore; a committed step damaged afterwards (a truncated or deleted file) raises
:class:`UnreadableCheckpoint` naming the step and the reason, and the directory itself is checked
when the :class:`Checkpointer` is made, not at its first (background) save.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import pathlib
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp
from flax import traverse_util
from jax.experimental import multihost_utils

from dynadiag_jax._checks import int_at_least
from dynadiag_jax.training.state import TrainState

__all__ = [
    "CheckpointMismatch",
    "Checkpointer",
    "exclusive_workdir",
    "UnreadableCheckpoint",
    "run_differences",
    "usable_directory",
]

# What a resumed run can do about a step it cannot read.
RESUME_ADVICE = "delete it or use another workdir"
# The step directories this process failed to read or is reading (see _quiet_failed_reads), and
# whether its hooks are installed.
_UNREADABLE: set[str] = set()
_HOOKED: list[bool] = []


class CheckpointMismatch(ValueError):
    """A checkpoint directory that this run cannot use: a checkpoint of another model shape, recipe
    or seed, one that cannot be read (:class:`UnreadableCheckpoint`), or a path that cannot hold
    checkpoints (a file, or not writable)."""


class UnreadableCheckpoint(CheckpointMismatch):
    """A committed step whose files cannot be read (truncated, deleted or garbled after the commit).

    Attributes:
      step: the step.
      reason: what failed, one line.
    """

    def __init__(self, directory, step: int, reason: str, advice: str = ""):
        super().__init__(
            f"checkpoint {directory} step {step} cannot be read ({reason})"
            + (f"; {advice}" if advice else "")
        )
        self.step, self.reason = step, reason


def usable_directory(directory, *, create: bool = True) -> pathlib.Path:
    """``directory`` as an absolute path, checked up front: a directory (or a path that can become
    one), created if missing and writable; with ``create=False`` (to read only) nothing is created
    or checked for writing.

    Raises:
      ValueError: the path or a directory above it is a file, it cannot be created, or it is not
        writable (an Orbax save would fail in its background thread, after the run trained).
    """
    path = pathlib.Path(directory).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing == path and not path.is_dir():
        raise ValueError(f"{path} is a file, not a directory")
    if not existing.is_dir():
        raise ValueError(f"{path} cannot be created: {existing} is a file, not a directory")
    if not create:
        return path
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{path} cannot be created ({e.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{path} is not writable")
    return path


LOCK_NAME = ".lock"


@contextlib.contextmanager
def exclusive_workdir(workdir):
    """Hold ``workdir`` for one run: an exclusive ``flock`` of ``<workdir>/.lock`` (released by
    the kernel if the process dies), which holds the holder's pid. Two runs in one workdir
    deleted each other's checkpoints (``max_to_keep``) and log (a fresh ``metrics.jsonl``).

    Raises:
      CheckpointMismatch: another process holds it (naming its pid), or the path cannot be a
        directory. A file system without locks (``ENOLCK``) runs unlocked, with a warning.
    """
    try:  # the checkpoints' directory, checked as Checkpointer checks it
        path = usable_directory(pathlib.Path(workdir) / "checkpoints").parent
    except ValueError as e:
        raise CheckpointMismatch(f"checkpoint directory: {e}") from None
    fd = os.open(path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise CheckpointMismatch(
                f"another run (process {pid}) is training in {path}: two runs in one workdir "
                f"would delete each other's checkpoints and log; wait for it to end, or use "
                f"another workdir"
            ) from None
        except OSError as e:
            logging.getLogger(__name__).warning(
                "%s cannot be locked (%s): nothing keeps a second run out of it", path, e.strerror
            )
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock


def run_differences(stored: Mapping, current: Mapping, where: str = "the checkpoint") -> list[str]:
    """``"key: X in <where>, Y in this run"`` for each entry (nested keys dotted) on which two run
    descriptions differ (``stored``: the one recorded in ``where``): the entries both hold
    first (a changed method or sparsity), then those only one holds (the sections one method
    reads and the other does not), several of one section on one line by name only:
    ``"dynadiag: 19 entries in <where> only: alpha_lr_scale, block_size, ..."``."""
    a, b = (
        traverse_util.flatten_dict(t, keep_empty_nodes=True, sep=".") for t in (stored, current)
    )

    def show(tree, key):
        if key not in tree:
            return "absent"
        return "{}" if tree[key] is traverse_util.empty_node else repr(tree[key])

    def entry(key):
        return f"{key}: {show(a, key)} in {where}, {show(b, key)} in this run"

    lines = [entry(key) for key in sorted(set(a) & set(b)) if a[key] != b[key]]
    one_sided: dict[tuple[str, str], list[str]] = {}
    for key in sorted(set(a) ^ set(b)):
        side = where if key in a else "this run"
        one_sided.setdefault((key.split(".")[0], side), []).append(key)
    for (section, side), keys in sorted(one_sided.items()):
        if len(keys) == 1:
            lines.append(entry(keys[0]))
        else:
            names = ", ".join(k.removeprefix(section + ".") for k in keys)
            lines.append(f"{section}: {len(keys)} entries in {side} only: {names}")
    return lines


def _quiet_failed_reads(step_dir: pathlib.Path) -> None:
    """Leave out, from now on, the reports of what a failed restore of ``step_dir`` left behind
    (called before the read: :meth:`Checkpointer._reading` stops watching a step that read).

    When one array read fails, Orbax returns with the restore's other reads still pending on the
    event loop it closes. As they end or are collected (seconds later, or at exit), Python prints
    each as "Exception ignored in" (with a TensorStore spec of a hundred lines), a closed loop's
    refusal of their callback (also as a bare traceback, through ``sys.excepthook``), or "Future
    exception was never retrieved": after the one line that says which step cannot be read and
    why, pages of noise. Reports of other errors still go to the hooks and the logger there
    were.
    """
    if not _HOOKED:  # once per process: the hooks read _UNREADABLE as it changes
        _HOOKED.append(True)
        previous, previous_except = sys.unraisablehook, sys.excepthook

        def hook(unraisable):
            if not _left_behind(unraisable.exc_value):
                previous(unraisable)

        def except_hook(kind, error, trace):
            # a closed loop's refusal raised in a callback from a TensorStore thread is printed
            # through sys.excepthook (PyErr_Print), not reported as unraisable
            if not _left_behind(error):
                previous_except(kind, error, trace)

        sys.unraisablehook = hook
        sys.excepthook = except_hook
        logging.getLogger("asyncio").addFilter(
            lambda record: not (record.exc_info and _left_behind(record.exc_info[1]))
        )
    _UNREADABLE.add(f"{step_dir}/")


def _left_behind(error) -> bool:
    """Whether ``error`` is one of a failed restore's pending reads (:func:`_quiet_failed_reads`):
    an error naming a step found unreadable, or a closed event loop's."""
    text = str(error)
    if isinstance(error, RuntimeError) and text == "Event loop is closed":
        return True
    return any(step_dir in text for step_dir in _UNREADABLE)


def _reason(error: BaseException) -> str:
    """The first line of the innermost cause of ``error``, with its type (Orbax wraps TensorStore's
    error, which names the file and what is wrong with it, in a generic one)."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


def _shape_of(leaf) -> tuple[int, ...] | None:
    shape = getattr(leaf, "shape", None)
    return None if shape is None else tuple(shape)


class Checkpointer:
    """Save and restore training states under ``directory``.

    Args:
      directory: where the step directories live (created if missing).
      max_to_keep: number of most recent checkpoints kept.
      async_save: write in a background thread (``save`` returns after the device-to-host copy).
      clock: ``() -> seconds``, the clock of :meth:`writing_since`.
      read_only: only read (another run's checkpoints, perhaps on a read-only file system): the
        directory is neither created nor checked for writing, and :meth:`save` refuses.

    Raises:
      CheckpointMismatch: ``directory`` cannot hold checkpoints (:func:`usable_directory`).
    """

    def __init__(
        self,
        directory,
        *,
        max_to_keep: int = 3,
        async_save: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        read_only: bool = False,
    ):
        max_to_keep = int_at_least(max_to_keep, "max_to_keep", 1)
        try:
            self.directory = usable_directory(directory, create=not read_only)
        except ValueError as e:
            raise CheckpointMismatch(f"checkpoint directory: {e}") from None
        self._read_only, self._max_to_keep = read_only, int(max_to_keep)
        self._clock, self._async = clock, async_save
        # a background write issued and not yet seen finished; when the last one was seen finished
        self._writing, self._seen_done = False, -float("inf")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=int(max_to_keep),
            create=not read_only,
            enable_async_checkpointing=async_save,
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                "state": ocp.StandardCheckpointHandler(),
                "meta": ocp.JsonCheckpointHandler(),
            },
        )

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` if there is none."""
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def save(self, state: TrainState, *, meta: Mapping[str, Any]) -> None:
        """Save ``state`` under its ``step`` (a no-op if that step is already saved)."""
        if self._read_only:
            raise ValueError(f"{self.directory} was opened read_only: nothing can be saved there")
        step = int(jax.device_get(state.step))
        if step in self._manager.all_steps():
            return
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta))
            ),
        )
        self._writing = self._async

    def writing_since(self, start: float) -> bool:
        """Whether a background write ran at any time from ``start`` (a time of the clock) until
        now. Orbax does not say when a write ended, so it counts as running until the first call
        that finds it finished: an interval may be flagged that the write ended just before, never
        one it ran in left unflagged."""
        if self._writing:
            if self._manager.is_saving_in_progress():
                return True
            self._writing, self._seen_done = False, self._clock()
        return self._seen_done > start

    @contextlib.contextmanager
    def _reading(self, step: int, item: str, advice: str = ""):
        """Raise :class:`UnreadableCheckpoint` (with ``advice``) if ``item`` (``"meta"``,
        ``"state"``) of ``step`` is missing, or if reading it fails other than by a mismatch;
        ``FileNotFoundError`` if there is no step ``step`` at all."""
        path = self.directory / str(step)
        if not path.exists():  # nothing to delete: "step 5 has no state/" sent users to a ghost
            raise FileNotFoundError(
                f"{self.directory} holds no checkpoint of step {step} (steps: {self.all_steps()})"
            )
        missing = None
        if path.is_dir() and not any(path.iterdir()):
            missing = "its directory is empty"
        elif not (path / item).is_dir():
            missing = f"it has no {item}/"
        if missing:
            raise UnreadableCheckpoint(self.directory, step, missing, advice)
        # Watched from before the read: a failed read's pending reads can be reported while Orbax
        # unwinds, before its error reaches the except clause below (a CI run printed one).
        watched = f"{path}/"
        fresh = watched not in _UNREADABLE
        _quiet_failed_reads(path)
        failed = False
        try:
            yield
        except CheckpointMismatch:
            raise
        except Exception as e:  # Orbax, TensorStore and json raise many types; the step is lost
            failed = True
            raise UnreadableCheckpoint(self.directory, step, f"{item}: {_reason(e)}", advice) from e
        finally:
            if fresh and not failed:
                _UNREADABLE.discard(watched)

    def read_meta(self, step: int, *, advice: str = "") -> dict:
        """The JSON record saved with ``step``.

        Raises:
          UnreadableCheckpoint: the record cannot be read (its message ends with ``advice``).
        """
        with self._reading(step, "meta", advice):
            return self._manager.restore(
                step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())
            )["meta"]

    def check_run(self, step: int, run_info: Mapping[str, Any]) -> dict:
        """The JSON record saved with ``step``, after checking that it was written by the run
        ``run_info`` describes (as it comes back from JSON: lists, not tuples).

        Raises:
          CheckpointMismatch: the record's ``"run"`` differs from ``run_info``; the message lists
            every differing key (:func:`run_differences`).
          UnreadableCheckpoint: the record cannot be read.
        """
        meta = self.read_meta(step, advice=RESUME_ADVICE)
        differences = run_differences(meta.get("run", {}), run_info)
        if differences:
            shown = "\n  ".join(differences)
            raise CheckpointMismatch(
                f"checkpoint {self.directory}/{step} was written by another run:\n  {shown}\n"
                "resume with the settings it was written with, or use another workdir"
            )
        return meta

    def check_compatible(self, step: int, target: TrainState) -> None:
        """Raise :class:`CheckpointMismatch` if the state stored at ``step`` does not have
        ``target``'s shapes (:class:`UnreadableCheckpoint` if its metadata cannot be read)."""
        with self._reading(step, "state", RESUME_ADVICE):
            stored = self._manager.item_metadata(step)["state"]
        if stored is None:  # Orbax's answer for a state/ without its _METADATA file
            raise UnreadableCheckpoint(
                self.directory, step, "state: its metadata is missing", RESUME_ADVICE
            )
        stored = getattr(stored, "tree", stored)
        problems = []
        stored_params = _by_path(stored["params"])
        target_params = _by_path(target.params)
        for path in sorted(set(stored_params) | set(target_params)):
            a, b = stored_params.get(path), target_params.get(path)
            if a is None:
                problems.append(f"params/{path}: missing in the checkpoint (this run: {b})")
            elif b is None:
                problems.append(f"params/{path}: in the checkpoint {a}, absent in this run")
            elif a != b:
                problems.append(f"params/{path}: checkpoint {a}, this run {b}")
        if not problems:
            # By path: Orbax stores NamedTuple states as dicts, whose leaves flatten in key order.
            a_leaves, b_leaves = _by_path(stored["opt_state"]), _by_path(target.opt_state)
            if a_leaves != b_leaves:
                differ = sorted(
                    k for k in set(a_leaves) | set(b_leaves) if a_leaves.get(k) != b_leaves.get(k)
                )
                problems.append(
                    "opt_state: a different optimizer state structure "
                    f"({len(a_leaves)} arrays stored, {len(b_leaves)} expected; differing, e.g. "
                    f"{', '.join(differ[:3])})"
                )
            a_coll, b_coll = _by_path(stored["collections"]), _by_path(target.collections)
            if a_coll != b_coll:
                diff = sorted(set(a_coll.items()) ^ set(b_coll.items()))[:3]
                problems.append(f"collections differ, e.g. {diff}")
        if problems:
            shown = "\n  ".join(problems[:8]) + ("\n  ..." if len(problems) > 8 else "")
            raise CheckpointMismatch(
                f"checkpoint {self.directory}/{step} does not fit this model "
                f"(another sparsity, size or phase?):\n  {shown}\n"
                f"use another workdir, or the settings the checkpoint was written with"
            )

    def restore(self, step: int, target: TrainState) -> TrainState:
        """Restore ``step`` into the structure, shapes and shardings of ``target``.

        ``target`` may be abstract (``jax.ShapeDtypeStruct`` leaves, with ``sharding`` set).
        Raises :class:`CheckpointMismatch` (see :meth:`check_compatible`) before reading any array,
        :class:`UnreadableCheckpoint` if an array cannot be read.
        """
        self.check_compatible(step, target)
        with self._reading(step, "state", RESUME_ADVICE):
            restored = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
            )
        return restored["state"]

    def drop_surplus(self) -> list[int]:
        """Delete the committed steps older than the newest ``max_to_keep`` and return them.

        Orbax deletes them after a save commits; a run killed between the two, then resumed from
        its last step with nothing left to save, would keep them for good. Call it once the
        newest step has been restored (an unreadable newest one needs the older ones).
        """
        if self._read_only:
            raise ValueError(f"{self.directory} was opened read_only: nothing can be deleted")
        surplus = sorted(self._manager.all_steps())[: -self._max_to_keep]
        for step in surplus:
            self._manager.delete(step)
        return surplus

    def set_aside(self, step: int) -> pathlib.Path:
        """Rename ``step``'s directory to ``<step>.unreadable`` (``-2``, ``-3``, ... if taken), a
        name Orbax does not read as a step: a run resumed from an earlier step can save this one
        again, and nothing is deleted. Returns the new path."""
        names = (f"{step}.unreadable" + (f"-{k}" if k > 1 else "") for k in itertools.count(1))
        target = next(self.directory / n for n in names if not (self.directory / n).exists())
        # On a shared file system one process renames, once every one has chosen the same name.
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
        if jax.process_index() == 0:
            (self.directory / str(step)).rename(target)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"checkpoint {step} set aside")
        self._manager.reload()
        return target

    def restore_variables(self, step: int | None = None) -> dict:
        """The model variables (``{"params": ..., **collections}``) stored at ``step`` (default:
        the newest), read as they were saved, without a target: to start another model from
        them (:func:`dynadiag_jax.from_dense`), which checks their shapes itself.

        Raises:
          FileNotFoundError: no committed checkpoint (at ``step``) in the directory.
          UnreadableCheckpoint: the step's state cannot be read.
        """
        steps = self.all_steps()
        step = max(steps, default=None) if step is None else step
        if step is None or step not in steps:
            raise FileNotFoundError(
                f"no checkpoint{'' if step is None else f' of step {step}'} in {self.directory}"
                + (f" (steps: {steps})" if steps else "")
            )
        with self._reading(step, "state"):
            restored = self._manager.restore(
                step, args=ocp.args.Composite(state=ocp.args.StandardRestore())
            )["state"]
        return {"params": restored["params"], **restored["collections"]}

    def wait(self) -> None:
        """Block until every pending asynchronous save is committed."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release the manager."""
        self._manager.wait_until_finished()
        self._manager.close()


def _by_path(tree) -> dict[str, tuple[int, ...] | None]:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(_key_name(k) for k in path): _shape_of(leaf) for path, leaf in flat}


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)
