"""Run under mpiexec -n 2: rank 0 enters MPI_Init while rank 1 has not started it yet.

    mpiexec -n 2 python tests/limits_worker.py MARKER

Rank 0 writes its pid to MARKER just before it initialises MPI the way the CLI does
(`start_mpi`), then waits there for rank 1, which sleeps first: the test sends rank 0 a SIGTERM
while it waits inside MPI_Init, and rank 0 must end at once.
"""

import os
import sys
import time
from pathlib import Path

import fsdp_lesson.__main__ as cli  # as `python -m fsdp_lesson`: the one-line signal handlers
from fsdp_lesson.launch import launcher_rank_and_size

rank = launcher_rank_and_size()[0]
if rank == 1:
    time.sleep(60)  # rank 0 waits for it in MPI_Init; the test ends the job long before
else:
    Path(sys.argv[1]).write_text(str(os.getpid()))
cli.start_mpi()
