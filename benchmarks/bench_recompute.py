"""What --recompute costs and saves: step time and activation peak, with and without.

    python benchmarks/bench_recompute.py [--steps 30] [--batch 64 256 1024]
    mpiexec -n 2 python benchmarks/bench_recompute.py --strategy zero3

For each global batch: the median ms/step without and with recomputation (the slowest rank's,
after 3 warm-up steps), the ms of one forward pass measured in the same run, and the extra time
per step as a fraction of that forward (a block's recompute reruns its Linear: every layer's
forward but the last Linear's and the embedding's); the activation peak of the ledger beside
plan.activation_peak's prediction. A figure to read, never a test: only the ratios measured in
the same run carry to another machine.
"""

from __future__ import annotations

import argparse
import os
import time

from fsdp_lesson.launch import rank_settings

os.environ.update(rank_settings())  # one BLAS thread, as every rank runs: before numpy loads

import numpy as np  # noqa: E402

from fsdp_lesson.comm import Comm
from fsdp_lesson.config import ModelConfig, TrainConfig
from fsdp_lesson.data import Dataset, rank_slice
from fsdp_lesson.memory import MemoryLedger
from fsdp_lesson.model import MLP
from fsdp_lesson.optim import make_optimizer
from fsdp_lesson.plan import activation_peak
from fsdp_lesson.rng import make_rng
from fsdp_lesson.strategies import make_strategy
from fsdp_lesson.train import forward, run

MODEL = ModelConfig(layers=4, hidden=1024)  # activations worth saving: 4 x batch x 1024 floats
WARMUP = 3


def step_ms(strategy: str, batch: int, recompute: bool, steps: int, comm: Comm, data) -> tuple:
    """(median ms/step of the slowest rank, this rank's activation peak in bytes)."""
    config = TrainConfig(
        strategy=strategy,
        steps=steps + WARMUP,
        batch=batch,
        eval_batches=0,
        samples=0,
        recompute=recompute,
    )
    history, _ = run(MODEL, config, comm=comm, data=data)
    slowest = np.max(comm.allgather_objects(history.step_seconds[WARMUP:]), axis=0)
    return 1e3 * float(np.median(slowest)), history.memory["peak"]["activations"]


def forward_ms(strategy: str, batch: int, comm: Comm, data) -> float:
    """Median ms of one forward pass (no caches kept) on this rank's rows."""
    model = MLP(MODEL)
    s = make_strategy(strategy, model, make_optimizer("sgd", 0.1), comm, MemoryLedger())
    s.init_params(make_rng(42))
    x = rank_slice(data.X_train[:batch], comm.rank, comm.size)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        forward(model, s, x)
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default=None, help="default: single on 1 rank, else dp")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256, 1024])
    args = parser.parse_args()
    comm, data = Comm(), Dataset.load()
    strategy = args.strategy or ("single" if comm.size == 1 else "dp")
    if comm.rank == 0:
        print(f"{strategy} on {comm.size} rank(s), model {MODEL}, {args.steps} steps per run")
        print(
            f"{'batch':>6} {'ms off':>8} {'ms on':>8} {'fwd ms':>8} {'extra/fwd':>9} "
            f"{'act off':>10} {'act on':>10} {'predicted on':>12}"
        )
    for batch in args.batch:
        off, act_off = step_ms(strategy, batch, False, args.steps, comm, data)
        on, act_on = step_ms(strategy, batch, True, args.steps, comm, data)
        fwd = forward_ms(strategy, batch, comm, data)
        predicted = activation_peak(MODEL, batch // comm.size, recompute=True)
        if comm.rank == 0:
            print(
                f"{batch:>6} {off:>8.2f} {on:>8.2f} {fwd:>8.2f} {(on - off) / fwd:>9.2f} "
                f"{act_off:>10,} {act_on:>10,} {predicted:>12,}"
            )


if __name__ == "__main__":
    main()
