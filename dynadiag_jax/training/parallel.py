"""Data parallelism with ``jax.sharding``: one mesh axis ``"data"`` over every device.

Parameters and optimizer state are replicated; each batch is split along its first axis. On
several hosts, call :func:`initialize_distributed` first; every process then feeds its own slice
of the global batch (:func:`global_batch`), and ``jax.jit`` runs one program over all devices.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dynadiag_jax._checks import int_at_least

__all__ = [
    "DATA_AXIS",
    "abstract_batch",
    "check_batch_size",
    "data_mesh",
    "global_batch",
    "global_batch_shape",
    "initialize_distributed",
    "replicated",
    "batch_sharded",
    "StopAgreement",
    "STOP_CHECK_EVERY",
]

DATA_AXIS = "data"


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
) -> bool:
    """Start ``jax.distributed`` when this is one process of a multi-host run.

    Arguments left out come from ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES`` and
    ``JAX_PROCESS_ID``; under SLURM or Open MPI with more than one task, JAX detects all three.
    Must run before anything touches the devices.

    Returns:
      Whether ``jax.distributed`` was initialised (False for a single process).
    """
    env = os.environ
    if num_processes is None and "JAX_NUM_PROCESSES" in env:
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and "JAX_PROCESS_ID" in env:
        process_id = int(env["JAX_PROCESS_ID"])
    coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
    cluster_tasks = max(int(env.get("SLURM_NTASKS", 1)), int(env.get("OMPI_COMM_WORLD_SIZE", 1)))
    if num_processes is not None and num_processes <= 1:
        return False  # said outright, also inside a SLURM or MPI job of several tasks
    if cluster_tasks <= 1 and num_processes is None:
        return False
    jax.distributed.initialize(
        coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
    )
    return True


# Steps between two checks of a stop request when several processes train (each check is one
# barrier of the processes through JAX's coordination service: host work, no device sync).
STOP_CHECK_EVERY = 10
_STOP_TIMEOUT_MS = 3_600_000  # a process compiling or evaluating longer than its peers waits
_runs = itertools.count()  # every process starts the same runs in the same order


class StopAgreement:
    """Whether a run stops after ``step``: the same answer on every process.

    One process stops at the first step boundary after its signal. Several see a SIGTERM (or a
    Ctrl-C) each at its own step, and one that stopped to save while the others went on into
    the next step's collectives left every process waiting for the others for ever. So the
    processes meet every :data:`STOP_CHECK_EVERY` steps and at the last step: a request that
    any process posted before a meeting stops all of them there, with its signal.

    Args:
      request: this process's :class:`~dynadiag_jax.training.loop.StopRequest` (``signum``).
      last_step: the run's last step (``num_steps``), where the processes always meet.
    """

    def __init__(self, request, *, last_step: int):
        self.request = request
        self.signum = None
        self._last = last_step
        self._client = _coordination_client() if jax.process_count() > 1 else None
        self._prefix = f"dynadiag_jax/stop/{next(_runs)}"
        self._posted = False
        self._answer = None  # (step, stop) of the last meeting

    def __call__(self, step: int) -> bool:
        if self._client is None:
            self.signum = self.request.signum
            return self.request.is_set()
        if step % STOP_CHECK_EVERY and step != self._last:
            return False
        if self._answer is not None and self._answer[0] == step:
            return self._answer[1]
        if self.request.is_set() and not self._posted:
            key = f"{self._prefix}/posted/{jax.process_index()}"
            self._client.key_value_set(key, f"{step} {self.request.signum}")
            self._posted = True
        self._client.wait_at_barrier(f"{self._prefix}/at/{step}", _STOP_TIMEOUT_MS)
        posted = [v.split() for _, v in self._client.key_value_dir_get(f"{self._prefix}/posted/")]
        # posted before this meeting; a later post counts at the next one
        due = sorted((int(at), int(signum)) for at, signum in posted if int(at) <= step)
        if due:
            self.signum = due[0][1]
        self._answer = (step, bool(due))
        return bool(due)


def _coordination_client():
    from jax._src import distributed  # noqa: PLC0415 - what Orbax's multihost utilities use too

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError(
            f"{jax.process_count()} processes but no jax.distributed client: start the run with "
            "initialize_distributed()"
        )
    return client


def data_mesh(devices=None) -> Mesh:
    """A 1-D mesh with axis ``"data"`` over ``devices`` (default: every device of every host)."""
    devices = jax.devices() if devices is None else list(devices)
    return Mesh(np.asarray(devices), (DATA_AXIS,))


def replicated(mesh: Mesh) -> NamedSharding:
    """The sharding of parameters and optimizer state: a full copy on every device."""
    return NamedSharding(mesh, PartitionSpec())


def batch_sharded(mesh: Mesh) -> NamedSharding:
    """The sharding of a batch: split along the first axis."""
    return NamedSharding(mesh, PartitionSpec(DATA_AXIS))


def check_batch_size(batch_size: int, mesh: Mesh, *, name: str = "batch_size") -> int:
    """The per-process batch size; raises ``ValueError`` when ``batch_size`` cannot be split evenly.

    Call it before building anything: the message names the device and process counts.
    """
    int_at_least(batch_size, name, 1)
    devices = mesh.devices.size
    if batch_size % devices:
        raise ValueError(
            f"{name}={batch_size} is not divisible by the number of devices ({devices}); "
            f"use a multiple of {devices}"
        )
    return batch_size // jax.process_count()


def global_batch_shape(local_shape: tuple[int, ...], mesh: Mesh) -> tuple[int, ...]:
    """The global shape of a batch array whose share on this process has ``local_shape``: the
    shares of the mesh's processes end to end along the first axis."""
    processes = len({d.process_index for d in mesh.devices.flat})
    return (local_shape[0] * processes, *local_shape[1:])


