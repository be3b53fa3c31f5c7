"""DynaDiag from a dense run's checkpoint (train/sparsify.py): one-shot, or a short fine-tune.

``suite`` takes the model, layers, recipe and data of a classification suite of
``train/configs/results.py`` (mlp, mixer, vit), so the dense runs of ``train/results.py`` feed it
as they are. ``finetune_fraction`` is the fine-tune's length as a fraction of the suite's
from-scratch steps (0: the one-shot model only); ``dynadiag.search_fraction`` of it searches
(0: freeze at once, then train the frozen diagonals).

  python train/sparsify.py --workdir=runs/sparsify_mlp \\
      --config=train/configs/sparsify.py:checkpoint=runs/results/mlp/<dense run>
  python train/sparsify.py --workdir=runs/sparsify_mlp_oneshot \\
      --config=train/configs/sparsify.py:checkpoint=<dense run>,finetune_fraction=0
"""

from train.configs.common import finetune, parse_arg


def get_config(arg=None):
    arg = parse_arg(
        arg,
        checkpoint="",
        suite="mlp",
        sparsity=0.9,
        block_size=1,
        finetune_fraction=0.1,
        runlocal=False,
    )
    config = finetune(arg, selection_every=25)
    # Scale each layer's values so that its K kept diagonals carry the dense kernel's Frobenius
    # norm (dd.from_dense keep_norm): docs/training.md has the measured effect.
    config.keep_norm = True
    # 90% of a trained kernel is gone at once: the fine-tune retrains more than it adjusts, and
    # 1e-2 beat each suite's own rate on the MLP, the Mixer and the ViT (docs/training.md).
    config.optimizer.learning_rate = 1e-2
    return config
