"""Initialisation and compile time of ViT models: DynaDiag against dense (docs/compile_time.md).

For each ViT variant, a fresh Python process per method (dense; DynaDiag on the attention and MLP
layers at ``--sparsity``) and repeat measures, in this order:

* init eager: ``model.init(key, images)`` called op by op, as a user calls it, first in the process;
* init jit: ``jax.jit(model.init)`` traced, compiled and run;
* search step: lowering and XLA compile of the library's train step
  (``dd.training.make_train_step`` with AdamW and a strength schedule) on the search-phase state;
* frozen step: the same after ``dd.training.freeze_state`` (the compact frozen form).

A dense model has no search phase: its one step is both rows' baseline. Times are the median over
``--repeats`` processes of wall-clock seconds (``cpu`` in the CSV: the process's CPU seconds over
all its threads, steadier on a loaded machine); ``ratio`` is DynaDiag over dense.

Usage:
  python bench/compile.py [--variants S/16,B/16] [--batch 8] [--image 32] [--sparsity 0.9]
                          [--explore buckets] [--num-buckets 4] [--gate sparse_topk]
                          [--repeats 1] [--out bench/results/compile_<time>.csv]

``--explore``, ``--num-buckets`` and ``--gate`` set the DynaDiag layers' exploration and gate, to
see what each part of the search phase costs to compile (docs/compile_time.md).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from bench_cli import (  # bench/, beside this
    count,
    make_parser,
    out_file,
    results_path,
    sparsity,
    write_csv,
)

MEASURES = (
    ("init_eager", "init eager"),
    ("init_jit", "init jit"),
    ("search_lower", "search step: lower"),
    ("search_compile", "search step: compile"),
    ("search_total", "search step: total"),
    ("frozen_lower", "frozen step: lower"),
    ("frozen_compile", "frozen step: compile"),
    ("frozen_total", "frozen step: total"),
)
METHODS = ("dense", "dynadiag")


class _Clock:
    """Wall and CPU seconds (all threads) since the last :meth:`lap`."""

    def __init__(self):
        self.lap()

    @staticmethod
    def _cpu():
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime

    def lap(self):
        now = (time.perf_counter(), self._cpu())
        last = getattr(self, "_last", now)
        self._last = now
        return now[0] - last[0], now[1] - last[1]


def _model(variant: str, method: str, args):
    import functools  # noqa: PLC0415 - the child imports JAX only after its arguments are read

    import dynadiag_jax as dd  # noqa: PLC0415
    from dynadiag_jax.models import ByPath  # noqa: PLC0415
    from dynadiag_jax.models.vit import SPARSE_LAYERS, ViT  # noqa: PLC0415

    if method == "dense":
        return ViT(num_classes=10, variant=variant)
    sparse = functools.partial(
        dd.nn.DiagonalDense,
        sparsity=args.sparsity,
        explore=args.explore,
        num_buckets=args.num_buckets,
        gate=args.gate,
    )
    return ViT(num_classes=10, variant=variant, dense=ByPath(SPARSE_LAYERS, sparse=sparse))


def _lower_compile(step, state, batch, clock, times, phase):
    clock.lap()
    lowered = step.lower(state, batch)
    times[f"{phase}_lower"] = clock.lap()
    lowered.compile()
    times[f"{phase}_compile"] = clock.lap()
    times[f"{phase}_total"] = tuple(
        a + b for a, b in zip(*(times[f"{phase}_{p}"] for p in ("lower", "compile")))
    )


def measure(variant: str, method: str, args) -> dict:
    """``{measure: (wall s, cpu s)}`` for one model, in this (fresh) process."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    import dynadiag_jax as dd  # noqa: PLC0415

    training = dd.training
    model = _model(variant, method, args)
    images = jnp.ones((args.batch, args.image, args.image, 3), jnp.float32)
    batch = {"image": images, "label": jnp.zeros((args.batch,), jnp.int32)}
    times = {}
    clock = _Clock()
    jax.block_until_ready(model.init(jax.random.key(0), images))
    times["init_eager"] = clock.lap()
    jax.block_until_ready(jax.jit(model.init)(jax.random.key(1), images))
    times["init_jit"] = clock.lap()

    tx = training.adamw(1e-3, weight_decay=0.05)
    state = jax.jit(
        lambda: training.create_train_state(
            model, tx, jax.ShapeDtypeStruct(images.shape, images.dtype), seed=0
        )
    )()
    hyper = dd.nn.functional.HYPER_NAME[args.gate]
    gate = training.GateSchedule(hyper, dd.schedules.cosine(1.0, 1e-3, 1000))
    step = jax.jit(training.make_train_step(model, tx, training.Classification(10), gate=gate))
    _lower_compile(step, state, batch, clock, times, "search")
    if method == "dense":
        for part in ("lower", "compile", "total"):
            times[f"frozen_{part}"] = times[f"search_{part}"]
    else:
        frozen = jax.jit(training.freeze_state)(state)
        _lower_compile(step, frozen, batch, clock, times, "frozen")
    return times


