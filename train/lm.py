"""GPT-2 on a byte-level corpus, DynaDiag or a baseline (``method=``: dense, static_diagonals,
static_unstructured, rigl, set, mest); reports validation perplexity.

  python train/lm.py --workdir=runs/lm_fortunes_s90           # mini GPT-2, fortunes, sparsity 0.9
  python train/lm.py --workdir=/tmp/lm_smoke --config=train/configs/gpt2_lm.py:runlocal
      # a smoke run: a tiny GPT-2 ("mu"), 6 steps of batch 8 on windows of 32 bytes
  python train/lm.py --workdir=runs/gpt2s_wt103_s90 \\
      --config=train/configs/gpt2_lm.py:corpus=wikitext,variant=small \\
      --config.data.path=/data/wikitext-103-raw

Corpora: ``auto`` (the default: fortunes where installed, else stdlib; the script prints which),
``fortunes`` (/usr/share/games/fortunes), ``stdlib`` (this Python's standard library sources),
``wikitext`` (WikiText-103 raw files at ``--config.data.path``). Tokens are bytes, so
perplexity is per byte (bits per byte = log2 of it).
"""

from __future__ import annotations

import pathlib
import sys

if __package__ in (None, ""):  # run as a file: make `train` importable from the repository root
    # Appended: the installed dynadiag_jax (with the compiled kernels) must win over the checkout.
    sys.path.append(str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
from absl import app, flags

from dynadiag_jax import data as D
from dynadiag_jax import training as T
from train import baselines, cli, common, finetuning
from train.configs import gpt2_lm

FLAGS = flags.FLAGS


@common.reports_config_errors
def prepare(config):
    """Check the config, corpus and batch sizes; build the model and the token batches.

    Returns ``(method, corpus, train_data, eval_data, example_input, phase, num_steps)``:
    ``method`` is the :class:`train.baselines.Method` that ``config.method`` names, ``phase`` the
    LoRA-FA phase after ``train.num_steps`` (``lora.steps`` > 0) or None, ``num_steps`` the total.

    Raises:
      common.ConfigError: for any of these problems (nothing has been compiled yet).
    """
    common.check_config(config, gpt2_lm.get_config())
    common.check_train_section(config.train)
    if int(config.train.num_steps) < 1:
        raise common.ConfigError(f"train.num_steps must be >= 1, got {config.train.num_steps}")
    common.check_eval_limit(config.data, "eval_windows", "every window")
    common.check_lora_learning_rate(config.lora)
    mesh = T.data_mesh()
    T.check_batch_size(int(config.train.batch_size), mesh, name="train.batch_size")
    T.check_batch_size(int(config.train.eval_batch_size), mesh, name="train.eval_batch_size")
    if int(config.data.seq_len) < 1:
        raise common.ConfigError(f"data.seq_len must be >= 1, got {config.data.seq_len}")
    corpus = D.load_corpus(config.data.corpus, config.data.path or None)
    seq_len, batch = int(config.data.seq_len), int(config.train.batch_size)
    windows = (len(corpus.train) - 1) // seq_len
    if windows >= 1:  # none: TokenWindows says the text is too short for data.seq_len
        common.check_batch_fits(
            batch, windows, f"windows of data.seq_len={seq_len} tokens in {corpus.name}"
        )
    train_data = D.TokenWindows(corpus.train, seq_len, batch, seed=int(config.seed))
    eval_data = D.WindowEvalBatches(
        corpus.valid,
        seq_len,
        int(config.train.eval_batch_size),
        max_windows=int(config.data.eval_windows) or None,
    )
    example = jax.ShapeDtypeStruct((batch, seq_len), jnp.int32)
    method = baselines.from_config(
        config,
        num_steps=int(config.train.num_steps),
        warmup_steps=int(config.optimizer.warmup_steps),
        vocab_size=D.BYTE_VOCAB_SIZE,
        block_size=seq_len,
    )
    common.check_layer_patterns(
        method.model,
        example,
        config.dynadiag,
        block_size=baselines.block_size(method, config.dynadiag),
    )
    phase, num_steps = finetuning.run_phase(
        config,
        method,
        int(config.train.num_steps),
        example,
        vocab_size=D.BYTE_VOCAB_SIZE,
        block_size=seq_len,
    )
    return method, corpus, train_data, eval_data, example, phase, num_steps


def train_and_evaluate(config, workdir, *, progress: bool = True):
    """Train and evaluate as ``config`` says; returns ``(TrainResult, corpus name)``."""
    method, corpus, train_data, eval_data, example, phase, num_steps = prepare(config)
    print(f"corpus: {corpus.name}; {num_steps} steps on {common.device_summary()}")
    result = common.train_from_config(
        config,
        method=method,
        task=T.LanguageModeling(),
        train_data=train_data,
        eval_data=eval_data,
        num_steps=num_steps,
        example_input=example,
        workdir=workdir,
        progress=progress,
        finetune=phase,
    )
    return result, corpus.name


def main(argv):
    del argv
    T.initialize_distributed()
    config = FLAGS.config
    result, corpus = common.run_script(
        lambda: train_and_evaluate(config, FLAGS.workdir, progress=FLAGS.progress)
    )
    report(config, FLAGS.workdir, result, corpus)


def report(config, workdir, result, corpus: str) -> None:
    """Print the run's validation perplexity; after a LoRA-FA phase, also the perplexity at the
    switch (from ``workdir``'s metrics) beside the end's."""
    m = result.eval_metrics
    # the adapters' A (not a param) counted with the params, as fashion_mnist.py and lora_fa.py do
    counts = finetuning.counts(T.variables_of(result.state), [])
    total = counts["diagonal"] + counts["adapter"] + counts["other"]
    adapters = f" ({counts['adapter']:,} in adapters)" if counts["adapter"] else ""
    # at sparsity 0 every method trains the dense model (what its checkpoint records)
    dense = config.method == "dense" or common.sparsity_of(config.dynadiag) == 0.0
    method = "dense" if dense else f"{config.method} at sparsity {config.dynadiag.sparsity:g}"
    if not dense and config.method in baselines.UNSTRUCTURED:  # masked dense kernels
        adapters += f" ({counts['nonzero']:,} non-zero)"
    print(
        f"{corpus}: GPT-2 {config.model.variant}, {method}, "
        f"{total:,} parameters{adapters}: validation perplexity {m['perplexity']:.3f} per byte "
        f"({m['bits_per_token']:.3f} bits/byte, {m['count']:,} bytes)"
        + (f" (resumed at step {result.start_step})" if result.start_step else "")
    )
    if int(config.lora.steps):
        start = int(config.train.num_steps)
        metrics = pathlib.Path(workdir) / "metrics.jsonl"
        before = finetuning.metric_before(metrics, start, "perplexity")
        print(
            f"LoRA-FA phase ({finetuning.row_name(config.lora)}, {config.lora.steps} steps): "
            f"validation perplexity {finetuning.metric_text(before, '.3f')} at step {start} -> "
            f"{m['perplexity']:.3f}"
        )


if __name__ == "__main__":  # flags exist only when run as a script (tests import this module)
    cli.define_config_flag(str(pathlib.Path(gpt2_lm.__file__)))
    flags.DEFINE_string("workdir", "runs/lm", "checkpoints and metrics go here")
    flags.DEFINE_bool("progress", True, "show a progress bar")
    app.run(main, flags_parser=cli.parse_flags)
