"""The environment every rank of this project is launched with, and why: one place.

The launchers (`make run/test/lab` through tools/lesson.py, the cluster `connect()` starts,
tools/execute_notebooks.py, the tests' mpiexec, and `python -m fsdp_lesson` for itself) start
ranks with `rank_settings()`. Each setting must be in the environment before the rank's numpy
or MPI loads (both read it once, at load), which is why it is set by whoever starts the
process, not when this package is imported. A value the user already set wins.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Mapping

RANK_ENV: dict[str, str] = {
    # The lesson's matrices are small and every core already runs a rank: BLAS threads would
    # only add overhead and fight the ranks for the cores.
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    # mpi4py's default, said here because it is what lets a waiting rank give way when there
    # are more ranks than cores (4 ranks on a 2-core laptop, `make test`'s 4 engines): at
    # MPI_THREAD_MULTIPLE, MPICH's wait loop releases its lock and yields the core between
    # polls; at MPI_THREAD_SINGLE (the C programs' level) it spins. MPICH's heavy yield
    # (MPIR_CVAR_ENABLE_HEAVY_YIELD=1, a ~50 us sleep per poll) is left off: it made 4 ranks on
    # 2 cores 2.4x slower on a quiet machine (benchmarks/bench_oversubscribed.py measures all
    # three; README, "More ranks than cores").
    "MPI4PY_RC_THREAD_LEVEL": "multiple",
}


def rank_settings(base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The launch settings of a rank: base's value where base has one."""
    return {name: base.get(name, value) for name, value in RANK_ENV.items()}


def rank_env(base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The whole environment to launch ranks with: base plus rank_settings()."""
    return {**base, **rank_settings(base)}


def launcher_rank_and_size() -> tuple[int, int]:
    """This process's rank and the job's size as the MPI launcher announced them, before MPI starts.

    Bad flags are caught before MPI starts, and only rank 0 should say so.
    """
    for rank_var, size_var in [
        ("PMI_RANK", "PMI_SIZE"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMIX_RANK", "PMIX_SIZE"),
        ("SLURM_PROCID", "SLURM_NTASKS"),
    ]:
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def end_every_rank_on_interrupt(rank: int) -> None:
    """One Ctrl-C (or SIGTERM) ends this rank at once, with one line from rank 0.

    mpiexec passes Ctrl-C on to every rank, but a rank busy inside an MPI call would raise
    KeyboardInterrupt only after the call returns, which it never does once another rank has
    stopped. So the signal wakes a thread instead (signal.set_wakeup_fd), which exits the
    process while the main thread may still be inside MPI (mpi4py releases the GIL there).
    """
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)  # the wakeup fd is written only with a handler set
    signal.set_wakeup_fd(write_end)

    def exit_now() -> None:
        signum = os.read(read_end, 1)[0]
        if rank == 0:
            what = "interrupted (Ctrl-C)" if signum == signal.SIGINT else "terminated"
            os.write(2, f"{what}: every rank stops; nothing more is written\n".encode())
        os._exit(128 + signum)

    threading.Thread(target=exit_now, daemon=True).start()
