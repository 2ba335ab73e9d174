"""Small matplotlib helpers for the notebooks: each takes plain data and returns its Figure.

loss_curves({"single": losses, "dp": losses})            smoothed loss per step
memory_bars({"dp": [peak of rank 0, ...]}, formula)       per-rank bytes by category
traffic_bars({"dp": {"allreduce": bytes}}, formula)       bytes sent per step by collective
collective_picture(before, after, "Allreduce")            what a collective does to 4 ranks
timeline({"prefetch": [trace of rank 0, ...]})            one step's compute and collectives
name_statistics(lengths, letter_counts)                   the names file at a glance (01)
token_rows(X, Y, "title")                                 context rows: padding, letters, target
batch_by_rank(Y_batch, n)                                 which rank keeps which row of a batch
cluster_picture(engine_ids)                               notebook, controller, engines = ranks
step_collectives("zero2")                                 which collective runs when in a step
shard_layout({"fc1": FlatParam, ...})                     each layer's flat vector by owner
bytes_per_parameter({"fp32": plan.FP32_ADAM, ...})        params, grads, optimizer state per param
gathered_units({"prefetch": history.timeline})            which units are gathered, event by event
commbench_fits(points, fits)                              timed collectives, fitted alpha-beta lines
latency_or_bandwidth(line, {"seed N=2": bytes})           where a message size sits: alpha or beta
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch
from matplotlib.ticker import FuncFormatter

from . import commbench
from .data import ALPHABET
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
    x, ticks, labels, lines, groups = 0, [], [], [], []  # lines: (total, from x, to x)
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
        labels += [f"r{r}" for r in range(len(per_rank))]
        groups.append(((xs[0] + xs[-1]) / 2, label))
        x += len(per_rank) + 1
    if lines:
        ax.hlines(*zip(*lines, strict=True), colors="black", linestyles="--", label="formula")
    ax.set_xticks(ticks, labels, fontsize=8)  # r0, r1, ...: each bar's rank
    names = ax.secondary_xaxis("bottom")  # and each group's label, centred below its bars
    names.set_xticks(*zip(*groups, strict=True))
    names.tick_params(length=0, pad=16)
    names.spines["bottom"].set_visible(False)
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


RANK_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3")
PAD_COLOR = "#c8c8c8"


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


def _box(ax: Axes, x: float, y: float, w: float, h: float, text: str, color: str) -> None:
    """A rounded box with centred text."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02", fc=color, ec="black"))
    ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=9)


def _arrow(ax: Axes, start: tuple, end: tuple, text: str = "", **style) -> None:
    """A double-headed arrow from start to end, labelled at its middle."""
    ax.annotate("", end, start, arrowprops=dict(arrowstyle="<->", lw=1.5, **style))
    if text:
        middle = ((start[0] + end[0]) / 2, (start[1] + end[1]) / 2 + 0.12)
        ax.text(*middle, text, ha="center", va="bottom", fontsize=8)


def cluster_picture(engine_ids: list[int]) -> Figure:
    """The notebook talks to the controller; the controller to the engines, one per MPI rank.

    engine_ids[r] is the ipyparallel engine id of rank r (Ranks.view.targets)."""
    n = len(engine_ids)
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.75 * n))
    height = 0.75 * n
    _box(ax, 0, height / 2 - 0.45, 2.2, 0.9, "this notebook\n(its kernel)", "#fdd0a2")
    _box(ax, 3.6, height / 2 - 0.45, 2.2, 0.9, "controller\n(ipcontroller)", "#d9d9d9")
    how = "%%px, pull, ranks.run\n(code and results,\nover ZeroMQ)"
    _arrow(ax, (2.25, height / 2), (3.55, height / 2), how)
    ax.add_patch(
        FancyBboxPatch((7.0, 0.05), 2.9, height - 0.1, boxstyle="round,pad=0.05", fc="#eef3fb",
                       ec=RANK_COLORS[0], ls="--")
    )  # fmt: skip
    ax.text(8.45, height + 0.05, "one MPI world (mpiexec)", ha="center", va="bottom", fontsize=9)
    for r, engine in enumerate(engine_ids):
        y = height - 0.75 * (r + 1) + 0.15
        _box(ax, 7.2, y, 2.5, 0.5, f"engine id {engine} = MPI rank {r}", "white")
        _arrow(ax, (5.85, height / 2), (7.15, y + 0.25), color="#777777")
    ax.text(10.1, height / 2, "MPI\ncollectives\nbetween\nthe ranks", fontsize=8, va="center")
    ax.set(xlim=(-0.1, 11.2), ylim=(-0.1, height + 0.4))
    ax.axis("off")
    fig.tight_layout()
    return fig


STAGES = ("dp", "zero1", "zero2", "zero3")
COMPUTE = "compute"


