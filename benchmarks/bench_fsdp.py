"""ms/step of zero3 with and without prefetch, and of dp, and the time spent in collectives.

    mpiexec -n 2 python benchmarks/bench_fsdp.py [--steps 20] [--models seed,1M,10M,30M]
    MPICH_ASYNC_PROGRESS=1 mpiexec -n 2 python benchmarks/bench_fsdp.py   # a progress thread

Every rank runs each configuration in turn; rank 0 prints one row per configuration: the
median ms/step (after 3 warm-up steps, the slowest rank's), the ms per step this rank spent
blocked in collectives (Comm's seconds), and zero3/dp in the same run. A figure to read, not
a test; on a shared machine only ratios measured in the same run mean much.
"""

from __future__ import annotations

import argparse
import os

import numpy as np

from fsdp_lesson.comm import Comm
from fsdp_lesson.config import ModelConfig, TrainConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.model import MLP
from fsdp_lesson.train import run

MODELS = {  # about 0.02 M, 1 M, 10 M and 30 M parameters
    "seed": ModelConfig(),
    "1M": ModelConfig(layers=4, hidden=512),
    "10M": ModelConfig(layers=10, hidden=1024),
    "30M": ModelConfig(layers=8, hidden=2048),
}
RUNS = {
    "dp": dict(strategy="dp"),
    "zero3 no-prefetch": dict(strategy="zero3", prefetch=False),
    "zero3 prefetch": dict(strategy="zero3", prefetch=True),
}
WARMUP = 3


def measure(model: ModelConfig, kwargs: dict, steps: int, data: Dataset) -> tuple[float, float]:
    """(median ms/step of the slowest rank, ms/step blocked in collectives on this rank)."""
    comm = Comm.world()
    config = TrainConfig(steps=steps, batch=32, eval_batches=0, samples=0, **kwargs)
    history, _ = run(model, config, comm=comm, data=data)
    ms = np.array(history.step_seconds[WARMUP:]) * 1e3
    slowest = max(comm.allgather_objects(float(np.median(ms))))
    blocked = sum(t["seconds"] for t in history.traffic.values()) * 1e3 / steps
    return slowest, blocked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    comm, data = Comm.world(), Dataset.load()
    progress = os.environ.get("MPICH_ASYNC_PROGRESS", "0")
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(
        f"N={comm.size}, MPICH_ASYNC_PROGRESS={progress}, {args.steps} steps, median after {WARMUP}"
    )
    say(f"{'model':>6} {'params':>7} {'run':>18} {'ms/step':>8} {'in coll.':>8} {'/dp':>5}")
    for label in args.models.split(","):
        model = MODELS[label]
        psi = MLP(model).num_params
        dp_ms = None
        for name, kwargs in RUNS.items():
            ms, blocked = measure(model, kwargs, args.steps, data)
            dp_ms = dp_ms or ms
            say(
                f"{label:>6} {psi / 1e6:6.2f}M {name:>18} {ms:8.2f} {blocked:8.2f} "
                f"{ms / dp_ms:5.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
