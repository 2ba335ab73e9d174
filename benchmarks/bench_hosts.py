"""The cost model meets a real link: commbench, plan.step_seconds and zero3's prefetch across
simulated hosts (fsdp_lesson/hosts.py), each cable a tbf at a known rate.

    .venv/bin/python benchmarks/bench_hosts.py --out /tmp/h2_results.json

1. commbench's alpha-beta fit across 2 hosts x 1 slot at two rates: 1/beta against the TCP
   payload the shaped rate carries (commbench.tcp_payload_rate), R^2 of the fit.
2. A >= 10 M parameter model's zero3 and dp steps across the link: the seconds the ranks spent
   inside collectives per step (measured) against plan.step_seconds (predicted), at N = 2 (one
   rank per host; MPICH's algorithms and the ring move the same bytes) and N = 4 on 2 hosts x 2
   slots (the ring only: its cables carry one rank's sends each way).
3. zero3 with and without --prefetch, the batch grown until compute is about the communication.

Builds its own hosts (prefix fsdpl-k-, a temporary directory) and takes them down on any exit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from fsdp_lesson import commbench, hosts, plan
from fsdp_lesson.config import ModelConfig

ROOT = Path(__file__).resolve().parent.parent
PREFIX = "fsdpl-k-"
MODEL = dict(emb=64, hidden=2048, layers=3)  # 10.55 M parameters
MODEL_FLAGS = [f for k, v in MODEL.items() for f in (f"--{k}", str(v))]
QUIET = ["--eval-batches", "0", "--samples", "0", "--log-every", "1000"]
FIT_KINDS = (("p2p", "pingpong"), ("mpi", "allreduce"), ("mpi", "allgather"),
             ("mpi", "reduce_scatter"), ("mpi", "bcast"), ("ring", "allreduce"),
             ("ring", "allgather"), ("ring", "reduce_scatter"), ("ring", "bcast"))  # fmt: skip


def load() -> float:
    """The 1-minute load average: what else the 2 cores were doing."""
    return round(os.getloadavg()[0], 2)


def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


@contextmanager
def cluster(bandwidth: str, slots: int = 1) -> Iterator[Path]:
    """2 hosts x slots at bandwidth, in a temporary directory; down on any exit."""
    with tempfile.TemporaryDirectory(prefix="fsdpl-k-") as tmp:
        directory = Path(tmp)
        try:
            hosts.up(hosts.Layout(2, slots, bandwidth, PREFIX), directory)
            yield directory
        finally:
            hosts.down(directory)


def link_fit(bandwidth: str, min_bytes: int = 4096, max_bytes: int = 4 * 2**20) -> dict:
    """commbench across 2 hosts x 1 slot: per kind alpha, 1/beta, its ratio to the TCP payload
    rate of the link, and R^2."""
    before = load()
    with cluster(bandwidth) as directory:
        points = commbench.run([2], mpiexec=directory / "mpiexec", min_bytes=min_bytes,
                               max_bytes=max_bytes, timeout=600)  # fmt: skip
    payload = commbench.tcp_payload_rate(hosts.bits_per_second(bandwidth))
    fits = commbench.fit(points)[2]
    kinds = {
        f"{impl} {kind}": dict(
            alpha_us=round(f["alpha_us"], 1),
            mbyte_per_s=round(1e-6 / f["beta_s_per_byte"], 3),
            of_payload_rate=round(1 / f["beta_s_per_byte"] / payload, 3),
            r2=round(f["r2"], 4),
        )
        for impl, kind in FIT_KINDS
        for f in [fits[impl][kind]]
    }
    return dict(bandwidth=bandwidth, payload_mbyte_per_s=round(payload / 1e6, 3), kinds=kinds,
                sizes=[min_bytes, max_bytes], load=[before, load()])  # fmt: skip


def train(directory: Path, n: int, strategy: str, *flags: str, steps: int = 4) -> dict:
    """One run of the model across the hosts; per step: the seconds (median after the first),
    and the collectives' seconds and sent bytes (totals / steps, mean over ranks)."""
    with tempfile.TemporaryDirectory() as out:
        command = [str(directory / "mpiexec"), "-n", str(n), sys.executable, "-m", "fsdp_lesson",
                   "train", "--strategy", strategy, *MODEL_FLAGS, "--steps", str(steps), *QUIET,
                   *flags, "--out", out]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stderr[-2000:]}")
        history = json.loads((Path(out) / "history.json").read_text())
    ranks = history["traffic"]
    return dict(
        step_s=float(np.median(history["step_seconds"][1:])),
        comm_s=float(np.mean([sum(t["seconds"] for t in r.values()) for r in ranks])) / steps,
        sent_bytes=float(np.mean([sum(t["sent_bytes"] for t in r.values()) for r in ranks]))
        / steps,
    )


