"""What ``import dynadiag_jax as dd`` gives: the API, and the training side loaded on first use."""

import importlib
import types

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


def test_version_is_the_distributions():
    import importlib.metadata

    assert dd.__version__ == importlib.metadata.version("dynadiag-jax")


@pytest.mark.parametrize(
    "built,running,refused",
    [
        ((0, 1), (0, 3), False),  # older handlers: a newer jaxlib runs them
        ((0, 3), (0, 3), False),
        ((0, 3), (0, 1), True),  # newer handlers: refused, and JAX with them
        ((1, 0), (0, 3), True),
        ((0, 1), None, False),  # no header to read: register, as before the check
    ],
)
def test_handlers_newer_than_the_jaxlib_are_not_registered(monkeypatch, built, running, refused):
    from dynadiag_jax import _extension

    monkeypatch.setattr(_extension, "running_ffi_api", lambda: running)
    module = types.SimpleNamespace(ffi_api=built)
    reason = _extension._refused(module, "the kernels")
    assert (reason is not None) == refused
    if refused:
        assert f"XLA FFI API {built[0]}.{built[1]}" in reason and "jaxlib" in reason


def test_the_running_jaxlib_header_is_read():
    from dynadiag_jax import _extension

    major, minor = _extension.running_ffi_api()
    assert major == 0 and minor >= 1
    if dd.has_cpu_kernels():  # what this build was compiled against runs here
        assert _extension._cpu_ext.ffi_api <= (major, minor)


def test_a_jaxlib_older_than_the_kernels_gets_a_warning_not_a_broken_jax(run_python, tmp_path):
    """A jaxlib refuses FFI handlers compiled against a newer FFI API when its backend starts,
    and then every JAX operation fails: the package leaves them unregistered and says so."""
    if not dd.has_cpu_kernels():
        pytest.skip("no compiled kernels to refuse")
    header = tmp_path / "include" / "xla" / "ffi" / "api" / "c_api.h"
    header.parent.mkdir(parents=True)
    major = dd._extension._cpu_ext.ffi_api[0]
    header.write_text(f"#define XLA_FFI_API_MAJOR {major + 1}\n#define XLA_FFI_API_MINOR 0\n")
    code = f"""
import warnings
import jax, jax.ffi, jax.numpy as jnp
jax.ffi.include_dir = lambda: {str(tmp_path / "include")!r}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import dynadiag_jax as dd
print(*[str(w.message) for w in caught], sep="\\n")
assert not dd.has_cpu_kernels() and "ffi" not in dd.available_impls()
layer = dd.nn.DiagonalDense(32, sparsity=0.75)
x = jnp.ones((4, 32))
y = layer.apply(layer.init(jax.random.key(0), x), x)
assert y.shape == (4, 32) and float(jnp.ones(3).sum()) == 3.0
print("ok")
"""
    out = run_python(["-c", code]).stdout
    assert out.splitlines()[-1] == "ok"
    assert f"newer than this jaxlib's {major + 1}.0" in out and "not registered" in out


def test_cuda_kernels_of_another_cuda_major_than_jaxs_plugin_are_not_registered(
    run_python, tmp_path
):
    """pip's isolated build cannot see JAX's CUDA plugin, so import checks the match again."""
    if not dd.has_cuda_kernels():
        pytest.skip("no CUDA kernels built")
    built = dd._extension._cuda_ext.cuda_runtime_version // 1000
    other = 12 if built != 12 else 13
    info = tmp_path / "site" / f"jax_cuda{other}_plugin-0.10.2.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: jax-cuda{other}-plugin\nVersion: 0.10.2\n"
    )
    code = """
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import dynadiag_jax as dd
print(*[str(w.message) for w in caught], sep="\\n")
assert not dd.has_cuda_kernels() and dd.has_cpu_kernels()
print("ok")
"""
    out = run_python(["-c", code], env={"PYTHONPATH": str(tmp_path / "site")}).stdout
    assert out.splitlines()[-1] == "ok"
    assert f"link the CUDA {built} runtime, but JAX's CUDA plugin is for CUDA {other}" in out


def test_without_the_compiled_modules_the_layers_run_and_ffi_says_why_not(run_python):
    """What `pip install . -C wheel.cmake=false` gives (README, Install)."""
    code = """
import importlib.abc, sys

class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("dynadiag_jax._") and name.endswith("_ext"):
            raise ImportError(f"{name} is not built")
        return None

sys.meta_path.insert(0, Blocker())
import jax, jax.numpy as jnp
import dynadiag_jax as dd
assert dd.available_impls() == ("auto", "dense", "jax"), dd.available_impls()
layer = dd.nn.DiagonalDense(32, sparsity=0.75)
x = jnp.ones((4, 32))
frozen = dd.freeze_tree(layer.init(jax.random.key(0), x))
assert layer.apply(frozen, x).shape == (4, 32)
values, offsets = frozen["params"]["values"], frozen["diagonals"]["offsets"]
for impl in ("ffi", "cuda_emulated"):
    try:
        dd.diag_matmul(x, values, offsets, out_features=32, impl=impl)
    except ValueError as e:
        assert "which this installation does not have" in str(e), e
    else:
        raise AssertionError(impl)
print("ok")
"""
    assert run_python(["-c", code]).stdout.strip() == "ok"
