"""The watchdog: no collective waits forever.

A rank that is stopped, hung or gone would otherwise leave every other rank waiting in its next
collective for good. So every Comm (comm.py) is a WatchedComm: while one of its blocking calls
(or a Request's wait) runs, the process's watchdog thread (`Watchdog`) watches the clock, as
PyTorch's process groups watch their NCCL and gloo work. Past the communicator's `timeout` (the
CLI's --timeout) it prints one line naming the collective, the step and layer it was waiting in
and the ranks that have not arrived (each rank counts the collectives it has entered in shared
memory, `Arrivals`), and ends every rank with MPI_Abort, exit code 4 (`end_the_job`). A
point-to-point wait (a pipeline's send or recv) waits for one peer only, and its line names
that peer and what it is doing (`Peer`, `peer_timeout_message`). The calls stay the blocking,
buffer-based ones: the watch costs the hot path a shared-memory store, a tuple and a clock read
per call.

    WatchedComm      what the watchdog reads of a communicator, and its watched blocking call
    Peer             the one rank a point-to-point wait depends on (a pipeline's send or recv)
    Arrivals         how many collectives each rank has entered, in shared memory
    WHERE, in_phase  where the loop is (step, phase, layer), as the loop says
    timeout_message  the one line (peer_timeout_message: a point-to-point wait's)
    Watchdog         the daemon thread (WATCHDOG, one per process), and end_the_job
    BarrierAtExit    a watched barrier before MPI_Finalize, which cannot be watched

Nothing here imports comm.py: the watchdog only reads the communicators handed to it.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from time import monotonic

import numpy as np

# How long a rank may wait in one collective before it ends the job. Far above the longest wait
# a healthy run of this lesson has (a peer's start-up, data loading, checkpoint write or
# evaluation: seconds), and short enough that a stalled job on a cluster ends within minutes.
# PyTorch's defaults are 10 min (NCCL) and 30 min (gloo).
DEFAULT_TIMEOUT = 300.0
EXIT_TIMEOUT = 4  # the exit code of a job ended by a timed-out collective


class WatchedComm:
    """A communicator whose blocking calls the watchdog watches: comm.Comm's base.

    mpi is the mpi4py communicator (None: one rank, no MPI at all), MPI the mpi4py module,
    `timeout` the seconds one collective may wait, `name` a sub-communicator's name for the
    message, `arrivals` its ranks' counts of collectives entered (None without MPI).
    """

    def __init__(self, mpi_comm=None, timeout: float = DEFAULT_TIMEOUT) -> None:
        self.mpi = mpi_comm
        self.timeout = timeout  # seconds one collective may wait (see Watchdog)
        self.name = None  # a sub-communicator's name (Comm.split), for the timeout's message
        self.arrivals = None
        if mpi_comm is not None:
            from mpi4py import MPI

            self.MPI = MPI
            self.arrivals = Arrivals.of(mpi_comm, MPI)
            WATCHDOG.start()
        self.rank = 0 if mpi_comm is None else mpi_comm.Get_rank()
        self.size = 1 if mpi_comm is None else mpi_comm.Get_size()

    def _arrive(self) -> int:
        """This rank enters its next collective on this communicator; returns its number."""
        arrivals = self.arrivals
        arrivals.entered += 1
        if arrivals.table is not None:
            arrivals.table[arrivals.row, 0] = arrivals.entered
        return arrivals.entered

    def _blocking(self, kind: str, call, *args, **kwargs):
        """call(*args, **kwargs), one blocking collective, watched: past self.timeout the
        watchdog ends the job."""
        WATCHDOG.waiting = (self, kind, self._arrive(), monotonic())
        try:
            return call(*args, **kwargs)
        finally:
            WATCHDOG.waiting = None

    def _watched_p2p(self, kind: str, peer: int, call, *args):
        """call(*args), one blocking wait on rank `peer` of this communicator alone (a send or
        a recv), watched: past self.timeout the watchdog ends the job naming that peer."""
        WATCHDOG.waiting = (self, kind, Peer(peer), monotonic())
        try:
            return call(*args)
        finally:
            WATCHDOG.waiting = None


@dataclass(frozen=True)
class Peer:
    """What a point-to-point wait waits for: one rank of the communicator (not all of them, as
    a collective does), so a timeout names that rank and what it is doing."""

    rank: int  # in the communicator

    def world_rank(self, comm: WatchedComm) -> int:
        """The peer's rank in COMM_WORLD, as every message names ranks."""
        world = comm.MPI.COMM_WORLD.Get_group()
        group = comm.mpi.Get_group()
        rank = group.Translate_ranks([self.rank], world)[0]
        group.Free()
        world.Free()
        return rank


