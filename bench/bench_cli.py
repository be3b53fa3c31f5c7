"""What the benchmark scripts share on their command line: checked option types and where a
default run writes.

Imports neither JAX nor the training code, so that a parent process that only starts children
(bench/page_faults.py, bench/compile.py) stays light. Every check fails the way argparse does:
one ``error:`` line and exit status 2, before anything is compiled or trained.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import pathlib
from collections.abc import Callable

# A default run writes here, beside the scripts, whatever the current directory.
RESULTS = pathlib.Path(__file__).resolve().parent / "results"
STAMP = "%Y%m%d-%H%M%S"


def results_path(name: str) -> pathlib.Path:
    """``bench/results/<name>_<time>.csv``: a default run's output."""
    return RESULTS / f"{name}_{datetime.datetime.now().strftime(STAMP)}.csv"


def write_csv(rows, fieldnames, name: str, out=None) -> pathlib.Path:
    """``rows`` (dicts) as a CSV at ``out`` (default :func:`results_path` of ``name``); prints
    where and returns the path."""
    path = pathlib.Path(out) if out else results_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fieldnames)
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {path}")
    return path


def format_us(ms: float) -> str:
    """Microseconds (from milliseconds) with at least three significant digits."""
    us = ms * 1e3
    return f"{us:.0f}" if us >= 100 else f"{us:.3g}"


def make_parser(doc: str) -> argparse.ArgumentParser:
    """A parser whose ``--help`` shows the script's whole docstring, as it is laid out."""
    return argparse.ArgumentParser(
        description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_options(
    parser: argparse.ArgumentParser,
    name: str,
    *,
    shapes: str | None = None,
    blocks: str | None = None,
    batch: str | None = None,
    repeats: int | None = None,
    each: str = "function",
) -> None:
    """The options most scripts share: ``--shapes``, ``--blocks``, ``--batch`` and ``--repeats``
    (each where a default is given, checked as it parses) and ``--out`` (a CSV path, default
    :func:`results_path` of ``name``)."""
    if shapes is not None:
        parser.add_argument(
            "--shapes",
            type=parse_shapes,
            default=shapes,
            help=f"IN:OUT layer shapes, comma separated (default {shapes})",
        )
    if blocks is not None:
        parser.add_argument(
            "--blocks",
            type=parse_sizes("block sizes", "1,16"),
            default=blocks,
            help="block sizes, comma separated: 1 = element diagonals, b >= 2 = blocks of b x b "
            f"(skipped where b does not divide a shape; default {blocks})",
        )
    if batch is not None:
        parser.add_argument(
            "--batch",
            type=parse_sizes("batch sizes", "1,4,16"),
            default=batch,
            help=f"rows of x, comma separated (default {batch})",
        )
    if repeats is not None:
        parser.add_argument(
            "--repeats",
            type=count("repeats"),
            default=repeats,
            help=f"timed calls of each {each}, median (default {repeats})",
        )
    parser.add_argument(
        "--out",
        type=out_file,
        default=None,
        help=f"CSV path (default bench/results/{name}_<time>.csv)",
    )


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """``"768:3072,3072:768"`` -> ``((768, 3072), (3072, 768))``: IN:OUT pairs of sizes >= 1."""
    try:
        pairs = tuple(tuple(int(n) for n in item.split(":")) for item in text.split(","))
    except ValueError:
        pairs = ()
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"shapes must look like 768:3072,3072:768; got {text!r}")
    return pairs


def parse_sizes(what: str, example: str) -> Callable[[str], tuple[int, ...]]:
    """A parser of comma separated integers >= 1, e.g. block or batch sizes."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            sizes = tuple(int(n) for n in text.split(","))
        except ValueError:
            sizes = ()
        if not sizes or min(sizes) < 1:
            raise argparse.ArgumentTypeError(
                f"{what} must be integers >= 1 like {example}; got {text!r}"
            )
        return sizes

    return parse


def count(what: str) -> Callable[[str], int]:
    """A parser of one integer >= 1 (a number of repeats, steps, seeds, processes)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = 0
        if n < 1:
            raise argparse.ArgumentTypeError(f"{what} must be an integer >= 1; got {text!r}")
        return n

    return parse


def parse_fractions(
    what: str = "sparsities", example: str = "0.9,0.95", *, one: bool = False
) -> Callable[[str], tuple[float, ...]]:
    """A parser of comma separated numbers in (0, 1) (``one``: in (0, 1])."""
    interval = "(0, 1]" if one else "(0, 1)"

    def parse(text: str) -> tuple[float, ...]:
        try:
            values = tuple(float(v) for v in text.split(","))
        except ValueError:
            values = ()
        if not values or not all(0.0 < v < 1.0 or (one and v == 1.0) for v in values):
            raise argparse.ArgumentTypeError(
                f"{what} must lie in {interval} (like {example}); got {text!r}"
            )
        return values

    return parse


def sparsity(text: str) -> float:
    """One sparsity in (0, 1): what ``dd.num_diagonals`` accepts."""
    values = parse_fractions("the sparsity", "0.9")(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"give one sparsity in (0, 1) like 0.9; got {text!r}")
    return values[0]


def divides(block: int, shape: tuple[int, int]) -> bool:
    """Whether blocks of ``block x block`` tile a layer of ``shape`` (``in, out``)."""
    return shape[0] % block == 0 and shape[1] % block == 0


def check_blocks(parser: argparse.ArgumentParser, shapes, blocks) -> None:
    """``parser.error`` when no block size of ``--blocks`` divides a shape of ``--shapes``."""
    if not any(divides(b, shape) for shape in shapes for b in blocks):
        parser.error(
            f"no block size of --blocks {','.join(map(str, blocks))} divides a shape of "
            f"--shapes {','.join(f'{i}:{o}' for i, o in shapes)}: nothing to time"
        )


def out_file(text: str) -> pathlib.Path:
    """``--out``: a CSV file path, refused as it parses (not after the work) when it names a
    directory or lies under a file."""
    path = pathlib.Path(text)
    if path.is_dir() or text.endswith(("/", "\\")):
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a CSV file path")
    parent = next((p for p in path.parents if p.exists()), None)
    if parent is not None and not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text} lies under {parent}, which is a file")
    return path
