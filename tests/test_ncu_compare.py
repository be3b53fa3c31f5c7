"""bench/ncu_compare.py on a synthetic Nsight Compute raw CSV, and gpu_check.sh's profile step.

The CSV is laid out as ``ncu --csv --page raw`` writes it (ncu's messages, a header row, a units
row, one row per launch, comma thousands); its measurements are the model's predictions times
known factors, so the join and the ratios can be checked against ``gpu_cost`` directly.
"""

import csv
import math
import os
import pathlib
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_script

import dynadiag_jax as dd
from dynadiag_jax import gpu_cost
from dynadiag_jax.layout import geometry

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "ncu_compare.py"
GPU_CHECK = ROOT / "scripts" / "gpu_check.sh"
ROWS, IN, OUT = 403456, 768, 3072

INFO = (
    "ID,Process ID,Process Name,Host Name,Kernel Name,Context,Stream,Block Size,Grid Size,Device,CC"
).split(",")
# unit of each metric as ncu prints it without --print-units base, and its factor from base units
UNITS = {
    "smsp__inst_executed.sum": ("inst", 1.0),
    "sm__inst_executed_pipe_tensor_op_hmma.sum": ("inst", 1.0),
    "launch__registers_per_thread": ("register/thread", 1.0),
    "sm__maximum_warps_per_active_cycle_pct": ("%", 1.0),
    "sm__warps_active.avg.pct_of_peak_sustained_active": ("%", 1.0),
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": ("", 1.0),
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum": ("", 1.0),
    "dram__bytes.sum": ("Gbyte", 1e-9),
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": ("%", 1.0),
    "lts__t_bytes.sum": ("Mbyte", 1e-6),
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": ("%", 1.0),
    "gpu__time_duration.sum": ("msecond", 1e3),
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": ("%", 1.0),
    "smsp__issue_active.avg.pct_of_peak_sustained_active": ("%", 1.0),
    **{
        f"lts__{m}.avg.pct_of_peak_sustained_elapsed": ("%", 1.0)
        for m in ("t_tag_requests", "t_sectors", "d_sectors", "xbar2lts_cycles_active")
    },
    "lts__t_requests.sum": ("", 1.0),
    "lts__t_sectors.sum": ("sector", 1.0),
    **{
        f"smsp__warp_issue_stalled_{reason}_per_warp_active.pct": ("%", 1.0)
        for reason in ("barrier", "long_scoreboard", "short_scoreboard", "mio_throttle")
        + ("lg_throttle", "math_pipe_throttle", "wait", "not_selected", "selected")
        + ("dispatch_stall", "no_instruction", "drain", "membar", "branch_resolving")
    },
}
# measured / predicted in the fixture, per model quantity
FACTOR = {
    "instructions": 1.25,
    "hmma": 1.0,
    "registers": 1.0,
    "occupancy %": 1.0,
    "achieved occ. %": 0.8,
    "hbm bytes": 1.5,
    "hbm busy %": 0.5,
    "l2 bytes": 2.0,
    "l2 busy %": 0.9,
    "seconds": 3.0,
}
FWD16 = (
    "void dynadiag::cuda::block_product_tc_kernel<__nv_bfloat16, true, false, 16, 64>"
    "(dynadiag::cuda::BlockProductArgs<__nv_bfloat16>)"
)
DX32 = FWD16.replace("true, false, 16, 64", "false, true, 32, 32")
REDUCE = (
    "void dynadiag::cuda::sddmm_reduce_kernel<__nv_bfloat16>"
    "(dynadiag::cuda::ReduceArgs<__nv_bfloat16>)"
)
CUTLASS = "void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_64x64_32x6_tn_align8>(Params)"


@pytest.fixture(scope="module")
def nc():
    """bench/ncu_compare.py as a module (it imports diag_matmul_gpu from beside it)."""
    return load_script(SCRIPT)


def model_path(b):
    """The kernels' launches at the headline shape with the benchmark's offsets (seed 0)."""
    k = dd.num_diagonals(IN, OUT, 0.9, block_size=b)
    offsets = np.random.default_rng(0).choice(geometry(IN, OUT, b).num_candidates, k, False)
    pred = gpu_cost.predict(ROWS, IN, OUT, jnp.bfloat16, offsets=offsets, block_size=b)
    return pred.paths["kernel"]


