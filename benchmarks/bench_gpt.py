"""Each strategy's transformer step (--model gpt) beside its floor, and their ratio.

Issue 36's speed constraint: at >= 10 M parameters each strategy's step should take at most
2x its floor.

    python benchmarks/bench_gpt.py [--quick] [--reps 3] [--steps 8]
                                   [--emb 256 --hidden 1024 --layers 13 --heads 4]

Prints one table (figures to read, never a test): `--model gpt` at 10.3 M parameters by
default (13 blocks of width 256, MLP 1024, 4 heads; batch 32 rows x 16 positions), SGD, trained
with fsdp_lesson.train.run: single on one rank; dp, zero1, zero2, zero3 on N = 2; and tp 2
(`--tp 2`, Megatron by heads) on 2 ranks. For each, beside its measured ms/step (median past the
first step), its floor, measured in the same mpiexec as the step:
- the step's matrix products run alone, at this rank's shapes (tp: its heads and columns):
  per block q, k, v, the output projection and the MLP's two Linears, each forward (x @ W) and
  backward (x.T @ dout, dout @ W.T), the LM head the same, and attention's batched products
  (B, H, S, D): forward q k^T and p v, backward the five of attention.py (scores again, dv, dp,
  dq, dk);
- plus every other byte a rank must read and write per step at the copy bandwidth each rank
  gets while all copy (bench_speed.TOUCHES, in the model's float32 size; tp: a rank's share of
  the model, and its activations' allreduces counted as an allreduce's 3 - 1/n bytes each).
  Activations are left out (the matrix products read and write most of them; the
  element-wise passes over the rest, LayerNorm, GELU, softmax, are not counted), so the floor
  is a lower one than a fused kernel could reach;
and where the step's time goes (bench_speed.PhaseClock: the layers' forward and backward,
the optimizer's update, collectives, the rest), with what the step's collectives take as bare
mpi4py calls in a loop (bench_speed's "MPI alone"): the collectives' time beyond it is waiting
for the other rank. The products are timed before and after each run and the faster taken,
so a moment of load does not lift the floor. Last, one block's forward and backward against
its products alone, alternating in one process: the package's compute overhead, a ratio that
holds on a loaded machine. Each figure is the median of --reps runs (each
its own mpiexec); the ratio is theirs. --quick: 3 steps, one run, the
same model (about 2 minutes on 2 busy cores). Smaller models (--emb ...) run in seconds: what
tests/test_bench_gpt.py does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from datetime import date

import numpy as np
from bench_speed import (  # this folder's neighbour
    FLOOR_HEADER,
    TOUCHES,
    PhaseClock,
    copy_gb_per_s,
    floor_line,
    floor_ms,
    linear_products,
    load,
    mpi_alone_ms,
    products_ms,
    step_figures,
    worker_rows,
)

from fsdp_lesson.launch import rank_env

# (label, ranks, strategy, tp): the rows, in order; each N runs as one mpiexec
RUNS = [
    ("single", 1, "single", 1),
    ("dp", 2, "dp", 1),
    ("zero1", 2, "zero1", 1),
    ("zero2", 2, "zero2", 1),
    ("zero3", 2, "zero3", 1),
    ("tp=2", 2, "single", 2),
]
SHAPE_FLAGS = ("emb", "hidden", "layers", "heads")


def gpt_products(config, rows: int, tp: int) -> list:
    """Every matrix product of one training step of GPT(config) on a rank with `rows` rows,
    its blocks split over `tp` ranks by heads (Megatron)."""
    E, F, S, V = config.emb, config.hidden, config.seq_len, config.vocab_size
    heads, D = config.heads // tp, config.emb // config.heads
    tokens = rows * S
    block = [(E, E // tp)] * 3 + [(E // tp, E), (E, F // tp), (F // tp, E)]  # q k v, o, fc, proj
    q, kt, p = (rows, heads, S, D), (rows, heads, D, S), (rows, heads, S, S)
    attention = [(q, kt), (p, q)]  # forward: q k^T, p v
    attention += [(q, kt), (p, q), (q, kt), (p, q), (p, q)]  # backward: s, dv, dp, dq, dk
    per_block = linear_products(block, tokens) + attention
    return per_block * config.layers + linear_products([(E, V)], tokens)


def tp_sharded_params(config, tp: int) -> int:
    """Parameters a tp rank does not hold: (tp - 1) / tp of every block's Shard-placed ones."""
    from fsdp_lesson.gpt import Block
    from fsdp_lesson.models import build_model

    if tp == 1:
        return 0
    model = build_model(config)
    block = next(layer for layer in model.layers if isinstance(layer, Block))
    sharded = sum(int(np.prod(block.whole_shapes[key])) for key in Block.TP_PLACEMENTS)
    return sharded * config.layers * (tp - 1) // tp


