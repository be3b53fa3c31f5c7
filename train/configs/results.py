"""Every method on four suites: docs/RESULTS.md's numbers.

Each suite (a model and its data) trains every method with one recipe (AdamW, cosine learning
rate); unstructured methods use RigL's schedule:

* ``mlp``: the authors' MLP 784-256-256-10 on Fashion-MNIST (hidden layers sparse, head dense),
  the authors' MNIST recipe;
* ``mixer``: a small MLP-Mixer on Fashion-MNIST (``mu/7``: 16 tokens of 7x7 patches, 2 blocks;
  token- and channel-mixing MLPs sparse; stem and head dense);
* ``vit``: a small ViT on Fashion-MNIST (``mini/7``: width 160, 2 blocks, 16 patches of 7x7; qkv,
  proj, fc1, fc2 sparse; patch embedding and head dense);
* ``gpt``: a small byte-level GPT (``micro``: width 160, 2 blocks) on a local corpus (the Debian
  fortunes where installed, else the Python standard library's sources); c_attn, c_proj, c_fc and
  the MLP's c_proj sparse; embeddings (tied head) dense. Validation perplexity and bits per byte.

Per suite: ``methods`` train at every sparsity (the element methods, and those with an input
permutation, ``<method>_random_perm`` or ``<method>_learned_perm``, on element diagonals and
blocks of 16), ``goal_methods`` (block diagonals, ``dynadiag_b<b>``, and LoRA-FA) only at
``goal_sparsity``; ``seeds`` seeds at the goal sparsity (and dense), ``sweep_seeds`` at the
others. An image suite trains ``epochs`` epochs unless ``steps``
is above 0 (a control trained as long as a LoRA-FA row: ``--config.models.vit.steps=1171``).
``<method>_lorafa_r<r>`` (the MLP's, ViT's and GPT's
``goal_methods`` at r = 4, 8, 16) is the diagonal method trained as usual, then a LoRA-FA phase of
rank ``r`` (train/finetuning.py) on its frozen model for ``lora.fraction`` of the run's steps
*more*: ``B`` alone (``lora.train_values``) at ``lora.learning_rate``, adapters of scale
``lora.alpha / r`` on every diagonal layer (``dynadiag.layers``). The widths of the ViT and the
GPT are multiples of 16 with 10 block-diagonal candidates per layer, so blocks of 16 keep exactly
10% of each layer at 90%.

  python train/results.py                                          # every suite
  python train/results.py --suite=vit,gpt                          # the transformer suites
  python train/results.py --config=train/configs/results.py:quick  # smoke run (1 seed, short)
  python train/results.py --config=train/configs/results.py:seeds=5,methods=dense+rigl
"""

import ml_collections

from train.configs.common import (
    SHORT_SEARCH,
    dynadiag,
    lora_section,
    parse_arg,
    unstructured_defaults,
)

SUITES = ("mlp", "mixer", "vit", "gpt")
# static_unstructured: RigL's and SET's first mask, never updated (what their updates add);
# the last entry, MEST, is the MLP's and the Mixer's only.
ELEMENT_METHODS = (
    "dense",
    "dynadiag",
    "static_diagonals",
    "static_unstructured",
    "rigl",
    "set",
    "mest",
)
# An input permutation in front of the diagonals (PA-DST), learned or fixed at random (the control
# that says whether learning it matters), on element diagonals and blocks of 16.
PERMUTED_METHODS = (
    "dynadiag_learned_perm",
    "dynadiag_random_perm",
    "static_diagonals_random_perm",
    "dynadiag_b16_learned_perm",
    "dynadiag_b16_random_perm",
)
# DynaDiag and a LoRA-FA phase after it (adapters counted in the density).
LORA_METHODS = ("dynadiag_lorafa_r4", "dynadiag_lorafa_r8", "dynadiag_lorafa_r16")
GOAL_SPARSITY = 0.9


def _lora(fraction=0.25):
    """A suite's ``lora`` section: train/finetuning.py's defaults (the rank is the method's, the
    layers the suite's diagonal ones) and ``fraction``, the phase's length as a fraction of the
    run's steps (train/lora_fa.py's default fine-tune length)."""
    section = lora_section(steps=None)
    del section["rank"], section["layers"]
    return dict(section, fraction=fraction)


def _optimizer(learning_rate, weight_decay, **overrides):
    return dict(
        dict(
            learning_rate=learning_rate,
            end_learning_rate=1e-5,
            warmup_steps=0,
            weight_decay=weight_decay,
            b1=0.9,
            b2=0.999,
            clip_norm=0.0,
            label_smoothing=0.0,
            # "init_gain": the sparse layers' weights take updates scaled by their init's gain
            # over the dense layer's (train/baselines.py SPARSE_LR_SCALES; docs/selection.md,
            # "The sparse weights' learning rate"); "none": the same updates as the dense layers
            sparse_lr_scale="init_gain",
        ),
        **overrides,
    )


