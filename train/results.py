"""Train and time every sparse-training method on every suite, then write docs/RESULTS.md.

Suites (train/configs/results.py): an MLP, an MLP-Mixer and a ViT on Fashion-MNIST, and a
byte-level GPT on a local corpus. In each, every method (dense, DynaDiag with element and block
diagonals, static diagonals, RigL, SET, MEST) trains at every sparsity with several seeds; the
final test accuracy (or validation perplexity) of each run is appended to
``<workdir>/accuracy.jsonl`` as soon as the run ends. Then every method's jitted training step and
inference are timed on one fixed batch, interleaved with dense so that each ratio compares
timings taken side by side (``<workdir>/speed.json``, per suite), and dense, static diagonals and
DynaDiag train once more per suite (one seed, 90%) with every program compiled before their
second step: those runs' logged step times are the steps' own, where the campaign's share the
cores with background compiles (the report's search-cost goals read them). Finally the report of
every suite with records, its plots and the machine description are written: to
``<workdir>/RESULTS.md``, or with ``--docs=docs`` to the shipped ``docs/RESULTS.md``, which only
the full campaign may write (the default config, every run recorded and every suite timed;
anything else is refused before it trains, so a smoke run or an experiment never overwrites the
shipped report).

Interrupt at any time: finished runs are kept, the interrupted run resumes from its last
checkpoint, and the same command carries on. A run whose settings changed is trained again; a
suite whose settings changed since it was timed keeps its old timings out of the report until
``--timing_only`` times it again. A run that diverged (a final evaluation loss that is not finite)
counts as a seed like any other, and the tables say how many did.

  python train/results.py --docs=docs                              # the campaign -> docs/
  python train/results.py                                          # the same, report in --workdir
  python train/results.py --suite=vit,gpt                          # some suites
  python train/results.py --config=train/configs/results.py:quick  # a smoke run (1 seed, short)
  python train/results.py --notiming                               # train; report if timed before
  python train/results.py --timing_only                            # re-time on a quiet machine
  python train/results.py --report_only                            # the report from the logs
"""

from __future__ import annotations

import pathlib
import sys
import time

if __package__ in (None, ""):  # run as a file: make `train` importable from the repository root
    # Appended: the installed dynadiag_jax (with the compiled kernels) must win over the checkout.
    sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

import tqdm
from absl import app, flags, logging

from dynadiag_jax import training as T
from train import cli, common, results_report, speed
from train.configs import results as default_config
from train.results_runs import (
    ACCURACY_FILE,
    SPEED_FILE,
    check_full_campaign,
    clean_runs,
    cold_compiles,
    fingerprint,
    merge_timings,
    prepare,
    read_records,
    read_timings,
    run_percent,
    run_plan,
    selected_suites,
    stale_timings,
    steps_of,
    timing_recipe,
    train_run,
    untrained,
    write_timings,
)

_CONFIG = cli.define_config_flag(str(pathlib.Path(default_config.__file__)))
_WORKDIR = flags.DEFINE_string(
    "workdir", "runs/results", "run directories, accuracy.jsonl and speed.json"
)
_DOCS = flags.DEFINE_string(
    "docs",
    "",
    "write RESULTS.md and its PNG plots here (docs: the shipped report) instead of --workdir; "
    "only for the full campaign: the default config, every run recorded, every suite timed",
)
_SUITE = flags.DEFINE_list(
    "suite",
    ["all"],
    f"suites to train and time: 'all' or some of {', '.join(default_config.SUITES)}",
)
_REPORT_ONLY = flags.DEFINE_bool(
    "report_only", False, "only rewrite the report from the logs in --workdir"
)
_TIMING_ONLY = flags.DEFINE_bool(
    "timing_only", False, "time the selected suites again (no training), then rewrite the report"
)
_TIMING = flags.DEFINE_bool(
    "timing", True, "time the selected suites after training (--notiming: train, then report)"
)
_PROGRESS = flags.DEFINE_bool("progress", True, "show a progress bar")


def train_all(config, data, suites, workdir: pathlib.Path) -> None:
    """Train every planned run of ``suites`` not yet in ``accuracy.jsonl``, appending each."""
    accuracy_path = workdir / ACCURACY_FILE
    plan = run_plan(config, suites)
    todo = untrained(config, data, suites, workdir)
    print(
        f"data: {data.name}; {len(todo)} of {len(plan)} training runs to train on "
        f"{common.device_summary()}; logs in {workdir}"
    )
    bar = tqdm.tqdm(todo, unit="run", disable=not _PROGRESS.value, dynamic_ncols=True)
    for spec in bar:
        model_name, method, sparsity, seed = spec
        steps = steps_of(config.models[model_name], data)
        fp = fingerprint(config, model_name, method, steps)
        bar.set_description(f"{model_name} {method} s={sparsity:g} seed={seed}")
        run_dir = workdir / model_name / f"{method}_s{run_percent(sparsity)}_seed{seed}_{fp}"
        try:
            record = train_run(config, data, spec, steps, run_dir, fp)
        except KeyboardInterrupt as e:
            common.exit_interrupted(
                e, f"\ninterrupted; the same command resumes ({run_dir} keeps its checkpoint)"
            )
        except T.CheckpointMismatch as e:  # e.g. no step of the run's checkpoints restores
            common.die(f"{e} ({run_dir})")
        T.append_jsonl(accuracy_path, record)
        metric = (
            f"perplexity {record['perplexity']:.3f} ({record['bits_per_byte']:.3f} bits/byte)"
            if "perplexity" in record
            else f"accuracy {record['accuracy']:.4f}"
        )
        bar.write(
            f"{model_name:6s} {method:17s} s={sparsity:<5g} seed={seed}: {metric} "
            f"({record['seconds']:.0f}s, load {record['load_average'][0]:.1f})"
        )


