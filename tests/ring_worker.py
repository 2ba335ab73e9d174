"""Run under `mpiexec -n N python tests/ring_worker.py OUT.pkl`: the ring against the library.

Every collective runs twice, through Comm(collectives="ring") and Comm(collectives="mpi"), on
the same inputs; then every strategy trains with ring collectives. Rank 0 writes, per case,
every rank's results and traffic, for tests/test_ring.py to compare.
"""

import pickle
import sys

import numpy as np
from mpi4py import MPI

from fsdp_lesson.comm import Comm, gather_objects, same_everywhere
from fsdp_lesson.config import ModelConfig, TrainConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.ring import Ring, chunk_bounds
from fsdp_lesson.train import run

DTYPES = (np.float32, np.float64)
ALLREDUCE_LENGTHS = (1, 2, 3, 5, 7, 12, 1000, 1001)  # unpadded: uneven and empty chunks too
SHARD_SIZES = (1, 3, 250)  # allgather / reduce-scatter buffers are padded: N * shard
TRAIN = dict(steps=30, batch=24, eval_batches=5, samples=3)  # a wrong chunk shows at step 1


def values(world, length: int, dtype, salt: int = 0) -> np.ndarray:
    """This rank's input: different on every rank, reproducible."""
    rng = np.random.default_rng([world.Get_rank(), length, salt])
    return rng.standard_normal(length).astype(dtype)


def both(world, call, x: np.ndarray, **args) -> dict:
    """call(comm, copy of x, **args) with ring and with mpi collectives, each on a fresh Comm."""
    out = {}
    for how in ("ring", "mpi"):
        comm = Comm(world, collectives=how)
        given = x.copy()
        result = call(comm, given, **args).copy()
        out[how] = result
        out[f"{how}_input_kept"] = bool(np.array_equal(given, x))
        out[f"{how}_same_everywhere"] = same_everywhere(comm, result)
        out[f"{how}_traffic"] = comm.traffic_report()
    return out


def reduce_scatter(comm, full):
    return comm.reduce_scatter_mean(full, np.empty(full.size // comm.size, full.dtype))


def reduce_scatter_in_place(comm, full):
    return comm.reduce_scatter_mean(full, None)


def allgather(comm, mine):
    return comm.allgather(mine, np.zeros(comm.size * mine.size, mine.dtype))


def allgather_in_place(comm, mine):
    full = np.full(comm.size * mine.size, np.nan, dtype=mine.dtype)
    full[comm.rank * mine.size : (comm.rank + 1) * mine.size] = mine
    return comm.allgather(None, full)


def mean_scalar(comm, x):
    return np.array([comm.mean_scalar(float(x[0]))])


def comm_cases(world) -> list[dict]:
    """Each collective through Comm, ring and mpi, on this rank's inputs."""
    n, rank = world.Get_size(), world.Get_rank()
    cases = []

    def case(kind, call, x, length, **args):
        info = dict(kind=kind, name=call.__name__, length=length, itemsize=x.itemsize) | args
        cases.append(info | both(world, call, x, **args))

    for dtype in DTYPES:
        for length in ALLREDUCE_LENGTHS:
            case("allreduce", Comm.allreduce_mean, values(world, length, dtype), length)
        for shard in SHARD_SIZES:
            full, mine = values(world, n * shard, dtype), values(world, shard, dtype, salt=1)
            case("reduce_scatter", reduce_scatter, full, n * shard)
            case("reduce_scatter", reduce_scatter_in_place, full, n * shard)
            case("allgather", allgather, mine, n * shard)
            case("allgather", allgather_in_place, mine, n * shard)
    for dtype in (np.int32, np.float64):
        for length in (1, 1000):
            for root in sorted({0, n - 1}):
                x = (np.arange(length) + 100 * rank).astype(dtype)
                case("bcast", Comm.bcast, x, length, root=root)
    case("allreduce", mean_scalar, values(world, 1, np.float64), 1)
    return cases


def uneven_ring_cases(world) -> list[dict]:
    """Ring.reduce_scatter / allgather on lengths N does not divide, against Reduce_scatter /
    Allgatherv with the same chunk sizes."""
    n, rank = world.Get_size(), world.Get_rank()
    cases = []
    for length in (1, 7, 1001):
        counts = [stop - start for start, stop in chunk_bounds(length, n)]
        start, stop = chunk_bounds(length, n)[rank]
        full = values(world, length, np.float64, salt=2)
        ring = Ring(world)
        mine = ring.reduce_scatter(full, np.empty(stop - start))
        library = np.empty(stop - start)
        world.Reduce_scatter(full, library, counts, op=MPI.SUM)
        gathered = np.zeros(length)
        gathered[start:stop] = full[start:stop]
        ring.allgather(gathered)
        expected = np.empty(length)
        world.Allgatherv(full[start:stop].copy(), [expected, counts])
        cases.append(
            dict(
                length=length,
                reduce_scatter_diff=float(np.abs(mine - library).max(initial=0.0)),
                allgather_equal=bool(np.array_equal(gathered, expected)),
                sent={kind: (s.messages, s.sent_bytes) for kind, s in ring.sent.items()},
            )
        )
    return cases


def train_runs(world) -> dict:
    data, results = Dataset.load(), {}
    for strategy in ("dp", "zero1", "zero2", "zero3"):
        for optimizer in ("sgd", "adam"):
            comm = Comm(world, collectives="ring")
            config = TrainConfig(strategy=strategy, optimizer=optimizer, **TRAIN)
            history, trained = run(ModelConfig(), config, comm=comm, data=data)
            params = trained.full_params()
            per_rank = gather_objects(comm, history.traffic)
            if comm.rank == 0:
                results[f"{strategy}-{optimizer}"] = {
                    "train_config": config,
                    "losses": history.losses,
                    "samples": history.samples,
                    "params": params,
                    "traffic": per_rank,
                }
    return results


def main(out: str) -> None:
    world = MPI.COMM_WORLD
    results = {
        "comm": world.gather(comm_cases(world), root=0),
        "uneven": world.gather(uneven_ring_cases(world), root=0),
        "train": train_runs(world),
    }
    if world.Get_rank() == 0:
        with open(out, "wb") as f:
            pickle.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
