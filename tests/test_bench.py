"""Smoke runs of the benchmark scripts on their tiniest configuration: table and CSV complete."""

import csv
import math
import pathlib

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--shapes", "16:32", "--sparsities", "0.5", "--batch", "4", "--repeats", "1"]


def read_rows(path):
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        return reader.fieldnames, list(reader)


def assert_timings(rows):
    for r in rows:
        ms, ratio = float(r["ms"]), float(r["speedup_vs_dense"])
        assert math.isfinite(ms) and ms > 0, r
        assert math.isfinite(ratio) and ratio > 0, r
        if r["impl"] == "dense":
            assert ratio == 1.0, r


def test_diag_matmul_benchmark_writes_its_table_and_csv(run_python, tmp_path):
    out = tmp_path / "bench.csv"
    proc = run_python(
        [
            str(ROOT / "bench" / "diag_matmul.py"),
            *TINY,
            "--impls",
            "ffi,jax,bcoo",
            "--blocks",
            "1,8,16,32",
            "--out",
            str(out),
        ]
    )
    assert "dense ms" in proc.stdout and "16->32" in proc.stdout, proc.stdout
    assert "CPU kernels " in proc.stdout.splitlines()[0], proc.stdout
    assert "block sizes [32] skipped at 16->32" in proc.stdout, proc.stdout
    fields, rows = read_rows(out)
    assert {"in", "out", "sparsity", "block", "k", "density", "impl", "phase", "ms"} <= set(fields)
    got = {(r["in"], r["out"], r["sparsity"], r["block"], r["impl"], r["phase"]) for r in rows}
    phases = ("fwd", "bwd", "fwd+bwd")
    impls = ("dense", "ffi", "jax", "bcoo")
    blocks = ("1", "8", "16")
    assert got == {("16", "32", "0.5", b, i, p) for b in blocks for i in impls for p in phases}
    assert len(rows) == len(got)
    assert {r["k"] for r in rows if r["block"] == "16"} == {"1"}  # K = P_b = 1
    assert_timings(rows)
    # dense is timed once per shape and sparsity: every block size reports the same dense time
    for phase in phases:
        assert len({r["ms"] for r in rows if r["impl"] == "dense" and r["phase"] == phase}) == 1
    assert out.with_suffix(".png").stat().st_size > 0


def test_diag_matmul_benchmark_writes_the_csv_without_matplotlib(run_python, tmp_path):
    out = tmp_path / "bench.csv"
    argv = [str(ROOT / "bench" / "diag_matmul.py"), *TINY, "--impls", "ffi", "--out", str(out)]
    code = (
        "import runpy, sys; sys.modules['matplotlib'] = None; "
        f"sys.argv = {argv!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    proc = run_python(["-c", code])
    assert f"wrote {out} (no plot: matplotlib is not installed)" in proc.stdout, proc.stdout
    _, rows = read_rows(out)
    assert {r["impl"] for r in rows} == {"dense", "ffi"}
    assert not out.with_suffix(".png").exists()


def test_quick_benchmark_keeps_the_options_given_beside_it(run_python, tmp_path):
    """``--quick --sparsities 0.9`` (--quick once replaced the typed sparsities): the quick
    case's block sizes and implementations, the typed sparsity, shape, batch, repeats and dtype."""
    out = tmp_path / "bench.csv"
    tiny = ["--shapes", "16:32", "--sparsities", "0.9", "--batch", "4", "--repeats", "1"]
    run_python(
        [str(ROOT / "bench" / "diag_matmul.py"), "--quick", *tiny, "--dtype", "float16"]
        + ["--out", str(out)]
    )
    _, rows = read_rows(out)
    got = {(r["in"], r["out"], r["sparsity"], r["block"], r["impl"], r["dtype"]) for r in rows}
    assert got == {
        ("16", "32", "0.9", b, i, "float16") for b in ("1", "16") for i in ("dense", "ffi")
    }
    assert_timings(rows)


def test_gpu_benchmark_runs_on_the_cpu_when_allowed(run_python, tmp_path):
    out = tmp_path / "gpu.csv"
    proc = run_python(
        [str(ROOT / "bench" / "diag_matmul_gpu.py"), "--allow-cpu", *TINY, "--out", str(out)]
    )
    assert "x dense" in proc.stdout and f"wrote {out}" in proc.stdout, proc.stdout
    fields, rows = read_rows(out)
    assert {"device", "layout", "impl", "phase", "ms", "speedup_vs_dense"} <= set(fields)
    assert {"tiles_touched", "tile_fill", "tensor_core_share", "predicted_ms"} <= set(fields)
    got = {(r["block_size"], r["layout"], r["impl"], r["phase"]) for r in rows}
    impls, phases = ("ffi", "auto", "dense", "bcoo"), ("fwd", "fwd+bwd")
    # element diagonals in both layouts; b = 16 (random); b = 32 does not divide 16
    cases = [("1", "random"), ("1", "band"), ("16", "random")]
    assert got == {(b, lay, i, p) for b, lay in cases for i in impls for p in phases}
    assert len(rows) == len(got)
    assert {r["device"] for r in rows} == {jax.devices()[0].device_kind}
    assert_timings(rows)
    # one table line per row
    assert sum(line.lstrip().startswith("16:32") for line in proc.stdout.splitlines()) == len(rows)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="only the CPU backend is refused")
def test_gpu_benchmark_refuses_the_cpu_by_default(run_python, tmp_path):
    out = tmp_path / "gpu.csv"
    proc = run_python(
        [str(ROOT / "bench" / "diag_matmul_gpu.py"), *TINY, "--out", str(out)], check=False
    )
    assert proc.returncode == 2 and "--allow-cpu" in proc.stderr, proc.stderr
    assert not out.exists()


def test_compile_benchmark_times_both_methods_in_fresh_processes(run_python, tmp_path):
    out = tmp_path / "compile.csv"
    proc = run_python(
        [
            str(ROOT / "bench" / "compile.py"),
            "--variants",
            "mu/16",
            "--batch",
            "2",
            "--explore",
            "none",
            "--gate",
            "softmax",
            "--out",
            str(out),
        ]
    )
    assert "search step: compile" in proc.stdout, proc.stdout
    assert "explore=none (4 buckets), gate=softmax" in proc.stdout, proc.stdout
    _, rows = read_rows(out)
    measures = [r["measure"] for r in rows]
    assert measures == [
        "init_eager",
        "init_jit",
        "search_lower",
        "search_compile",
        "search_total",
        "frozen_lower",
        "frozen_compile",
        "frozen_total",
    ]
    for r in rows:
        assert r["variant"] == "mu/16" and (r["explore"], r["gate"]) == ("none", "softmax")
        for key in ("dense_s", "dynadiag_s", "dense_cpu_s", "dynadiag_cpu_s"):
            assert float(r[key]) > 0, r
        assert float(r["ratio"]) == pytest.approx(
            float(r["dynadiag_s"]) / float(r["dense_s"]), rel=1e-2
        )
