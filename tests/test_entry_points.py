"""The train/ scripts, run as the README runs them, import the dynadiag_jax that has the kernels.

A script run from the repository root puts the checkout on ``sys.path``; a non-editable install
keeps the compiled modules in site-packages only, so a checkout placed first would shadow them and
every diagonal product would silently take the pure-JAX path. The package warns in that case.
"""

import ast
import os
import pathlib
import subprocess
import sys
import warnings

import pytest

import dynadiag_jax as dd

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = ("fashion_mnist.py", "imagenet.py", "lm.py", "results.py", "unedited_vit.py")


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_imports_the_compiled_kernels(script):
    if not dd.has_cpu_kernels():
        pytest.skip("this installation has no compiled kernels to lose")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", f"train/{script}", "--helpshort"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # absl exits with status 1 after --helpshort; the import happened before it.
    assert "Traceback" not in proc.stderr and "--helpfull" in proc.stdout, proc.stderr[-3000:]


def test_a_checkout_that_shadows_the_kernels_warns(tmp_path):
    if not dd.has_cpu_kernels():
        pytest.skip("this installation has no compiled kernels to lose")
    installed = pathlib.Path(dd.__file__).resolve().parent
    if installed.parent == ROOT or any((ROOT / "dynadiag_jax").glob("_cpu_ext*")):
        pytest.skip("the checkout itself holds the compiled kernels (scripts/dev_build.sh)")
    code = "import dynadiag_jax as dd; print(dd.available_impls())"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "has no compiled kernels" in proc.stderr and str(installed) in proc.stderr
    assert "'ffi'" not in proc.stdout
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "ffi" in dd.available_impls()  # the tests' own import is the installed one


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_prints_the_docstring_as_written_and_the_config_flag(script):
    """``--help``: absl formats the docstring with ``%``, which turned "90% sparse" into
    "90train/fashion_mnist.pyparse"; ``--config`` was listed only by ``--helpfull``."""
    doc = ast.get_docstring(ast.parse((ROOT / "train" / script).read_text()), clean=False)
    proc = subprocess.run(
        [sys.executable, f"train/{script}", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    for line in doc.strip().splitlines():
        assert line in proc.stdout, line
    assert "--config: config file and its arguments" in proc.stdout, proc.stdout[-2000:]
    if script == "lm.py":
        assert "gpt2_lm.py:runlocal" in proc.stdout
