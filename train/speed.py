"""Side-by-side timings of the training step and inference of every method (results command).

Each group (one suite at one sparsity) holds jitted functions on one fixed batch (the suite's
training batch; images or token windows): dense, the diagonal layers (DynaDiag after its freeze
and the static-diagonal baseline run exactly this product, through ``diag_matmul``'s default
implementation), block-diagonal layers for each block size the suite trains at that sparsity
(``diagonal_b<b>``), unstructured sparsity as masked dense layers (training: dense layers under
the RigL optimizer wrapper, i.e. the real RigL/SET/MEST step; inference: ``MaskedDense``), and
unstructured sparsity as ``jax.experimental.sparse`` BCOO layers (``BCOODense``, trained with the
plain optimizer). After warm-up the group's functions run round-robin ``repeats`` times; each
reports its median, so every ratio to dense compares timings taken under the same machine load.
"""

from __future__ import annotations

import functools
import os
import platform
import time

import jax
import numpy as np
import tqdm

import dynadiag_jax as dd
from dynadiag_jax import baselines as B
from dynadiag_jax import training as T
from train import baselines
from train import results_runs as R

VARIANTS = ("dense", "diagonal", "unstructured_masked", "unstructured_bcoo")  # + diagonal_b<b>


def machine() -> dict:
    """Where the timings were taken."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "cpu": cpu,
        "cores_visible": len(os.sched_getaffinity(0)),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "devices": [str(d) for d in jax.devices()],
        "load_average_at_start": list(os.getloadavg()),
        "diag_impl": "ffi (compiled kernel)"
        if "ffi" in dd.available_impls()
        else "jax (pure-JAX path)",
    }


def _time_round_robin(fns: dict, repeats: int, warmup: int) -> dict[str, float]:
    for f in fns.values():
        for _ in range(warmup):
            jax.block_until_ready(f())
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, f in fns.items():
            start = time.perf_counter()
            jax.block_until_ready(f())
            times[name].append(time.perf_counter() - start)
    return {name: float(np.median(t)) for name, t in times.items()}


def _train_and_infer(model, optimizer, example, batch, task, infer_inputs, gate=None):
    """``(train_fn, {batch_size: infer_fn})`` on one state (not donated: it is reused)."""
    state = jax.jit(lambda: T.create_train_state(model, optimizer, example, seed=0))()
    step = jax.jit(T.make_train_step(model, optimizer, task, gate=gate))
    variables = T.variables_of(state)
    forward = jax.jit(lambda v, x: model.apply(v, x, train=False))
    return (
        lambda: step(state, batch),
        {b: functools.partial(forward, variables, x) for b, x in infer_inputs.items()},
    )


def _group(config, data, name: str, sparsity: float, block_sizes=(), permuted=()) -> dict:
    """``{(kind, variant): fn}`` of one suite at one sparsity; ``kind`` is ``train`` or
    ``infer_b<batch>``; ``block_sizes`` adds a ``diagonal_b<b>`` variant per block size,
    ``permuted`` (block sizes, 1 for element diagonals) a ``diagonal[_b<b>]_perm`` variant with
    a fixed input permutation (a permuted DynaDiag layer after its freeze)."""
    m = config.models[name]
    task = R.task_of(m, data)
    batch = R.sample_batch(m, data, int(m.batch_size))
    example = R.example_input(m, data)
    samples = R.sample_batch(m, data, max(int(b) for b in m.inference_batches))
    infer_inputs = {int(b): R.model_inputs(m, samples)[: int(b)] for b in m.inference_batches}
    make = functools.partial(
        R.build, config, name, sparsity=sparsity, seed=0, data=data, steps=R.steps_of(m, data)
    )
    dense, rigl = make(method="dense"), make(method="rigl")

    def layered(layer):
        return baselines.model_with_layer(
            m.model,
            m.dynadiag,
            functools.partial(layer, sparsity=sparsity),
            **R.model_kwargs(m, data),
        )

    static = {"diagonal": make(method="static_diagonals")}
    static.update({f"diagonal_b{b}": make(method=f"static_diagonals_b{b}") for b in block_sizes})
    for b in permuted:
        block = "" if b == 1 else f"_b{b}"
        static[f"diagonal{block}_perm"] = make(method=f"static_diagonals{block}_random_perm")
    fns = {}
    for variant, model, optimizer, infer_model in (
        ("dense", dense.model, dense.optimizer, None),
        *((v, s.model, s.optimizer, None) for v, s in static.items()),
        # A masked model's inference runs MaskedDense layers.
        ("unstructured_masked", rigl.model, rigl.optimizer, layered(B.MaskedDense)),
        ("unstructured_bcoo", layered(B.BCOODense), dense.optimizer, None),
    ):
        fns[("train", variant)], infer = _train_and_infer(
            model, optimizer, example, batch, task, infer_inputs
        )
        if infer_model is not None:
            _, infer = _train_and_infer(
                infer_model, dense.optimizer, example, batch, task, infer_inputs
            )
        fns.update({(f"infer_b{b}", variant): f for b, f in infer.items()})
    return fns


def block_sizes_at(config, name: str, sparsity: float, *, permuted=False) -> tuple[int, ...]:
    """The block sizes of the block-diagonal methods the suite trains at ``sparsity``; with
    ``permuted``, those of the methods with an input permutation (1: element diagonals)."""
    plan = R.run_plan(config, [name])
    sizes = {
        R.parse_method(method)[1]
        for _, method, s, _ in plan
        if s == sparsity and bool(R.method_permutation(method)) == permuted
    }
    return tuple(sorted(sizes if permuted else sizes - {1}))


def measure(config, data, models=None, *, progress: bool = True) -> dict:
    """Timings of every variant for every suite in ``models`` (default: all) at each of its
    sparsities (seconds, medians)."""
    start = time.perf_counter()
    out = {"machine": machine(), "repeats": int(config.speed.repeats), "models": {}}
    names = R.suites(config) if models is None else list(models)
    groups = [(n, float(s)) for n in names for s in config.models[n].sparsities]
    for name, sparsity in tqdm.tqdm(groups, unit="group", disable=not progress, desc="timing"):
        fns = _group(
            config,
            data,
            name,
            sparsity,
            block_sizes_at(config, name, sparsity),
            block_sizes_at(config, name, sparsity, permuted=True),
        )
        medians = _time_round_robin(fns, int(config.speed.repeats), int(config.speed.warmup))
        group = out["models"].setdefault(name, {}).setdefault(f"{sparsity:g}", {})
        for (kind, variant), seconds in medians.items():
            group.setdefault(variant, {})[kind] = seconds
    out["seconds"] = time.perf_counter() - start
    return out
