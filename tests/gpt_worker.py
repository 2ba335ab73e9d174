"""Run under `mpiexec -n N python tests/gpt_worker.py OUT.pkl`: the transformer (`--model gpt`)
on every mesh of RUNS[N], each through train.run as the CLI runs it.

Rank 0 writes, per run: its configs, the losses, the validation loss, the samples, the whole
parameters (gathered over the mesh) and every rank's mesh coordinates, ledger peaks and
traffic; tests/test_gpt.py compares them with single-rank training and with the dry run.
A checkpoint case saves on one mesh and resumes on another (`SAVE_ON`, `RESUME_ON`).
"""

import pickle
import sys
from pathlib import Path

from fsdp_lesson.comm import Comm, gather_objects
from fsdp_lesson.config import ModelConfig, RunConfig, TrainConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.train import run, whole_params

MODEL = ModelConfig(model="gpt", layers=2)
COMMON = dict(steps=12, batch=24, eval_batches=2, samples=2)
SGD, ADAM = dict(optimizer="sgd"), dict(optimizer="adam")

# name: the mesh and strategy flags (TrainConfig fields, and Comm.world's collectives); the
# single run it is compared with has the same fields but the mesh's and the strategy's
RUNS = {
    4: {
        "dp": dict(strategy="dp"),
        "zero1-adam": dict(strategy="zero1", **ADAM),
        "zero2": dict(strategy="zero2"),
        "zero3-adam": dict(strategy="zero3", **ADAM),
        "zero3-ring": dict(strategy="zero3", collectives="ring"),
        "zero3-recompute-accum2": dict(strategy="zero3", recompute=True, accum=2),
        "zero3-bf16": dict(strategy="zero3", precision="bf16"),
        "zero3-clip": dict(strategy="zero3", clip_grad_norm=0.5),
        "tp2-zero3": dict(strategy="zero3", tp=2),
        "tp2-sp-zero2-adam": dict(strategy="zero2", tp=2, sequence_parallel=True, **ADAM),
        "tp4-sp": dict(strategy="single", tp=4, sequence_parallel=True),
        "pp2-1f1b-dp": dict(strategy="dp", pp=2, micro_batches=2, schedule="1f1b"),
        "cp2-zero3": dict(strategy="zero3", cp=2),
        "cp2-contiguous-zero2-adam": dict(strategy="zero2", cp=2, cp_layout="contiguous", **ADAM),
        "cp4-dp-ring": dict(strategy="dp", cp=4, collectives="ring"),
        "cp4": dict(strategy="single", cp=4),  # `--cp 4` alone: single averages over cp
        "tp2-cp2-zero3": dict(strategy="zero3", tp=2, cp=2),
        "tp2-cp2-sp-zero1": dict(strategy="zero1", tp=2, cp=2, sequence_parallel=True),
        # no evaluation and no sampling: every K/V send is a training step's (test_gpt counts them)
        "cp2-dp-counted": dict(strategy="dp", cp=2, eval_batches=0, samples=0),
        "cp2-zero3-recompute-counted": dict(
            strategy="zero3", cp=2, recompute=True, eval_batches=0, samples=0
        ),
        "cp2-pp2-zero3-recompute": dict(
            strategy="zero3", cp=2, pp=2, micro_batches=2, recompute=True
        ),
    },
    8: {
        "tp2-cp2-pp2-zero3": dict(strategy="zero3", tp=2, cp=2, pp=2, micro_batches=2),
        "tp2-sp-pp2-dp2-zero2-1f1b": dict(
            strategy="zero2", tp=2, pp=2, sequence_parallel=True, micro_batches=2, schedule="1f1b"
        ),
    },
}
# a checkpoint of this 4-rank run at step SAVE_AT resumes on RESUME_ON for the other steps
SAVE_ON, RESUME_ON, SAVE_AT = "tp2-cp2-zero3", "cp4-dp-ring", 6


def run_one(name: str, kwargs: dict, data: Dataset, rc: RunConfig) -> dict | None:
    kwargs = dict(kwargs)
    comm = Comm.world(kwargs.pop("collectives", "mpi"))  # fresh accounting per run
    config = TrainConfig(**(COMMON | kwargs))
    history, strategy = run(MODEL, config, rc, comm, data)
    params = whole_params(strategy)
    per_rank = gather_objects(
        comm,
        {
            "coords": strategy.mesh.coords,
            "peak": history.memory["peak"],
            "traffic": history.traffic,
        },
    )
    if comm.rank != 0:
        return None
    return {
        "train_config": config,
        "losses": history.losses,
        "val_loss": history.val_loss,
        "samples": history.samples,
        "params": params,
        "per_rank": per_rank,
        "resumed_from": history.resumed_from,
    }


def main(out: str) -> None:
    world, data, results = Comm.world(), Dataset.load(), {}
    for name, kwargs in RUNS[world.size].items():
        results[name] = run_one(name, kwargs, data, RunConfig())
    if world.size == 4:  # save on one mesh, resume on another, beside OUT (the test's tmp)
        checkpoint = Path(out).parent / "checkpoint"
        saved = RunConfig(save_every=SAVE_AT, checkpoint_dir=checkpoint)
        run_one("save", RUNS[4][SAVE_ON] | {"steps": SAVE_AT}, data, saved)
        resume = RunConfig(resume=checkpoint, reshard=True)
        results["resumed"] = run_one("resume", RUNS[4][RESUME_ON], data, resume)
    if world.rank == 0:
        with open(out, "wb") as f:
            pickle.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
