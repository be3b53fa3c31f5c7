"""A config's ``lora`` section -> a LoRA-FA fine-tuning phase (``dynadiag_jax.training.Finetune``).

Shared by the two ways to fine-tune a frozen DynaDiag model with LoRA-FA adapters: a phase at the
end of a training run (train/lm.py's ``lora.steps``) and train/lora_fa.py on a frozen run's
checkpoint (the phase from step 0). The ``lora`` section (``train.configs.common.lora_section``):
``rank`` (0: no adapters, the control that fine-tunes the diagonal values alone), ``alpha`` (scale
``alpha / rank``), ``layers`` (path regexes), ``train_values`` (also train the diagonal values;
else only ``B``) and ``learning_rate`` (the phase's own, cosine to ``optimizer.end_learning_rate``,
no warm-up).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

import dynadiag_jax as dd
from dynadiag_jax import data as D
from dynadiag_jax import training as T
from train import baselines, common


class SuiteData(NamedTuple):
    """What a fine-tune of a results suite's model reads (:func:`suite_data`).

    Attributes:
      train: training batches (seeded by the config's seed).
      eval: evaluation batches (the test images, or the corpus's validation windows).
      example: the training input's ``jax.ShapeDtypeStruct``.
      scratch_steps: the steps of the suite's run from scratch (which ``finetune_fraction``
        scales).
      task: the suite's task.
      metric: ``"accuracy"`` or ``"perplexity"``, the evaluation's headline.
      model_kwargs: the model constructor's data-dependent arguments.
      calibration: ``n -> inputs[n, ...]``, the first ``n`` training inputs (images, or token
        windows of the training corpus without their last token): ``dd.refit``'s data.
    """

    train: Any
    eval: Any
    example: jax.ShapeDtypeStruct
    scratch_steps: int
    task: Any
    metric: str
    model_kwargs: dict
    calibration: Callable[[int], jax.Array]


def suite_data(config) -> SuiteData:
    """The :class:`SuiteData` of the config's suite: the fortunes corpus for gpt, else the
    images."""
    batch = int(config.train.batch_size)
    if config.suite == "gpt":
        corpus = D.load_corpus(config.data.corpus, config.data.path or None)
        seq_len = int(config.data.seq_len)

        def windows(n):
            usable = min(n, (len(corpus.train) - 1) // seq_len)
            return jnp.asarray(corpus.train[: usable * seq_len].reshape(usable, seq_len))

        return SuiteData(
            D.TokenWindows(corpus.train, seq_len, batch, seed=int(config.seed)),
            D.WindowEvalBatches(
                corpus.valid,
                seq_len,
                int(config.train.eval_batch_size),
                max_windows=int(config.data.eval_windows) or None,
            ),
            jax.ShapeDtypeStruct((batch, seq_len), jnp.int32),
            int(config.train.num_steps),
            T.LanguageModeling(),
            "perplexity",
            dict(vocab_size=D.BYTE_VOCAB_SIZE, block_size=seq_len),
            windows,
        )
    data = D.load_small_images(config.data.source, data_dir=config.data.data_dir or None)
    return SuiteData(
        D.ArrayBatches(data.train, batch, seed=int(config.seed)),
        D.EvalBatches(data.test, int(config.train.eval_batch_size)),
        jax.ShapeDtypeStruct((batch, *data.train["image"].shape[1:]), jnp.float32),
        int(config.train.epochs) * (len(data.train["label"]) // batch),
        T.Classification(data.num_classes, float(config.optimizer.label_smoothing)),
        "accuracy",
        dict(num_classes=data.num_classes),
        lambda n: jnp.asarray(data.train["image"][:n], jnp.float32),
    )


def evaluate(model, variables, eval_data, task) -> dict:
    """``model``'s evaluation with ``variables`` over ``eval_data``."""
    collections = {k: v for k, v in variables.items() if k != "params"}
    state = T.TrainState(jnp.zeros((), jnp.int32), variables["params"], None, collections, None)
    eval_step = jax.jit(T.make_eval_step(model, task))
    return T.evaluate(eval_step, state, eval_data, T.data_mesh(), task)


def check_lora(lora_cfg) -> None:
    """Raise :class:`common.ConfigError` for a ``lora`` section that cannot train anything."""
    rank = int(lora_cfg.rank)
    if rank < 0:
        raise common.ConfigError(f"lora.rank must be >= 0, got {rank}")
    if rank == 0 and not bool(lora_cfg.train_values):
        raise common.ConfigError(
            "lora.rank=0 (no adapters) trains nothing: it is the control run that fine-tunes the "
            "diagonal values alone, with lora.train_values=True"
        )
    if not float(lora_cfg.learning_rate) > 0:
        raise common.ConfigError(f"lora.learning_rate must be > 0, got {lora_cfg.learning_rate}")
    if rank and float(lora_cfg.alpha) == 0:  # the adapters' scale alpha / rank: B gets no gradient
        raise common.ConfigError(
            "lora.alpha=0 scales the adapters to nothing (B gets no gradient): give alpha > 0, or "
            "lora.rank=0 with lora.train_values=True for the values alone"
        )


def trained_patterns(lora_cfg) -> list[str]:
    """The params the phase trains: every ``B`` (with adapters), and the diagonal values if
    asked."""
    return [r".*/lora_b"] * bool(int(lora_cfg.rank)) + [r".*/values"] * bool(lora_cfg.train_values)


def frozen_model(model_cfg, dynadiag_cfg, **model_kwargs) -> nn.Module:
    """The model with its diagonal layers initialised in the frozen form, so that its init has a
    frozen run's structure (the variables a phase starts from)."""
    layer = functools.partial(common.sparse_layer(dynadiag_cfg), init_phase="frozen")
    return baselines.model_with_layer(model_cfg, dynadiag_cfg, layer, **model_kwargs)


def lora_phase(
    lora_cfg, base: nn.Module, opt_cfg, dynadiag_cfg, example_input, *, start_step: int, steps: int
) -> T.Finetune:
    """The phase that ``lora_cfg`` describes on ``base`` (:func:`frozen_model`), ``steps`` long
    from ``start_step``, with ``opt_cfg``'s optimizer at ``lora.learning_rate``.

    Raises:
      common.ConfigError: a bad section, or a pattern of ``lora.layers`` that matches no layer or
        a rank above a layer's width (found by tracing the adapted model's init).
    """
    check_lora(lora_cfg)
    rank = int(lora_cfg.rank)
    layers = tuple(lora_cfg.layers) or tuple(dynadiag_cfg.layers)  # (): the diagonal layers
    model = dd.nn.lora_fa(base, layers, rank=rank, alpha=float(lora_cfg.alpha)) if rank else base
    x = jnp.zeros(example_input.shape, example_input.dtype)
    try:
        jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))
    except ValueError as e:
        raise common.ConfigError(f"lora.layers / lora.rank: {e}") from None
    opt = opt_cfg.copy_and_resolve_references()
    with opt.unlocked():
        opt.update(learning_rate=float(lora_cfg.learning_rate), warmup_steps=0)
    tx, lr = common.build_optimizer(opt, dynadiag_cfg, steps, 0)
    return T.Finetune(start_step, model, tx, tuple(trained_patterns(lora_cfg)), lr)


