"""Checkpoints with Orbax's ``CheckpointManager``: keep the last N, asynchronous, atomic.

A checkpoint holds the :class:`~dynadiag_jax.training.state.TrainState` and a JSON ``meta``
record (what the training loop needs besides the state: the phase, the run's description, the
metrics not logged yet). A checkpoint interrupted mid-write stays a temporary directory that Orbax
ignores, so the latest *committed* step is always complete. Restoring checks every stored shape
against the expected one first and names the mismatching parameters instead of failing deep inside
TensorStore.
"""

from __future__ import annotations

import pathlib
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax
import orbax.checkpoint as ocp

from dynadiag_jax.training.state import TrainState

__all__ = ["CheckpointMismatch", "Checkpointer"]


class CheckpointMismatch(ValueError):
    """A checkpoint that this run cannot resume from (another model shape, recipe or seed)."""


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
    """

    def __init__(
        self,
        directory,
        *,
        max_to_keep: int = 3,
        async_save: bool = True,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if int(max_to_keep) < 1:
            raise ValueError(f"max_to_keep must be >= 1, got {max_to_keep!r}")
        self.directory = pathlib.Path(directory).absolute()
        self._clock, self._async = clock, async_save
        # a background write issued and not yet seen finished; when the last one was seen finished
        self._writing, self._seen_done = False, -float("inf")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=int(max_to_keep), create=True, enable_async_checkpointing=async_save
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

    def read_meta(self, step: int) -> dict:
        """The JSON record saved with ``step``."""
        return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]

    def check_compatible(self, step: int, target: TrainState) -> None:
        """Raise :class:`CheckpointMismatch` if the state stored at ``step`` does not have
        ``target``'s shapes."""
        stored = self._manager.item_metadata(step)["state"]
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
                problems.append(
                    "opt_state: a different optimizer state structure "
                    f"({len(a_leaves)} arrays stored, {len(b_leaves)} expected)"
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
        Raises :class:`CheckpointMismatch` (see :meth:`check_compatible`) before reading any array.
        """
        self.check_compatible(step, target)
        restored = self._manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
        )
        return restored["state"]

    def restore_variables(self, step: int | None = None) -> dict:
        """The model variables (``{"params": ..., **collections}``) stored at ``step`` (default:
        the newest), read as they were saved, without a target: to start another model from
        them (:func:`dynadiag_jax.from_dense`), which checks their shapes itself.

        Raises:
          FileNotFoundError: no committed checkpoint (at ``step``) in the directory.
        """
        steps = self.all_steps()
        step = max(steps, default=None) if step is None else step
        if step is None or step not in steps:
            raise FileNotFoundError(
                f"no checkpoint{'' if step is None else f' of step {step}'} in {self.directory}"
                + (f" (steps: {steps})" if steps else "")
            )
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
