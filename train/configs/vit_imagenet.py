"""ViT on ImageNet-1k, DeiT recipe (docs/design.md section 9): dense or DynaDiag at any sparsity.

300 epochs, AdamW lr 1e-3 at batch 1024 (5 warm-up epochs, cosine decay), weight decay 0.05 (none
on alpha, biases, norms, position embedding, class token), label smoothing 0.1, RandAugment
(m9, mstd 0.5), mixup 0.8 / cutmix 1.0, drop path 0.1. DynaDiag: qkv, proj, fc1, fc2 of every
block; search phase = the first 30% of steps, then the selection freezes.

  python train/imagenet.py --workdir=runs/vit_b16_dense \\
      --config=train/configs/vit_imagenet.py:variant=B/16,sparsity=0 \\
      --config.data.data_dir=$TFDS_DATA_DIR
  python train/imagenet.py --workdir=runs/vit_b16_s90 \\
      --config=train/configs/vit_imagenet.py:variant=B/16,sparsity=0.9 \\
      --config.data.data_dir=$TFDS_DATA_DIR
  python train/imagenet.py --workdir=runs/vit_b16_rigl90 \\
      --config=train/configs/vit_imagenet.py:variant=B/16,sparsity=0.9,method=rigl \\
      --config.data.data_dir=$TFDS_DATA_DIR
  (variants: B/16, S/16, Ti/16; sparsity: 0 (dense), 0.8, 0.9, 0.95; method: dynadiag,
  static_diagonals, static_unstructured, rigl, set, mest)
  python train/imagenet.py --workdir=/tmp/vit_smoke --config=train/configs/vit_imagenet.py:runlocal
  python train/imagenet.py --workdir=/tmp/vit_b16_fake \\
      --config=train/configs/vit_imagenet.py:variant=B/16,sparsity=0.9 \\
      --config.data.fake_examples=4096 --config.train.num_steps=100
  (no data needed: runlocal is a tiny ViT on 64 random images; data.fake_examples=N trains on N
  random images per split, to try or time a command on a machine without ImageNet)

On a GPU every sparse layer runs at dense speed: with dynadiag.impl="auto", element diagonals (the
default block_size=1) run as W built on the device + XLA's dot, by design (scattered diagonals
cannot beat cuBLAS). block_size=16 or 32 are no faster today: the GPU cost model, which counts the
instructions the compiled CUDA kernels issue, predicts none at 90% with the 1.25x over dense that
"auto" asks for (the kernels at 1.14x forward / 0.81x step of cuBLAS for ViT-B/16's fc1 at 90%,
b=16, bfloat16, H100; 1.07x / 0.87x at b=32), so "auto" takes the dense path for them too.
The fastest GPU command predicted is therefore the sparsity=0.9 one above, at about the dense
step time plus the search's gate work; the script prints the path and predicted speed of every
sparse layer at start-up (docs/gpu_cost_model.md). On CPU the C++ kernels run (docs/RESULTS.md).
"""

import ml_collections

from train.configs.common import dynadiag, given, parse_arg, unstructured_defaults

SPARSE_LAYERS = (r".*/attn/(qkv|proj)", r".*/mlp/(fc1|fc2)")


def get_config(arg=None):
    typed = given(arg)
    arg = parse_arg(
        arg,
        variant="B/16",
        sparsity=0.9,
        gate="sparse_topk",
        block_size=1,
        method="dynadiag",
        runlocal=False,
    )
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.model = dict(name="vit", variant=arg.variant, drop_path=0.1, dropout=0.0)
    # sparsity 0: dense; block_size 1: element diagonals
    config.dynadiag = dynadiag(arg.sparsity, SPARSE_LAYERS, arg.gate, arg.block_size)
    # dense | dynadiag | static_diagonals | rigl | set | mest (train/baselines.py): the same layers
    # (dynadiag.layers) at the same sparsity; unstructured methods follow `unstructured`.
    config.method = arg.method
    config.unstructured = unstructured_defaults()
    config.data = dict(
        data_dir="",
        train_split="train",
        eval_split="validation",
        image_size=224,
        randaugment=dict(num_ops=2, magnitude=9.0, magnitude_std=0.5, prob=0.5),
        num_threads=16,
        prefetch=512,
        eval_max_examples=0,
        # > 0: this many random images per split instead of ImageNet (no data_dir): a command runs
        # anywhere, at ImageNet's cost per step, and learns nothing
        fake_examples=0,
    )
    config.mixup = dict(mixup_alpha=0.8, cutmix_alpha=1.0, switch_prob=0.5, prob=1.0)
    config.train = dict(
        batch_size=1024,
        epochs=300,
        num_steps=0,  # num_steps > 0 overrides epochs
        eval_batch_size=1000,
        log_every=100,
        eval_every=5000,
        checkpoint_every=1000,
        keep_checkpoints=3,
        selection_every=1000,
    )
    config.optimizer = dict(
        learning_rate=1e-3,
        end_learning_rate=1e-5,
        warmup_epochs=5,
        weight_decay=0.05,
        b1=0.9,
        b2=0.999,
        clip_norm=0.0,
        label_smoothing=0.1,
        # the sparse layers' weights' updates times their init's gain (train/baselines.py)
        sparse_lr_scale="init_gain",
    )
    if arg.runlocal:  # a smoke run: tiny model, small images, a few steps, no data needed
        if "variant" not in typed:  # runlocal,variant=S/16 smoke-runs that variant
            config.model.variant = "mu/4"
        config.unstructured.update_every = 2  # rigl/set/mest update their masks in a short run
        config.data.image_size = 32
        config.data.fake_examples = 64
        config.data.num_threads = 2
        config.data.prefetch = 16
        config.data.eval_max_examples = 16
        config.train.batch_size = 8
        config.train.eval_batch_size = 8
        config.train.num_steps = 6
        config.train.log_every = 2
        config.train.eval_every = 0
        config.train.checkpoint_every = 2
        config.train.selection_every = 1
        config.optimizer.warmup_epochs = 0
    return config
