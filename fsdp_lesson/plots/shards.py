"""ZeRO's shards: each layer's padded flat vector by the rank that owns each slice, and what
each rank keeps of every layer."""

from __future__ import annotations

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from ._style import RANK_COLORS

PAD_COLOR = "#c8c8c8"


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
