"""Memory admission: a run's peak per rank predicted before anything is allocated, and refused
when it exceeds --memory-budget-mb or the machine's available memory, with what would fit.

The prediction is the planner's (plan.ledger_bytes: the strategy's own code run dry), plus the
step history and a step's batch; train.prepare calls check_memory before loading the data.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import plan
from .bounds import meminfo
from .comm import Comm, ranks_on_this_host
from .config import ModelConfig, TrainConfig
from .data import batch_bytes, load_bytes
from .memory import MemoryBudgetError
from .strategies import STRATEGY_CLASSES, strategy_options


def predicted_peak(strategy: str, model_config: ModelConfig, tc: TrainConfig, n: int) -> int:
    """Bytes per rank that training allocates on n ranks: plan.ledger_bytes for the strategy
    over the data-parallel ranks (exact, as the tests check; with --tp, on this rank's pieces;
    with --pp, the largest of the stages', so that every rank refuses a run one rank could not
    fit), the step history, and a step's batch (step_batch_bytes)."""

    options = memory_options(tc) | strategy_options(strategy, tc)
    options |= dict(pp=tc.pp, micro_batches=tc.micro_batches, schedule=tc.schedule)
    dp = data_parallel_size(tc, n)
    ledger = max(
        sum(
            plan.ledger_bytes(
                strategy,
                model_config,
                dp,
                tc.optimizer,
                tc.batch // dp,
                recompute=tc.recompute,
                tp=tc.tp,
                sequence_parallel=tc.sequence_parallel,
                cp=tc.cp,
                cp_layout=tc.cp_layout,
                stage=stage,
                **options,
            ).values()
        )
        for stage in range(tc.pp)
    )
    return ledger + 3 * 8 * tc.steps + step_batch_bytes(model_config, tc, n)


def data_parallel_size(tc: TrainConfig, n: int) -> int:
    """The ranks the batch is split among: N / (T * P * C) (mesh.py); --strategy runs over
    them and, with --cp, over the C context-parallel ranks of each."""
    return n // (tc.tp * tc.pp * tc.cp)


# What train_step's np.split and its list of losses keep per micro-batch: two array views and
# a float (290 bytes measured, with tracemalloc, at 10^6 micro-batches).
MICRO_BATCH_BYTES = 320


def step_batch_bytes(model_config: ModelConfig, tc: TrainConfig, n: int) -> int:
    """A step's batch on one of n ranks: the index of every row of the global batch (--batch
    rows times --accum), this rank's rows of tokens (of the data-parallel ranks' share), and
    the --accum (times a pipeline's --micro-batches) micro-batches cut from them."""
    rows, dp, pieces = tc.batch * tc.accum, data_parallel_size(tc, n), tc.accum * tc.micro_batches
    return batch_bytes(rows, dp, model_config.seq_len, tc.c_compat) + MICRO_BATCH_BYTES * pieces


def memory_options(tc: TrainConfig) -> dict:
    """The memory options (levers) every strategy takes: precision and gradient accumulation."""
    return dict(precision=tc.precision, accum=tc.accum, accum_reduce=tc.accum_reduce)


def check_memory(
    model_config: ModelConfig, tc: TrainConfig, comm: Comm, data_path: Path | None = None
) -> None:
    """Refuse a run whose predicted peak per rank exceeds the budget or the machine's memory.

    The prediction is made before anything is allocated (and before the names file at
    data_path is read: its size bounds what loading it takes), so nothing is half-built when a
    run is refused, and the machine's OOM killer never has to step in. The budget bounds what
    training allocates; the machine's available memory that plus the dataset every rank loads.
    """
    need, mib = predicted_peak(tc.strategy, model_config, tc, comm.size), 2**20
    ranks = f"{comm.size} rank" + ("s" if comm.size > 1 else "")
    if tc.memory_budget_mb is not None and need > tc.memory_budget_mb * mib:
        allowed = tc.memory_budget_mb * mib
        hint = _fitting_strategy(model_config, tc, comm.size, allowed) or _batch_hint(
            model_config, tc, comm.size, need
        )
        raise MemoryBudgetError(
            f"this run would need {need / mib:,.1f} MiB per rank ({tc.strategy} on {ranks}, "
            f"predicted before allocating anything), more than the budget of "
            f"{tc.memory_budget_mb:g} MiB: {hint}"
        )
    available = agreed_available_memory(comm)
    if available is None:
        return
    allowed = available / ranks_on_this_host(comm)
    load, kept = (0, 0) if data_path is None else load_bytes(data_path, model_config.seq_len)
    total = max(load, kept + need)
    if total <= allowed:
        return
    batch = step_batch_bytes(model_config, tc, comm.size)
    parts = {"state": need - batch, "batch": batch, "data": max(load, kept)}
    largest = max(parts, key=parts.get)
    why, hint = "", "use more ranks, a smaller model, batch or --steps"
    if largest == "data":
        why = (
            f"; loading {data_path} ({os.path.getsize(data_path):,} bytes) takes up to "
            f"{load / mib:,.0f} MiB, on every rank"
        )
        hint = "use a smaller names file (--data), or fewer ranks on this machine"
    elif largest == "batch":
        why = f"; {batch / mib:,.1f} MiB of it for each step's batch"
        hint = _batch_hint(model_config, tc, comm.size, need)
    else:
        hint = _fitting_strategy(model_config, tc, comm.size, allowed, load, kept) or hint
    raise MemoryBudgetError(
        f"this run would need {total / mib:,.1f} MiB per rank ({tc.strategy} on {ranks}, "
        f"predicted before allocating anything{why}), more than this machine's available memory "
        f"({allowed / mib:,.0f} MiB per rank): {hint}"
    )


def _fitting_strategy(
    model_config: ModelConfig, tc: TrainConfig, n: int, allowed: float, load=0, kept=0
) -> str | None:
    """'--strategy zero1 would fit' if a ZeRO stage would fit in `allowed` (beside a dataset
    whose loading peaks at `load` bytes and which keeps `kept`), else None."""
    for s in (name for name, cls in STRATEGY_CLASSES.items() if cls.shard_level > 0):
        other = TrainConfig(**(tc.to_dict() | {"strategy": s}))
        if s != tc.strategy and max(load, kept + predicted_peak(s, model_config, other, n)) <= (
            allowed
        ):
            return f"--strategy {s} would fit"
    return None


def _batch_hint(model_config: ModelConfig, tc: TrainConfig, n: int, need: int) -> str:
    """What to change when each step's batch is most of the need: --accum, or --batch."""
    if step_batch_bytes(model_config, tc, n) * 2 < need:
        return "use more ranks, a smaller model, batch or --steps"
    rows = f"{tc.batch:,} x {tc.accum:,} rows a step" if tc.accum > 1 else f"{tc.batch:,} rows"
    return f"lower --accum or --batch ({rows}, every index drawn on every rank)"


def agreed_available_memory(comm: Comm) -> int | None:
    """The least available memory any rank read (a collective): one figure, so that every
    rank refuses a run with the same line, however the machine's memory moved between reads."""
    readings = [r for r in comm.allgather_objects(meminfo("MemAvailable")) if r is not None]
    return min(readings) if readings else None
