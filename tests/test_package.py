"""What ``import dynadiag_jax as dd`` gives: the API, and the training side loaded on first use."""

import importlib

import pytest

import dynadiag_jax as dd

LAZY = ("baselines", "data", "models", "training")


def test_training_subpackages_load_on_first_use(run_python):
    # A fresh process: this one has imported them already (through the tests' other modules).
    code = f"""
import sys
import dynadiag_jax as dd
lazy = {LAZY!r}
loaded = sorted(m for m in sys.modules if m.split(".")[:2] in [["dynadiag_jax", n] for n in lazy])
assert not loaded, loaded
assert set(lazy) <= set(dir(dd)), dir(dd)
assert dd.models.ViT.__module__ == "dynadiag_jax.models.vit"
assert callable(dd.training.train) and callable(dd.baselines.rigl)
assert dd.data.ArrayBatches.__module__.startswith("dynadiag_jax.data")
print("ok")
"""
    assert run_python(["-c", code]).stdout.strip() == "ok"


@pytest.mark.parametrize("name", LAZY)
def test_lazy_subpackage_is_the_module(name):
    assert getattr(dd, name) is importlib.import_module(f"dynadiag_jax.{name}")


def test_unknown_attribute_still_raises():
    with pytest.raises(AttributeError, match="module 'dynadiag_jax' has no attribute 'modles'"):
        dd.modles  # noqa: B018
    assert not hasattr(dd, "modles")


# The experiment harness's dependencies (the `train` extra and what they pull in). absl is not
# among them: flax.linen and optax import absl.logging themselves.
HARNESS_ONLY = (
    "clu",
    "grain",
    "matplotlib",
    "ml_collections",
    "mlxtend",
    "orbax",
    "PIL",
    "tensorboardX",
    "tensorflow",
    "tensorflow_datasets",
    "tqdm",
)


def test_the_layer_library_needs_no_harness_dependency(run_python):
    """In a process where every harness dependency fails to import, the library imports whole,
    trains, freezes, applies and exports a layer, and the harness names the extra it needs."""
    code = f"""
import importlib, importlib.abc, pkgutil, sys

BLOCKED = {HARNESS_ONLY!r}

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{{name}} is blocked")
        return None

sys.meta_path.insert(0, Blocker())

import jax, jax.numpy as jnp, optax
import dynadiag_jax as dd

harness = ("dynadiag_jax.data", "dynadiag_jax.training")
for m in pkgutil.walk_packages(dd.__path__, "dynadiag_jax."):
    if not m.name.startswith(harness):
        importlib.import_module(m.name)

layer = dd.nn.DiagonalDense(32, sparsity=0.75)
x = jax.random.normal(jax.random.key(1), (16, 32))
y = jnp.roll(x, 3, axis=1)
variables = layer.init(jax.random.key(0), x)
tx = dd.optim.diag_optimizer(1e-2, alpha_learning_rate=1e-2)
opt_state = tx.init(variables["params"])

@jax.jit
def step(variables, opt_state, strength):
    variables = dd.nn.set_gate(variables, strength=strength)
    def loss(params):
        return jnp.mean((layer.apply({{**variables, "params": params}}, x) - y) ** 2)
    value, grads = jax.value_and_grad(loss)(variables["params"])
    updates, opt_state = tx.update(grads, opt_state, variables["params"])
    params = optax.apply_updates(variables["params"], updates)
    return {{**variables, "params": params}}, opt_state, value

losses = []
for strength in (1.0, 0.3, 0.1, 0.03, 0.01):
    variables, opt_state, value = step(variables, opt_state, strength)
    losses.append(float(value))
assert losses[-1] < losses[0], losses
frozen = dd.freeze_tree(variables)
assert frozen["diagonals"]["offsets"].shape == (8,), frozen["diagonals"]
out = layer.apply(frozen, x)
assert out.shape == (16, 32) and bool(jnp.isfinite(out).all())
exported = dd.export(lambda v, x: layer.apply(v, x))(frozen, x)
assert jax.export.deserialize(exported.serialize()).call(frozen, x).shape == (16, 32)

for name in harness:
    try:
        importlib.import_module(name)
    except ImportError as e:
        assert 'pip install "dynadiag-jax[train]"' in str(e), e
    else:
        raise AssertionError(name + " imported without its dependencies")
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not loaded, loaded
print("ok")
"""
    assert run_python(["-c", code]).stdout.strip() == "ok"
