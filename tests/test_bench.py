"""Smoke runs of the benchmark scripts on their tiniest configuration: table and CSV complete."""

import csv
import json
import math
import pathlib
import re
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import load_script
from training_helpers import fast_compile  # noqa: F401 - fixture

import dynadiag_jax as dd
from dynadiag_jax.layout import diag_indices
from dynadiag_jax.training.state import TrainState

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = ["--shapes", "16:32", "--sparsities", "0.5", "--batch", "4", "--repeats", "1"]


def read_rows(path):
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        return reader.fieldnames, list(reader)


def assert_refuses(script, option, capsys):
    """The script's ``main`` (in this process) exits with status 2 and an ``error:`` line."""
    with pytest.raises(SystemExit) as exited:
        load_script(script).main(option)
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and "error:" in stderr, stderr


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
    assert "dense us" in proc.stdout and "16->32" in proc.stdout, proc.stdout
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
    # bench/ first on the path, as `python bench/diag_matmul.py` puts it (for bench_cli.py)
    code = (
        "import runpy, sys; sys.modules['matplotlib'] = None; "
        f"sys.path.insert(0, {str(ROOT / 'bench')!r}); "
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


SMALL = ["--shapes", "64:128", "--sparsities", "0.5", "--blocks", "1", "--impls", "ffi,dense"]
PHASES = ("fwd", "bwd", "fwd+bwd")


def test_diag_matmul_benchmark_times_a_list_of_batch_sizes(run_python, tmp_path):
    """``--batch 1,3``: one table block and one set of CSV rows per batch size, the table in
    microseconds with three significant digits (0.1 ms steps said nothing at batch 1)."""
    out = tmp_path / "bench.csv"
    script = str(ROOT / "bench" / "diag_matmul.py")
    proc = run_python([script, *SMALL, "--batch", "1,3", "--repeats", "2", "--out", str(out)])
    _, rows = read_rows(out)
    got = {(r["batch"], r["impl"], r["phase"]) for r in rows}
    assert got == {(b, i, p) for b in ("1", "3") for i in ("dense", "ffi") for p in PHASES}
    assert len(rows) == len(got)
    assert_timings(rows)
    lines = proc.stdout.splitlines()
    blocks = [n for n, line in enumerate(lines) if line.startswith("batch ")]
    assert [lines[n] for n in blocks] == ["batch 1", "batch 3"], proc.stdout
    assert "dense us" in lines[blocks[0] + 1] and "ffi us" in lines[blocks[0] + 1], proc.stdout
    for batch, start in zip(("1", "3"), blocks):
        table = [line.split() for line in lines[start + 3 : start + 6]]
        assert [t[0] for t in table] == ["64->128"] * 3, proc.stdout
        for t in table:
            dense = next(
                r for r in rows if (r["batch"], r["impl"], r["phase"]) == (batch, "dense", t[5])
            )
            us = float(dense["ms"]) * 1e3
            assert t[6] == (f"{us:.0f}" if us >= 100 else f"{us:.3g}"), (t, dense)


def test_diag_matmul_benchmark_times_the_phases_asked_for(run_python, tmp_path):
    """``--phases fwd`` times forwards alone (an inference loop): no backward row, and none in
    the timing loop; ``--evict_mb`` (a buffer written before every call) changes no row's
    identity; both reach the fresh processes of ``--processes``."""
    out = tmp_path / "bench.csv"
    script = str(ROOT / "bench" / "diag_matmul.py")
    argv = [script, *SMALL, "--batch", "1", "--repeats", "2", "--phases", "fwd"]
    run_python([*argv, "--evict_mb", "1", "--processes", "1", "--out", str(out)])
    _, rows = read_rows(out.with_name(out.stem + "_runs.csv"))
    assert sorted((r["impl"], r["phase"]) for r in rows) == [("dense", "fwd"), ("ffi", "fwd")]
    assert_timings(rows)
    module = load_script(script)
    assert module.parse_args([*SMALL, "--phases", "fwd+bwd,fwd"]).phases == ("fwd", "fwd+bwd")
    seen = []
    fns = {("dense", 1, "fwd"): (lambda: seen.append(float(evict[0])), ())}
    evict = module.np.zeros(8, module.np.float32)
    module.time_interleaved(fns, 3, module.tqdm(disable=True), evict)
    assert seen == [0.0, 1.0, 2.0, 3.0]  # the warm-up call, then each timed one after a write


def test_call_overhead_benchmark_times_every_variant_per_shape_and_batch(run_python, tmp_path):
    """One row per (shape, block, batch, variant); dense is the 1.0x reference of its group; a
    block size that does not divide a shape is skipped with a message."""
    out = tmp_path / "calls.csv"
    script = str(ROOT / "bench" / "call_overhead.py")
    args = ["--shapes", "64:128,48:96", "--blocks", "1,32", "--batch", "1,3", "--repeats", "2"]
    proc = run_python([script, *args, "--out", str(out)])
    assert "skipped 48->96 b=32" in proc.stdout, proc.stdout
    _, rows = read_rows(out)
    variants = ["dense", "dense+bias", "ffi", "ffi in range", "ffi in range+bias", "jax"]
    groups = [("64->128", "1"), ("64->128", "32"), ("48->96", "1")]
    got = [(r["shape"], r["block"], r["batch"], r["variant"]) for r in rows]
    assert got == [(s, b, n, v) for s, b in groups for n in ("1", "3") for v in variants]
    for r in rows:
        us, ratio = float(r["us"]), float(r["speedup_vs_dense"])
        assert math.isfinite(us) and us > 0 and math.isfinite(ratio) and ratio > 0, r
        if r["variant"] == "dense":
            assert ratio == 1.0, r


def test_call_overhead_benchmark_interleaves_its_rounds(monkeypatch):
    """The functions take turns in rounds, the order rotating, each call after an untimed one
    (it timed each function's calls all together, one function after another)."""
    module = load_script(str(ROOT / "bench" / "call_overhead.py"))
    calls = []

    def time_call(fn, args):
        calls.append(fn)
        return {"a": 1.0, "b": 2.0, "c": 3.0}[fn] + len(calls) * 1e-9

    monkeypatch.setattr(module, "time_call", time_call)
    us = module._median_us({"a": "a", "b": "b", "c": "c"}, (), repeats=7, rounds=3)
    # shares 3, 2, 2; a warm-up call before each share
    expected = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    expected += ["b"] * 3 + ["c"] * 3 + ["a"] * 3 + ["c"] * 3 + ["a"] * 3 + ["b"] * 3
    assert calls == expected
    assert us == pytest.approx({"a": 1e6, "b": 2e6, "c": 3e6})


@pytest.mark.parametrize("option", [["--shapes", "64"], ["--batch", "0"], ["--sparsity", "1"]])
def test_call_overhead_benchmark_refuses_bad_options(capsys, option):
    assert_refuses(ROOT / "bench" / "call_overhead.py", option, capsys)


def test_input_pipeline_benchmark_rates_every_thread_count(tmp_path, capsys):
    """A row per thread count, in the order given, from synthetic JPEGs decoded on every read
    (the pipeline's batches as train/imagenet.py's: RGB uint8 at the image size)."""
    script = load_script(ROOT / "bench" / "input_pipeline.py")
    source = script.SyntheticJpegs(10, images=2, size=(64, 48))
    example = source[3]
    assert example["image"].shape == (48, 64, 3) and example["image"].dtype == np.uint8
    assert example["label"] == 3 and len(source) == 10
    out = tmp_path / "pipe.csv"
    args = ["--threads", "2,1", "--batch", "4", "--batches", "1", "--rounds", "2"]
    script.main(
        [*args, "--images", "2", "--size", "64x48", "--image_size", "32", "--out", str(out)]
    )
    fields, rows = read_rows(out)
    assert fields == ["threads", "images_per_s", "per_thread", "ms_per_image_thread"]
    assert [r["threads"] for r in rows] == ["2", "1"]
    for r in rows:
        rate = float(r["images_per_s"])
        assert math.isfinite(rate) and rate > 0
        assert float(r["per_thread"]) == pytest.approx(rate / int(r["threads"]), rel=1e-3)
    assert "2 synthetic 64x48 JPEGs" in capsys.readouterr().out


@pytest.mark.parametrize(
    "option",
    [
        ["--threads", "0"],
        ["--size", "64"],
        ["--size", "0x48"],
        ["--warmup", "-1"],
        ["--batch", "0"],
    ],
)
def test_input_pipeline_benchmark_refuses_bad_options(capsys, option):
    assert_refuses(ROOT / "bench" / "input_pipeline.py", option, capsys)


@pytest.mark.usefixtures("fast_compile")
def test_search_step_benchmark_times_every_variant_against_the_frozen_layer(tmp_path):
    """One row per (shape, sparsity, batch, variant); the frozen layer is the 1.0x reference."""
    out = tmp_path / "search.csv"
    args = ["--shapes", "64:96", "--sparsity", "0.9,0.8", "--batch", "4", "--repeats", "2"]
    load_script(ROOT / "bench" / "search_step.py").main([*args, "--out", str(out)])
    _, rows = read_rows(out)
    got = [(r["shape"], r["sparsity"], r["batch"], r["variant"]) for r in rows]
    variants = ["dense", "frozen", "narrow", "flat"]
    assert got == [("64->96", s, "4", v) for s in ("0.9", "0.8") for v in variants]
    for r in rows:
        us, ratio = float(r["us"]), float(r["vs_frozen"])
        assert math.isfinite(us) and us > 0 and math.isfinite(ratio) and ratio > 0, r
        if r["variant"] == "frozen":
            assert ratio == 1.0, r


@pytest.mark.usefixtures("fast_compile")
@pytest.mark.parametrize("permutation", ["random", "learned"])
def test_search_step_benchmark_with_a_permutation_adds_the_plain_frozen_layer(
    tmp_path, permutation
):
    out = tmp_path / "search.csv"
    args = ["--shapes", "64:96", "--sparsity", "0.9", "--batch", "4", "--repeats", "2"]
    load_script(ROOT / "bench" / "search_step.py").main(
        [*args, "--permutation", permutation, "--out", str(out)]
    )
    _, rows = read_rows(out)
    assert [r["variant"] for r in rows] == ["plain", "dense", "frozen", "narrow", "flat"]
    assert all(math.isfinite(float(r["us"])) and float(r["us"]) > 0 for r in rows)


@pytest.mark.usefixtures("fast_compile")
def test_search_step_benchmark_times_block_layers_over_rounds(tmp_path, monkeypatch):
    """``--block-size`` builds block layers (the frozen one holds values[K, L_b, b, b]) and
    ``--rounds`` times every variant once per round."""
    script = load_script(ROOT / "bench" / "search_step.py")
    seen, rounds = [], []
    build, timed = script.functions, script.time_interleaved

    def functions(*args):
        fns = build(*args)
        seen.append(fns["frozen"][1][0]["values"].shape)
        return fns

    monkeypatch.setattr(script, "functions", functions)
    monkeypatch.setattr(script, "time_interleaved", lambda *a: rounds.append(1) or timed(*a))
    out = tmp_path / "search.csv"
    args = ["--shapes", "64:96", "--sparsity", "0.9", "--batch", "4", "--repeats", "2"]
    script.main(
        [*args, "--block-size", "16", "--rounds", "3", "--permutation", "random", "--out", str(out)]
    )
    _, rows = read_rows(out)
    assert {r["block_size"] for r in rows} == {"16"}
    assert len(seen) == 1 and len(seen[0]) == 4 and seen[0][-2:] == (16, 16)
    assert len(rounds) == 3
    assert all(math.isfinite(float(r["us"])) and float(r["us"]) > 0 for r in rows)


@pytest.mark.parametrize(
    "option",
    [
        ["--shapes", "64"],
        ["--sparsity", "1"],
        ["--repeats", "0"],
        ["--permutation", "sorted"],
        ["--rounds", "0"],
        ["--block-size", "0"],
        ["--shapes", "64:96", "--block-size", "64"],
    ],
)
def test_search_step_benchmark_refuses_bad_options(capsys, option):
    assert_refuses(ROOT / "bench" / "search_step.py", option, capsys)


def test_gate_rank_benchmark_times_the_kernel_and_the_reference(run_python, tmp_path):
    out = tmp_path / "rank.csv"
    args = ["--p", "16,40", "--sparsity", "0.5", "--repeats", "2", "--out", str(out)]
    proc = run_python([str(ROOT / "bench" / "gate_rank.py"), *args])
    _, rows = read_rows(out)
    assert [(r["p"], r["k"]) for r in rows] == [("16", "8"), ("40", "20")]
    for r in rows:
        assert all(
            math.isfinite(float(r[c])) and float(r[c]) > 0 for c in ("kernel_us", "reference_us")
        )
        ratio = float(r["kernel_us"]) / float(r["reference_us"])
        assert float(r["kernel_over_reference"]) == pytest.approx(ratio, rel=1e-2), r
    assert "kernel/reference" in proc.stdout, proc.stdout
    table = [
        line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["16"], ["40"])
    ]
    assert [t[-1] for t in table] == [f"{float(r['kernel_over_reference']):.2f}" for r in rows]


@pytest.mark.parametrize("option", [["--p", "0"], ["--sparsity", "1"], ["--repeats", "0"]])
def test_gate_rank_benchmark_refuses_bad_options(capsys, option):
    assert_refuses(ROOT / "bench" / "gate_rank.py", option, capsys)


@pytest.mark.usefixtures("fast_compile")
def test_suite_step_benchmark_times_both_phases_and_every_compilation(tmp_path, capsys):
    """The small digits' MLP suite: step times and bytes accessed of both phases with each
    optimizer (none: no update), the frozen step beside static diagonals' step, and the compile
    time of every program a DynaDiag, static or dense run compiles. In this process, its programs
    compiled fast (the bytes are the same)."""
    out = tmp_path / "suite.csv"
    args = ["--data", "mnist5k", "--fraction", "0.1", "--repeats", "2", "--out", str(out)]
    load_script(ROOT / "bench" / "suite_step.py").main(args)
    stdout = capsys.readouterr().out
    _, rows = read_rows(out)
    programs = ["initial state", "search step", "freeze", "frozen step"]
    programs += ["enter working set", "working-set step", "refresh working set"]
    optimizers = ("suite optimizer", "sgd", "none")
    steps = [f"{p} step, {o}" for o in optimizers for p in ("search", "frozen", "working-set")]
    steps.insert(3, "refresh working set")  # after the suite optimizer's steps
    assert [r["what"] for r in rows] == [
        *(f"compile: {p}" for p in programs),
        "compile: static_diagonals step",
        "compile: dense step",
        *steps,
        "frozen step (beside static)",
        "static_diagonals step",
        *(
            f"{p} step and records, metrics {how}"
            for p in ("search", "frozen")
            for how in ("packed", "dict")
        ),
        *(f"bytes: {s}" for s in steps),
        "load average while timing",
    ]
    *measured, load = (float(r["value"]) for r in rows)
    assert all(math.isfinite(v) and v > 0 for v in measured) and load >= 0
    moved = {r["what"]: float(r["value"]) for r in rows if r["what"].startswith("bytes: ")}
    # the search phase's optimizer updates all P candidates' values, the frozen one K of them
    for phase in ("search", "frozen"):
        assert moved[f"bytes: {phase} step, suite optimizer"] > moved[f"bytes: {phase} step, none"]
    assert moved["bytes: search step, none"] > moved["bytes: frozen step, none"]
    # the working-set step moves W rows, not P (the suite's AdamW: the values and both moments)
    ws, full = (moved[f"bytes: {p} step, suite optimizer"] for p in ("working-set", "search"))
    assert ws < full
    assert "search / frozen step, sgd:" in stdout
    assert "search / frozen step with its records, metrics packed:" in stdout
    assert "working-set / frozen step, suite optimizer:" in stdout
    assert "frozen / static diagonals' step, suite optimizer:" in stdout


@pytest.mark.parametrize(
    "option",
    [["--sparsity", "1"], ["--fraction", "1"], ["--repeats", "0"], ["--working-set", "0.5"]],
)
def test_suite_step_benchmark_refuses_bad_options(capsys, option):
    assert_refuses(ROOT / "bench" / "suite_step.py", option, capsys)


@pytest.mark.parametrize("shape", [(12, 12, 3), (9, 20, 4), (20, 9, 4)])
def test_matched_layout_finds_most_of_a_hidden_diagonal_layout(shape):
    """``W`` is exactly ``K`` diagonals of ``W[:, p]`` for a random ``p``: the alternation
    (offsets, then the permutation, each the best given the other) never ends below the identity
    permutation's top-``K`` diagonals it starts from, and holds most of ``|W|^2`` where a random
    layout would hold about ``K / P`` of it."""
    probe = load_script(ROOT / "bench" / "permutation_probe.py")
    out_features, in_features, k = shape
    rng = np.random.default_rng(sum(shape))
    shares = []
    for _ in range(4):
        offsets = np.sort(rng.choice(max(shape[:2]), k, replace=False))
        rows, cols = (np.asarray(a) for a in diag_indices(offsets, in_features, out_features))
        hidden = np.zeros(shape[:2])
        hidden[rows, cols] = rng.normal(size=rows.shape) + 3.0
        w = np.zeros(shape[:2])
        w[:, rng.permutation(in_features)] = hidden

        def share(perm, kept, w=w):
            r, c = (np.asarray(a) for a in diag_indices(kept, in_features, out_features))
            return np.square(w[:, perm][r, c]).sum() / np.square(w).sum()

        perm, kept = probe.matched_layout(w, k)
        assert sorted(perm) == list(range(in_features)) and len(set(kept)) == k
        identity = np.arange(in_features)
        masses = [share(identity, [d]) for d in range(max(shape[:2]))]
        start = share(identity, np.sort(np.argsort(masses)[::-1][:k]))
        assert share(perm, kept) >= start - 1e-12
        shares.append(share(perm, kept))
    assert np.mean(shares) > 0.7, shares


@pytest.mark.usefixtures("fast_compile")
@pytest.mark.parametrize("probe", ["moves", "assigned"])
def test_permutation_probe_reports_each_run_per_seed(tmp_path, capsys, probe):
    """The small digits' MLP suite, one seed: a CSV row per run (and per learned layer, with
    the share of its rows moved, in [0, 1]) and a table line per run."""
    out = tmp_path / "probe.csv"
    args = ["--data", "mnist5k", "--probe", probe, "--seeds", "0", "--out", str(out)]
    args += ["--lr-scales", "1,100"] if probe == "moves" else ["--dense-steps", "3"]
    load_script(ROOT / "bench" / "permutation_probe.py").main(args)
    stdout = capsys.readouterr().out
    _, rows = read_rows(out)
    runs = list(dict.fromkeys(r["run"] for r in rows))
    if probe == "moves":
        assert runs == ["learned, perm lr x1", "learned, perm lr x100"]
        assert {r["layer"] for r in rows} == {"hidden_0", "hidden_1"}
        moved = [float(r["rows_moved"]) for r in rows]
        assert all(0.0 <= m <= 1.0 for m in moved)
        # a hundred times the steps move more rows than the suite's own
        by = {(r["run"], r["layer"]): float(r["rows_moved"]) for r in rows}
        assert by[("learned, perm lr x100", "hidden_0")] > by[("learned, perm lr x1", "hidden_0")]
        assert "rows moved per layer" in stdout
    else:
        assert runs == [
            "static diagonals, random permutation",
            "static diagonals, layout matched to dense after 3 steps",
        ]
    assert all(0.0 < float(r["metric"]) <= 1.0 for r in rows)
    assert all(run in stdout for run in runs)


@pytest.mark.parametrize(
    "option", [["--seeds", "x"], ["--lr-scales", "-1"], ["--dense-steps", "-1"], ["--seeds", "-1"]]
)
def test_permutation_probe_refuses_bad_options(capsys, option):
    assert_refuses(ROOT / "bench" / "permutation_probe.py", option, capsys)


def test_page_fault_benchmark_counts_faults_per_call_in_fresh_processes(run_python, tmp_path):
    """Every call of both implementations in every process is a CSV row with its time and a
    non-negative fault count; the table has a line per process and implementation."""
    out = tmp_path / "faults.csv"
    script = str(ROOT / "bench" / "page_faults.py")
    args = ["--shape", "64:128", "--block", "16", "--batch", "8", "--calls", "3"]
    proc = run_python([script, *args, "--processes", "2", "--out", str(out)])
    _, rows = read_rows(out)
    got = [(r["process"], r["impl"], r["call"]) for r in rows]
    assert got == [(p, i, c) for p in "01" for i in ("ffi", "dense") for c in "012"]
    assert all(float(r["ms"]) > 0 and int(r["faults"]) >= 0 for r in rows), rows
    table = [
        line.split() for line in proc.stdout.splitlines() if line.split()[:1] in (["0"], ["1"])
    ]
    assert [t[:2] for t in table] == [[p, i] for p in "01" for i in ("ffi", "dense")], proc.stdout
    # the median in microseconds and the speed-up over dense in the same process
    assert "median us" in proc.stdout and "x dense" in proc.stdout, proc.stdout
    for p in "01":
        ms = {
            i: statistics.median(
                float(r["ms"]) for r in rows if (r["process"], r["impl"]) == (p, i)
            )
            for i in ("ffi", "dense")
        }
        speedups = [t[3] for t in table if t[0] == p]
        assert speedups == [f"{ms['dense'] / ms['ffi']:.2f}x", "1.00x"], (speedups, ms)


@pytest.mark.parametrize(
    "option", [["--shape", "768"], ["--block", "7"], ["--processes", "0"], ["--sparsity", "1"]]
)
def test_page_fault_benchmark_refuses_bad_options(capsys, option):
    assert_refuses(ROOT / "bench" / "page_faults.py", option, capsys)


def test_diag_matmul_benchmark_summarises_fresh_processes(run_python, tmp_path):
    """``--processes 2`` runs the benchmark twice in fresh processes and writes min / median /
    max over them of every row (and every process's rows beside)."""
    out = tmp_path / "spread.csv"
    script = str(ROOT / "bench" / "diag_matmul.py")
    argv = [script, *SMALL, "--batch", "1,3", "--repeats", "1", "--processes", "2"]
    proc = run_python([*argv, "--out", str(out)])
    assert "2 fresh processes of: diag_matmul.py --shapes 64:128" in proc.stdout, proc.stdout
    assert "over 2 processes" in proc.stdout and f"wrote {out}" in proc.stdout, proc.stdout
    fields, rows = read_rows(out)
    stats = ("ms_min", "ms_median", "ms_max", "speedup_min", "speedup_median", "speedup_max")
    assert {"batch", "processes", "max_over_min", *stats} <= set(fields)
    got = {(r["batch"], r["impl"], r["phase"]) for r in rows}
    assert got == {(b, i, p) for b in ("1", "3") for i in ("dense", "ffi") for p in PHASES}
    assert len(rows) == len(got)
    _, runs = read_rows(out.with_name("spread_runs.csv"))
    assert sorted({r["process"] for r in runs}) == ["0", "1"] and len(runs) == 2 * len(rows)
    for r in rows:
        assert r["processes"] == "2", r
        ms = sorted(
            float(p["ms"])
            for p in runs
            if (p["batch"], p["impl"], p["phase"]) == (r["batch"], r["impl"], r["phase"])
        )
        assert [float(r["ms_min"]), float(r["ms_max"])] == ms, r
        assert float(r["ms_min"]) <= float(r["ms_median"]) <= float(r["ms_max"]), r
        assert float(r["max_over_min"]) == pytest.approx(ms[1] / ms[0], rel=1e-2), r
        up = [float(r[k]) for k in ("speedup_min", "speedup_median", "speedup_max")]
        assert up == sorted(up) and up[0] > 0, r
        if r["impl"] == "dense":
            assert up == [1.0, 1.0, 1.0], r
    # one summary line per row
    assert sum(line.startswith("64->128") for line in proc.stdout.splitlines()) == len(rows)


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
def test_gpu_benchmark_refuses_the_cpu_by_default(tmp_path, capsys):
    out = tmp_path / "gpu.csv"
    script = load_script(ROOT / "bench" / "diag_matmul_gpu.py")
    assert script.main([*TINY, "--out", str(out)]) == 2
    assert "--allow-cpu runs anyway" in capsys.readouterr().err
    assert not out.exists()


def test_compile_benchmark_times_both_methods_in_fresh_processes(run_python, tmp_path):
    """The smallest ViT's rows, each process's programs compiled fast (what a test checks)."""
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
        ],
        env={"JAX_DISABLE_MOST_OPTIMIZATIONS": "1"},  # the children inherit it
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


def test_lora_cost_benchmark_prints_every_rank_batch_and_fine_tune(run_python):
    """The MLP on the small digits at r = 2: inference at the suite's batches with and without
    the adapter, the three fine-tunes, and the weight counts (r * (in + out) per layer)."""
    script = str(ROOT / "bench" / "lora_cost.py")
    args = ["--suite", "mlp", "--data", "mnist5k", "--ranks", "2", "--repeats", "1"]
    out = run_python([script, *args], timeout=600).stdout.splitlines()
    rows = [
        line.split() for line in out[out.index(next(x for x in out if x.startswith("what"))) + 1 :]
    ]
    got = [(" ".join(r[:-7]), r[-7], r[-6]) for r in rows]
    assert got == [
        ("inference", "0", "1"),
        ("inference", "0", "256"),
        ("inference", "2", "1"),
        ("inference", "2", "256"),
        ("step, values", "0", "128"),
        ("step, B", "2", "128"),
        ("step, B + values", "2", "128"),
    ]
    adapter = 2 * (784 + 256) + 2 * (256 + 256)
    for r in rows:
        assert float(r[-5]) > 0 and r[-4].endswith("x") and r[-3] == "26880", r
        assert r[-2] == ("0" if r[-7] == "0" else str(adapter)), r
    trained = {" ".join(r[:-7]): int(r[-1]) for r in rows}
    assert trained["step, B"] == 2 * 256 * 2 and trained["step, values"] == 26880
    assert trained["step, B + values"] == 2 * 256 * 2 + 26880


def test_density_benchmark_times_both_paths_per_product_and_density(run_python, tmp_path):
    """Every (density, product) cell of each shape is a CSV row with both paths' times; the
    table has a line per product with its ratios and the lowest density where dense wins."""
    out = tmp_path / "density.csv"
    script = str(ROOT / "bench" / "density.py")
    args = ["--shapes", "32:64", "--blocks", "1,16", "--batch", "8"]
    proc = run_python([script, *args, "--densities", "0.5,1", "--repeats", "2", "--out", str(out)])
    _, rows = read_rows(out)
    got = [(r["b"], r["density"], r["product"]) for r in rows]
    want = [
        (b, d, p)
        for b, ds in (("1", ("0.5", "1.0")), ("16", ("0.5", "1.0")))
        for d in ds
        for p in ("y", "dx", "dvalues")
    ]
    assert got == want
    assert all(float(r["ffi_us"]) > 0 and float(r["dense_us"]) > 0 for r in rows)
    lines = [line for line in proc.stdout.splitlines() if line.strip().startswith("32->64")]
    firsts = [line.split()[-1] for line in lines]
    assert len(lines) == 6 and set(firsts) <= {"0.500", "1.000", "never"}


@pytest.mark.usefixtures("fast_compile")
def test_sparse_lr_probe_reports_each_method_and_factor(tmp_path, capsys):
    """The small digits' MLP suite, one seed: a CSV row per method, factor and seed, and the
    factor changes the run (the sparse weights' updates are scaled)."""
    out = tmp_path / "probe.csv"
    args = ["--data", "mnist5k", "--methods", "dense,dynadiag", "--factors", "1,3"]
    load_script(ROOT / "bench" / "sparse_lr_probe.py").main(
        [*args, "--seeds", "0", "--out", str(out)]
    )
    stdout = capsys.readouterr().out
    _, rows = read_rows(out)
    got = {(r["method"], float(r["factor"])): float(r["metric"]) for r in rows}
    assert set(got) == {(m, f) for m in ("dense", "dynadiag") for f in (1.0, 3.0)}
    assert all(0.0 < v <= 1.0 for v in got.values())
    assert got[("dense", 1.0)] != got[("dense", 3.0)]
    assert got[("dynadiag", 1.0)] != got[("dynadiag", 3.0)]
    assert "dynadiag" in stdout and "x3" in stdout


@pytest.mark.parametrize(
    "option", [["--methods", "rigl"], ["--factors", "0"], ["--seeds", "x"], ["--seeds", "-1"]]
)
def test_sparse_lr_probe_refuses_bad_options(capsys, option):
    assert_refuses(ROOT / "bench" / "sparse_lr_probe.py", option, capsys)


def test_diagonal_regrow_swaps_the_smallest_diagonals_for_new_ones_at_zero():
    """One update on a frozen layer: the smallest-norm quarter leaves, distinct offsets not in the
    layer enter with zero values and zero Adam moments, the rest is untouched."""
    regrow = load_script(ROOT / "bench" / "diagonal_regrow.py").regrow
    layer = dd.nn.DiagonalDense(24, sparsity=0.5, init_phase="frozen", name="fc")
    variables = layer.init(jax.random.key(0), np.ones((2, 24), np.float32))
    params = {"fc": variables["params"]}
    k = variables["diagonals"]["offsets"].shape[0]
    norms = np.arange(1, k + 1, dtype=np.float32)[::-1]  # the last rows are the smallest
    params["fc"]["values"] = jnp.asarray(norms[:, None] * np.ones((k, 24), np.float32))
    tx = optax.adam(1e-3)
    opt_state = jax.tree.map(lambda x: x + 1.0 if x.dtype == jnp.float32 else x, tx.init(params))
    state = TrainState(
        step=jnp.asarray(0, jnp.int32),
        params=params,
        opt_state=opt_state,
        collections={"diagonals": {"fc": variables["diagonals"]}},
        rng=jax.random.key_data(jax.random.key(1)),
    )
    new = regrow(state, {"fc": 24}, 0.25, 100)  # at step 0 f = 0.25: round(0.25 K) swapped
    before = np.asarray(variables["diagonals"]["offsets"])
    after = np.asarray(new.collections["diagonals"]["fc"]["offsets"])
    n = round(0.25 * k)
    assert len(set(after.tolist())) == k and (after[: k - n] == before[: k - n]).all()
    assert not set(after[k - n :].tolist()) & set(before.tolist())
    values = np.asarray(new.params["fc"]["values"])
    assert (values[k - n :] == 0).all() and (values[: k - n] == norms[: k - n, None]).all()
    mu = np.asarray(new.opt_state[0].mu["fc"]["values"])
    assert (mu[k - n :] == 0).all() and (mu[: k - n] == 1).all()


@pytest.mark.usefixtures("fast_compile")
def test_diagonal_regrow_probe_reports_each_method_with_and_without(tmp_path, capsys):
    """The small digits' MLP suite, one seed: a CSV row per method with and without the updates,
    and the updates change the run."""
    out = tmp_path / "regrow.csv"
    args = ["--data", "mnist5k", "--methods", "static_diagonals", "--every", "10"]
    load_script(ROOT / "bench" / "diagonal_regrow.py").main(
        [*args, "--seeds", "0", "--out", str(out)]
    )
    stdout = capsys.readouterr().out
    _, rows = read_rows(out)
    got = {r["regrow"]: float(r["metric"]) for r in rows}
    assert set(got) == {"False", "True"} and all(0.0 < v <= 1.0 for v in got.values())
    assert got["False"] != got["True"]
    assert "whole diagonals swapped" in stdout


@pytest.mark.parametrize(
    "option",
    [
        ["--methods", "rigl"],
        ["--seeds", "x"],
        ["--every", "0"],
        ["--end", "0"],
        ["--fraction", "2"],
    ],
)
def test_diagonal_regrow_probe_refuses_bad_options(capsys, option):
    assert_refuses(ROOT / "bench" / "diagonal_regrow.py", option, capsys)


