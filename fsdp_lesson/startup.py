"""The watch over MPI_Init: a rank that never starts ends the job within --timeout, named.

MPI_Init waits for every rank of the job, holding the GIL (mpi4py calls it as it is imported),
so neither the collective watchdog (watchdog.py: it watches collectives, which come later) nor
any Python thread of the rank can run while it waits. A rank stopped before it reaches MPI_Init
therefore left the others spinning in it for good. So just before MPI_Init a rank forks a
watcher, a copy of itself that touches no MPI:

    the rank      installs libc's _exit as its C-level SIGILL handler (no Python, no GIL
                  needed: signal number 4 is the exit code, EXIT_TIMEOUT), then enters
                  MPI_Init; once it returns it closes the pipe to the watcher and restores
                  SIGILL
    the watcher   waits on that pipe for --timeout seconds; past them it reads this host's
                  ranks from /proc (the rank's launcher's children and their PMI_RANK),
                  prints one line naming the stopped ones (the lowest rank not stopped
                  prints it), and ends the job as MPI_Abort(4) would: PMI's abort command on
                  the rank's PMI connection, so mpiexec ends every rank, the stopped one too,
                  and exits with code 4 (a launcher that does not act on it: SIGILL, and the
                  rank's handler _exit(4)s).

The watcher ends with its rank (the pipe closes when the rank exits) and leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import time
from collections.abc import Iterator
from pathlib import Path

from .watchdog import EXIT_TIMEOUT, process_state, timeout_message

NOT_STARTED = ("stopped", "stopped by a debugger", "exited", "gone")


def exit_on_sigill() -> bool:
    """Make SIGILL end this process with exit code 4 from C (libc's _exit(signum)): a handler
    that runs while MPI_Init holds the GIL. False where that cannot be done here."""
    if signal.SIGILL != EXIT_TIMEOUT:  # POSIX numbers SIGILL 4 on every platform MPICH runs on
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.signal.restype = ctypes.c_void_p
        libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
        handler = ctypes.cast(libc._exit, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return False
    return libc.signal(signal.SIGILL, handler) != ctypes.c_void_p(-1).value


def launcher_ranks(rank_pid: int) -> dict[int, int]:
    """{world rank: pid} of the ranks this host's launcher started (the rank's siblings, their
    PMI_RANK read from /proc); {} where /proc says nothing."""
    try:
        launcher = Path(f"/proc/{rank_pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return {}
    ranks = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[1] != launcher:
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
            found = [v for v in environ if v.startswith(b"PMI_RANK=")]
            if found and int(entry.name) != os.getpid():  # not the watcher itself
                ranks[int(found[0].split(b"=", 1)[1])] = int(entry.name)
    return ranks


def report(rank: int, size: int, rank_pid: int, waited: float, timeout: float) -> bool:
    """Print the one line, from the lowest rank of this host that is not itself stopped;
    whether this rank printed it."""
    local = launcher_ranks(rank_pid)
    states = {r: process_state(pid) for r, pid in sorted(local.items())}
    missing = [(r, state) for r, state in states.items() if state in NOT_STARTED]
    waiting = [r for r in states if r not in dict(missing)] or [rank]
    if rank != min(waiting):
        return False
    unknown = max(size - max(len(local), 1), 0)
    line = timeout_message(rank, "MPI_Init", "", waited, timeout, missing, unknown)
    os.write(2, (line + "\n").encode())
    return True


def end_the_start(rank_pid: int) -> None:
    """End the job from the watcher, as MPI_Abort(4) would: PMI's own abort command on the
    rank's PMI connection (hydra's PMI_FD, which the watcher inherited), so mpiexec ends every
    rank, the stopped ones too, and exits with code 4 and no more lines. A launcher without it
    (or one that does not act in 3 s): SIGILL makes the rank _exit(4) (exit_on_sigill)."""
    with contextlib.suppress(OSError, KeyError, ValueError):
        os.write(int(os.environ["PMI_FD"]), f"cmd=abort exitcode={EXIT_TIMEOUT}\n".encode())
        time.sleep(3.0)
    with contextlib.suppress(OSError):
        os.kill(rank_pid, signal.SIGILL)


@contextlib.contextmanager
def watched_start(rank: int, size: int, timeout: float) -> Iterator[None]:
    """Run the body (MPI_Init) under the watch: past `timeout` seconds the job ends, exit
    code 4, with one line naming the ranks that have not started. One rank: no watch."""
    if size < 2 or not exit_on_sigill():
        yield
        return
    read_end, write_end = os.pipe()
    rank_pid, start = os.getpid(), time.monotonic()
    watcher = os.fork()
    if watcher == 0:  # the watcher: no MPI, no Python exit handlers
        os.close(write_end)
        ready, _, _ = select.select([read_end], [], [], timeout)
        if not ready:
            said = False
            with contextlib.suppress(Exception):
                said = report(rank, size, rank_pid, time.monotonic() - start, timeout)
            # the rank that said it ends the job, once mpiexec has passed the line on; should
            # it not, the others do
            time.sleep(0.5 if said else 3.0)
            end_the_start(rank_pid)
        os._exit(0)
    os.close(read_end)
    try:
        yield
    finally:
        os.close(write_end)  # the watcher sees the pipe close, and ends
        with contextlib.suppress(ChildProcessError):
            os.waitpid(watcher, 0)
        signal.signal(signal.SIGILL, signal.SIG_DFL)
