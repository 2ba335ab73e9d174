"""HSDP where it belongs: zero3 --replicate 2 at N = 4 on 2 simulated hosts (fsdp_lesson/hosts.py).

With --shard-group consecutive (the default, FSDP2's mesh) the shard groups are the hosts and
only the replicas' gradient allreduce crosses the link; with --shard-group strided the shard
groups span the hosts and every gather and reduce-scatter crosses it. Both train the model
single-rank training trains; the ring's count of the bytes between hosts (each rank's sends
to a right neighbour on another host, Comm.between_hosts) is what the cables carry, and the
placement changes it threefold.

Needs iproute2 and user namespaces, no root (skips with the reason elsewhere); its own hosts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi_helpers import simulated_hosts

from fsdp_lesson import hosts
from fsdp_lesson.comm import bytes_between_hosts
from fsdp_lesson.config import ModelConfig, TrainConfig
from fsdp_lesson.train import run

ROOT = Path(__file__).resolve().parent.parent
REASON = hosts.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))
PREFIX = "fsdpl-s-"
STEPS = 60


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """2 hosts x 2 slots at 1 Gbit/s, up for the module and always down at its end."""
    with simulated_hosts(tmp_path_factory.mktemp("hosts"), PREFIX) as directory:
        yield directory


@pytest.fixture(scope="module")
def single_params():
    _, strategy = run(ModelConfig(), TrainConfig(steps=STEPS, eval_batches=0, samples=0))
    return strategy.full_params()


def hsdp_across_hosts(directory: Path, out: Path, shard_group: str) -> tuple[list[dict], int, str]:
    """zero3 --replicate 2 on the lesson's ring: every rank's traffic, the bytes the cables
    carried from host to host meanwhile, and what rank 0 printed."""
    before = hosts.link_bytes(directory)
    command = [
        str(directory / "mpiexec"), "-n", "4", sys.executable, "-m", "fsdp_lesson", "train",
        "--strategy", "zero3", "--replicate", "2", "--shard-group", shard_group,
        "--collectives", "ring", "--steps", str(STEPS), "--eval-batches", "0", "--samples", "0",
        "--log-every", str(STEPS), "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    crossed = hosts.between_hosts(before, hosts.link_bytes(directory), directory)
    return json.loads((out / "history.json").read_text())["traffic"], crossed, done.stdout


@pytest.mark.timeout(600)
def test_hsdp_placement_decides_what_crosses_the_link(cluster, single_params, tmp_path):
    between = {}
    for shard_group in ("consecutive", "strided"):
        out = tmp_path / shard_group
        traffic, crossed, printed = hsdp_across_hosts(cluster, out, shard_group)
        saved = np.load(out / "params.npz")
        for layer, p in single_params.items():
            for k, v in p.items():
                diff = np.abs(saved[f"{layer}.{k}"] - v).max()
                assert diff <= 1e-5, f"{shard_group}: {layer}.{k} differs by {diff:.1e}"
        counted = sum(bytes_between_hosts(rank) for rank in traffic)
        # the cables carry the ring's sends plus TCP/IP headers and mpiexec's control traffic
        assert 1.0 <= crossed / counted <= 1.1, (shard_group, crossed, counted)
        assert f"between hosts: {counted / 1e6:,.2f} MB" in printed, printed
        between[shard_group] = counted
        crossing = {"consecutive": "(replicate)", "strided": "(shard)"}[shard_group]
        group_bytes = sum(
            t["sent_bytes"]
            for rank in traffic
            for kind, t in rank.items()
            if t["between_hosts"] and crossing in kind
        )  # the rest: the world's loss means, 8 bytes a step
        assert group_bytes >= 0.99 * counted, (shard_group, group_bytes, counted)
    # consecutive: the replicas' allreduce of a gradient shard, 2 * 1/2 * Psi/2 per rank and
    # step; strided: the shard group's two allgathers and reduce-scatter, 3 * 1/2 * Psi
    assert between["strided"] / between["consecutive"] == pytest.approx(3, rel=0.02)
