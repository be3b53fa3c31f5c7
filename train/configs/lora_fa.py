"""LoRA-FA fine-tuning of a frozen DynaDiag run's checkpoint (train/lora_fa.py).

``suite`` takes the model, layers, recipe and data of a suite of ``train/configs/results.py`` (the
classification suites mlp, mixer, vit, and the byte-level language model gpt), so the DynaDiag runs
of ``train/results.py`` feed it as they are; ``sparsity`` and ``block_size`` must be the run's.
The ``lora`` section (train/finetuning.py): ``rank`` and ``alpha`` set the adapters (scale
``alpha / rank``) on the layers ``lora.layers`` matches (default: the suite's diagonal layers);
``train_values`` also trains the diagonal values (else only ``B``); ``rank=0`` with
``train_values`` is the control without adapters (the diagonal values fine-tuned alone);
``learning_rate`` is the fine-tune's own. ``finetune_fraction`` is the fine-tune's length as a
fraction of the suite's from-scratch steps.

  python train/lora_fa.py --workdir=runs/lora_mlp_r8 \\
      --config=train/configs/lora_fa.py:checkpoint=runs/results/mlp/<dynadiag run>,rank=8
  python train/lora_fa.py --workdir=runs/lora_gpt_r8 \\
      --config=train/configs/lora_fa.py:suite=gpt,checkpoint=runs/results/gpt/<dynadiag run>,rank=8
"""

from train.configs.common import FINETUNE_SUITES, finetune, lora_section, parse_arg


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
    config = finetune(arg, selection_every=0, suites=(*FINETUNE_SUITES, "gpt"))
    # The diagonal layers by default (layers ()); finetune_fraction sets the length.
    config.lora = lora_section(steps=None)
    config.lora.update(
        rank=arg.rank,
        alpha=arg.alpha,
        train_values=arg.train_values,
        learning_rate=arg.learning_rate,
    )
    return config
