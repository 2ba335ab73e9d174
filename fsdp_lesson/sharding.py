"""The one sharding table: which ZeRO level shards which state, and the list of strategies.

    level        params   grads   optimizer state
    single, dp   full     full    full
    zero1        full     full    1/N
    zero2        full     1/N     1/N
    zero3        1/N      1/N     1/N

A category is sharded from the level named in SHARDED_FROM on: one comparison, as llm.c's
`multi_gpu_get_shard_offset` does it. Allocation (strategies/), the planner (plan.py) and
checkpoints (through each strategy's state) all read this table.
"""

from __future__ import annotations

# Every strategy by name, with its shard level: the ZeRO paper's stage (single and dp shard
# nothing). "Stage" is kept for a pipeline's stages (pipeline.py).
SHARD_LEVEL = {"single": 0, "dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
STRATEGIES = tuple(SHARD_LEVEL)

# The first level at which a category is split over the ranks.
SHARDED_FROM = {"optimizer": 1, "grads": 2, "params": 3}


def is_sharded(level: int, category: str) -> bool:
    """Whether shard level `level` keeps only 1/N of `category` ("params", "grads", "optimizer")."""
    return level >= SHARDED_FROM[category]
