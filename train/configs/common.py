"""Shared config pieces: typed "key=value" arguments and the dynadiag and unstructured sections."""

from __future__ import annotations

import difflib
from collections.abc import Iterable

import ml_collections

_TRUE, _FALSE = ("", "1", "true", "yes"), ("0", "false", "no")


def did_you_mean(candidates: Iterable[str]) -> str:
    """``" (did you mean 'a' or 'b'?)"`` for the first three candidates; ``""`` for none."""
    found = list(dict.fromkeys(candidates))[:3]
    return f" (did you mean {' or '.join(map(repr, found))}?)" if found else ""


def given(arg: str | None) -> set[str]:
    """The keys that the config argument ``arg`` (``"key=value,..."``) sets."""
    return {item.partition("=")[0] for item in filter(None, (arg or "").split(","))}


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
    """Parse ``key=value`` pairs (a bare ``key`` means True) against ``defaults``.

    Values take the type of their default; unknown keys raise ``ValueError`` naming the closest
    and the known ones.
    """
    out = ml_collections.ConfigDict(defaults)
    for item in filter(None, (arg or "").split(",")):
        key, _, value = item.partition("=")
        if key not in defaults:
            raise ValueError(
                f"unknown config argument {key!r}"
                f"{did_you_mean(difflib.get_close_matches(key, defaults))}; "
                f"known: {', '.join(defaults)}"
            )
        default = defaults[key]
        if isinstance(default, bool):
            if value.lower() not in _TRUE + _FALSE:
                raise ValueError(f"config argument {key}={value!r} is not true or false")
            out[key] = value.lower() in _TRUE
        elif value == "":
            raise ValueError(f"config argument {key!r} needs a value ({key}=...)")
        else:
            try:
                out[key] = type(default)(value)
            except ValueError:
                kind = type(default).__name__
                article = "an" if kind == "int" else "a"
                raise ValueError(
                    f"config argument {key}={value!r} is not {article} {kind}"
                ) from None
    return out


# Gate schedules over the search phase. The sparse gate's strength decays exponentially, which the
# layer's exploration benchmark found to recover planted diagonals (docs/selection.md); the
# softmax gate's temperature follows the authors' released recipe (cosine 5.0 -> 0.05).
GATE_SCHEDULES = {
    "sparse_topk": dict(name="exponential", init_value=1.0, end_value=1e-3),
    "softmax": dict(name="cosine", init_value=5.0, end_value=0.05),
}
# The search length of the MLP and the Mixer (train/configs/results.py, fashion_mnist.py): 10% of
# the steps, not the authors' 30%; the ViT and the GPT keep 30%, each the better of the lengths
# measured on it (docs/selection.md, "How long the search").
SHORT_SEARCH = 0.1


def dynadiag(
    sparsity: float,
    layers,
    gate: str = "sparse_topk",
    block_size: int = 1,
    search_fraction: float = 0.3,
) -> dict:
    """The ``dynadiag`` section shared by every config: which layers, how sparse, how they search.

    ``sparsity=0`` trains the dense model; the search phase is the first ``search_fraction`` of the
    steps (0.3: the authors' recipe, 30 of 100 epochs; the Fashion-MNIST MLP and Mixer suites take
    0.1: docs/selection.md, "How long the search").
    ``block_size=1`` keeps element diagonals (the paper's); 8, 16, 32, 64 or 128 makes every
    sparse layer a block-diagonal one (the size must divide each sparse layer's widths).
    """
    if gate not in GATE_SCHEDULES:
        raise ValueError(f"unknown gate {gate!r}; known: {', '.join(GATE_SCHEDULES)}")
    return dict(
        sparsity=sparsity,
        layers=tuple(layers),
        gate=gate,
        block_size=block_size,  # 1: element diagonals; b in (8, ..., 128): b x b block diagonals
        slack=0.25,
        explore="buckets",
        gate_schedule=dict(GATE_SCHEDULES[gate]),
        search_fraction=search_fraction,
        score_every=0,  # > 0 with explore="dense_score": score every diagonal this often
        alpha_lr_scale=1.0,
        fan_in="sparse",  # initial values at the dense layer's output scale (DiagonalDense)
        scale="rms",  # the search product at the frozen layer's output scale (DiagonalDense)
        # alpha restarts from the values' norms this far into the search (0: never); early, so
        # the all-diagonal warm-up is short (docs/selection.md: 0.05 beat 0.2 for less compute)
        rescore_fraction=0.05,
        # > 0: after the restart each layer searches over a working set of the top
        # ceil(working_set * K) candidates by alpha (>= 1; 0: off), so that a search step is no
        # longer [P, ...]-sized; moved to the new top every working_set_refresh steps, entered
        # working_set_start (a fraction of the search, > rescore_fraction) into the search
        # (docs/selection.md, "What a search step costs")
        working_set=0.0,
        working_set_refresh=20,
        working_set_start=0.1,
        impl="auto",  # dd.diag_matmul backend: "auto" (compiled kernel if built), "jax", "dense"
        # each sparse layer's input permutation: "none", "random" (fixed, drawn at init) or
        # "learned" (a soft matrix while searching, hardened at the freeze; DiagonalDense)
        permutation="none",
        permutation_penalty=1e-3,  # the learned permutation's l1-l2 penalty weight (lambda)
        # the learned permutation's start: "random" (half on a random permutation matrix, half
        # uniform) or "uniform" (PA-DST's; docs/design.md 4.7 has both measured)
        permutation_start="random",
        # the learned permutation's relaxation: "sinkhorn" (PA-DST's soft in x in matrix) or
        # "blocks" (a hard forward through blocks of at most 64 after a random base permutation)
        permutation_relaxation="sinkhorn",
    )


