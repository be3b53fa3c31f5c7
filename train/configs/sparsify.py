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

import ml_collections

from train.configs import results
from train.configs.common import parse_arg

SUITES = ("mlp", "mixer", "vit")


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
    if arg.suite not in SUITES:
        raise ValueError(f"unknown suite {arg.suite!r}; known: {', '.join(SUITES)}")
    suite = results.get_config(f"models={arg.suite}").models[arg.suite]
    config = ml_collections.ConfigDict()
    # The dense run's workdir (or its checkpoints/ directory) and the step (0: the newest).
    config.checkpoint = arg.checkpoint
    config.step = 0
    config.seed = 0
    config.model = suite.model.to_dict()
    # Scale each layer's values so that its K kept diagonals carry the dense kernel's Frobenius
    # norm (dd.from_dense keep_norm): docs/training.md has the measured effect.
    config.keep_norm = True
    config.dynadiag = suite.dynadiag.to_dict()
    config.dynadiag.update(sparsity=arg.sparsity, block_size=arg.block_size)
    config.data = dict(source="auto", data_dir="")
    config.train = dict(
        batch_size=suite.batch_size,
        eval_batch_size=1000,
        epochs=suite.epochs,  # the from-scratch run's length, which finetune_fraction scales
        finetune_fraction=arg.finetune_fraction,
        log_every=50,
        eval_every=0,
        selection_every=25,
        checkpoint_every=0,
        keep_checkpoints=1,
    )
    config.optimizer = suite.optimizer.to_dict()
    # 90% of a trained kernel is gone at once: the fine-tune retrains more than it adjusts, and
    # 1e-2 beat each suite's own rate on the MLP, the Mixer and the ViT (docs/training.md).
    config.optimizer.learning_rate = 1e-2
    if arg.runlocal:
        config.data.source = "mnist5k"
        config.train.epochs = 1
    return config
