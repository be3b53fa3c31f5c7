"""Byte-level text corpora for language modelling, and batches of token windows.

Tokens are the UTF-8 bytes of the text (vocabulary 256), so no tokenizer file is needed.
Corpora: ``"fortunes"`` (Debian ``fortunes``), ``"stdlib"`` (the Python standard library's
``.py`` sources), ``"wikitext"`` (WikiText-103 raw: ``wiki.{train,valid,test}.raw`` in a directory),
and ``"auto"``: fortunes where installed, else the standard library's sources (both are local).
"""

from __future__ import annotations

import pathlib
import sysconfig
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from dynadiag_jax._checks import int_at_least, no_directory
from dynadiag_jax.data.arrays import _process_share

__all__ = [
    "BYTE_VOCAB_SIZE",
    "Corpus",
    "TokenWindows",
    "WindowEvalBatches",
    "decode_bytes",
    "encode_bytes",
    "load_corpus",
]

BYTE_VOCAB_SIZE = 256
FORTUNES_DIR = pathlib.Path("/usr/share/games/fortunes")
WIKITEXT_FILES = {"train": "wiki.train.raw", "valid": "wiki.valid.raw", "test": "wiki.test.raw"}
CORPORA = ("auto", "fortunes", "stdlib", "wikitext")


class Corpus(NamedTuple):
    """Token streams: ``train`` and ``valid`` int32 ``[N]``; ``name`` says where they came from."""

    train: np.ndarray
    valid: np.ndarray
    name: str


