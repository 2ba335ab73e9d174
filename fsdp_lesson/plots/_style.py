"""What the pictures share: the colours of collectives, lanes and ranks, bytes shown as kB, and
the finish of a bar chart with its dashed formula line (formula_legend says what that line is)."""

from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

KINDS = ("allreduce", "allgather", "reduce_scatter")
KIND_COLORS = dict(zip(KINDS, ("#4c72b0", "#55a868", "#dd8452"), strict=True))
LANE_COLORS = {"compute": "#4c72b0", "comm": "#dd8452"}
RANK_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3")
KB = FuncFormatter(lambda value, _: f"{value / 1e3:g}")  # bytes on the axis, shown as kB


def _finish(fig: Figure, ax: Axes, ylabel: str, title: str) -> Figure:
    """Bytes shown as kB, the legend outside on the right, a tight layout."""
    ax.yaxis.set_major_formatter(KB)
    ax.set(ylabel=ylabel, title=title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig


def _formula_lines(ax: Axes, lines: list[tuple]) -> None:
    """A dashed black line labelled "formula" at each (total, from x, to x), if any."""
    if lines:
        ax.hlines(*zip(*lines, strict=True), colors="black", linestyles="--", label="formula")


PAPER_FORMULA = "ZeRO formula (Ψ_pad): params + grads + optimizer"  # the dashed line's meaning


def formula_legend(fig: Figure, meaning: str = PAPER_FORMULA) -> Figure:
    """Say in the legend what the dashed line of memory_bars/traffic_bars is, and keep it
    inside the frame (a little headroom above the tallest bar or line)."""
    ax = fig.axes[0]
    for collection in ax.collections:  # the dashed formula lines (not memory_bars' moments)
        if collection.get_label() == "formula":
            collection.set_label(meaning)
    top = max([p.get_y() + p.get_height() for p in ax.patches if p.get_height()] or [0.0])
    lines = [y for c in ax.collections for s in c.get_segments() for _, y in s]
    ax.set_ylim(0, 1.08 * max([top, *lines]))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig
