"""The CUDA build without a GPU: ptxas resource use for sm_80/sm_90, lowering to the targets, and
the configure-time guard against an nvcc of another CUDA major version than JAX's plugin.

The ptxas test compiles the device code of xla_ext/cuda with nvcc (device code only, both
architectures) and fails on register spills, local-memory stack frames or shared memory beyond
the per-block limit; it also checks the tensor-core kernels really contain wmma.mma instructions.
"""

import importlib.util
import pathlib
import re
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from conftest import CUDA_ARCHS, sass_counts

import dynadiag_jax as dd
from dynadiag_jax import launch_plan

ROOT = pathlib.Path(__file__).resolve().parent.parent
GUARD = ROOT / "xla_ext" / "cuda" / "cuda_plugin_guard.cmake"
PLUGIN_LISTER = ROOT / "xla_ext" / "cuda" / "jax_cuda_plugin.py"
ARCHS = CUDA_ARCHS
SMEM_LIMIT = 48 * 1024  # static shared memory per block
MAX_REGISTERS = 255

# Kernel name fragment -> how many instantiations each architecture must show.
EXPECTED_KERNELS = {
    "element_plan_kernel": 6,  # float, half, bfloat16 x output axis moving/fixed
    "element_product_kernel": 6,
    "sddmm_kernel": 3,
    "sddmm_reduce_kernel": 3,
    # half, bfloat16 x fwd/dx x (outputs on the long axis: 10 (b, panel width) pairs; short: 4 b)
    "block_product_tc_kernel": 56,
    "block_product_simt_kernel": 12,  # float, half, bfloat16 x 4
    "block_sddmm_tc_kernel": 8,  # half, bfloat16 x 4 b
    "block_sddmm_simt_kernel": 3,
}


def ptxas_report(log: str) -> list[dict]:
    """Per (kernel, arch): registers, spill stores/loads, stack frame, smem, from -Xptxas -v."""
    entries, current = [], None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\S+)' for 'sm_(\d+)'", line):
            current = {"kernel": m.group(1), "arch": m.group(2), "smem": 0}
            entries.append(current)
        elif current is None:
            continue
        elif m := re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
        ):
            current.update(
                stack=int(m.group(1)), spill_stores=int(m.group(2)), spill_loads=int(m.group(3))
            )
        elif m := re.search(r"Used (\d+) registers", line):
            current["registers"] = int(m.group(1))
            if s := re.search(r"(\d+) bytes smem", line):
                current["smem"] = int(s.group(1))
    return entries


@pytest.fixture(scope="module")
def ptxas(cuda_device_build):
    log, out = cuda_device_build  # one nvcc build per session, shared with test_gpu_sass.py
    ptx = {a: "".join(p.read_text() for p in out.glob(f"*compute_{a}*.ptx")) for a in ARCHS}
    return ptxas_report(log), ptx


@pytest.mark.slow
def test_ptxas_no_spills_and_smem_within_the_block_limit(ptxas):
    report, _ = ptxas
    for arch in ARCHS:
        for name, count in EXPECTED_KERNELS.items():
            found = [e for e in report if e["arch"] == arch and f"{len(name)}{name}" in e["kernel"]]
            assert len(found) == count, f"sm_{arch}: {len(found)} instantiations of {name}"
    for e in report:
        where = f"{e['kernel']} sm_{e['arch']}"
        assert e["spill_stores"] == 0 and e["spill_loads"] == 0, f"{where} spills: {e}"
        assert e["stack"] == 0, f"{where} uses a local-memory stack frame: {e}"
        assert e["smem"] <= SMEM_LIMIT, f"{where} needs {e['smem']} bytes of shared memory"
        assert e["registers"] <= MAX_REGISTERS, f"{where}: {e['registers']} registers"


@pytest.mark.slow
def test_tensor_core_products_and_dvalues_fit_two_blocks_per_sm_without_divisions_or_16_bit_io(
    cuda_device_build,
):
    nvdisasm = sass_counts.find_tool("nvdisasm")
    if nvdisasm is None:
        pytest.skip("needs nvdisasm (pip install nvidia-cuda-nvdisasm)")
    log, out = cuda_device_build
    sass = sass_counts.disassemble(nvdisasm, sass_counts.cubin_path(out))
    assert sass_counts.guard_violations(log, sass) == []


@pytest.mark.parametrize(
    "kernel,name",
    [
        (
            "block_product_tc_kernel",
            "_ZN8dynadiag4cuda23block_product_tc_kernelI13__nv_bfloat16Lb1ELb0ELi16ELi64EEEvNS0_"
            "16BlockProductArgsIT_EE",
        ),
        (
            "block_sddmm_tc_kernel",
            "_ZN8dynadiag4cuda21block_sddmm_tc_kernelI13__nv_bfloat16Li16EEEvNS0_"
            "14BlockSddmmArgsIT_EE",
        ),
    ],
)
def test_the_guards_see_registers_a_division_in_the_main_loop_and_16_bit_accesses(kernel, name):
    # a listing in nvdisasm's format: a division inside the pipeline loop, a 16-bit store after it
    (loop,) = sass_counts.span_lines(sass_counts.REGIONS[kernel]["stage"][1][0])
    file = f"/work/xla_ext/cuda/{loop[0]}"
    listing = f"""
.text.{name}:
.L_x_1:
	//## File "{file}", line {loop[1] + 1}
        /*0000*/                   I2F.U32.RP R0, R1 ;
        /*0010*/                   MUFU.RCP R0, R0 ;
	//## File "{file}", line {loop[1]}
        /*0020*/              @!P0 BRA `(.L_x_1) ;
        /*0030*/                   STG.E.U16 desc[UR4][R2.64], R5 ;
        /*0040*/                   EXIT ;
"""
    log = (
        f"ptxas info    : Compiling entry function '{name}' for 'sm_90'\n"
        "ptxas info    : Used 130 registers, used 1 barriers, 44032 bytes smem"
    )
    found = sass_counts.guard_violations(log, listing)
    assert len(found) == 3, found
    assert "130 registers" in found[0] and "division" in found[1] and "16-bit" in found[2]


@pytest.mark.slow
def test_tensor_core_kernels_issue_wmma(ptxas):
    _, ptx = ptxas
    for arch in ARCHS:
        assert "wmma.mma.sync.aligned.row.col.m16n16k16.f32.bf16.bf16.f32" in ptx[arch], arch
        assert re.search(r"wmma\.mma\.sync\.aligned\.row\.col\.m16n16k16\.f32\.f32", ptx[arch]), (
            arch
        )


def test_diag_matmul_lowers_to_the_cuda_targets_with_a_workspace():
    if not dd.has_cuda_kernels():
        # with a CUDA compiler at hand a missing build is a CI failure, not a reason to skip
        if shutil.which("nvcc") is not None:
            pytest.fail(
                "nvcc is on PATH but dynadiag_jax was installed without the CUDA kernels; "
                "reinstall with `DYNADIAG_CUDA=ON pip install .` to see why the CUDA build failed "
                "or was skipped"
            )
        pytest.skip("CUDA targets not built (no nvcc on PATH)")
    rows, in_f, out_f, k = 4, 16, 48, 3
    # element diagonals with the tensor-core plan and without it; block diagonals (b = 16)
    for dtype, v_shape in (
        (jnp.bfloat16, (k, in_f)),
        (jnp.float32, (k, in_f)),
        (jnp.bfloat16, (k, 3, 16, 16)),
    ):
        block_size = v_shape[-1] if len(v_shape) == 4 else 1
        x = jax.ShapeDtypeStruct((rows, in_f), dtype)
        v = jax.ShapeDtypeStruct(v_shape, dtype)
        o = jax.ShapeDtypeStruct((k,), jnp.int32)

        def f(x, v, o):
            return dd.diag_matmul(x, v, o, out_features=out_f, impl="ffi")

        def loss(x, v, o):
            return jnp.sum(f(x, v, o).astype(jnp.float32) ** 2)

        fwd = jax.jit(f).trace(x, v, o).lower(lowering_platforms=("cuda",)).as_text()
        grad = (
            jax.jit(jax.grad(loss, argnums=(0, 1)))
            .trace(x, v, o)
            .lower(lowering_platforms=("cuda",))
            .as_text()
        )
        for kind, text in (("fwd", fwd), ("fwd", grad), ("dx", grad), ("dvalues", grad)):
            calls = [
                line
                for line in text.splitlines()
                if f"stablehlo.custom_call @dynadiag_diag_matmul_v2_{kind}(" in line
            ]
            assert calls, f"no {kind} custom call in the CUDA lowering ({dtype.__name__})"
            nbytes = launch_plan.workspace_bytes(
                kind, rows, in_f, out_f, k, dtype, block_size=block_size
            )
            nbytes = max(1, nbytes)
            where = f"{kind} ({dtype.__name__}) workspace: {calls[0]}"
            assert all(f"tensor<{nbytes}xui8>" in c for c in calls), where


def fake_distribution(site, name, version):
    """An installed distribution as importlib.metadata sees it: a .dist-info with METADATA."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_plugin_lister_finds_the_cuda_major_of_each_jax_plugin(tmp_path):
    spec = importlib.util.spec_from_file_location("jax_cuda_plugin", PLUGIN_LISTER)
    lister = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(lister)
    assert lister.installed_plugins([str(tmp_path)]) == []
    fake_distribution(tmp_path, "jax-cuda13-plugin", "0.8.1")
    fake_distribution(tmp_path, "jax_cuda12_pjrt", "0.7.2")
    fake_distribution(tmp_path, "jax-cuda-tools", "1.0")  # not a plugin: no major version
    fake_distribution(tmp_path, "jaxlib", "0.8.1")
    assert lister.installed_plugins([str(tmp_path)]) == [
        ("jax-cuda13-plugin", "0.8.1", 13),
        ("jax_cuda12_pjrt", "0.7.2", 12),
    ]


@pytest.mark.parametrize(
    "nvcc,plugin,ok",
    [
        ("13.0.88", None, True),  # a CPU-only JAX: nothing to check
        ("13.0.88", "jax-cuda13-plugin", True),
        ("12.8.93", "jax-cuda12-plugin", True),
        ("13.0.88", "jax-cuda12-plugin", False),
        ("12.8.93", "jax-cuda13-plugin", False),
    ],
)
def test_configure_refuses_an_nvcc_of_another_major_than_the_jax_plugin(tmp_path, nvcc, plugin, ok):
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.skip("needs cmake on PATH")
    if plugin is not None:
        fake_distribution(tmp_path, plugin, "0.8.1")
    proc = subprocess.run(
        [cmake, f"-DCUDA_VERSION={nvcc}", f"-DPYTHON={sys.executable}"]
        + [f"-DPLUGIN_PATH={tmp_path}", "-P", str(GUARD)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if ok:
        assert proc.returncode == 0, proc.stderr
        assert (plugin is None) == ("matches" not in proc.stdout), proc.stdout
        return
    want = re.search(r"cuda(\d+)", plugin).group(1)
    message = " ".join(proc.stderr.split())  # CMake wraps long messages
    assert proc.returncode != 0
    assert (
        f"nvcc is CUDA {nvcc}, but JAX's CUDA plugin {plugin} 0.8.1 is built for CUDA {want}"
        in (message)
    ), proc.stderr
    assert f"Use a CUDA {want} nvcc" in message and "DYNADIAG_CUDA=OFF" in message, proc.stderr