def step_comparison(bandwidth: str) -> list[dict]:
    """zero3 (no prefetch: every collective blocks) and dp across the link, measured against
    plan.step_seconds at the link's TCP payload rate."""
    psi = sum(plan.layer_sizes(ModelConfig(**MODEL)))
    payload = commbench.tcp_payload_rate(hosts.bits_per_second(bandwidth))
    rows = []
    for slots, impls in ((1, ("mpi", "ring")), (2, ("ring",))):
        with cluster(bandwidth, slots) as directory:
            for impl in impls:
                for strategy in ("zero3", "dp"):
                    before = load()
                    flags = ["--collectives", impl] + (["--no-prefetch"] * (strategy == "zero3"))
                    run = train(directory, 2 * slots, strategy, *flags)
                    predicted = plan.step_seconds(strategy, psi, 2 * slots, payload, 4)
                    rows.append(dict(bandwidth=bandwidth, ranks=2 * slots, hosts=2,
                                     collectives=impl, strategy=strategy, psi=psi, **run,
                                     traffic_bytes=plan.traffic_bytes(strategy, psi, 2 * slots, 4),
                                     predicted_s=predicted, measured_over_predicted=run["comm_s"]
                                     / predicted, load=[before, load()]))  # fmt: skip
    return rows


def prefetch_share(bandwidth: str, steps: int = 6) -> dict:
    """zero3 at N = 2 with and without --prefetch, at a batch whose compute is about the
    communication: the share of the communication that prefetch hides, from the steps."""
    before = load()
    with cluster(bandwidth) as directory:
        probe = train(directory, 2, "zero3", "--no-prefetch", "--batch", "64")
        compute = max(probe["step_s"] - probe["comm_s"], 1e-3)
        batch = int(min(4096, 64 * probe["comm_s"] / compute)) // 2 * 2
        runs = {
            prefetch: train(
                directory, 2, "zero3", f"--{prefetch}", "--batch", str(batch), steps=steps
            )  # fmt: skip
            for prefetch in ("no-prefetch", "prefetch")
        }
    off, on = runs["no-prefetch"], runs["prefetch"]
    return dict(bandwidth=bandwidth, batch=batch, without=off, with_prefetch=on,
                compute_s=off["step_s"] - off["comm_s"],
                hidden_share=(off["step_s"] - on["step_s"]) / off["comm_s"],
                load=[before, load()])  # fmt: skip


def report(results: dict) -> str:
    """The figures as a table, with the load and the CPU they were measured under."""
    lines = [f"CPU: {results['cpu']}, {os.cpu_count()} cores"]
    for fit in results["commbench"]:
        lines.append(f"\ncommbench, 2 hosts x 1 slot at {fit['bandwidth']} (TCP payload "
                     f"{fit['payload_mbyte_per_s']} MB/s), load {fit['load']}")  # fmt: skip
        lines.append(f"  {'kind':20} {'alpha us':>9} {'1/beta MB/s':>11} {'of payload':>10} R^2")
        for kind, f in fit["kinds"].items():
            lines.append(f"  {kind:20} {f['alpha_us']:>9.1f} {f['mbyte_per_s']:>11.2f} "
                         f"{f['of_payload_rate']:>10.2f} {f['r2']:.3f}")  # fmt: skip
    lines.append(f"\nsteps of a {MODEL} model: collective seconds per step (measured) "
                 "vs plan.step_seconds (predicted, at the TCP payload rate)")  # fmt: skip
    for r in results["steps"]:
        lines.append(
            f"  {r['bandwidth']} N={r['ranks']} {r['collectives']:4} {r['strategy']:5} step "
            f"{r['step_s']:.2f} s, comm {r['comm_s']:.2f} s, predicted {r['predicted_s']:.2f} s"
            f" ({r['measured_over_predicted']:.2f}x); load {r['load']}"
        )
    p = results["prefetch"]
    lines.append(
        f"\nzero3 prefetch at {p['bandwidth']}, batch {p['batch']}: step "
        f"{p['without']['step_s']:.2f} s -> {p['with_prefetch']['step_s']:.2f} s, comm "
        f"{p['without']['comm_s']:.2f} s, compute {p['compute_s']:.2f} s; hidden share "
        f"{p['hidden_share']:.2f}; load {p['load']}"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="write the results as JSON here")
    parser.add_argument("--rates", nargs="+", default=["100mbit", "50mbit"], help="commbench's")
    parser.add_argument("--step-rate", default="200mbit", help="parts 2 and 3's link")
    args = parser.parse_args()
    reason = hosts.unavailable()
    if reason is not None:
        parser.error(reason)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # a kill runs the finally too
    results = dict(cpu=cpu_name(), load_start=load())
    results["commbench"] = [link_fit(rate) for rate in args.rates]
    results["steps"] = step_comparison(args.step_rate)
    results["prefetch"] = prefetch_share(args.step_rate)
    results["load_end"] = load()
    args.out.write_text(json.dumps(results, indent=1))
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
