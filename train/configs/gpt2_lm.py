"""GPT-2 byte-level language model: dense or DynaDiag (c_attn, c_proj, c_fc, mlp c_proj).

Default: the "mini" size (4 layers, width 128) on a local corpus, sized for a CPU: the Debian
fortunes where installed, else this Python's standard library sources (``corpus=auto``).
GPT-2 small/medium on WikiText-103 (raw files wiki.{train,valid,test}.raw in a directory):

  python train/lm.py --workdir=runs/lm_fortunes_s90
  python train/lm.py --workdir=runs/lm_stdlib \\
      --config=train/configs/gpt2_lm.py:corpus=stdlib,sparsity=0
  python train/lm.py --workdir=runs/lm_rigl90 --config=train/configs/gpt2_lm.py:method=rigl
  python train/lm.py --workdir=/tmp/lm_smoke --config=train/configs/gpt2_lm.py:runlocal  # smoke run
  python train/lm.py --workdir=runs/lm_s90_lora --config.lora.steps=250  # + a LoRA-FA phase
  python train/lm.py --workdir=runs/gpt2s_wt103_s90 \\
      --config=train/configs/gpt2_lm.py:variant=small,corpus=wikitext,sparsity=0.9 \\
      --config.data.path=/data/wikitext-103-raw --config.data.seq_len=1024 \\
      --config.train.batch_size=256 \\
      --config.train.num_steps=100000
"""

import ml_collections

from train.configs.common import dynadiag, given, lora_section, parse_arg, unstructured_defaults

SPARSE_LAYERS = (r".*/attn/(c_attn|c_proj)", r".*/mlp/(c_fc|c_proj)")


def get_config(arg=None):
    typed = given(arg)
    arg = parse_arg(
        arg,
        variant="mini",
        sparsity=0.9,
        corpus="auto",
        gate="sparse_topk",
        block_size=1,
        method="dynadiag",
        runlocal=False,
    )
    config = ml_collections.ConfigDict()
    config.seed = 0
    config.model = dict(name="gpt2", variant=arg.variant, dropout=0.0)
    # sparsity 0: dense; block_size 1: element diagonals
    config.dynadiag = dynadiag(arg.sparsity, SPARSE_LAYERS, arg.gate, arg.block_size)
    # dense | dynadiag | static_diagonals | rigl | set | mest (train/baselines.py): the same layers
    # (dynadiag.layers) at the same sparsity; unstructured methods follow `unstructured`.
    config.method = arg.method
    config.unstructured = unstructured_defaults()
    config.data = dict(corpus=arg.corpus, path="", seq_len=128, eval_windows=256)
    config.train = dict(
        batch_size=16,
        num_steps=1000,
        eval_batch_size=64,
        log_every=50,
        eval_every=500,
        checkpoint_every=500,
        keep_checkpoints=2,
        selection_every=100,
    )
    # A LoRA-FA phase after the run's num_steps (steps 0: none; train/finetuning.py): adapters on
    # the frozen diagonal layers, B (and with train_values the diagonal values) trained.
    config.lora = lora_section()  # layers (): the diagonal layers (dynadiag.layers)
    config.optimizer = dict(
        learning_rate=1e-3,
        end_learning_rate=1e-4,
        warmup_steps=100,
        weight_decay=0.1,
        b1=0.9,
        b2=0.99,
        clip_norm=1.0,
        # the sparse layers' weights' updates times their init's gain (train/baselines.py)
        sparse_lr_scale="init_gain",
    )
    if arg.runlocal:
        if "variant" not in typed:  # runlocal,variant=micro smoke-runs that variant
            config.model.variant = "mu"
        config.unstructured.update_every = 2  # rigl/set/mest update their masks in a short run
        config.data.seq_len = 32
        config.data.eval_windows = 16
        config.train.batch_size = 8
        config.train.eval_batch_size = 8
        config.train.num_steps = 6
        config.train.log_every = 2
        config.train.eval_every = 0
        config.train.checkpoint_every = 2
        config.train.selection_every = 1
        config.optimizer.warmup_steps = 1
    return config
