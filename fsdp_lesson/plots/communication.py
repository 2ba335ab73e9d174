"""What communication costs: bytes sent per step by collective, and timed collectives against
the alpha-beta model (latency- or bandwidth-bound)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from .. import commbench
from ._style import KIND_COLORS, KINDS, _finish, _formula_lines


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
    _formula_lines(ax, lines)
    ax.set_xticks(xs, list(traffic))
    return _finish(fig, ax, "kB sent per rank per step", "communication per step")


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
