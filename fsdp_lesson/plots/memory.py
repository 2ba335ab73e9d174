"""Memory per rank: ledger peaks by category and by lever, bytes per parameter, activations
against batch size, and live bytes over one step's events (with the units gathered)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from ..memory import CATEGORIES
from ._style import KB, KIND_COLORS, LANE_COLORS, _finish, _formula_lines

CATEGORY_COLORS = dict(
    zip(CATEGORIES, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3"), strict=True)
)


def memory_bars(
    reports: dict[str, list[dict]],
    formula: dict[str, dict] | None = None,
    at_once: dict[str, list[int]] | None = None,
) -> Figure:
    """For each label, one stacked bar per rank: each category's own peak (the ledger's
    `peak`), stacked; formula totals as dashed lines. The categories peak at different
    moments, so the stack can stand above any one moment's memory: `at_once` (the ledger's
    `peak_total` per rank) marks the most bytes alive at one moment on each bar."""
    fig, ax = plt.subplots(figsize=(max(5, 1.2 * sum(map(len, reports.values()))), 3.8))
    x, ticks, labels, lines, groups = 0, [], [], [], []  # lines: (total, from x, to x)
    for group, (label, per_rank) in enumerate(reports.items()):
        xs = x + np.arange(len(per_rank))
        bottom = np.zeros(len(per_rank))
        for category in CATEGORIES:
            heights = np.array([peak.get(category, 0) for peak in per_rank], dtype=float)
            legend = category if group == 0 else None
            ax.bar(xs, heights, 0.8, bottom, color=CATEGORY_COLORS[category], label=legend)
            bottom += heights
        if at_once and label in at_once:
            ax.hlines(at_once[label], xs - 0.4, xs + 0.4, color="black", lw=2.5,
                      label="peak at one moment" if group == 0 else None)  # fmt: skip
        if formula and label in formula:
            lines.append((sum(formula[label].values()), xs[0] - 0.45, xs[-1] + 0.45))
        ticks += list(xs)
        labels += [f"r{r}" for r in range(len(per_rank))]
        groups.append(((xs[0] + xs[-1]) / 2, label))
        x += len(per_rank) + 1
    _formula_lines(ax, lines)
    ax.set_xticks(ticks, labels, fontsize=8)  # r0, r1, ...: each bar's rank
    names = ax.secondary_xaxis("bottom")  # and each group's label, centred below its bars
    names.set_xticks(*zip(*groups, strict=True))
    names.tick_params(length=0, pad=16)
    names.spines["bottom"].set_visible(False)
    return _finish(
        fig, ax, "kB per rank", "each category's peak per rank, stacked (not one moment's memory)"
    )


def bytes_per_parameter(precisions: dict) -> Figure:
    """One horizontal bar per precision (a plan.BytesPerParam): params + grads + optimizer state."""
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.9 * len(precisions)))
    parts = (("params", "params"), ("grads", "grads"), ("optimizer", "optimizer state"))
    for y, p in enumerate(precisions.values()):
        left = 0
        for category, label in parts:
            width = getattr(p, category)
            ax.barh(y, width, left=left, color=CATEGORY_COLORS[category], edgecolor="white",
                    label=label if y == 0 else None)  # fmt: skip
            ax.text(left + width / 2, y, f"{width} B", ha="center", va="center", color="white")
            left += width
    ax.set_yticks(range(len(precisions)), list(precisions))
    ax.invert_yaxis()
    ax.set(xlabel="bytes per parameter", title="what one parameter costs on a data-parallel rank")
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1), fontsize=8)
    fig.tight_layout()
    return fig


LEVER_PARTS = ("params", "grads", "master", "m, v", "buffers", "activations")
LEVER_COLORS = dict(CATEGORY_COLORS, master="#937860", **{"m, v": CATEGORY_COLORS["optimizer"]})


def split_master(peak: dict, mixed: bool) -> dict:
    """A ledger's peaks with the optimizer category split: with Adam in mixed precision the
    fp32 master, m and v are the same size, so the master is a third of it (fp32: none)."""
    master = peak["optimizer"] // 3 if mixed else 0
    return {**peak, "master": master, "m, v": peak["optimizer"] - master}


def lever_bars(
    peaks: dict[str, list[dict]], mixed: dict[str, bool], formula: dict[str, float]
) -> Figure:
    """One stacked bar per configuration and rank (LEVER_PARTS), the formula's total as a
    dashed line over each configuration's ranks."""
    fig, ax = plt.subplots(figsize=(max(6, 0.55 * sum(map(len, peaks.values()))), 4))
    x, ticks, labels, lines = 0, [], [], []
    for group, (label, per_rank) in enumerate(peaks.items()):
        xs = x + np.arange(len(per_rank))
        parts = [split_master(peak, mixed[label]) for peak in per_rank]
        bottom = np.zeros(len(per_rank))
        for part in LEVER_PARTS:
            heights = np.array([p[part] for p in parts], dtype=float)
            ax.bar(xs, heights, 0.8, bottom, color=LEVER_COLORS[part],
                   label=part if group == 0 else None)  # fmt: skip
            bottom += heights
        lines.append((formula[label], xs[0] - 0.45, xs[-1] + 0.45))
        ticks += list(xs)
        labels += [str(r) for r in range(len(per_rank))]
        ax.text(xs.mean(), -0.1, label, transform=ax.get_xaxis_transform(), ha="center",
                va="top", fontsize=8)  # fmt: skip
        x += len(per_rank) + 1
    _formula_lines(ax, lines)
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_xlabel("rank (configuration below)", labelpad=22)
    return _finish(
        fig, ax, "kB per rank", "each lever's category peaks per rank, stacked (ledger peaks)"
    )