class Arrivals:
    """How many collectives each rank of one communicator has entered, in shared memory.

    One row per rank of the communicator on this host, (collectives entered, pid), in an MPI
    shared-memory window. A rank writes only its own row, once per collective (one store); a
    rank whose collective timed out reads the others' rows to say which have not arrived
    (PyTorch's desync report does the same through its store). Ranks on other hosts cannot be
    read: the message says so. Communicators share the object of their MPI communicator, so
    every Comm on COMM_WORLD counts in one place, as MPI orders their collectives. A last row
    holds 1 + the world rank that is reporting a timeout, so that the line comes once.
    """

    _world: Arrivals | None = None

    def __init__(self, mpi_comm, MPI) -> None:
        self.entered = 0  # collectives this rank has entered on the communicator
        self.size = mpi_comm.Get_size()
        self.table = None  # rows (entered, pid) of this host's ranks, or None: unavailable
        self.row, self.world_ranks, self.window = 0, [], None
        local = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED)
        group, whole = local.Get_group(), mpi_comm.Get_group()
        self.here = set(group.Translate_ranks(list(range(local.Get_size())), whole))
        whole.Free()  # `here`: the ranks of mpi_comm on this host (sharing its memory)
        try:
            n, self.row = local.Get_size(), local.Get_rank()
            nbytes = 16 * (n + 1) if self.row == 0 else 0
            self.window = MPI.Win.Allocate_shared(nbytes, 8, comm=local)
            buffer, _ = self.window.Shared_query(0)
            self.table = np.ndarray((n + 1, 2), dtype=np.int64, buffer=buffer)
            self.table[self.row] = (0, os.getpid())
            if self.row == 0:
                self.table[n] = (0, 0)  # nobody reports yet
            local.Barrier()  # every row written before anyone could read it
            world = MPI.COMM_WORLD.Get_group()
            self.world_ranks = group.Translate_ranks(list(range(n)), world)
            world.Free()
        except MPI.Exception:  # an MPI without shared windows: the message says less
            self.table = None
        group.Free()
        local.Free()

    @classmethod
    def of(cls, mpi_comm, MPI) -> Arrivals:
        """The Arrivals of mpi_comm: COMM_WORLD's made once per process (the notebooks make a
        Comm per run), a sub-communicator's with it."""
        if mpi_comm != MPI.COMM_WORLD:
            return cls(mpi_comm, MPI)
        if cls._world is None:
            cls._world = cls(mpi_comm, MPI)
        return cls._world

    def missing(self, entered: int) -> list[tuple[int, int]]:
        """(world rank, pid) of this host's ranks that have not yet entered collective
        number `entered`."""
        if self.table is None:
            return []
        rows = zip(self.world_ranks, self.table[:-1].copy(), strict=True)
        return [(r, int(pid)) for r, (n, pid) in rows if n < entered]

    def pids(self) -> list[tuple[int, int]]:
        """(world rank, pid) of this host's ranks."""
        if self.table is None:
            return []
        return list(zip(self.world_ranks, map(int, self.table[:-1, 1]), strict=True))

    def claim_report(self, rank: int) -> bool:
        """Whether this rank is the first on this host to report a timeout (and now it is).

        Ranks that time out together look one after another, 50 ms apart by their row, so
        that two rarely claim at once; without shared memory every rank reports.
        """
        if self.table is None:
            return True
        time.sleep(0.05 * self.row)
        if self.table[-1, 0]:
            return False
        self.table[-1, 0] = rank + 1
        return True


PROCESS_STATES = {"T": "stopped", "t": "stopped by a debugger", "Z": "exited", "X": "exited"}
PROCESS_STATES |= {"R": "running", "S": "sleeping", "D": "waiting for I/O"}


