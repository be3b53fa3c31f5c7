"""A ViT written the usual way, made diagonal by ``dd.nn.sparsify``, against the suites' own ViT.

``PlainViT`` below is a plain-linen ViT as one writes it without DynaDiag in mind: ``nn.Conv``
patches, ``nn.MultiHeadDotProductAttention`` (separate query / key / value / out projections,
``nn.DenseGeneral``) and an ``nn.Dense`` MLP. No line of it knows about diagonal layers;
:data:`RULES` make its attention projections and MLP layers diagonal by module path, as the ViT
suite's ``dynadiag.layers`` do for ``dd.models.ViT`` (whose attention has one fused ``qkv``).

For every seed this trains, with the ViT suite's recipe (``train/configs/results.py``, one epoch of
Fashion-MNIST, DynaDiag at ``--sparsity``), the suite's ViT and the sparsified ``PlainViT``, and
appends each run's test accuracy and logged step times to ``<workdir>/accuracy.jsonl``. Then it
times both models' training steps after the freeze side by side (interleaved, median), and prints
the table:

  python train/unedited_vit.py                        # 3 seeds at 90%, ~5 min on two cores
  python train/unedited_vit.py --seeds=1 --config=train/configs/results.py:quick

``--seeds`` defaults to the config's ViT suite's ``seeds`` (``:quick``: 1). The config's
``sparsities``, ``methods`` and sparse ``layers`` are not read (``--sparsity`` is the one trained,
:data:`RULES` the plain ViT's layers): a config that changes them is refused.

Interrupt at any time: finished runs are kept and the same command resumes the interrupted one.
Each run's recipe (the suite's DynaDiag settings, data and sparsity) is kept with its checkpoints
and its record: running another one in the same ``--workdir`` is refused with the settings that
differ, instead of resuming or reporting runs of the old one.
"""

from __future__ import annotations

import functools
import json
import pathlib
import sys

if __package__ in (None, ""):  # run as a file: make `train` importable from the repository root
    # Appended: the installed dynadiag_jax (with the compiled kernels) must win over the checkout.
    sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

import flax.linen as nn
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import app, flags

import dynadiag_jax as dd
from dynadiag_jax import training as T
from dynadiag_jax.models import variants, vit
from dynadiag_jax.training.checkpoint import run_differences
from train import baselines, cli, common, speed
from train import results_runs as R
from train.configs import results as default_config

SUITE = "vit"
VARIANTS = ("ours", "plain")  # the suite's ViT, and PlainViT through dd.nn.sparsify
# The suite's sparse layers in PlainViT's paths: attention projections and both MLP layers.
RULES = (r".*/attention/(query|key|value|out)", r".*/mlp/Dense_[01]")
XAVIER = nn.initializers.xavier_uniform()
FLAGS = flags.FLAGS


class MlpBlock(nn.Module):
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(self.mlp_dim, kernel_init=XAVIER, bias_init=nn.initializers.normal(1e-6))(x)
        y = nn.gelu(y, approximate=False)
        return nn.Dense(x.shape[-1], kernel_init=XAVIER, bias_init=nn.initializers.normal(1e-6))(y)


class Block(nn.Module):
    num_heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads, kernel_init=XAVIER, name="attention"
        )(y, y)
        x = x + y
        return x + MlpBlock(self.mlp_dim, name="mlp")(nn.LayerNorm()(x))


class PlainViT(nn.Module):
    """Pre-norm ViT with a class token: ``images[B, H, W, C] -> logits[B, num_classes]``."""

    num_classes: int
    patch: int = 7
    width: int = 160
    depth: int = 2
    mlp_dim: int = 320
    num_heads: int = 4

    @nn.compact
    def __call__(self, images, *, train: bool = False):
        del train  # no dropout in this recipe
        x = nn.Conv(self.width, (self.patch,) * 2, strides=(self.patch,) * 2, padding="VALID")(
            images
        )
        x = x.reshape(x.shape[0], -1, self.width)
        cls = self.param("cls_token", nn.initializers.zeros, (1, 1, self.width))
        x = jnp.concatenate([jnp.broadcast_to(cls, (x.shape[0], 1, self.width)), x], axis=1)
        x = x + self.param("pos_embed", nn.initializers.normal(0.02), (1, *x.shape[1:]))
        for i in range(self.depth):
            x = Block(self.num_heads, self.mlp_dim, name=f"block_{i}")(x)
        x = nn.LayerNorm()(x)
        return nn.Dense(self.num_classes, kernel_init=nn.initializers.zeros, name="head")(x[:, 0])


def plain_vit(config, num_classes: int) -> PlainViT:
    """``PlainViT`` with the suite model's sizes (``dd.models.ViT``'s ``variant``)."""
    size, patch = variants.parse_variant(config.models[SUITE].model.variant, vit.SIZES, model="ViT")
    return PlainViT(num_classes, patch, size.width, size.depth, size.mlp_dim, size.num_heads)


def rules(dynadiag_cfg, sparsity: float, **extra) -> list[tuple[str, dict]]:
    """:data:`RULES` with the suite's ``DiagonalDense`` arguments at ``sparsity``."""
    layer = common.sparse_layer(baselines.with_sparsity(dynadiag_cfg, sparsity))
    return [(pattern, {**layer.keywords, **extra}) for pattern in RULES]


