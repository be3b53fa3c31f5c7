"""The C++ sources build for a processor without AVX (aarch64: Grace Hopper, Graviton), where
CMakeLists.txt leaves out the AVX kernel files: compiled here with a cross compiler, when one is
installed (.ci/run installs it; `apt-get install g++-aarch64-linux-gnu`)."""

import pathlib
import shutil
import subprocess
import sysconfig

import jax.ffi
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CROSS = shutil.which("aarch64-linux-gnu-g++")
pytestmark = pytest.mark.skipif(CROSS is None, reason="no aarch64 cross compiler installed")

# What CMakeLists.txt compiles on a processor that is not x86-64 (the AVX files left out).
SOURCES = [
    "cpu/diag_kernels.cc",
    "cpu/kernels_portable.cc",
    "cpu/kernels_portable_blocks.cc",
    "cpu/module.cc",
    "cpu/ffi_handlers.cc",
    "cpu/gate_rank.cc",
    "plan/module.cc",
    "emu/ffi_handlers.cc",
    "emu/module.cc",
]


def _compile(source):
    nanobind = pytest.importorskip("nanobind")
    includes = [
        nanobind.include_dir(),
        jax.ffi.include_dir(),
        sysconfig.get_paths()["include"],
        str(ROOT / "xla_ext"),
        str(ROOT / "xla_ext" / "cpu"),
    ]
    return subprocess.run(
        [CROSS, "-std=c++17", "-fsyntax-only", "-DSIMT_FIBERS", "-Wno-unknown-pragmas"]
        + [f"-I{i}" for i in includes]
        + [str(ROOT / "xla_ext" / source)],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("source", SOURCES)
def test_source_compiles_for_aarch64(source):
    proc = _compile(source)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_avx_kernels_do_not_and_are_left_out_there():
    """The cross compiler targets aarch64 (the x86 intrinsics fail), and CMake compiles those
    files only on x86-64."""
    assert _compile("cpu/kernels_avx2.cc").returncode != 0
    cmake = (ROOT / "CMakeLists.txt").read_text()
    assert 'if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")' in cmake
    x86_only = cmake.split('if(CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")')[1]
    assert "kernels_avx512.cc" in x86_only.split("endif()")[0]