def step_events(stage: str, layers: tuple[str, ...] = ("emb", "fc1", "fc2")) -> list[tuple]:
    """(phase, kind, label) of one training step of a strategy, in order, for the layers that
    have parameters: kind is COMPUTE or a collective. As strategies/*.py and train.py do it."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}: use one of {', '.join(STAGES)}")
    events = []
    for layer in layers:  # forward
        if stage == "zero3":
            events.append(("forward", "allgather", f"params {layer}"))
        events.append(("forward", COMPUTE, layer))
    for layer in reversed(layers):  # backward
        if stage == "zero3":
            events.append(("backward", "allgather", f"params {layer}"))
        events.append(("backward", COMPUTE, layer))
        if stage == "dp":
            events.append(("backward", "allreduce", f"grad {layer}"))
        elif stage in ("zero2", "zero3"):
            events.append(("backward", "reduce_scatter", f"grad {layer}"))
    for layer in layers:  # update
        if stage == "zero1":
            events.append(("update", "reduce_scatter", f"grad {layer}"))
        events.append(("update", COMPUTE, f"{'all of ' if stage == 'dp' else 'shard '}{layer}"))
        if stage in ("zero1", "zero2"):
            events.append(("update", "allgather", f"params {layer}"))
    events.append(("log", "allreduce", "loss (8 B)"))  # run() logs the mean loss every step
    return events


def step_collectives(stage: str, layers: tuple[str, ...] = ("emb", "fc1", "fc2")) -> Figure:
    """One step as a time line: computation on the top lane, collectives below, by phase."""
    events = step_events(stage, layers)
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
    ax.set_title(f"{stage}: one training step, in time order", fontsize=10)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    fig.tight_layout()
    return fig


# --- notebooks 05, 07-09: ZeRO-3's schedule, memory over a step, shards, the dashed line ----

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


def shard_layout(layouts: dict, zoom_layer: str = "fc2", zoom_cells: int = 40) -> Figure:
    """Each layer's padded flat vector (a FlatParam) coloured by the rank that owns each slice,
    padding grey; then the last `zoom_cells` elements of one layer, one cell per element."""
    fig, axes = plt.subplots(len(layouts) + 1, 1, figsize=(10, 1.0 * len(layouts) + 1.4),
                             height_ratios=[1] * len(layouts) + [1.4])  # fmt: skip
    for ax, (name, f) in zip(axes, layouts.items(), strict=False):
        for r in range(f.world_size):
            start, stop = f.shard_range(r)
            ax.barh(0, min(stop, f.numel) - start, left=start, color=RANK_COLORS[r], ec="white")
            ax.text((start + stop) / 2, 0, f"rank {r}: [{start:,}, {stop:,})", ha="center",
                    va="center", color="white", fontsize=8)  # fmt: skip
        if f.padding:
            ax.barh(0, f.padding, left=f.numel, color=PAD_COLOR, hatch="///")
        if "b" in f.sizes:
            ax.axvline(f.sizes["W"], color="black", lw=1)  # where W ends and b begins
        ax.set(xlim=(0, f.padded_numel), xticks=[])
        ax.set_yticks([0], [name])
        label = f"{f.numel:,} + {f.padding} padding\n= {f.world_size} x {f.shard_size:,}"
        ax.text(1.01, 0.5, label, transform=ax.transAxes, va="center", fontsize=8)
    f, ax = layouts[zoom_layer], axes[-1]
    first = f.padded_numel - zoom_cells
    for i in range(first, f.padded_numel):
        part = "W" if i < f.sizes["W"] else "b" if i < f.numel else "pad"
        color = PAD_COLOR if part == "pad" else RANK_COLORS[i // f.shard_size]
        ax.bar(i, 1, width=0.92, color=color, hatch="///" if part == "pad" else None)
        ax.text(
            i,
            0.5,
            part,
            ha="center",
            va="center",
            fontsize=6 if part == "pad" else 7,
            rotation=90 if part == "pad" else 0,
            color="black" if part == "pad" else "white",
        )
    ticks = [first, f.sizes["W"], f.numel]
    ax.set_xticks(ticks, [f"{t:,}" for t in ticks], fontsize=8)
    ax.set(yticks=[], xlim=(first - 0.6, f.padded_numel - 0.4))
    ax.set_title(f"the last {zoom_cells} elements of {zoom_layer}: all owned by rank "
                 f"{first // f.shard_size}, padding grey", fontsize=9)  # fmt: skip
    fig.tight_layout()
    return fig


def bytes_per_parameter(precisions: dict) -> Figure:
    """One horizontal bar per precision (a plan.Precision): params + grads + optimizer state."""
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


def memory_timeline(timelines: dict[str, list[tuple[str, int]]]) -> Figure:
    """Live bytes on a rank at every ledger event of one step, a panel per strategy; the
    backward pass shaded from the event "hold dlogits"; zero3's gathers (the events
    "hold <layer> gathered") dotted."""
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
        span = max(live) - min(live)
        ax.set_ylim(min(live) - 0.3 * span, max(live) + 0.1 * span)
        ax.yaxis.set_major_formatter(KB)
        ax.set_ylabel("kB live on each rank")
        gathers = any(e.startswith("hold") and e.endswith(" gathered") for e in events)
        dotted = " (dotted: a layer is gathered)" if gathers else ""
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


def commbench_fits(points: list[dict], fits: dict) -> Figure:
    """Measured seconds per call against buffer bytes, log-log, one panel per kind: a marker
    per point (commbench.time_collectives), a line per fit (colour: impl; dashes: N)."""
    kinds = commbench.KINDS
    fig, axes = plt.subplots(1, len(kinds), figsize=(3.2 * len(kinds), 3.4), sharey=True)
    colors = {"p2p": "tab:gray", "mpi": "tab:blue", "ring": "tab:orange"}
    dashes = dict(zip(sorted({p["ranks"] for p in points}), ("-", "--", ":", "-."), strict=False))
    for ax, kind in zip(axes, kinds, strict=True):
        for n, impl in sorted({(p["ranks"], p["impl"]) for p in points if p["kind"] == kind}):
            mine = [p for p in points if (p["ranks"], p["impl"], p["kind"]) == (n, impl, kind)]
            mine.sort(key=lambda p: p["buffer_bytes"])
            line = fits[n][impl][kind]
            x = [p["buffer_bytes"] for p in mine]
            fitted = [commbench.line_seconds(line, p["messages"], p["sent_bytes"]) for p in mine]
            ax.loglog(x, [p["seconds"] for p in mine], "o", color=colors[impl], ms=3)
            ax.loglog(x, fitted, dashes[n], color=colors[impl], label=f"{impl} N={n}")
        ax.set_title(kind)
        ax.set_xlabel("buffer bytes")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("seconds per call")
    fig.tight_layout()
    return fig


def latency_or_bandwidth(line: dict, message_bytes: dict[str, float]) -> Figure:
    """One message's predicted time, alpha + beta * bytes, log-log, with its two asymptotes,
    the crossover alpha / beta, and a marker per labelled message size (e.g. a model's mean)."""
    alpha, beta = line["alpha_s"], line["beta_s_per_byte"]
    crossover = alpha / beta
    x = np.logspace(0, 9, 200)  # 1 B to 1 GB
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.loglog(x, alpha + beta * x, color="black", label="α + β · bytes")
    ax.loglog(x, np.full_like(x, alpha), ":", color="tab:red", label=f"α = {alpha * 1e6:.3g} µs")
    ax.loglog(x, beta * x, ":", color="tab:blue", label=f"β · bytes, 1/β = {1e-9 / beta:.3g} GB/s")
    ax.axvline(crossover, color="gray", linestyle="--", label=f"α/β = {crossover:,.0f} B")
    for i, (label, size) in enumerate(message_bytes.items()):
        ax.plot(size, alpha + beta * size, "o", color=plt.cm.tab10(i + 2), label=label)
    ax.set(xlabel="bytes per message", ylabel="seconds per message", ylim=(alpha / 3, None))
    ax.set_title("left of α/β latency-bound, right of it bandwidth-bound", fontsize=10)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig


# --- notebook 03: the ring allreduce, step by step -----------------------------------------


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
    ax.hlines(*zip(*lines, strict=True), colors="black", linestyles="--", label="formula")
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_xlabel("rank (configuration below)", labelpad=22)
    return _finish(fig, ax, "peak kB per rank", "memory per rank by lever (ledger peaks)")


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


def precision_curves(curves: dict[str, np.ndarray], margin: float, smooth: int = 100) -> Figure:
    """Loss curves of one training in several precisions, the first (fp32) wide and solid under
    the others dashed; below, each other curve minus the first, inside a band of ± margin."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True, height_ratios=[2, 1])
    loss_curves(curves, smooth=smooth, ax=top)
    for i, line in enumerate(top.lines):
        line.set(linestyle="-" if i == 0 else "--", linewidth=3.0 if i == 0 else 1.5)
    top.legend()
    top.set(xlabel="", title=f"the same training in {', '.join(curves)}")
    (first, reference), *others = curves.items()
    base = running_mean(reference, smooth)
    steps = np.arange(len(reference) - len(base), len(reference))
    for i, (label, values) in enumerate(others, start=1):
        bottom.plot(steps, running_mean(values, smooth) - base, color=plt.cm.tab10(i), lw=1,
                    label=f"{label} − {first}")  # fmt: skip
    bottom.axhspan(-margin, margin, color="#55a868", alpha=0.2, label=f"± {margin}: the margin")
    bottom.axhline(0, color="grey", lw=0.5)
    bottom.set(xlabel="step", ylabel=f"difference to {first}")
    bottom.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    return fig


def loss_scale(scales: list[float], skipped: list[bool]) -> Figure:
    """fp16's dynamic loss scale per step (log2), each skipped step (an overflow) marked."""
    fig, ax = plt.subplots(figsize=(8, 3))
    steps = np.arange(len(scales))
    ax.step(steps, np.log2(scales), where="post", color="#4c72b0", label="log₂ of the loss scale")
    bad = np.flatnonzero(skipped)
    ax.plot(bad, np.log2(np.asarray(scales)[bad]), "x", color="#c44e52", ms=7,
            label=f"skipped step: an inf in a gradient ({len(bad)})")  # fmt: skip
    ax.set(xlabel="step", ylabel="log₂ S", title="fp16: the loss scale halves at an overflow, "
           "doubles after a run of good steps")  # fmt: skip
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig
