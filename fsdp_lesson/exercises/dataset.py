"""Notebook 01's checkers: the rows a name makes (exercise 1) and the rows a rank keeps
(exercise 2). The expected answers come from the package's own `build_rows` and `rank_slice`,
here, so the learner's cell shows only the call."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..checks import check, fail, not_solved
from ..data import build_rows, rank_slice

LENGTHS = [2, 4, 15]  # the name lengths n_rows is tried on


def check_n_rows(n_rows: Callable) -> bool:
    """Exercise 1: n_rows(L) against the rows `build_rows` makes of a name of L letters."""
    made = [len(build_rows(["a" * length])[0]) for length in LENGTHS]
    return check(
        "n_rows",
        [n_rows(length) for length in LENGTHS],
        made,
        hint="count the tokens of a name, the boundary included",
    )


def check_rows_of_rank(rows, rank: int = 2, n: int = 8, batch: int = 32) -> bool:
    """Exercise 2: the global rows of a batch of `batch` that rank `rank` of `n` keeps; a
    contiguous block (the usual mistake) and another rank's rows are named."""
    size = batch // n
    if not not_solved(rows) and np.asarray(rows).shape == (size,):
        shown = np.asarray(rows).tolist()
        if shown == list(range(rank * size, (rank + 1) * size)):
            return fail(
                f"✗ rank {rank} of {n}: a contiguous block of the batch — section 6's rule"
                " interleaves the ranks, it does not cut the batch into blocks"
            )
        others = [
            r for r in range(n) if r != rank and shown == list(rank_slice(range(batch), r, n))
        ]
        if others:
            return fail(f"✗ rank {rank} of {n}: rank {others[0]}'s rows — ranks count from 0")
    return check(
        f"rank {rank} of {n}",
        rows,
        rank_slice(np.arange(batch), rank, n),
        hint="rank r keeps the rows b with b % N == r",
    )
