"""Metric records: scalars to TensorBoard (tensorboardX) and every record to ``metrics.jsonl``.

A resumed run starts from a checkpoint at some step ``s``; records written after ``s`` by the
interrupted run are dropped (JSONL rewritten atomically, TensorBoard events purged), so the log of a
resumed run reads exactly like the log of an uninterrupted one. Every record of step ``s`` is
written before the checkpoint of step ``s``, so those are kept. A run that starts afresh (no
checkpoint yet, e.g. killed before its first save committed) starts an empty log.

Both files are written in the calling thread: a write that fails (a full disk) raises ``OSError``
naming the file there, where tensorboardX's own writer thread died and its queue then blocked the
training loop for good.
"""

from __future__ import annotations

import contextlib
import functools
import json
import numbers
import os
import pathlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

__all__ = ["MetricWriter", "append_jsonl", "read_jsonl"]

JSONL_NAME = "metrics.jsonl"


def read_jsonl(path) -> Iterator[dict]:
    """The records (JSON objects) of a metrics file, skipping every line that is not one: a torn
    line (a kill mid-write), or one damaged otherwise. Non-finite values are written and read as
    ``NaN``/``Infinity``, as Python's ``json`` does (strict JSON readers refuse them)."""
    path = pathlib.Path(path)
    if not path.exists():
        return
    with path.open() as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(record, dict):
                yield record


def append_jsonl(path, record: Mapping[str, Any]) -> None:
    """Append ``record`` as one line of ``path``, on a line of its own: after a torn last line (a
    kill mid-write) it starts a new one, so that the torn line alone is lost, not this record."""
    path = pathlib.Path(path)
    with path.open("a+b") as f:
        torn = f.tell() > 0 and f.seek(-1, os.SEEK_END) >= 0 and f.read(1) != b"\n"
        f.write((b"\n" if torn else b"") + (json.dumps(_plain(record)) + "\n").encode())


def _plain(value: Any) -> Any:
    """``value`` as JSON-serialisable Python data (numpy/JAX scalars and arrays included)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (str, bool)) or value is None:
        return value
    arr = np.asarray(value)
    if arr.ndim:
        return arr.tolist()
    return arr.item()


class _EventFile:
    """TensorBoard scalar events appended in the calling thread (tensorboardX's ``SummaryWriter``
    queues them to a thread that dies on a write error)."""

    def __init__(self, logdir: pathlib.Path, purge_step: int):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto import event_pb2, summary_pb2

        self._pb, self._summary = event_pb2, summary_pb2.Summary
        self._writer = EventsWriter(str(logdir / "events"))
        # TensorBoard hides the events of an earlier run at and after purge_step (a resume)
        start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
        self._writer.write_event(event_pb2.Event(step=purge_step, session_log=start))

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        # the proto itself: tensorboardX's summary.scalar logs a warning for every NaN
        summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=float(value))])
        self._writer.write_event(self._pb.Event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class MetricWriter:
    """Writes ``{"step": s, "kind": ..., **values}`` records.

    Args:
      logdir: directory for ``metrics.jsonl`` and the TensorBoard event files.
      start_step: the step of the checkpoint training resumes from (records with a larger step
        are dropped), or None for a run that starts afresh (every earlier record is dropped).
      tensorboard: also write numeric scalars as TensorBoard events.
      enabled: False on every process but the first of a multi-host run (nothing is written).
    """

    def __init__(
        self,
        logdir,
        *,
        start_step: int | None = None,
        tensorboard: bool = True,
        enabled: bool = True,
    ):
        self.enabled = enabled
        self.path = pathlib.Path(logdir) / JSONL_NAME
        self._tb = None
        self._file = None
        self._failed = False
        self._logged: set[tuple[int, str]] = set()
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = (
            []
            if start_step is None
            else [r for r in read_jsonl(self.path) if r.get("step", 0) <= start_step]
        )
        tmp = self.path.with_suffix(".jsonl.tmp")
        with tmp.open("w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)
        os.replace(tmp, self.path)
        self._logged = {(r.get("step", 0), r.get("kind")) for r in kept}
        self._file = self.path.open("a")
        if tensorboard:
            self._tb = self._io(
                "TensorBoard events",
                lambda: _EventFile(self.path.parent, 0 if start_step is None else start_step + 1),
            )

    def _io(self, what: str, action):
        """``action()``; an ``OSError`` (a full disk, a vanished directory) as one naming the
        file, after which the writer writes nothing more (:meth:`close` included)."""
        try:
            return action()
        except OSError as e:
            self._failed = True
            raise OSError(
                e.errno, f"cannot write the {what} of {self.path.parent}: {e.strerror or e}"
            ) from e

    def write(self, step: int, kind: str, values: Mapping[str, Any]) -> None:
        """Append one record; numeric scalars also go to TensorBoard as ``kind/name`` (NaN and
        inf too: a diverged run's loss is what its reader looks for). ``ValueError`` after
        :meth:`close`, ``OSError`` naming the file when it cannot be written."""
        if not self.enabled:
            return
        if self._file is None:
            raise ValueError(f"the metrics writer of {self.path} is closed: nothing can be written")
        record = {"step": int(step), "kind": kind, **_plain(values)}
        self._io(JSONL_NAME, lambda: self._file.write(json.dumps(record) + "\n"))
        self._logged.add((int(step), kind))
        if self._tb is not None:
            for name, v in record.items():
                if name in ("step", "kind") or isinstance(v, bool):
                    continue
                if isinstance(v, numbers.Real):
                    add = functools.partial(self._tb.add_scalar, f"{kind}/{name}", v, int(step))
                    self._io("TensorBoard events", add)

    def logged(self, step: int, kind: str) -> bool:
        """Whether the log holds a ``kind`` record of ``step`` (kept from before a resume, or
        written since)."""
        return (int(step), kind) in self._logged

    def flush(self) -> None:
        """Push everything written so far to disk (called before each checkpoint)."""
        if not self.enabled:
            return

        def flush():
            self._file.flush()
            os.fsync(self._file.fileno())
            if self._tb is not None:
                self._tb.flush()

        self._io(JSONL_NAME, flush)

    def close(self) -> None:
        """Flush and close both files; after a failed write, close them without a flush (it
        would fail the same way and hide the error that stopped the run)."""
        if not self.enabled or self._file is None:
            return
        if not self._failed:
            self.flush()
        file, tb, self._file, self._tb = self._file, self._tb, None, None
        with contextlib.suppress(OSError):
            file.close()
            if tb is not None:
                tb.close()
