"""The data set (notebook 01): the names at a glance, context rows as letters, and which rank
keeps which row of a batch."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from ..data import ALPHABET
from ._style import RANK_COLORS


def name_statistics(lengths: np.ndarray, letter_counts: np.ndarray) -> Figure:
    """A histogram of name lengths next to the count of each letter a-z."""
    fig, (ax_len, ax_letters) = plt.subplots(1, 2, figsize=(12, 3.2))
    ax_len.hist(lengths, bins=np.arange(1.5, lengths.max() + 1.5), color="tab:blue", ec="white")
    ax_len.set(title="name length", xlabel="letters", ylabel="names")
    ax_letters.bar(list(ALPHABET[1:]), letter_counts, color="tab:orange")
    ax_letters.set(title="letter frequency", ylabel="occurrences")
    fig.tight_layout()
    return fig


def token_rows(X: np.ndarray, Y: np.ndarray, title: str = "") -> Figure:
    """Rows of (context X | target Y) as letters: padding grey, letters blue, target orange."""
    fig, ax = plt.subplots(figsize=(9, 0.5 + 0.46 * len(Y)))
    kind = np.concatenate([(X > 0).astype(int), np.full((len(Y), 1), 2)], axis=1)  # 0, 1, 2
    colours = plt.matplotlib.colors.ListedColormap(["#dddddd", "#9ecae1", "#fdae6b"])
    ax.imshow(kind, cmap=colours, vmin=0, vmax=2)
    rows = np.concatenate([X, Y[:, None]], axis=1)  # (rows, S + 1)
    for (r, c), token in np.ndenumerate(rows):
        ax.text(c, r, ALPHABET[token], ha="center", va="center", fontsize=11)
    ax.axvline(X.shape[1] - 0.5, color="black", lw=2)  # context | target
    ax.set_xticks(range(rows.shape[1]), [str(i) for i in range(X.shape[1])] + ["Y"])
    ax.set_yticks(range(len(rows)), [f"row {r}" for r in range(len(rows))])
    ax.set_title(title)
    return fig


def batch_by_rank(Y_batch: np.ndarray, n: int) -> Figure:
    """The global batch (each row's target letter) coloured by rank, and what each rank keeps."""
    b = np.arange(len(Y_batch))
    by_rank = plt.matplotlib.colors.ListedColormap(["white", *RANK_COLORS[:n]])  # 0 = not kept
    fig, (ax_batch, ax_ranks) = plt.subplots(
        2, 1, figsize=(12, 3.4), sharex=True, gridspec_kw={"height_ratios": [1, n]}
    )
    ax_batch.imshow([b % n + 1], cmap=by_rank, vmin=0, vmax=n)
    kept = np.array([np.where(b % n == r, r + 1, 0) for r in range(n)])  # (n, B): b % n == r
    ax_ranks.imshow(kept, cmap=by_rank, vmin=0, vmax=n)
    for i, token in enumerate(Y_batch):
        ax_batch.text(i, 0, ALPHABET[token], ha="center", va="center", color="white")
        ax_ranks.text(i, i % n, ALPHABET[token], ha="center", va="center", color="white")
    ax_batch.set(yticks=[], title="the global batch (each row's target letter), coloured by rank")
    ax_ranks.set_xticks(b[::n], [str(i) for i in b[::n]])
    ax_ranks.set_xticks(b - 0.5, minor=True)
    ax_ranks.set_yticks(np.arange(n) - 0.5, minor=True)
    ax_ranks.grid(which="minor", color="#cccccc")
    ax_ranks.tick_params(which="minor", length=0)
    ax_ranks.set(
        yticks=range(n), yticklabels=[f"rank {r}" for r in range(n)], xlabel="global row b"
    )
    fig.tight_layout()
    return fig
