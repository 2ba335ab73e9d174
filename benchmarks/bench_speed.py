"""Speed of every strategy at N = 1, 2, 4, each figure beside references measured in the same run.

    python benchmarks/bench_speed.py [--reps 3] [--steps 2000] [--cli-steps 5000] [--ranks 1 2 4]

Prints three tables (a figure to read, never a test):
1. ms/step (median over steps, the seed's model, SGD) and the ms/step inside collectives,
   run with fsdp_lesson.train.run under `mpiexec -n N`; whole-process seconds of the CLI
   (`mpiexec -n N python -m fsdp_lesson train ... --steps CLI_STEPS`, median of reps); and
   both as ratios to single-rank training measured in the same run.
2. Start-up: the CLI with one step against `python -c "import numpy; from mpi4py import MPI"`.
3. At 10.8 M parameters (hidden 1024, 11 layers), N = 2: each strategy's memory-traffic floor
   (the bytes a rank must read and write per step, counted below, divided by the copy
   bandwidth both ranks get at once) beside its measured step.
The fixed numpy kernel, a 64 MB np.copyto, gives the machine's copy bandwidth, so figures from
different machines compare as ratios. Runs that other processes slowed (more than a quarter
of a core on average) are run again, at most three times, and marked.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from fsdp_lesson.launch import rank_env

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
STRATEGIES = ["dp", "zero1", "zero2", "zero3"]
LARGE = {"hidden_size": 1024, "n_layers": 11}  # ModelConfig fields: 10.8 M parameters
COPY_BYTES = 64 * 2**20
FOREIGN_LIMIT = 0.25  # cores other processes may use during a timed run before it is redone

# Parameter-sized arrays a rank reads or writes per step, as fractions of the whole model
# (float32, SGD), with n ranks. Forward reads W; backward reads W (for dx) and writes dW; SGD
# reads p and g and writes p (3 touches, on a shard of 1/n where sharded). An allreduce reads
# and writes its buffer; a reduce-scatter reads the full buffer and writes a shard; an
# allgather reads a shard and writes the full buffer. Activations (a few hundred KB) are left
# out. zero3 gathers every layer twice (forward and backward).
TOUCHES = {
    "single": lambda n: 3 + 3,
    "dp": lambda n: 3 + 2 + 3,
    "zero1": lambda n: 3 + (1 + 1 / n) + 3 / n + (1 / n + 1),
    "zero2": lambda n: 3 + (1 + 1 / n) + 3 / n + (1 / n + 1),
    "zero3": lambda n: 2 * (1 / n + 1) + 3 + (1 + 1 / n) + 3 / n,
}


def copy_gb_per_s(repeats: int = 10) -> float:
    """Bytes read plus written per second by np.copyto of 64 MB (median of repeats), in GB/s."""
    src = np.ones(COPY_BYTES // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages first
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        seconds.append(time.perf_counter() - start)
    return 2 * COPY_BYTES / statistics.median(seconds) / 1e9


def worker(kind: str, steps: int) -> None:
    """On every rank of one mpiexec: train each strategy; rank 0 prints one JSON line each."""
    from fsdp_lesson.comm import Comm
    from fsdp_lesson.config import ModelConfig, TrainConfig
    from fsdp_lesson.data import Dataset
    from fsdp_lesson.model import MLP
    from fsdp_lesson.train import run

    data = Dataset.load()
    comm = Comm.world()
    model_config = ModelConfig(**LARGE) if kind == "large" else ModelConfig()
    strategies = STRATEGIES if comm.size > 1 else ["single", *STRATEGIES]
    record = {"ranks": comm.size, "params": MLP(model_config).num_params}
    if kind == "large":  # the bandwidth each rank gets while every rank copies
        comm.barrier()
        record["copy_gb_s"] = copy_gb_per_s()
    for strategy in strategies:
        config = TrainConfig(strategy=strategy, steps=steps, eval_batches=0, n_samples=0)
        history, _ = run(model_config, config, comm=Comm.world(), data=data)
        seconds = history.step_seconds[steps // 10 :]  # past the warm-up
        comm_seconds = sum(t["seconds"] for t in history.traffic.values())
        if comm.rank == 0:
            row = record | {
                "strategy": strategy,
                "step_ms": float(np.median(seconds) * 1e3),
                "comm_ms": comm_seconds / steps * 1e3,
            }
            print(json.dumps(row), flush=True)


def _busy_seconds() -> float:
    """CPU seconds all processes of the machine have used (Linux /proc/stat)."""
    fields = open("/proc/stat").readline().split()[1:9]
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields)
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(command: list[str], tries: int = 3, timeout: float = 900) -> tuple[float, bool]:
    """Whole-process seconds of command, and whether other processes slowed even the last try."""
    for _ in range(tries):
        busy, mine, start = _busy_seconds(), _children_seconds(), time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, timeout=timeout, cwd=ROOT)
        seconds = time.perf_counter() - start
        foreign = (_busy_seconds() - busy) - (_children_seconds() - mine)
        if foreign / seconds < FOREIGN_LIMIT:
            return seconds, False
    return seconds, True


def median_of(command: list[str], reps: int) -> tuple[float, bool]:
    runs = [timed(command) for _ in range(reps)]
    return statistics.median(s for s, _ in runs), any(d for _, d in runs)


def launch(n: int, *args: str) -> list[str]:
    """python ARGS on n ranks; one rank runs as a user runs it, without mpiexec."""
    return [*([MPIEXEC, "-n", str(n)] if n > 1 else []), sys.executable, *args]


def worker_rows(n: int, kind: str, steps: int) -> list[dict]:
    command = launch(n, __file__, "--worker", kind, "--steps", str(steps))
    out = subprocess.run(
        command, capture_output=True, text=True, timeout=1800, check=True, env=rank_env()
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def cli(n: int, strategy: str, steps: int) -> list[str]:
    train = ["-m", "fsdp_lesson", "train", "--strategy", strategy, "--steps", str(steps)]
    return launch(n, *train, "--eval-batches", "1", "--samples", "0", "--log-every", "1000000")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="whole-process runs per figure")
    parser.add_argument("--steps", type=int, default=2000, help="steps per ms/step figure")
    parser.add_argument("--cli-steps", type=int, default=5000, help="steps of the timed CLI run")
    parser.add_argument("--large-steps", type=int, default=30, help="steps at 10.8 M parameters")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--worker", choices=["small", "large"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.large_steps if args.worker == "large" else args.steps)
    os.environ.update(rank_env())  # the ranks' environment (fsdp_lesson/launch.py)

    copy = copy_gb_per_s()
    rows = [row for n in args.ranks for row in worker_rows(n, "small", args.steps)]
    single = next(r for r in rows if r["strategy"] == "single")
    print(f"reference: np.copyto of 64 MB moves {copy:.1f} GB/s (read + write, one process)")
    print(f"whole-process runs: {args.cli_steps} steps, median of {args.reps}; * = disturbed")
    print(
        f"{'strategy':8s} {'N':>2s} {'ms/step':>8s} {'in coll.':>8s} {'x single':>8s} "
        f"{'whole s':>8s} {'x single':>8s}"
    )
    whole_single = None
    for r in rows:
        whole, disturbed = median_of(cli(r["ranks"], r["strategy"], args.cli_steps), args.reps)
        whole_single = whole_single or whole  # single is the first row
        print(
            f"{r['strategy']:8s} {r['ranks']:2d} {r['step_ms']:8.3f} {r['comm_ms']:8.3f} "
            f"{r['step_ms'] / single['step_ms']:8.2f} {whole:7.2f}{'*' if disturbed else ' '} "
            f"{whole / whole_single:8.2f}",
            flush=True,
        )

    startup, d1 = median_of(cli(2, "zero3", 1), args.reps)
    bare, d2 = median_of(launch(2, "-c", "import numpy; from mpi4py import MPI"), args.reps)
    print(
        f"\nstart-up, N = 2: the CLI (zero3, 1 step) {startup:.2f} s{'*' if d1 else ''}, "
        f"python importing numpy and mpi4py {bare:.2f} s{'*' if d2 else ''}: "
        f"{startup - bare:+.2f} s"
    )

    large = worker_rows(2, "large", args.large_steps)
    params, per_rank_copy = large[0]["params"], large[0]["copy_gb_s"]
    print(
        f"\n{params / 1e6:.1f} M parameters, N = 2, SGD: the floor is the counted bytes per "
        f"rank per step / {per_rank_copy:.1f} GB/s (np.copyto with both ranks copying)"
    )
    header = ["MB/step", "floor ms", "step ms", "in coll."]
    print(f"{'strategy':8s} " + " ".join(f"{h:>8s}" for h in header) + " x floor")
    for r in large:
        traffic = TOUCHES[r["strategy"]](r["ranks"]) * 4 * params
        floor_ms = traffic / (per_rank_copy * 1e9) * 1e3
        print(
            f"{r['strategy']:8s} {traffic / 1e6:8.1f} {floor_ms:8.2f} {r['step_ms']:8.2f} "
            f"{r['comm_ms']:8.2f} {r['step_ms'] / floor_ms:7.2f}"
        )


if __name__ == "__main__":
    main()
