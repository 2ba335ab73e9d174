"""Start-up: the CLI under mpiexec beside a bare numpy + mpi4py start, measured in the same run.

    python benchmarks/bench_startup.py [--reps 5] [--ranks 2]

Prints (a figure to read, never a test):
1. Whole-process seconds, median of reps, the two commands alternating:
     bare  mpiexec -n N python -c "import numpy; from mpi4py import MPI"   (the reference)
     CLI   mpiexec -n N python -m fsdp_lesson train --strategy zero3 --steps 0
               --eval-batches 1 --samples 0                    (initialise, evaluate, exit)
   and what the CLI adds to the reference: the goal is at most 0.3 s.
2. The ten slowest imports of the CLI's rank 0 (`python -X importtime`): the modules the run
   imports itself, by cumulative time (a module's own load plus everything it imports).
Every run is shown with the cores other processes used meanwhile (the machine is shared).
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from pathlib import Path

from bench_speed import measured_run  # this folder's neighbour

from fsdp_lesson.launch import rank_env

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
BARE = ["-c", "import numpy; from mpi4py import MPI"]
CLI = ["-m", "fsdp_lesson", "train", "--strategy", "zero3", "--steps", "0"]
CLI += ["--eval-batches", "1", "--samples", "0"]
GOAL_SECONDS = 0.3


def timed(ranks: int, args: list[str]) -> tuple[float, float]:
    """Whole-process seconds of `mpiexec -n ranks python ARGS`, and the cores others used."""
    command = [MPIEXEC, "-n", str(ranks), sys.executable, *args]
    seconds, _, others = measured_run(command, env=rank_env(), timeout=300)
    return seconds, others


def slowest_imports(ranks: int, top: int = 10) -> list[tuple[float, str]]:
    """(cumulative seconds, module) of rank 0's top-level imports in one CLI run, slowest first."""
    command = [MPIEXEC, "-n", str(ranks), "-prepend-rank", sys.executable, "-X", "importtime"]
    run = subprocess.run(
        [*command, *CLI], capture_output=True, text=True, timeout=300, cwd=ROOT, env=rank_env()
    )
    # "[0] import time:  self [us] | cumulative | name"; top-level names have one leading space
    line = re.compile(r"^\[0\] import time:\s+\d+ \|\s+(\d+) \| (\S.*)$")
    found = [(int(m[1]) / 1e6, m[2]) for m in map(line.match, run.stderr.splitlines()) if m]
    return sorted(found, reverse=True)[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="runs of each command")
    parser.add_argument("--ranks", type=int, default=2, help="mpiexec -n")
    args = parser.parse_args()

    runs: dict[str, list[tuple[float, float]]] = {"bare": [], "CLI": []}
    for rep in range(args.reps):
        for name, command in (("bare", BARE), ("CLI", CLI)):
            seconds, foreign = timed(args.ranks, command)
            runs[name].append((seconds, foreign))
            print(f"  run {rep + 1} {name:4s} {seconds:6.2f} s  (others used {foreign:.2f} cores)")
    bare, cli = (statistics.median(s for s, _ in runs[k]) for k in ("bare", "CLI"))
    foreign = statistics.median(f for r in runs.values() for _, f in r)
    print(
        f"\nstart-up, N = {args.ranks}, median of {args.reps} (others used {foreign:.2f} cores):\n"
        f"  bare numpy + mpi4py   {bare:6.2f} s  (the reference)\n"
        f"  CLI, zero3, 0 steps   {cli:6.2f} s  = reference {cli - bare:+.2f} s "
        f"({cli / bare:.2f}x; goal: at most {GOAL_SECONDS:+.1f} s)"
    )
    print(f"\nslowest imports of the CLI's rank 0 (cumulative), N = {args.ranks}:")
    for seconds, module in slowest_imports(args.ranks):
        print(f"  {seconds * 1e3:7.1f} ms  {module}")


if __name__ == "__main__":
    main()