def run_phase(config, method, num_steps: int, example_input, **model_kwargs):
    """``(phase or None, total steps)`` of a training run whose config has a ``lora`` section:
    with ``lora.steps`` > 0 the phase follows the run's ``num_steps`` (whose schedule is kept) on
    its frozen model, and the run lasts ``lora.steps`` more."""
    steps = int(config.lora.steps)
    if steps < 0:
        raise common.ConfigError(f"lora.steps must be >= 0 (0: no LoRA-FA phase), got {steps}")
    if not steps:
        return None, num_steps
    if method.name not in ("dynadiag", "static_diagonals"):
        raise common.ConfigError(
            f"a LoRA-FA phase (lora.steps={steps}) fine-tunes a frozen diagonal model: method "
            f"{method.name!r} has none (use dynadiag or static_diagonals, sparsity > 0)"
        )
    base = frozen_model(config.model, config.dynadiag, **model_kwargs)
    phase = lora_phase(
        config.lora,
        base,
        config.optimizer,
        config.dynadiag,
        example_input,
        start_step=num_steps,
        steps=steps,
    )
    return phase, num_steps + steps


def metric_before(metrics_path, step: int, metric: str):
    """``metric`` of the evaluation a run logged at ``step`` (the model as the phase that starts
    there found it: the run without its phase), or None when it logged none."""
    before = [
        r[metric] for r in T.read_jsonl(metrics_path) if r["kind"] == "eval" and r["step"] == step
    ]
    return before[-1] if before else None


def metric_text(value, spec: str) -> str:
    """A :func:`metric_before` value in format ``spec``; "(not logged)" for None (its
    metrics.jsonl lost the record, e.g. deleted before a rerun of a finished run)."""
    return "(not logged)" if value is None else format(value, spec)


def counts(variables, trained: list[str]) -> dict[str, int]:
    """Weights of ``variables`` by role: diagonal values, adapters (``A`` + ``B``), the rest, the
    ones the fine-tune trains, and the non-zero ones."""
    params = variables["params"]
    flat = traverse_util.flatten_dict(params, sep="/")
    sizes = {k: int(np.prod(np.shape(v))) for k, v in flat.items()}
    b = sum(n for k, n in sizes.items() if k.endswith("/lora_b"))
    a = sum(int(np.prod(np.shape(v))) for v in jax.tree.leaves(variables.get("lora_frozen", {})))
    by_role = T.parameter_counts(params)
    hits = traverse_util.flatten_dict(dd.optim.path_mask(trained)(params), sep="/")
    nonzero = sum(int(np.count_nonzero(np.asarray(v))) for v in flat.values())
    return {
        "diagonal": by_role.diagonal,
        "adapter": a + b,
        "other": by_role.other - b,
        "trained": sum(sizes[k] for k, hit in hits.items() if hit),
        "nonzero": nonzero + a,  # what a masked dense layer keeps (A counted whole)
    }


def row_name(lora_cfg) -> str:
    """The table's name of a fine-tune: ``+ LoRA-FA r=8 (B + values)``, ``+ values, no adapter``."""
    what = "B + values" if bool(lora_cfg.train_values) else "B"
    rank = int(lora_cfg.rank)
    return f"+ LoRA-FA r={rank} ({what})" if rank else "+ values, no adapter"