def encode_bytes(text: str) -> np.ndarray:
    """UTF-8 bytes of ``text`` as int32 tokens in ``[0, 256)``."""
    return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def decode_bytes(tokens) -> str:
    """Inverse of :func:`encode_bytes` (invalid UTF-8 sequences become U+FFFD); a token outside
    ``[0, 256)`` (sampled from a model of a larger vocabulary) is a ``ValueError``, not a byte
    taken modulo 256."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= BYTE_VOCAB_SIZE):
        bad = tokens[(tokens < 0) | (tokens >= BYTE_VOCAB_SIZE)].ravel()[0]
        raise ValueError(f"tokens must be bytes in [0, {BYTE_VOCAB_SIZE}), got {bad}")
    return tokens.astype(np.uint8).tobytes().decode("utf-8", errors="replace")


def _split(data: bytes, valid_fraction: float, name: str) -> Corpus:
    tokens = np.frombuffer(data, np.uint8).astype(np.int32)
    cut = int(len(tokens) * (1.0 - valid_fraction))
    return Corpus(tokens[:cut], tokens[cut:], name)


def _fortunes(path) -> Corpus:
    root = FORTUNES_DIR if path is None else pathlib.Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(
            f"fortunes directory {root} {no_directory(root)} "
            "(Debian/Ubuntu: apt-get install fortunes)"
        )
    files = sorted(
        p for p in root.iterdir() if p.is_file() and not p.is_symlink() and p.suffix != ".dat"
    )
    if not files:
        raise FileNotFoundError(f"{root} holds no fortune files")
    return _split(
        b"".join(p.read_bytes() for p in files), 0.05, f"fortunes ({root}, {len(files)} files)"
    )


def _stdlib(path, max_bytes: int) -> Corpus:
    root = pathlib.Path(sysconfig.get_paths()["stdlib"] if path is None else path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"source directory {root} {no_directory(root)}")
    skip = {"test", "tests", "site-packages", "idlelib", "__pycache__"}
    chunks, total = [], 0
    for p in sorted(root.rglob("*.py")):
        if skip.intersection(p.relative_to(root).parts):
            continue
        data = p.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if not chunks:
        raise FileNotFoundError(f"{root} holds no .py files")
    return _split(b"".join(chunks), 0.05, f"stdlib ({root}, {total} bytes)")


def _wikitext(path) -> Corpus:
    if path is None:
        raise ValueError(
            "the wikitext corpus needs a path to the directory holding "
            f"{', '.join(WIKITEXT_FILES.values())} (WikiText-103 raw)"
        )
    root = pathlib.Path(path).expanduser()
    if not root.is_dir():
        raise FileNotFoundError(f"WikiText directory {root} {no_directory(root)}")
    missing = [f for f in ("train", "valid") if not (root / WIKITEXT_FILES[f]).exists()]
    if missing:
        raise FileNotFoundError(
            f"{root} is not a WikiText-103 raw directory: missing "
            f"{', '.join(WIKITEXT_FILES[f] for f in missing)}"
        )
    data = {s: (root / WIKITEXT_FILES[s]).read_bytes() for s in ("train", "valid")}
    empty = [str(root / WIKITEXT_FILES[s]) for s in data if not data[s]]
    if empty:  # else "0 tokens are too few for one window" later, naming no file
        are = "is" if len(empty) == 1 else "are"
        raise ValueError(f"{' and '.join(empty)} {are} empty: a WikiText-103 raw file holds text")
    train, valid = (np.frombuffer(data[s], np.uint8).astype(np.int32) for s in ("train", "valid"))
    return Corpus(train, valid, f"wikitext ({root})")


def load_corpus(name: str = "auto", path=None, *, max_bytes: int = 16 << 20) -> Corpus:
    """Load a byte-level corpus; its ``name`` says which one (and from where).

    Args:
      name: ``"auto"`` (fortunes if :data:`FORTUNES_DIR` exists, else ``"stdlib"``),
        ``"fortunes"``, ``"stdlib"`` or ``"wikitext"``.
      path: the corpus directory (``None``: the system default; required for ``wikitext``; not
        accepted with ``auto``).
      max_bytes: cap on the ``stdlib`` corpus size.

    Raises:
      ValueError: unknown ``name``; FileNotFoundError: the directory or its files are missing.
    """
    if name not in CORPORA:
        raise ValueError(f"unknown corpus {name!r}; expected one of {CORPORA}")
    if name == "auto":
        if path is not None:
            raise ValueError("corpus 'auto' takes no path: name the corpus the path holds")
        name = "fortunes" if FORTUNES_DIR.is_dir() else "stdlib"
    if name == "fortunes":
        return _fortunes(path)
    if name == "stdlib":
        return _stdlib(path, max_bytes)
    return _wikitext(path)


def _num_windows(tokens: np.ndarray, seq_len: int, text: str) -> int:
    """Whole windows of ``seq_len + 1`` tokens in ``tokens`` (``text`` names them in errors)."""
    int_at_least(seq_len, "seq_len", 1)
    n = (len(tokens) - 1) // seq_len
    if n < 1:
        raise ValueError(
            f"{text} has {len(tokens)} tokens, too few for one window of seq_len + 1 = "
            f"{seq_len + 1}: lower seq_len or use a longer text"
        )
    return n


class TokenWindows:
    """Training batches ``{"tokens": int32 [B, seq_len + 1]}`` of non-overlapping windows.

    Epoch ``e`` visits the windows in the order ``default_rng([seed, e]).permutation``; step ``t``
    is a pure function of ``(seed, t)``, as for :class:`~dynadiag_jax.data.ArrayBatches`.
    """

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        global_batch_size: int,
        *,
        seed: int,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        self.tokens = np.asarray(tokens, np.int32)
        self.seq_len = int(seq_len)
        self.num_windows = _num_windows(self.tokens, seq_len, "the training text")
        int_at_least(global_batch_size, "batch size", 1)
        if global_batch_size > self.num_windows:
            raise ValueError(
                f"batch size {global_batch_size} exceeds the corpus's {self.num_windows} windows"
            )
        self.global_batch_size = int(global_batch_size)
        self.steps_per_epoch = self.num_windows // self.global_batch_size
        self.seed = int_at_least(seed, "seed", 0)  # numpy's generators take no negative seed
        self._share = _process_share(self.global_batch_size, process_index, process_count)

    def _windows(self, starts: np.ndarray) -> np.ndarray:
        return self.tokens[starts[:, None] + np.arange(self.seq_len + 1)[None, :]]

    def iterate(self, start_step: int) -> Iterator[dict[str, np.ndarray]]:
        step, epoch, perm, b = int(start_step), None, None, self.global_batch_size
        while True:
            e, i = divmod(step, self.steps_per_epoch)
            if e != epoch:
                epoch, perm = e, np.random.default_rng([self.seed, e]).permutation(self.num_windows)
            starts = perm[i * b : (i + 1) * b][self._share] * self.seq_len
            yield {"tokens": self._windows(starts)}
            step += 1


class WindowEvalBatches:
    """Every window of ``tokens`` once (at most ``max_windows``), padded, with a ``"mask"``."""

    def __init__(
        self,
        tokens: np.ndarray,
        seq_len: int,
        global_batch_size: int,
        *,
        max_windows: int | None = None,
        process_index: int | None = None,
        process_count: int | None = None,
    ):
        self.tokens = np.asarray(tokens, np.int32)
        self.seq_len = int(seq_len)
        n = _num_windows(self.tokens, seq_len, "the evaluation text")
        if max_windows is not None:
            n = min(n, int_at_least(max_windows, "max_windows", 1))
        self.num_windows = n
        self.global_batch_size = int_at_least(global_batch_size, "batch size", 1)
        self._share = _process_share(self.global_batch_size, process_index, process_count)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        b = self.global_batch_size
        for first in range(0, self.num_windows, b):
            idx = np.arange(first, first + b)
            mask = idx < self.num_windows
            starts = np.where(mask, idx, 0)[self._share] * self.seq_len
            yield {
                "tokens": self.tokens[starts[:, None] + np.arange(self.seq_len + 1)[None, :]],
                "mask": mask[self._share].astype(np.float32),
            }
