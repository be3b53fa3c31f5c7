"""Run a ``train/`` or ``bench/`` script up to the end of its command-line parsing, then exit 0.

``python tests/doc_command_shim.py SCRIPT ARGS...`` runs ``SCRIPT`` as ``python SCRIPT ARGS...``
would, but absl's ``app.run`` and argparse's ``parse_args`` stop the process with status 0 once
the arguments have parsed: an unknown flag, a ``--config.<key>`` the config lacks or a value of the
wrong type still fails as it would for a user (status 2 and the script's message), and nothing is
trained, loaded or compiled.

``python tests/doc_command_shim.py --batch COMMANDS.json`` does the same for a list of
``[script, args]`` and prints a JSON list of ``[status, stderr]``, one per command: the libraries
every script imports are imported once, and each command runs in a process forked from that one
(a fresh interpreter per command spent most of its seconds importing them again).

``python tests/doc_command_shim.py --batch-run COMMANDS.json`` runs each command to its end the
same way, without stopping after the parse: for commands that a test expects to be refused before
anything is compiled (tests/test_scripts.py), which would otherwise each pay a fresh interpreter.
"""

import argparse
import json
import os
import pathlib
import runpy
import sys
import tempfile
import traceback

from absl import app, flags

_parse_args = argparse.ArgumentParser.parse_args


def _run(main, argv=None, flags_parser=None, **kwargs):
    parse = flags_parser or flags.FLAGS
    parse(sys.argv if argv is None else argv)
    sys.exit(0)


def _parse_and_stop(self, *args, **kwargs):
    _parse_args(self, *args, **kwargs)
    sys.exit(0)


def _run_script(script, script_args):
    """Run ``script`` with ``script_args`` as ``python SCRIPT ARGS...`` would."""
    sys.argv = [script, *script_args]
    sys.path[0] = str(pathlib.Path(script).resolve().parent)  # as `python SCRIPT` sets it
    runpy.run_path(script, run_name="__main__")


def _parse(script, script_args):
    """Run ``script`` with ``script_args`` until its command line has parsed (SystemExit)."""
    app.run = _run
    argparse.ArgumentParser.parse_args = _parse_and_stop
    _run_script(script, script_args)
    sys.exit(f"{script} finished without parsing its command line")


def _status(code):
    """The exit status the interpreter gives ``SystemExit(code)`` (a message goes to stderr)."""
    if code is None or isinstance(code, int):
        return code or 0
    print(code, file=sys.stderr)
    return 1


def _forked(script, script_args, run=_parse):
    """``(status, stderr)`` of ``run`` (``_parse``: up to the parse) in a child forked from this
    process."""
    with tempfile.TemporaryFile("w+") as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(err.fileno(), 2)
            os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
            status = 0  # a script that returns
            try:
                run(script, script_args)
            except SystemExit as stop:
                status = _status(stop.code)
            except BaseException:
                traceback.print_exc()
                status = 1
            sys.stderr.flush()
            os._exit(status)
        _, wait_status = os.waitpid(pid, 0)
        err.seek(0)
        return os.waitstatus_to_exitcode(wait_status), err.read()


def _batch(path, run=_parse):
    import absl.logging  # noqa: F401  (what the scripts import, once for every command)
    import flax.linen  # noqa: F401
    import ml_collections  # noqa: F401
    import optax  # noqa: F401

    import dynadiag_jax.training  # noqa: F401

    commands = json.loads(pathlib.Path(path).read_text())
    print(json.dumps([_forked(script, args, run) for script, args in commands]))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--batch"]:
        _batch(sys.argv[2])
    elif sys.argv[1:2] == ["--batch-run"]:
        _batch(sys.argv[2], _run_script)
    else:
        _parse(sys.argv[1], sys.argv[2:])
