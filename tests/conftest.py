"""Strict numerics for every test (no silent dtype or rank promotion) and shared fixtures."""

import fcntl
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest

import dynadiag_jax

jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

# The train/ scripts are imported by several test modules. Appended (not prepended, as pytest's
# `pythonpath` setting would) so that the installed dynadiag_jax, which holds the compiled
# extension, wins over the source checkout.
ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

CUDA_ARCHS = ("80", "90")  # the architectures the CUDA extension is built and checked for
# Measured on an H100 80GB HBM3 (2026-11-27, docs/gpu_cost_model.md): the block kernels' speed-up
# over XLA's dot on a ready W, (forward, forward + backward), at 403,456 x 768 -> 3072, bfloat16,
# random offsets, keyed by (b, sparsity)
H100_MEASURED_SPEEDUP = {
    (16, 0.8): (0.62, 0.42),
    (16, 0.9): (0.89, 0.75),
    (16, 0.95): (1.08, 1.01),
    (16, 0.98): (1.26, 1.48),
    (32, 0.8): (0.58, 0.52),
    (32, 0.9): (0.76, 0.77),
    (32, 0.95): (0.98, 1.14),
    (32, 0.98): (1.26, 1.50),
}


_CACHE_KEY = pytest.StashKey[str]()
_CACHE_SETTINGS = {
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}


# XLA's CPU compiler set for compile time: the suite's time is mostly compiling small programs it
# then runs for milliseconds. LLVM at optimisation level 0 (a quarter less wall time for
# test_results.py, test_nn.py and test_unedited_vit.py together, 303 -> 222 s), and XLA's older
# elemental emitters for its fusions instead of the MLIR fusion emitters (the MLP suite's search
# step compiles in 0.73 s instead of 1.79 s, a one-op program in 19 ms instead of 32 ms;
# bench/suite_step.py's compile rows). The HLO passes, and so every fusion and every custom call
# to our kernels (built by the C++ compiler, not by XLA), are unchanged; only the machine code of
# XLA's own fusions differs.
FAST_COMPILE_FLAGS = (
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
)


def pytest_configure(config):
    """Fast XLA compiles and one on-disk compilation cache for the session (each unless the
    environment sets its own).

    The tests, their xdist workers and the training runs they start in child processes compile
    many of the same programs (the same tiny models and steps, test after test); JAX serves a
    program compiled once to every later compile of it. A cached program is the one the compile
    would produce, so no result changes; ``train/results.py`` switches the cache off for its runs.
    """
    if hasattr(config, "workerinput"):
        return  # a worker inherits the controller's environment
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in FAST_COMPILE_FLAGS:
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    os.environ["XLA_FLAGS"] = flags
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    folder = tempfile.mkdtemp(prefix="dynadiag-tests-jax-cache-")
    config.stash[_CACHE_KEY] = folder
    os.environ["JAX_COMPILATION_CACHE_DIR"] = folder
    for name, value in _CACHE_SETTINGS.items():
        os.environ.setdefault(name, value)
    # this process imported jax already: it runs the tests without xdist
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs",
        float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
    )
    jax.config.update(
        "jax_persistent_cache_min_entry_size_bytes",
        int(os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"]),
    )


def pytest_unconfigure(config):
    folder = config.stash.get(_CACHE_KEY, None)
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)


