"""One training step in time order: each rank's compute and collectives as traced, and which
collective a strategy runs when."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from ..config import ModelConfig
from ..dryrun import COMPUTE
from ..dryrun import step_events as dry_step_events
from ..plan import PLANNED
from ._style import KIND_COLORS, KINDS, LANE_COLORS

TRACE_LANES = {  # the trace's lanes, top to bottom within a rank's row, and their colours
    "compute": LANE_COLORS["compute"],
    "allgather": KIND_COLORS["allgather"],
    "reduce_scatter": KIND_COLORS["reduce_scatter"],
    "allreduce": "#8172b3",  # HSDP's replicate allreduce: not compute's blue
}


def timeline(
    traces: dict[str, list[list]],
    ax: Axes | None = None,
    title: str = "one step on every rank: each unit's compute and each collective",
) -> Figure:
    """One row per rank and run, over one step: a lane for compute and one per collective kind
    (allgather, reduce-scatter, allreduce), so that overlapping collectives stay apart.

    A trace is History.trace: (lane, what, start s, end s) spans from the step's start, `what`
    beginning with the collective's kind on the "comm" lane. A collective's span runs from its
    issue to its completion (as seen by the rank's wait).
    """
    rows = [
        (label, rank, trace)
        for label, per_rank in traces.items()
        for rank, trace in enumerate(per_rank)
    ]
    kinds = {
        what.split()[0] for _, _, trace in rows for lane, what, _, _ in trace if lane == "comm"
    }
    lanes = ["compute"] + [kind for kind in TRACE_LANES if kind in kinds]
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.25 * len(lanes) * len(rows) + 1.5))
    height = 0.9 / len(lanes)
    for row, (_label, _rank, trace) in enumerate(rows):
        for lane, what, start, end in trace:
            name = "compute" if lane == "compute" else what.split()[0]
            y = row + 0.05 + height * lanes.index(name)
            ax.broken_barh(
                [(1e3 * start, 1e3 * (end - start))],
                (y + 0.1 * height, 0.8 * height),
                color=TRACE_LANES[name],
                edgecolor="white",  # back-to-back collectives stay apart
                linewidth=0.5,
                alpha=0.8,
            )
    for row in range(1, len(rows)):  # a thin line between ranks, a thick one between runs
        new_run = rows[row][0] != rows[row - 1][0]
        ax.axhline(row, color="black" if new_run else "#d0d0d0", lw=1.2 if new_run else 0.6)
    ax.set_yticks(np.arange(len(rows)) + 0.5, [f"{label} r{rank}" for label, rank, _ in rows])
    ax.set_ylim(len(rows), 0)
    ax.set_xlabel("ms since the step began")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=TRACE_LANES[lane]) for lane in lanes]
    names = {"compute": "compute (per unit)", "reduce_scatter": "reduce-scatter"}
    ax.legend(
        handles,
        [names.get(lane, lane) for lane in lanes],
        title="lanes, top to bottom\n(collectives: issue\nto completion)",
        fontsize=8,
        title_fontsize=8,
        loc="upper left",
        bbox_to_anchor=(1, 1),
    )
    ax.figure.tight_layout()
    return ax.figure


def step_events(strategy: str, model_config: ModelConfig | None = None, **options) -> list[tuple]:
    """(phase, kind, label) of one training step of a strategy on 2 ranks, in order, for the
    layers that have parameters: kind is COMPUTE or a collective. Not a description: the
    strategy's own code, run dry (dryrun.step_events)."""
    if strategy not in PLANNED:
        raise ValueError(f"unknown strategy {strategy!r}: use one of {', '.join(PLANNED)}")
    return dry_step_events(strategy, model_config, **options)


def step_collectives(strategy: str, model_config: ModelConfig | None = None, **options) -> Figure:
    """One step as a time line: computation on the top lane, collectives below, by phase
    (`options`: the strategy's, e.g. zero3's prefetch=False)."""
    events = step_events(strategy, model_config, **options)
    fig, ax = plt.subplots(figsize=(max(8, 0.62 * len(events)), 2.5))
    phases = {}  # phase -> (first x, last x)
    for x, (phase, kind, label) in enumerate(events):
        first, _ = phases.get(phase, (x, x))
        phases[phase] = (first, x)
        lane, color = (1, "#d9d9d9") if kind == COMPUTE else (0, KIND_COLORS[kind])
        ax.add_patch(FancyBboxPatch((x + 0.05, lane + 0.1), 0.9, 0.8, boxstyle="round,pad=0.02",
                                    fc=color, ec="black"))  # fmt: skip
        ax.text(x + 0.5, lane + 0.5, label.replace(" ", "\n", 1), ha="center", va="center",
                fontsize=7, color="black" if kind == COMPUTE else "white")  # fmt: skip
    for i, (phase, (first, last)) in enumerate(phases.items()):
        ax.axvspan(first, last + 1, color="#f4f4f4" if i % 2 else "white", zorder=0)
        ax.text((first + last + 1) / 2, 2.05, phase, ha="center", va="bottom", fontsize=10)
    for kind in KINDS:
        if any(k == kind for _, k, _ in events):
            ax.bar(0, 0, color=KIND_COLORS[kind], label=kind)  # a legend entry, nothing drawn
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    ax.set(xlim=(0, len(events)), ylim=(0, 2.5))
    ax.set_yticks([0.5, 1.5], ["collectives", "computation"])
    ax.set_xticks([])
    ax.set_title(f"{strategy}: one training step, in time order", fontsize=10)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig
