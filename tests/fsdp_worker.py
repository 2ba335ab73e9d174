"""Run under `mpiexec -n N python tests/fsdp_worker.py OUT.pkl`: zero3's FSDP options on N ranks.

Rank 0 writes, per run: the losses, the full parameters, and each rank's initial parameters
(what it keeps after initialisation), memory ledger, traffic and trace of one step.
"""

import pickle
import sys

import numpy as np

from fsdp_lesson.comm import Comm, gather_objects
from fsdp_lesson.config import ModelConfig, RunConfig, TrainConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.train import run

N = Comm.world().size
INIT = dict(steps=0, batch=24, eval_batches=0, samples=0)
TRAIN = dict(steps=30, batch=24, eval_batches=2, samples=1)  # a wrong shard shows at step 1


def runs():
    """(name, model config, train config): sharded initialisation, then every option trained."""
    for strategy in ("dp", "zero1", "zero2", "zero3"):
        for c_compat in (False, True):
            yield (
                f"init-{strategy}-c{c_compat:d}",
                ModelConfig(),
                dict(strategy=strategy, c_compat=c_compat, **INIT),
            )
    yield (
        "init-zero3-units2",
        ModelConfig(layers=3),
        dict(strategy="zero3", layers_per_unit=2, **INIT),
    )
    options = {
        "prefetch": {},
        "no-prefetch": dict(prefetch=False),
        "units2": dict(layers_per_unit=2),
        "whole": dict(layers_per_unit=99),
        "keep": dict(reshard_after_forward=False),
        "keep-no-prefetch": dict(reshard_after_forward=False, prefetch=False),
        **{f"hsdp{r}": dict(replicate=r) for r in (2, 4) if N % r == 0},
    }
    for opt in ("sgd", "adam"):
        for label, extra in options.items():
            model = (
                ModelConfig(layers=4)
                if label in ("prefetch", "no-prefetch", "units2")
                else ModelConfig()
            )
            yield f"{label}-{opt}", model, dict(strategy="zero3", optimizer=opt, **TRAIN, **extra)
    c_compat = {  # the C FSDP programs' local biases (strategies/zero3/local_biases.py)
        "c-compat-sgd": {},
        "c-compat-accum-sgd": dict(batch=12, accum=2),
        "c-compat-adam": dict(optimizer="adam"),
        "c-compat-units2-adam": dict(optimizer="adam", layers_per_unit=2, prefetch=False),
    }
    for name, extra in c_compat.items():
        yield name, ModelConfig(), dict(strategy="zero3", c_compat=True, **(TRAIN | extra))


def main(out: str) -> None:
    data, results = Dataset.load(), {}
    for name, model_config, kwargs in runs():
        comm = Comm.world()  # fresh accounting per run
        config = TrainConfig(**kwargs)
        history, strategy = run(model_config, config, RunConfig(trace_step=1), comm, data)
        initial = {
            k: e.array.copy() for k, e in strategy.local_state().items() if k.endswith(".params")
        }
        params = strategy.full_params()
        per_rank = gather_objects(
            comm,
            {
                "memory": history.memory,
                "traffic": history.traffic,
                "trace": history.trace,
                "initial": initial if config.steps == 0 else None,
                "sharded": {k: e.sharded for k, e in strategy.local_state().items()},
                "local_biases": getattr(strategy, "local_biases", None)
                and {k: b.copy() for k, b in strategy.local_biases.params.items()},
            },
        )
        if comm.rank == 0:
            results[name] = {
                "model_config": model_config,
                "train_config": config,
                "losses": np.asarray(history.losses),
                "params": params,
                "per_rank": per_rank,
            }
    if Comm.world().rank == 0:
        with open(out, "wb") as f:
            pickle.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
