"""ms/step of every strategy at N = 1, 2, 4 ranks under mpiexec, split into compute and comm.

    python benchmarks/bench_strategies.py [--steps 2000] [--ranks 1 2 4] [--optimizer sgd]

Communication time is what the ranks spent inside collectives (Comm's accounting); compute
is the rest of the step. Targets on a 2-core machine: dp N=2 <= 0.25 ms and
N=4 <= 1.0 ms; zero3 N=2 <= 0.3 ms and N=4 <= 1.5 ms; zero1/zero2 within 1.3x of dp.
A figure to read, not a test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

STRATEGIES = ["dp", "zero1", "zero2", "zero3"]


def worker(steps: int, optimizer: str) -> None:
    """On every rank: train each strategy; rank 0 prints one JSON line per strategy."""
    import numpy as np

    from fsdp_lesson.comm import Comm
    from fsdp_lesson.config import ModelConfig, TrainConfig
    from fsdp_lesson.data import Dataset
    from fsdp_lesson.train import run

    data = Dataset.load()
    for strategy in STRATEGIES:
        comm = Comm.world()
        config = TrainConfig(
            strategy=strategy, optimizer=optimizer, steps=steps, eval_batches=0, n_samples=0
        )
        history, _ = run(ModelConfig(), config, comm=comm, data=data)
        step_ms = float(np.median(history.step_seconds[steps // 10 :]) * 1e3)
        comm_ms = sum(t["seconds"] for t in history.traffic.values()) / steps * 1e3
        mean_ms = float(np.mean(history.step_seconds) * 1e3)
        if comm.rank == 0:
            print(
                json.dumps(
                    {
                        "strategy": strategy,
                        "ranks": comm.size,
                        "median_ms": step_ms,
                        "mean_ms": mean_ms,
                        "comm_ms": comm_ms,
                    }
                ),
                flush=True,
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.worker:
        return worker(args.steps, args.optimizer)

    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    rows = []
    for n in args.ranks:
        command = [
            mpiexec,
            "-n",
            str(n),
            sys.executable,
            __file__,
            "--worker",
            "--steps",
            str(args.steps),
            "--optimizer",
            args.optimizer,
        ]
        out = subprocess.run(command, capture_output=True, text=True, timeout=900, check=True)
        rows += [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    print(
        f"{'strategy':8s} {'N':>2s} {'median':>8s} {'mean':>8s} {'comm':>7s} {'compute':>8s}"
        f"  (ms/step, {args.optimizer}; comm and compute split the mean)"
    )
    for r in rows:
        print(
            f"{r['strategy']:8s} {r['ranks']:2d} {r['median_ms']:8.3f} {r['mean_ms']:8.3f} "
            f"{r['comm_ms']:7.3f} {r['mean_ms'] - r['comm_ms']:8.3f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
