"""Small matplotlib helpers for the notebooks: each takes plain data and returns its Figure.

One module per kind of picture; every name is importable from here (`plots.memory_bars`):

training       loss_curves({"single": losses, "dp": losses})      smoothed loss per step
               precision_curves(curves, margin), loss_scale(...)  bf16/fp16 against fp32 (07)
data           name_statistics(lengths, letter_counts)            the names file at a glance (01)
               token_rows(X, Y, "title")                          context rows: padding, letters
               batch_by_rank(Y_batch, n)                          which rank keeps which row
cluster        cluster_picture(engine_ids)                        notebook, controller, engines
               hosts_picture(host_of_rank, "1gbit")               simulated hosts and their cables
collectives    collective_picture(before, after, "Allreduce")     what a collective does to ranks
               ring_steps(n)                                      a ring allreduce, step by step
communication  traffic_bars({"dp": {"allreduce": bytes}}, ...)   bytes sent per step by collective
               commbench_fits(points, fits)                       timed collectives, alpha-beta fits
               latency_or_bandwidth(line, {"seed N=2": bytes})    a message size: alpha or beta
timelines      timeline({"prefetch": [trace of rank 0, ...]})     one step's compute and collectives
               step_collectives("zero2")                          which collective runs when
memory         memory_bars({"dp": [peak of rank 0, ...]}, ...)    per-rank bytes by category
               bytes_per_parameter({"fp32": plan.FP32_ADAM})      params, grads, optimizer per param
               lever_bars, activation_vs_batch                    the memory levers (07)
               activation_vs_sequence(s, ledger, counted)         activations against s (14)
               memory_timeline, gathered_units                    live bytes over one step's events
mesh           mesh_memory({"405B": 1024}, recompute=True)        the (dp, tp, pp) meshes that fit
context        ring_balance({"zigzag": scores}, {"zigzag": secs})  ring attention's work per cp rank
pipeline       pipeline_lanes(records), bubble_curves((2, 4))     stages' ops and idle; the bubble
shards         shard_layout({"fc1": FlatParam, ...}), rank_shards each layer's flat vector by owner
_style         formula_legend(fig), KB, the colours               what the pictures share
"""

from ._style import (
    KB,
    KIND_COLORS,
    KINDS,
    LANE_COLORS,
    PAPER_FORMULA,
    RANK_COLORS,
    formula_legend,
)
from .cluster import cluster_picture, hosts_picture
from .collectives import RING_LEGEND, RING_OUTLINE, collective_picture, ring_moves, ring_steps
from .communication import commbench_fits, latency_or_bandwidth, traffic_bars
from .context import ring_balance
from .data import batch_by_rank, name_statistics, token_rows
from .memory import (
    CATEGORY_COLORS,
    LEVER_COLORS,
    LEVER_PARTS,
    activation_vs_batch,
    activation_vs_sequence,
    bytes_per_parameter,
    gathered_spans,
    gathered_units,
    lever_bars,
    memory_bars,
    memory_timeline,
    split_master,
)
from .mesh import MESH_COLORS, MESH_GPUS, MESH_PARTS, mesh_memory
from .pipeline import IDLE_COLOR, OP_COLORS, bubble_curves, pipeline_lanes
from .shards import PAD_COLOR, rank_shards, shard_layout
from .timelines import COMPUTE, PLANNED, TRACE_LANES, step_collectives, step_events, timeline
from .training import loss_curves, loss_scale, precision_curves, running_mean

__all__ = [
    "CATEGORY_COLORS",
    "COMPUTE",
    "IDLE_COLOR",
    "KB",
    "KINDS",
    "KIND_COLORS",
    "LANE_COLORS",
    "LEVER_COLORS",
    "LEVER_PARTS",
    "MESH_COLORS",
    "MESH_GPUS",
    "MESH_PARTS",
    "OP_COLORS",
    "PAD_COLOR",
    "PAPER_FORMULA",
    "RANK_COLORS",
    "RING_LEGEND",
    "RING_OUTLINE",
    "PLANNED",
    "TRACE_LANES",
    "activation_vs_batch",
    "activation_vs_sequence",
    "batch_by_rank",
    "bubble_curves",
    "bytes_per_parameter",
    "cluster_picture",
    "collective_picture",
    "commbench_fits",
    "formula_legend",
    "gathered_spans",
    "gathered_units",
    "hosts_picture",
    "latency_or_bandwidth",
    "lever_bars",
    "loss_curves",
    "loss_scale",
    "memory_bars",
    "memory_timeline",
    "mesh_memory",
    "name_statistics",
    "pipeline_lanes",
    "precision_curves",
    "rank_shards",
    "ring_balance",
    "ring_moves",
    "ring_steps",
    "running_mean",
    "shard_layout",
    "split_master",
    "step_collectives",
    "step_events",
    "timeline",
    "token_rows",
    "traffic_bars",
]
