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
change). Trains nothing. Example::

    python train/results.py --suite=vit --notiming --workdir=runs/vit8 \\
        --config=train/configs/results.py:models=vit,methods=dynadiag+static_diagonals,sparsities=0.9,seeds=8
    python bench/paired_seeds.py --workdir runs/vit8
    python bench/paired_seeds.py --workdir runs/vit8_changed --against runs/vit8
"""

from __future__ import annotations

import argparse
import pathlib
import sys

# Appended: `train` from the checkout; the installed dynadiag_jax (with its kernels) still wins.
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

from diag_matmul import write_csv  # noqa: E402 - bench/, beside this

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
    """The records of ``workdir/accuracy.jsonl``."""
    path = pathlib.Path(workdir) / R.ACCURACY_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: train the runs with train/results.py")
    return R.read_records(path)


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
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.pairs is not None and args.against:
        parser.error("--pairs and --against: give one (--against pairs each method with itself)")
    try:
        pairs = parse_pairs(PAIRS if args.pairs is None else args.pairs)
    except ValueError as e:
        parser.error(str(e))
    control = read_records(args.against) if args.against else None
    rows = []
    for workdir in args.workdir:
        records = read_records(workdir)
        if control is not None:
            records, pairs = against(records, control, pathlib.Path(args.against).name)
        rows += rows_of(records, pairs, workdir)
    if not rows:
        what = (
            "method of --workdir has two seeds in common with --against"
            if control is not None
            else "pair of --pairs has two common seeds in these workdirs"
        )
        parser.error(f"no {what}")
    print("\n".join(format_table(rows)))
    csv_path = write_csv(rows, FIELDS, "paired_seeds", args.out)
    plot(rows, csv_path.with_suffix(".png"))


if __name__ == "__main__":
    main()
