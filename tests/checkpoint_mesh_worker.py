"""Run under mpiexec: checkpoints saved by one mesh, resumed by another (issue 25).

    mpiexec -n N python tests/checkpoint_mesh_worker.py DIR    # the jobs of JOBS[N], in turn

Every run trains STEPS steps in all; a save stops at SAVE_AT. World rank 0 writes each run's
losses and whole parameters to DIR/NAME.npz (train.whole_params gathers pieces and stages).
"""

import sys
from pathlib import Path

import numpy as np

from fsdp_lesson.comm import Comm
from fsdp_lesson.config import ModelConfig, RunConfig, TrainConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.train import run, whole_params

STEPS, SAVE_AT = 8, 4
COMMON = dict(batch=24, eval_batches=0, samples=0)
A = dict(tp=2, strategy="zero3", optimizer="adam")  # N = 4: dp 2
B = dict(pp=2, micro_batches=2, strategy="zero1", optimizer="sgd")  # N = 4: dp 2
C = dict(tp=2, pp=2, micro_batches=2, strategy="zero2", optimizer="adam")  # N = 8: dp 2
H = dict(strategy="zero3", replicate=2, optimizer="adam")  # N = 4: HSDP, 2 groups of 2
# N -> (result name, settings, the checkpoint it saves or resumes): None saves no checkpoint
JOBS = {
    4: [
        ("A", A, "save A"),
        ("B", B, "save B"),
        ("A-straight", A, None),
        ("A-same", A, "resume A"),
        ("A2", A | dict(layers_per_unit=2), "save A2"),  # zero3's units of pieces
        ("H", H, "save H"),
        ("H-straight", H, None),
        ("H-same", H, "resume H"),
    ],
    8: [
        ("C", C, "save C"),
        ("A-to-tp2-pp2-dp2", C, "resume A"),
        ("A-to-hsdp", dict(strategy="zero3", replicate=4, optimizer="adam"), "resume A"),
    ],
    2: [
        ("A-to-dp2", dict(strategy="zero1", optimizer="adam"), "resume A"),
        ("B-to-tp2", dict(tp=2, optimizer="sgd"), "resume B"),
        ("C-to-zero3", dict(strategy="zero3", optimizer="adam"), "resume C"),
        ("P-to-tp2", dict(tp=2, optimizer="adam"), "resume P"),  # P: saved by single
        ("A2-to-units-of-3", A | dict(layers_per_unit=3), "resume A2"),  # tp 2, dp 1
        ("H-to-zero3", dict(strategy="zero3", optimizer="adam"), "resume H"),
    ],
}


def main(directory: str) -> None:
    root, data, world = Path(directory), Dataset.load(), Comm.world()
    for name, settings, checkpoint in JOBS[world.size]:
        action, source = (checkpoint or "run -").split()
        steps = SAVE_AT if action == "save" else STEPS
        config = TrainConfig(steps=steps, **COMMON | settings)
        if action == "save":
            rc = RunConfig(save_every=SAVE_AT, checkpoint_dir=root / source)
        elif action == "resume":
            rc = RunConfig(resume=root / source, reshard=True)
        else:
            rc = RunConfig()
        history, strategy = run(ModelConfig(), config, rc, world, data)
        params = whole_params(strategy)  # a collective: every rank takes part
        if world.rank == 0:
            flat = {f"{layer}.{k}": v for layer, p in params.items() for k, v in p.items()}
            np.savez(root / f"{name}.npz", losses=history.losses, **flat)


if __name__ == "__main__":
    main(sys.argv[1])
