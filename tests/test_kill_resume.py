"""SIGKILL at any moment, restart, and end with exactly the metrics of an uninterrupted run."""

import json
import os
import pathlib
import random
import subprocess
import sys
import time

import pytest
from training_helpers import comparable

import dynadiag_jax
from dynadiag_jax import training as T

HERE = pathlib.Path(__file__).resolve().parent
STEPS = 16
SLEEP = "0.15"  # seconds per step, so that a random kill lands in training as often as in start-up
DENSE = ()
SPARSE = ("--sparsity", "0.8", "--freeze", "8")  # checkpoints every 2 steps; frozen from step 8
# Training records every 3 steps: the checkpoint of step 8 holds steps 7-8, not logged yet.
SPARSE_LOG3 = (*SPARSE, "--log-every", "3")


def _run(run_python, workdir, *extra, check=True):
    args = [str(HERE / "train_child.py"), str(workdir), "--steps", str(STEPS), *extra]
    proc = run_python(args, check=check)
    return proc, (
        json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else None
    )


def _assert_same_run(reference_dir, resumed_dir, reference, resumed, context=""):
    assert resumed["eval"] == reference["eval"], context
    assert resumed["param_sum"] == reference["param_sum"], context
    a = comparable(T.read_jsonl(pathlib.Path(reference_dir) / "metrics.jsonl"))
    b = comparable(T.read_jsonl(pathlib.Path(resumed_dir) / "metrics.jsonl"))
    assert b == a, context


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Uninterrupted runs, one per set of arguments, shared by the tests of this module."""
    cache = {}

    def get(run_python, *extra):
        if extra not in cache:
            workdir = tmp_path_factory.mktemp("reference")
            cache[extra] = (workdir, _run(run_python, workdir, *extra)[1])
        return cache[extra]

    return get


@pytest.mark.slow
@pytest.mark.parametrize(
    "config, kill_at",
    [
        (DENSE, 5),
        (DENSE, 11),
        pytest.param(SPARSE, 7, id="sparse-just-before-freeze"),
        pytest.param(SPARSE, 9, id="sparse-just-after-freeze"),
        pytest.param(SPARSE_LOG3, 9, id="sparse-after-freeze-mid-log-interval"),
    ],
)
def test_kill_at_a_step_then_resume(run_python, references, tmp_path, config, kill_at):
    # The per-step pause lets the asynchronous save of the step before the kill commit.
    config = (*config, "--step-sleep", SLEEP)
    ref_dir, reference = references(run_python, *config)
    proc, _ = _run(run_python, tmp_path, *config, "--kill-at", str(kill_at), check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]
    _, resumed = _run(run_python, tmp_path, *config)
    assert 0 < resumed["start_step"] < kill_at
    _assert_same_run(ref_dir, tmp_path, reference, resumed)


@pytest.mark.slow
@pytest.mark.parametrize("config", [DENSE, pytest.param(SPARSE, id="sparse")])
def test_kill_at_a_random_moment_then_resume(run_python, references, tmp_path, config):
    ref_dir, reference = references(run_python, *config, "--step-sleep", SLEEP)
    seed = random.randrange(1 << 30)
    delay = random.Random(seed).uniform(1.0, 10.0)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [
            str(pathlib.Path(dynadiag_jax.__file__).resolve().parents[1]),
            *filter(None, [env.get("PYTHONPATH")]),
        ]
    )
    args = [
        sys.executable,
        str(HERE / "train_child.py"),
        str(tmp_path),
        "--steps",
        str(STEPS),
        *config,
        "--step-sleep",
        SLEEP,
    ]
    child = subprocess.Popen(
        args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    time.sleep(delay)
    child.kill()
    child.wait()
    _, resumed = _run(run_python, tmp_path, *config, "--step-sleep", SLEEP)
    _assert_same_run(
        ref_dir, tmp_path, reference, resumed, f"random seed {seed}: killed after {delay:.2f}s"
    )
