"""Which exploration mechanism finds planted diagonals best for its cost (docs/selection.md).

A teacher layer with K planted diagonals (random distinct offsets, values of magnitude 0.5..1 with
random signs, over sqrt(K b)) generates y = teacher(x) for fresh Gaussian x each step; element
problems (b = 1) and block problems (block diagonals of b x b blocks, b = 8). A student
DiagonalDense with the same K and b trains on the MSE for the search phase (Adam; alpha has its
own learning rate), with the sparse gate's strength annealed; then it is frozen. Reported per
mechanism (mean over seeds):

* recovered: fraction of planted offsets among the student's top-K alpha at the freeze;
* worst: the lowest recovered fraction over the seeds;
* rel_err: ||frozen student(x) - teacher(x)|| / ||teacher(x)|| on held-out x (no fine-tuning);
* computed: mean number of diagonals in the forward product per step (K_cap = ceil(1.25 K));
* cost: diagonal-products of forward + dx + dvalues per step as a fraction of computing all P
  (block layers: P_b) diagonals in the three products (a dense-equivalent step is 1.0);
* time: wall time of the search phase relative to "none (narrow)" on the same problem (median of
  --repeats runs after compilation; a ratio measured in the same process, noisy on shared CPUs).

Usage:
  python bench/exploration.py [--steps 300] [--seeds 3] [--repeats 3] [--problems all|element|block]
                              [--out DIR or FILE.csv]
Writes DIR/exploration.csv (exploration_<problems>.csv with --problems; default DIR
bench/results/), or FILE.csv when --out ends in .csv, and prints a table.
"""

from __future__ import annotations

import csv
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from bench_cli import RESULTS, count, make_parser  # bench/, beside this
from tqdm import tqdm

import dynadiag_jax as dd

# (in, out, K, block size): element problems, then block problems with P_b = 32, 16, 16.
PROBLEMS = {
    "element": [(128, 128, 8, 1), (256, 64, 6, 1), (64, 256, 8, 1)],
    "block": [(256, 256, 4, 8), (512, 128, 2, 8), (128, 512, 2, 8)],
}
STRENGTH_START, STRENGTH_END = 1.0, 1e-3
NARROW_STRENGTH = 1e-3
LR, ALPHA_LR, BATCH = 1e-2, 1e-2, 64

# name -> (DiagonalDense explore mode, strength schedule, dense-score period or None)
MECHANISMS = {
    "none (narrow)": ("none", "narrow", None),
    "none (wide start)": ("none", "exponential", None),
    "dense_score every 10": ("dense_score", "exponential", 10),
    "dense_score every 3": ("dense_score", "exponential", 3),
    "buckets (exp. schedule)": ("buckets", "exponential", None),
    "buckets (cosine schedule)": ("buckets", "cosine", None),
}


def make_teacher(key, n_in: int, n_out: int, k: int, b: int):
    """A frozen DiagonalDense with K random offsets and values of magnitude 0.5..1 / sqrt(K b)
    (every output sees K b inputs)."""
    teacher = dd.nn.DiagonalDense(
        n_out, k=k, block_size=b, init_phase="frozen", use_bias=False, impl="jax"
    )
    k_init, k_mag, k_sign = jax.random.split(key, 3)
    variables = teacher.init(k_init, jnp.zeros((1, n_in)))
    shape = variables["params"]["values"].shape
    mag = jax.random.uniform(k_mag, shape, minval=0.5, maxval=1.0)
    sign = jnp.where(jax.random.bernoulli(k_sign, 0.5, shape), 1.0, -1.0)
    variables = {
        "params": {"values": mag * sign / np.sqrt(k * b)},
        "diagonals": variables["diagonals"],
    }
    return teacher, variables


def strength_schedule(kind: str, steps: int):
    if kind == "narrow":
        return dd.schedules.constant(NARROW_STRENGTH)
    return dd.schedules.by_name(
        kind, init_value=STRENGTH_START, end_value=STRENGTH_END, steps=steps
    )


