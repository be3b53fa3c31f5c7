"""Nsight Compute's measurements of the dynadiag kernels beside the cost model's prediction.

Reads the raw CSV of ``ncu --csv --page raw`` (a header row, a units row, one row per profiled
launch; scripts/gpu_check.sh profiles bench/diag_matmul_gpu.py at the goal shape with the
metrics of :data:`TERMS`), groups the launches by kernel instance (template, dtype, template
flags) and grid, and joins each group with the launch of ``gpu_cost.predict`` that runs that
kernel with that grid for the same layer, sparsity and offsets (the benchmark's, from its seed) at
one of the block sizes given. Per term of the model (:data:`TERMS`: instructions, registers,
occupancy, bytes, seconds; docs/gpu_cost_model.md says which metric checks which) it prints and
writes the measured value, the model's value and their ratio.

Kernels without a model launch (another grid, another block size, a name without template
arguments) are listed and written with blank predictions; a CSV without any dynadiag kernel is an
error (exit 2).

    python bench/ncu_compare.py OUT/ncu_headline.csv --out OUT/ncu_vs_model.csv
    python bench/ncu_compare.py --list-metrics required    # what gpu_check.sh asks ncu for
"""

from __future__ import annotations

import argparse
import csv
import math
import pathlib
import re
import statistics
import sys
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np
from bench_cli import count, out_file, parse_shapes, parse_sizes, sparsity  # bench/, beside
from diag_matmul_gpu import make_offsets  # bench/, beside this

import dynadiag_jax as dd
from dynadiag_jax import gpu_cost, gpu_sass
from dynadiag_jax.layout import geometry

HMMA_PER_MMA = 2  # a wmma m16n16k16 product is two HMMA.16816 on sm_80 / sm_90


def _occupancy_pct(launch, spec, dtype):
    blocks, _, _ = gpu_cost.occupancy(launch.registers, launch.shared_bytes, launch.threads, spec)
    warps = -(-launch.threads // gpu_cost.WARP)
    return 100.0 * blocks * warps / spec.sm_max_warps


def _busy_pct(term):
    """The model's share of the launch's time that ``term`` (an engine of Launch.terms) is busy."""

    def pct(launch, spec, dtype):
        return 100.0 * launch.terms(spec, dtype)[term] / launch.seconds(spec, dtype)

    return pct


class Term(NamedTuple):
    """A measured metric and the model quantity it checks (None: the model has no such term)."""

    name: str
    metric: str
    predict: object  # (Launch, DeviceSpec, dtype) -> float, or None
    optional: bool = False  # not every GPU or ncu version has it: gpu_check.sh asks if listed


# ncu's warp stall reasons (smsp__warp_issue_stalled_<reason>_per_warp_active.pct)
STALL_REASONS = (
    "barrier",
    "long_scoreboard",
    "short_scoreboard",
    "mio_throttle",
    "lg_throttle",
    "math_pipe_throttle",
    "wait",
    "not_selected",
    "selected",
    "dispatch_stall",
    "no_instruction",
    "drain",
    "membar",
    "branch_resolving",
)

TERMS = (
    Term("instructions", "smsp__inst_executed.sum", lambda la, s, d: la.instructions),
    Term(
        "hmma",
        "sm__inst_executed_pipe_tensor_op_hmma.sum",
        lambda la, s, d: HMMA_PER_MMA * la.mma,
        optional=True,
    ),
    Term("registers", "launch__registers_per_thread", lambda la, s, d: la.registers),
    Term("occupancy %", "sm__maximum_warps_per_active_cycle_pct", _occupancy_pct),
    # the model runs every launch at its theoretical occupancy
    Term("achieved occ. %", "sm__warps_active.avg.pct_of_peak_sustained_active", _occupancy_pct),
    # shared memory is modelled conflict-free: the issue figures count instructions, not replays
    Term(
        "smem ld conflicts",
        "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
        lambda la, s, d: 0.0,
    ),
    Term(
        "smem st conflicts",
        "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
        lambda la, s, d: 0.0,
    ),
    Term("hbm bytes", "dram__bytes.sum", lambda la, s, d: la.hbm_bytes),
    Term("hbm busy %", "dram__throughput.avg.pct_of_peak_sustained_elapsed", _busy_pct("hbm")),
    # the L2 carries the SMs' loads and stores and every HBM byte (fills and write-backs)
    Term(
        "l2 bytes",
        "lts__t_bytes.sum",
        lambda la, s, d: la.load_bytes + la.store_bytes + la.hbm_bytes,
    ),
    Term(
        "tensor pipe %",
        "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
        None,
        optional=True,
    ),
    Term("seconds", "gpu__time_duration.sum", lambda la, s, d: la.seconds(s, d)),
    Term(
        "l2 busy %",
        "lts__throughput.avg.pct_of_peak_sustained_elapsed",
        _busy_pct("l2"),
        optional=True,
    ),
    # Which of the L2's units is the busy one: tag lookups (one per request, however many of its
    # four 32-byte sectors a request uses), sectors, the data banks, the crossbar into it.
    *(
        Term(
            f"l2 {unit} busy %",
            f"lts__{metric}.avg.pct_of_peak_sustained_elapsed",
            None,
            optional=True,
        )
        for unit, metric in (
            ("tags", "t_tag_requests"),
            ("sectors", "t_sectors"),
            ("data", "d_sectors"),
            ("xbar in", "xbar2lts_cycles_active"),
        )
    ),
    Term("l2 requests", "lts__t_requests.sum", None, optional=True),
    Term("l2 sectors", "lts__t_sectors.sum", None, optional=True),
    # What holds a kernel that no work term explains: how busy the issue slots are, and the share
    # of active warp cycles each stall reason takes.
    Term(
        "issue active %",
        "smsp__issue_active.avg.pct_of_peak_sustained_active",
        None,
        optional=True,
    ),
    *(
        Term(
            f"stall {reason} %",
            f"smsp__warp_issue_stalled_{reason}_per_warp_active.pct",
            None,
            optional=True,
        )
        for reason in STALL_REASONS
    ),
)

# ncu scales units with SI prefixes unless --print-units base; times become seconds, sizes bytes
_PREFIX = {"": 1.0, "n": 1e-9, "u": 1e-6, "m": 1e-3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}
_SHORT_TIME = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
_DTYPES = {"__nv_bfloat16": "bfloat16", "__half": "float16", "float": "float32"}
_TEMPLATES = {key[0] for key in gpu_sass.KERNELS}
_DX_LAUNCHES = ("block_product", "element_plan", "element_product")
# XLA's dot runs cuBLAS / cuBLASLt GEMM kernels: profiled beside ours (the benchmark always runs
# the dense layer), their measurements are the reference ours are read against
_REFERENCE = re.compile(r"gemm|nvjet|cutlass|xmma", re.IGNORECASE)
REFERENCE_ROLE = "dense reference (XLA's dot; not modelled)"


def unit_scale(unit: str) -> float:
    """Factor from ``unit`` to seconds or bytes; 1 for other units (%, inst, register/thread)."""
    if unit in _SHORT_TIME:
        return _SHORT_TIME[unit]
    m = re.fullmatch(r"([numKMGT]?)(second|byte)", unit)
    return _PREFIX[m.group(1)] if m else 1.0


def parse_value(text: str) -> float | None:
    """A metric cell as a float (comma thousands allowed); None for ``n/a`` or empty."""
    text = text.strip().replace(",", "")
    try:
        return float(text)
    except ValueError:
        return None


class Profiled(NamedTuple):
    """One profiled kernel launch: its name, grid (thread blocks) and metrics in base units."""

    kernel_name: str
    grid: int
    threads: int
    metrics: dict  # metric -> float or None


def _dim_product(text: str) -> int:
    return math.prod(int(n) for n in re.findall(r"\d+", text)) if text.strip() else 0


def read_raw_csv(path) -> list:
    """The launches of an ``ncu --csv --page raw`` file (lines before its header are skipped)."""
    with open(path, newline="") as fh:
        rows = list(csv.reader(fh))
    start = next((i for i, r in enumerate(rows) if r[:1] == ["ID"] and "Kernel Name" in r), None)
    if start is None:
        raise ValueError(f"{path}: no ncu raw header (a row starting with ID, Kernel Name)")
    header = rows[start]
    col = {name: i for i, name in enumerate(header)}
    scale = {}
    body = rows[start + 1 :]
    if body and body[0][0] == "" and len(body[0]) == len(header):  # the units row
        scale = {name: unit_scale(body[0][col[name]]) for name in header}
        body = body[1:]
    metrics = [name for name in header if "__" in name]  # ncu metric names, not the info columns
    launches = []
    for row in body:
        if len(row) != len(header):  # ncu's own messages between rows
            continue
        values = {}
        for name in metrics:
            v = parse_value(row[col[name]])
            values[name] = None if v is None else v * scale.get(name, 1.0)
        launches.append(
            Profiled(
                row[col["Kernel Name"]],
                _dim_product(row[col["Grid Size"]]) if "Grid Size" in col else 0,
                _dim_product(row[col["Block Size"]]) if "Block Size" in col else 0,
                values,
            )
        )
    return launches


def kernel_key(name: str):
    """``(template, dtype, args)`` of a demangled dynadiag kernel name, ``args`` its other template
    arguments (bools and ints: b and the panel width), as the cost model's ``Launch.kernel`` names
    them (ncu may print a bool as 0 or 1, which compares equal); the template alone (str) for a
    name without template arguments it understands; None for other kernels. ncu names a kernel
    with or without its namespace."""
    m = re.search(r"(?:dynadiag::cuda::|void )(\w+)<([^<>]*)>", name)
    if m and (m.group(1) in _TEMPLATES or "dynadiag::cuda::" in name):
        args = [a.strip() for a in m.group(2).split(",")]
        dtype = _DTYPES.get(args[0])
        rest = tuple(
            a == "true" if a in ("true", "false") else int(a)
            for a in args[1:]
            if a in ("true", "false") or re.fullmatch(r"-?\d+", a)
        )
        if dtype is not None and len(rest) == len(args) - 1:
            return m.group(1), dtype, rest
        return m.group(1)
    base = re.sub(r"\(.*", "", name).split("::")[-1].strip()
    return base if base in _TEMPLATES else None


class Group(NamedTuple):
    """The launches of one kernel instance and grid, and the model launch joined to them."""

    key: tuple  # (template, dtype, flags)
    grid: int
    launches: list
    block_size: int | None  # of the joined model launch
    role: str  # "fwd block_product", "dvalues block_sddmm", ...; or why none was joined
    predicted: object  # gpu_cost.Launch or None


def model_launches(args, spec) -> list:
    """``(block size, role, Launch)`` of every CUDA launch the model predicts for the benchmark."""
    out = []
    in_f, out_f = args.shape
    for b in args.block_sizes:
        geo = geometry(in_f, out_f, b)
        k = dd.num_diagonals(in_f, out_f, args.sparsity, block_size=b)
        # the benchmark's offsets: block diagonals in the random layout only, drawn first from a
        # generator seeded with --seed
        layout = args.layout if b == 1 else "random"
        offsets = make_offsets(layout, k, geo.num_candidates, np.random.default_rng(args.seed))
        pred = gpu_cost.predict(
            args.rows, in_f, out_f, args.dtype, offsets=offsets, block_size=b, device=spec
        )
        path = pred.paths["kernel"]
        for la in path.fwd:
            out.append((b, f"fwd {la.name}", la))
        for la in path.bwd:  # dx's launches, then dvalues'
            out.append((b, f"{'dx' if la.name in _DX_LAUNCHES else 'dvalues'} {la.name}", la))
    return [(b, role, la) for b, role, la in out if la.kernel]


def join(launches, predictions, dtype) -> tuple:
    """``(groups, ignored)``: dynadiag launches grouped and joined; names of the other kernels."""
    by_config, reference, ignored = {}, {}, []
    for la in launches:
        key = kernel_key(la.kernel_name)
        if key is not None:
            by_config.setdefault((key, la.grid), []).append(la)
        elif _REFERENCE.search(la.kernel_name):
            name = re.sub(r"^void ", "", la.kernel_name)
            reference.setdefault((name[:90], la.grid), []).append(la)
        else:
            ignored.append(la.kernel_name)
    groups = [
        Group((name, "", ()), grid, members, None, REFERENCE_ROLE, None)
        for (name, grid), members in reference.items()
    ]
    for (key, grid), members in by_config.items():
        if isinstance(key, str):
            note = "no template arguments understood (profile with --print-kernel-base demangled)"
            groups.append(Group((key, "", ()), grid, members, None, note, None))
            continue
        template, kdtype, flags = key
        same = [(b, role, p) for b, role, p in predictions if p.kernel == (template, flags)]
        hits = [(b, role, p) for b, role, p in same if p.ctas == grid]
        if kdtype != dtype:
            note = f"profiled in {kdtype}, the model was asked for {dtype}"
        elif len(hits) == 1:
            groups.append(Group(key, grid, members, *hits[0]))
            continue
        elif hits:
            note = "ambiguous: " + ", ".join(f"b={b} {role}" for b, role, _ in hits)
        elif same:
            grids = sorted({p.ctas for *_, p in same})
            note = f"no model launch with this grid (the model's: {grids})"
        else:
            note = "the model has no launch of this kernel"
        groups.append(Group(key, grid, members, None, note, None))
    return groups, ignored


def ours(groups) -> list:
    """The groups of dynadiag kernels (not the dense reference)."""
    return [g for g in groups if g.role != REFERENCE_ROLE]


def kernel_label(key) -> str:
    template, dtype, flags = key
    shown = (str(f).lower() if isinstance(f, bool) else str(f) for f in flags)
    args = [dtype, *shown] if dtype else []
    return f"{template}<{', '.join(args)}>" if args else template


FIELDS = "kernel grid block_size launch profiled term metric measured predicted ratio".split()


def records(groups, spec, dtype, present) -> list:
    """One record per (group, term whose metric the CSV holds)."""
    out = []
    for g in groups:
        for term in TERMS:
            if term.metric not in present:
                continue
            values = [la.metrics[term.metric] for la in g.launches]
            values = [v for v in values if v is not None]
            measured = statistics.median(values) if values else None
            predicted = None
            if g.predicted is not None and term.predict is not None:
                predicted = float(term.predict(g.predicted, spec, dtype))
            ratio = measured / predicted if measured is not None and predicted else None
            out.append(
                {
                    "kernel": kernel_label(g.key),
                    "grid": g.grid,
                    "block_size": g.block_size if g.block_size is not None else "",
                    "launch": g.role,
                    "profiled": len(g.launches),
                    "term": term.name,
                    "metric": term.metric,
                    "measured": "" if measured is None else measured,
                    "predicted": "" if predicted is None else predicted,
                    "ratio": "" if ratio is None else round(ratio, 4),
                }
            )
    return out


def _fmt(v) -> str:
    if v == "" or v is None:
        return "-"
    return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"


def table(recs) -> str:
    lines = []
    head = None
    for r in recs:
        group = (r["kernel"], r["grid"])
        if group != head:
            head = group
            b = f"b={r['block_size']} " if r["block_size"] != "" else ""
            lines.append(
                f"\n{r['kernel']}  grid {r['grid']}  {b}{r['launch']}  ({r['profiled']} profiled)"
            )
            lines.append(f"  {'term':<18} {'measured':>12} {'model':>12} {'ratio':>8}")
        ratio = "-" if r["ratio"] == "" else f"{r['ratio']:.3f}"
        lines.append(
            f"  {r['term']:<18} {_fmt(r['measured']):>12} {_fmt(r['predicted']):>12} {ratio:>8}"
        )
    return "\n".join(lines)


def _one_shape(text: str) -> tuple[int, int]:
    shapes = parse_shapes(text)
    if len(shapes) != 1:
        raise argparse.ArgumentTypeError(f"give one IN:OUT shape like 768:3072; got {text!r}")
    return shapes[0]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("csv", nargs="?", type=pathlib.Path, help="ncu --csv --page raw output")
    parser.add_argument(
        "--list-metrics",
        choices=("required", "optional"),
        help="print the ncu metrics (comma separated) and exit",
    )
    parser.add_argument(
        "--rows", type=count("rows"), default=403456, help="rows of x (the benchmark's)"
    )
    parser.add_argument("--shape", type=_one_shape, default=(768, 3072), help="IN:OUT")
    parser.add_argument("--sparsity", type=sparsity, default=0.9)
    parser.add_argument("--block-sizes", type=parse_sizes("block sizes", "16,32"), default=(16, 32))
    parser.add_argument("--layout", choices=("random", "band"), default="random")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--seed", type=int, default=0, help="the benchmark's --seed")
    parser.add_argument(
        "--device",
        default=gpu_cost.DEFAULT_DEVICE,
        choices=list(gpu_cost.DEVICES),
        help="the cost model's",
    )
    parser.add_argument("--out", type=out_file, default=None, help="write the records here")
    args = parser.parse_args(argv)
    if args.list_metrics is None and args.csv is None:
        parser.error("give the ncu CSV (or --list-metrics)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list_metrics:
        print(",".join(t.metric for t in TERMS if t.optional == (args.list_metrics == "optional")))
        return 0
    dtype = jnp.dtype(args.dtype).name
    spec = gpu_cost.DEVICES[args.device]
    if not args.csv.is_file():
        print(f"{args.csv}: no such file (did the ncu run fail?)", file=sys.stderr)
        return 2
    try:
        launches = read_raw_csv(args.csv)
    except ValueError as e:  # not an ncu raw CSV
        print(e, file=sys.stderr)
        return 2
    groups, ignored = join(launches, model_launches(args, spec), dtype)
    if not ours(groups):
        others = set(ignored) | {la.kernel_name for g in groups for la in g.launches}
        print(
            f"{args.csv}: no dynadiag kernel among its {len(launches)} launches "
            f"({', '.join(sorted(others)) or 'none'}); profile with "
            "--print-kernel-base demangled, as scripts/gpu_check.sh does",
            file=sys.stderr,
        )
        return 2
    present = set(launches[0].metrics)
    recs = records(groups, spec, dtype, present)
    print(
        f"ncu vs the cost model ({spec.name}): {args.rows} rows x {args.shape[0]} -> "
        f"{args.shape[1]}, {dtype}, sparsity {args.sparsity}, b in {args.block_sizes}"
    )
    print(table(recs))
    missing = [t.metric for t in TERMS if t.metric not in present]
    if missing:
        print(f"\nnot in the CSV: {', '.join(missing)}")
    unjoined = [g for g in ours(groups) if g.predicted is None]
    for g in unjoined:
        print(f"not joined: {kernel_label(g.key)} grid {g.grid}: {g.role}", file=sys.stderr)
    # XLA's own kernels around the calls (copies, conversions, the guard's selects): their time
    # is part of what the benchmark measures and the model does not see
    seconds, other = {}, set(ignored)
    for la in launches:
        if la.kernel_name in other:
            t = la.metrics.get("gpu__time_duration.sum")
            seconds.setdefault(la.kernel_name, []).append(t or 0.0)
    for name in sorted(seconds):
        ts = seconds[name]
        print(
            f"ignored (not a dynadiag kernel): {name} ({len(ts)} launches, "
            f"{1e3 * sum(ts):.4g} ms in all)",
            file=sys.stderr,
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=FIELDS)
            writer.writeheader()
            writer.writerows(recs)
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