def block_against_products(shape: dict[str, int], rows: int, rounds: int = 12) -> tuple:
    """One transformer block's forward and backward (the package's, ms) and its products alone
    (ms), alternating in this one process so that both see the same load: medians of rounds."""
    from fsdp_lesson import gpt
    from fsdp_lesson.config import ModelConfig
    from fsdp_lesson.rng import make_rng

    config = ModelConfig(model="gpt", **(shape | {"layers": 1}))
    block = gpt.GPT(config).layers[1]
    rng = make_rng(0, False)
    p = {k: gpt.initial_transformer(k, shape, rng) for k, shape in block.shapes.items()}
    g = {k: np.empty(shape, np.float32) for k, shape in block.shapes.items()}
    x = rng.uniform(rows * config.seq_len * config.emb).reshape(rows, -1)
    products = gpt_products(config, rows, 1)[:-3]  # without the head's three
    layer_ms, products_alone = [], []
    for _ in range(rounds):
        start = time.perf_counter()
        out, saved = block.forward(p, x)
        block.backward(p, saved, out, g)
        layer_ms.append((time.perf_counter() - start) * 1e3)
        products_alone.append(products_ms(products, repeats=1))
    return statistics.median(layer_ms), statistics.median(products_alone)


def worker(steps: int, shape: dict[str, int]) -> None:
    """On every rank of one mpiexec: the floor's two measurements, then each run of RUNS at
    this N; rank 0 prints one JSON line per run."""
    from fsdp_lesson import gpt
    from fsdp_lesson.comm import Comm
    from fsdp_lesson.config import ModelConfig, TrainConfig
    from fsdp_lesson.data import Dataset
    from fsdp_lesson.models import build_model
    from fsdp_lesson.train import run

    clock = PhaseClock()
    layers = (gpt.TokenPositionEmbedding, gpt.Block, gpt.Head)
    clock.wrap_step(layers, gpt.SequenceCrossEntropy)
    config = ModelConfig(model="gpt", **shape)
    data, comm = Dataset.load(), Comm.world()
    params = build_model(config).num_params
    comm.barrier()
    copy = copy_gb_per_s()  # while every rank copies
    for label, n, strategy, tp in RUNS:
        if n != comm.size:
            continue
        train = TrainConfig(strategy=strategy, tp=tp, steps=steps, eval_batches=0, samples=0)
        rows = train.batch // (comm.size // tp)  # the rows of this rank's data-parallel share
        products = gpt_products(config, rows, tp)
        comm.barrier()  # the products while every rank computes its own, before and after
        before = products_ms(products)
        run_comm = Comm.world()
        clock.start(run_comm)
        history, _ = run(config, train, comm=run_comm, data=data)
        comm.barrier()
        compute = min(before, products_ms(products))  # at their fastest: the floor
        mpi_ms = mpi_alone_ms(comm, history.traffic, steps) if comm.size > 1 else 0.0
        if comm.rank == 0:
            figures = step_figures(history, steps)
            allreduce = history.traffic.get("allreduce", {}).get("buffer_bytes", 0)
            row = figures | {
                "label": label,
                "strategy": strategy,
                "ranks": comm.size,
                "tp": tp,
                "params": params,
                "rank_params": params - tp_sharded_params(config, tp),
                "tp_allreduce_bytes": allreduce / steps if tp > 1 else 0.0,
                "copy_gb_s": copy,
                "matmul_ms": compute,
                "mpi_ms": mpi_ms,
                "phases_ms": clock.phases_ms(history, steps),
            }
            print(json.dumps(row), flush=True)


