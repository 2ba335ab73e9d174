"""Small matplotlib helpers for the notebooks: each takes plain data and returns its Figure.

loss_curves({"single": losses, "dp": losses})            smoothed loss per step
memory_bars({"dp": [peak of rank 0, ...]}, formula)       per-rank bytes by category
traffic_bars({"dp": {"allreduce": bytes}}, formula)       bytes sent per step by collective
collective_picture(before, after, "Allreduce")            what a collective does to 4 ranks
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


# --- notebooks 05, 07-09: ZeRO-3's schedule, memory over a step, shards, the dashed line ----

RANK_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")
PAD_COLOR = "#c8c8c8"
PAPER_FORMULA = "ZeRO formula (Ψ_pad): params + grads + optimizer"  # the dashed line's meaning


def formula_legend(fig: Figure, meaning: str = PAPER_FORMULA) -> Figure:
    """Say in the legend what the dashed line of memory_bars/traffic_bars is, and keep it
    inside the frame (a little headroom above the tallest bar or line)."""
    ax = fig.axes[0]
    for collection in ax.collections:  # the dashed formula lines
        collection.set_label(meaning)
    top = max([p.get_y() + p.get_height() for p in ax.patches if p.get_height()] or [0.0])
    lines = [y for c in ax.collections for s in c.get_segments() for _, y in s]
    ax.set_ylim(0, 1.08 * max([top, *lines]))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def zero3_schedule(layers: list[str]) -> Figure:
    """Which collective runs when in one ZeRO-3 step: per layer, allgather → compute → release
    in forward; allgather → backward → reduce-scatter in backward; the update sends nothing."""
    fig, ax = plt.subplots(figsize=(12, 2.6))
    rows = {"collective": 1.0, "compute": 0.0}
    x = 0.0

    def box(row: str, text: str, color: str, width: float = 1.0) -> None:
        nonlocal x
        ax.barh(rows[row], width, left=x, height=0.7, color=color, edgecolor="white")
        ax.text(x + width / 2, rows[row], text, ha="center", va="center", fontsize=7)
        x += width

    for name in layers:  # forward
        box("collective", f"allgather\n{name}", KIND_COLORS["allgather"])
        box("compute", f"forward\n{name}\n(release)", "#dddddd")
    box("compute", "loss", "#bbbbbb", 0.6)
    backward_start = x
    for name in reversed(layers):
        box("collective", f"allgather\n{name}", KIND_COLORS["allgather"])
        box("compute", f"backward\n{name}", "#dddddd")
        box("collective", f"reduce-\nscatter\n{name}", KIND_COLORS["reduce_scatter"])
    box("compute", "update\nshards", "#bbbbbb", 0.8)
    ax.axvline(backward_start, color="black", lw=0.8)
    ax.text(backward_start / 2, 1.65, "forward", ha="center")
    ax.text((backward_start + x) / 2, 1.65, "backward, then the update", ha="center")
    ax.set_yticks(list(rows.values()), list(rows))
    ax.set_xticks([])
    ax.set(xlim=(0, x), ylim=(-0.5, 1.9), title="one ZeRO-3 step on every rank, left to right")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


def memory_timeline(timelines: dict[str, list[tuple[str, int]]]) -> Figure:
    """Live bytes on a rank at every ledger event of one step, a panel per strategy; the
    backward pass shaded from the event "hold dlogits"; zero3's gathers dotted."""
    widths = [len(t) for t in timelines.values()]
    fig, axes = plt.subplots(1, len(timelines), figsize=(13, 4.4), width_ratios=widths)
    for ax, (label, timeline) in zip(np.atleast_1d(axes), timelines.items(), strict=True):
        events, live = zip(*timeline, strict=True)
        ax.plot(range(len(live)), live, marker="o", ms=3, color=CATEGORY_COLORS["activations"])
        backward = events.index("hold dlogits") - 0.5
        ax.axvspan(backward, len(events) - 0.5, color="#eeeeee", zorder=0)
        axis = ax.get_xaxis_transform()
        ax.text(backward / 2, 0.03, "forward", transform=axis, ha="center")
        ax.text((backward + len(events)) / 2, 0.03, "backward", transform=axis, ha="center")
        for i, event in enumerate(events):
            if event.startswith("gather"):
                ax.axvline(i, color=KIND_COLORS["allgather"], ls=":", lw=1)
        ax.set_xticks(range(len(events)), events, rotation=90, fontsize=6)
        ax.set_xlim(-0.5, len(events) - 0.5)
        span = max(live) - min(live)
        ax.set_ylim(min(live) - 0.3 * span, max(live) + 0.1 * span)
        ax.yaxis.set_major_formatter(KB)
        ax.set_ylabel("kB live on each rank")
        dotted = " (dotted: a layer is gathered)" if "zero3" in label else ""
        ax.set_title(f"{label}: live bytes during one step{dotted}", fontsize=9)
    fig.tight_layout()
    return fig


def rank_shards(layouts: dict, n: int) -> Figure:
    """One row per rank, one column per layer (FlatParam layouts): the slice the rank keeps
    filled in, the rest of the layer an empty outline, the padding hatched grey."""
    fig, axes = plt.subplots(n, len(layouts), figsize=(11, 0.55 * n + 1.0), squeeze=False)
    for r in range(n):
        for c, (name, f) in enumerate(layouts.items()):
            ax = axes[r, c]
            ax.barh(0, f.numel, color="white", edgecolor="#aaaaaa")  # the layer: not kept
            start, stop = f.shard_range(r)
            ax.barh(0, min(stop, f.numel) - start, left=start, color=RANK_COLORS[r])
            if stop > f.numel:  # this rank's slice ends in padding
                ax.barh(0, stop - f.numel, left=f.numel, color=PAD_COLOR, hatch="///")
                ax.annotate(
                    f"+{stop - f.numel} padding",
                    xy=(f.padded_numel, 0.3),
                    xytext=(0.55, 0.62),
                    textcoords="axes fraction",
                    fontsize=7,
                    arrowprops={"arrowstyle": "->", "lw": 0.8},
                )
            ax.set(xlim=(0, f.padded_numel), xticks=[], yticks=[])
            if r == 0:
                ax.set_title(f"{name}: {f.padded_numel:,} = {n} x {f.shard_size:,}", fontsize=9)
        axes[r, 0].set_ylabel(f"rank {r}", rotation=0, ha="right", va="center")
        mine = sum(f.shard_size for f in layouts.values())
        axes[r, -1].text(
            1.04, 0.5, f"keeps {mine:,}", transform=axes[r, -1].transAxes, va="center", fontsize=8
        )
    fig.suptitle("ZeRO-3: what each rank keeps of every layer", fontsize=10)
    fig.tight_layout()
    return fig
