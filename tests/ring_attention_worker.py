"""Run under `mpiexec -n 4 python tests/ring_attention_worker.py OUT.pkl`: ring attention
(fsdp_lesson/ring_attention.py) on every cp size of a 4-rank world, in one launch.

For C = 4, 2 and 1 the world splits into 4 / C cp groups (Comm.split, so C = 2 runs as two
rings side by side, each on its own sequence); each group runs ring attention forward and
backward on both layouts with its step traced. Rank 0 writes, per case and per world rank,
the local results, the positions, the sends' counts after forward and after backward and the
trace, for tests/test_ring_attention.py to compare with single-rank attention.

`mpiexec -n 4 python tests/ring_attention_worker.py stop RANK`: one ring over the world with a
3 s timeout in which rank RANK stops itself (SIGSTOP) before it sends: the others' waits on
their neighbours must end the job, naming who they wait for.
"""

import os
import pickle
import signal
import sys

import numpy as np

from fsdp_lesson.comm import Comm, gather_objects
from fsdp_lesson.ring_attention import LAYOUTS, layout, ring_attention, ring_attention_backward

WORLD = 4
SHAPE = (2, 3, 24, 8)  # (B, H, T, D): T = 24 divides into 2C zig-zag chunks for C = 1, 2, 4
CP_SIZES = (4, 2, 1)


def sequence(cp: int, name: str, group: int) -> tuple[np.ndarray, ...]:
    """q, k, v and dout (each (B, H, T, D) float32) of one group's whole sequence: the same on
    every rank, different for every case and group."""
    rng = np.random.default_rng([cp, LAYOUTS.index(name), group])
    return tuple(rng.standard_normal(SHAPE).astype(np.float32) for _ in range(4))


def sends(cp: Comm) -> tuple[int, float]:
    """(messages, bytes) this rank has sent on cp so far."""
    send = cp.traffic_report().get("send", {"messages": 0, "sent_bytes": 0})
    return send["messages"], send["sent_bytes"]


def run_case(world: Comm, cp_size: int, name: str) -> dict:
    group = world.rank // cp_size
    cp = world.split(group, world.rank, "cp")
    positions = layout(name, SHAPE[2], cp_size)
    mine = positions[cp.rank]
    q, k, v, dout = (x[:, :, mine] for x in sequence(cp_size, name, group))
    cp.trace.spans = []
    out, lse = ring_attention(q, k, v, positions, cp)
    after_forward = sends(cp)
    dq, dk, dv = ring_attention_backward(q, k, v, out, lse, dout, positions, cp)
    spans, cp.trace.spans = cp.trace.spans, None
    return dict(
        group=group,
        cp_rank=cp.rank,
        positions=mine,
        results=dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv),
        forward_sends=after_forward,
        backward_sends=tuple(b - f for b, f in zip(sends(cp), after_forward, strict=True)),
        spans=spans,
    )


def stop(rank: int) -> None:
    """A ring whose rank `rank` stops before its first send; the watchdog ends the job."""
    world = Comm.world(timeout=3.0)
    cp = world.split(0, world.rank, "cp")
    positions = layout("zigzag", SHAPE[2], cp.size)
    q, k, v, _ = (x[:, :, positions[cp.rank]] for x in sequence(cp.size, "zigzag", 0))
    if cp.rank == rank:
        os.kill(os.getpid(), signal.SIGSTOP)
    ring_attention(q, k, v, positions, cp)


def main(out_path: str) -> None:
    world = Comm.world()
    assert world.size == WORLD, f"run on {WORLD} ranks"
    results = {}
    for cp_size in CP_SIZES:
        for name in LAYOUTS:
            results[(cp_size, name)] = gather_objects(world, run_case(world, cp_size, name))
    if world.rank == 0:
        with open(out_path, "wb") as f:
            pickle.dump(results, f)


if __name__ == "__main__":
    stop(int(sys.argv[2])) if sys.argv[1] == "stop" else main(sys.argv[1])
