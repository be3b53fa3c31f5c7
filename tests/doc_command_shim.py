"""Run a ``train/`` or ``bench/`` script up to the end of its command-line parsing, then exit 0.

``python tests/doc_command_shim.py SCRIPT ARGS...`` runs ``SCRIPT`` as ``python SCRIPT ARGS...``
would, but absl's ``app.run`` and argparse's ``parse_args`` stop the process with status 0 once
the arguments have parsed: an unknown flag, a ``--config.<key>`` the config lacks or a value of the
wrong type still fails as it would for a user (status 2 and the script's message), and nothing is
trained, loaded or compiled.
"""

import argparse
import pathlib
import runpy
import sys

from absl import app, flags

_parse_args = argparse.ArgumentParser.parse_args


def _run(main, argv=None, flags_parser=None, **kwargs):
    parse = flags_parser or flags.FLAGS
    parse(sys.argv if argv is None else argv)
    sys.exit(0)


def _parse_and_stop(self, *args, **kwargs):
    _parse_args(self, *args, **kwargs)
    sys.exit(0)


if __name__ == "__main__":
    script, *script_args = sys.argv[1:]
    app.run = _run
    argparse.ArgumentParser.parse_args = _parse_and_stop
    sys.argv = [script, *script_args]
    sys.path[0] = str(pathlib.Path(script).resolve().parent)  # as `python SCRIPT` sets it
    runpy.run_path(script, run_name="__main__")
    sys.exit(f"{script} finished without parsing its command line")
