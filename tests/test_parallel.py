"""Data parallelism over several (fake) CPU devices: same training as on one device."""

import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
from training_helpers import train_tiny

import dynadiag_jax
from dynadiag_jax.training import parallel

HERE = pathlib.Path(__file__).resolve().parent
FOUR_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}


def test_four_devices_train_like_one(run_python):
    proc = run_python([str(HERE / "train_child.py"), "-", "--steps", "6"], env=FOUR_DEVICES)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == 4 and out["param_devices"] == 4  # replicated on every device
    single = train_tiny(num_steps=6, eval_every=4)
    # The batch is split over four devices; only the summation order of the gradient differs.
    assert out["eval"]["accuracy"] == single.eval_metrics["accuracy"]
    np.testing.assert_allclose(out["eval"]["loss"], single.eval_metrics["loss"], rtol=1e-5)
    first = [np.asarray(x).ravel()[:8] for x in jax.tree.leaves(single.state.params)]
    for a, b in zip(out["params"], first, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_batch_not_divisible_by_four_devices(run_python):
    proc = run_python(
        [str(HERE / "train_child.py"), "-", "--batch", "6"], env=FOUR_DEVICES, check=False
    )
    assert proc.returncode != 0
    assert (
        "batch_size=6 is not divisible by the number of devices (4); use a multiple of 4"
        in proc.stderr
    )


def _two_processes(tmp_path, *args):
    """Two ``train_child.py`` processes of one run (CPU, gloo), one device each."""
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    package_root = str(pathlib.Path(dynadiag_jax.__file__).resolve().parents[1])
    children = []
    for i in range(2):
        env = dict(
            os.environ,
            JAX_COORDINATOR_ADDRESS=f"localhost:{port}",
            JAX_NUM_PROCESSES="2",
            JAX_PROCESS_ID=str(i),
            PYTHONPATH=os.pathsep.join(
                [package_root, *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        )
        children.append(
            subprocess.Popen(
                [sys.executable, str(HERE / "train_child.py"), str(tmp_path / "run"), *args],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return children


def _finish(children, timeout=600):
    """``(returncode, stdout, stderr)`` of each child; kills both if one hangs."""
    try:
        return [(c, *c.communicate(timeout=timeout)) for c in children]
    finally:
        for c in children:
            if c.poll() is None:
                c.kill()
                c.communicate()  # closes the pipes too


def test_two_processes_train_like_one(tmp_path):
    """Two hosts (processes), one device each: every process ends with the same state."""
    outs = []
    for child, stdout, stderr in _finish(_two_processes(tmp_path, "--steps", "6")):
        assert child.returncode == 0, stderr[-3000:]
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    assert [o["process"] for o in outs] == [0, 1] and all(o["devices"] == 2 for o in outs)
    assert outs[0]["eval"] == outs[1]["eval"] and outs[0]["params"] == outs[1]["params"]
    single = train_tiny(num_steps=6, eval_every=4)
    np.testing.assert_allclose(outs[0]["eval"]["loss"], single.eval_metrics["loss"], rtol=1e-5)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["2", "4", "6"]


def test_a_signal_to_one_process_stops_both_at_the_same_step(tmp_path):
    """SIGTERM to one process of two: it stopped to save while the other went on into the next
    step, and each waited for the other for ever. Both stop at the next meeting, saved."""
    children = _two_processes(tmp_path, "--steps", "40", "--step-sleep", "0.2")
    checkpoints = tmp_path / "run" / "checkpoints"
    deadline = time.monotonic() + 300
    while not (checkpoints / "2").exists():
        assert time.monotonic() < deadline and all(c.poll() is None for c in children)
        time.sleep(0.2)
    children[1].send_signal(signal.SIGTERM)
    finished = _finish(children, timeout=180)
    stops = set()
    for child, _, stderr in finished:
        assert child.returncode != 0, stderr[-3000:]
        (stop,) = re.findall(r"stopped at step (\d+) of 40", stderr)
        stops.add(int(stop))
    (stop,) = stops  # the same step on both
    assert stop % parallel.STOP_CHECK_EVERY == 0 and stop < 40
    assert str(stop) in {p.name for p in checkpoints.iterdir()}


def test_abstract_batch_describes_the_batch_a_step_is_called_with():
    """The compiles ahead get the step's batch's shapes and dtypes without a transfer; on one
    process the step takes the host arrays (no sharding: the step's ``in_shardings`` place them),
    so that its calls find the program compiled ahead."""
    mesh = parallel.data_mesh()
    local = {"x": np.ones((8, 3), np.float64), "y": np.arange(8, dtype=np.int32)}
    real = parallel.step_batch(local, mesh)
    abstract = parallel.abstract_batch(local, mesh)
    for k, v in real.items():
        assert isinstance(v, np.ndarray)
        assert (abstract[k].shape, abstract[k].dtype) == (
            v.shape,
            jax.dtypes.canonicalize_dtype(v.dtype),
        )
        assert abstract[k].sharding is None
    assert parallel.global_batch_shape((8, 3), mesh) == (8, 3)


def test_initialize_distributed_starts_only_a_run_of_several_processes(monkeypatch):
    """JAX_NUM_PROCESSES=1 inside a SLURM job of several tasks (a Python started in the batch
    step, outside srun) waited for peers that never came."""
    started = []
    monkeypatch.setattr(jax.distributed, "initialize", lambda **kw: started.append(kw))
    names = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_NTASKS")
    for name in (*names, "OMPI_COMM_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert not parallel.initialize_distributed() and not started
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "1")
    assert not parallel.initialize_distributed() and not started
    monkeypatch.delenv("JAX_NUM_PROCESSES")
    assert parallel.initialize_distributed()  # JAX reads the rest from SLURM
    assert started == [dict(coordinator_address=None, num_processes=None, process_id=None)]
    assert parallel.initialize_distributed(num_processes=2, process_id=1)
    assert started[-1]["num_processes"] == 2
