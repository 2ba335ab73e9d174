"""Median ms/step of single-rank training at the seed's config, with SGD and with Adam.

    python benchmarks/bench_single.py [--steps 3000]

Target: <= 0.25 ms/step on a 2-core machine (the C program: 0.78 ms/step).
A figure to read, not a test: tests never assert on wall-clock time.
"""

from __future__ import annotations

import argparse

import numpy as np

from fsdp_lesson.config import ModelConfig, TrainConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.train import run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    args = parser.parse_args()
    data = Dataset.load()
    for optimizer in ("sgd", "adam"):
        config = TrainConfig(steps=args.steps, optimizer=optimizer, eval_batches=0, samples=0)
        history, _ = run(ModelConfig(), config, data=data)
        ms = np.array(history.step_seconds[100:]) * 1e3  # skip the warm-up
        print(
            f"single {optimizer:4s}: median {np.median(ms):.3f} ms/step "
            f"(p10 {np.percentile(ms, 10):.3f}, p90 {np.percentile(ms, 90):.3f}), {len(ms)} steps"
        )


if __name__ == "__main__":
    main()
