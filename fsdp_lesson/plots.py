"""Small matplotlib helpers for the notebooks: each takes plain data and returns its Figure.

loss_curves({"single": losses, "dp": losses})            smoothed loss per step
memory_bars({"dp": [peak of rank 0, ...]}, formula)       per-rank bytes by category
traffic_bars({"dp": {"allreduce": bytes}}, formula)       bytes sent per step by collective
collective_picture(before, after, "Allreduce")            what a collective does to 4 ranks
timeline({"prefetch": [trace of rank 0, ...]})            one step's compute and collectives
gathered_units({"prefetch": history.timeline})            which units are gathered, event by event
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from .memory import CATEGORIES

KINDS = ("allreduce", "allgather", "reduce_scatter")
CATEGORY_COLORS = dict(
    zip(CATEGORIES, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"), strict=True)
)
KIND_COLORS = dict(zip(KINDS, ("#4c72b0", "#55a868", "#dd8452"), strict=True))
KB = FuncFormatter(lambda value, _: f"{value / 1e3:g}")  # bytes on the axis, shown as kB


def running_mean(values, window: int) -> np.ndarray:
    """The mean of each `window` consecutive values (fewer values than that: one window)."""
    values = np.asarray(values, dtype=np.float64)
    window = max(1, min(window, len(values)))
    return np.convolve(values, np.ones(window) / window, mode="valid")


def loss_curves(curves: dict[str, np.ndarray], smooth: int = 50, ax: Axes | None = None) -> Figure:
    """One line per label: the loss per step, as a running mean over `smooth` steps."""
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.5))
    for label, values in curves.items():
        mean = running_mean(values, smooth)
        ax.plot(np.arange(len(values) - len(mean), len(values)), mean, label=label)
    ax.set(xlabel="step", ylabel=f"loss (running mean, {smooth} steps)")
    ax.legend()
    return ax.figure


def _finish(fig: Figure, ax: Axes, ylabel: str, title: str) -> Figure:
    """Bytes shown as kB, the legend outside on the right, a tight layout."""
    ax.yaxis.set_major_formatter(KB)
    ax.set(ylabel=ylabel, title=title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def memory_bars(reports: dict[str, list[dict]], formula: dict[str, dict] | None = None) -> Figure:
    """For each label, one stacked bar per rank (bytes by category); formula totals as lines."""
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * sum(map(len, reports.values()))), 3.8))
    x, ticks, labels, lines = 0, [], [], []  # lines: (total, from x, to x) of each formula
    for group, (label, per_rank) in enumerate(reports.items()):
        xs = x + np.arange(len(per_rank))
        bottom = np.zeros(len(per_rank))
        for category in CATEGORIES:
            heights = np.array([peak.get(category, 0) for peak in per_rank], dtype=float)
            legend = category if group == 0 else None
            ax.bar(xs, heights, 0.8, bottom, color=CATEGORY_COLORS[category], label=legend)
            bottom += heights
        if formula and label in formula:
            lines.append((sum(formula[label].values()), xs[0] - 0.45, xs[-1] + 0.45))
        ticks += list(xs)
        labels += [f"{label}\nrank {r}" if r == 0 else f"rank {r}" for r in range(len(per_rank))]
        x += len(per_rank) + 1
    if lines:
        ax.hlines(*zip(*lines, strict=True), colors="black", linestyles="--", label="formula")
    ax.set_xticks(ticks, labels, fontsize=8)
    return _finish(fig, ax, "peak kB per rank", "memory per rank by category (ledger peaks)")


def traffic_bars(traffic: dict[str, dict], formula: dict[str, float] | None = None) -> Figure:
    """One stacked bar per label: bytes sent per step by collective kind; formula as a line."""
    fig, ax = plt.subplots(figsize=(max(4, 1.5 * len(traffic)), 3.8))
    kinds = list(KINDS) + sorted({k for t in traffic.values() for k in t} - set(KINDS))
    xs = np.arange(len(traffic))
    bottom = np.zeros(len(traffic))
    for kind in kinds:
        heights = np.array([t.get(kind, 0.0) for t in traffic.values()], dtype=float)
        if heights.any():
            ax.bar(xs, heights, 0.6, bottom, color=KIND_COLORS.get(kind), label=kind)
            bottom += heights
    lines = [(formula[k], x - 0.4, x + 0.4) for x, k in enumerate(traffic) if k in (formula or {})]
    if lines:
        ax.hlines(*zip(*lines, strict=True), colors="black", linestyles="--", label="formula")
    ax.set_xticks(xs, list(traffic))
    return _finish(fig, ax, "kB sent per rank per step", "communication per step")


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


LANE_COLORS = {"compute": "#4c72b0", "comm": "#dd8452"}


def timeline(traces: dict[str, list[list]], ax: Axes | None = None) -> Figure:
    """One row per rank and run, compute and communication on two lanes, over one step.

    A trace is History.trace: (lane, what, start s, end s) spans from the step's start. A
    collective's span runs from its issue to its completion (as seen by the rank's wait).
    """
    rows = [
        (label, rank, trace)
        for label, per_rank in traces.items()
        for rank, trace in enumerate(per_rank)
    ]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.7 * len(rows) + 1))
    for row, (_label, _rank, trace) in enumerate(rows):
        for lane, _what, start, end in trace:
            y = row + (0.05 if lane == "compute" else 0.45)
            ax.broken_barh(
                [(1e3 * start, 1e3 * (end - start))], (y, 0.4), color=LANE_COLORS[lane], alpha=0.8
            )
    ax.set_yticks(np.arange(len(rows)) + 0.5, [f"{label} r{rank}" for label, rank, _ in rows])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in LANE_COLORS.values()]
    ax.legend(
        handles,
        ["compute (per unit)", "collective (issue to completion)"],
        fontsize=8,
        loc="upper left",
        bbox_to_anchor=(1, 1),
    )
    ax.figure.tight_layout()
    return ax.figure


def gathered_spans(timeline: list[tuple[str, int]]) -> list[tuple[str, int, int]]:
    """(unit, first event, last event) of each time a unit's full parameters were held.

    A timeline is History.timeline: (event, live bytes) with events "hold <unit> gathered"
    and "free <unit> gathered" among the others.
    """
    spans, since = [], {}
    for i, (event, _) in enumerate(timeline):
        kind, _, label = event.partition(" ")
        if label.endswith(" gathered"):
            unit = label.removesuffix(" gathered")
            if kind == "hold":
                since[unit] = i
            elif kind == "free":
                spans.append((unit, since.pop(unit), i))
    return spans


def gathered_units(timelines: dict[str, list[tuple[str, int]]]) -> Figure:
    """One column per label: live bytes over one step's events (top) and, below, a bar for
    each unit while its full parameters are gathered, so the units rise and fall in order."""
    fig, axes = plt.subplots(
        2,
        len(timelines),
        figsize=(6 * len(timelines), 5),
        squeeze=False,
        sharex="col",
        height_ratios=[1, 1.4],
    )
    for column, (label, timeline) in enumerate(timelines.items()):
        top, bottom = axes[0, column], axes[1, column]
        top.plot([live for _, live in timeline], color="black", lw=1)
        top.yaxis.set_major_formatter(KB)
        top.set_ylabel("kB live")
        top.set_title(label, fontsize=10)
        spans = gathered_spans(timeline)
        units = list(dict.fromkeys(unit for unit, _, _ in spans))  # in order of first gather
        for unit, start, stop in spans:
            bottom.broken_barh(
                [(start, stop - start)], (units.index(unit) + 0.1, 0.8), color=LANE_COLORS["comm"]
            )
        bottom.set_yticks(np.arange(len(units)) + 0.5, units)
        bottom.invert_yaxis()
        bottom.set_xlabel("event of the step (hold / free)")
        bottom.set_ylabel("gathered")
    fig.tight_layout()
    return fig
