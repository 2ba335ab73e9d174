"""Context parallelism in pictures: each cp rank's share of ring attention's work, as counted
(scores computed) and as measured (compute seconds), per layout, both relative to the rank
with the least, so that counts and seconds share one axis."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from ._style import RANK_COLORS


def ring_balance(counted: dict[str, list], measured: dict[str, list] | None = None) -> Figure:
    """One group of bars per layout, a bar per rank: its work over the least busy rank's (1 =
    balanced). `counted`: {layout: [scores per rank]} (ring_attention.ring_work); `measured`:
    {layout: [seconds per rank]} with the same layouts, drawn as black dots over the bars."""
    if not counted or any(len(v) == 0 or min(v) <= 0 for v in counted.values()):
        raise ValueError("counted: give {layout: [work per rank]} with positive work on every rank")
    if measured is not None and (
        set(measured) != set(counted)
        or any(len(measured[k]) != len(counted[k]) or min(measured[k]) <= 0 for k in counted)
    ):
        raise ValueError(
            "measured: give the same layouts as counted, with positive seconds for every rank"
        )
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    ranks = len(next(iter(counted.values())))
    width = 0.8 / ranks
    for g, (name, work) in enumerate(counted.items()):
        relative = np.asarray(work, float) / min(work)
        for r, value in enumerate(relative):
            x = g + (r - (ranks - 1) / 2) * width
            ax.bar(x, value, width, color=RANK_COLORS[r % len(RANK_COLORS)],
                   label=f"rank {r}" if g == 0 else None)  # fmt: skip
            if measured is not None:
                seconds = np.asarray(measured[name], float)
                ax.plot(x, seconds[r] / seconds.min(), "o", color="black",
                        label="measured" if g == 0 and r == 0 else None)  # fmt: skip
    ax.axhline(1, color="grey", lw=0.8, ls=":")
    ax.set_xticks(range(len(counted)), list(counted))
    ax.set(
        ylabel="work / least busy rank's", title="ring attention's work per rank (bars: counted)"
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.tight_layout()
    return fig