def touched_bytes(r: dict) -> tuple[float, float]:
    """(bytes a rank reads and writes per step, those of them inside the matrix products)."""
    model = 4 * r["rank_params"]  # float32: tp's rank holds its share
    touched = TOUCHES[r["strategy"]](r["ranks"] // r["tp"]) * model
    touched += (3 - 1 / r["tp"]) * r["tp_allreduce_bytes"]  # tp's allreduces of activations
    return touched, 3 * model  # compute reads W twice and writes dW


def median_row(runs: list[dict]) -> dict:
    """The runs' medians of every figure (one run: itself)."""
    row = dict(runs[0])
    for key in ("step_ms", "matmul_ms", "copy_gb_s", "mpi_ms"):
        row[key] = statistics.median(r[key] for r in runs)
    row["phases_ms"] = {
        p: statistics.median(r["phases_ms"][p] for r in runs) for p in runs[0]["phases_ms"]
    }
    return row


def table(args) -> None:
    """Every run of RUNS, --reps times, and the table of medians."""
    shape = [f"--{k}={getattr(args, k)}" for k in SHAPE_FLAGS]
    by_label: dict[str, list[dict]] = {}
    for _ in range(args.reps):
        for n in sorted({n for _, n, _, _ in RUNS}):
            for r in worker_rows(n, "gpt", args.steps, __file__, *shape):
                by_label.setdefault(r["label"], []).append(r)
    first = next(iter(by_label.values()))[0]
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next(
        (
            line.split(":", 1)[1].strip()
            for line in cpu.splitlines()
            if line.startswith("Model name")
        ),
        "unknown CPU",
    )
    print(
        f"--model gpt, {first['params'] / 1e6:.1f} M parameters ("
        + " ".join(shape)
        + f"), batch 32 x 16 positions, SGD, {args.steps} steps, median of {args.reps} runs; "
        f"{model_name}, {os.cpu_count()} cores, {load()}, {date.today()}\n"
        "floor = the step's matrix products alone (matmul, at the rank's shapes, measured with "
        "every rank computing) + the other counted bytes at np.copyto's bandwidth with every "
        "rank copying (single: 1 rank, the rest 2); phases in ms/step (means)"
    )
    print(f"{FLOOR_HEADER} {'MPI alone':>9s}")
    for label, runs in by_label.items():
        row = median_row(runs)
        touched, inside = touched_bytes(row)
        line = floor_line(label, touched, inside, row["matmul_ms"], row["copy_gb_s"], row)
        floor = floor_ms(touched, inside, row["matmul_ms"], row["copy_gb_s"])
        over = "  over 2x" if row["step_ms"] > 2 * floor else ""
        print(f"{line} {row['mpi_ms']:9.2f}{over}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 steps, one run")
    parser.add_argument("--reps", type=int, default=3, help="runs (mpiexecs) per figure")
    parser.add_argument("--steps", type=int, default=8, help="steps per run")
    parser.add_argument("--emb", type=int, default=256, help="embedding width")
    parser.add_argument("--hidden", type=int, default=1024, help="the blocks' MLP width")
    parser.add_argument("--layers", type=int, default=13, help="transformer blocks")
    parser.add_argument("--heads", type=int, default=4, help="attention heads")
    parser.add_argument("--worker", choices=["gpt", "block"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = {k: getattr(args, k) for k in SHAPE_FLAGS}
    if args.worker == "block":  # --steps carries the rows
        layer, alone = block_against_products(shape, args.steps)
        return print(json.dumps({"layer_ms": layer, "products_ms": alone}))
    if args.worker:
        return worker(args.steps, shape)
    if args.quick:
        args.reps, args.steps = 1, 3
    os.environ.update(rank_env())  # the ranks' environment (fsdp_lesson/launch.py)
    start = time.perf_counter()
    table(args)
    rows = 32 // 2  # on a rank of its own, as the ranks run (one BLAS thread)
    [r] = worker_rows(1, "block", rows, __file__, *(f"--{k}={v}" for k, v in shape.items()))
    layer, alone = r["layer_ms"], r["products_ms"]
    print(
        f"one block alone at N = 2's {rows} rows, alternating with its products in one process "
        f"(median of 12): {layer:.1f} ms against {alone:.1f} ms, {layer / alone:.2f}x; {load()}"
    )
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
