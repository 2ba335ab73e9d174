"""Whole-process seconds of the C programs the course grew from, beside the CLI doing the same.

    python benchmarks/bench_c.py --sources DIR [--steps 5000] [--reps 3] [--programs ...]

DIR holds `train.c`, `train_dp.c`, `train_fsdp.c`, `train_tp.c`, `train_pp.c` and `train_3d.c`
with their `src/` (the llm_parallelisms.c programs that docs/seed_semantics.md describes; they
are not part of this repository). Each is copied into build/c with its step count set to --steps
(they hard-code 25,000), compiled with `-Ofast -march=native` (gcc; this .venv's mpicc for the
MPI ones) and run from the project's root, where they read data/names.txt. Each C program and
the CLI runs of the same work (the same steps, N, batch, evaluation and samples: the CLI's
defaults are the C program's) alternate, reps times; the table prints the medians and each CLI/C
ratio, measured in the same run:

    C train        vs  train --strategy single        N = 1
    C train_dp     vs  dp, zero1                       N = 2
    C train_fsdp   vs  zero2, zero3                    N = 2
    C train_tp     vs  --tp 2                          N = 2
    C train_pp     vs  --pp 3                          N = 3
    C train_3d     vs  --tp 2 --pp 3 --strategy zero3  N = 12 (train_3d --tp 2 --dp 2)

The C programs call MPI_Init (no threads: MPICH spins while it waits), so N stays at the cores
here, except for train_pp, which runs on 3 ranks only, and train_3d on 12: on 2 cores their
figures are oversubscribed for both programs alike, which costs the spinning C ranks far more
(the 3-D program is slow enough there to time with --steps 1000 --reps 1). A run that other
processes slowed (more than a quarter of a core) is marked *. A figure to read, not a test.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from bench_speed import FOREIGN_LIMIT, measured_run  # this folder's neighbour

from fsdp_lesson.launch import rank_env

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
BUILD = ROOT / "build" / "c"
# C program -> (ranks, the CLI runs that do its work, by label: their train flags)
PAIRS = {
    "train": (1, {"single": ["--strategy", "single"]}),
    "train_dp": (2, {s: ["--strategy", s] for s in ("dp", "zero1")}),
    "train_fsdp": (2, {s: ["--strategy", s] for s in ("zero2", "zero3")}),
    "train_tp": (2, {"tp 2": ["--tp", "2"]}),
    "train_pp": (3, {"pp 3": ["--pp", "3"]}),  # 3 ranks on 2 cores: see the note above
    "train_3d": (12, {"tp 2 pp 3 zero3": ["--tp", "2", "--pp", "3", "--strategy", "zero3"]}),
}
C_FLAGS = {"train_3d": ["--tp", "2", "--dp", "2"]}  # its mesh: T·D·3 = 12 ranks


def build(sources: Path, program: str, steps: int) -> Path:
    """build/c/<program>_<steps>: the program with `int steps = <steps>;`, compiled."""
    text = (sources / f"{program}.c").read_text()
    if "int steps = 25000;" not in text:
        raise SystemExit(f"{sources / program}.c: no 'int steps = 25000;' to set the steps in")
    shutil.copytree(sources / "src", BUILD / "src", dirs_exist_ok=True)  # its #include "src/..."
    source, binary = BUILD / f"{program}_{steps}.c", BUILD / f"{program}_{steps}"
    source.write_text(text.replace("int steps = 25000;", f"int steps = {steps};"))
    compiler = "gcc" if program == "train" else str(BIN / "mpicc")
    flags = ["-Ofast", "-march=native", "-w", "-o", str(binary), str(source), "-lm"]
    subprocess.run([compiler, *flags], check=True, cwd=BUILD)
    return binary


def launch(n: int, *command: str) -> list[str]:
    return [str(BIN / "mpiexec"), "-n", str(n), *command] if n > 1 else list(command)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", type=Path, required=True, help="the C programs' folder")
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--programs", nargs="+", choices=list(PAIRS), help="default: all")
    args = parser.parse_args()
    BUILD.mkdir(parents=True, exist_ok=True)
    env = rank_env()
    print(f"{args.steps} steps, median of {args.reps} alternating runs; load {os.getloadavg()}")
    print(f"{'run':28s} {'N':>2s} {'whole s':>8s}  {'x C':>5s}")
    chosen = args.programs or list(PAIRS)
    for program, (n, runs) in ((p, PAIRS[p]) for p in chosen):
        binary = str(build(args.sources, program, args.steps))
        commands = {f"C {program}": launch(n, binary, *C_FLAGS.get(program, []))}
        for label, flags in runs.items():
            train = ["-m", "fsdp_lesson", "train", *flags, "--steps", str(args.steps)]
            commands[label] = launch(n, sys.executable, *train)
        seconds = {label: [] for label in commands}
        disturbed = set()
        for _ in range(args.reps):  # alternating, so that a slow spell hits every program
            for label, command in commands.items():
                wall, _, others = measured_run(command, env=env)
                seconds[label].append(wall)
                if others > FOREIGN_LIMIT:
                    disturbed.add(label)
        c_median = statistics.median(seconds[f"C {program}"])
        for label, runs in seconds.items():
            mark = "*" if label in disturbed else " "
            median = statistics.median(runs)
            print(f"{label:28s} {n:>2d} {median:>8.2f}{mark} {median / c_median:>5.2f}")


if __name__ == "__main__":
    main()
