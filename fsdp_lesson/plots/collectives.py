"""What a collective does to the ranks' arrays: before and after, and a ring allreduce step by
step (notebook 03)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure


def _grid(ax: Axes, arrays: list[np.ndarray], norm: plt.Normalize, title: str) -> None:
    """One row per rank, one cell per element, each cell coloured and labelled by its value."""
    grid = np.array([np.asarray(a, dtype=float).ravel() for a in arrays])
    ax.imshow(grid, cmap="Blues", norm=norm, aspect="equal")
    for (r, c), value in np.ndenumerate(grid):
        color = "white" if norm(value) > 0.6 else "black"  # dark cells get white text
        ax.text(c, r, f"{value:g}", ha="center", va="center", fontsize=9, color=color)
    ax.set_xticks(np.arange(grid.shape[1] + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(grid.shape[0] + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", linewidth=2)
    ax.tick_params(which="both", length=0)
    ax.set_xticks([])
    ax.set_yticks(range(len(grid)), [f"rank {r}" for r in range(len(grid))])
    ax.set_title(title, fontsize=10)


def collective_picture(before: list[np.ndarray], after: list[np.ndarray], title: str) -> Figure:
    """Each rank's array before and after a collective, side by side, values in the cells."""
    values = np.concatenate([np.ravel(a) for a in [*before, *after]]).astype(float)
    norm = plt.Normalize(min(values.min(), 0), values.max())
    widths = [np.size(before[0]), np.size(after[0])]
    fig, axes = plt.subplots(
        1, 2, figsize=(2 + 0.55 * sum(widths), 0.5 + 0.5 * len(before)), width_ratios=widths
    )
    _grid(axes[0], before, norm, "before")
    _grid(axes[1], after, norm, "after")
    fig.suptitle(title)
    fig.tight_layout()
    left, right = axes[0].get_position(), axes[1].get_position()
    middle = ((left.x1 + right.x0) / 2, (left.y0 + left.y1) / 2)
    fig.text(*middle, "→", ha="center", va="center", fontsize=20)
    return fig


def ring_moves(n: int) -> list[tuple[str, int, list[int]]]:
    """(phase, step, chunk each rank sends) of a ring allreduce on n ranks, as ring.py runs it:
    rank r sends to rank r + 1, which receives that same chunk."""
    scatter = [("reduce-scatter", k, [(r - k - 1) % n for r in range(n)]) for k in range(n - 1)]
    gather = [("allgather", k, [(r - k) % n for r in range(n)]) for k in range(n - 1)]
    return scatter + gather


RING_LEGEND = {  # what a cell shows: ranks' labels, or a cluster's numbers
    "labels": 'a cell: what the rank holds\nof chunk c ("0+3": ranks 0\n'
    "and 3's values summed;\nΣ: all ranks')",
    "numbers": "a cell: the rank's value\nof chunk c; darker: it sums\nmore ranks' values",
}
RING_OUTLINE = """outlined: received at this
step, from the rank above
(the last rank's goes
round to rank 0)"""


def _ring_arrow(ax: Axes, x: float, y0: float, y1: float) -> None:
    ax.annotate("", (x, y1), (x, y0), arrowprops=dict(arrowstyle="->", lw=1.4, color="#d95f02"))


def ring_steps(n: int = 4, values: list | None = None) -> Figure:
    """Every step of a ring allreduce: one grid per step, ranks down, chunks across.

    A cell says which ranks' values of that chunk the rank holds summed ("0+3"; "Σ": all n);
    the cells received at a step are outlined, with an arrow from the sender (rank r -> r + 1,
    the last rank round to rank 0). values[i][r] (optional, one number per chunk: the start,
    then after each step) replaces those labels by the numbers a cluster computed.
    """
    moves = ring_moves(n)
    held = [[{r} for _ in range(n)] for r in range(n)]  # held[r][c]: ranks summed in r's chunk c
    states, received = [[row[:] for row in held]], [None]
    for phase, _, sent in moves:
        before = [row[:] for row in held]
        for r, c in enumerate(sent):
            right = (r + 1) % n
            held[right][c] = (
                before[r][c] | before[right][c] if phase == "reduce-scatter" else before[r][c]
            )
        states.append([row[:] for row in held])
        received.append(sent)
    fig, axes = plt.subplots(2, n, figsize=(3.1 * n, 2 * (0.62 * n + 0.8)))
    panels = [axes[0, i] for i in range(n)] + [axes[1, i] for i in range(n - 1)]
    titles = ["start: own values"] + [f"{phase} step {k}" for phase, k, _ in moves]
    for i, (ax, state, sent) in enumerate(zip(panels, states, received, strict=True)):
        counts = np.array([[len(s) for s in row] for row in state])
        ax.imshow(counts, cmap="Blues", vmin=0, vmax=n + 1, aspect="equal")
        for (r, c), count in np.ndenumerate(counts):
            label = "Σ" if count == n else "+".join(map(str, sorted(state[r][c])))
            if values is not None:
                label = f"{np.ravel(values[i][r])[c]:g}"
            color = "white" if count >= n - 1 else "black"
            ax.text(c - 0.08, r, label, ha="center", va="center", fontsize=7, color=color)
        for r, c in enumerate(sent or []):
            right, x = (r + 1) % n, c + 0.36
            ax.add_patch(plt.Rectangle((c - 0.46, right - 0.46), 0.92, 0.92, fill=False,
                                       ec="#d95f02", lw=2))  # fmt: skip
            if right:
                _ring_arrow(ax, x, r + 0.1, right - 0.1)
            else:  # round the ring: out at the bottom, in at the top
                _ring_arrow(ax, x, n - 0.9, n - 0.25)
                _ring_arrow(ax, x, -0.75, -0.1)
        ax.set(xlim=(-0.5, n - 0.5), ylim=(n - 0.1, -0.9))
        ax.set_xticks(range(n), [f"c{c}" for c in range(n)], fontsize=7)
        ax.set_yticks(range(n), [f"rank {r}" for r in range(n)], fontsize=7)
        ax.tick_params(length=0, labelbottom=False, labeltop=True)
        ax.set_title(titles[i], fontsize=9)
    legend = axes[1, n - 1]
    legend.axis("off")
    shows = "labels" if values is None else "numbers"
    legend.text(0, 0.5, f"{RING_LEGEND[shows]}\n\n{RING_OUTLINE}", fontsize=8, va="center")
    fig.suptitle(f"ring allreduce on {n} ranks = reduce-scatter + allgather", fontsize=10)
    fig.tight_layout()
    return fig
