"""Run under mpiexec: pipeline parallelism (fsdp_lesson/pipeline.py) built by hand on a mesh.

mpiexec -n N python tests/pipeline_worker.py OUT.pkl
    every case of CASES on N ranks: Mesh.of(world, tp, pp), the Stage, the strategy over
    mesh.dp, K steps of pipeline_step on the rows train_loop would give this rank; rank 0
    writes the losses, the full parameters (gathered over dp, then over pp) and every rank's
    ledger peaks, traffic and last step's record
mpiexec -n N python tests/pipeline_worker.py raise|stop RANK STEP
    one pipeline run in which rank RANK raises RuntimeError (ended as the CLI ends it) or stops
    itself (SIGSTOP) in step STEP, with a 3 s timeout: every rank must end within seconds
"""

import os
import pickle
import signal
import sys
from dataclasses import asdict, dataclass

from fsdp_lesson.__main__ import abort_on_unforeseen
from fsdp_lesson.comm import Comm, gather_objects
from fsdp_lesson.config import ModelConfig, TrainConfig
from fsdp_lesson.data import Dataset, GlobalBatchSampler
from fsdp_lesson.memory import MemoryLedger
from fsdp_lesson.mesh import Mesh
from fsdp_lesson.model import MLP
from fsdp_lesson.optim import make_optimizer
from fsdp_lesson.pipeline import Stage, gather_stages, pipeline_step
from fsdp_lesson.rng import make_rng
from fsdp_lesson.strategies import make_strategy
from fsdp_lesson.tensor import megatron
from fsdp_lesson.watchdog import WHERE


@dataclass(frozen=True)
class Case:
    """One run: the mesh, the pipeline's settings, the strategy over dp, the model."""

    n: int
    pp: int
    micro_batches: int
    schedule: str = "gpipe"
    strategy: str = "single"
    optimizer: str = "sgd"
    layers: int = 1
    tp: int = 1
    collectives: str = "mpi"
    steps: int = 30
    batch: int = 24
    recompute: bool = False


CASES = {
    "p3-m1": Case(3, 3, 1),  # the C program's placement: emb | fc1 relu1 | fc2
    "p3-m4-1f1b": Case(3, 3, 4, "1f1b", steps=10),
    "p2-m4-gpipe": Case(2, 2, 4, "gpipe"),
    "p2-m4-1f1b": Case(2, 2, 4, "1f1b"),
    "p2-m4-1f1b-ring": Case(2, 2, 4, "1f1b", collectives="ring", steps=10),
    "p2-m4-gpipe-adam": Case(2, 2, 4, "gpipe", optimizer="adam"),
    "p2-m2-1f1b-layers2": Case(2, 2, 2, "1f1b", layers=2),
    **{
        f"p2-dp2-{strategy}-m2-{schedule}": Case(4, 2, 2, schedule, strategy, steps=20)
        for strategy in ("zero2", "zero3")
        for schedule in ("gpipe", "1f1b")
    },
    "p2-dp2-dp-m4-1f1b-ring": Case(4, 2, 4, "1f1b", "dp", collectives="ring", steps=5),
    "p2-dp2-zero3-m2-1f1b-recompute": Case(4, 2, 2, "1f1b", "zero3", steps=10, recompute=True),
    "tp2-p2-dp2-zero2-m2-gpipe": Case(8, 2, 2, "gpipe", "zero2", tp=2, steps=20),
    "tp2-p2-dp2-zero2-m2-1f1b": Case(8, 2, 2, "1f1b", "zero2", tp=2, steps=20),
}


def train_config(case: Case) -> TrainConfig:
    return TrainConfig(
        strategy=case.strategy,
        optimizer=case.optimizer,
        steps=case.steps,
        batch=case.batch,
        tp=case.tp,
        pp=case.pp,
        micro_batches=case.micro_batches,
        schedule=case.schedule,
        recompute=case.recompute,
    )


def build(case: Case, world: Comm):
    """The mesh, this rank's Stage and its strategy over mesh.dp, initialised as run() does."""
    tc = train_config(case)
    tc.validate(world.size)
    mesh = Mesh.of(world, tp=case.tp, pp=case.pp)
    stage = Stage(MLP(ModelConfig(layers=case.layers), megatron(mesh.tp)), case.pp, mesh.pp.rank)
    ledger = MemoryLedger(rank=world.rank)
    optimizer = make_optimizer(tc.optimizer, tc.lr)
    strategy = make_strategy(
        tc.strategy, stage, optimizer, mesh.dp, ledger, accum=case.micro_batches
    )
    rng = make_rng(tc.seed, tc.c_compat)
    strategy.init_params(rng)
    return mesh, stage, strategy, rng


def train_loop(case, mesh, stage, strategy, rng, data, failure=None) -> tuple[list, list]:
    """K steps on the rows train.train_loop gives this rank, each step told to the watchdog as
    the loop tells it (WHERE.step); the dp-mean losses and the last step's record."""
    sampler = GlobalBatchSampler(data.X_train, data.Y_train, case.batch, rng)
    losses, record = [], []
    for step in range(case.steps):
        WHERE.step = step
        X, Y = sampler.next_slice(mesh.dp.rank, mesh.dp.size)
        if failure is not None:
            failure(step)
        record.clear()
        loss = pipeline_step(
            stage,
            strategy,
            mesh.pp,
            X,
            Y,
            case.micro_batches,
            case.schedule,
            record,
            recompute=case.recompute,
        )
        losses.append(mesh.dp.mean_scalar(loss))
    return losses, list(record)


def run_case(case: Case, data: Dataset) -> dict | None:
    world = Comm.world(case.collectives)  # fresh accounting per case
    mesh, stage, strategy, rng = build(case, world)
    losses, record = train_loop(case, mesh, stage, strategy, rng, data)
    params = gather_stages(strategy.full_params(), mesh.pp)
    per_rank = gather_objects(
        world,
        {
            "stage": mesh.pp.rank,
            "dp_rank": mesh.dp.rank,
            "peak": dict(strategy.ledger.peak),
            "traffic": world.traffic_report(),
            "record": record,
        },
    )
    if world.rank == 0:
        return {"case": asdict(case), "losses": losses, "params": params, "per_rank": per_rank}
    return None


def fail(mode: str, failing_rank: int, failing_step: int) -> None:
    """One run in which a rank raises or stops in a step; the CLI's ending of an error."""
    case = Case(2, 2, 4, "1f1b", steps=1000)
    world = Comm.world(timeout=3.0)
    mesh, stage, strategy, rng = build(case, world)

    def failure(step: int) -> None:
        if world.rank == failing_rank and step == failing_step:
            if mode == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            raise RuntimeError("injected failure (a bug on one stage)")

    try:
        train_loop(case, mesh, stage, strategy, rng, Dataset.load(), failure)
    except RuntimeError as err:
        abort_on_unforeseen(err)


def main(args: list[str]) -> None:
    if args[0] in ("raise", "stop"):
        fail(args[0], int(args[1]), int(args[2]))
        return
    n, data, results = Comm.world().size, Dataset.load(), {}
    for name, case in CASES.items():
        if case.n == n:
            results[name] = run_case(case, data)
    if Comm.world().rank == 0:
        with open(args[0], "wb") as f:
            pickle.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1:])
