"""Speed of every strategy at N = 1, 2, 4, each figure beside references measured in the same run.

    python benchmarks/bench_speed.py [--quick] [--reps 3] [--ranks 1 2 4] [--large-steps 30]

Prints two tables (figures to read, never a test):
1. The seed's model, SGD: ms/step (median over steps past the warm-up), the ms/step spent
   inside collectives, and what the same collectives take as bare mpi4py calls in a loop
   ("MPI alone": per step the same calls of each kind at the kind's mean size), run with
   fsdp_lesson.train.run under `mpiexec -n N`; whole-process
   seconds of the CLI (`mpiexec -n N python -m fsdp_lesson train ...`, median of reps); each
   also as a ratio to single-rank training measured in the same run; and issue 33's test at each
   N > 1: zero3's step minus dp's over what zero3's extra collectives cost as bare calls (its
   MPI alone minus dp's), which should be at most 2.
2. At 10.8 M parameters (hidden 1024, 11 layers), N = 2, SGD: each strategy's floor beside
   its measured step: the step's matrix products run alone (a kernel measured in the same
   run) plus every other byte a rank must read and write per step (counted by TOUCHES below)
   at the copy bandwidth each rank gets while both copy; and where the step's time goes:
   forward and backward compute, the optimizer's update, collectives (the seconds blocked in
   them: for a non-blocking one, its wait), and the rest (the hooks, allocation, the loop's
   bookkeeping, and the time spent starting non-blocking collectives: zero3's prefetch);
   then issue 33's test again at this size.
The transformer's table of the same kind is benchmarks/bench_gpt.py's.
The fixed numpy kernel, a 64 MB np.copyto, gives the machine's copy bandwidth, so figures from
different machines compare as ratios. A whole-process run that other processes slowed (more
than a quarter of a core on average) is run again, at most three times, and marked *; the
load average is printed with each table. On 2 cores shared with other work (load average
about 9), --quick took 5 minutes before it was made shorter still; the default is about 3
times --quick's work at N <= 2, plus N = 4.
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
LARGE = {"hidden": 1024, "layers": 11}  # ModelConfig fields: 10.8 M parameters
COPY_BYTES = 64 * 2**20
FOREIGN_LIMIT = 0.25  # cores other processes may use during a timed run before it is redone

# Bytes a rank must read plus write per step, in units of the model's float32 size F (SGD, n
# ranks). Compute: forward reads W, backward reads W (for dx) and writes dW: 3. SGD reads p
# and g and writes p: 3, on a shard (3/n) where the optimizer state is sharded. Collectives,
# if every rank read its peers' buffers directly (a single copy through shared memory):
# a reduce-scatter reads rank r's chunk of every rank's buffer (F) and writes the shard (F/n):
# 1 + 1/n; an allgather into the full buffer reads the n - 1 other shards and writes them
# (in place, as zero1's): 2(n-1)/n, or 2 when the own shard is copied too (zero3's); an
# allreduce is both: 3 - 1/n. Activations (a few hundred KB) are left out; zero3 gathers
# every unit twice (forward and backward).
TOUCHES = {
    "single": lambda n: 3 + 3,
    "dp": lambda n: 3 + (3 - 1 / n) + 3,
    "zero1": lambda n: 3 + (1 + 1 / n) + 3 / n + 2 * (n - 1) / n,
    "zero2": lambda n: 3 + (1 + 1 / n) + 3 / n + 2 * (n - 1) / n,
    "zero3": lambda n: 2 * 2 + 3 + (1 + 1 / n) + 3 / n,
}
PHASES = ("forward", "backward", "update", "collectives", "rest")


Product = tuple[tuple[int, ...], tuple[int, ...]]  # the shapes of A and B in A @ B


def linear_products(shapes: list[tuple[int, int]], rows: int) -> list[Product]:
    """The three matrix products of a Linear W (in, out) per step at `rows` rows: forward
    x @ W, backward x.T @ dout (dW) and dout @ W.T (dx)."""
    return [
        product
        for i, o in shapes
        for product in (((rows, i), (i, o)), ((i, rows), (rows, o)), ((rows, o), (o, i)))
    ]


def products_ms(products: list[Product], repeats: int = 10) -> float:
    """ms for the matrix products, run alone (the fastest of repeats): contiguous float32
    operands, each result written into a buffer of its own, as a gradient is."""
    rng = np.random.default_rng(0)
    arrays = [
        (
            rng.random(a, np.float32),
            rng.random(b, np.float32),
            np.empty(np.broadcast_shapes(a[:-2], b[:-2]) + (a[-2], b[-1]), np.float32),
        )
        for a, b in products
    ]
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for a, b, out in arrays:
            np.matmul(a, b, out=out)
        seconds.append(time.perf_counter() - start)
    return min(seconds) * 1e3


def matmul_ms(model, rows: int) -> float:
    """ms for every Linear layer's three matrix products of one step at `rows` rows per rank."""
    shapes = [layer.shapes["W"] for layer in model.layers if "b" in layer.shapes]
    return products_ms(linear_products(shapes, rows))


