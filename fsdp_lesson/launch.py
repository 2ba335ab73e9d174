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

# A local run talks to nobody but itself, so its ranks listen on loopback only: a laptop on a
# classroom's Wi-Fi exposes nothing. Left alone, MPICH's default netmod (UCX) listens on every
# interface, and its other one (libfabric, MPIR_CVAR_CH4_NETMOD=ofi) on the first it finds.
# Not set for a job that spans hosts (`mpiexec -f hosts`, srun on several nodes), which needs
# the real interfaces, nor with FSDP_LESSON_ALL_INTERFACES=1 (README, "Running on more than one
# machine"). hydra's own control port (mpiexec's PMI server) cannot be bound here: hydra
# listens on all interfaces whatever -iface or HYDRA_IFACE say (they only choose the address
# it announces), for as long as mpiexec runs; mpiexec.gforker, in the same wheel, listens on
# nothing (docs/architecture.md, "Local runs listen on loopback").
LOOPBACK_ENV: dict[str, str] = {
    "UCX_NET_DEVICES": "lo",  # UCX: its tcp transport on the loopback device only
    "FI_PROVIDER": "tcp",  # libfabric: the tcp provider ...
    "FI_TCP_IFACE": "lo",  # ... on the loopback device
}
ALL_INTERFACES = "FSDP_LESSON_ALL_INTERFACES"  # 1: leave MPI's interfaces as MPI chooses
LOOPBACK_SET = "FSDP_LESSON_LOOPBACK"  # the LOOPBACK_ENV names a launch here set, comma-separated
RANK_ENV |= LOOPBACK_ENV | {LOOPBACK_SET: ",".join(LOOPBACK_ENV)}


def one_host(env: Mapping[str, str] = os.environ) -> bool | None:
    """Whether this process's MPI job runs on this host only, as its launcher announced it.

    True for a process that no launcher started (it is the launcher, or runs alone); False or
    True from hydra's, Open MPI's or Slurm's local rank count; None for a launcher that says
    nothing about hosts.
    """
    for local, size in [
        ("MPI_LOCALNRANKS", "PMI_SIZE"),  # MPICH's hydra
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "OMPI_COMM_WORLD_SIZE"),  # Open MPI
    ]:
        if local in env and size in env:
            return env[local] == env[size]
    for nodes in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES"):
        if nodes in env:
            return env[nodes] == "1"
    launched = ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "SLURM_PROCID")
    return None if any(name in env for name in launched) else True


def wants_all_interfaces(env: Mapping[str, str] = os.environ) -> bool:
    return env.get(ALL_INTERFACES, "").strip().lower() not in ("", "0", "no", "false")


def rank_settings(base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The launch settings of a rank: base's value where base has one.

    The loopback settings only where the job stays on this host (one_host) and the user has
    not asked for every interface; LOOPBACK_SET names those this call adds.
    """
    settings = {name: base.get(name, value) for name, value in RANK_ENV.items()}
    for name in (*LOOPBACK_ENV, LOOPBACK_SET):
        del settings[name]
    if one_host(base) is True and not wants_all_interfaces(base):
        added = [name for name in LOOPBACK_ENV if name not in base]
        settings |= {name: base.get(name, value) for name, value in LOOPBACK_ENV.items()}
        inherited = [n for n in base.get(LOOPBACK_SET, "").split(",") if n in LOOPBACK_ENV]
        settings[LOOPBACK_SET] = ",".join(n for n in LOOPBACK_ENV if n in added + inherited)
    return settings


def drop_inherited_loopback(env=os.environ) -> None:
    """Before MPI starts in a rank: if its job spans hosts, or FSDP_LESSON_ALL_INTERFACES is set,
    drop the loopback settings a launcher of this project passed on (a `python -m fsdp_lesson`
    process, or a test, that started `mpiexec -f hosts ...`), which would keep the ranks from
    reaching each other; values the user set stay."""
    if one_host(env) is not False and not wants_all_interfaces(env):
        return
    for name in env.get(LOOPBACK_SET, "").split(","):
        if name in LOOPBACK_ENV and env.get(name) == LOOPBACK_ENV[name]:
            del env[name]
    env.pop(LOOPBACK_SET, None)


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
