"""The one sharding table: which ZeRO stage shards which state, and the list of strategies.

    stage        params   grads   optimizer state
    single, dp   full     full    full
    zero1        full     full    1/N
    zero2        full     1/N     1/N
    zero3        1/N      1/N     1/N

A category is sharded from the stage named in SHARDED_FROM on: one comparison, as llm.c's
`multi_gpu_get_shard_offset` does it. Allocation (strategies/), the planner (plan.py) and
checkpoints (through each strategy's state) all read this table.
"""

from __future__ import annotations

# Every strategy by name, with its ZeRO stage (single and dp shard nothing).
ZERO_STAGE = {"single": 0, "dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}
STRATEGIES = tuple(ZERO_STAGE)

# The first stage at which a category is split over the ranks.
SHARDED_FROM = {"optimizer": 1, "grads": 2, "params": 3}


def is_sharded(stage: int, category: str) -> bool:
    """Whether ZeRO stage `stage` keeps only 1/N of `category` ("params", "grads", "optimizer")."""
    return stage >= SHARDED_FROM[category]