def _write_records(workdir, records):
    workdir.mkdir()
    (workdir / "accuracy.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def test_paired_seeds_tables_each_method_against_its_control(tmp_path, capsys):
    """Seeds both methods have, accuracy in points, perplexity lower-is-better; a pair with one
    common seed or a missing method is left out; the CSV and the PNG are written."""
    acc = [
        {"model": "vit", "method": m, "sparsity": 0.9, "seed": s, "accuracy": a}
        for m, accs in (("dynadiag", (0.84, 0.83, 0.85)), ("static_diagonals", (0.83, 0.84)))
        for s, a in enumerate(accs)
    ]
    ppl = [
        {"model": "gpt", "method": m, "sparsity": 0.95, "seed": s, "perplexity": p}
        for m, ppls in (("dynadiag", (8.5, 8.8)), ("static_diagonals", (8.6, 8.6)), ("set", (8.0,)))
        for s, p in enumerate(ppls)
    ]
    _write_records(tmp_path / "runs_a", acc)
    _write_records(tmp_path / "runs_b", ppl + [{**ppl[-1], "method": "static_unstructured"}])
    out = tmp_path / "paired.csv"
    load_script(ROOT / "bench" / "paired_seeds.py").main(
        ["--workdir", str(tmp_path / "runs_a"), "--workdir", str(tmp_path / "runs_b")]
        + ["--out", str(out)]
    )
    stdout = capsys.readouterr().out
    _, rows = read_rows(out)
    assert [(r["model"], r["method"], r["control"], r["seeds"]) for r in rows] == [
        ("vit", "dynadiag", "static_diagonals", "2"),  # seed 2 has no static run
        ("gpt", "dynadiag", "static_diagonals", "2"),  # set: one seed of each, left out
    ]
    assert float(rows[0]["paired_mean"]) == pytest.approx(0.0)
    assert rows[0]["better"] == "1" and rows[1]["better"] == "1"  # 8.5 < 8.6, 8.8 > 8.6
    assert "| runs_a | vit | 90% | dynadiag | static_diagonals | 83.50 +- 0.71 |" in stdout
    assert "| 8.65 +- 0.21 | 8.60 +- 0.00 | +0.05 +- 0.21 | 1 of 2 |" in stdout  # -0.1, +0.2
    assert out.with_suffix(".png").stat().st_size > 0


def test_paired_seeds_against_a_control_workdir(tmp_path, capsys):
    """--against pairs each method with itself in the control workdir, seed by seed; a method
    the control lacks is left out, and a control sharing no method is refused."""
    changed = [
        {"model": "mlp", "method": m, "sparsity": 0.9, "seed": s, "accuracy": a}
        for m, accs in (("dynadiag", (0.86, 0.88, 0.87)), ("rigl", (0.85, 0.86)))
        for s, a in enumerate(accs)
    ]
    control = [
        {"model": "mlp", "method": "dynadiag", "sparsity": 0.9, "seed": s, "accuracy": a}
        for s, a in enumerate((0.85, 0.88, 0.86, 0.90))
    ]
    _write_records(tmp_path / "changed", changed)
    _write_records(tmp_path / "before", control)
    out = tmp_path / "against.csv"
    script = load_script(ROOT / "bench" / "paired_seeds.py")
    script.main(
        ["--workdir", str(tmp_path / "changed"), "--against", str(tmp_path / "before")]
        + ["--out", str(out)]
    )
    stdout = capsys.readouterr().out
    _, rows = read_rows(out)
    assert [(r["method"], r["control"], r["seeds"], r["better"]) for r in rows] == [
        ("dynadiag", "dynadiag@before", "3", "2")  # seed 3 only in the control; rigl in neither
    ]
    assert float(rows[0]["paired_mean"]) == pytest.approx(0.02 / 3)
    assert (
        "| dynadiag | dynadiag@before | 87.00 +- 1.00 | 86.33 +- 1.53 | +0.67 +- 0.58 |" in stdout
    )
    _write_records(tmp_path / "other", [dict(r, method="set") for r in control])
    assert_refuses(
        ROOT / "bench" / "paired_seeds.py",
        ["--workdir", str(tmp_path / "changed"), "--against", str(tmp_path / "other")],
        capsys,
    )


@pytest.mark.parametrize(
    "option",
    [
        ["--pairs", "dynadiag"],
        ["--pairs", "a:b:c"],
        ["--pairs", ","],
        ["--pairs", "rigl:nothing"],  # no pair with two common seeds
        ["--pairs", "dynadiag:static_diagonals", "--against", "."],  # one or the other
    ],
)
def test_paired_seeds_refuses_bad_options(tmp_path, capsys, option):
    records = [
        {"model": "mlp", "method": m, "sparsity": 0.9, "seed": s, "accuracy": 0.8}
        for m in ("dynadiag", "static_diagonals")
        for s in (0, 1)
    ]
    _write_records(tmp_path / "w", records)
    assert_refuses(
        ROOT / "bench" / "paired_seeds.py", ["--workdir", str(tmp_path / "w"), *option], capsys
    )


def _bench_cli():
    """bench/bench_cli.py, the module the scripts loaded here import."""
    load_script(ROOT / "bench" / "diag_matmul.py")
    return sys.modules["bench_cli"]


# (script, its options, what its one error line says): refused before anything is compiled,
# trained or written; {tmp} is a directory that exists.
REFUSED = [
    ("diag_matmul", ["--sparsities", "1.5"], "sparsities must lie in (0, 1)"),
    ("diag_matmul", ["--sparsities", "0"], "sparsities must lie in (0, 1)"),
    ("diag_matmul", ["--sparsities=-0.1"], "sparsities must lie in (0, 1)"),
    ("diag_matmul", ["--sparsities", ""], "sparsities must lie in (0, 1)"),
    ("diag_matmul", ["--shapes", "64:128", "--blocks", "7"], "no block size of --blocks 7"),
    ("diag_matmul", [*SMALL, "--batch", "1,0"], "batch sizes must be integers >= 1"),
    ("diag_matmul", [*SMALL, "--processes", "0"], "number of processes must be an integer >= 1"),
    ("diag_matmul", [*SMALL, "--phases", "fwd,back"], "phases must be a subset of"),
    ("diag_matmul", [*SMALL, "--evict_mb", "-1"], "--evict_mb must be >= 0"),
    ("call_overhead", ["--sparsity", "0"], "the sparsity must lie in (0, 1)"),
    ("page_faults", ["--sparsity", "0"], "the sparsity must lie in (0, 1)"),
    ("density", ["--densities", "0,0.5"], "densities must lie in (0, 1]"),
    ("density", ["--densities", "0.25,x"], "densities must lie in (0, 1]"),
    ("density", ["--densities", ""], "densities must lie in (0, 1]"),
    ("density", ["--repeats", "0"], "repeats must be an integer >= 1"),
    ("density", ["--repeats", "-2"], "repeats must be an integer >= 1"),
    ("density", ["--shapes", "64:64", "--blocks", "7"], "no block size of --blocks 7"),
    ("exploration", ["--steps", "0"], "steps must be an integer >= 1"),
    ("exploration", ["--seeds", "0"], "seeds must be an integer >= 1"),
    ("exploration", ["--repeats", "0"], "repeats must be an integer >= 1"),
    ("compile", ["--repeats", "0"], "repeats must be an integer >= 1"),
    ("compile", ["--variants", "Ti/16,X/3"], "unknown ViT size 'X'"),
    ("gpu_decision_table", ["--devices", "Z100"], "devices must be among H100, A100"),
    ("gpu_decision_table", ["--devices", ""], "devices must be among H100, A100"),
    ("ncu_compare", ["x.csv", "--device", "Z"], "invalid choice: 'Z'"),
    ("sparse_lr_probe", ["--data", "nosuch"], "unknown data source 'nosuch'"),
    ("diagonal_regrow", ["--data", "nosuch"], "unknown data source 'nosuch'"),
    ("permutation_probe", ["--data", "nosuch"], "unknown data source 'nosuch'"),
    ("suite_step", ["--data", "nosuch"], "unknown data source 'nosuch'"),
    ("lora_cost", ["--suite", "mlp", "--data", "nosuch"], "unknown data source 'nosuch'"),
    (
        "lora_cost",
        ["--suite", "mlp", "--data", "mnist5k", "--ranks", "100000", "--repeats", "1"],
        "--ranks: lora.layers / lora.rank: lora_fa: rank=100000 exceeds min(in, out)",
    ),
    ("sparse_lr_probe", ["--data", "mnist5k", "--out", "{tmp}"], "is a directory"),
    ("diagonal_regrow", ["--data", "mnist5k", "--out", "{tmp}"], "is a directory"),
    ("permutation_probe", ["--data", "mnist5k", "--out", "{tmp}/"], "is a directory"),
    # every --out is checked as it parses, not when the table is written after the work
    *[
        (script, [*args, "--out", "{tmp}"], "is a directory; give a CSV file path")
        for script, args in (
            ("diag_matmul", []),
            ("gate_rank", ["--p", "8"]),
            ("page_faults", []),
            ("density", []),
            ("call_overhead", []),
            ("search_step", []),
            ("compile", []),
            ("suite_step", []),
            ("coverage", ["{tmp}"]),
            ("paired_seeds", ["--workdir", "{tmp}"]),
            ("diag_matmul_gpu", []),
            ("ncu_compare", ["x.csv"]),
        )
    ],
    ("gpu_decision_table", ["--csv", "{tmp}/"], "is a directory; give a CSV file path"),
    ("call_overhead", ["--shapes", "32:64", "--blocks", "5"], "no block size of --blocks 5"),
    ("compile", ["--variants", "mu/16", "--image", "8"], "--image 8 is not a multiple of mu/16's"),
    ("diag_matmul_gpu", ["--batch", "0"], "--batch must be an integer >= 1"),
    ("ncu_compare", ["x.csv", "--shape", "768x3072"], "shapes must look like 768:3072"),
    ("ncu_compare", ["x.csv", "--shape", "1:2,3:4"], "give one IN:OUT shape"),
    ("ncu_compare", ["x.csv", "--sparsity", "1.5"], "the sparsity must lie in (0, 1)"),
    ("ncu_compare", ["x.csv", "--rows", "0"], "rows must be an integer >= 1"),
]
# Where a script writes, when not --out; lora_cost writes nothing.
OUT_OPTION = {"gpu_decision_table": "--csv", "lora_cost": None}


@pytest.mark.parametrize(
    ("script", "option", "message"), REFUSED, ids=[f"{s} {' '.join(o)}" for s, o, _ in REFUSED]
)
def test_bench_scripts_refuse_bad_options_in_one_line(tmp_path, capsys, script, option, message):
    """Exit status 2 and one ``error:`` line (no traceback), and no output file left behind."""
    out = tmp_path / "out" / "table.csv"
    flag = OUT_OPTION.get(script, "--out")
    argv = [*((flag, str(out)) if flag else ()), *(o.format(tmp=tmp_path) for o in option)]
    with pytest.raises(SystemExit) as exited:
        load_script(ROOT / "bench" / f"{script}.py").main(argv)
    stderr = capsys.readouterr().err
    assert exited.value.code == 2, stderr
    assert "Traceback" not in stderr and message in stderr.splitlines()[-1], stderr
    assert "error:" in stderr.splitlines()[-1], stderr
    assert not out.parent.exists()


def test_an_out_path_under_a_file_is_refused_as_it_parses(tmp_path):
    cli = _bench_cli()
    (tmp_path / "table.csv").write_text("")
    with pytest.raises(Exception, match="lies under .*table.csv, which is a file"):
        cli.out_file(str(tmp_path / "table.csv" / "x.csv"))
    assert cli.out_file(str(tmp_path / "new" / "x.csv")) == tmp_path / "new" / "x.csv"


def test_exploration_refuses_an_out_file_that_is_not_a_csv(tmp_path, capsys):
    (tmp_path / "notes").write_text("")
    assert_refuses(ROOT / "bench" / "exploration.py", ["--out", str(tmp_path / "notes")], capsys)


@pytest.mark.parametrize("script", ["gate_rank", "call_overhead", "density"])
def test_kernel_benchmarks_refuse_to_run_without_the_extension(monkeypatch, capsys, script):
    """gate_rank's impl="auto" timed the reference under both columns without it; the others
    died in a traceback of impl='ffi'."""
    monkeypatch.setattr(dd, "has_cpu_kernels", lambda: False)
    with pytest.raises(SystemExit) as exited:
        load_script(ROOT / "bench" / f"{script}.py").main([])
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and "the C++ extension is not built" in stderr, stderr


def test_band_offsets_of_a_layer_narrower_than_its_bands_are_one_band():
    gpu = load_script(ROOT / "bench" / "diag_matmul_gpu.py")
    rng = np.random.default_rng(0)
    for k, p in ((4, 8), (19, 20), (16, 64)):
        offsets = gpu.make_offsets("band", k, p, rng)
        assert len(set(offsets.tolist())) == k and offsets.max() < p
    table = load_script(ROOT / "bench" / "gpu_decision_table.py")
    assert table.parse_devices("H100,H100,A100") == ["H100", "A100"]


@pytest.mark.parametrize("content", ["", "a,b\n1,2\n"])
def test_ncu_compare_refuses_a_csv_not_from_ncu_in_one_line(tmp_path, capsys, content):
    path = tmp_path / "profile.csv"
    path.write_text(content)
    assert load_script(ROOT / "bench" / "ncu_compare.py").main([str(path)]) == 2
    assert (
        capsys.readouterr().err
        == f"{path}: no ncu raw header (a row starting with ID, Kernel Name)\n"
    )


def test_gpu_decision_table_writes_its_csv_into_a_new_directory(tmp_path, capsys):
    out = tmp_path / "new" / "table.csv"
    load_script(ROOT / "bench" / "gpu_decision_table.py").main(
        ["--devices", "A100", "--csv", str(out)]
    )
    _, rows = read_rows(out)
    assert rows and {r["device"] for r in rows} == {"A100"}
    assert f"wrote {out}" in capsys.readouterr().err


def test_write_csv_writes_beside_the_scripts_whatever_the_current_directory(
    tmp_path, monkeypatch, capsys
):
    """bench/results/<name>_<time>.csv of the checkout, not of the current directory."""
    bench_cli = _bench_cli()
    write_csv = bench_cli.write_csv
    assert bench_cli.RESULTS == ROOT / "bench" / "results"
    monkeypatch.setattr(bench_cli, "RESULTS", tmp_path / "results")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    path = write_csv([{"a": 1}], ["a"], "probe")
    assert path.parent == tmp_path / "results" and path.name.startswith("probe_"), path
    assert read_rows(path) == (["a"], [{"a": "1"}])
    assert not (tmp_path / "elsewhere" / "bench").exists()


def test_coverage_takes_relative_run_paths(tmp_path, monkeypatch):
    """Orbax refused the relative path of its own usage example ("Checkpoint path should be
    absolute")."""
    coverage = load_script(ROOT / "bench" / "coverage.py")
    seen = []
    monkeypatch.setattr(coverage, "layer_rows", lambda run: seen.append(run) or [])
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "a").mkdir(parents=True)
    coverage.main(["runs/a", "--out", str(tmp_path / "c.csv")])
    assert seen == [tmp_path / "runs" / "a"]


