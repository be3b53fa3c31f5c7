"""What a results suite's DynaDiag training step costs in its search phase, its frozen phase, and
to compile, beside static diagonals and dense.

Builds a suite of ``train/configs/results.py`` (model, recipe, data) at one sparsity, trains the
DynaDiag state on real batches until ``--fraction`` of its search phase (so the gate has narrowed as
in a run), then times, interleaved (median of ``--repeats``), its jitted training step there and
after the freeze - with the suite's optimizer, with plain SGD and with no update at all
(``optax.set_to_zero``: the forward, backward and search mechanics alone), which shows what the
optimizer's pass over the search phase's ``values[P, ...]`` costs. With ``--working-set c`` (1.25 by
default, 0: off) it also times the step of the same search state in the working-set form
(``dynadiag_jax.training.enter_working_set``: each layer's top ``ceil(c K)`` candidates) and its
refresh program (``refresh_working_set``, which a run calls every ``R`` steps; timed without
donation, so it includes a copy of the stored ``values[P, ...]`` that a run does not make).
Static diagonals' step (the frozen layers from the first step, random offsets) is timed against
the frozen step in a loop of the two alone: after the freeze a DynaDiag run computes the same
product on its learned offsets. Last, the step as a run calls it: blocks of ``RECORD_EVERY`` steps
whose metrics are then fetched and summed (what the training loop does between two records),
with the metrics packed in one array (the run's program) and as a dict of scalars, in both phases.
Beside each step time it reports
the bytes the compiled step accesses (XLA's cost analysis of the program the run jits, state
donated; a conditional counts every branch, the kernels' custom calls count nothing), which unlike
the times does not depend on the host's load, and the load average while timing. It also reports
the XLA compile time of each program a run compiles (initial state, search step, freeze, frozen
step; static diagonals' and dense's step). Prints a table; writes a CSV (``--out``, default
``bench/results/suite_step_<time>.csv``).

Example::

    python bench/suite_step.py --suite mlp --sparsity 0.9
"""

from __future__ import annotations

import argparse
import functools
import os
import pathlib
import sys
import time

# Appended: `train` from the checkout; the installed dynadiag_jax (with its kernels) still wins.
sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from bench_cli import out_file, write_csv  # noqa: E402 - bench/, beside this
from diag_matmul import time_interleaved  # noqa: E402 - bench/, beside this
from sparse_lr_probe import prepare  # noqa: E402 - bench/, beside this
from tqdm import tqdm  # noqa: E402

from dynadiag_jax import training as T  # noqa: E402
from dynadiag_jax.training import loop  # noqa: E402
from train import results_runs as R  # noqa: E402
from train.configs import results as results_config  # noqa: E402

# The step's optimizers: None is the suite's own; "none" makes no update (the mechanics alone).
OPTIMIZERS = {"suite optimizer": None, "sgd": optax.sgd(1e-3), "none": optax.set_to_zero()}
RECORD_EVERY = 50  # the results runs' log_every


def _time_records(calls: dict, rounds: int, progress) -> dict[str, float]:
    """Median over ``rounds`` (the calls taking turns) of the seconds per step of
    :data:`RECORD_EVERY` steps of ``fn(*args)`` whose metrics are then fetched and summed."""
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (fn, args) in calls.items():
            sums = loop.MetricSums()
            start = time.perf_counter()
            for _ in range(RECORD_EVERY):
                sums.add(fn(*args)[1])
            sums.means()
            times[name].append((time.perf_counter() - start) / RECORD_EVERY)
            progress.update(1)
    return {name: float(np.median(t)) for name, t in times.items()}


def _compile_seconds(fn, *args) -> float:
    start = time.perf_counter()
    jax.jit(fn).lower(*args).compile()
    return time.perf_counter() - start


