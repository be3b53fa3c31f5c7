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

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

import dynadiag_jax as dd
from dynadiag_jax import training as T
from train import baselines, common


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
    model = (
        dd.nn.lora_fa(base, tuple(lora_cfg.layers), rank=rank, alpha=float(lora_cfg.alpha))
        if rank
        else base
    )
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


def counts(variables, trained: list[str]) -> dict[str, int]:
    """Weights of ``variables`` by role: diagonal values, adapters (``A`` + ``B``), the rest, and
    the ones the fine-tune trains."""
    params = variables["params"]
    flat = traverse_util.flatten_dict(params, sep="/")
    sizes = {k: int(np.prod(np.shape(v))) for k, v in flat.items()}
    b = sum(n for k, n in sizes.items() if k.endswith("/lora_b"))
    a = sum(int(np.prod(np.shape(v))) for v in jax.tree.leaves(variables.get("lora_frozen", {})))
    by_role = T.parameter_counts(params)
    hits = traverse_util.flatten_dict(dd.optim.path_mask(trained)(params), sep="/")
    return {
        "diagonal": by_role.diagonal,
        "adapter": a + b,
        "other": by_role.other - b,
        "trained": sum(sizes[k] for k, hit in hits.items() if hit),
    }


def row_name(lora_cfg) -> str:
    """The table's name of a fine-tune: ``+ LoRA-FA r=8 (B + values)``, ``+ values, no adapter``."""
    what = "B + values" if bool(lora_cfg.train_values) else "B"
    rank = int(lora_cfg.rank)
    return f"+ LoRA-FA r={rank} ({what})" if rank else "+ values, no adapter"
