"""ThreadSanitizer over the emulated CUDA kernels (real threads, one per CUDA thread).

Builds xla_ext/emu/kernel_check.cc - the forward, dx and dvalues launch sequences on small cases
against a float64 reference, without XLA - with -fsanitize=thread and runs it. A data race in a
kernel (a missing __syncthreads, a lane reading another lane's wmma store without __syncwarp) is
reported by TSan; any report fails the test. The same binary must abort on a divergent barrier.
"""

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DRIVER = ROOT / "xla_ext" / "emu" / "kernel_check.cc"


@pytest.fixture(scope="module")
def tsan_driver(tmp_path_factory):
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if cxx is None or not DRIVER.exists():
        pytest.skip("needs a C++ compiler (g++ or $CXX) and the xla_ext sources")
    exe = tmp_path_factory.mktemp("tsan") / "kernel_check"
    cmd = [
        cxx,
        "-std=c++17",
        "-O1",
        "-g",
        "-fsanitize=thread",
        "-pthread",
        "-Wall",
        "-Wno-unknown-pragmas",
        "-I",
        str(ROOT / "xla_ext"),
        str(DRIVER),
        "-o",
        str(exe),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"build failed:\n{proc.stderr[-4000:]}"
    return exe


def run(exe, *args):
    env = dict(os.environ, TSAN_OPTIONS="exitcode=66 halt_on_error=0")
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
def test_kernels_are_correct_and_race_free_under_tsan(tsan_driver):
    proc = run(tsan_driver)
    assert "ThreadSanitizer" not in proc.stderr, proc.stderr[-6000:]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert ", 0 failures;" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_divergent_barrier_aborts_with_both_call_sites(tsan_driver):
    proc = run(tsan_driver, "diverge")
    assert proc.returncode != 0
    assert "divergent __syncthreads: a thread waits at" in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("kernel_check.cc:") == 2, proc.stderr[-2000:]
