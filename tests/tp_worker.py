"""Run under `mpiexec -n N python tests/tp_worker.py OUT.pkl`: tensor-parallel runs on N ranks.

Rank 0 writes what tests/test_tp.py compares with single-rank training: losses, the whole
parameters (gathered over tp and dp), the samples, and every rank's memory ledger, traffic and
whether the padding of the split layers is still zero.
"""

import pickle
import sys

import numpy as np

from fsdp_lesson.comm import Comm, gather_objects
from fsdp_lesson.config import ModelConfig, TrainConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.tensor import ColumnParallelLinear
from fsdp_lesson.train import run

COMMON = dict(steps=30, batch=24, eval_batches=3, samples=2)
SEED, PADDED_2, PADDED_4 = ModelConfig(), ModelConfig(hidden=63), ModelConfig(hidden=62)

# per world size: (name, model config, train config kwargs, collectives)
RUNS = {
    2: [
        *[(f"tp2-single-{opt}", SEED, dict(tp=2, optimizer=opt), "mpi") for opt in ("sgd", "adam")],
        ("tp2-single-sgd-layers2", ModelConfig(layers=2), dict(tp=2), "mpi"),
        ("tp2-single-sgd-layers3-hidden63", ModelConfig(layers=3, hidden=63), dict(tp=2), "mpi"),
        ("tp2-single-sgd-ring", SEED, dict(tp=2), "ring"),
    ],
    4: [
        *[
            (f"tp2-{strategy}-{opt}", SEED, dict(tp=2, strategy=strategy, optimizer=opt), "mpi")
            for strategy in ("dp", "zero1", "zero2", "zero3")
            for opt in ("sgd", "adam")
        ],
        ("tp4-single-sgd", SEED, dict(tp=4), "mpi"),
        ("tp4-single-adam-hidden62", PADDED_4, dict(tp=4, optimizer="adam"), "mpi"),
        (
            "tp2-zero3-adam-hidden63-ring",
            PADDED_2,
            dict(tp=2, strategy="zero3", optimizer="adam"),
            "ring",
        ),
    ],
}


def padding_is_zero(strategy) -> bool:
    """Whether this rank's columns or rows past the whole layer's width are all 0."""
    zero = True
    strategy.begin_phase("forward")
    for layer in strategy.model.layers:
        p = strategy.materialize(layer)  # a collective under zero3: every rank, in order
        if layer.split:
            real = layer.stop - layer.start
            column = isinstance(layer, ColumnParallelLinear)
            pad = [p["W"][:, real:], p["b"][real:]] if column else [p["W"][real:]]
            zero &= not any(np.any(a) for a in pad)
        strategy.release(layer)
    return zero


def main(out: str) -> None:
    data, world = Dataset.load(), Comm.world()
    results = {}
    for name, model_config, kwargs, collectives in RUNS[world.size]:
        config = TrainConfig(**(COMMON | kwargs))
        comm = Comm.world(collectives)  # fresh accounting per run
        history, strategy = run(model_config, config, comm=comm, data=data)
        params = strategy.full_params()
        per_rank = gather_objects(
            comm,
            {
                "memory": history.memory,
                "traffic": history.traffic,
                "padding_is_zero": padding_is_zero(strategy),
            },
        )
        if comm.rank == 0:
            results[name] = {
                "model_config": model_config,
                "train_config": config,
                "collectives": collectives,
                "losses": history.losses,
                "samples": history.samples,
                "params": params,
                "per_rank": per_rank,
            }
    if world.rank == 0:
        with open(out, "wb") as f:
            pickle.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
