"""The CUDA kernels under the SIMT emulation's checks and the sanitizers, without XLA.

xla_ext/emu/kernel_check.cc runs the emulation's own checks on small faulty kernels
(simt_selftest.cc), then the forward, dx and dvalues launch sequences on small cases against a
float64 reference. It is built here several ways, all at once:

- with ThreadSanitizer (real threads, one per CUDA thread): a data race in a kernel - a missing
  __syncthreads, a lane reading another lane's wmma store without __syncwarp - is reported;
- with AddressSanitizer and UndefinedBehaviorSanitizer: an out-of-bounds global access or
  undefined behaviour in kernel or emulator code is reported;
- with each bug planted in the real kernels (DYNADIAG_PLANTED_BUG in cuda/diag_kernels.cuh),
  to show that the emulation or ASan catches it, with the message a kernel author would see.
"""

import concurrent.futures
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from conftest import once_per_session

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = [
    ROOT / "xla_ext" / "emu" / "kernel_check.cc",
    ROOT / "xla_ext" / "emu" / "simt_selftest.cc",
]
COMMON = ["-std=c++17", "-pthread", "-Wall", "-Wno-unknown-pragmas", "-I", str(ROOT / "xla_ext")]
# -O0: with UBSan, -O1 triples the compile time and saves less than that in the run.
ASAN = ["-O0", "-g1", "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]
FIBERS = ["-O0", "-DSIMT_FIBERS"]  # deterministic schedule, fastest to build
VARIANTS = {
    "tsan": ["-O1", "-g", "-fsanitize=thread"],
    "asan": ASAN,
    "unset_shared": [*FIBERS, "-DDYNADIAG_PLANTED_BUG=1"],
    "double_write": [*FIBERS, "-DDYNADIAG_PLANTED_BUG=2"],
    "out_of_bounds": [*ASAN, "-DDYNADIAG_PLANTED_BUG=3"],
}
ENV = {
    "TSAN_OPTIONS": "exitcode=66 halt_on_error=0",
    "ASAN_OPTIONS": "exitcode=67",
    "UBSAN_OPTIONS": "print_stacktrace=1",
}


@pytest.fixture(scope="session")
def drivers(tmp_path_factory):
    """{variant: executable}, compiled in parallel (each build takes 10-40 s), once for all xdist
    workers."""
    cxx = os.environ.get("CXX") or shutil.which("g++")
    if cxx is None or not all(s.exists() for s in SOURCES):
        pytest.skip("needs a C++ compiler (g++ or $CXX) and the xla_ext sources")

    def build_all(out):
        def build(name):
            exe = out / name
            cmd = [cxx, *COMMON, *VARIANTS[name], *map(str, SOURCES), "-o", str(exe)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, f"{name} build failed:\n{proc.stderr[-4000:]}"
            return str(exe)

        with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            return dict(zip(VARIANTS, pool.map(build, VARIANTS)))

    built = once_per_session(tmp_path_factory, "kernel_check", build_all)
    return {name: pathlib.Path(exe) for name, exe in built.items()}


def run(exe, *args):
    env = dict(os.environ, **ENV)
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=600, env=env)


def failures(proc):
    return [line for line in proc.stdout.splitlines() if line.startswith("FAIL")]


@pytest.mark.slow
def test_kernels_are_correct_and_race_free_under_tsan(drivers):
    # float16 runs the same kernel code as bfloat16 (one template, another T); ASan runs all three
    proc = run(drivers["tsan"], "--dtype", "float32,bfloat16")
    assert "ThreadSanitizer" not in proc.stderr, proc.stderr[-6000:]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert ", 0 failures;" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32,int8", "bfloat16,", "half"])
def test_an_unknown_dtype_is_refused_before_any_check(drivers, dtype):
    proc = run(drivers["unset_shared"], "--dtype", dtype)
    assert proc.returncode == 2 and proc.stdout.startswith("unknown dtype "), proc.stdout[-2000:]


@pytest.mark.slow
def test_divergent_barrier_aborts_with_both_call_sites(drivers):
    proc = run(drivers["tsan"], "diverge")
    assert proc.returncode != 0
    assert "divergent __syncthreads: a thread waits at" in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("kernel_check.cc:") == 2, proc.stderr[-2000:]


@pytest.mark.slow
def test_kernels_are_clean_under_asan_and_ubsan(drivers):
    proc = run(drivers["asan"])
    assert "Sanitizer" not in proc.stderr and "runtime error" not in proc.stderr, proc.stderr[
        -6000:
    ]
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert ", 0 failures;" in proc.stdout, proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("seed", ["1", "0xdead"])
def test_emulation_reports_every_planted_fault_of_its_own_kernels(drivers, seed):
    # The faulty kernels of simt_selftest.cc (shared memory left by another block, an index past a
    # shared row, misaligned wmma and vector accesses, output elements written twice, never or
    # past the end) must each be reported, and blocks must run shuffled and several at once,
    # whatever the block order.
    proc = run(drivers["unset_shared"], "--seed", seed, "--dtype", "float32")
    assert not [f for f in failures(proc) if "selftest" in f], proc.stdout[-4000:]


@pytest.mark.slow
def test_planted_unset_shared_read_is_reported_with_kernel_and_array(drivers):
    # Bug 1: the plan kernel never resets its shared counter of entries. On a GPU it starts with
    # what the previous block left (or garbage); the emulation poisons shared memory at every block
    # start and reports the first read of a byte the block has not written.
    proc = run(drivers["unset_shared"], "--dtype", "float16")
    assert proc.returncode == 1
    reports = [f for f in failures(proc) if "read of shared" in f]
    assert reports, proc.stdout[-4000:]
    assert all(
        "read of shared entries before any thread of its block wrote it "
        "(dynadiag::cuda::element_plan_kernel [with T = __half;"
        in r
        and "declared int32_t entries at cuda/diag_kernels.cuh:" in r
        for r in reports
    ), reports


@pytest.mark.slow
def test_planted_double_write_is_reported_with_both_kernels(drivers):
    # Bug 2: the product kernel runs the diagonal path after the tensor-core path of a block, and
    # writes its outputs again. On a GPU the numbers stay right (both paths compute the same sums),
    # so no comparison with a reference can see it; the output check does.
    proc = run(drivers["double_write"], "--dtype", "bfloat16")
    assert proc.returncode == 1
    pattern = re.compile(
        r"output ProductArgs::out\[\d+, \d+\] written twice: "
        r"by element_diagonal_tile<__nv_bfloat16, (true|false)> \(cuda/diag_kernels\.cuh:\d+\) "
        r"after element_tensor_core_tile<__nv_bfloat16> \(cuda/diag_kernels\.cuh:\d+\)"
    )
    reports = [f for f in failures(proc) if "written twice" in f]
    assert reports and all(pattern.search(r) for r in reports), proc.stdout[-4000:]
    assert not [f for f in failures(proc) if f.split()[1] == "dvalues"], (
        "dvalues has no planted bug"
    )


@pytest.mark.slow
def test_planted_out_of_bounds_read_is_caught_by_asan(drivers):
    # Bug 3: the diagonal walk reads values[k, t] for t past the diagonal's length D (the check
    # `t >= D` is gone); for the last diagonal that reads past the end of `values`.
    proc = run(drivers["out_of_bounds"], "--dtype", "float32")
    assert proc.returncode == 67, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "ERROR: AddressSanitizer: heap-buffer-overflow" in proc.stderr, proc.stderr[-4000:]
    frame0 = re.search(r"#0 0x[0-9a-f]+ in (.*)", proc.stderr)
    assert frame0 and "dynadiag::cuda::element_diagonal_tile<float, true>" in frame0.group(1), (
        proc.stderr[-4000:]
    )


@pytest.fixture(scope="module")
def planted_package(tmp_path_factory):
    """A copy of the imported dynadiag_jax whose _emu_ext has bug 2 (the double write) planted."""
    import dynadiag_jax

    # pip's cmake and ninja (the test extra) live beside the interpreter, maybe not on PATH.
    search = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])
    tools = {name: shutil.which(name, path=search) for name in ("cmake", "ninja")}
    try:
        import nanobind
    except ImportError:
        nanobind = None
    if None in tools.values() or nanobind is None:
        pytest.skip("needs cmake, ninja and nanobind (the test extra installs them)")
    work = tmp_path_factory.mktemp("planted_emu")
    configure = [
        tools["cmake"],
        "-S",
        str(ROOT),
        "-B",
        str(work / "build"),
        "-G",
        "Ninja",
        f"-DCMAKE_MAKE_PROGRAM={tools['ninja']}",
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DPython_EXECUTABLE={sys.executable}",
        f"-Dnanobind_DIR={nanobind.cmake_dir()}",
        "-DDYNADIAG_CUDA=OFF",
        "-DCMAKE_CXX_FLAGS=-DDYNADIAG_PLANTED_BUG=2",
        "-DDYNADIAG_EMU_OPT=-O0",  # one small call: compile time is all its cost
    ]
    for cmd in (
        configure,
        [tools["cmake"], "--build", str(work / "build"), "--target", "_emu_ext"],
    ):
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    package = work / "site" / "dynadiag_jax"
    shutil.copytree(
        pathlib.Path(dynadiag_jax.__file__).resolve().parent,
        package,
        ignore=shutil.ignore_patterns("_emu_ext*", "__pycache__"),
    )
    (built,) = (work / "build").rglob("_emu_ext*.so")
    shutil.copy(built, package / built.name)
    return work / "site"