def models(config, data, sparsity: float, seed: int, steps: int):
    """``{"ours": Method, "plain": Method}``: the same optimizer, gate and freeze for both."""
    ours = R.build(config, SUITE, "dynadiag", sparsity, seed, data, steps)
    plain = dd.nn.sparsify(
        plain_vit(config, data.images.num_classes), rules(config.models[SUITE].dynadiag, sparsity)
    )
    return dict(zip(VARIANTS, (ours, ours._replace(model=plain)), strict=True))


def trained_config(config, sparsity: float):
    """``config`` with the suite alone, planning only what this script trains (DynaDiag at
    ``sparsity``): what :func:`R.prepare` checks (not RigL's mask schedule, which needs more steps
    than an epoch of mnist5k, nor the other suites' data)."""
    config = config.copy_and_resolve_references()
    with config.unlocked():
        config.models = ml_collections.ConfigDict({SUITE: config.models[SUITE]})
        m = config.models[SUITE]
        m.methods, m.goal_methods, m.sparsities = ("dynadiag",), (), (sparsity,)
    return config


def recipe(config, variant: str, sparsity: float, steps: int) -> dict:
    """What a run of ``variant`` computes from, as its checkpoints and its record keep it (after
    JSON): the suite's DynaDiag settings, data and steps (:func:`R.recipe`) and ``sparsity``."""
    info = {"variant": variant, "sparsity": sparsity, **R.recipe(config, SUITE, "dynadiag", steps)}
    return json.loads(json.dumps(info))


def check_recorded(
    records: list[dict], recipes: dict[str, dict], seeds: int, sparsity: float, path: pathlib.Path
) -> None:
    """Raise :class:`common.ConfigError` if ``records`` (``path``) hold a run this command would
    report, recorded with another recipe than ``recipes[variant]``: its accuracy is not this
    recipe's."""
    for r in records:
        if r["variant"] not in recipes or r["sparsity"] != sparsity or r["seed"] >= seeds:
            continue
        run = f"{path} records the {r['variant']} run of seed {r['seed']}"
        if "recipe" not in r:
            raise common.ConfigError(
                f"{run} without its recipe (it was trained before recipes were recorded): use "
                "another workdir (--workdir)"
            )
        differences = run_differences(r["recipe"], recipes[r["variant"]], where=path.name)
        if differences:
            shown = "\n  ".join(differences)
            raise common.ConfigError(
                f"{run} with another recipe:\n  {shown}\nrun with the settings it was recorded "
                "with, or use another workdir (--workdir)"
            )


def train_one(
    config,
    data,
    built,
    seed: int,
    steps: int,
    workdir: pathlib.Path,
    run_info: dict,
    *,
    progress: bool = False,
) -> dict:
    """One run of the suite's recipe (``progress``: a bar over its steps); its accuracy,
    parameters and logged step times.

    Raises:
      common.ConfigError: ``workdir`` holds a checkpoint of another ``run_info`` or seed, or one
        that cannot be read.
    """
    try:
        result = R.train_built(
            config, data, SUITE, built, seed, steps, workdir, run_info, progress=progress
        )
    except T.CheckpointMismatch as e:
        raise common.ConfigError(f"{e} (--workdir)") from None
    counts = T.parameter_counts(result.state.params)
    metrics = workdir / "metrics.jsonl"
    return {
        "accuracy": result.eval_metrics["accuracy"],
        "parameters": counts.total,
        "diagonal_parameters": counts.diagonal,
        "search_step_time_s": R.mean_step_time(metrics, 0, built.freeze_step),
        "frozen_step_time_s": R.mean_step_time(metrics, built.freeze_step),
    }


def time_frozen(config, data, sparsity: float) -> dict[str, float]:
    """Median seconds of both models' training step after the freeze (frozen from the start,
    the same computation), and of their dense forms, interleaved."""
    m = config.models[SUITE]
    task, batch = R.task_of(m, data), R.sample_batch(m, data, int(m.batch_size))
    example, steps = R.example_input(m, data), R.steps_of(m, data)
    make = functools.partial(R.build, config, SUITE, sparsity=sparsity, seed=0, data=data)
    ours, dense = make(method="static_diagonals", steps=steps), make(method="dense", steps=steps)
    plain = plain_vit(config, data.images.num_classes)
    frozen = dd.nn.sparsify(plain, rules(m.dynadiag, sparsity, init_phase="frozen"))
    timed = {
        "ours": ours.model,
        "plain": frozen,
        "ours dense": dense.model,
        "plain dense": plain,
    }
    fns = {
        name: speed._train_and_infer(model, dense.optimizer, example, batch, task, {})[0]
        for name, model in timed.items()
    }
    return speed._time_round_robin(
        fns, repeats=int(config.speed.repeats), warmup=int(config.speed.warmup)
    )


def _mean_ms(records: list[dict], key: str) -> str:
    """The mean of a logged time over ``records`` in ms; "-" where a run logged none."""
    times = [r[key] for r in records if r[key] is not None]
    return f"{1e3 * np.mean(times):.1f} ms" if times else "-"


