"""Run under `mpiexec -n N python tests/mpi_worker.py OUT.pkl`: every strategy on N ranks.

Rank 0 writes what the tests compare against single: losses, the full parameters, each
rank's memory ledger, traffic and tracemalloc peak, the samples, and the sampling traffic.
"""

import pickle
import sys

from fsdp_lesson.comm import Comm, gather_objects
from fsdp_lesson.config import ModelConfig, RunConfig, TrainConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.train import run

# (name, model config, train config kwargs, extra arguments of run())
RUNS = [
    *[
        (
            f"{strategy}-{opt}",
            ModelConfig(),
            dict(strategy=strategy, optimizer=opt),
            {"timeline_step": 1},
        )
        for strategy in ("dp", "zero1", "zero2", "zero3")
        for opt in ("sgd", "adam")
    ],
    *[
        (
            f"zero3-{opt}-layers4",
            ModelConfig(layers=4),
            dict(strategy="zero3", optimizer=opt),
            {},
        )
        for opt in ("sgd", "adam")
    ],
    # a wider model, so Python's own ~15 KB of bookkeeping is small next to the arrays
    *[
        (
            f"{strategy}-adam-wide",
            ModelConfig(hidden=256),
            dict(strategy=strategy, optimizer="adam"),
            {"trace_memory": True},
        )
        for strategy in ("dp", "zero1", "zero2", "zero3")
    ],
]
COMMON = dict(steps=30, batch=24, eval_batches=5, samples=3)  # a wrong shard shows at step 1


def padding_is_zero(strategy) -> bool:
    """Whether every padding element this rank holds of every layer's parameters is 0."""
    for key, entry in strategy.local_state().items():
        if key.endswith(".params"):
            flat = strategy.layout[entry.layer]
            start = flat.shard_range(strategy.comm.rank)[0] if entry.sharded else 0
            if entry.array[max(flat.numel - start, 0) :].any():
                return False
    return True


def main(out: str) -> None:
    comm, data = Comm.world(), Dataset.load()
    results = {}
    for name, model_config, kwargs, run_kwargs in RUNS:
        steps = 5 if "trace_memory" in run_kwargs else COMMON["steps"]
        config = TrainConfig(**(COMMON | kwargs | {"steps": steps}))
        comm = Comm.world()  # fresh accounting per run
        history, strategy = run(model_config, config, RunConfig(**run_kwargs), comm, data)
        params = strategy.full_params()
        per_rank = gather_objects(
            comm,
            {
                "memory": history.memory,
                "traffic": history.traffic,
                "after": comm.traffic_report(),
                "padding_is_zero": padding_is_zero(strategy),
            },
        )
        if comm.rank == 0:
            results[name] = {
                "model_config": model_config,
                "train_config": config,
                "losses": history.losses,
                "val_loss": history.val_loss,
                "samples": history.samples,
                "names": history.names,
                "timeline": history.timeline,
                "params": params,
                "per_rank": per_rank,
            }
    if comm.rank == 0:
        with open(out, "wb") as f:
            pickle.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
