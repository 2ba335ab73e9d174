"""Pipeline parallelism in pictures: one lane per stage with each micro-batch's forward and
backward (idle time left blank), and the bubble against the number of micro-batches."""

from __future__ import annotations

from collections.abc import Iterable

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from ..plan import bubble_fraction

OP_COLORS = {"F": "#4c72b0", "B": "#dd8452"}  # a forward, a backward
IDLE_COLOR = "#eeeeee"  # the lane behind the boxes: what shows between them is idle time


def check_records(records) -> list[list[tuple[int, str, float, float]]]:
    """records as pipeline_step(record=...) or unit_time_records give them: one list per stage
    of (micro-batch, "F" or "B", start, end); ValueError saying what is wrong otherwise."""
    if not isinstance(records, (list, tuple)) or not records:
        raise ValueError("records: give one list of ops per stage (a list of lists), not empty")
    first = records[0]
    if isinstance(first, (list, tuple)) and len(first) == 4 and first[1] in OP_COLORS:
        raise ValueError("records: one list per stage; this is one stage's record: give [record]")
    checked = []
    for s, record in enumerate(records):
        if not isinstance(record, (list, tuple)):
            raise ValueError(f"records[{s}]: a list of (micro, 'F' or 'B', start, end) per op")
        ops = []
        for i, op in enumerate(record):
            if not isinstance(op, (list, tuple)) or len(op) != 4:
                raise ValueError(
                    f"records[{s}][{i}] = {op!r}: each op is (micro, 'F' or 'B', start, end)"
                )
            m, kind, start, end = op
            if kind not in OP_COLORS:
                raise ValueError(f"records[{s}][{i}]: kind {kind!r}, not 'F' or 'B'")
            if not 0 <= start <= end:
                raise ValueError(
                    f"records[{s}][{i}]: start {start} and end {end}: need 0 <= start <= end"
                )
            ops.append((int(m), kind, float(start), float(end)))
        checked.append(ops)
    if not any(checked):
        raise ValueError("records: no stage has an op to draw")
    return checked


def pipeline_lanes(
    records,
    title: str = "one step of every stage",
    unit: str = "time units",
    ax: Axes | None = None,
) -> Figure:
    """One lane per stage (stage 0 on top): a box per op from its start to its end, blue for a
    forward, orange for a backward, labelled with its micro-batch; the grey lane shows through
    where the stage waits (the bubble). `records`: pipeline.unit_time_records(...) (unit time)
    or each stage's pipeline_step(record=[...]) (seconds: unit="ms" draws them in ms)."""
    records = check_records(records)
    scale = 1e3 if unit == "ms" else 1.0
    span = scale * max(end for record in records for *_, end in record)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.55 * len(records) + 1.2))
    for s, record in enumerate(records):
        ax.broken_barh([(0, span)], (s - 0.4, 0.8), color=IDLE_COLOR, zorder=0)
        for m, kind, start, end in record:
            width = scale * (end - start)
            ax.broken_barh([(scale * start, width)], (s - 0.35, 0.7), color=OP_COLORS[kind],
                           edgecolor="white", linewidth=0.8, zorder=1)  # fmt: skip
            if width >= span / 60:  # a label where it fits
                size = 7 if width >= span / 30 else 5
                ax.text(scale * start + width / 2, s, f"{kind}{m}", ha="center", va="center",
                        fontsize=size, color="white", zorder=2)  # fmt: skip
    ax.set_yticks(range(len(records)), [f"stage {s}" for s in range(len(records))])
    ax.set(ylim=(len(records) - 0.5, -0.5), xlim=(0, span), xlabel=unit, title=title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (*OP_COLORS.values(), IDLE_COLOR)]
    ax.legend(handles, ["forward", "backward", "idle"], fontsize=8, loc="upper left",
              bbox_to_anchor=(1, 1))  # fmt: skip
    ax.figure.tight_layout()
    return ax.figure


MEASURED_MARKERS = ("o", "s", "^", "D", "v")  # bubble_curves' measured series, in turn


def bubble_curves(
    stages: Iterable[int] = (2, 4, 8, 16),
    micro_batches: Iterable[int] = range(1, 33),
    measured: dict[str, dict[int, float]] | None = None,
    ax: Axes | None = None,
) -> Figure:
    """The predicted bubble (p−1)/(m+p−1) (plan.bubble_fraction) against M, a line per P, and
    `measured` idle fractions as points: {"P = 2, measured": {M: fraction, ...}}."""
    ms = np.array(list(micro_batches))
    stages = list(stages)
    if not len(ms) or min(ms) < 1 or not stages or min(stages) < 1:
        raise ValueError("stages and micro_batches: give positive integers, at least one each")
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.8))
    for p in stages:
        ax.plot(ms, [bubble_fraction(p, m) for m in ms], label=f"P = {p}, predicted")
    for i, (label, points) in enumerate((measured or {}).items()):
        if not points:
            raise ValueError(f"measured[{label!r}]: no points")
        m_values = sorted(points)
        # a marker of its own per series, filled and hollow in turn, the hollow ones larger:
        # two stages' points that nearly coincide both stay visible
        ax.plot(
            m_values,
            [points[m] for m in m_values],
            linestyle="none",
            marker=MEASURED_MARKERS[i % len(MEASURED_MARKERS)],
            color="black",
            markerfacecolor="black" if i % 2 == 0 else "none",
            markersize=6 + 3 * (i % 2),
            label=label,
        )
    ax.set(xlabel="micro-batches per step M", ylabel="idle fraction of the step", ylim=(0, 1),
           title="the pipeline bubble (p − 1)/(m + p − 1)")  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    ax.figure.tight_layout()
    return ax.figure