def _suites():
    sparsities = (0.8, 0.9, 0.95)
    return dict(
        mlp=dict(
            task="classification",
            model=dict(name="mlp", hidden=(256, 256)),
            dynadiag=dynadiag(0.0, (r"hidden_\d+",), search_fraction=SHORT_SEARCH),
            optimizer=_optimizer(1e-3, 1e-4),
            batch_size=128,
            epochs=8,
            steps=0,  # > 0: this many steps instead of `epochs` (a same-steps control)
            seeds=3,
            sweep_seeds=3,
            sparsities=sparsities,
            methods=(*ELEMENT_METHODS, *PERMUTED_METHODS),
            # b = 32 does not divide the 784 inputs.
            goal_methods=("dynadiag_b8", "dynadiag_b16", *LORA_METHODS),
            inference_batches=(1, 256),
            lora=_lora(),
        ),
        mixer=dict(
            task="classification",
            model=dict(name="mixer", variant="mu/7"),
            dynadiag=dynadiag(
                0.0,
                (r".*/(token_mixing|channel_mixing)/(fc1|fc2)",),
                search_fraction=SHORT_SEARCH,
            ),
            optimizer=_optimizer(2e-3, 0.05),
            batch_size=128,
            epochs=4,
            steps=0,  # > 0: this many steps instead of `epochs` (a same-steps control)
            seeds=3,
            sweep_seeds=3,
            sparsities=sparsities,
            methods=(*ELEMENT_METHODS, *PERMUTED_METHODS),
            # b = 32 does not divide the 16-token mixing layers.
            goal_methods=("dynadiag_b8", "dynadiag_b16"),
            inference_batches=(1, 256),
            lora=_lora(),
        ),
        vit=dict(
            task="classification",
            model=dict(name="vit", variant="mini/7"),
            dynadiag=dynadiag(0.0, (r".*/attn/(qkv|proj)", r".*/mlp/(fc1|fc2)")),
            optimizer=_optimizer(1e-3, 0.05, warmup_steps=50, label_smoothing=0.1),
            batch_size=64,
            epochs=1,
            steps=0,  # > 0: this many steps instead of `epochs` (a same-steps control)
            seeds=3,
            sweep_seeds=1,
            sparsities=sparsities,
            methods=(*ELEMENT_METHODS[:-1], *PERMUTED_METHODS),
            goal_methods=("dynadiag_b16", *LORA_METHODS),
            inference_batches=(1, 256),
            lora=_lora(),
        ),
        gpt=dict(
            task="language_modeling",
            model=dict(name="gpt2", variant="micro", dropout=0.0),
            dynadiag=dynadiag(0.0, (r".*/attn/(c_attn|c_proj)", r".*/mlp/(c_fc|c_proj)")),
            optimizer=_optimizer(
                2e-3, 0.1, end_learning_rate=1e-4, warmup_steps=50, b2=0.99, clip_norm=1.0
            ),
            batch_size=16,
            steps=600,
            seq_len=64,
            eval_windows=512,
            eval_batch_size=64,
            eval_every=100,  # the validation curve of the report's plot
            seeds=2,
            sweep_seeds=1,
            sparsities=sparsities,
            methods=(*ELEMENT_METHODS[:-1], *PERMUTED_METHODS),
            goal_methods=("dynadiag_b16", *LORA_METHODS),
            inference_batches=(1, 16),
            lora=_lora(),
        ),
    )


def get_config(arg=None):
    # Lists inside the argument string are "+"-separated (commas separate the arguments). An empty
    # seeds/methods/sparsities keeps each suite's own; a value replaces it in every suite.
    arg = parse_arg(arg, quick=False, seeds="", models="+".join(SUITES), methods="", sparsities="")
    if arg.seeds and not (arg.seeds.isdigit() and int(arg.seeds) >= 1):
        raise ValueError(f"config argument seeds={arg.seeds!r} must be an int >= 1")
    config = ml_collections.ConfigDict()
    config.goal_sparsity = GOAL_SPARSITY
    # Images for the classification suites, a byte-level corpus for the language model (path: the
    # wikitext corpus's directory, or another directory for the others; "" their default).
    config.data = dict(source="auto", data_dir="", corpus="auto", path="")
    all_models = _suites()
    unknown = sorted(set(arg.models.split("+")) - set(all_models))
    if unknown:
        raise ValueError(f"unknown models {unknown}; known: {', '.join(all_models)}")
    config.models = {name: all_models[name] for name in arg.models.split("+")}
    for m in config.models.values():
        if arg.seeds:
            m.seeds = m.sweep_seeds = int(arg.seeds)
        if arg.methods:
            m.methods = tuple(arg.methods.split("+"))
            m.goal_methods = ()
        if arg.sparsities:
            m.sparsities = tuple(float(s) for s in arg.sparsities.split("+"))
    config.unstructured = unstructured_defaults()
    config.eval_batch_size = 1000  # image suites; the last batch is padded; a multiple of devices
    # Timing: every method's jitted step on one fixed batch (the suite's training batch),
    # interleaved, median of `repeats`; the clean runs (dense, static diagonals and DynaDiag
    # trained once more, train/results_runs.py) `clean_repeats` times each, the fastest kept.
    config.speed = dict(repeats=40, warmup=5, clean_repeats=3)
    if arg.quick:
        for m in config.models.values():
            if not arg.seeds:  # quick,seeds=2 keeps its 2 seeds
                m.seeds = m.sweep_seeds = 1
            if "epochs" in m:
                m.epochs = 1
            else:
                m.steps, m.eval_every = 200, 50
        config.speed.repeats = 5
        config.speed.clean_repeats = 1
    return config
