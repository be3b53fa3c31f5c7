"""The training scripts' command line: the ``--config`` flag, checked before anything is built.

ml_collections reports a bad override or config argument with a traceback (an unknown
``--config.<key>``) or with its own message and status 1. :func:`define_config_flag` first checks
the command line itself: the config file and its argument (``--config=path:key=value,...``), every
``--config.<key>=<value>`` override (the key exists, the value parses as the entry's type);
:func:`parse_flags` (``app.run``'s ``flags_parser``) reports whatever absl still rejects. Either
way the script prints one line, ``error: ...``, and exits with status 2 (:func:`common.die`),
before the data is loaded or anything is compiled.
"""

from __future__ import annotations

import difflib
import importlib.util
import os
import pathlib
import re
import sys
from collections.abc import Sequence

import ml_collections
from absl import flags
from ml_collections import config_flags
from ml_collections.config_flags import tuple_parser

from train import common
from train.configs.common import did_you_mean

FLAG = "config"
# The parsers ml_collections uses for these entry types (config_flags._FIELD_TYPE_TO_PARSER).
# Tuples go through its TupleParser, their elements checked against the default's; other entries
# (sections, None) are left to ml_collections and :func:`parse_flags`.
_PARSERS = {
    bool: (flags.BooleanParser(), "true or false"),
    int: (flags.IntegerParser(), "an int"),
    float: (flags.FloatParser(), "a number"),
}
_ELEMENTS = {bool: "booleans", int: "ints", float: "numbers", str: "strings"}


def define_config_flag(
    default: str | None,
    help_text: str = "config file and its arguments, path[:key=value,...]; "
    "--config.<key>=<value> overrides one entry",
    *,
    argv: Sequence[str] | None = None,
    flag_values: flags.FlagValues = flags.FLAGS,
):
    """``config_flags.DEFINE_config_file("config", default, lock_config=True)``, after
    :func:`check_command_line` on ``argv`` (default ``sys.argv``; a problem exits with status 2).

    The flag reads its overrides from ``argv`` with ``--config`` moved first
    (:func:`config_first`), so they may be typed before it."""
    argv = sys.argv if argv is None else list(argv)
    try:
        check_command_line(argv, default)
    except common.ConfigError as e:
        common.die(str(e))
    holder = config_flags.DEFINE_config_file(
        FLAG,
        default,
        help_text,
        flag_values=flag_values,
        lock_config=True,
        sys_argv=config_first(argv),
    )
    # --help lists the main module's key flags only; defined here, --config would be in --helpfull.
    flag_values.register_key_flag_for_module(argv[0], flag_values[FLAG])
    return holder


def parse_flags(argv: list[str]) -> list[str]:
    """``app.run``'s ``flags_parser``: absl's flag errors as one line and status 2.

    ``--config`` is read before the ``--config.<key>`` overrides wherever it was typed (see
    :func:`config_first`). An empty ``--workdir=`` is refused; a ``~`` in it is expanded.
    """
    try:
        rest = flags.FLAGS(config_first(argv))
    except flags.Error as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        common.die(lines[-1] if lines else type(e).__name__)
    # An empty --workdir= would write into the current directory, or save nothing (T.train).
    workdir = flags.FLAGS["workdir"].value if "workdir" in flags.FLAGS else None
    if workdir is not None and not workdir.strip():
        common.die("--workdir is empty: give the directory for the run's checkpoints and logs")
    if workdir is not None:
        # the shell leaves a ~ after "--workdir=" as it is: a directory named "~" was made
        flags.FLAGS.workdir = os.path.expanduser(workdir)
    return rest


def config_first(argv: Sequence[str]) -> list[str]:
    """``argv`` with its ``--config`` arguments moved before the first ``--config.<key>``
    override, the rest in order.

    ml_collections applies an override as absl reads it, so it refuses one typed before the
    config it overrides ("Found --config.seed=0 in argv before a value for --config was
    specified"); the overrides apply to the config the command line selects either way.
    """
    argv = list(argv)
    end = argv.index("--") if "--" in argv else len(argv)
    config, rest = [], []
    i = 1
    while i < end:
        arg = argv[i]
        if re.fullmatch(rf"--?{FLAG}=.*", arg, re.DOTALL):
            config.append(arg)
        elif re.fullmatch(rf"--?{FLAG}", arg):
            config += argv[i : i + 2]
            i += 1
        else:
            rest.append(arg)
        i += 1
    first = next((j for j, a in enumerate(rest) if re.match(rf"--?(no)?{FLAG}\.", a)), len(rest))
    return argv[:1] + rest[:first] + config + rest[first:] + argv[end:]


def check_command_line(argv: Sequence[str], default: str | None) -> ml_collections.ConfigDict:
    """The config ``argv`` selects (``--config``, else ``default``), its overrides checked.

    Raises:
      common.ConfigError: a missing config file or one without ``get_config``, a config argument
        that ``get_config`` rejects, an override of an unknown key, or an override whose value does
        not parse as the type of the entry it replaces.
    """
    args = _flag_arguments(argv)
    spec = _config_spec(args, default)
    overrides = _overrides(args)
    if spec is None:
        if overrides:
            raise common.ConfigError(
                f"{overrides[0][-1]} overrides an entry of the config, but no --config was given"
            )
        return ml_collections.ConfigDict()
    config = load_config(spec)
    for override in overrides:
        _check_override(config, *override)
    return config