def measure(
    config,
    data,
    suite: str,
    sparsity: float,
    fraction: float,
    repeats: int,
    working_set: float = 0.0,
) -> list[dict]:
    """Rows ``{"what", "value", "unit"}``: step times (ms), compile times (s) and bytes (MB) of
    ``config``'s suite ``suite`` on ``data`` (``R.prepare(config)``); ``working_set``: the factor
    of the working-set form also timed (0: not)."""
    m = config.models[suite]
    steps, task = R.steps_of(m, data), R.task_of(m, data)
    example, batch = R.example_input(m, data), R.sample_batch(m, data, int(m.batch_size))
    built = {
        method: R.build(config, suite, method, sparsity, 0, data, steps)
        for method in ("dynadiag", "static_diagonals", "dense")
    }
    dyn = built["dynadiag"]
    rows = []

    def init(method, optimizer):
        return lambda: T.create_train_state(built[method].model, optimizer, example, seed=0)

    rows.append(("compile: initial state", _compile_seconds(init("dynadiag", dyn.optimizer)), "s"))
    state = jax.jit(init("dynadiag", dyn.optimizer))()
    search_step = T.make_train_step(dyn.model, dyn.optimizer, task, gate=dyn.gate)
    step = jax.jit(search_step)
    source = R.train_source(m, data, 0)
    for _, local in zip(range(round(fraction * dyn.freeze_step)), source.iterate(0)):
        state, _ = step(state, local)
    rows.append(("compile: search step", _compile_seconds(step, state, batch), "s"))
    rows.append(("compile: freeze", _compile_seconds(T.freeze_state, state), "s"))
    frozen = jax.jit(T.freeze_state)(state)
    rows.append(("compile: frozen step", _compile_seconds(step, frozen, batch), "s"))
    enter = functools.partial(T.enter_working_set, factor=working_set)
    if working_set:
        rows.append(("compile: enter working set", _compile_seconds(enter, state), "s"))
        narrow = jax.jit(enter)(state)
        rows.append(("compile: working-set step", _compile_seconds(step, narrow, batch), "s"))
        refresh = T.refresh_working_set
        rows.append(("compile: refresh working set", _compile_seconds(refresh, narrow), "s"))
    calls, accessed, static_step = {}, [], None
    for method in ("static_diagonals", "dense"):
        b = built[method]
        other = jax.jit(init(method, b.optimizer))()
        fn = T.make_train_step(b.model, b.optimizer, task)
        rows.append((f"compile: {method} step", _compile_seconds(fn, other, batch), "s"))
        if method == "static_diagonals":  # the frozen step's computation, with random offsets
            static_step = (jax.jit(fn), (other, batch))
    for name, optimizer in OPTIMIZERS.items():
        optimizer = optimizer or dyn.optimizer
        step_fn = T.make_train_step(dyn.model, optimizer, task, gate=dyn.gate)
        fn = jax.jit(step_fn)
        opt_state = optimizer.init(state.params)
        search = state._replace(opt_state=opt_state)
        after = jax.jit(T.freeze_state)(search)
        phases = [("search", search), ("frozen", after)]
        if working_set:
            phases.append(("working-set", jax.jit(enter)(search)))
        for phase, phase_state in phases:
            calls[f"{phase} step, {name}"] = (fn, (phase_state, batch))
            donated = jax.jit(step_fn, donate_argnums=0).lower(phase_state, batch).compile()
            accessed.append((f"bytes: {phase} step, {name}", _bytes_accessed(donated) / 1e6, "MB"))
        if working_set and name == "suite optimizer":
            narrow = phases[-1][1]
            calls["refresh working set"] = (jax.jit(T.refresh_working_set), (narrow,))
            donated = jax.jit(T.refresh_working_set, donate_argnums=0).lower(narrow).compile()
            accessed.append(("bytes: refresh working set", _bytes_accessed(donated) / 1e6, "MB"))
    # In a loop of its own: a call right after the search step finds the caches full of the
    # search's buffers, so in the big loop the frozen step would pay for its place in the order.
    pair = {
        "frozen step (beside static)": calls["frozen step, suite optimizer"],
        "static_diagonals step": static_step,
    }
    packed_step = jax.jit(loop.packed(search_step))
    runs = {
        f"{phase} step and records, metrics {how}": (fn, (phase_state, batch))
        for phase, phase_state in (("search", state), ("frozen", frozen))
        for how, fn in (("packed", packed_step), ("dict", step))
    }
    rounds = max(3, repeats // 10)
    with tqdm(
        total=repeats * (len(calls) + 2) + rounds * len(runs), unit="call", leave=False
    ) as progress:
        load = os.getloadavg()[0]
        times = time_interleaved(calls, repeats, progress)
        times.update(time_interleaved(pair, repeats, progress))
        times.update(_time_records(runs, rounds, progress))
        load = max(load, os.getloadavg()[0])
    rows += [(name, 1e3 * t, "ms") for name, t in times.items()]
    rows += [*accessed, ("load average while timing", load, "")]
    return [{"what": w, "value": v, "unit": u} for w, v, u in rows]


def _bytes_accessed(compiled) -> float:
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, list) else analysis
    return float(analysis.get("bytes accessed", float("nan")))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default="mlp", choices=results_config.SUITES)
    parser.add_argument("--sparsity", type=float, default=0.9)
    parser.add_argument("--fraction", type=float, default=0.5, help="of the search phase trained")
    parser.add_argument("--repeats", type=int, default=101)
    parser.add_argument("--data", default="auto", help="the suites' data.source (mnist5k: small)")
    parser.add_argument(
        "--working-set",
        type=float,
        default=1.25,
        help="also time the working-set form of this factor (>= 1; 0: not)",
    )
    parser.add_argument("--out", type=out_file, default=None)
    args = parser.parse_args(argv)
    if not 0.0 < args.sparsity < 1.0 or not 0.0 <= args.fraction < 1.0 or args.repeats < 1:
        parser.error("need 0 < --sparsity < 1, 0 <= --fraction < 1 and --repeats >= 1")
    if args.working_set and not args.working_set >= 1.0:
        parser.error("need --working-set >= 1 (or 0: off)")
    config = results_config.get_config(f"models={args.suite}")
    config.data.source = args.data
    config.unstructured.update_every = 1
    data = prepare(parser, config)
    rows = measure(
        config, data, args.suite, args.sparsity, args.fraction, args.repeats, args.working_set
    )
    print(f"{args.suite} at {args.sparsity:g}, {args.fraction:g} of the search trained")
    for r in rows:
        print(f"  {r['what']:<44} {r['value']:9.3f} {r['unit']}")
    by = {r["what"]: r["value"] for r in rows}
    ratio = by["frozen step (beside static)"] / by["static_diagonals step"]
    print(f"  frozen / static diagonals' step, suite optimizer: {ratio:.2f}x")
    for how in ("packed", "dict"):
        ratio = by[f"search step and records, metrics {how}"]
        ratio /= by[f"frozen step and records, metrics {how}"]
        print(f"  search / frozen step with its records, metrics {how}: {ratio:.2f}x")
    for name in OPTIMIZERS:
        ratio = by[f"search step, {name}"] / by[f"frozen step, {name}"]
        traffic = by[f"bytes: search step, {name}"] / by[f"bytes: frozen step, {name}"]
        print(f"  search / frozen step, {name}: {ratio:.2f}x (bytes accessed {traffic:.1f}x)")
        if args.working_set:
            ratio = by[f"working-set step, {name}"] / by[f"frozen step, {name}"]
            traffic = by[f"bytes: working-set step, {name}"] / by[f"bytes: frozen step, {name}"]
            print(
                f"  working-set / frozen step, {name}: {ratio:.2f}x (bytes accessed {traffic:.1f}x)"
            )
    write_csv(rows, ("what", "value", "unit"), "suite_step", args.out)


if __name__ == "__main__":
    main()
