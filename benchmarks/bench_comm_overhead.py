"""Comm's per-call overhead: 10^5 allreduce_mean calls of 4 KB against bare mpi4py.

    mpiexec -n 2 python benchmarks/bench_comm_overhead.py [CALLS]

Prints µs per call for the bare `Allreduce` + division that Comm does in mpi mode, for
`Comm.allreduce_mean`, and the difference: what Comm's bookkeeping costs a call; then, for
comparison, the hand-made ring's allreduce_mean (collectives="ring"). The calls run in 10
rounds, the three alternating (the machine is shared, so its load drifts); each figure is the
median over rounds.
"""

import sys
import time

import numpy as np
from mpi4py import MPI

from fsdp_lesson.comm import Comm


def round_us(call, buf: np.ndarray, calls: int) -> float:
    """µs per call over `calls` back-to-back calls."""
    MPI.COMM_WORLD.Barrier()
    start = time.perf_counter()
    for _ in range(calls):
        call(buf)
    return (time.perf_counter() - start) / calls * 1e6


def bare(buf: np.ndarray) -> None:
    MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    buf /= buf.dtype.type(MPI.COMM_WORLD.Get_size())


def main(calls: int) -> None:
    buf = np.ones(1024, dtype=np.float32)  # 4 KB
    comm, ring = Comm.world(), Comm.world(collectives="ring")
    contenders = (bare, comm.allreduce_mean, ring.allreduce_mean)
    rounds = 10
    for call in contenders:
        round_us(call, buf, calls // rounds)  # warm-up
    times = [[round_us(call, buf, calls // rounds) for call in contenders] for _ in range(rounds)]
    bare_us, comm_us, ring_us = np.median(times, axis=0)
    if comm.rank == 0:
        print(
            f"N={comm.size}, {calls:,} calls of a 4 KB allreduce: bare {bare_us:.2f} µs, "
            f"Comm {comm_us:.2f} µs, overhead {comm_us - bare_us:.2f} µs per call; "
            f"ring {ring_us:.2f} µs"
        )


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 100_000)