def load_script(path):
    """The script at ``path`` (bench/, scripts/: not packages) as a module; the modules beside it
    are importable while it loads."""
    folder = str(pathlib.Path(path).parent)
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(pathlib.Path(path).stem, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(folder)
    return module


sass_counts = load_script(ROOT / "scripts" / "sass_counts.py")


def once_per_session(tmp_path_factory, name, make):
    """``make(folder)`` run once per test session, by whichever xdist worker asks first; the
    others wait for it and get the same result (JSON-able), the folder shared by all.

    A session-scoped fixture runs once per *worker*: an expensive one (a compile of minutes) ran
    twice on two workers. A failed ``make`` leaves no result, so the next worker tries again.
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # every worker's basetemp is a folder of the session's
    result = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not result.exists():
            folder = root / name
            folder.mkdir(exist_ok=True)
            result.write_text(json.dumps(make(folder)))
        return json.loads(result.read_text())


COMMAND_SHIM = pathlib.Path(__file__).with_name("doc_command_shim.py")


def shim_batch(commands, folder, *, run=False, cwd=None):
    """``[(status, stderr)]`` of ``[(script, args)]``, each in a child forked from one process
    that imported the libraries once (tests/doc_command_shim.py): up to the end of its command-line
    parsing, or with ``run`` to its end. ``folder`` holds the listing; ``cwd`` (default
    ``folder``) is where relative script paths start."""
    listing = pathlib.Path(folder) / "commands.json"
    listing.write_text(json.dumps([[str(script), list(args)] for script, args in commands]))
    proc = subprocess.run(
        [sys.executable, str(COMMAND_SHIM), "--batch-run" if run else "--batch", str(listing)],
        cwd=cwd or folder,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [tuple(result) for result in json.loads(proc.stdout)]


@pytest.fixture
def rng():
    """A fresh numpy Generator with a fixed seed per test."""
    return np.random.default_rng(0)


@pytest.fixture
def run_python(tmp_path):
    """Run Python code in a child process that imports the same dynadiag_jax as the tests.

    The child starts in a scratch directory, so a source checkout in the working directory cannot
    shadow the installed package (which holds the compiled extension).
    """
    package_root = str(pathlib.Path(dynadiag_jax.__file__).resolve().parent.parent)

    def run(args, *, env=None, timeout=600, check=True):
        env = dict(env or {})
        if "XLA_FLAGS" in env:  # added to the session's (FAST_COMPILE_FLAGS), not replacing them
            env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {env['XLA_FLAGS']}".strip()
        child_env = dict(os.environ, **env)
        child_env["PYTHONPATH"] = os.pathsep.join(
            [package_root, *filter(None, [child_env.get("PYTHONPATH")])]
        )
        proc = subprocess.run(
            [sys.executable, *args],
            cwd=tmp_path,
            env=child_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check:
            assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        return proc

    return run


def _device_code_inputs():
    """The files the device code is compiled from: everything under xla_ext/cuda/ and, from
    anywhere in xla_ext/, what those include, transitively (an edit of a CPU kernel alone does not
    make the build's device code stale)."""
    todo = [p for p in sass_counts.CUDA_DIR.rglob("*") if p.is_file()]
    seen = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        text = path.read_text(errors="replace")
        for name in re.findall(r'^\s*#\s*include\s+"([^"]+)"', text, re.M):
            if (ROOT / "xla_ext" / name).is_file():
                todo.append(ROOT / "xla_ext" / name)
    return seen


def _built_device_code():
    """``(ptxas -v log, folder)`` the CMake build kept (xla_ext/cuda/CMakeLists.txt: device/) for
    every architecture of ``CUDA_ARCHS``, newest first, if it was compiled after the last change
    to any of :func:`_device_code_inputs`; else None."""
    newest_source = max(p.stat().st_mtime for p in _device_code_inputs())
    logs = ROOT.glob("build/*/xla_ext/cuda/device/ptxas.log")
    for log in sorted(logs, key=lambda p: p.stat().st_mtime, reverse=True):
        text, folder = log.read_text(), log.parent
        if log.stat().st_mtime > newest_source and all(
            f"for 'sm_{a}'" in text and sass_counts.cubin_path(folder, a).exists()
            for a in CUDA_ARCHS
        ):
            return text, folder
    return None


@pytest.fixture(scope="session")
def cuda_device_build(tmp_path_factory):
    """``(ptxas -v log, folder)`` of the shipped CUDA source's device code for ``CUDA_ARCHS``; the
    folder keeps each architecture's cubin and PTX (``sass_counts.cubin_path``). The checked code
    is what the extension's build compiled, when that build is current; otherwise it is compiled
    here once per session (minutes on two cores). Skips without nvcc."""
    nvcc = sass_counts.find_tool("nvcc")
    if nvcc is None or not sass_counts.SOURCE.exists():
        pytest.skip("needs nvcc and the xla_ext sources")
    if built := _built_device_code():
        return built
    out = tmp_path_factory.mktemp("nvcc")
    return sass_counts.compile_device_code(nvcc, jax.ffi.include_dir(), out, CUDA_ARCHS), out
