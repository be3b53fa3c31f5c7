"""Each method against its control, seed by seed, from results workdirs already trained.

A results suite trains seed ``s`` of every method on the same batches in the same order, so the
difference of two methods taken seed by seed leaves that part of the seed spread out
(docs/selection.md, "What eight seeds can tell apart"). This reads the ``accuracy.jsonl`` of
each ``--workdir`` (runs of ``python train/results.py ... --config=...:seeds=N``), and for every
suite, sparsity and ``method:control`` pair of ``--pairs`` with at least two common seeds prints
both means, the paired difference (mean +- std) and the seeds the method is better on (higher
accuracy, lower perplexity). Writes a CSV (``--out``, default
``bench/results/paired_seeds_<time>.csv``) and a PNG beside it (the paired differences with
their spread, one row per line of the table). With ``--against DIR`` every method of each
``--workdir`` is paired with the same method at the same suite and sparsity in ``DIR`` instead
(a change of config, seed by seed: the workdirs of the same command with and without the
change). A workdir holds the runs of every config it was trained with (a changed setting trains
again, with a new fingerprint, and leaves the old records); where one method's seed has records of
several fingerprints, this refuses and lists them: ``--fingerprint`` picks the ones to pair (a
prefix will do; the run directories end in it). Trains nothing. Example::

    python train/results.py --suite=vit --notiming --workdir=runs/vit8 \\
        --config=train/configs/results.py:models=vit,methods=dynadiag+static_diagonals,sparsities=0.9,seeds=8
    python bench/paired_seeds.py --workdir runs/vit8
    python bench/paired_seeds.py --workdir runs/vit8_changed --against runs/vit8
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys

# Appended: `train` from the checkout; the installed dynadiag_jax (with its kernels) still wins.
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from bench_cli import out_file, write_csv  # noqa: E402 - bench/, beside this

from train import results_runs as R  # noqa: E402
from train.results_report import CONTROL_PAIRS, common_seeds, paired_of, stats_of  # noqa: E402

# Each selection against its fixed control, as docs/RESULTS.md's goal lines pair them.
PAIRS = ",".join(f"{method}:{control}" for method, control in CONTROL_PAIRS)
FIELDS = (
    "workdir",
    "model",
    "sparsity",
    "method",
    "control",
    "metric",
    "method_mean",
    "method_std",
    "control_mean",
    "control_std",
    "paired_mean",
    "paired_std",
    "better",
    "seeds",
)


def parse_pairs(text: str) -> list[tuple[str, str]]:
    """``"a:b,c:d"`` as ``[("a", "b"), ("c", "d")]``."""
    pairs = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        method, sep, control = item.partition(":")
        if not sep or not method or not control or ":" in control:
            raise ValueError(f"--pairs: expected method:control, got {item!r}")
        pairs.append((method, control))
    if not pairs:
        raise ValueError("--pairs: no method:control pair given")
    return pairs


def read_records(workdir) -> list[dict]:
    """The records of ``workdir/accuracy.jsonl``; ValueError when there are none."""
    path = pathlib.Path(workdir) / R.ACCURACY_FILE
    if not path.is_file():
        raise ValueError(f"{path} does not exist: train the runs with train/results.py")
    records = R.read_records(path)
    if not records:
        raise ValueError(f"{path} holds no records: train the runs with train/results.py")
    return records


def one_fingerprint(records, chosen=()) -> list[dict]:
    """``records`` with one fingerprint (the settings a run was trained with) per run.

    Where a (model, method) has records of a fingerprint that starts with one of ``chosen``, only
    those are kept. ValueError, listing the fingerprints, where a (model, method, sparsity, seed)
    still has records of more than one: seed by seed, they would pair runs of other settings."""

    def picked(r) -> bool:
        return any(str(r.get("fingerprint")).startswith(fp) for fp in chosen)

    narrowed = {(r["model"], r["method"]) for r in records if picked(r)}
    kept = [r for r in records if picked(r) or (r["model"], r["method"]) not in narrowed]
    runs = collections.defaultdict(set)
    for r in kept:
        runs[(r["model"], r["method"], r["sparsity"], r["seed"])].add(str(r.get("fingerprint")))
    mixed = sorted({run[:2] for run, fps in runs.items() if len(fps) > 1})
    if not mixed:
        return kept
    parts = []
    for model, method in mixed:
        seeds = collections.defaultdict(set)
        for r in kept:
            if (r["model"], r["method"]) == (model, method):
                seeds[str(r.get("fingerprint"))].add(r["seed"])
        listed = ", ".join(
            f"{fp} (seeds {','.join(map(str, sorted(s)))})" for fp, s in sorted(seeds.items())
        )
        parts.append(f"{model} {method}: {listed}")
    raise ValueError(
        "runs trained with different settings have the same seed: "
        + "; ".join(parts)
        + "; pick the ones to pair with --fingerprint FP[,FP...] (a prefix will do)"
    )


def seed_counts(records, methods=None) -> str:
    """How many seeds each method (of ``methods``, default all) has, per suite and sparsity."""
    seeds = collections.defaultdict(set)
    for r in records:
        if methods is None or r["method"] in methods:
            seeds[(r["model"], r["sparsity"], r["method"])].add(r["seed"])
    suites = collections.defaultdict(list)
    for (model, sparsity, method), s in sorted(seeds.items()):
        suites[(model, sparsity)].append(f"{method} {len(s)}")
    return "; ".join(f"{m} {100 * sp:g}%: {', '.join(c)}" for (m, sp), c in suites.items())


def against(records, control_records, control_name) -> tuple[list[dict], list[tuple[str, str]]]:
    """``records`` with ``control_records`` renamed ``<method>@<control_name>``, and the pairs
    of each method of ``records`` with its renamed self."""
    renamed = [dict(r, method=f"{r['method']}@{control_name}") for r in control_records]
    methods = sorted({r["method"] for r in records})
    return records + renamed, [(m, f"{m}@{control_name}") for m in methods]


def rows_of(records, pairs, workdir="") -> list[dict]:
    """One row per (suite, sparsity, pair) with at least two common seeds, both means over
    those seeds."""
    rows = []
    for metric in ("accuracy", "perplexity"):
        suites = sorted({(r["model"], r["sparsity"]) for r in records if metric in r})
        for model, sparsity in suites:
            for method, control in pairs:
                values = common_seeds(records, model, method, control, sparsity, metric)
                paired = paired_of(*values, metric)
                if paired is None:
                    continue
                a, b = map(stats_of, values)
                rows.append(
                    dict(
                        zip(
                            FIELDS,
                            (workdir, model, sparsity, method, control, metric)
                            + (a[0], a[1], b[0], b[1])
                            + paired,
                        )
                    )
                )
    return rows


def format_table(rows) -> list[str]:
    """Markdown lines: accuracy in points, perplexity as it is."""
    lines = [
        "| runs | suite | sparsity | method | control | method | control | paired difference "
        "| better |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        scale = 100.0 if r["metric"] == "accuracy" else 1.0

        def cell(mean, std, sign="", scale=scale):
            return f"{scale * mean:{sign}.2f} +- {scale * std:.2f}"

        lines.append(
            f"| {_name(r)} | {r['model']} | {100 * r['sparsity']:g}% | {r['method']} | "
            f"{r['control']} | "
            f"{cell(r['method_mean'], r['method_std'])} | "
            f"{cell(r['control_mean'], r['control_std'])} | "
            f"{cell(r['paired_mean'], r['paired_std'], '+')} | {r['better']} of {r['seeds']} |"
        )
    return lines


def _name(row) -> str:
    """The workdir a row comes from, by its last component."""
    return pathlib.Path(row["workdir"]).name if row["workdir"] else "-"


def plot(rows, path) -> None:
    """The paired differences (points, or perplexity) with +- their std, one row each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 0.45 * len(rows) + 1.2))
    for i, r in enumerate(rows):
        scale = 100.0 if r["metric"] == "accuracy" else -1.0  # drawn so that right is better
        ax.errorbar(scale * r["paired_mean"], i, xerr=abs(scale) * r["paired_std"], fmt="o")
    ax.axvline(0.0, color="grey", lw=0.8)
    ax.set_yticks(
        range(len(rows)),
        [
            f"{_name(r)}, {r['model']} {100 * r['sparsity']:g}%: {r['method']} - {r['control']} "
            f"(n={r['seeds']})"
            for r in rows
        ],
    )
    ax.invert_yaxis()
    ax.set_xlabel("seed-by-seed difference: points, or -perplexity (right is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"wrote {path}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", action="append", required=True, help="repeat for several")
    parser.add_argument(
        "--pairs", help=f"method:control, comma-separated (default: {PAIRS}); not with --against"
    )
    parser.add_argument(
        "--against", help="a control workdir: each method against the same method there"
    )
    parser.add_argument(
        "--fingerprint",
        default="",
        help="comma-separated fingerprints (or prefixes): where a method has runs of several, "
        "pair the runs of these",
    )
    parser.add_argument("--out", type=out_file)
    args = parser.parse_args(argv)
    if args.pairs is not None and args.against:
        parser.error("--pairs and --against: give one (--against pairs each method with itself)")
    try:
        pairs = parse_pairs(PAIRS if args.pairs is None else args.pairs)
    except ValueError as e:
        parser.error(str(e))
    chosen = tuple(fp for fp in args.fingerprint.split(",") if fp)

    raw = {}
    for workdir in [*args.workdir, *([args.against] if args.against else [])]:
        try:
            raw[workdir] = read_records(workdir)
        except ValueError as e:
            parser.error(str(e))
    unmatched = [
        fp
        for fp in chosen
        if not any(str(r.get("fingerprint")).startswith(fp) for rs in raw.values() for r in rs)
    ]
    if unmatched:
        parser.error(f"--fingerprint {','.join(unmatched)}: no record of the workdirs has it")

    def load(workdir) -> list[dict]:
        try:
            return one_fingerprint(raw[workdir], chosen)
        except ValueError as e:
            parser.error(f"{workdir}: {e}")

    control = load(args.against) if args.against else None
    rows, seen = [], []
    for workdir in args.workdir:
        records = load(workdir)
        if control is not None:
            records, pairs = against(records, control, pathlib.Path(args.against).name)
        mine = rows_of(records, pairs, workdir)
        rows += mine
        methods = None if control is not None else {m for pair in pairs for m in pair}
        seen.append((workdir, records, methods, bool(mine)))
    counts = {workdir: seed_counts(records, methods) for workdir, records, methods, _ in seen}
    if not rows:
        what = (
            "method of --workdir has two seeds in common with --against"
            if control is not None
            else "pair of --pairs has two common seeds in these workdirs"
        )
        listed = " | ".join(f"{pathlib.Path(w).name}: {c or 'none'}" for w, c in counts.items())
        parser.error(f"no {what}; seeds per method: {listed} (train seeds=2 or more)")
    for workdir, _, _, paired in seen:
        if not paired:
            print(
                f"note: {workdir} left out: no pair with two common seeds "
                f"(seeds per method: {counts[workdir] or 'none'})",
                file=sys.stderr,
            )
    print("\n".join(format_table(rows)))
    csv_path = write_csv(rows, FIELDS, "paired_seeds", args.out)
    plot(rows, csv_path.with_suffix(".png"))


if __name__ == "__main__":
    main()
