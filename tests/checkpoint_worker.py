"""Run under mpiexec: save sharded checkpoints, or resume them into every strategy.

    mpiexec -n N python tests/checkpoint_worker.py save DIR      # each strategy: SAVE_AT steps,
                                                                 # save; and STEPS straight
    mpiexec -n M python tests/checkpoint_worker.py resume DIR    # every saved checkpoint into
                                                                 # every strategy at M ranks
Rank 0 writes the final full parameters and losses of each run to DIR/*.npz.
"""

import sys
from pathlib import Path

import numpy as np

from fsdp_lesson.comm import Comm
from fsdp_lesson.config import ModelConfig, RunConfig, TrainConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.train import run

STRATEGIES = ["dp", "zero1", "zero2", "zero3"]
CONFIG = dict(optimizer="adam", batch=24, eval_batches=2, samples=1)
SAVE_AT, STEPS = 15, 30  # a resharding mistake shows at the first step after SAVE_AT


def save_result(path: Path, history, strategy) -> None:
    params = strategy.full_params()  # a collective: every rank takes part
    if strategy.comm.rank == 0:
        flat = {f"{layer}.{k}": v for layer, p in params.items() for k, v in p.items()}
        np.savez(path, losses=history.losses, **flat)


def main(mode: str, directory: str) -> None:
    root, data = Path(directory), Dataset.load()
    n = Comm.world().size
    if mode == "save":
        for strategy in STRATEGIES:
            half = TrainConfig(strategy=strategy, steps=SAVE_AT, **CONFIG)
            run(
                ModelConfig(),
                half,
                RunConfig(save_every=SAVE_AT, checkpoint_dir=root / strategy),
                Comm.world(),
                data,
            )
            history, s = run(
                ModelConfig(),
                TrainConfig(strategy=strategy, steps=STEPS, **CONFIG),
                comm=Comm.world(),
                data=data,
            )
            save_result(root / f"straight-{strategy}-N{n}.npz", history, s)
    else:
        for source in STRATEGIES:
            for target in STRATEGIES:
                config = TrainConfig(strategy=target, steps=STEPS, **CONFIG)
                resume = RunConfig(resume=root / source, reshard=True)
                history, s = run(ModelConfig(), config, resume, Comm.world(), data)
                save_result(root / f"resumed-{source}-to-{target}-N{n}.npz", history, s)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
