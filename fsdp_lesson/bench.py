"""The measurement sweep: strategy x ranks x model, every rank's memory, traffic and time.

    python -m fsdp_lesson bench --out build/sweep.json            # the notebook's quick sweep
    python -m fsdp_lesson bench --full --out build/sweep-full.json
    python -m fsdp_lesson bench --out build/sweep.json --reuse    # unless this code made it

For each rank count N it runs `mpiexec -n N` once; every rank trains each (model, strategy)
for a few steps and reports its ledger peaks, tracemalloc peak, RSS, traffic per step by
collective and ms/step (median) split into communication and compute. Rank 0 prints one
JSON line per run; this process collects them into one file. Each record names the code that
measured it (a digest of the package's source), so that notebooks 07 and 08 share one sweep
(--reuse) and a change to the package measures again.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import psutil

from .plan import PLANNED as STRATEGIES  # the strategies one runs on N ranks

# name -> (ModelConfig fields, steps): 18,635, 0.93 M and 30.0 M parameters.
MODELS = {
    "seed": ({}, 300),
    "medium": ({"hidden": 512, "layers": 4}, 20),
    "large": ({"hidden": 2048, "layers": 8}, 4),
}
QUICK = {"ranks": [1, 2, 4], "models": ["seed", "medium"]}
FULL = {"ranks": [1, 2, 4, 8], "models": ["seed", "medium", "large"]}


@functools.cache  # the source does not change under a running sweep: read it once
def code_digest() -> str:
    """A digest of the package's source: which code a sweep's records were measured by."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parent
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def reusable(path: Path, ranks: list[int], models: list[str]) -> bool:
    """Whether `path` holds this plan's sweep, every record measured by this same code."""
    try:
        records = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(records, list)
        and all(isinstance(r, dict) and r.get("code") == code_digest() for r in records)
        and sorted({(r.get("model"), r.get("strategy"), r.get("ranks")) for r in records})
        == sorted((m, s, n) for m in models for s in STRATEGIES for n in ranks)
    )


def measure(model_name: str, strategy: str, optimizer: str = "adam") -> dict | None:
    """Train one configuration on this MPI job; rank 0 gets every rank's figures."""
    from .comm import Comm, gather_objects
    from .config import ModelConfig, RunConfig, TrainConfig
    from .train import run

    fields, steps = MODELS[model_name]
    comm = Comm.world()
    config = TrainConfig(
        strategy=strategy, optimizer=optimizer, steps=steps, eval_batches=0, samples=0
    )
    # memory from 2 steps under tracemalloc (which slows Python down); time from a clean run
    traced, _ = run(
        ModelConfig(**fields), replace(config, steps=2), RunConfig(trace_memory=True), comm
    )
    comm = Comm.world()
    history, _ = run(ModelConfig(**fields), config, comm=comm)
    mine = {
        "memory": traced.memory,
        "rss_bytes": psutil.Process().memory_info().rss,  # the whole process: a ceiling
        "traffic_per_step": {k: t["sent_bytes"] / steps for k, t in history.traffic.items()},
        # means over the same steps, so that compute = step - communication
        "ms_per_step": float(np.mean(history.step_seconds) * 1e3),
        "comm_ms_per_step": sum(t["seconds"] for t in history.traffic.values()) / steps * 1e3,
        "median_ms_per_step": float(np.median(history.step_seconds) * 1e3),
        "min_ms_per_step": float(np.min(history.step_seconds) * 1e3),  # the spread of the steps
        "max_ms_per_step": float(np.max(history.step_seconds) * 1e3),
    }
    per_rank = gather_objects(comm, mine)
    if comm.rank != 0:
        return None
    return {
        "code": code_digest(),
        "model": model_name,
        "model_config": fields,
        "strategy": strategy,
        "optimizer": optimizer,
        "ranks": comm.size,
        "steps": steps,
        "per_rank": per_rank,
    }


def worker(models: list[str]) -> None:
    """Runs on every rank of one mpiexec: every model x strategy, one JSON line each."""
    for model_name in models:
        for strategy in STRATEGIES:
            result = measure(model_name, strategy)
            if result is not None:
                print(json.dumps(result), flush=True)


def sweep(ranks: list[int], models: list[str], timeout: float = 1800) -> list[dict]:
    """One mpiexec per rank count; returns every run's record."""
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    records = []
    for n in ranks:
        start = time.perf_counter()
        command = [
            mpiexec,
            "-n",
            str(n),
            sys.executable,
            "-m",
            "fsdp_lesson.bench",
            "--worker",
            *models,
        ]
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if out.returncode != 0:
            raise RuntimeError(f"mpiexec -n {n} failed:\n{out.stderr[-2000:]}")
        records += [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        print(
            f"N={n}: {len(models) * len(STRATEGIES)} runs in {time.perf_counter() - start:.0f} s",
            file=sys.stderr,
        )
    return records


def summary(records: list[dict]) -> str:
    """One line per run: rank 0's peak memory, traffic per step, ms per step (comm part)."""
    lines = [
        f"{'model':7s} {'N':>2s} {'strategy':8s} {'peak kB':>10s} {'sent kB/step':>13s}"
        f" {'ms/step':>8s} {'in comm':>8s}   (rank 0; traffic counted, time measured)"
    ]
    for r in records:
        rank0 = r["per_rank"][0]
        lines.append(
            f"{r['model']:7s} {r['ranks']:2d} {r['strategy']:8s}"
            f" {rank0['memory']['peak_total'] / 1e3:10,.1f}"
            f" {sum(rank0['traffic_per_step'].values()) / 1e3:13,.1f}"
            f" {rank0['ms_per_step']:8.3f} {rank0['comm_ms_per_step']:8.3f}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fsdp_lesson bench", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", type=Path, default=Path("build/sweep.json"))
    parser.add_argument("--full", action="store_true", help="add N=8 and the 30 M-parameter model")
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="keep --out's sweep when this same code measured it (delete it to measure again)",
    )
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    plan = FULL if args.full else QUICK
    if args.reuse and reusable(args.out, plan["ranks"], plan["models"]):
        records = json.loads(args.out.read_text())
        print(summary(records))
        print(f"reused {len(records)} runs from {args.out}, measured by this same code")
        return 0
    records = sweep(plan["ranks"], plan["models"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(records, indent=1))
    print(summary(records))
    print(f"wrote {len(records)} runs to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