def test_compile_and_coverage_write_a_new_csv_per_run_by_default(tmp_path, monkeypatch):
    """Their default outputs carry the time, as the other scripts' do (once fixed names that a
    second run overwrote)."""
    monkeypatch.setattr(_bench_cli(), "RESULTS", tmp_path)
    compile_script = load_script(ROOT / "bench" / "compile.py")
    times = {key: (1.0, 2.0) for key, _ in compile_script.MEASURES}
    monkeypatch.setattr(compile_script, "_run_child", lambda *args: times)
    compile_script.main(["--variants", "mu/16"])
    coverage = load_script(ROOT / "bench" / "coverage.py")
    monkeypatch.setattr(coverage, "layer_rows", lambda run: [])
    coverage.main([str(tmp_path)])
    names = sorted(p.name for p in tmp_path.glob("*.csv"))
    assert [n.split("_")[0] for n in names] == ["compile", "coverage"], names
    assert all(re.fullmatch(r"[a-z]+_\d{8}-\d{6}\.csv", n) for n in names), names


@pytest.mark.parametrize("where", ["file.csv", "folder"])
def test_exploration_writes_into_a_directory_or_a_csv_path(tmp_path, monkeypatch, where):
    """``--out x.csv`` is the CSV (it once became a directory ``x.csv/``); ``--out DIR`` holds
    exploration_<problems>.csv."""
    script = load_script(ROOT / "bench" / "exploration.py")
    result = dict(recovered=1.0, rel_err=0.1, computed=8.0, cost=0.5, seconds=1.0)
    monkeypatch.setattr(script, "run_one", lambda *args: result)
    args = ["--problems", "element", "--steps", "1", "--seeds", "1", "--repeats", "1"]
    script.main([*args, "--out", str(tmp_path / where)])
    path = (
        tmp_path / where if where.endswith(".csv") else tmp_path / where / "exploration_element.csv"
    )
    _, rows = read_rows(path)
    assert len(rows) == len(script.PROBLEMS["element"]) * len(script.MECHANISMS)


