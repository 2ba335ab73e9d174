"""Run under `mpiexec -n N python tests/levers_worker.py OUT.pkl`: the memory levers on N ranks.

Mixed precision (bf16, fp16), gradient accumulation (every, last), activation
recomputation (each beside its twin without) and gradient clipping with every strategy;
rank 0 writes, per run, the losses, the full parameters (the fp32 master where there is one),
the skipped steps and each rank's memory ledger and traffic.
"""

import pickle
import sys

import numpy as np

from fsdp_lesson.comm import Comm, gather_objects
from fsdp_lesson.config import ModelConfig, RunConfig, TrainConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.train import run

STRATEGIES = ("dp", "zero1", "zero2", "zero3")
TRAIN = dict(steps=20, batch=24, eval_batches=2, samples=1)  # a wrong shard shows at step 1
TRAFFIC = dict(steps=5, batch=24, eval_batches=0, samples=0)
RECOMPUTE = dict(steps=30, batch=24, eval_batches=1, samples=0)
CLIP = 0.1  # --clip-grad-norm


def runs():
    """(name, model config, train config kwargs, collectives)."""
    for strategy in STRATEGIES:
        for opt in ("sgd", "adam"):
            kwargs = dict(strategy=strategy, optimizer=opt, precision="bf16", **TRAIN)
            yield f"{strategy}-{opt}-bf16", ModelConfig(), kwargs, "mpi"
        kwargs = dict(strategy=strategy, optimizer="adam", precision="fp16", **TRAIN)
        yield f"{strategy}-adam-fp16", ModelConfig(), kwargs, "mpi"
        for precision in ("fp32", "bf16"):  # measured traffic: the ring's own bytes
            kwargs = dict(strategy=strategy, optimizer="adam", precision=precision, **TRAFFIC)
            yield f"{strategy}-{precision}-ring", ModelConfig(), kwargs, "ring"
        for reduce in ("every", "last"):
            kwargs = dict(strategy=strategy, optimizer="adam", accum_reduce=reduce, **TRAIN)
            kwargs |= dict(batch=12, accum=2)
            yield f"{strategy}-accum-{reduce}", ModelConfig(), kwargs, "mpi"
        for recompute in (False, True):  # a deeper model: three blocks to recompute
            kwargs = dict(strategy=strategy, optimizer="adam", recompute=recompute, **RECOMPUTE)
            yield f"{strategy}-recompute-{recompute}", ModelConfig(layers=3), kwargs, "mpi"
        for opt in ("sgd", "adam"):  # the seed model's gradient norm is 0.2-0.3: every step clips
            kwargs = dict(strategy=strategy, optimizer=opt, clip_grad_norm=CLIP, **TRAIN)
            yield f"{strategy}-{opt}-clip", ModelConfig(), kwargs, "mpi"
    kwargs = dict(strategy="zero3", clip_grad_norm=CLIP, layers_per_unit=2, **TRAIN)
    yield "zero3-units2-clip", ModelConfig(layers=3), kwargs, "mpi"
    yield (
        "zero3-bf16-units2-keep",
        ModelConfig(layers=3),
        dict(strategy="zero3", precision="bf16", layers_per_unit=2, **TRAIN)
        | dict(reshard_after_forward=False),
        "mpi",
    )
    yield (
        "zero3-accum-last-bf16-no-prefetch",
        ModelConfig(layers=3),
        dict(strategy="zero3", optimizer="adam", precision="bf16", prefetch=False, **TRAIN)
        | dict(batch=12, accum=2, accum_reduce="last"),
        "mpi",
    )
    for recompute in (False, True):  # every lever at once, and units that hold two blocks
        kwargs = dict(strategy="zero3", optimizer="adam", precision="bf16", **RECOMPUTE)
        kwargs |= dict(layers_per_unit=2, batch=12, accum=2, recompute=recompute)
        yield f"zero3-units2-bf16-accum-recompute-{recompute}", ModelConfig(layers=3), kwargs, "mpi"


def master_params(strategy) -> dict:
    """Every layer's parameters, flat, as the state holds them (the fp32 master, if mixed)."""
    out = {}
    units = getattr(strategy, "units", None)
    for key, entry in strategy.local_state().items():
        if key.endswith(".params"):
            flat = strategy.layout[entry.layer]
            whole = np.zeros(flat.padded_numel, dtype=np.float32)
            if entry.sharded:
                comm = strategy.shard_comm if units else strategy.comm
                comm.allgather(entry.array.astype(np.float32), whole)
            else:
                whole[: entry.array.size] = entry.array
            if units is None:
                out[entry.layer] = whole[: flat.numel]
                continue
            unit = next(u for u in units if u.name == entry.layer)
            for layer, views in unit.views(whole).items():
                out[layer] = np.concatenate([v.ravel() for v in views.values()] or [whole[:0]])
    return out


def main(out: str) -> None:
    data, results = Dataset.load(), {}
    for name, model_config, kwargs, collectives in runs():
        comm = Comm.world(collectives)  # fresh accounting per run
        config = TrainConfig(**kwargs)
        history, strategy = run(
            model_config, config, RunConfig(collectives=collectives), comm, data
        )
        params = master_params(strategy)
        per_rank = gather_objects(
            comm,
            {
                "memory": history.memory,
                "traffic": history.traffic,
                "skipped": history.skipped_steps,
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
