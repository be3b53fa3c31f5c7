"""DynaDiag from a dense run's checkpoint (train/sparsify.py): one-shot, or a short fine-tune.

``suite`` takes the model, layers, recipe and data of a suite of ``train/configs/results.py``
(mlp, mixer, vit, or gpt: the language model, evaluated by validation perplexity), so the dense
runs of ``train/results.py`` feed it as they are. ``refit_examples`` training examples (images, or
token windows) refit the kept diagonals to the dense layers' outputs (``dd.refit``; 0: keep the
dense entries). ``finetune_fraction`` is the fine-tune's length as a fraction of the suite's
from-scratch steps (0: the one-shot model only); ``dynadiag.search_fraction`` of it searches (0,
the default: freeze at once, then train the frozen diagonals). ``distill`` is the share of the
fine-tune's loss that is distillation from the dense model (``T.Distillation``, at
``distill_temperature``; 0: the labels alone).

  python train/sparsify.py --workdir=runs/sparsify_mlp \\
      --config=train/configs/sparsify.py:checkpoint=runs/results/mlp/<dense run>
  python train/sparsify.py --workdir=runs/sparsify_mlp_oneshot \\
      --config=train/configs/sparsify.py:checkpoint=<dense run>,finetune_fraction=0
"""

from train.configs.common import FINETUNE_SUITES, finetune, parse_arg


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
    config = finetune(arg, selection_every=25, suites=(*FINETUNE_SUITES, "gpt"))
    # Scale each layer's values so that its K kept diagonals carry the dense kernel's Frobenius
    # norm (dd.from_dense keep_norm): docs/training.md has the measured effect.
    config.keep_norm = True
    # Refit the kept diagonals to the dense layers' outputs on this many training examples
    # (dd.refit, ridge relative to the activations' scale; 0 examples: no refit). The fine-tune
    # then starts frozen (a search would re-mix every diagonal and lose the fit).
    config.refit_examples = 2048
    config.refit_ridge = 1e-3
    config.dynadiag.search_fraction = 0.0
    # The fine-tune also learns from the dense model's outputs (knowledge distillation: this share
    # of the loss is the cross-entropy to its softened predictions; 0: labels only).
    config.distill = 0.9
    config.distill_temperature = 2.0
    # 90% of a trained kernel is gone at once: the fine-tune retrains more than it adjusts, and
    # 1e-2 beat lower rates on every suite (docs/training.md, "From a dense checkpoint").
    config.optimizer.learning_rate = 1e-2
    # The values start from the dense kernel's entries (keep_norm, refit), not from the sparse
    # init whose gain init_gain makes up for: their updates are not scaled up (x3.16 at 90% cost
    # the MLP 0.26 points, seed 0: 86.86 against 87.12).
    config.optimizer.sparse_lr_scale = "none"
    return config