def _run_child(variant: str, method: str, args) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, method]
    for name in ("batch", "image", "sparsity", "explore", "num_buckets", "gate"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ), check=False)
    if proc.returncode:
        raise SystemExit(f"{variant} {method} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = make_parser(__doc__)
    parser.add_argument("--variants", default="S/16,B/16", help="comma-separated ViT variants")
    parser.add_argument("--batch", type=count("the batch size"), default=8)
    parser.add_argument("--image", type=count("the image size"), default=32, help="height, width")
    parser.add_argument("--sparsity", type=sparsity, default=0.9)
    parser.add_argument("--explore", default="buckets", choices=("buckets", "dense_score", "none"))
    parser.add_argument("--num-buckets", type=count("the number of buckets"), default=4)
    parser.add_argument("--gate", default="sparse_topk", choices=("sparse_topk", "softmax"))
    parser.add_argument(
        "--repeats", type=count("repeats"), default=1, help="fresh processes per method"
    )
    parser.add_argument(
        "--out",
        type=out_file,
        default=None,
        help="CSV path (default bench/results/compile_<time>.csv)",
    )
    parser.add_argument("--child", nargs=2, metavar=("VARIANT", "METHOD"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(*args.child, args)))
        return
    # The children time the first imports; this process may import the model before them.
    from dynadiag_jax.models import vit  # noqa: PLC0415
    from dynadiag_jax.models.variants import parse_variant  # noqa: PLC0415

    for variant in args.variants.split(","):
        try:
            _, patch = parse_variant(variant, vit.SIZES, model="ViT")
        except ValueError as e:
            parser.error(f"--variants: {e}")
        if args.image % patch:
            parser.error(f"--image {args.image} is not a multiple of {variant}'s patch {patch}")
    out = args.out or results_path("compile")

    rows = []
    print(
        f"ViT init and first-step compile, batch {args.batch}, {args.image}x{args.image} images, "
        f"DynaDiag at sparsity {args.sparsity}, explore={args.explore} "
        f"({args.num_buckets} buckets), gate={args.gate}; "
        f"median of {args.repeats} process(es), seconds"
    )
    header = (
        f"{'variant':8s} {'measure':22s} {'dense':>8s} {'dynadiag':>9s} {'ratio':>6s} "
        f"{'cpu ratio':>9s}"
    )
    print(header)
    print("-" * len(header))
    for variant in args.variants.split(","):
        runs = {m: [_run_child(variant, m, args) for _ in range(args.repeats)] for m in METHODS}
        for key, label in MEASURES:
            med = {
                m: [statistics.median(r[key][i] for r in runs[m]) for i in (0, 1)] for m in METHODS
            }
            ratio = med["dynadiag"][0] / med["dense"][0]
            cpu_ratio = med["dynadiag"][1] / med["dense"][1]
            print(
                f"{variant:8s} {label:22s} {med['dense'][0]:8.1f} {med['dynadiag'][0]:9.1f} "
                f"{ratio:6.2f} {cpu_ratio:9.2f}",
                flush=True,
            )
            rows.append(
                {
                    "variant": variant,
                    "measure": key,
                    "dense_s": f"{med['dense'][0]:.3f}",
                    "dynadiag_s": f"{med['dynadiag'][0]:.3f}",
                    "ratio": f"{ratio:.3f}",
                    "dense_cpu_s": f"{med['dense'][1]:.3f}",
                    "dynadiag_cpu_s": f"{med['dynadiag'][1]:.3f}",
                    "cpu_ratio": f"{cpu_ratio:.3f}",
                    "batch": args.batch,
                    "image": args.image,
                    "sparsity": args.sparsity,
                    "explore": args.explore,
                    "num_buckets": args.num_buckets,
                    "gate": args.gate,
                    "repeats": args.repeats,
                }
            )
    write_csv(rows, list(rows[0]), "compile", out)


if __name__ == "__main__":
    main()
