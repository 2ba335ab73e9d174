"""Run under mpiexec -n N: rank STOP stops itself before MPI_Init, the others train.

    mpiexec -n N python tests/startup_worker.py STOP train --strategy dp --timeout 5 ...

Rank STOP sends itself SIGSTOP before the CLI starts MPI; every other rank runs the CLI with
the flags after STOP and waits for it in MPI_Init, until the start-up watch (startup.py) ends
the job.
"""

import os
import signal
import sys

import fsdp_lesson.__main__ as cli  # as `python -m fsdp_lesson`
from fsdp_lesson.launch import launcher_rank_and_size

if launcher_rank_and_size()[0] == int(sys.argv[1]):
    os.kill(os.getpid(), signal.SIGSTOP)
sys.exit(cli.main(sys.argv[2:]))
