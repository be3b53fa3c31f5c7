"""Every method on Fashion-MNIST at 80/90/95% sparsity, several seeds: docs/RESULTS.md's numbers.

Two models, each trained with one recipe for every method (AdamW, cosine learning rate; the
authors' MNIST recipe for the MLP): the authors' MLP 784-256-256-10 (hidden layers sparse, head
dense), and a small MLP-Mixer (``mu/7``: 16 tokens of 7x7 patches, 2 blocks; token- and
channel-mixing MLPs sparse; stem and head dense). Unstructured methods use RigL's schedule.

  python train/results.py                                          # everything (tens of minutes)
  python train/results.py --config=train/configs/results.py:quick      # smoke run: 1 seed, 1 epoch
  python train/results.py --config=train/configs/results.py:seeds=5,models=mlp,methods=dense+rigl
"""

import ml_collections

from train.baselines import METHODS, unstructured_defaults
from train.configs.common import dynadiag, parse_arg


def _optimizer(learning_rate, weight_decay):
    return dict(
        learning_rate=learning_rate,
        end_learning_rate=1e-5,
        warmup_steps=0,
        weight_decay=weight_decay,
        b1=0.9,
        b2=0.999,
        clip_norm=0.0,
        label_smoothing=0.0,
    )


def get_config(arg=None):
    # Lists inside the argument string are "+"-separated (commas separate the arguments).
    arg = parse_arg(
        arg,
        quick=False,
        seeds=3,
        models="mlp+mixer",
        methods="+".join(METHODS),
        sparsities="0.8+0.9+0.95",
    )
    config = ml_collections.ConfigDict()
    config.seeds = 1 if arg.quick else arg.seeds
    config.methods = tuple(arg.methods.split("+"))
    config.sparsities = tuple(float(s) for s in arg.sparsities.split("+"))
    config.data = dict(source="auto", data_dir="")
    all_models = dict(
        mlp=dict(
            model=dict(name="mlp", hidden=(256, 256)),
            dynadiag=dynadiag(0.0, (r"hidden_\d+",)),
            optimizer=_optimizer(1e-3, 1e-4),
            batch_size=128,
            epochs=8,
        ),
        mixer=dict(
            model=dict(name="mixer", variant="mu/7"),
            dynadiag=dynadiag(0.0, (r".*/(token_mixing|channel_mixing)/(fc1|fc2)",)),
            optimizer=_optimizer(2e-3, 0.05),
            batch_size=128,
            epochs=4,
        ),
    )
    unknown = sorted(set(arg.models.split("+")) - set(all_models))
    if unknown:
        raise ValueError(f"unknown models {unknown}; known: {', '.join(all_models)}")
    config.models = {name: all_models[name] for name in arg.models.split("+")}
    config.unstructured = unstructured_defaults()
    config.eval_batch_size = 1000  # the last batch is padded; a multiple of the device count
    # Timing: every method's jitted step on one fixed batch, interleaved, median of `repeats`.
    config.speed = dict(train_batch=128, inference_batches=(1, 256), repeats=40, warmup=5)
    if arg.quick:
        for m in config.models.values():
            m.epochs = 1
        config.speed.repeats = 5
    return config