def load_config(spec: str) -> ml_collections.ConfigDict:
    """``get_config(arg)`` of the config file ``spec = "path[:arg]"``, as ml_collections calls it.

    Raises:
      common.ConfigError: no such file, no ``get_config``, or ``get_config`` raised ``ValueError``
        or ``TypeError`` (a bad config argument).
    """
    path, *arg = spec.split(":", 1)
    file = pathlib.Path(path)
    if not file.is_file():
        raise common.ConfigError(f"--config={spec}: no config file {path!r}")
    module_spec = importlib.util.spec_from_file_location(f"_{FLAG}_{file.stem}", file)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, "get_config", None)):
        raise common.ConfigError(f"--config={spec}: {path} defines no get_config()")
    try:
        return module.get_config(*arg)
    except (TypeError, ValueError) as e:
        raise common.ConfigError(f"--config={spec}: {e}") from None


def _flag_arguments(argv: Sequence[str]) -> list[str]:
    """The arguments absl reads as flags: all after the program name, up to ``--``."""
    args = list(argv[1:])
    return args[: args.index("--")] if "--" in args else args


def _config_spec(args: list[str], default: str | None) -> str | None:
    """The last ``--config=spec`` (or ``--config spec``), else ``default``."""
    spec = default
    for i, arg in enumerate(args):
        match = re.fullmatch(rf"--?{FLAG}(=(.*))?", arg, re.DOTALL)
        if match:
            spec = match.group(2) if match.group(1) else (args[i + 1] if i + 1 < len(args) else "")
    return spec


def _overrides(args: list[str]) -> list[tuple[str, str | None, str | None, str]]:
    """``(key, value, next argument, argument as typed)`` of every ``--config.<key>[=value]``.

    ``value`` is the text after ``=``, ``"false"`` for ``--noconfig.<key>``, else ``None``: then a
    boolean entry becomes true and any other takes the next argument (as absl reads it).
    """
    found = []
    for i, arg in enumerate(args):
        match = re.fullmatch(rf"--?(no)?{FLAG}\.([^=]*)(=(.*))?", arg, re.DOTALL)
        if match:
            negated, key, _, value = match.groups()
            following = args[i + 1] if i + 1 < len(args) else None
            found.append((key, "false" if negated else value, following, arg))
    return found


def _entries(config, prefix="") -> dict:
    """``{dotted key: value}`` of every entry and section of ``config``."""
    out = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        out[name] = value
        if isinstance(value, ml_collections.ConfigDict):
            out.update(_entries(value, name + "."))
    return out


def _unknown_key(config, entries: dict, key: str, typed: str) -> common.ConfigError:
    """The error for an override of a key the config does not have: the entries named like it
    (the same section's first), and what the section holds."""
    section, _, name = key.rpartition(".")
    by_name = {}
    for k, v in entries.items():
        if not isinstance(v, ml_collections.ConfigDict):
            by_name.setdefault(k.rpartition(".")[2], []).append(k)
    close = difflib.get_close_matches(name, by_name)  # the name itself first, if it exists
    similar = [k for n in close for k in by_name[n]]
    similar.sort(key=lambda k: not k.startswith(section + "."))  # stable: closest names first
    if isinstance(entries.get(section), ml_collections.ConfigDict):
        known = f"{section} holds {', '.join(entries[section].keys())}"
    else:
        known = f"the config holds {', '.join(config.keys())}"
    return common.ConfigError(
        f"{typed}: unknown config key {key!r}{did_you_mean(similar)}; {known}"
    )


def _check_override(config, key: str, value, following, typed: str) -> None:
    entries = _entries(config)
    if key not in entries:
        raise _unknown_key(config, entries, key, typed)
    if key == "suite":  # a label once the config is built: overriding it changed nothing else
        raise common.ConfigError(
            f"{typed}: the suite is chosen in the config argument, which builds that suite's "
            f"model, layers, recipe and data: --config=<config file>:suite=<name>"
        )
    default = entries[key]
    if value is None and isinstance(default, bool):
        return  # --config.<flag> alone: true
    value = following if value is None else value
    expected = _expected(default)
    if expected is not None and (value is None or not _parses(default, value)):
        got = "no value" if value is None else repr(value)
        raise common.ConfigError(
            f"{typed}: config key {key!r} takes {expected} (default {default!r}), got {got}"
        )


def _expected(default) -> str | None:
    """What an override of an entry whose default is ``default`` must be (None: not checked)."""
    if type(default) in _PARSERS:
        return _PARSERS[type(default)][1]
    kind = _element_type(default)
    return f"a tuple of {_ELEMENTS[kind]}" if kind else None


def _element_type(default) -> type | None:
    """The one type of a non-empty tuple's elements, if it is one of :data:`_ELEMENTS`."""
    kinds = {type(v) for v in default} if isinstance(default, tuple) else set()
    return next(iter(kinds)) if len(kinds) == 1 and kinds <= set(_ELEMENTS) else None


def _parses(default, text: str) -> bool:
    """Whether ``text`` is a valid value for the entry (parsed as ml_collections parses it)."""
    try:
        if type(default) in _PARSERS:
            _PARSERS[type(default)][0].parse(text)
            return True
        parsed = tuple_parser.TupleParser().parse(text)
    except (TypeError, ValueError, SyntaxError):
        return False
    kind = _element_type(default)
    accepted = (int, float) if kind is float else (kind,)
    return all(
        isinstance(v, accepted) and (kind is bool or not isinstance(v, bool)) for v in parsed
    )