def copy_gb_per_s(repeats: int = 10) -> float:
    """Bytes read plus written per second by np.copyto of 64 MB (the fastest of repeats), GB/s."""
    src = np.ones(COPY_BYTES // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touch the pages first
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        seconds.append(time.perf_counter() - start)
    return 2 * COPY_BYTES / min(seconds) / 1e9


class PhaseClock:
    """Seconds spent in the layers' forward and backward and in strategy.step, by wrapping them.

    The collectives' seconds come from Comm's own clock (`comm`, the run's world Comm, whose
    report holds every dimension's); those inside a phase (zero1's and zero2's in step, tp's in
    a layer's forward and backward) are subtracted from it, so `update` is the optimizer's
    work alone and `forward` the layers' own.
    """

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(("forward", "backward", "step"), 0.0)
        self.inside: set[str] = set()  # the phases being timed right now
        self.comm = None  # set to the run's Comm before it trains

    def wrap(self, owner, method: str, phase: str) -> None:
        inner = getattr(owner, method)

        def timed(obj, *args, **kwargs):
            if phase in self.inside:  # a subclass's step calling its parent's: counted once
                return inner(obj, *args, **kwargs)
            self.inside.add(phase)
            start, before = time.perf_counter(), _comm_seconds(self.comm)
            try:
                return inner(obj, *args, **kwargs)
            finally:
                self.inside.discard(phase)
                inside = _comm_seconds(self.comm) - before
                self.seconds[phase] += time.perf_counter() - start - inside

        setattr(owner, method, timed)

    def wrap_step(self, layer_classes: tuple, loss_class) -> None:
        """Time every layer class's and the loss's forward and backward, and every strategy's
        step (its update)."""
        from fsdp_lesson.strategies import STRATEGY_CLASSES

        for cls in (*layer_classes, loss_class):
            self.wrap(cls, "forward", "forward")
            self.wrap(cls, "backward", "backward")
        for cls in STRATEGY_CLASSES.values():
            if "step" in vars(cls):
                self.wrap(cls, "step", "step")

    def start(self, comm) -> None:
        """Zero the clocks for a run on comm."""
        self.seconds, self.comm = dict.fromkeys(self.seconds, 0.0), comm

    def phases_ms(self, history, steps: int) -> dict[str, float]:
        """ms/step (means) of PHASES in a run of `steps` steps (its History)."""
        total = history.step_seconds.sum()
        comm_seconds = sum(t["seconds"] for t in history.traffic.values())
        phases = {
            "forward": self.seconds["forward"],
            "backward": self.seconds["backward"],
            "update": self.seconds["step"],
            "collectives": comm_seconds,
        }
        phases["rest"] = total - sum(phases.values())
        return {k: v / steps * 1e3 for k, v in phases.items()}


def _comm_seconds(comm) -> float:
    return 0.0 if comm is None else sum(t.seconds for t in comm.traffic.values())


def step_figures(history, steps: int) -> dict[str, float]:
    """A run's median ms/step past the warm-up (a tenth of the steps, at least the first) and
    its ms/step inside collectives."""
    seconds = history.step_seconds[max(1, steps // 10) if steps > 1 else 0 :]
    comm_seconds = sum(t["seconds"] for t in history.traffic.values())
    return {"step_ms": float(np.median(seconds) * 1e3), "comm_ms": comm_seconds / steps * 1e3}


def worker(kind: str, steps: int) -> None:
    """On every rank of one mpiexec: train each strategy; rank 0 prints one JSON line each."""
    from fsdp_lesson import model as model_module
    from fsdp_lesson.comm import Comm
    from fsdp_lesson.config import ModelConfig, TrainConfig
    from fsdp_lesson.data import Dataset
    from fsdp_lesson.train import run

    clock = PhaseClock()
    if kind == "large":  # the phases of the step
        layers = (model_module.Embedding, model_module.Linear, model_module.ReLU)
        clock.wrap_step(layers, model_module.SoftmaxCrossEntropy)
    data = Dataset.load()
    comm = Comm.world()
    model_config = ModelConfig(**LARGE) if kind == "large" else ModelConfig()
    strategies = STRATEGIES if comm.size > 1 else ["single", *STRATEGIES]
    record = {"ranks": comm.size, "params": model_module.MLP(model_config).num_params}
    if kind == "large":  # the bandwidth each rank gets while every rank copies
        comm.barrier()
        record["copy_gb_s"] = copy_gb_per_s()
        comm.barrier()  # and the matrix products while every rank computes them
        model = model_module.MLP(model_config)
        record["matmul_ms"] = matmul_ms(model, TrainConfig().batch // comm.size)
    for strategy in strategies:
        config = TrainConfig(strategy=strategy, steps=steps, eval_batches=0, samples=0)
        run_comm = Comm.world()
        clock.start(run_comm)
        start = time.perf_counter()
        history, _ = run(model_config, config, comm=run_comm, data=data)
        mpi_ms = mpi_alone_ms(comm, history.traffic, steps) if comm.size > 1 else 0.0
        figures = step_figures(history, steps)
        phases = clock.phases_ms(history, steps)
        if comm.rank == 0:
            row = (
                record
                | figures
                | {
                    "strategy": strategy,
                    "mpi_ms": mpi_ms,
                    "phases_ms": phases,
                    "run_s": time.perf_counter() - start,
                }
            )
            print(json.dumps(row), flush=True)


def busy_seconds() -> float:
    """CPU seconds all processes of the machine have used (Linux /proc/stat)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:9]
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, fields)
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def mpi_alone_ms(comm, traffic: dict, steps: int, repeats: int = 300) -> float:
    """ms/step of a run's collectives as bare mpi4py calls, nothing around them: per step the
    same number of calls of each kind, each the kind's mean size (float32 buffers), after one
    untimed step (pages touched). A step of the strategy cannot take less than its compute plus
    this. Fewer repeats for large buffers: at most about 100 MB of buffers in all."""
    from mpi4py import MPI

    world, n = comm.mpi, comm.size
    calls = []  # (kind, full buffer) per call of one step
    for kind, t in traffic.items():
        per_step = round(t["calls"] / steps)
        if per_step:
            numel = -(-t["buffer_bytes"] // (4 * t["calls"] * n)) * n  # divisible by n
            calls += [(kind, np.zeros(numel, np.float32))] * per_step
    shards = {id(full): np.zeros(full.size // n, np.float32) for _, full in calls}
    step_bytes = sum(full.nbytes for _, full in calls)
    repeats = max(5, min(repeats, 100 * 2**20 // max(step_bytes, 1)))  # the same on every rank
    for r in range(repeats + 1):
        if r == 1:  # the first step warmed the buffers
            world.Barrier()
            start = time.perf_counter()
        for kind, full in calls:
            if kind == "allreduce":
                world.Allreduce(MPI.IN_PLACE, full)
            elif kind == "allgather":
                world.Allgather(shards[id(full)], full)
            elif kind == "reduce_scatter":
                world.Reduce_scatter_block(full, shards[id(full)])
            elif kind == "bcast":
                world.Bcast(full)
    return (time.perf_counter() - start) / repeats * 1e3


def measured_run(
    command: list[str], env: dict[str, str] | None = None, timeout: float = 900
) -> tuple[float, float, float]:
    """Run command once: its wall seconds, its CPU seconds, and the cores others used meanwhile."""
    busy, mine, start = busy_seconds(), children_seconds(), time.perf_counter()
    subprocess.run(command, check=True, capture_output=True, timeout=timeout, cwd=ROOT, env=env)
    seconds, cpu = time.perf_counter() - start, children_seconds() - mine
    return seconds, cpu, max((busy_seconds() - busy) - cpu, 0.0) / seconds


def timed(command: list[str], tries: int = 3, timeout: float = 900) -> tuple[float, bool]:
    """Whole-process seconds of command, and whether other processes slowed even the last try."""
    for _ in range(tries):
        seconds, _, others = measured_run(command, timeout=timeout)
        if others < FOREIGN_LIMIT:
            return seconds, False
    return seconds, True


def launch(n: int, *args: str) -> list[str]:
    """python ARGS on n ranks; one rank runs as a user runs it, without mpiexec."""
    return [*([MPIEXEC, "-n", str(n)] if n > 1 else []), sys.executable, *args]


def worker_rows(n: int, kind: str, steps: int, script: str = __file__, *args: str) -> list[dict]:
    """Run `script --worker kind --steps steps ARGS` on n ranks; the JSON rows it prints."""
    command = launch(n, script, "--worker", kind, "--steps", str(steps), *args)
    out = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=1800,
        check=True,
        env=rank_env(),
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def cli(n: int, strategy: str, steps: int) -> list[str]:
    train = ["-m", "fsdp_lesson", "train", "--strategy", strategy, "--steps", str(steps)]
    return launch(n, *train, "--eval-batches", "1", "--samples", "0", "--log-every", "1000000")


def load() -> str:
    return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())


def seed_table(args) -> None:
    """Table 1: the seed's model at every N, ms/step and whole-process seconds."""
    rows = [row for n in args.ranks for row in worker_rows(n, "small", args.steps)]
    single = next((r for r in rows if r["strategy"] == "single"), None)
    print(f"the seed's model ({rows[0]['params']:,} parameters), SGD; {load()}")
    print(
        f"whole-process: the CLI, {args.cli_steps} steps at N <= 2, {args.cli_steps_4} at N = 4, "
        f"median of {args.reps}; * = disturbed by other processes"
    )
    print(
        f"{'strategy':8s} {'N':>2s} {'ms/step':>8s} {'in coll.':>8s} {'MPI alone':>9s} "
        f"{'x single':>8s} {'whole s':>8s} {'s/kstep':>8s} {'x single':>8s}"
    )
    per_kstep_single = None
    for r in rows:
        steps = args.cli_steps if r["ranks"] <= 2 else args.cli_steps_4
        command = cli(r["ranks"], r["strategy"], steps)
        runs = [timed(command) for _ in range(args.reps)]
        whole = statistics.median(s for s, _ in runs)
        per_kstep = whole / steps * 1000
        per_kstep_single = per_kstep_single or per_kstep  # single is the first row
        ratio = r["step_ms"] / single["step_ms"] if single else float("nan")
        print(
            f"{r['strategy']:8s} {r['ranks']:2d} {r['step_ms']:8.3f} {r['comm_ms']:8.3f} "
            f"{r['mpi_ms']:9.3f} {ratio:8.2f} "
            f"{whole:7.2f}{'*' if any(d for _, d in runs) else ' '} "
            f"{per_kstep:8.3f} {per_kstep / per_kstep_single:8.2f}",
            flush=True,
        )
    if single:
        print(f"reference: single-rank training, {1e3 / single['step_ms']:,.0f} steps/s")
    print_zero3_floor(rows)


def print_zero3_floor(rows: list[dict]) -> None:
    """zero3's step against dp's, beside a bound: dp's step with dp's collectives swapped for
    zero3's, each timed as bare MPI calls in a loop (no Python around them, warm buffers); and
    issue 33's test: zero3's step over dp's divided by what its extra collectives cost as bare
    calls (zero3's MPI alone minus dp's), which should be at most 2."""
    for n in sorted({r["ranks"] for r in rows if r["ranks"] > 1}):
        at_n = {r["strategy"]: r for r in rows if r["ranks"] == n}
        dp, zero3 = at_n["dp"], at_n["zero3"]
        bound = dp["step_ms"] - dp["mpi_ms"] + zero3["mpi_ms"]
        over, extra = zero3["step_ms"] - dp["step_ms"], zero3["mpi_ms"] - dp["mpi_ms"]
        print(
            f"N = {n}: zero3 takes {zero3['step_ms'] / dp['step_ms']:.2f}x dp's step; dp's step "
            f"with zero3's collectives as bare MPI calls in place of its own: "
            f"{bound / dp['step_ms']:.2f}x\n"
            f"N = {n}: zero3 - dp = {over:.3f} ms/step, its extra collectives as bare "
            f"calls {extra:.3f} ms/step: "
            + (
                f"{over / extra:.1f}x ({'within' if over <= 2 * extra else 'over'} issue 33's 2x)"
                if extra > 0
                else "no extra cost measured (noise): no verdict"
            )
        )


def large_table(args) -> None:
    """Table 2: 10.8 M parameters, N = 2: floor, measured step, and its phases."""
    large = worker_rows(2, "large", args.large_steps)
    first = large[0]
    params, per_rank_copy, compute = first["params"], first["copy_gb_s"], first["matmul_ms"]
    print(
        f"\n{params / 1e6:.1f} M parameters, N = 2, SGD, {args.large_steps} steps; {load()}\n"
        f"floor = the matrix products alone ({compute:.1f} ms, measured with both ranks "
        f"computing) + the other counted bytes per rank / {per_rank_copy:.1f} GB/s (np.copyto "
        f"with both ranks copying); the phases are ms/step (means)"
    )
    print(FLOOR_HEADER)
    for r in large:
        traffic = TOUCHES[r["strategy"]](r["ranks"]) * 4 * params
        print(floor_line(r["strategy"], traffic, 3 * 4 * params, compute, per_rank_copy, r))
    print_zero3_floor(large)


FLOOR_HEADER = f"{'strategy':8s} " + " ".join(
    f"{h:>8s}" for h in ["MB/step", "matmul", "bytes ms", "floor ms", "step ms", "x floor", *PHASES]
)


def floor_line(
    label: str, touched: float, in_compute: float, compute_ms: float, copy_gb_s: float, r: dict
) -> str:
    """One row under FLOOR_HEADER: the bytes a rank touches per step (`touched`), those of them
    the matrix products already read or write (`in_compute`, not counted twice), the floor =
    compute_ms + the rest at copy_gb_s, the measured step r["step_ms"], and its phases."""
    bytes_ms = floor_ms(touched, in_compute, 0.0, copy_gb_s)
    floor = compute_ms + bytes_ms
    phases = " ".join(f"{r['phases_ms'][p]:8.2f}" for p in PHASES)
    return (
        f"{label:8s} {touched / 1e6:8.1f} {compute_ms:8.2f} {bytes_ms:8.2f} {floor:8.2f} "
        f"{r['step_ms']:8.2f} {r['step_ms'] / floor:8.2f} {phases}"
    )


def floor_ms(touched: float, in_compute: float, compute_ms: float, copy_gb_s: float) -> float:
    """A step's floor: its matrix products' ms plus the bytes they do not touch at copy_gb_s."""
    return compute_ms + (touched - in_compute) / (copy_gb_s * 1e9) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, runs and ranks")
    parser.add_argument("--reps", type=int, default=3, help="whole-process runs per figure")
    parser.add_argument("--steps", type=int, default=2000, help="steps per ms/step figure")
    parser.add_argument("--cli-steps", type=int, default=5000, help="CLI steps at N <= 2")
    parser.add_argument("--cli-steps-4", type=int, default=2000, help="CLI steps at N = 4")
    parser.add_argument("--large-steps", type=int, default=30, help="steps at 10.8 M parameters")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--worker", choices=["small", "large"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.steps)
    if args.quick:
        args.reps, args.steps, args.cli_steps, args.cli_steps_4 = 1, 300, 500, 300
        args.large_steps, args.ranks = 5, [1, 2]
    os.environ.update(rank_env())  # the ranks' environment (fsdp_lesson/launch.py)
    print(f"reference: np.copyto of 64 MB moves {copy_gb_per_s():.1f} GB/s (read + write)")
    seed_table(args)
    large_table(args)


if __name__ == "__main__":
    main()