def global_batch(local: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, Any]:
    """Assemble each process's slice of a batch into global arrays sharded over ``"data"``."""
    sharding = batch_sharded(mesh)
    arrays = {k: np.asarray(v) for k, v in local.items()}
    return {
        k: jax.make_array_from_process_local_data(sharding, v, global_batch_shape(v.shape, mesh))
        for k, v in arrays.items()
    }


def step_batch(local: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, Any]:
    """This process's ``local`` batch as a jitted step takes it when its batch ``in_shardings``
    is :func:`batch_sharded` (the steps of :mod:`dynadiag_jax.training` are).

    On one process the host arrays themselves: the step's dispatch places them on the devices in
    a fraction of the host time of a separate transfer (a quarter to a tenth on the 2-core CPU
    host), and on CPU that time adds to every step, since the step runs in the caller's thread.
    Across processes, :func:`global_batch`'s global arrays.
    """
    if _one_process(mesh):
        return {k: np.asarray(v) for k, v in local.items()}
    return global_batch(local, mesh)


def _one_process(mesh: Mesh) -> bool:
    return all(d.process_index == jax.process_index() for d in mesh.devices.flat)


def abstract_batch(local: Mapping[str, np.ndarray], mesh: Mesh) -> dict[str, jax.ShapeDtypeStruct]:
    """What :func:`step_batch` would make of ``local`` (shapes, dtypes and, across processes, the
    global arrays' sharding), without transferring anything: enough to compile a program that
    takes the batch and that the step's calls then find in ``jax.jit``'s cache (host arrays and
    committed global arrays are different keys there)."""
    sharding = None if _one_process(mesh) else batch_sharded(mesh)
    arrays = {k: np.asarray(v) for k, v in local.items()}
    return {
        k: jax.ShapeDtypeStruct(
            global_batch_shape(v.shape, mesh),
            jax.dtypes.canonicalize_dtype(v.dtype),
            sharding=sharding,
        )
        for k, v in arrays.items()
    }