def activation_vs_batch(
    micro_batches: list[int], measured: dict[str, list[int]], predicted: dict[str, list[int]]
) -> Figure:
    """Activation peak per micro-batch size: measured as markers, predicted as lines."""
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for i, (label, values) in enumerate(measured.items()):
        color = plt.cm.tab10(i)
        ax.plot(micro_batches, predicted[label], "-", color=color, label=f"{label}: predicted")
        ax.plot(micro_batches, values, "o", color=color, label=f"{label}: measured")
    ax.set_xlabel("micro-batch (rows per rank)")
    ax.set_xticks(micro_batches)
    return _finish(fig, ax, "activation peak kB per rank", "activations vs batch size")


def activation_vs_sequence(
    seq_lens: list[int], ledger: dict[str, list[int]], counted: dict[str, list[int]]
) -> Figure:
    """Activation bytes per sequence length on log-log axes: the ledger's (measured or
    predicted) as solid lines with markers, counted formulas dashed; a straight line's slope is
    the power of s (1: linear, 2: s²)."""
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for label, values in ledger.items():
        ax.plot(seq_lens, values, "o-", label=label)
    for label, values in counted.items():
        ax.plot(seq_lens, values, "s--", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(seq_lens, [str(s) for s in seq_lens])
    ax.set_xlabel("sequence length s (positions)")
    ax.set(ylabel="bytes per rank", title="activations vs sequence length")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def memory_timeline(timelines: dict[str, list[tuple[str, int]]]) -> Figure:
    """Live bytes on a rank at every ledger event of one step, a panel per strategy; the
    backward pass shaded from the event "hold dlogits"; zero3's gathers (the events
    "hold <layer> gathered") dotted. Every panel's axis starts at zero."""
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
            if event.startswith("hold") and event.endswith(" gathered"):
                ax.axvline(i, color=KIND_COLORS["allgather"], ls=":", lw=1.2)
        ax.set_xticks(range(len(events)), events, rotation=90, fontsize=7.5)
        ax.set_xlim(-0.5, len(events) - 0.5)
        ax.set_ylim(0, 1.1 * max(live))  # from zero: a rise is drawn as large as it is
        ax.yaxis.set_major_formatter(KB)
        ax.set_ylabel("kB live on each rank")
        gathers = any(e.startswith("hold") and e.endswith(" gathered") for e in events)
        dotted = " (dotted: a layer is gathered)" if gathers else ""
        ax.set_title(f"{label}: live bytes during one step{dotted}", fontsize=9)
    fig.tight_layout()
    return fig


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