@pytest.mark.slow
def test_a_failed_emulator_check_reaches_python_as_an_exception(planted_package, tmp_path):
    # Bug 2 leaves every number right; the output check reports the double write, and the FFI
    # handler returns the report as an error, so jax raises instead of returning the result.
    code = (
        f"PLANTED = {str(planted_package)!r}\n"
        + """
import jax, jax.numpy as jnp, numpy as np, dynadiag_jax as dd
assert dd.__file__.startswith(PLANTED), dd.__file__
x = jnp.ones((32, 64), jnp.bfloat16)
values = jnp.ones((64, 64), jnp.bfloat16)
offsets = jnp.arange(64, dtype=jnp.int32)
try:
    y = dd.diag_matmul(x, values, offsets, out_features=64, impl="cuda_emulated")
    y.block_until_ready()
except Exception as e:
    print("RAISED", type(e).__name__, str(e)[:2000])
else:
    print("RETURNED", np.asarray(y, np.float32)[0, :4])
"""
    )
    env = dict(os.environ, PYTHONPATH=str(planted_package))
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith("RAISED"), proc.stdout[-2000:]
    assert "emulated CUDA launch failed" in proc.stdout, proc.stdout[-2000:]
    assert re.search(r"output ProductArgs::out\[\d+, \d+\] written twice", proc.stdout), proc.stdout
