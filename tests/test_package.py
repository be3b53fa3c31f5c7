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