def process_state(pid: int) -> str:
    """What a local process is doing, from /proc (Linux): "stopped", "running", ..."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return PROCESS_STATES.get(stat.rsplit(")", 1)[1].split()[0], "alive")


class Whereabouts:
    """Where this process's loop is, as the loop itself says (as begin_phase tells a strategy):
    the training step, the phase it is in (evaluation, sampling, a checkpoint, ...) and the layer
    its passes are at. The watchdog reads it only when a collective has timed out."""

    def __init__(self) -> None:
        self.step: int | None = None  # train.train_loop's step, None outside the loop
        self.layer: str | None = None  # passes.forward/backward's layer, None between layers
        self.phases: list[str] = []  # in_phase's, innermost last

    def text(self) -> str:
        """ "of step 12 at layer fc1", "of the validation loss", "" if nothing was said."""
        phase = self.phases[-1] if self.phases else None
        if phase is None and self.step is not None:
            phase = f"step {self.step}"
        parts = (phase and f"of {phase}", self.layer and f"at layer {self.layer}")
        return " ".join(part for part in parts if part)


WHERE = Whereabouts()  # the process's: one loop runs at a time


def in_phase(phase: str) -> Callable:
    """Decorate a function whose collectives belong to `phase` ("the validation loss"): while
    it runs, a timed-out collective says so."""

    def decorate(function: Callable) -> Callable:
        @functools.wraps(function)
        def inside(*args, **kwargs):
            WHERE.phases.append(phase)
            try:
                return function(*args, **kwargs)
            finally:
                WHERE.phases.pop()

        return inside

    return decorate


def timeout_message(
    rank: int,
    what: str,
    where: str,
    waited: float,
    timeout: float,
    missing: list[tuple[int, str]],
    unknown: int,
    stopped: list[int] = (),
) -> str:
    """The one line a timed-out rank prints: the collective, where, and who has not arrived.

    missing: (world rank, state) of the ranks that have not entered the collective, among
    those it could read (this host's); unknown: how many other ranks it could not read (on
    other hosts, or all of them without shared memory); stopped: ranks that have entered it
    but are stopped (a non-blocking collective needs its ranks to make progress too), or
    stopped outside it (a pipeline: the rank that has not arrived waits on a stopped one).
    """
    head = f"rank {rank}: {what}" + (f" {where}" if where else "") + f" waited {waited:.0f} s"
    s = "s" if len(missing) > 1 else ""
    if missing:
        ranks = ", ".join(f"{r} ({state})" for r, state in missing)
        who = f"rank{s} {ranks} {'have' if s else 'has'} not arrived"
        if stopped:  # what a running rank that has not arrived may be waiting for
            s = "s" if len(stopped) > 1 else ""
            who += f"; rank{s} {', '.join(map(str, stopped))} {'are' if s else 'is'} stopped"
    elif stopped:
        who = f"every rank has arrived, but rank {', '.join(map(str, stopped))} is stopped"
    else:
        who = "every rank it can see has arrived"
    if unknown:
        who += f"; {unknown} rank{'s' if unknown > 1 else ''} on other hosts not checked"
    return f"{head}; {who}: every rank stops now (exit code {EXIT_TIMEOUT}, --timeout {timeout:g})"


def peer_timeout_message(
    rank: int,
    what: str,
    where: str,
    waited: float,
    timeout: float,
    peer: int,
    state: str | None,
    stopped: list[int] = (),
) -> str:
    """The one line of a timed-out point-to-point wait: what (e.g. "recv (pp) from rank 0"),
    where, and what the peer is doing (state None: on another host, not checked); stopped:
    other ranks of this host that are stopped, which a running peer may be waiting for (a
    pipeline's stage waits on the next, which waits on a stopped rank of its own stage)."""
    head = f"rank {rank}: {what}" + (f" {where}" if where else "") + f" waited {waited:.0f} s"
    missing = "sent it" if what.startswith("recv") else "received it"
    if state is None:
        who = f"rank {peer} (on another host, not checked) has not {missing}"
    else:
        who = f"rank {peer} ({state}) has not {missing}"
    if stopped:
        s = "s" if len(stopped) > 1 else ""
        who += f"; rank{s} {', '.join(map(str, stopped))} {'are' if s else 'is'} stopped"
    return f"{head}; {who}: every rank stops now (exit code {EXIT_TIMEOUT}, --timeout {timeout:g})"


class Watchdog:
    """The process's watchdog: a daemon thread that ends the job when a collective waits too long.

    The thread that calls a collective sets `waiting` = (comm, kind, number, start)
    for the duration of the blocking call and clears it after; the watchdog looks a few times a
    second, and once the call has waited longer than comm.timeout it prints one line
    (timeout_message) and calls MPI_Abort on COMM_WORLD, which makes the launcher (mpiexec, or
    the ipcluster's) end every rank, the stopped one included. As PyTorch's process groups do
    with their NCCL and gloo work (a watchdog thread, "Watchdog caught collective operation
    timeout"), except that here the whole job ends rather than the communicator. One thread
    waits at a time, as the training loop does.
    """

    period = 0.2  # seconds between looks: a timeout is noticed this much late at most

    def __init__(self) -> None:
        self.waiting: tuple | None = None
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def start(self) -> None:
        with self.lock:
            if self.thread is None:
                self.thread = threading.Thread(
                    target=self._watch, name="fsdp_lesson collective watchdog", daemon=True
                )
                self.thread.start()

    def _watch(self) -> None:
        while True:
            time.sleep(self.period)
            waiting = self.waiting
            if waiting is None:
                continue
            comm, kind, entered, since = waiting
            waited = monotonic() - since
            if waited > comm.timeout:
                end_the_job(comm, kind, entered, waited, WHERE.text())
                return


WATCHDOG = Watchdog()


def stopped_ranks(arrivals: Arrivals) -> list[tuple[int, int]]:
    """(world rank, pid) of this host's ranks that are stopped."""
    return [(r, pid) for r, pid in arrivals.pids() if process_state(pid).startswith("stopped")]


def end_the_job(
    comm: WatchedComm, kind: str, entered: int | Peer, waited: float, where: str
) -> None:
    """A collective (or a wait on one peer) waited longer than comm.timeout: one line on
    stderr, then MPI_Abort(4).

    The first rank of this host to time out says it (Arrivals.claim_report); the others, in
    the same or another collective waiting for the same stalled rank, stay silent and give it
    three seconds to end the job, so that the line comes once (once per host).
    """
    arrivals = comm.arrivals
    what = kind if comm.name is None else f"{kind} ({comm.name})"
    rank = comm.MPI.COMM_WORLD.Get_rank()
    if isinstance(entered, Peer):
        peer = entered.world_rank(comm)
        what += f" {'from' if kind == 'recv' else 'to'} rank {peer}"
        pid = dict(arrivals.pids()).get(peer)  # known when it runs on this host
        state = None if pid is None else process_state(pid)
        world = Arrivals._world or arrivals  # the stopped rank may be in no group of ours
        stopped = [r for r, _ in stopped_ranks(world) if r != peer]
        line = peer_timeout_message(rank, what, where, waited, comm.timeout, peer, state, stopped)
    else:
        missing = [(r, process_state(pid)) for r, pid in arrivals.missing(entered)]
        world = Arrivals._world or arrivals  # a stopped rank may be in no group of ours
        stopped = [r for r, _ in stopped_ranks(world) if r not in dict(missing)]
        readable = 1 if arrivals.table is None else len(arrivals.world_ranks)  # itself at least
        line = timeout_message(
            rank, what, where, waited, comm.timeout, missing, arrivals.size - readable, stopped
        )
    world = Arrivals._world or arrivals
    if world.claim_report(rank):
        os.write(2, (line + "\n").encode())
        time.sleep(0.5)  # let mpiexec pass the line on before MPI_Abort tears the job down
    else:  # another rank of this host says it and ends the job; should it not, this one does
        time.sleep(3.0)
    # MPICH's own "Abort(4) on node 0 ...: application called MPI_Abort" would only repeat it
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    # should MPI_Abort itself hang (a launcher that is gone), end this process anyway
    threading.Timer(10.0, os._exit, (EXIT_TIMEOUT,)).start()
    comm.MPI.COMM_WORLD.Abort(EXIT_TIMEOUT)
    os._exit(EXIT_TIMEOUT)


class BarrierAtExit:
    """At exit (atexit, while the watchdog still runs): a watched barrier of every rank.

    MPI_Finalize, which mpi4py calls after this, waits for every rank, and the watchdog cannot
    watch it (MPI is half gone inside it); so the ranks meet here first, on a communicator of
    their own (a duplicate of COMM_WORLD: its barrier cannot match another call), and a rank
    stalled after its last collective ends the job as in any other.
    """

    def __init__(self) -> None:
        self.comm: WatchedComm | None = None  # the barrier's own, made at the first register
        self.world: WatchedComm | None = None  # the newest world: its timeout holds at exit too

    def register(self, world: WatchedComm) -> None:
        """Comm.world() made `world`: the first time, make the barrier's communicator and have
        atexit call meet; every time, remember the newest world."""
        if self.comm is None:
            self.comm = WatchedComm(world.mpi.Dup())
            self.comm.name = "at exit"
            atexit.register(self.meet)
        self.world = world

    def meet(self) -> None:
        comm = self.comm
        if comm.MPI.Is_finalized():
            return
        comm.timeout = self.world.timeout
        comm._blocking("barrier", comm.mpi.Barrier)


BARRIER_AT_EXIT = BarrierAtExit()
