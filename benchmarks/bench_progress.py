"""Does a non-blocking collective finish while the other rank is busy elsewhere?

    mpiexec -n 2 python benchmarks/bench_progress.py
    MPIR_CVAR_CH4_IPC_CMA_P2P_THRESHOLD=65537 MPIR_CVAR_CH4_SHM_POSIX_IQUEUE_CELL_SIZE=69632 \\
        MPIR_CVAR_CH4_PACK_BUFFER_SIZE=69632 mpiexec -n 2 python benchmarks/bench_progress.py

zero3's prefetch starts the next unit's allgather and waits for it a layer later; its gradient
reduce-scatter is waited for a unit later. That hides the collective only if it can finish
while the other rank computes, outside MPI (MPICH has no progress thread by default). Every
rank starts the collective at the seed model's sizes (each unit's full buffer at N = 2); rank
1 then sleeps SLEEP seconds longer than rank 0 before its wait, and rank 0 prints how long its
own wait took: about 0 when the bytes moved without rank 1, about SLEEP when its wait had to
wait for rank 1 to enter MPI (a meeting point). A sleep, not a clock race: the figure stands
on a loaded machine. With MPICH's defaults a message of 8 KB or more is sent by rendezvous or in
several 8 KB cells, both of which need the sender inside MPI; the settings in the second line
send such messages of up to 64 KB in one shared-memory cell.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
from mpi4py import MPI

from fsdp_lesson.config import ModelConfig
from fsdp_lesson.flat import FlatParam
from fsdp_lesson.model import MLP

SLEEP = 0.03  # seconds rank 1 stays away longer than rank 0
HEAD_START = 0.01  # seconds both wait after starting it: long enough for both to have started
REPEATS = 7


def wait_ms(world, kind: str, full: np.ndarray, shard: np.ndarray) -> float:
    """Median ms rank 0 spends in the wait of one `kind`, rank 1 arriving SLEEP s later."""
    waits = []
    for _ in range(REPEATS):
        world.Barrier()
        if kind == "allgather":
            request = world.Iallgather(shard, full)
        elif kind == "reduce_scatter":
            request = world.Ireduce_scatter_block(full, shard)
        else:
            request = world.Iallreduce(MPI.IN_PLACE, full)
        time.sleep(HEAD_START + (SLEEP if world.rank == 1 else 0.0))
        start = time.perf_counter()
        request.Wait()
        waits.append(time.perf_counter() - start)
    return float(np.median(waits) * 1e3)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # --help only
    world = MPI.COMM_WORLD
    n = world.size
    units = [layer for layer in MLP(ModelConfig()).layers if layer.shapes]
    settings = {k: v for k, v in os.environ.items() if k.startswith("MPIR_CVAR_")}
    rows = []
    for layer in units:
        numel = FlatParam(layer.shapes, n).padded_numel
        full, shard = np.zeros(numel, np.float32), np.ones(numel // n, np.float32)
        for kind in ("allgather", "reduce_scatter", "allreduce"):
            rows.append((layer.name, numel * 4, kind, wait_ms(world, kind, full, shard)))
    if world.rank == 0:
        print(f"N = {n}; MPI settings: {settings or 'the defaults'}")
        late = f"{SLEEP * 1e3:.0f} ms later"
        print(f"rank 0's wait, ms, with rank 1 arriving {late} (median of {REPEATS})")
        for name, nbytes, kind, ms in rows:
            print(f"{name:5s} {nbytes:7,d} B  {kind:15s} {ms:6.2f}")


if __name__ == "__main__":
    main()
