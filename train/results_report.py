"""docs/RESULTS.md and its plots from the results command's records (training runs and timings).

Every suite of the config with records gets its tables: test accuracy (classification) or
validation perplexity and bits per byte (language model) per method and sparsity, the achieved
density, the side-by-side step timings, and whole runs against dense. The project's goals (the
MLP against the baselines, DynaDiag against RigL and SET on the ViT and the GPT, the learned search
against static diagonals, blocks against element diagonals) are evaluated from the same numbers;
the hand-written notes between ``<!-- notes -->`` and
``<!-- /notes -->`` survive regeneration.
"""

from __future__ import annotations

import collections
import datetime
import math
import pathlib
import re

import numpy as np

import dynadiag_jax as dd
from train.results_runs import (
    is_language_model,
    method_permutation,
    method_rank,
    parse_method,
    suites,
)

METHOD_NAMES = {
    "dense": "Dense",
    "dynadiag": "DynaDiag",
    "static_diagonals": "Static diagonals",
    "static_unstructured": "Static unstructured",
    "rigl": "RigL",
    "set": "SET",
    "mest": "MEST",
}
VARIANT_NAMES = {
    "dense": "Dense",
    "diagonal": "Diagonal (DynaDiag frozen, static diagonals)",
    "unstructured_masked": "Unstructured, masked dense (RigL/SET/MEST as trained)",
    "unstructured_bcoo": "Unstructured, BCOO (jax.experimental.sparse)",
}
SUITE_TITLES = {
    "mlp": "MLP on Fashion-MNIST",
    "mixer": "MLP-Mixer on Fashion-MNIST",
    "vit": "ViT on Fashion-MNIST",
    "gpt": "byte-level GPT",
}
NOTES = re.compile(r"<!-- notes -->.*?<!-- /notes -->", re.S)
EMPTY_NOTES = "<!-- notes -->\n<!-- /notes -->"
# The methods of the training-loss plot: learned against static selection, and the best DST
# against its own fixed mask.
CURVE_METHODS = ("dense", "dynadiag", "static_diagonals", "static_unstructured", "set")
PLOTS = {
    "quality": "results_accuracy.png",
    "speed": "results_speed.png",
    "curves": "results_gpt_curves.png",
    "loss_curves": "results_vit_loss.png",
}


def method_name(method: str) -> str:
    base, block = parse_method(method)
    name = METHOD_NAMES.get(base, base)
    if block > 1:
        name = f"{name}, blocks {block}x{block}"
    permutation = method_permutation(method)
    name = f"{name}, {permutation} permutation" if permutation else name
    rank = method_rank(method)
    return f"{name} + LoRA-FA r={rank}" if rank else name


def variant_name(variant: str) -> str:
    base, permuted = variant.removesuffix("_perm"), variant.endswith("_perm")
    if base.startswith("diagonal_b"):
        b = base[len("diagonal_b") :]
        name = f"Block diagonals {b}x{b} (DynaDiag frozen)"
    else:
        name = VARIANT_NAMES.get(base, base)
    return f"{name}, input permutation" if permuted else name


def _metric(config, model: str) -> str:
    return "perplexity" if is_language_model(config.models[model]) else "accuracy"


def stats_of(values) -> tuple[float, float, int]:
    """``(mean, std, n)`` of ``values`` (the sample std; 0 for one value; NaN beside an infinite
    mean, a diverged run's perplexity)."""
    v = np.asarray(values, np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf
        return float(v.mean()), float(v.std(ddof=1)) if len(v) > 1 else 0.0, len(v)


# Metrics where lower is better: a NaN one (a diverged run's, in records written before
# LanguageModeling.summarise made it inf) counts as infinite, the worst.
LOWER_IS_BETTER = ("perplexity", "bits_per_byte")


def metric_stats(records, metric: str = "accuracy") -> dict:
    """``{(model, method, sparsity): (mean, std, n)}`` of ``metric`` over the records that have
    it (dense: sparsity 0)."""
    groups = collections.defaultdict(list)
    for r in records:
        if metric in r:
            value = r[metric]
            if metric in LOWER_IS_BETTER and math.isnan(value):
                value = math.inf
            groups[(r["model"], r["method"], r["sparsity"])].append(value)
    return {k: stats_of(v) for k, v in groups.items()}


def diverged_runs(records) -> collections.Counter:
    """``{(model, method, sparsity): count}`` of the runs whose final evaluation loss is not
    finite: their metric (an accuracy near chance, an infinite perplexity) counts in the mean like
    any seed's, and the tables say how many there were."""
    return collections.Counter(
        (r["model"], r["method"], r["sparsity"])
        for r in records
        if not math.isfinite(r.get("loss", 0.0))
    )


def _runs(n: int) -> str:
    return f"{n} run" if n == 1 else f"{n} runs"


def _fmt(stat, scale=100.0, digits=2, diverged=0):
    mean, std, n = stat
    count = f"{n}, {diverged} diverged" if diverged else f"{n}"
    return f"{scale * mean:.{digits}f} ± {scale * std:.{digits}f} ({count})"


def _methods(m) -> list[str]:
    return [*m.methods, *(x for x in m.goal_methods if x not in m.methods)]


def _sparsities(m) -> list[float]:
    return sorted(float(s) for s in m.sparsities)


def metric_table(
    stats, model, methods, sparsities, *, scale=100.0, digits=2, diverged=None
) -> list[str]:
    diverged = diverged or {}
    lines = [
        "| method | " + " | ".join(f"{100 * s:g}% sparse" for s in sparsities) + " |",
        "|---|" + "---|" * len(sparsities),
    ]
    for method in methods:
        cells = []
        for s in sparsities:
            key = (model, method, 0.0 if method == "dense" else s)
            cells.append(
                _fmt(stats[key], scale, digits, diverged.get(key, 0)) if key in stats else "n/a"
            )
        lines.append(f"| {method_name(method)} | " + " | ".join(cells) + " |")
    return lines


def _densities(records, model) -> dict:
    dens = collections.defaultdict(list)
    for r in records:
        if r["model"] == model:
            dens[(r["method"], r["sparsity"])].append(r["density"])
    return dens


def density_table(records, model, methods, sparsities) -> list[str]:
    dens = _densities(records, model)
    lines = [
        "| method | " + " | ".join(f"{100 * s:g}%" for s in sparsities) + " |",
        "|---|" + "---|" * len(sparsities),
    ]
    for method in methods:
        if method == "dense":
            continue
        cells = [
            f"{100 * np.mean(dens[(method, s)]):.2f}%" if dens.get((method, s)) else "n/a"
            for s in sparsities
        ]
        lines.append(f"| {method_name(method)} | " + " | ".join(cells) + " |")
    return lines


def speed_table(timings, model) -> list[str]:
    groups = timings["models"].get(model, {})
    if not groups:
        return ["(no timings)"]
    kinds = sorted(
        {k for g in groups.values() for v in g.values() for k in v},
        key=lambda k: (k != "train", int(k[7:]) if k.startswith("infer_b") else 0),
    )
    head = [("training step" if k == "train" else f"inference, batch {k[7:]}") for k in kinds]
    lines = [
        "| sparsity | layers | " + " | ".join(f"{h} (ms) | ×dense" for h in head) + " |",
        "|---|---|" + "---|---|" * len(kinds),
    ]
    for s, group in groups.items():
        dense = group["dense"]
        for variant, t in group.items():
            cells = []
            for k in kinds:
                cells += [f"{1e3 * t[k]:.3f}", f"{t[k] / dense[k]:.2f}"] if k in t else ["", ""]
            lines.append(
                f"| {100 * float(s):g}% | {variant_name(variant)} | " + " | ".join(cells) + " |"
            )
    return lines


def in_run_table(records, model, methods, sparsities) -> list[str]:
    """Mean logged step time of whole runs relative to the dense runs (noisy: other times)."""
    times = collections.defaultdict(list)
    for r in records:
        if r["model"] == model and r.get("step_time_s"):
            times[(r["method"], r["sparsity"])].append(r["step_time_s"])
            if r.get("search_step_time_s"):
                times[(r["method"] + ":search", r["sparsity"])].append(r["search_step_time_s"])
            if r.get("frozen_step_time_s"):
                times[(r["method"] + ":frozen", r["sparsity"])].append(r["frozen_step_time_s"])
    dense = np.mean(times[("dense", 0.0)]) if times.get(("dense", 0.0)) else None
    if dense is None:
        return ["(no dense runs)"]
    lines = [
        "| method | " + " | ".join(f"{100 * s:g}%" for s in sparsities) + " |",
        "|---|" + "---|" * len(sparsities),
        "| Dense | " + " | ".join(f"{1e3 * dense:.2f} ms" for _ in sparsities) + " |",
    ]
    for method in methods:
        for suffix, label in (
            ("", ""),
            (":search", " (search phase)"),
            (":frozen", " (after freeze)"),
        ):
            key = method + suffix
            if method == "dense" or not any((key, s) in times for s in sparsities):
                continue
            cells = [
                f"{np.mean(times[(key, s)]) / dense:.2f}×" if (key, s) in times else "n/a"
                for s in sparsities
            ]
            lines.append(f"| {method_name(method)}{label} | " + " | ".join(cells) + " |")
    return lines


def uninterrupted(records) -> list:
    """The runs that trained in one go: a resumed run's ``seconds`` count only from its last
    start (and every start compiles again), so its wall time is no whole run's."""
    return [r for r in records if not r.get("resumed_at")]


def _resumed_note(records, model) -> str:
    resumed = sum(1 for r in records if r["model"] == model and r.get("resumed_at"))
    return f"; {resumed} resumed runs left out" if resumed else ""


def whole_run_table(records, model, methods, sparsities, cores: int) -> list[str]:
    """Mean wall and processor time of whole runs (compilation, search phase, mask updates and
    evaluations included), relative to the dense runs, with the machine's load during them (of
    its ``cores``); resumed runs left out (:func:`uninterrupted`)."""
    runs = collections.defaultdict(list)
    for r in uninterrupted(records):
        if r["model"] == model:
            runs[(r["method"], r["sparsity"])].append(r)
    dense = runs.get(("dense", 0.0))
    if not dense:
        return [f"(no dense run trained in one go{_resumed_note(records, model)})"]

    def cell(rs, ref):
        wall = np.mean([r["seconds"] for r in rs])
        text = f"{wall:.0f} s ({wall / np.mean([r['seconds'] for r in ref]):.2f}×"
        if all("cpu_seconds" in r for r in rs + ref):
            cpu = np.mean([r["cpu_seconds"] for r in rs])
            text += f"; CPU {cpu / np.mean([r['cpu_seconds'] for r in ref]):.2f}×"
        return text + ")"

    lines = [
        "| method | " + " | ".join(f"{100 * s:g}%" for s in sparsities) + " |",
        "|---|" + "---|" * len(sparsities),
        "| Dense | " + " | ".join(cell(dense, dense) for _ in sparsities) + " |",
    ]
    for method in methods:
        if method == "dense":
            continue
        cells = [
            cell(runs[(method, s)], dense) if runs.get((method, s)) else "n/a" for s in sparsities
        ]
        lines.append(f"| {method_name(method)} | " + " | ".join(cells) + " |")
    resumed = _resumed_note(records, model)
    if resumed:
        lines += ["", f"Resumed runs are left out{resumed}."]
    loads = [x for r in records if r["model"] == model for x in r.get("load_average", ())]
    if loads:
        lines += [
            "",
            f"One-minute load average at the starts and ends of these runs: mean "
            f"{np.mean(loads):.1f}, range {min(loads):.1f}-{max(loads):.1f} ({cores} cores: "
            f"above {cores}, other programs shared the processors and wall times stretch; "
            "processor time stretches less).",
        ]
    return lines


def _whole_run_ratio(records, model, method, sparsity):
    """Mean logged step time of ``method``'s runs over that of the dense runs (same model)."""

    def times(m, s):
        return [
            r["step_time_s"]
            for r in records
            if (r["model"], r["method"], r["sparsity"]) == (model, m, s) and r.get("step_time_s")
        ]

    ours, dense = times(method, sparsity), times("dense", 0.0)
    return float(np.mean(ours) / np.mean(dense)) if ours and dense else None


def _met(ok: bool) -> str:
    return "met" if ok else "missed"


def mlp_goals(stats, timings, records=(), sparsity=0.9) -> list[str]:
    """The goals on the Fashion-MNIST MLP (accuracy against the baselines, speed against dense):
    each item met or missed, with the numbers."""
    m, s = "mlp", sparsity
    get = lambda method: stats.get((m, method, 0.0 if method == "dense" else s))  # noqa: E731
    dd, dense, rigl, set_ = get("dynadiag"), get("dense"), get("rigl"), get("set")
    out = []
    if dd and dense:
        gap = 100 * (dense[0] - dd[0])
        out.append(
            f"- DynaDiag within 1 point of dense: **{_met(gap <= 1.0)}** "
            f"(dense {100 * dense[0]:.2f}%, DynaDiag {100 * dd[0]:.2f}%, gap {gap:+.2f} points)."
        )
    if dd and rigl and set_:
        best = max(rigl[0], set_[0])
        out.append(
            "- DynaDiag at least as accurate as SET and RigL: "
            f"**{_met(dd[0] >= best)}** "
            f"(RigL {100 * rigl[0]:.2f}%, SET {100 * set_[0]:.2f}%, DynaDiag {100 * dd[0]:.2f}%)."
        )
    group = timings["models"].get(m, {}).get(f"{s:g}")
    if group and "diagonal" in group:
        ratio = group["diagonal"]["train"] / group["dense"]["train"]
        whole = _whole_run_ratio(records, m, "dynadiag", s)
        whole_text = (
            f"; over whole runs, search phase included, {whole:.2f}× (logged step times)"
            if whole is not None
            else ""
        )
        out.append(
            "- Faster training step than dense (DynaDiag after the freeze, "
            f"{timings['machine']['diag_impl']}): "
            f"**{_met(ratio < 1.0)}** ({ratio:.2f}× the dense step{whole_text})."
        )
    return out


def _acc(stat) -> str:
    return f"{100 * stat[0]:.2f} ± {100 * stat[1]:.2f}%"


def vit_goals(stats, sparsity=0.9, model="vit") -> list[str]:
    """The ViT: DynaDiag at least max(RigL, SET) - 0.2 points; the learned selection
    better than static random diagonals by more than the seed spread (the larger of the two
    standard deviations)."""
    get = lambda method: stats.get((model, method, sparsity))  # noqa: E731
    dd, rigl, set_, static = get("dynadiag"), get("rigl"), get("set"), get("static_diagonals")
    out = []
    if dd and rigl and set_:
        best = max(rigl[0], set_[0])
        out.append(
            "- ViT: DynaDiag at least max(RigL, SET) - 0.2 points: "
            f"**{_met(dd[0] >= best - 0.002)}** (DynaDiag {_acc(dd)}, RigL {_acc(rigl)}, "
            f"SET {_acc(set_)}; {100 * (dd[0] - best):+.2f} points)."
        )
    if dd and static:
        gain, spread = dd[0] - static[0], max(dd[1], static[1])
        out.append(
            "- ViT: learned selection better than static random diagonals by more than the seed "
            f"spread: **{_met(gain > spread)}** (DynaDiag {_acc(dd)}, static {_acc(static)}: "
            f"{100 * gain:+.2f} points against a spread of {100 * spread:.2f})."
        )
    return out


def gpt_goals(stats, sparsity=0.9, model="gpt") -> list[str]:
    """The GPT: DynaDiag's perplexity within 2% of the better of RigL and SET."""
    get = lambda method: stats.get((model, method, sparsity))  # noqa: E731
    dd, rigl, set_ = get("dynadiag"), get("rigl"), get("set")
    if not (dd and rigl and set_):
        return []
    best = min(rigl[0], set_[0])
    return [
        "- GPT: DynaDiag's validation perplexity within 2% of the better of RigL and SET: "
        f"**{_met(dd[0] <= 1.02 * best)}** (DynaDiag {dd[0]:.3f}, RigL {rigl[0]:.3f}, "
        f"SET {set_[0]:.3f}; {100 * (dd[0] / best - 1):+.2f}%)."
    ]


def _mean_of(records, key, model, method, sparsity):
    values = [
        r[key]
        for r in records
        if (r["model"], r["method"], r["sparsity"]) == (model, method, sparsity)
        and r.get(key) is not None
    ]
    return float(np.mean(values)) if values else None


def _phase_costs(records, model, sparsity):
    """Mean logged ``(search step, frozen step, static diagonals' step)`` of ``records``."""
    return (
        _mean_of(records, "search_step_time_s", model, "dynadiag", sparsity),
        _mean_of(records, "frozen_step_time_s", model, "dynadiag", sparsity),
        _mean_of(records, "step_time_s", model, "static_diagonals", sparsity),
    )


def search_goals(config, stats, ppl_stats, records, sparsity=0.9, clean_runs=None) -> list[str]:
    """The search's goals beyond the ViT and GPT lines of :func:`vit_goals` / :func:`gpt_goals`:
    the MLP near the best DST, the GPT below static diagonals, learned >= static at the highest
    sparsity of every suite, and what the search and the frozen phase cost (logged step times:
    of ``clean_runs`` (``{suite: {method: record}}``, runs with no background compile beside
    their steps) where given, else of the DynaDiag runs at ``sparsity``; whole runs as wall time
    against dense)."""
    clean_runs = clean_runs or {}
    out = []
    get = lambda m, method, s=sparsity: stats.get((m, method, s))  # noqa: E731
    dd, dsts = get("mlp", "dynadiag"), [get("mlp", x) for x in ("rigl", "set", "mest")]
    if dd and all(dsts):
        best = max(x[0] for x in dsts)
        out.append(
            "- MLP: DynaDiag within 0.2 points of the best of RigL / SET / MEST: "
            f"**{_met(dd[0] >= best - 0.002)}** (DynaDiag {_acc(dd)}, best {100 * best:.2f}%; "
            f"{100 * (dd[0] - best):+.2f} points)."
        )
    dd, static = (
        ppl_stats.get(("gpt", "dynadiag", sparsity)),
        ppl_stats.get(("gpt", "static_diagonals", sparsity)),
    )
    if dd and static:
        out.append(
            "- GPT: DynaDiag's perplexity below static diagonals': "
            f"**{_met(dd[0] < static[0])}** ({dd[0]:.3f} against {static[0]:.3f})."
        )
    for model in suites(config):
        top = max((float(x) for x in config.models[model].sparsities), default=None)
        lm = is_language_model(config.models[model])
        table = ppl_stats if lm else stats
        dd, static = (
            table.get((model, "dynadiag", top)),
            table.get((model, "static_diagonals", top)),
        )
        if top is None or not (dd and static):
            continue
        ok = dd[0] <= static[0] if lm else dd[0] >= static[0]
        shown = (
            f"{dd[0]:.3f} against {static[0]:.3f}"
            if lm
            else f"{100 * dd[0]:.2f}% against {100 * static[0]:.2f}%"
        )
        out.append(
            f"- {model} at {100 * top:g}%: learned selection at least as good as static: "
            f"**{_met(ok)}** ({shown})."
        )
    for model in suites(config):
        campaign = _phase_costs(records, model, sparsity)
        clean = {
            method: {**r, "model": model, "method": method, "sparsity": sparsity}
            for method, r in clean_runs.get(model, {}).items()
        }
        measured = _phase_costs(list(clean.values()), model, sparsity) if clean else campaign
        allocators = {r.get("allocator") for r in clean.values()}
        repeats = min((int(r.get("repeats", 1)) for r in clean.values()), default=1)
        source = (
            (
                "logged means of one run that compiled its programs before its second step"
                if repeats == 1
                else f"the fastest of {repeats} runs for each phase's logged mean, every "
                "program compiled before the second step"
            )
            + (", jemalloc preloaded" if allocators == {"jemalloc"} else "")
            if clean
            else "logged means"
        )
        search, frozen, static = measured
        beside = _mean_of(records, "beside_compile", model, "dynadiag", sparsity)
        also = ""
        if clean and campaign[0] and campaign[1]:
            also = f"; the campaign's runs {campaign[0] / campaign[1]:.2f}x"
            if beside is not None:
                also += f", {100 * beside:.0f}% of their intervals beside a background compile"
        if search and frozen:
            out.append(
                f"- {model}: search step at most 1.3x the frozen step: "
                f"**{_met(search <= 1.3 * frozen)}** ({search / frozen:.2f}x, {source}{also})."
            )
        elif frozen:
            out.append(
                f"- {model}: search step at most 1.3x the frozen step: not measured (the search "
                "phase ended before its first logged interval, every 50 steps)."
            )
        if frozen and static:
            also = ""
            if clean and campaign[1] and campaign[2]:
                also = f"; the campaign's runs {campaign[1] / campaign[2]:.2f}x"
            out.append(
                f"- {model}: logged step after the freeze within 10% of static diagonals': "
                f"**{_met(frozen <= 1.1 * static)}** ({frozen / static:.2f}x{also})."
            )
    whole = uninterrupted(records)
    for model, limit in (("mlp", 0.6), ("gpt", 1.0)):
        wall = _mean_of(whole, "seconds", model, "dynadiag", sparsity)
        dense = _mean_of(whole, "seconds", model, "dense", 0.0)
        if wall and dense:
            logged = _whole_run_ratio(records, model, "dynadiag", sparsity)
            logged_text = f"; logged steps {logged:.2f}x" if logged is not None else ""
            # Static diagonals run the frozen product from the first step with no search: their
            # whole run is the floor any search can reach, so the reader sees what is left.
            static_wall = _mean_of(whole, "seconds", model, "static_diagonals", sparsity)
            if static_wall:
                logged_text += f"; static diagonals, no search: {static_wall / dense:.2f}x"
            logged_text += _resumed_note(records, model)
            ok = wall <= limit * dense if limit < 1.0 else wall < dense
            bound = f"at most {limit:g}x" if limit < 1.0 else "below"
            out.append(
                f"- {model}: whole DynaDiag run {bound} "
                f"dense (wall time, compilation included): **{_met(ok)}** "
                f"({wall / dense:.2f}x{logged_text})."
            )
        elif _mean_of(records, "seconds", model, "dynadiag", sparsity) and _mean_of(
            records, "seconds", model, "dense", 0.0
        ):
            out.append(
                f"- {model}: whole DynaDiag run against dense: not measured (no DynaDiag or "
                f"dense run trained in one go{_resumed_note(records, model)})."
            )
    return out


def common_seeds(records, model, method, control, sparsity, metric):
    """``(values of method, values of control)``: ``metric`` of the seeds both have a record for
    at ``sparsity``, in seed order."""
    runs = collections.defaultdict(dict)
    for r in records:
        if r["model"] == model and r["sparsity"] == sparsity and metric in r:
            runs[r["method"]][r["seed"]] = r[metric]
    seeds = sorted(set(runs[method]) & set(runs[control]))
    return [runs[method][s] for s in seeds], [runs[control][s] for s in seeds]


def paired_difference(records, model, method, control, sparsity, metric):
    """Seed by seed ``method - control`` of ``metric`` at ``sparsity``, over the seeds both have
    a record for: ``(mean, std, seeds where method is better, seeds)``, better meaning higher
    (lower for perplexity); None without two such seeds. A suite's runs of one seed see the same
    batches in the same order, so the paired difference leaves that part of the seed spread out."""
    return paired_of(*common_seeds(records, model, method, control, sparsity, metric), metric)


def paired_of(a, b, metric):
    """:func:`paired_difference` of the values ``a`` and ``b`` of the same seeds, in order."""
    if len(a) < 2:
        return None
    diffs = np.asarray(a, np.float64) - np.asarray(b, np.float64)
    better = int(np.sum(diffs < 0 if metric == "perplexity" else diffs > 0))
    return float(diffs.mean()), float(diffs.std(ddof=1)), better, len(diffs)


def _over_control(table, records, where, method, control, metric: str) -> str:
    """``method``'s mean over ``control``'s in ``table`` at ``where = (model, sparsity)``, and
    with ``records`` the seed-by-seed difference."""
    model, sparsity = where
    scale = 1.0 if metric == "perplexity" else 100.0
    gain = table[(model, method, sparsity)][0] - table[(model, control, sparsity)][0]
    text = f"{method_name(method)} {scale * gain:+.2f}"
    paired = paired_difference(records, model, method, control, sparsity, metric)
    if paired is None:
        return text
    mean, std, better, n = paired
    return f"{text} (by seed {scale * mean:+.2f} ± {scale * std:.2f}, better in {better} of {n})"


# Each way of choosing a mask and its fixed control: the search over static diagonals, the
# unstructured methods' updates over their first mask, never updated.
CONTROL_PAIRS = (
    ("dynadiag", "static_diagonals"),
    ("rigl", "static_unstructured"),
    ("set", "static_unstructured"),
    ("mest", "static_unstructured"),
)


def control_lines(config, stats, ppl_stats, sparsity=0.9, records=()) -> list[str]:
    """What each way of choosing a mask adds over its fixed control at ``sparsity``: DynaDiag's
    search over static diagonals, RigL's, SET's and MEST's updates over the static unstructured
    mask (their first mask, never updated); and the two fixed layouts against each other.
    Accuracy points, or perplexity for a language model (lower is better); with ``records``, also
    the seed-by-seed difference (:func:`paired_difference`) and the seeds it is better on."""
    out = []
    for model in suites(config):
        lm = is_language_model(config.models[model])
        table = ppl_stats if lm else stats
        get = lambda method: table.get((model, method, sparsity))  # noqa: B023, E731
        diagonals, unstructured = get("static_diagonals"), get("static_unstructured")
        if diagonals is None or unstructured is None:
            continue
        scale, unit = (1.0, "perplexity") if lm else (100.0, "points")
        metric = _metric(config, model)
        gains = [
            _over_control(table, records, (model, sparsity), method, control, metric)
            for method, control in CONTROL_PAIRS
            if get(method) is not None
        ]
        layout = scale * (diagonals[0] - unstructured[0])
        out.append(
            f"- {model}: over the fixed control ({unit}; DynaDiag against static diagonals, the "
            f"others against the static unstructured mask): {', '.join(gains)}. Static diagonals "
            f"against the static unstructured mask: {layout:+.2f}."
        )
    return out


def block_goals(config, stats, ppl_stats, sparsity=0.9) -> list[str]:
    """Block against element diagonals at ``sparsity``: within 0.5 points of accuracy
    (classification, at b = 16 and at the ViT's block size) or 2% of
    perplexity (language model)."""
    out = []
    for model in suites(config):
        m = config.models[model]
        lm = is_language_model(m)
        table = ppl_stats if lm else stats
        element = table.get((model, "dynadiag", sparsity))
        for method in m.goal_methods:
            base, block = parse_method(method)
            ours = table.get((model, method, sparsity))
            if (
                base != "dynadiag"
                or method_permutation(method)
                or method_rank(method)
                or ours is None
                or element is None
            ):
                continue
            if lm:
                ratio = ours[0] / element[0] - 1
                out.append(
                    f"- {model}: blocks {block}x{block} within 2% of element diagonals' "
                    f"perplexity: **{_met(ratio <= 0.02)}** ({ours[0]:.3f} against "
                    f"{element[0]:.3f}, {100 * ratio:+.2f}%)."
                )
            elif block == 16 or model == "vit":
                gap = 100 * (ours[0] - element[0])
                out.append(
                    f"- {model}: blocks {block}x{block} within 0.5 points of element diagonals: "
                    f"**{_met(gap >= -0.5)}** ({_acc(ours)} against {_acc(element)}, "
                    f"{gap:+.2f} points)."
                )
    return out


def lora_goals(config, stats, ppl_stats, sparsity=0.9) -> list[str]:
    """DynaDiag + LoRA-FA at ``sparsity`` (each rank the suite trains, adapters counted in its
    density): at least max(RigL, SET) (classification), a perplexity below both (language
    model)."""
    out = []
    for model in suites(config):
        m = config.models[model]
        lm = is_language_model(m)
        table = ppl_stats if lm else stats
        rigl, set_ = table.get((model, "rigl", sparsity)), table.get((model, "set", sparsity))
        for method in _methods(m):
            ours = table.get((model, method, sparsity))
            if not (method_rank(method) and ours and rigl and set_):
                continue
            if lm:
                best = min(rigl[0], set_[0])
                out.append(
                    f"- {model}: {method_name(method)} perplexity below RigL's and SET's: "
                    f"**{_met(ours[0] < best)}** ({ours[0]:.3f} against {best:.3f})."
                )
            else:
                best = max(rigl[0], set_[0])
                out.append(
                    f"- {model}: {method_name(method)} at least max(RigL, SET): "
                    f"**{_met(ours[0] >= best)}** ({_acc(ours)} against {100 * best:.2f}%)."
                )
    return out


def permutation_goals(config, stats, ppl_stats, sparsity=0.9) -> list[str]:
    """Input permutations at ``sparsity``: element diagonals + learned permutation at least
    max(RigL, SET) (classification); blocks of 16 + learned permutation within 2% of element
    diagonals' perplexity (language model); the learned permutation better than the random one
    by more than the seed spread (the larger standard deviation) at some sparsity: ``sparsity``,
    or another where both have two seeds or more."""
    out = []
    for model in suites(config):
        m = config.models[model]
        lm = is_language_model(m)
        table = ppl_stats if lm else stats
        get = lambda method: table.get((model, method, sparsity))  # noqa: B023, E731
        if lm:
            ours, element = get("dynadiag_b16_learned_perm"), get("dynadiag")
            if ours and element:
                ratio = ours[0] / element[0] - 1
                out.append(
                    f"- {model}: blocks 16x16 + learned permutation within 2% of element "
                    f"diagonals' perplexity: **{_met(ratio <= 0.02)}** ({ours[0]:.3f} against "
                    f"{element[0]:.3f}, {100 * ratio:+.2f}%)."
                )
        else:
            ours, rigl, set_ = get("dynadiag_learned_perm"), get("rigl"), get("set")
            if ours and rigl and set_:
                best = max(rigl[0], set_[0])
                out.append(
                    f"- {model}: DynaDiag + learned permutation at least max(RigL, SET): "
                    f"**{_met(ours[0] >= best)}** ({_acc(ours)} against {100 * best:.2f}%)."
                )
        scale, unit = (1.0, "") if lm else (100.0, " points")
        # `sparsity` first, then the others where both rows have a spread (two seeds or more)
        others = [x for x in _sparsities(m) if x != sparsity]
        for base in ("dynadiag", "dynadiag_b16"):
            met, parts = False, []
            for at in (sparsity, *others):
                learned = table.get((model, f"{base}_learned_perm", at))
                random = table.get((model, f"{base}_random_perm", at))
                if not (learned and random) or (at != sparsity and min(learned[2], random[2]) < 2):
                    continue
                gain = (random[0] - learned[0]) if lm else (learned[0] - random[0])
                spread = max(learned[1], random[1])
                met = met or gain > spread
                parts.append(
                    f"{100 * at:g}%: {scale * learned[0]:.3f} against {scale * random[0]:.3f}, "
                    f"spread {scale * spread:.3f}{unit}"
                )
            if parts:
                out.append(
                    f"- {model}: {method_name(base)} with a learned permutation better than with "
                    f"a random one by more than the seed spread somewhere: **{_met(met)}** "
                    f"({'; '.join(parts)})."
                )
    return out


def permutation_moves(config, records) -> list[str]:
    """Per suite, how far the learned permutations moved from their random start: the share of
    rows whose frozen ``perm`` differs from the start's (records' ``perm_rows_moved``), mean over
    layers and runs (every sparsity and seed) and the largest layer's."""
    out = []
    for model in suites(config):
        parts = []
        for base in ("dynadiag", "dynadiag_b16"):
            moved = [
                list(r["perm_rows_moved"].values())
                for r in records
                if r["model"] == model
                and r["method"] == f"{base}_learned_perm"
                and r.get("perm_rows_moved")
            ]
            if moved:
                mean = np.mean([np.mean(m) for m in moved])
                most = max(max(m) for m in moved)
                parts.append(
                    f"{method_name(base)} {100 * mean:.1f}% (largest layer {100 * most:.1f}%, "
                    f"{len(moved)} runs)"
                )
        if parts:
            out.append(
                f"- {model}: rows the learned permutation moved from its random start: "
                f"{'; '.join(parts)}."
            )
    return out


def block_table(config, records, stats, ppl_stats, timings, sparsity=0.9) -> list[str]:
    """Element and block DynaDiag, with and without an input permutation, side by side at
    ``sparsity``: quality, density, speed."""
    lines = [
        "| suite | method | accuracy (%) or perplexity | density | training step ×dense "
        "(frozen layers) | inference ×dense (largest batch) |",
        "|---|---|---|---|---|---|",
    ]
    trained = {r["model"] for r in records}  # a one-suite report has no rows of the others
    for model in suites(config):
        m = config.models[model]
        blocks = [
            x for x in m.goal_methods if parse_method(x)[0] == "dynadiag" and not method_rank(x)
        ]
        if not blocks or model not in trained:
            continue
        lm = is_language_model(m)
        dens = _densities(records, model)
        group = timings["models"].get(model, {}).get(f"{sparsity:g}", {})
        for method in ("dynadiag", *blocks):
            key = (model, method, sparsity)
            if lm:
                quality = _fmt(ppl_stats[key], 1.0, 3) if key in ppl_stats else "n/a"
            else:
                quality = _fmt(stats[key]) if key in stats else "n/a"
            d = dens.get((method, sparsity))
            block = parse_method(method)[1]
            suffix = "_perm" if method_permutation(method) else ""
            variant = group.get(("diagonal" if block == 1 else f"diagonal_b{block}") + suffix)
            dense = group.get("dense")
            train = infer = "n/a"
            if variant and dense:
                train = f"{variant['train'] / dense['train']:.2f}×"
                infer_kind = max(
                    (k for k in dense if k.startswith("infer_b")), key=lambda k: int(k[7:])
                )
                infer = f"{variant[infer_kind] / dense[infer_kind]:.2f}×"
            lines.append(
                f"| {model} | {method_name(method)} | {quality} | "
                f"{f'{100 * np.mean(d):.2f}%' if d else 'n/a'} | {train} | {infer} |"
            )
    return lines


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_quality(config, stats, ppl_stats, models, path):
    """Accuracy (classification) or perplexity (language model) against sparsity, per suite."""
    plt = _pyplot()
    # one colour per method in every panel, and one legend under them all (per-panel legends
    # covered the curves once the suites had a dozen methods)
    methods = list(dict.fromkeys(x for model in models for x in _methods(config.models[model])))
    colors = {x: plt.cm.tab20(i % 20) for i, x in enumerate(x for x in methods if x != "dense")}
    ncol = min(5, 2 * len(models))  # a one-suite figure (5.5 in) is too narrow for 5 labels
    rows = -(-len(methods) // ncol)
    height = 4 + 0.22 * rows
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), height), squeeze=False)
    for ax, model in zip(axes[0], models):
        m = config.models[model]
        lm = is_language_model(m)
        table, scale = (ppl_stats, 1.0) if lm else (stats, 100.0)
        for method in _methods(m):
            if method == "dense":
                if (model, "dense", 0.0) in table:
                    mean, std, _ = table[(model, "dense", 0.0)]
                    ax.axhline(scale * mean, color="k", ls="--", label="Dense")
                    ax.axhspan(scale * (mean - std), scale * (mean + std), color="k", alpha=0.1)
                continue
            xs = [s for s in _sparsities(m) if (model, method, s) in table]
            if xs:
                ax.errorbar(
                    [100 * x for x in xs],
                    [scale * table[(model, method, s)][0] for s in xs],
                    yerr=[scale * table[(model, method, s)][1] for s in xs],
                    marker="o" if parse_method(method)[1] == 1 else "s",
                    capsize=3,
                    color=colors[method],
                    label=method_name(method),
                )
        ax.set(
            title=SUITE_TITLES.get(model, model),
            xlabel="sparsity of the sparse layers (%)",
            ylabel="validation perplexity per byte" if lm else "test accuracy (%)",
        )
        ax.grid(alpha=0.3)
    legend = {}
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=ncol, fontsize=8)
    fig.tight_layout(rect=(0, 0.22 * rows / height + 0.02, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


CURVES = {
    # record key -> (y label, methods drawn: None for every method of the suite)
    "curve": ("validation bits per byte", None),
    "loss_curve": ("training loss (mean of each logging interval)", CURVE_METHODS),
}


def dynadiag_freeze(config, records, model: str, sparsity: float) -> int | None:
    """The freeze step of ``model``'s DynaDiag runs at ``sparsity`` (None without one): of their
    own steps, whatever longer runs (a LoRA-FA phase after them) a plot draws beside them."""
    steps = {
        int(r["steps"]) - int(r.get("lora_steps", 0))
        for r in records
        if r["model"] == model and r["method"] == "dynadiag" and r["sparsity"] == sparsity
    }
    if not steps:
        return None
    fraction = float(config.models[model].dynadiag.search_fraction)
    return dd.schedules.freeze_step(max(steps), search_fraction=fraction)


def plot_curves(config, records, model, sparsity, path, key: str = "curve") -> bool:
    """``records``' per-step ``key`` curves (:data:`CURVES`) against the step for the methods of
    ``model`` at ``sparsity`` (mean over seeds; dense drawn dashed, the DynaDiag freeze dotted);
    ``False`` when there is nothing to draw."""
    ylabel, wanted = CURVES[key]
    curves = collections.defaultdict(list)
    for r in records:
        if r["model"] == model and r.get(key) and r["sparsity"] in (0.0, sparsity):
            curves[r["method"]].append(dict(map(tuple, r[key])))
    m = config.models[model]
    methods = [x for x in _methods(m) if x in curves and (wanted is None or x in wanted)]
    if not methods:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colours = plt.get_cmap("tab10").colors
    others = [x for x in methods if x != "dense"]
    for method in methods:
        steps = sorted(set.intersection(*(set(c) for c in curves[method])))
        if method == "dense":
            style = {"ls": "--", "color": "k"}
        else:  # ten colours, then the same ten dash-dotted: fifteen methods need distinct lines
            row, column = divmod(others.index(method), len(colours))
            style = {"ls": ("-", "-.", ":")[row % 3], "color": colours[column]}
        ax.plot(
            steps,
            [np.mean([c[s] for c in curves[method]]) for s in steps],
            marker=".",
            label=f"{method_name(method)} ({len(curves[method])} seeds)",
            **style,
        )
    freeze = dynadiag_freeze(config, records, model, sparsity)
    if freeze is not None:
        ax.axvline(freeze, color="grey", lw=0.8, ls=":", label="DynaDiag freeze")
    ax.set(
        title=f"{SUITE_TITLES.get(model, model)}, {100 * sparsity:g}% sparse",
        xlabel="training step",
        ylabel=ylabel,
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def speed_label(variant: str) -> str:
    """:func:`variant_name` without its parenthesis (", input permutation" kept: the plain and
    the permuted variant had one label)."""
    return re.sub(r" \([^)]*\)", "", variant_name(variant))


def plot_speed(timings, models, path):
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        groups = timings["models"].get(model, {})
        xs = sorted(groups, key=float)
        ax.axhline(1.0, color="k", ls="--", label="Dense")
        variants = sorted({v for g in groups.values() for v in g} - {"dense"})
        for variant in variants:
            pts = [
                (100 * float(s), groups[s][variant]["train"] / groups[s]["dense"]["train"])
                for s in xs
                if variant in groups[s]
            ]
            if pts:
                ax.plot(*zip(*pts), marker="o", label=speed_label(variant))
        ax.set(
            title=f"training step, {model}",
            xlabel="sparsity (%)",
            ylabel="time per step / dense time per step (medians)",
        )
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _suite_section(config, model, records, stats, ppl_stats, bpb_stats) -> list[str]:
    m = config.models[model]
    methods, sparsities = _methods(m), _sparsities(m)
    by_steps = is_language_model(m) or int(m.get("steps", 0)) > 0
    length = f"{m.steps} steps" if by_steps else f"{m.epochs} epochs"
    goal = float(config.goal_sparsity)
    if goal in sparsities:  # as run_plan trains them
        seeds = f"{m.seeds} seeds at {100 * goal:g}% and for dense"
        if m.sweep_seeds != m.seeds and len(sparsities) > 1:
            seeds += f", {m.sweep_seeds} at the other sparsities"
    else:
        seeds = f"{m.sweep_seeds} seeds"
    diverged = diverged_runs(r for r in records if r["model"] == model)
    out = [
        f"### {model}: {SUITE_TITLES.get(model, model)}",
        "",
        f"`{dict(m.model)}`, {length}, batch {m.batch_size}; {seeds}. Sparse layers: "
        f"`{', '.join(m.dynadiag.layers)}`.",
        "",
    ]
    if is_language_model(m):
        out += [
            f"Validation perplexity per byte (sequences of {m.seq_len} bytes, "
            f"{m.eval_windows} windows), mean ± standard deviation over seeds (number of seeds):",
            "",
            *metric_table(
                ppl_stats, model, methods, sparsities, scale=1.0, digits=3, diverged=diverged
            ),
            "",
            "Validation bits per byte:",
            "",
            *metric_table(
                bpb_stats, model, methods, sparsities, scale=1.0, digits=4, diverged=diverged
            ),
        ]
    else:
        out += [
            "Final test accuracy (%), mean ± standard deviation over seeds (number of seeds):",
            "",
            *metric_table(stats, model, methods, sparsities, diverged=diverged),
        ]
    if diverged:
        out += [
            "",
            f"{_runs(sum(diverged.values()))} diverged (a final evaluation loss that is not "
            "finite): their metric counts in the mean like any seed's.",
        ]
    return out + [
        "",
        "Achieved density of the sparse layers (non-zero weights / dense weights):",
        "",
        *density_table(records, model, methods, sparsities),
        "",
    ]


def write(docs, config, records, timings, *, data_name: str) -> pathlib.Path:
    """Write ``RESULTS.md`` and its plots (:data:`PLOTS`) under ``docs`` for every suite of
    ``config`` that has records."""
    docs = pathlib.Path(docs)
    docs.mkdir(parents=True, exist_ok=True)
    models = [x for x in suites(config) if any(r["model"] == x for r in records)]
    goal = float(config.goal_sparsity)
    stats = metric_stats(records, "accuracy")
    ppl_stats = metric_stats(records, "perplexity")
    bpb_stats = metric_stats(records, "bits_per_byte")
    plot_quality(config, stats, ppl_stats, models or suites(config), docs / PLOTS["quality"])
    plot_speed(timings, models or suites(config), docs / PLOTS["speed"])
    lms = [x for x in models if is_language_model(config.models[x])]
    curves = bool(lms) and plot_curves(config, records, lms[0], goal, docs / PLOTS["curves"])
    loss_curves = "vit" in models and plot_curves(
        config, records, "vit", goal, docs / PLOTS["loss_curves"], key="loss_curve"
    )
    mach = timings["machine"]
    path = docs / "RESULTS.md"
    notes = (
        NOTES.search(path.read_text()).group(0)
        if path.exists() and NOTES.search(path.read_text())
        else EMPTY_NOTES
    )
    per_suite = ", ".join(
        f"{x} {sum(r['seconds'] for r in records if r['model'] == x) / 60:.1f} min" for x in models
    )
    goal_lines = [
        ("The MLP against the baselines and dense", mlp_goals(stats, timings, records, goal)),
        (
            "The ViT and the GPT against RigL and SET",
            vit_goals(stats, goal) + gpt_goals(ppl_stats, goal),
        ),
        (
            "The search: learned against static diagonals, and its cost",
            search_goals(config, stats, ppl_stats, records, goal, timings.get("clean_runs")),
        ),
        (
            "Each selection against its fixed control (not a goal: what the search and the "
            "mask updates add over a fixed random layout)",
            control_lines(config, stats, ppl_stats, goal, records),
        ),
        (
            "Block against element diagonals",
            block_goals(config, stats, ppl_stats, goal),
        ),
        (
            "Input permutations",
            permutation_goals(config, stats, ppl_stats, goal) + permutation_moves(config, records),
        ),
        ("LoRA-FA", lora_goals(config, stats, ppl_stats, goal)),
    ]
    out = [
        "# Results: DynaDiag and the sparse-training baselines",
        "",
        f"Written by `python train/results.py` on {datetime.date.today().isoformat()} "
        f"(data: {data_name}). "
        f"Training took {sum(r['seconds'] for r in records) / 60:.1f} min over {len(records)} "
        f"runs ({per_suite}), the timings {timings.get('seconds', 0.0) / 60:.1f} min; the last "
        f"command that trained or timed ran {timings.get('invocation_seconds', 0.0) / 60:.1f} min.",
        "",
        "## Machine",
        "",
        f"- CPU: {mach['cpu']}, {mach['cores_visible']} cores visible; "
        "load average at the start of the timings: "
        f"{', '.join(f'{x:.1f}' for x in mach['load_average_at_start'])}",
        f"- {mach['platform']}, Python {mach['python']}, JAX {mach['jax']}, "
        f"devices {', '.join(mach['devices'])}",
        f"- diagonal products ran through: {mach['diag_impl']}",
        "",
        f"## Goals at {100 * goal:g}% sparsity",
        "",
    ]
    for title, lines in goal_lines:
        out += [f"**{title}**", "", *(lines or ["- not evaluated: not part of this run."]), ""]
    out += [
        notes,
        "",
        "## Accuracy and perplexity",
        "",
        "Every method trains the same layers at the same sparsity with the same recipe; dense has "
        "no sparsity (its row repeats one value). Block methods (`blocks bxb`) and LoRA-FA run at "
        "the goal sparsity only; the methods with an input permutation, blocks of 16 included, at "
        "every sparsity (a block layer keeps at least one block diagonal: read its density).",
        "",
    ]
    for model in models:
        out += _suite_section(config, model, records, stats, ppl_stats, bpb_stats)
    out += [f"![quality vs sparsity]({PLOTS['quality']})", ""]
    if curves:
        out += [
            f"Validation bits per byte during training, {100 * goal:g}% sparse (mean over seeds):",
            "",
            f"![validation bits per byte vs step]({PLOTS['curves']})",
            "",
        ]
    if loss_curves:
        out += [
            f"Training loss of the ViT, {100 * goal:g}% sparse (mean over seeds): where a gap "
            "between the learned and the static selection opens, and between SET and its fixed "
            "first mask.",
            "",
            f"![ViT training loss vs step]({PLOTS['loss_curves']})",
            "",
        ]
    out += [
        f"## Block against element diagonals, {100 * goal:g}% sparse",
        "",
        "DynaDiag with block diagonals beside element diagonals, and either with an input "
        "permutation; density is what the block "
        "budget reaches (it moves in steps of b / min(in, out) per layer); speed is the frozen "
        "layers' side-by-side timing below.",
        "",
        *block_table(config, records, stats, ppl_stats, timings, goal),
        "",
        "## Speed",
        "",
        f"Median over {timings['repeats']} round-robin repeats of each jitted function on one "
        "fixed batch (each suite's training batch); ratios compare with dense timed in the same "
        "rounds. DynaDiag after its freeze and the static-diagonal baseline run the same diagonal "
        "product (block rows: the block product); RigL, SET and MEST train masked dense layers "
        "(their step includes the optimizer wrapper), and the BCOO rows show what storing the "
        "unstructured weights in `jax.experimental.sparse` costs instead. "
        "`python train/results.py --timing_only` measures these tables again (no training).",
        "",
    ]
    for model in models:
        out += [
            f"### {model}",
            "",
            *speed_table(timings, model),
            "",
            "Whole runs, wall time (mean per run; ratio to dense), compilation, DynaDiag's search "
            "phase, mask updates and evaluations included:",
            "",
            *whole_run_table(
                records,
                model,
                _methods(config.models[model]),
                _sparsities(config.models[model]),
                int(timings["machine"]["cores_visible"]),
            ),
            "",
            "Mean logged step time over whole training runs relative to the dense runs (includes "
            "DynaDiag's search phase and the mask updates; taken at different times, so noisier):",
            "",
            *in_run_table(
                records, model, _methods(config.models[model]), _sparsities(config.models[model])
            ),
            "",
        ]
    out += [f"![time per step vs sparsity]({PLOTS['speed']})", ""]
    path.write_text("\n".join(out))
    return path
