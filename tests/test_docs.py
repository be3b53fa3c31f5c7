"""The docs as a user copies them: every documented command parses, the README's programs run.

Commands are the ``python train/...`` and ``python bench/...`` lines of README.md and docs/*.md,
in code blocks (``\\`` continuations joined, a ``for`` loop's variable set to its first value) and
in inline code. Their placeholders are filled in as ``PLACEHOLDERS`` says (a workdir ``W``, a suite
``S``, ``<seed>``...). Each runs through ``doc_command_shim.py`` (all in one batch, each in a
process of its own), which stops the script once its command line has parsed: a flag the script
no longer has, a ``--config.<key>`` its config lacks or a value of the wrong type fails here as it
would for the reader.
"""

import ast
import inspect
import pathlib
import re
import shlex
import subprocess
import sys

import pytest
from conftest import COMMAND_SHIM, once_per_session, shim_batch

import dynadiag_jax as dd

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))

# (pattern, replacement) over a command's text, in order: the docs' placeholders.
PLACEHOLDERS = (
    (r",<args>", ""),
    (r"<suite>", "mlp"),
    (r"<seed>", "0"),
    (r"<n>", "3"),
    (r"<r>", "8"),
    (r"<methods>", "dynadiag"),
    (r"<fingerprint>", "0"),
    (r"<[^<>]*>", "/tmp/placeholder"),  # a directory: <dir>, <dense run>, <run>, ...
    (r"\[(,[^\]]*)\]", r"\1"),  # an optional argument: [,seeds=10]
    (r"(?<=[=\s])W\d?\b", "/tmp/placeholder"),  # workdirs W, W0, W1, ...
    (r"(?<=[=\s.])S\b", "mlp"),  # a suite: --suite=S, models=S, models.S.x
    (r"(?<==)P\b", "0.9"),
    (r"(?<==)N\b", "3"),
    (r"(?<==)F\b", "0.3"),
    (r"(?<=--block-size )B\b", "16"),
    (r"(?<=--relaxation )R\b", "blocks"),
    (r"\s\.\.\.(?=\s|$)", ""),  # "and so on"
)
_SCRIPT = re.compile(r"(?:train|bench)/\w+\.py")
_PYTHON = re.compile(r"(?:\S*/)?python3?")
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_LOOP = re.compile(r"^\s*for (\w+) in (.+?); do\b")


def _code(path):
    """``(line, text)`` of every code line (continuations joined) and inline span of ``path``."""
    text = path.read_text()
    found = []
    for fence in _FENCE.finditer(text):
        first = text.count("\n", 0, fence.start(1)) + 1
        lines = fence.group(1).split("\n")
        loops = {}
        i = 0
        while i < len(lines):
            start, line = i, lines[i]
            while line.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line.rstrip()[:-1] + " " + lines[i]
            i += 1
            loop = _LOOP.match(line)
            if loop:
                loops[loop.group(1)] = shlex.split(loop.group(2))[0]
            for name, value in loops.items():
                line = line.replace(f"${name}", value)  # unquoted: the shell splits it
            found.append((first + start, line))
    prose = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for span in re.finditer(r"`([^`]+)`", prose):
        found.append((text.count("\n", 0, span.start()) + 1, span.group(1).replace("\n", " ")))
    return found


def _commands():
    """``(id, script, args)`` of every documented command, the first place each is written."""
    out, seen = [], set()
    for path in DOCS:
        for line, text in _code(path):
            if not _SCRIPT.search(text):
                continue
            for pattern, replacement in PLACEHOLDERS:
                text = re.sub(pattern, replacement, text)
            lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            tokens = list(lexer)
            for i, token in enumerate(tokens[:-1]):
                if _PYTHON.fullmatch(token) and _SCRIPT.fullmatch(tokens[i + 1]):
                    args = []
                    for arg in tokens[i + 2 :]:
                        if arg in (")", ";", "&&", "||", "|", "&"):
                            break
                        args.append(arg)
                    if (tokens[i + 1], tuple(args)) not in seen:
                        seen.add((tokens[i + 1], tuple(args)))
                        out.append((f"{path.relative_to(ROOT)}:{line}", tokens[i + 1], args))
    return out


