"""SIGKILL at any moment, restart, and end with exactly the metrics of an uninterrupted run."""

import json
import os
import pathlib
import random
import shutil
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


# --- damaged checkpoints and workdirs, as the training scripts meet them ------------------------

CONFIGS = HERE.parent / "train" / "configs"
# A dense mnist5k MLP: 31 steps, checkpoints at 30 and 31 (every 10, the last two kept).
FASHION = (
    f"--config={CONFIGS / 'fashion_mnist.py'}:sparsity=0,epochs=1",
    "--config.data.source=mnist5k",
    "--config.model.hidden=(64, 64)",
    "--config.train.checkpoint_every=10",
    "--noprogress",
)


def _fashion(run_python, workdir, check=True):
    script = str(HERE.parent / "train" / "fashion_mnist.py")
    return run_python([script, *FASHION, f"--workdir={workdir}"], check=check)


def _truncate_an_array_file(step_dir):
    data = max((step_dir / "state" / "ocdbt.process_0" / "d").iterdir(), key=os.path.getsize)
    data.write_bytes(data.read_bytes()[:100])


def _error_line(proc):
    """The one line a refused command prints (status 2, no traceback)."""
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = [x for x in proc.stderr.splitlines() if x.strip()]
    assert line.startswith("error: ")
    return line


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    """A finished run of :data:`FASHION` (its workdir, and its test accuracy line)."""
    workdir = tmp_path_factory.mktemp("dense")
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(dynadiag_jax.__file__).parents[1]))
    script = str(HERE.parent / "train" / "fashion_mnist.py")
    proc = subprocess.run(
        [sys.executable, script, *FASHION, f"--workdir={workdir}"],
        env=env,
        cwd=workdir,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    [accuracy] = [x for x in proc.stdout.splitlines() if x.startswith("dense: test accuracy")]
    return workdir, accuracy.split(",")[0]


@pytest.mark.slow
def test_kill_then_unreadable_newest_checkpoint_resumes_from_the_one_before(
    run_python, references, tmp_path
):
    config = ("--step-sleep", SLEEP)
    ref_dir, reference = references(run_python, *config)
    proc, _ = _run(run_python, tmp_path, *config, "--kill-at", "9", check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]
    # the newest committed step (the kill may come before the save of step 8 commits)
    newest = max(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    _truncate_an_array_file(tmp_path / "checkpoints" / str(newest))
    proc, resumed = _run(run_python, tmp_path, *config)
    assert resumed["start_step"] == newest - 2 and f"step {newest} cannot be read" in proc.stderr
    _assert_same_run(ref_dir, tmp_path, reference, resumed)


def test_script_warns_of_an_unreadable_checkpoint_and_errs_when_none_is_readable(
    run_python, dense_run, tmp_path
):
    source, accuracy = dense_run
    workdir = tmp_path / "run"
    shutil.copytree(source, workdir)
    checkpoints = workdir / "dense" / "checkpoints"
    _truncate_an_array_file(checkpoints / "31")
    proc = _fashion(run_python, workdir)
    [warning] = [x for x in proc.stderr.splitlines() if "cannot be read" in x]
    assert f"{checkpoints} step 31 cannot be read (state: " in warning
    assert "resuming from step 30" in warning and "Traceback" not in proc.stderr
    assert f"{accuracy}," in proc.stdout and "(resumed at step 30)" in proc.stdout
    for step in (30, 31):
        shutil.rmtree(checkpoints / str(step) / "state")
    kept = sorted(p.name for p in checkpoints.iterdir())
    line = _error_line(_fashion(run_python, workdir, check=False))
    assert line == (
        f"error: checkpoint {checkpoints} step 31 cannot be read (it has no state/); delete it "
        "or use another workdir (the earlier step 30 cannot be read either) (--workdir)"
    )
    assert sorted(p.name for p in checkpoints.iterdir()) == kept  # nothing moved or deleted


def test_script_refuses_a_workdir_that_cannot_hold_checkpoints(run_python, tmp_path):
    (tmp_path / "file").write_text("")
    line = _error_line(_fashion(run_python, tmp_path / "file", check=False))
    assert line == (
        f"error: checkpoint directory: {tmp_path / 'file' / 'dense' / 'checkpoints'} cannot be "
        f"created: {tmp_path / 'file'} is a file, not a directory (--workdir)"
    )
    (tmp_path / "run" / "dense").mkdir(parents=True)
    (tmp_path / "run" / "dense" / "checkpoints").write_text("")
    line = _error_line(_fashion(run_python, tmp_path / "run", check=False))
    assert line.endswith("checkpoints is a file, not a directory (--workdir)")


def test_sparsify_refuses_another_one_shot_recipe_and_an_unreadable_source(
    run_python, dense_run, tmp_path
):
    source, _ = dense_run

    def sparsify(checkpoint, sparsity, workdir, check=True):
        spec = f"checkpoint={checkpoint},runlocal,finetune_fraction=0,sparsity={sparsity}"
        args = [
            str(HERE.parent / "train" / "sparsify.py"),
            f"--config={CONFIGS / 'sparsify.py'}:{spec}",
        ]
        args += ["--config.model.hidden=(64, 64)", f"--workdir={workdir}", "--noprogress"]
        return run_python(args, check=check)

    workdir = tmp_path / "one_shot"
    sparsify(source / "dense", 0.9, workdir)
    table = (workdir / "sparsify.json").read_text()
    proc = sparsify(source / "dense", 0.8, workdir, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"error: checkpoint {workdir / 'checkpoints'}/0 was written")
    assert "dynadiag.sparsity: 0.9 in the checkpoint, 0.8 in this run" in proc.stderr
    assert (workdir / "sparsify.json").read_text() == table  # the 0.9 model's table stays
    sparsify(source / "dense", 0.9, workdir)  # the same recipe again: nothing to refuse
    damaged = tmp_path / "damaged"
    shutil.copytree(source / "dense", damaged)
    _truncate_an_array_file(damaged / "checkpoints" / "31")
    line = _error_line(sparsify(damaged, 0.9, tmp_path / "from_damaged", check=False))
    assert line.startswith(f"error: checkpoint {damaged / 'checkpoints'} step 31 cannot be read (")