@pytest.mark.parametrize(
    ("script", "snippets"),
    [
        ("call_overhead", ["IN:OUT layer shapes", "in (0, 1)", "median (default 201)", "Example"]),
        ("density", ["IN:OUT layer shapes", "in (0, 1]", "median (default 21)", "Example"]),
        ("page_faults", ["IN:OUT of the layer", "in (0, 1)", "(default 15)", "Example"]),
        ("search_step", ["IN:OUT layer shapes", "in (0, 1)", "median (default 101)", "Example"]),
        ("gate_rank", ["ceil((1 - sparsity) P)", "median (default 1001)", "Example"]),
        ("diag_matmul_gpu", ["in (0, 1), comma separated", "adjacent ones"]),
        ("diag_matmul", ["sparsities in (0, 1)", "Examples"]),
    ],
)
def test_bench_help_says_the_syntax_of_each_option(capsys, script, snippets):
    with pytest.raises(SystemExit) as exited:
        load_script(ROOT / "bench" / f"{script}.py").main(["--help"])
    stdout = " ".join(capsys.readouterr().out.split())  # argparse wraps the help lines
    assert exited.value.code == 0
    assert all(" ".join(s.split()) in stdout for s in snippets), stdout


def _paired_records(runs):
    """``accuracy.jsonl`` records of suite mlp at 90%: (method, seed, accuracy, fingerprint)."""
    return [
        {"model": "mlp", "method": m, "sparsity": 0.9, "seed": s, "accuracy": a, "fingerprint": f}
        for m, s, a, f in runs
    ]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "missing/accuracy.jsonl does not exist"),
        ("empty dir", "accuracy.jsonl does not exist"),
        ("empty file", "accuracy.jsonl holds no records"),
        ("against empty dir", "accuracy.jsonl does not exist"),
    ],
)
def test_paired_seeds_refuses_a_workdir_without_records_in_one_line(
    tmp_path, capsys, setup, message
):
    runs = [(m, s, 0.8, "a") for m in ("dynadiag", "static_diagonals") for s in (0, 1)]
    _write_records(tmp_path / "good", _paired_records(runs))
    (tmp_path / "empty").mkdir()
    workdir = {"missing": "missing", "empty file": "blank"}.get(setup, "empty")
    if setup == "empty file":
        _write_records(tmp_path / "blank", [])
    argv = ["--workdir", str(tmp_path / workdir), "--out", str(tmp_path / "p.csv")]
    if setup.startswith("against"):
        argv = ["--workdir", str(tmp_path / "good"), "--against", str(tmp_path / "empty")]
    with pytest.raises(SystemExit) as exited:
        load_script(ROOT / "bench" / "paired_seeds.py").main(argv)
    stderr = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in stderr, stderr
    assert message in stderr.splitlines()[-1] and "error:" in stderr.splitlines()[-1], stderr
    assert not (tmp_path / "p.csv").exists()


def test_paired_seeds_pairs_runs_of_one_fingerprint(tmp_path, capsys):
    """A control seed trained again with another setting (a new fingerprint) is refused, with
    the fingerprints listed, until --fingerprint picks the runs to pair."""
    runs = [("dynadiag", 0, 0.84, "aaaa1111"), ("dynadiag", 1, 0.85, "aaaa1111")]
    runs += [("static_diagonals", 0, 0.83, "bbbb2222"), ("static_diagonals", 1, 0.84, "bbbb2222")]
    runs += [("static_diagonals", 0, 0.86, "cccc3333")]  # seed 0 again, another learning rate
    _write_records(tmp_path / "w", _paired_records(runs))
    script = load_script(ROOT / "bench" / "paired_seeds.py")
    argv = ["--workdir", str(tmp_path / "w"), "--pairs", "dynadiag:static_diagonals"]
    with pytest.raises(SystemExit) as exited:
        script.main([*argv, "--out", str(tmp_path / "mixed.csv")])
    line = capsys.readouterr().err.splitlines()[-1]
    assert exited.value.code == 2, line
    assert "mlp static_diagonals: bbbb2222 (seeds 0,1), cccc3333 (seeds 0)" in line, line
    assert "--fingerprint" in line and "dynadiag:" not in line, line
    assert not (tmp_path / "mixed.csv").exists()
    out = tmp_path / "picked.csv"
    script.main([*argv, "--fingerprint", "bbbb", "--out", str(out)])
    _, rows = read_rows(out)
    assert [(r["control"], r["seeds"]) for r in rows] == [("static_diagonals", "2")]
    assert float(rows[0]["control_mean"]) == pytest.approx(0.835)  # not the 0.86 run
    assert float(rows[0]["paired_mean"]) == pytest.approx(0.01)
    capsys.readouterr()
    with pytest.raises(SystemExit):
        script.main([*argv, "--fingerprint", "dddd"])
    assert "--fingerprint dddd: no record" in capsys.readouterr().err


def test_paired_seeds_says_how_many_seeds_each_method_has(tmp_path, capsys):
    """One seed each: refused, saying so; with a second workdir that pairs, the one-seed
    workdir is named in a note instead of silently left out."""
    one = [("dynadiag", 0, 0.84, "a"), ("static_diagonals", 0, 0.83, "b"), ("rigl", 0, 0.8, "c")]
    two = [(m, s, 0.8 + s / 100, "a") for m in ("dynadiag", "static_diagonals") for s in (0, 1)]
    _write_records(tmp_path / "one", _paired_records(one))
    _write_records(tmp_path / "two", _paired_records(two))
    script = load_script(ROOT / "bench" / "paired_seeds.py")
    argv = ["--pairs", "dynadiag:static_diagonals", "--out", str(tmp_path / "p.csv")]
    with pytest.raises(SystemExit) as exited:
        script.main(["--workdir", str(tmp_path / "one"), *argv])
    line = capsys.readouterr().err.splitlines()[-1]
    assert exited.value.code == 2 and "error: no pair of --pairs" in line, line
    assert "one: mlp 90%: dynadiag 1, static_diagonals 1 (train seeds=2 or more)" in line, line
    script.main(["--workdir", str(tmp_path / "one"), "--workdir", str(tmp_path / "two"), *argv])
    assert f"note: {tmp_path / 'one'} left out" in capsys.readouterr().err
    _, rows = read_rows(tmp_path / "p.csv")
    assert [r["workdir"] for r in rows] == [str(tmp_path / "two")]
