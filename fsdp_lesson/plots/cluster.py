"""The cluster: this notebook, the ipyparallel controller and the engines that are the MPI
ranks."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyBboxPatch

from ._style import RANK_COLORS


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


def hosts_picture(
    host_of_rank: list[str], bandwidth: str, shard_groups: list[list[int]] | None = None
) -> Figure:
    """Simulated hosts (fsdp_lesson/hosts.py): each host a box with its ranks, each joined to the
    switch by its own cable of `bandwidth`; ranks of one host share memory, others the cables.

    host_of_rank[r] is rank r's host (its hostname); shard_groups, if given (HSDP), colours
    every rank by the shard group it belongs to."""
    hosts = list(dict.fromkeys(host_of_rank))
    colour = {}
    for g, group in enumerate(shard_groups or [list(range(len(host_of_rank)))]):
        colour |= dict.fromkeys(group, RANK_COLORS[g % len(RANK_COLORS)])
    width = 3.0
    fig, ax = plt.subplots(figsize=(max(6.0, 3.6 * len(hosts)), 3.2))
    switch_x = (len(hosts) * (width + 0.6) - 0.6) / 2
    _box(ax, switch_x - 1.1, 2.7, 2.2, 0.55, "switch (a bridge)", "#d9d9d9")
    for h, host in enumerate(hosts):
        x = h * (width + 0.6)
        ranks = [r for r, name in enumerate(host_of_rank) if name == host]
        ax.add_patch(
            FancyBboxPatch((x, 0.05), width, 1.55, boxstyle="round,pad=0.05", fc="#eef3fb",
                           ec="black")
        )  # fmt: skip
        ax.text(x + width / 2, 1.38, host, ha="center", va="center", fontsize=9)
        slot = width / max(1, len(ranks))
        for i, r in enumerate(ranks):
            _box(ax, x + i * slot + 0.1, 0.3, slot - 0.2, 0.6, f"rank {r}", colour[r])
        ax.plot([x + width / 2, switch_x], [1.68, 2.68], color="black", lw=2)
        ax.text((x + width / 2 + switch_x) / 2 + 0.1, 2.15, bandwidth, fontsize=8, va="center")
    if shard_groups:
        ax.text(0, -0.3, "colour: shard group", fontsize=8, va="center")
    ax.set(xlim=(-0.2, len(hosts) * (width + 0.6) - 0.4), ylim=(-0.45, 3.4))
    ax.axis("off")
    fig.tight_layout()
    return fig