def time_suites(config, data, suites, workdir: pathlib.Path, begun: float) -> None:
    """Time ``suites`` side by side and train their clean runs; their entries replace the old
    ones in ``speed.json``."""
    print("timing every method side by side ...")
    timings = speed.measure(config, data, suites, progress=_PROGRESS.value)
    clean = clean_runs(config, suites, workdir, progress=_PROGRESS.value)
    # each suite's timings with the recipe they measured: the report leaves out stale ones
    recipes = {s: timing_recipe(config, s, data) for s in suites}
    timings = merge_timings(read_timings(workdir), timings, clean, recipes)
    timings["invocation_seconds"] = time.perf_counter() - begun  # kept for --report_only
    write_timings(workdir, timings)


def main(argv):
    del argv
    if _REPORT_ONLY.value and _TIMING_ONLY.value:
        # Either alone is a plan; both would skip the timing --timing_only asks for.
        common.die(
            "--report_only and --timing_only exclude each other: --timing_only times the suites "
            "and then rewrites the report, --report_only only rewrites it; give one"
        )
    if _TIMING_ONLY.value and not _TIMING.value:  # it timed, against the --notiming given
        common.die(
            "--timing_only and --notiming exclude each other: --timing_only only times; "
            "--notiming trains without timing; give one"
        )
    logging.set_verbosity(logging.WARNING)
    cold_compiles()  # whole runs are timed with their compilation
    config = _CONFIG.value
    workdir = pathlib.Path(_WORKDIR.value)
    begun = time.perf_counter()
    training = not (_REPORT_ONLY.value or _TIMING_ONLY.value)
    timing = not _REPORT_ONLY.value and (_TIMING.value or _TIMING_ONLY.value)
    try:
        chosen = selected_suites(config, _SUITE.value)
        data = prepare(config, timed=timing)
        if _DOCS.value:
            check_full_campaign(
                config,
                data,
                workdir,
                trained=chosen if training else [],
                timed=chosen if timing else [],
            )
        # after the checks above, so that a bad config creates nothing
        workdir = common.usable_workdir(workdir, create=not _REPORT_ONLY.value)
        read_timings(workdir)  # an unreadable speed.json stops the command before it trains
    except common.ConfigError as e:
        common.die(str(e))
    if _REPORT_ONLY.value and not any((workdir / f).exists() for f in (ACCURACY_FILE, SPEED_FILE)):
        common.die(
            f"{workdir} holds no results ({ACCURACY_FILE}, {SPEED_FILE}): is --workdir right?"
        )
    if training:
        train_all(config, data, chosen, workdir)
    if timing:
        try:
            time_suites(config, data, chosen, workdir, begun)
        except KeyboardInterrupt as e:
            common.exit_interrupted(
                e,
                f"\ninterrupted while timing; {workdir / SPEED_FILE} is as it was "
                "(--timing_only times again)",
            )
    if not (workdir / SPEED_FILE).exists():
        if not (_REPORT_ONLY.value or _TIMING.value):
            # --notiming on a new workdir: the runs are in; the report needs the timings.
            print(
                f"trained; no report yet: {workdir / SPEED_FILE} is missing "
                "(--timing_only times the suites and writes the report)"
            )
            return
        common.die(f"{workdir / SPEED_FILE} is missing: run with --timing_only first")
    planned = set(run_plan(config))
    same_recipe = [
        r
        for r in read_records(workdir / ACCURACY_FILE)
        if r["model"] in config.models
        and r["fingerprint"]
        == fingerprint(config, r["model"], r["method"], steps_of(config.models[r["model"]], data))
    ]
    # Sparsity and seed are not in the fingerprint: runs of another plan in the same workdir
    # (other sparsities, more seeds) would otherwise enter this report's goals and totals.
    records = [
        r for r in same_recipe if (r["model"], r["method"], r["sparsity"], r["seed"]) in planned
    ]
    if not records:  # a report of nothing would replace the one there
        common.die(
            f"no run of {workdir / ACCURACY_FILE} has this config's recipe and plan: the report "
            "is left as it was (is --config the one the runs were trained with?)"
        )
    if len(records) < len(same_recipe):
        print(
            f"report: {len(same_recipe) - len(records)} runs of {workdir / ACCURACY_FILE} with "
            "this recipe are outside this config's methods, sparsities and seeds, left out"
        )
    try:
        timings = read_timings(workdir)
    except common.ConfigError as e:
        common.die(str(e))
    stale = stale_timings(config, data, timings)
    if stale:
        print(
            f"report: the timings of {', '.join(stale)} in {workdir / SPEED_FILE} were taken "
            f"with other settings, left out (--timing_only --suite={','.join(stale)} times them "
            "again)"
        )
        timings["models"] = {k: v for k, v in timings["models"].items() if k not in stale}
        timings["clean_runs"] = {
            k: v for k, v in timings.get("clean_runs", {}).items() if k not in stale
        }
    if _DOCS.value:  # what check_full_campaign allowed must have happened (no run failed)
        try:
            check_full_campaign(config, data, workdir, trained=(), timed=())
        except common.ConfigError as e:
            common.die(str(e))
    path = results_report.write(
        _DOCS.value or workdir, config, records, timings, data_name=data.name
    )
    print(f"report: {path}")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