def report(records: list[dict], timings: dict[str, float], sparsity: float) -> str:
    rows = [
        f"ViT suite at {sparsity:g}: the suite's ViT and PlainViT through dd.nn.sparsify",
        "",
        "| model | test accuracy (mean +- std) | seeds | parameters | logged step, search "
        "/ frozen | timed frozen step, x ours |",
        "|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        rs = [r for r in records if r["variant"] == name]
        if not rs:
            continue
        acc = 100 * np.array([r["accuracy"] for r in rs])
        logged = " / ".join(
            _mean_ms(rs, key) for key in ("search_step_time_s", "frozen_step_time_s")
        )
        rows.append(
            f"| {name} | {acc.mean():.2f} +- {acc.std():.2f} | {len(rs)} | "
            f"{rs[0]['parameters']:,} | {logged} | "
            f"{timings[name] / timings['ours']:.3f}x |"
        )
    rows.append(
        f"\nDense steps, same timing: ours {timings['ours dense'] / timings['ours']:.2f}x, "
        f"plain {timings['plain dense'] / timings['ours']:.2f}x the sparse step of ours."
    )
    return "\n".join(rows)


def run(
    config, workdir: pathlib.Path, seeds: int, sparsity: float, *, progress: bool = False
) -> str:
    """Train what ``workdir`` has not recorded yet (``progress``: a bar over each run's steps),
    time the frozen steps, and return the report."""
    workdir = common.usable_workdir(workdir)
    data = R.prepare(trained_config(config, sparsity))
    steps = R.steps_of(config.models[SUITE], data)
    recipes = {name: recipe(config, name, sparsity, steps) for name in VARIANTS}
    path = workdir / R.ACCURACY_FILE
    records = R.read_records(path) if path.exists() else []
    check_recorded(records, recipes, seeds, sparsity, path)
    done = {(r["variant"], r["seed"], r["sparsity"]) for r in records}
    for seed in range(seeds):
        for name, built in models(config, data, sparsity, seed, steps).items():
            if (name, seed, sparsity) in done:
                continue
            print(f"training {name} seed {seed} ...", flush=True)
            run_dir = workdir / f"{name}_s{R.run_percent(sparsity)}_seed{seed}"
            record = {"variant": name, "seed": seed, "sparsity": sparsity, "recipe": recipes[name]}
            record.update(
                train_one(
                    config, data, built, seed, steps, run_dir, recipes[name], progress=progress
                )
            )
            T.append_jsonl(path, record)
            records.append(record)
    print("timing the frozen steps ...", flush=True)
    timings = time_frozen(config, data, sparsity)
    chosen = [r for r in records if r["sparsity"] == sparsity and r["seed"] < seeds]
    return report(chosen, timings, sparsity)


def unread_settings(config) -> list[str]:
    """The entries of the config's ViT suite that this script does not read but the config
    changes from the suite's default (``--sparsity`` is trained, :data:`RULES` sparsify the plain
    ViT)."""
    m, default = config.models[SUITE], default_config.get_config(f"models={SUITE}").models[SUITE]
    unread = [
        f"models.{SUITE}.{key}"
        for key in ("sparsities", "methods", "goal_methods")
        if tuple(m[key]) != tuple(default[key])
    ]
    if tuple(m.dynadiag.layers) != tuple(default.dynadiag.layers):
        unread.append(f"models.{SUITE}.dynadiag.layers (the plain ViT's layers are RULES)")
    return unread


def main(argv):
    del argv
    config = FLAGS.config
    if "models" not in config:  # another script's config
        common.die("the config has no 'models' entry: give train/configs/results.py")
    if SUITE not in config.models:
        common.die(f"the config has no {SUITE!r} suite (use models={SUITE} or the default)")
    if not 0.0 < FLAGS.sparsity < 1.0:
        common.die(f"--sparsity must lie in (0, 1), got {FLAGS.sparsity}")
    unread = unread_settings(config)
    if unread:
        common.die(
            f"unedited_vit.py trains --sparsity={FLAGS.sparsity:g} with the suite's sparse layers "
            f"and --seeds; it does not read {', '.join(unread)}: leave them at their defaults"
        )
    seeds = FLAGS.seeds or int(config.models[SUITE].seeds)
    common.run_script(
        lambda: print(
            run(config, pathlib.Path(FLAGS.workdir), seeds, FLAGS.sparsity, progress=FLAGS.progress)
        )
    )


if __name__ == "__main__":  # flags exist only when run as a file (tests import this module)
    cli.define_config_flag(str(pathlib.Path(default_config.__file__)))
    flags.DEFINE_string("workdir", "runs/unedited_vit", "run directories and records")
    flags.DEFINE_integer(
        "seeds", 0, "seeds 0 .. n-1 (0: the config's ViT suite's seeds)", lower_bound=0
    )
    flags.DEFINE_float("sparsity", 0.9, "sparsity of the diagonal layers")
    flags.DEFINE_bool("progress", True, "show a progress bar over each run's steps")
    app.run(main, flags_parser=cli.parse_flags)
