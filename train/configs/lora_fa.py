"""LoRA-FA fine-tuning of a frozen DynaDiag run's checkpoint (train/lora_fa.py).

``suite`` takes the model, layers, recipe and data of a classification suite of
``train/configs/results.py`` (mlp, mixer, vit), so the DynaDiag runs of ``train/results.py`` feed
it as they are; ``sparsity`` and ``block_size`` must be the run's. ``rank`` and ``alpha`` set the
adapters (scale ``alpha / rank``) on the layers ``lora.layers`` matches (default: the suite's
diagonal layers); ``train_values`` also trains the diagonal values (else only ``B``); ``rank=0``
with ``train_values`` is the control without adapters (the diagonal values fine-tuned alone).
``finetune_fraction`` is the fine-tune's length as a fraction of the suite's from-scratch steps.

  python train/lora_fa.py --workdir=runs/lora_mlp_r8 \\
      --config=train/configs/lora_fa.py:checkpoint=runs/results/mlp/<dynadiag run>,rank=8
"""

from train.configs.common import finetune, parse_arg


def get_config(arg=None):
    arg = parse_arg(
        arg,
        checkpoint="",
        suite="mlp",
        sparsity=0.9,
        block_size=1,
        rank=8,
        alpha=16.0,
        train_values=False,
        learning_rate=1e-2,
        finetune_fraction=0.25,
        runlocal=False,
    )
    config = finetune(arg, selection_every=0)
    config.lora = dict(
        rank=arg.rank,
        alpha=arg.alpha,
        # Path regexes as dynadiag.layers; the diagonal layers by default.
        layers=list(config.dynadiag.layers),
        train_values=arg.train_values,
    )
    # The fine-tune's own rate (B starts at zero: no warm-up needed); 1e-2 beat the suite's 1e-3
    # on the MLP at r = 8 and 16 (docs/training.md).
    config.optimizer.update(learning_rate=arg.learning_rate, warmup_steps=0)
    return config
