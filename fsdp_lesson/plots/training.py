"""Training curves: the loss per step, the same training in several precisions, fp16's loss
scale."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure


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
