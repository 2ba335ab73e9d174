"""Comm's per-call overhead: 10^5 allreduce_mean calls of 4 KB against bare mpi4py.

    mpiexec -n 2 python benchmarks/bench_comm_overhead.py [--calls CALLS]

Prints µs per call for the bare `Allreduce` + division that Comm does in mpi mode, for
`Comm.allreduce_mean`, and the difference: what Comm's bookkeeping costs a call; then, for
comparison, the hand-made ring's allreduce_mean (collectives="ring"). The calls run in 10
rounds, the three alternating (the machine is shared, so its load drifts); each figure is the
median over rounds.
"""

import argparse
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


def calls_flag(text: str) -> int:
    """--calls: a whole number of at least 10 (the calls are split into 10 rounds)."""
    if not text.isdigit() or int(text) < 10:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 10, got {text}")
    return int(text)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--calls", type=calls_flag, default=100_000, help="allreduce calls per contender"
    )
    main(parser.parse_args().calls)