COMMANDS = _commands()


def test_the_docs_have_commands_of_every_kind():
    scripts = {script for _, script, _ in COMMANDS}
    assert len(COMMANDS) > 100
    assert {"train/fashion_mnist.py", "train/imagenet.py", "train/results.py"} <= scripts
    assert {"bench/diag_matmul.py", "bench/suite_step.py"} <= scripts
    # a placeholder, a loop variable and a multi-line inline command were filled in
    args = {" ".join(a) for _, _, a in COMMANDS}
    assert any("--workdir=/tmp/placeholder" in a for a in args)
    assert any("sparsity=0.8" in a or "sparsity=0" in a for a in args)
    assert not any(re.search(r"[<>$]|\bW\b", a) for a in args)


def test_the_shim_refuses_what_a_user_would_get_refused(tmp_path):
    """The check can fail: an unknown override and an unknown argparse flag, alone and in the
    batch, with the same message; a command that parses exits 0 in the batch beside them."""
    refused = [
        ("train/fashion_mnist.py", ["--config.no_such_key=1"]),
        ("bench/diag_matmul.py", ["--no-such-flag"]),
    ]
    parses = ("train/fashion_mnist.py", ["--config.train.epochs=1"])
    batch = shim_batch([*refused, parses], tmp_path, cwd=ROOT)
    assert batch[2] == (0, ""), batch[2]
    for (script, args), (status, stderr) in zip(refused, batch):
        alone = subprocess.run(
            [sys.executable, str(COMMAND_SHIM), script, *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert alone.returncode == 2 == status, alone.stderr[-2000:]
        assert alone.stderr == stderr


@pytest.fixture(scope="session")
def parsed(tmp_path_factory):
    """``{id: (status, stderr)}`` of every documented command, parsed in one batch shared by all
    xdist workers."""
    results = once_per_session(
        tmp_path_factory,
        "documented_commands",
        lambda folder: shim_batch([(s, a) for _, s, a in COMMANDS], folder, cwd=ROOT),
    )
    return {where: tuple(result) for (where, _, _), result in zip(COMMANDS, results)}


@pytest.mark.parametrize("where,script,args", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_documented_command_parses(where, script, args, parsed):
    status, stderr = parsed[where]
    assert status == 0, f"{where}: python {script} {shlex.join(args)}\n{stderr[-2000:]}"


def _python_blocks(path):
    """The ```python blocks of ``path``, as written."""
    blocks = re.finditer(r"^```python\n(.*?)^```", path.read_text(), re.S | re.M)
    return [m.group(1) for m in blocks]


README_BLOCKS = _python_blocks(ROOT / "README.md")


def _readme_block(first_line):
    """The README's python block that starts with ``first_line``."""
    found = [b for b in README_BLOCKS if b.startswith(first_line)]
    assert len(found) == 1, f"{len(found)} README python blocks start with {first_line!r}"
    return found[0]


def test_readme_linen_loop_runs_and_freezes_to_what_its_comments_say(run_python):
    code = _readme_block("import jax, jax.numpy as jnp, optax, flax.linen as nn\n") + (
        "params = frozen['params']['DiagonalDense_0']\n"
        "assert set(variables['params']['DiagonalDense_0']) == {'alpha', 'values', 'bias'}\n"
        "assert {'dynadiag', 'diagonals'} <= set(variables)\n"
        "offsets = frozen['diagonals']['DiagonalDense_0']['offsets']\n"
        "assert params['values'].shape[0] == 79 == offsets.shape[0]\n"
        "y = model.apply(frozen, x)\n"
        "assert y.shape == (128, 10) and bool(jnp.isfinite(y).all())\n"
        "print('ok')\n"
    )
    assert run_python(["-c", code]).stdout.splitlines()[-1] == "ok"


def test_readme_sparsify_lists_the_layers_it_prints_and_from_dense_refit_run(run_python):
    """The sparsify block, then from_dense and refit on a dense Block as the README calls them."""
    listing = _readme_block("import jax, jax.numpy as jnp, flax.linen as nn\n")
    from_dense = _readme_block("dense_variables = ...")
    code = "\n".join(
        [
            listing,
            "dense_variables = Block().init(jax.random.key(1), x)",
            from_dense.split("\n", 1)[1],
            "dense_model, calibration_inputs = Block(), x",
            _readme_block("fitted = dd.refit("),
            "assert jax.tree.structure(fitted) == jax.tree.structure(rescaled)",
            "assert model.apply(one_shot, x).shape == x.shape",
        ]
    )
    printed = run_python(["-c", code]).stdout.splitlines()
    # the comment under the loop shows what it prints: "# path in -> out   (note)"
    shown = [
        re.sub(r"\s{2,}.*", "", line[2:])
        for line in listing.splitlines()
        if re.match(r"# \S+ \(.*\) -> \(", line)
    ]
    assert len(shown) == 4 and all(line in printed for line in shown), printed


def test_readme_nnx_loop_and_its_export_run(run_python):
    code = "\n".join(
        [
            _readme_block("import jax, jax.numpy as jnp, optax\nfrom flax import nnx\n"),
            _readme_block("graphdef, state = nnx.split(frozen)"),
            "y = jax.export.deserialize(blob).call(nnx.to_pure_dict(state), x)",
            "assert jnp.allclose(y, frozen(x), atol=1e-5), float(jnp.abs(y - frozen(x)).max())",
            "print('ok')",
        ]
    )
    assert run_python(["-c", code]).stdout.splitlines()[-1] == "ok"


def test_readme_export_blocks_run(run_python):
    """The two export blocks on a layer of the README's first example."""
    code = "\n".join(
        [
            "import jax, jax.numpy as jnp, dynadiag_jax as dd",
            "layer, x = dd.nn.DiagonalDense(256, sparsity=0.9), jnp.ones((4, 784))",
            "variables = layer.init(jax.random.key(0), x)",
            _readme_block("frozen_layer, frozen = dd.freeze(layer, variables)"),
            "assert jnp.allclose(y, frozen_layer.apply(frozen, x), atol=1e-5)",
            _readme_block('(b,) = jax.export.symbolic_shape("b")'),
            "assert jnp.allclose(y, frozen_layer.apply(frozen, x), atol=1e-5)",
            "x = jnp.ones((7, 784))",
            "assert exported.call(frozen, x).shape == (7, 256)",
            "print('ok')",
        ]
    )
    assert run_python(["-c", code]).stdout.splitlines()[-1] == "ok"


def _dd_calls(code):
    """``(dotted name, keyword names)`` of every ``dd.<...>(...)`` call in ``code``."""
    calls = []
    for node in ast.walk(ast.parse(code)):
        if not isinstance(node, ast.Call):
            continue
        names, func = [], node.func
        while isinstance(func, ast.Attribute):
            names.append(func.attr)
            func = func.value
        if isinstance(func, ast.Name) and func.id == "dd" and names:
            calls.append((".".join(reversed(names)), [k.arg for k in node.keywords if k.arg]))
    return calls


DOC_CALLS = sorted(
    {
        (name, tuple(keywords))
        for path in DOCS
        for block in _python_blocks(path)
        for name, keywords in _dd_calls(block)
    }
)


def test_the_docs_call_the_library_in_their_python_blocks():
    names = {name for name, _ in DOC_CALLS}
    assert {"nn.DiagonalDense", "freeze_tree", "from_dense", "training.Finetune"} <= names


@pytest.mark.parametrize("name,keywords", DOC_CALLS, ids=[f"dd.{n}" for n, _ in DOC_CALLS])
def test_documented_call_names_a_function_and_its_keywords(name, keywords):
    """Every ``dd.X(..., key=...)`` of a python block exists and accepts those keywords."""
    target = dd
    for part in name.split("."):
        target = getattr(target, part)
    signature = inspect.signature(target)
    signature.bind_partial(**dict.fromkeys(keywords))
