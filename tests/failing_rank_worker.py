"""Run under mpiexec: the real CLI, with a failure on one rank only.

mpiexec -n N python tests/failing_rank_worker.py raise RANK STEP [train flags ...]
    rank RANK raises RuntimeError in its STEPth training step, while the others go on
    into that step's collectives: the CLI must end every rank within seconds
mpiexec -n N python tests/failing_rank_worker.py full-disk RANK 0 [train flags ...]
    rank RANK may write files of at most 4 KB (RLIMIT_FSIZE, as on a full disk), so its
    checkpoint shard fails with a real OSError: every rank must report it and exit 2
"""

import resource
import sys

from mpi4py import MPI

import fsdp_lesson.train as train
from fsdp_lesson.__main__ import main

mode, failing_rank, failing_step = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
rank = MPI.COMM_WORLD.Get_rank()  # MPI is up before any limit: its own files are written

if mode == "full-disk" and rank == failing_rank:
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
elif mode == "raise":
    training_step, steps = train.training_step, [0]

    def flaky_training_step(stage, strategy, X, Y, *args):
        steps[0] += 1
        if rank == failing_rank and steps[0] == failing_step:
            raise RuntimeError("injected failure (a bug on one rank)")
        return training_step(stage, strategy, X, Y, *args)

    train.training_step = flaky_training_step
sys.exit(main(["train", *sys.argv[4:]]))