def run_one(mechanism: str, problem, seed: int, steps: int, repeats: int) -> dict:
    explore, schedule_kind, every = MECHANISMS[mechanism]
    n_in, n_out, k, b = problem
    k_teacher, k_student, k_data, k_test = jax.random.split(jax.random.key(seed), 4)
    teacher, t_vars = make_teacher(k_teacher, n_in, n_out, k, b)
    planted = set(np.asarray(t_vars["diagonals"]["offsets"]).tolist())
    student = dd.nn.DiagonalDense(
        n_out, k=k, block_size=b, explore=explore, use_bias=False, impl="jax"
    )
    s_vars = student.init(k_student, jnp.zeros((1, n_in)))
    tx = dd.optim.diag_optimizer(LR, alpha_learning_rate=ALPHA_LR)
    schedule = strength_schedule(schedule_kind, steps)

    def loss_fn(params, dyn, x):
        y, state = student.apply({"params": params, "dynadiag": dyn}, x, mutable=["intermediates"])
        loss = jnp.mean((y - teacher.apply(t_vars, x)) ** 2)
        return loss, state["intermediates"]["computed_diagonals"][0]

    def step(carry, i):
        params, opt_state, dyn = carry
        score = (i % every == 0) if every else False
        dyn = dd.nn.set_gate({"dynadiag": dyn}, strength=schedule(i), score=score)["dynadiag"]
        x = jax.random.normal(jax.random.fold_in(k_data, i), (BATCH, n_in))
        (_, computed), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, dyn, x)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, dyn), computed

    search = jax.jit(lambda carry: jax.lax.scan(step, carry, jnp.arange(steps)))
    carry0 = (s_vars["params"], tx.init(s_vars["params"]), s_vars["dynadiag"])
    jax.block_until_ready(search(carry0))  # compile
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        (params, _, dyn), computed = jax.block_until_ready(search(carry0))
        times.append(time.perf_counter() - start)

    found = set(np.asarray(dd.select_diagonals(params["alpha"], k)).tolist())
    frozen = dd.freeze_tree({"params": params, "dynadiag": dyn, "diagonals": s_vars["diagonals"]})
    x_test = jax.random.normal(k_test, (1024, n_in))
    y_t, y_s = teacher.apply(t_vars, x_test), student.apply(frozen, x_test)
    spec = student.spec(n_in)
    p, k_cap = spec.num_candidates, spec.k_cap
    computed = np.asarray(computed, np.float64)
    if explore == "dense_score":
        n_scored = len(range(0, steps, every))
        products = 3 * k_cap * steps + (p - k_cap) * n_scored
    else:
        products = 3 * computed.sum()
    return {
        "recovered": len(found & planted) / k,
        "rel_err": float(jnp.linalg.norm(y_s - y_t) / jnp.linalg.norm(y_t)),
        "computed": float(computed.mean()),
        "cost": products / (3 * p * steps),
        "seconds": statistics.median(times),
    }


def main(argv=None):
    parser = make_parser(__doc__)
    parser.add_argument("--steps", type=count("steps"), default=300, help="search steps per run")
    parser.add_argument("--seeds", type=count("seeds"), default=3, help="runs per problem")
    parser.add_argument(
        "--repeats", type=count("repeats"), default=3, help="timed search phases per run (median)"
    )
    parser.add_argument("--problems", choices=("all", *PROBLEMS), default="all")
    parser.add_argument(
        "--out",
        type=Path,
        default=RESULTS,
        help="a directory for exploration[_<problems>].csv, or a path ending in .csv",
    )
    args = parser.parse_args(argv)
    if args.out.suffix.lower() == ".csv":
        path = args.out
    elif args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file: give a directory or a path ending in .csv")
    else:
        path = args.out / (
            "exploration.csv" if args.problems == "all" else f"exploration_{args.problems}.csv"
        )
    if path.is_dir():
        parser.error(f"--out {args.out}: {path} is a directory")

    problems = [p for kind, ps in PROBLEMS.items() if args.problems in ("all", kind) for p in ps]
    jobs = [(m, p, s) for p in problems for m in MECHANISMS for s in range(args.seeds)]
    results = {}
    for mechanism, problem, seed in tqdm(jobs, desc="exploration"):
        results[mechanism, problem, seed] = run_one(
            mechanism, problem, seed, args.steps, args.repeats
        )

    rows = []
    for problem in problems:
        base = statistics.mean(
            results["none (narrow)", problem, s]["seconds"] for s in range(args.seeds)
        )
        for mechanism in MECHANISMS:
            runs = [results[mechanism, problem, s] for s in range(args.seeds)]
            rows.append(
                {
                    "problem": "{}x{} K={}".format(*problem)
                    + (f" b={problem[3]}" if problem[3] > 1 else ""),
                    "mechanism": mechanism,
                    "recovered": statistics.mean(r["recovered"] for r in runs),
                    "worst": min(r["recovered"] for r in runs),
                    "rel_err": statistics.mean(r["rel_err"] for r in runs),
                    "computed": statistics.mean(r["computed"] for r in runs),
                    "cost": statistics.mean(r["cost"] for r in runs),
                    "time": statistics.mean(r["seconds"] for r in runs) / base,
                }
            )

    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    header = (
        "| problem (in x out, K, block) | mechanism | recovered | worst | rel_err | computed "
        "| cost | time |"
    )
    print(f"\n{args.steps} search steps, {args.seeds} seeds, jax impl on {jax.default_backend()}\n")
    print(header)
    print("|" + "---|" * 8)
    for r in rows:
        print(
            f"| {r['problem']} | {r['mechanism']} | {r['recovered']:.2f} | {r['worst']:.2f} | "
            f"{r['rel_err']:.3f} | {r['computed']:.1f} | {r['cost']:.3f} | {r['time']:.2f} |"
        )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
