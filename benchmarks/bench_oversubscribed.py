"""More ranks than cores: how MPICH's waiting ranks should wait, measured in the same run.

    python benchmarks/bench_oversubscribed.py [--ranks 4] [--steps 2000] [--reps 3]

A rank blocked in a collective polls MPICH until its peers arrive; with more ranks than cores
(4 ranks on a 2-core laptop, `make test`'s 4 engines) a polling rank takes core time from a
rank that has work. Three ways to wait, each a whole CLI run of dp and zero3 (wall and CPU
seconds, median of reps, the three alternating):

    single        MPI_THREAD_SINGLE: MPICH spins (the C programs' level)
    multiple      MPI_THREAD_MULTIPLE: MPICH releases its lock and yields between polls
                  (what every launch of this project sets: fsdp_lesson/launch.py)
    heavy yield   multiple plus MPIR_CVAR_ENABLE_HEAVY_YIELD=1: a ~50 us sleep per poll

Every run is shown with the cores other processes used meanwhile (the machine may be shared);
a figure to read, never a test.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
from pathlib import Path

from bench_speed import load, measured_run  # this folder's neighbour

from fsdp_lesson.launch import rank_env

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
WAYS = {
    "single": {"MPI4PY_RC_THREAD_LEVEL": "single", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "0"},
    "multiple": {"MPI4PY_RC_THREAD_LEVEL": "multiple", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "0"},
    "heavy yield": {"MPI4PY_RC_THREAD_LEVEL": "multiple", "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1"},
}


def timed(ranks: int, strategy: str, steps: int, way: str) -> tuple[float, float, float]:
    """Wall seconds, CPU seconds of the ranks, and the cores others used, of one CLI run."""
    command = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "fsdp_lesson", "train"]
    command += ["--strategy", strategy, "--steps", str(steps), "--eval-batches", "1"]
    command += ["--samples", "0", "--log-every", "1000000"]
    return measured_run(command, env=rank_env() | WAYS[way])


def cpu_name() -> str:
    """The CPU's model name (Linux), else what Python knows of the machine."""
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return names[0]
    except (OSError, IndexError):
        return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    print(f"{args.ranks} ranks on {cores} cores ({cpu_name()}), {args.steps} steps,")
    print(f"median of {args.reps}; {load()}")
    header = f"{'strategy':9s} {'waiting':12s} {'wall s':>7s} {'CPU s':>7s} {'x multiple':>10s}"
    print(header + "  others")
    for strategy in ("dp", "zero3"):
        runs: dict[str, list[tuple[float, float, float]]] = {way: [] for way in WAYS}
        for _ in range(args.reps):
            for way in WAYS:
                runs[way].append(timed(args.ranks, strategy, args.steps, way))
        reference = statistics.median(r[0] for r in runs["multiple"])
        for way, rows in runs.items():
            wall = statistics.median(r[0] for r in rows)
            cpu = statistics.median(r[1] for r in rows)
            others = max(r[2] for r in rows)
            print(
                f"{strategy:9s} {way:12s} {wall:7.2f} {cpu:7.2f} {wall / reference:10.2f}"
                f"  {others:.2f} cores"
            )
    print(load())


if __name__ == "__main__":
    main()
