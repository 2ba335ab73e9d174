"""Which (dp, tp, pp) meshes (cp = 1) fit a GPU: predicted bytes per GPU of every mesh, a panel
per model, with the GPU's capacity as a dashed line (plan.mesh_gpu_bytes: formulas, not
measurements)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.figure import Figure

from ..plan import GPU_CAPACITY, MODELS, mesh_gpu_bytes, meshes
from .memory import CATEGORY_COLORS

MESH_PARTS = ("params", "grads", "optimizer", "gathered", "activations")
MESH_COLORS = dict(CATEGORY_COLORS, gathered=CATEGORY_COLORS["buffers"])
MESH_GPUS = {"7B": 8, "70B": 64, "405B": 1024}  # a server, eight servers, a thousand GPUs


def mesh_memory(
    gpus: dict[str, int] = MESH_GPUS,
    stage: str = "zero1",
    capacity: float = GPU_CAPACITY,
    **levers,
) -> Figure:
    """For each model (plan.MODELS' name: its GPU count) a panel with one stacked bar per
    mesh (plan.meshes), a first-stage GPU's GiB by category; `levers` are mesh_gpu_bytes'
    (recompute, micro_batches, ...). Bars above 3x the capacity are cut, their total written."""
    panels = {name: meshes(MODELS[name], n) for name, n in gpus.items()}
    fig, axes = plt.subplots(
        1, len(panels), figsize=(2 + 0.25 * sum(map(len, panels.values())), 4), sharey=True,
        gridspec_kw={"width_ratios": [len(m) for m in panels.values()]}, squeeze=False,
    )  # fmt: skip
    top = 3 * capacity / 2**30
    for ax, (name, mesh_list) in zip(axes[0], panels.items(), strict=True):
        parts = [mesh_gpu_bytes(MODELS[name], stage, *mesh, **levers) for mesh in mesh_list]
        xs, bottom = np.arange(len(mesh_list)), np.zeros(len(mesh_list))
        for part in MESH_PARTS:
            heights = np.array([p[part] for p in parts]) / 2**30
            ax.bar(xs, heights, 0.8, bottom, color=MESH_COLORS[part], label=part)
            bottom += heights
        for x, total in zip(xs, bottom, strict=True):
            if total > top:
                ax.text(x, 0.98 * top, f"{total:,.0f} GiB", rotation=90, ha="center", va="top",
                        color="white", fontsize=7)  # fmt: skip
        ax.axhline(capacity / 2**30, color="black", linestyle="--", label="GPU capacity")
        ax.set_xticks(xs, [f"{tp}×{pp}" for _, tp, pp, _ in mesh_list], rotation=90, fontsize=7)
        ax.set(title=f"{name} on {gpus[name]} GPUs", xlabel="tp × pp (dp: the rest)")
    axes[0][0].set(ylim=(0, top), ylabel="GiB per GPU (first pipeline stage)")
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))
    fig.suptitle(f"predicted bytes per GPU by mesh ({stage}); below the dashed line it fits")
    fig.tight_layout()
    return fig