FINETUNE_SUITES = ("mlp", "mixer", "vit")


def finetune(arg, *, selection_every: int, suites=FINETUNE_SUITES) -> ml_collections.ConfigDict:
    """The part every fine-tune config shares (train/sparsify.py, train/lora_fa.py).

    ``arg`` (from :func:`parse_arg`) has ``checkpoint``, ``suite`` (one of ``suites`` of
    train/configs/results.py, whose model, layers, recipe and data are taken), ``sparsity``,
    ``block_size``, ``finetune_fraction`` (the fine-tune's length as a fraction of the suite's
    from-scratch steps) and ``runlocal`` (the small local digits, one epoch, no learning-rate
    warm-up). The ``gpt`` suite's
    ``train`` section has the from-scratch ``num_steps`` where the image suites have ``epochs``.
    """
    from train.configs import results  # noqa: PLC0415 - results imports this module

    if arg.suite not in suites:
        raise ValueError(f"unknown suite {arg.suite!r}; known: {', '.join(suites)}")
    suite = results.get_config(f"models={arg.suite}").models[arg.suite]
    config = ml_collections.ConfigDict()
    config.suite = arg.suite
    # The source run's workdir (or its checkpoints/ directory) and the step (0: the newest).
    config.checkpoint = arg.checkpoint
    config.step = 0
    config.seed = 0
    config.model = suite.model.to_dict()
    config.dynadiag = suite.dynadiag.to_dict()
    config.dynadiag.update(sparsity=arg.sparsity, block_size=arg.block_size)
    common_train = dict(
        batch_size=suite.batch_size,
        finetune_fraction=arg.finetune_fraction,
        log_every=50,
        eval_every=0,
        selection_every=selection_every,
        checkpoint_every=0,
        keep_checkpoints=1,
    )
    if suite.task == "language_modeling":
        config.data = dict(
            corpus="auto", path="", seq_len=suite.seq_len, eval_windows=suite.eval_windows
        )
        # num_steps: the from-scratch run's length, which finetune_fraction scales
        config.train = dict(
            common_train, eval_batch_size=suite.eval_batch_size, num_steps=suite.steps
        )
    else:
        config.data = dict(source="mnist5k" if arg.runlocal else "auto", data_dir="")
        # epochs: the from-scratch run's length, which finetune_fraction scales
        config.train = dict(
            common_train, eval_batch_size=1000, epochs=1 if arg.runlocal else suite.epochs
        )
    config.optimizer = suite.optimizer.to_dict()
    if arg.runlocal and "warmup_steps" in config.optimizer:
        # one epoch of the local digits leaves a fine-tune of a few steps (the ViT's: 6)
        config.optimizer["warmup_steps"] = 0
    return config


def lora_section(*, steps: int | None = 0) -> dict:
    """A config's ``lora`` section: the defaults (r = 8, alpha 16, B alone at 1e-2, which beat
    the suites' 1e-3 on the MLP: docs/training.md); ``steps`` is the in-run phase's length (0:
    none; None: no such entry, for train/lora_fa.py, whose length is a fraction). ``layers`` ()
    means the diagonal layers, whatever ``dynadiag.layers`` is set to (a copy of the patterns went
    stale when they were overridden, and adapted dense layers); a tuple of path regexes names
    others (ml_collections overrides no list entry from the command line)."""
    section = dict(rank=8, alpha=16.0, layers=(), train_values=False, learning_rate=1e-2)
    return section if steps is None else dict(section, steps=steps)


def unstructured_defaults() -> ml_collections.ConfigDict:
    """The ``unstructured`` section: RigL's schedule (delta T = 100, stop at 75%, drop 0.3 cosine).

    ``mutation_ratio`` and ``soft_bound`` are MEST's (EM&S: grow 20% above the budget).
    ``fan_in="sparse"`` starts the kept weights of a sparse layer at the model's dense
    initializer times ``1 / sqrt(density)`` (the same rule as ``DiagonalDense``'s default), so
    every method starts at the output scale of the dense layer it replaces; ``"dense"`` keeps the
    dense initializer (a masked dense layer's start).
    """
    return ml_collections.ConfigDict(
        dict(
            distribution="uniform",
            update_every=100,
            end_fraction=0.75,
            drop_fraction=0.3,
            mutation_ratio=0.2,
            soft_bound=True,
            fan_in="sparse",
        )
    )