def predicted(launch):
    """The model's quantity for each term with a factor, as the docs define them."""
    spec, dt = gpu_cost.H100, jnp.bfloat16
    blocks = gpu_cost.occupancy(launch.registers, launch.shared_bytes, launch.threads, spec)[0]
    occupancy = 100.0 * blocks * (launch.threads // 32) / spec.sm_max_warps
    seconds = launch.seconds(spec, dt)
    return {
        "instructions": launch.instructions,
        "hmma": 2 * launch.mma,
        "registers": launch.registers,
        "occupancy %": occupancy,
        "achieved occ. %": occupancy,
        "hbm bytes": launch.hbm_bytes,
        "hbm busy %": 100.0 * launch.terms(spec, dt)["hbm"] / seconds,
        "l2 bytes": launch.load_bytes + launch.store_bytes + launch.hbm_bytes,
        "l2 busy %": 100.0 * launch.terms(spec, dt)["l2"] / seconds,
        "seconds": seconds,
    }


def measured_row(launch, scale=1.0):
    """Metric -> cell text: the model's values times FACTOR, in UNITS, with comma thousands."""
    p = predicted(launch)
    base = {
        "smsp__inst_executed.sum": p["instructions"] * FACTOR["instructions"],
        "sm__inst_executed_pipe_tensor_op_hmma.sum": p["hmma"],
        "launch__registers_per_thread": p["registers"],
        "sm__maximum_warps_per_active_cycle_pct": p["occupancy %"],
        "sm__warps_active.avg.pct_of_peak_sustained_active": p["occupancy %"] * 0.8,
        "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum": 123456.0,
        "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum": 0.0,
        "dram__bytes.sum": p["hbm bytes"] * FACTOR["hbm bytes"],
        "dram__throughput.avg.pct_of_peak_sustained_elapsed": p["hbm busy %"] * 0.5,
        "lts__t_bytes.sum": p["l2 bytes"] * FACTOR["l2 bytes"],
        "lts__throughput.avg.pct_of_peak_sustained_elapsed": p["l2 busy %"] * FACTOR["l2 busy %"],
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": 7.5,
        "gpu__time_duration.sum": p["seconds"] * FACTOR["seconds"] * scale,
    }
    # the measurements the model has no term for
    base.update({m: 12.5 for m in UNITS if m not in base})
    return {m: f"{v * UNITS[m][1]:,.6f}" for m, v in base.items()}


def raw_csv(path, launches):
    """Write ``[(kernel name, grid, metric cells)]`` as ncu's raw page, ncu's messages around it."""
    metrics = list(UNITS)
    with open(path, "w", newline="") as fh:
        fh.write("==PROF== Connected to process 4242 (/venv/bin/python3.12)\n")
        writer = csv.writer(fh, quoting=csv.QUOTE_ALL, lineterminator="\n")
        writer.writerow(INFO + metrics)
        writer.writerow([""] * len(INFO) + [UNITS[m][0] for m in metrics])
        for i, (name, grid, cells) in enumerate(launches):
            info = [i, 4242, "python3.12", "127.0.0.1", name, 1, 7, "(256, 1, 1)"]
            info += [f"({grid}, 1, 1)", 0, 9.0]  # grid size, device, compute capability
            writer.writerow(info + [cells.get(m, "n/a") for m in metrics])
            if i == 1:
                fh.write('==PROF== Profiling "block_product_tc_kernel" - 2: 0%....50%....100%\n')
        fh.write("==PROF== Disconnected from process 4242\n")
    return path


@pytest.fixture(scope="module")
def headline(tmp_path_factory):
    """The fixture CSV: b = 16 fwd twice, b = 32 dx, b = 16 dvalues reduction (tensor pipe
    n/a), a cuBLAS kernel, a dynadiag kernel with a grid the model has not and a name without
    template arguments."""
    p16, p32 = model_path(16), model_path(32)
    fwd16, reduce16, dx32 = p16.fwd[0], p16.bwd[-1], p32.bwd[0]
    assert (fwd16.name, reduce16.name, dx32.name) == (
        "block_product",
        "sddmm_reduce",
        "block_product",
    )
    reduce_cells = measured_row(reduce16)
    del reduce_cells["sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"]
    launches = [
        (FWD16, fwd16.ctas, measured_row(fwd16)),
        (FWD16, fwd16.ctas, measured_row(fwd16, scale=1.1)),  # the fwd of the fwd+bwd call
        (DX32, dx32.ctas, measured_row(dx32)),
        (REDUCE, reduce16.ctas, reduce_cells),
        (CUTLASS, 1000, measured_row(fwd16)),
        (FWD16, fwd16.ctas // 3, measured_row(fwd16)),
        ("block_sddmm_tc_kernel", 1056, measured_row(fwd16)),
        ("loop_convert_fusion_2", 64, measured_row(fwd16)),
    ]
    path = raw_csv(tmp_path_factory.mktemp("ncu") / "ncu.csv", launches)
    return path, {"fwd": fwd16, "dx": dx32, "reduce": reduce16}


def test_the_raw_page_is_read_past_messages_and_units(nc, headline):
    path, model = headline
    launches = nc.read_raw_csv(path)
    assert [la.kernel_name for la in launches] == [
        FWD16,
        FWD16,
        DX32,
        REDUCE,
        CUTLASS,
        FWD16,
        "block_sddmm_tc_kernel",
        "loop_convert_fusion_2",
    ]
    first = launches[0]
    assert first.grid == model["fwd"].ctas and first.threads == 256
    m = first.metrics
    # comma thousands and SI units (Gbyte, Mbyte, msecond) come back in bytes and seconds
    assert m["smsp__inst_executed.sum"] == pytest.approx(1.25 * model["fwd"].instructions)
    assert m["dram__bytes.sum"] == pytest.approx(1.5 * model["fwd"].hbm_bytes, rel=1e-6)
    secs = model["fwd"].seconds(gpu_cost.H100, jnp.bfloat16)
    assert m["gpu__time_duration.sum"] == pytest.approx(3.0 * secs, rel=1e-6)
    tensor = "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
    assert m[tensor] == 7.5 and launches[3].metrics[tensor] is None  # n/a


def test_values_units_and_names_parse(nc):
    assert nc.parse_value("1,234,567.5") == 1234567.5 and nc.parse_value("n/a") is None
    assert nc.unit_scale("usecond") == 1e-6 and nc.unit_scale("Kbyte") == 1e3
    assert nc.unit_scale("ns") == 1e-9 and nc.unit_scale("%") == 1.0
    assert nc.unit_scale("inst") == 1.0 and nc.unit_scale("byte/second") == 1.0
    assert nc.kernel_key(FWD16) == ("block_product_tc_kernel", "bfloat16", (True, False, 16, 64))
    assert nc.kernel_key(REDUCE) == ("sddmm_reduce_kernel", "bfloat16", ())
    half = "void dynadiag::cuda::element_product_kernel<__half, false>(ProductArgs<__half>)"
    assert nc.kernel_key(half) == ("element_product_kernel", "float16", (False,))
    assert nc.kernel_key("block_sddmm_tc_kernel") == "block_sddmm_tc_kernel"
    assert nc.kernel_key(CUTLASS) is None and nc.kernel_key("loop_convert_fusion_2") is None


def test_no_header_is_an_error(nc, tmp_path):
    path = tmp_path / "log.csv"
    path.write_text("==ERROR== ERR_NVGPUCTRPERM - no permission to access counters\n")
    with pytest.raises(ValueError, match="no ncu raw header"):
        nc.read_raw_csv(path)


def test_launches_are_grouped_by_kernel_and_grid_and_joined_to_the_model(nc, headline):
    path, model = headline
    args = nc.parse_args([str(path)])
    groups, ignored = nc.join(
        nc.read_raw_csv(path), nc.model_launches(args, gpu_cost.H100), "bfloat16"
    )
    # XLA's dot (a cuBLAS GEMM) is kept as the reference, other XLA kernels are left out
    assert ignored == ["loop_convert_fusion_2"]
    by = {(g.key[0], g.key[2], g.grid): g for g in groups}
    assert len(by) == len(groups) == 6 and len(nc.ours(groups)) == 5
    ref = by[(CUTLASS.removeprefix("void "), (), 1000)]
    assert (ref.role, ref.predicted, len(ref.launches)) == (nc.REFERENCE_ROLE, None, 1)
    fwd = by[("block_product_tc_kernel", (True, False, 16, 64), model["fwd"].ctas)]
    assert (fwd.block_size, fwd.role, len(fwd.launches)) == (16, "fwd block_product", 2)
    assert fwd.predicted == model["fwd"]
    dx = by[("block_product_tc_kernel", (False, True, 32, 32), model["dx"].ctas)]
    assert (dx.block_size, dx.role, dx.predicted) == (32, "dx block_product", model["dx"])
    red = by[("sddmm_reduce_kernel", (), model["reduce"].ctas)]
    assert (red.block_size, red.role, red.predicted) == (
        16,
        "dvalues sddmm_reduce",
        model["reduce"],
    )
    # listed, not dropped: a grid the model has no launch with, a name without its template
    odd = by[("block_product_tc_kernel", (True, False, 16, 64), model["fwd"].ctas // 3)]
    assert odd.predicted is None and "no model launch with this grid" in odd.role
    assert str(model["fwd"].ctas) in odd.role and "75648" in odd.role  # the model's b = 32 grid
    bare = by[("block_sddmm_tc_kernel", (), 1056)]
    assert bare.predicted is None and "--print-kernel-base demangled" in bare.role
    # asked for float16, the bfloat16 kernels join nothing
    groups16, _ = nc.join(nc.read_raw_csv(path), nc.model_launches(args, gpu_cost.H100), "float16")
    assert all(g.predicted is None for g in groups16)
    assert any("profiled in bfloat16" in g.role for g in groups16)


def test_every_term_meets_its_prediction_with_the_measured_ratio(nc, headline):
    path, model = headline
    args = nc.parse_args([str(path)])
    launches = nc.read_raw_csv(path)
    groups, _ = nc.join(launches, nc.model_launches(args, gpu_cost.H100), "bfloat16")
    recs = nc.records(groups, gpu_cost.H100, jnp.bfloat16, set(launches[0].metrics))
    key = {
        "fwd": ("<bfloat16, true, false, 16, 64>", model["fwd"].ctas),
        "dx": ("<bfloat16, false, true, 32, 32>", model["dx"].ctas),
        "reduce": ("sddmm_reduce_kernel<bfloat16>", model["reduce"].ctas),
    }
    for role, (label, grid) in key.items():
        rows = {r["term"]: r for r in recs if label in r["kernel"] and r["grid"] == grid}
        assert set(rows) == {t.name for t in nc.TERMS}
        want = predicted(model[role])
        for term, factor in FACTOR.items():
            r = rows[term]
            assert r["predicted"] == pytest.approx(want[term]), (role, term)
            if want[term] == 0:  # no HMMA in the reduction: no ratio
                assert r["ratio"] == "" and r["measured"] == 0, (role, term)
                continue
            # the fwd ran twice, the second 10% longer: the median of the two
            expect = factor * (1.05 if (role, term) == ("fwd", "seconds") else 1.0)
            assert r["ratio"] == pytest.approx(expect, rel=1e-3), (role, term)
        # bank conflicts: measured, modelled as none, so no ratio; the tensor pipe has no model
        ld = rows["smem ld conflicts"]
        assert (ld["measured"], ld["predicted"], ld["ratio"]) == (123456.0, 0.0, "")
        assert rows["tensor pipe %"]["predicted"] == "" and rows["tensor pipe %"]["ratio"] == ""
    assert rows["tensor pipe %"]["measured"] == ""  # n/a in the reduction's row
    fwd_rows = [r for r in recs if "<bfloat16, true, false, 16, 64>" in r["kernel"]]
    assert {r["profiled"] for r in fwd_rows if r["grid"] == model["fwd"].ctas} == {2}
    # an unjoined group keeps its measurements and has no predictions
    odd = [r for r in fwd_rows if r["grid"] == model["fwd"].ctas // 3]
    assert odd and all(r["predicted"] == "" and r["measured"] != "" for r in odd)
    assert all(r["block_size"] == "" for r in odd)


def test_the_script_prints_the_table_and_writes_the_csv(nc, run_python, headline, tmp_path):
    path, model = headline
    out = tmp_path / "compare.csv"
    proc = run_python([str(SCRIPT), str(path), "--out", str(out)])
    assert "block_product_tc_kernel<bfloat16, true, false, 16, 64>" in proc.stdout, proc.stdout
    assert f"grid {model['fwd'].ctas}  b=16 fwd block_product  (2 profiled)" in proc.stdout
    assert f"grid {model['dx'].ctas}  b=32 dx block_product" in proc.stdout
    assert re.search(r"instructions\s+\S+\s+\S+\s+1\.250", proc.stdout), proc.stdout
    assert (
        "not joined: block_product_tc_kernel<bfloat16, true, false, 16, 64> "
        f"grid {model['fwd'].ctas // 3}" in proc.stderr
    )
    assert "not joined: block_sddmm_tc_kernel grid 1056" in proc.stderr
    assert "ignored (not a dynadiag kernel): loop_convert_fusion_2 (1 launches" in proc.stderr
    assert f"grid 1000  {nc.REFERENCE_ROLE}" in proc.stdout
    with open(out, newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 6 * len(UNITS)  # six groups, every metric of the fixture
    ref = [r for r in rows if r["launch"] == nc.REFERENCE_ROLE]
    assert {r["predicted"] for r in ref} == {""} and len(ref) == len(UNITS)
    fwd = [r for r in rows if r["launch"] == "fwd block_product"]
    stalls = [r for r in fwd if r["term"] == "stall barrier %"]
    assert stalls and all(float(r["measured"]) == 12.5 and r["predicted"] == "" for r in stalls)
    seconds = [r for r in rows if r["term"] == "seconds" and r["launch"] == "dx block_product"]
    assert len(seconds) == 1 and math.isclose(float(seconds[0]["ratio"]), 3.0, rel_tol=1e-3)


def test_a_csv_without_dynadiag_kernels_or_no_csv_is_an_error(run_python, tmp_path):
    fwd = model_path(16).fwd[0]
    path = raw_csv(tmp_path / "cublas.csv", [(CUTLASS, 1000, measured_row(fwd))])
    proc = run_python([str(SCRIPT), str(path)], check=False)
    assert proc.returncode == 2 and "no dynadiag kernel among its 1 launches" in proc.stderr
    assert CUTLASS in proc.stderr
    proc = run_python([str(SCRIPT), str(tmp_path / "none.csv")], check=False)
    assert proc.returncode == 2 and "no such file" in proc.stderr


def test_metric_lists_cover_the_terms(nc, capsys):
    required, optional = [], []
    for kind, into in (("required", required), ("optional", optional)):
        assert nc.main(["--list-metrics", kind]) == 0
        into += capsys.readouterr().out.strip().split(",")
    assert set(required) | set(optional) == set(UNITS) and not set(required) & set(optional)
    assert "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active" in optional
    assert {"smsp__inst_executed.sum", "gpu__time_duration.sum", "dram__bytes.sum"} <= set(required)


def test_gpu_check_profiles_the_benchmarked_shape_with_the_listed_metrics(nc):
    subprocess.run(["bash", "-n", str(GPU_CHECK)], check=True)
    text = GPU_CHECK.read_text()
    step = text[text.index("Nsight Compute profile of the goal shape") :]
    assert 'log "ncu (Nsight Compute) not found: the profile is skipped"' in step
    assert "/usr/local/cuda/bin/ncu" in step and "--list-metrics required" in step
    assert "--csv --page raw" in step
    assert "--kernel-name" not in step  # every kernel: ours, cuBLAS's and XLA's around them
    assert "--print-kernel-base demangled" in step
    # the comparison asks the model about the shape the profiled benchmark runs
    flat = step.replace("\\\n", " ")
    bench = re.search(r"diag_matmul_gpu\.py\" (.*?) --out", flat).group(1).split()
    compare = re.search(r"COMPARE\[@\]}\" \"\$OUT/ncu_goal\.csv\" (.*?) --out", flat)
    compare = compare.group(1).split()
    b, c = dict(zip(bench[::2], bench[1::2])), dict(zip(compare[::2], compare[1::2]))
    assert (b["--batch"], b["--shapes"], b["--sparsities"]) == (
        c["--rows"],
        c["--shape"],
        c["--sparsity"],
    )
    assert b["--block-sizes"] == c["--block-sizes"] and b["--layouts"] == "random"
    assert (b["--repeats"], b["--warmup"], b["--impls"]) == ("1", "0", "ffi")
    # and the benchmark takes those arguments
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import diag_matmul_gpu
    finally:
        sys.path.remove(str(SCRIPT.parent))
    parsed = diag_matmul_gpu.parse_args(bench)
    assert (parsed.repeats, parsed.warmup, parsed.block_sizes) == (1, 0, (16, 32))
    with pytest.raises(SystemExit):
        diag_matmul_gpu.parse_args(["--repeats", "0"])
    # --quick sets defaults; it overrode the options typed beside it
    quick = diag_matmul_gpu.parse_args(["--quick", "--block-sizes", "32", "--sparsities", "0.95"])
    assert (quick.block_sizes, quick.sparsities, quick.shapes) == ((32,), (0.95,), ((768, 3072),))
    assert quick.impls == ("ffi", "dense")


def test_the_profile_step_runs_with_a_stand_in_ncu(nc, headline, tmp_path):
    """The step as gpu_check.sh runs it, with an ncu that lists one tensor-pipe metric, records
    its arguments and writes the fixture as its log file."""
    path, model = headline
    text = GPU_CHECK.read_text()
    step = text[text.index('log "5. ') : text.index("\nfi\n", text.index('log "5. ')) + 4]
    limited = next(line for line in text.splitlines() if line.startswith("limited() "))
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    ncu = bin_dir / "ncu"
    ncu.write_text(f"""#!/usr/bin/env bash
if [ "$1" = --query-metrics ]; then
  printf 'Metric Name  Metric Description\\nsm__inst_executed_pipe_tensor_op_hmma  warp insts\\n'
  exit 0
fi
printf '%s\\n' "$@" > {tmp_path}/args.txt
while [ $# -gt 0 ]; do [ "$1" = --log-file ] && cp {path} "$2"; shift; done
""")
    ncu.chmod(0o755)
    venv = tmp_path / "venv"  # $VENV/bin/python: this interpreter
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    script = tmp_path / "step.sh"
    script.write_text(f"""set -euo pipefail
OUT={out}; REPO={ROOT}; VENV={venv}; status=0
log() {{ echo "== $*" | tee -a "$OUT/gpu_check.log"; }}
want() {{ true; }}
{limited}
{step}
echo "status $status"
""")
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    # the package the tests import (it holds the compiled extension), as run_python does
    env["PYTHONPATH"] = os.pathsep.join(
        [str(pathlib.Path(dd.__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0 and "status 0" in proc.stdout, proc.stdout + proc.stderr
    args = (tmp_path / "args.txt").read_text().split("\n")
    metrics = args[args.index("--metrics") + 1].split(",")
    listed = [t.metric for t in nc.TERMS if not t.optional]
    assert metrics == [*listed, "sm__inst_executed_pipe_tensor_op_hmma.sum"]
    assert "ncu does not list sm__pipe_tensor_op_hmma_cycles_active" in proc.stdout
    with open(out / "ncu_vs_model.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    joined = {(r["block_size"], r["launch"]) for r in rows if r["predicted"] != ""}
    want = {("16", "fwd block_product"), ("32", "dx block_product"), ("16", "dvalues sddmm_reduce")}
    assert joined == want
    assert "b=16 fwd block_product" in (out / "ncu_vs_model.log").read_text()
