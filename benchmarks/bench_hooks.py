"""Where a step's time goes, per strategy hook: a profile of dp and zero3 on the seed model.

    mpiexec -n 2 python benchmarks/bench_hooks.py [--rounds 10] [--steps 100] [dp zero3 ...]

Every rank builds each strategy (SGD, the seed model) and trains them in turn, `--steps` steps
each per round, interleaved (the machine's load drifts). Each hook of the strategy is wrapped:
per step, how often it is called, its thread CPU time, its wall time, and the part of that wall
time spent inside collectives (Comm's own clock: a blocking call, or a Request's wait). Then
one more round under cProfile counts the Python calls a step makes. Rank 0 prints, per
strategy, the step's median and 10th percentile (the steps no other process interrupted, on
a loaded machine) and the per-hook means. The wrappers cost about a microsecond per hook call:
read differences between strategies, not the absolute hook figures. A figure to read, not a
test.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import numpy as np

from fsdp_lesson.comm import Comm
from fsdp_lesson.config import ModelConfig, TrainConfig
from fsdp_lesson.data import Dataset, GlobalBatchSampler
from fsdp_lesson.memory import MemoryLedger
from fsdp_lesson.model import MLP
from fsdp_lesson.optim import make_optimizer
from fsdp_lesson.rng import make_rng
from fsdp_lesson.strategies import make_strategy, strategy_options
from fsdp_lesson.train import memory_options, train_step

HOOKS = (
    "begin_micro_batch",
    "begin_phase",
    "materialize",
    "release",
    "grad_buffer",
    "reduce_grads",
    "step",
)


class Profiled:
    """One strategy on this rank, its hooks wrapped; `totals[hook]` = [calls, cpu, wall, comm]."""

    def __init__(self, name: str, data: Dataset) -> None:
        self.comm = Comm.world()
        config = TrainConfig(strategy=name, eval_batches=0, samples=0)
        self.model = MLP(ModelConfig())
        options = memory_options(config) | strategy_options(name, config)
        optimizer = make_optimizer(config.optimizer, config.lr)
        ledger = MemoryLedger(rank=self.comm.rank)
        self.strategy = make_strategy(name, self.model, optimizer, self.comm, ledger, **options)
        rng = make_rng(config.seed, False)
        self.strategy.init_params(rng)
        self.sampler = GlobalBatchSampler(data.X_train, data.Y_train, config.batch, rng)
        self.totals = {hook: [0, 0.0, 0.0, 0.0] for hook in HOOKS}
        self.steps: list[float] = []

    def _comm_seconds(self) -> float:
        return sum(t.seconds for t in self.comm.traffic.values())

    def wrap(self) -> None:
        """From now on each hook call adds to `totals`."""
        for hook in HOOKS:
            self._wrap(hook)

    def _wrap(self, hook: str) -> None:
        inner, total = getattr(type(self.strategy), hook).__get__(self.strategy), self.totals[hook]

        def timed(*args):
            cpu, wall, comm = time.thread_time(), time.perf_counter(), self._comm_seconds()
            try:
                return inner(*args)
            finally:
                total[0] += 1
                total[1] += time.thread_time() - cpu
                total[2] += time.perf_counter() - wall
                total[3] += self._comm_seconds() - comm

        setattr(self.strategy, hook, timed)  # on the instance: the loop calls this one

    def run(self, steps: int, record: bool = True) -> None:
        """`steps` steps as train_loop runs them: train_step, then the logged loss's mean."""
        for _ in range(steps):
            X, Y = self.sampler.next_slice(self.comm.rank, self.comm.size)
            start = time.perf_counter()
            self.comm.mean_scalar(train_step(self.model, self.strategy, X, Y))
            if record:
                self.steps.append(time.perf_counter() - start)

    def python_calls(self, steps: int) -> float:
        """Python function calls per step (cProfile's count, builtins included), unwrapped."""
        for hook in HOOKS:
            vars(self.strategy).pop(hook, None)
        profile = cProfile.Profile()
        profile.enable()
        self.run(steps, record=False)
        profile.disable()
        return sum(entry[1] for entry in pstats.Stats(profile).stats.values()) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=100, help="steps per strategy per round")
    parser.add_argument("strategies", nargs="*", default=["dp", "zero3"])
    args = parser.parse_args()
    data = Dataset.load()
    runs = {name: Profiled(name, data) for name in args.strategies}
    for run in runs.values():
        run.run(args.steps, record=False)  # warm-up
        run.wrap()
    for _ in range(args.rounds):
        for run in runs.values():
            run.comm.barrier()
            run.run(args.steps)
    calls = {name: run.python_calls(args.steps) for name, run in runs.items()}
    if runs and next(iter(runs.values())).comm.rank == 0:
        n = args.rounds * args.steps
        for name, run in runs.items():
            us = np.array(run.steps) * 1e6
            print(
                f"{name}: step median {np.median(us):.0f} us, 10th percentile "
                f"{np.percentile(us, 10):.0f} us; {calls[name]:.0f} Python calls per step"
            )
            print(f"  {'hook':18s} {'calls':>6s} {'CPU us':>8s} {'wall us':>8s} {'in MPI':>8s}")
            for hook, (count, cpu, wall, comm) in run.totals.items():
                print(
                    f"  {hook:18s} {count / n:6.1f} {cpu / n * 1e6:8.1f} {wall / n * 1e6:8.1f} "
                    f"{comm / n * 1e6:8.1f}"
                )


if __name__ == "__main__":
    main()
