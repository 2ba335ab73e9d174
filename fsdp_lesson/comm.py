"""Comm: the collectives the lesson uses, with each rank's traffic measured or counted.

Two ways to run them, chosen once per Comm:

- collectives="mpi" (the default): the MPI library's own Allreduce, Allgather, ... over mpi4py's
  buffer interface. How the library moves the bytes is its business: MPICH picks an algorithm
  by message size and N (for an allreduce recursive doubling or Rabenseifner's reduce-scatter +
  allgather, for an allgather recursive doubling, Bruck's or a ring), so the traffic is
  *counted*: the ring model applied to each call (docs/zero_formulas.md). For a full buffer of
  F bytes over N ranks a rank sends (N-1)/N * F in N-1 messages for an allgather or a
  reduce-scatter, 2(N-1)/N * F in 2(N-1) messages for an allreduce; a broadcast's N-1 messages
  of F bytes are shared by N ranks, (N-1)/N of a message and (N-1)/N * F per rank.
- collectives="ring": the rings of Sendrecv in ring.py, so the traffic is *measured*: the bytes
  and messages this rank really handed to MPI.

16-bit buffers (mixed precision, precision.py) move as 16 bits: half the bytes of float32.
MPI has no sum for bfloat16, so their reductions always run ring.py's algorithm with numpy
doing the adds (in mpi mode too, counted as before); allgathers and broadcasts only copy, so the
library moves their uint16 bits.

A Comm built without an MPI communicator is one rank and needs no MPI at all.

No collective waits forever (`timeout`, the CLI's --timeout): a rank that is stopped, hung or
gone would otherwise leave every other rank waiting in its next collective for good. While a
blocking call (or a Request's wait) runs, the process's watchdog thread (`Watchdog`) watches
the clock, as PyTorch's process groups watch their NCCL and gloo work; past the timeout it
prints one line naming the collective, the step and layer it was waiting in and the ranks that
have not arrived (each rank counts the collectives it has entered in shared memory,
`Arrivals`), and ends every rank with MPI_Abort, exit code 4. The calls stay the blocking,
buffer-based ones: the watch costs the hot path a shared-memory store, a tuple and a clock
read per call.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from time import monotonic, perf_counter

import numpy as np

from .ring import KINDS, Ring, Sent, on_wire

COLLECTIVES = ("mpi", "ring")
# How long a rank may wait in one collective before it ends the job. Far above the longest wait
# a healthy run of this lesson has (a peer's start-up, data loading, checkpoint write or
# evaluation: seconds), and short enough that a stalled job on a cluster ends within minutes.
# PyTorch's defaults are 10 min (NCCL) and 30 min (gloo).
DEFAULT_TIMEOUT = 300.0
EXIT_TIMEOUT = 4  # the exit code of a job ended by a timed-out collective
# messages and bytes a rank sends per call in the ring model, in units of (N-1) and (N-1)/N * F
RING_FACTOR = {"allreduce": 2, "allgather": 1, "reduce_scatter": 1, "bcast": 1}


@dataclass
class Traffic(Sent):
    """One collective kind's totals on this rank: `messages` and `sent_bytes` (from Sent: in
    ring mode what the ring sent, in mpi mode the ring model's count; a counted broadcast's
    messages are a per-rank mean, so a fraction), and:"""

    calls: int = 0
    buffer_bytes: int = 0  # bytes of the full buffers handed to the collective
    seconds: float = 0.0  # wall-clock time inside the calls


class Comm:
    """allreduce_mean, allgather, reduce_scatter_mean, bcast and barrier, each accounted."""

    _last_world: Comm | None = None  # the newest Comm.world(): its timeout holds at exit too
    _at_exit: Comm | None = None  # a duplicate of COMM_WORLD for the barrier at exit

    def __init__(
        self, mpi_comm=None, collectives: str = "mpi", timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        if collectives not in COLLECTIVES:
            raise ValueError(f"collectives={collectives!r}: use 'mpi' (the library's) or 'ring'")
        self.mpi = mpi_comm
        self.timeout = timeout  # seconds one collective may wait (see Watchdog)
        self.name = None  # a sub-communicator's name (split), for the timeout's message
        self.arrivals = None
        if mpi_comm is not None:
            from mpi4py import MPI

            self.MPI = MPI
            self.arrivals = Arrivals.of(mpi_comm, MPI)
            WATCHDOG.start()
        self.rank = 0 if mpi_comm is None else mpi_comm.Get_rank()
        self.size = n = 1 if mpi_comm is None else mpi_comm.Get_size()
        self.collectives = collectives
        self.traffic = {kind: Traffic() for kind in KINDS}
        self.trace = Trace()  # a step's spans, while recording (shared with split's children)
        # whether this rank's right neighbour on the ring runs on another host: then, in the
        # ring model, every byte this rank sends on this communicator crosses the network
        self.sends_between_hosts = n > 1 and (self.rank + 1) % n not in self.arrivals.here
        self.between_hosts = dict.fromkeys(self.traffic, self.sends_between_hosts)
        # ring mode: the ring adds what it sends straight into the Traffic records
        self.ring = Ring(mpi_comm, sent=self.traffic) if collectives == "ring" else None
        # mpi mode's 16-bit reductions: the ring summing in numpy (its own sends not recorded:
        # the call is counted by the ring model, as every call of mpi mode)
        self.numpy_ring = self.ring or Ring(mpi_comm)
        # mpi mode, per call: (RING_FACTOR * (N-1), messages); sent_bytes += that * F / N
        self._counted = {kind: (f * (n - 1), f * (n - 1)) for kind, f in RING_FACTOR.items()}
        self._counted["bcast"] = (n - 1, (n - 1) / n)
        self._scalar = np.zeros(1, dtype=np.float64)
        self._divisors: dict[np.dtype, np.generic] = {}  # N as a scalar of each dtype, made once

    @classmethod
    def world(cls, collectives: str = "mpi", timeout: float = DEFAULT_TIMEOUT) -> Comm:
        """All ranks of the MPI job (mpiexec or the ipcluster's MPI engines)."""
        from .launch import drop_inherited_loopback

        drop_inherited_loopback()  # a job across hosts needs their interfaces (launch.py)
        from mpi4py import MPI

        comm = cls(MPI.COMM_WORLD, collectives, timeout)
        if Comm._last_world is None:  # MPI_Finalize waits for every rank: a barrier, watched
            Comm._at_exit = cls(MPI.COMM_WORLD.Dup())  # its own: it cannot match another call
            Comm._at_exit.name = "at exit"
            atexit.register(_barrier_at_exit)
        Comm._last_world = comm
        return comm

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
        WATCHDOG.waiting = (self, kind, self._arrive(), monotonic(), threading.get_ident())
        try:
            return call(*args, **kwargs)
        finally:
            WATCHDOG.waiting = None

    def _divide(self, buf: np.ndarray) -> None:
        """buf /= N in buf's own precision: the sum over ranks becomes the mean."""
        divisor = self._divisors.get(buf.dtype)
        if divisor is None:
            divisor = self._divisors[buf.dtype] = buf.dtype.type(self.size)
        buf /= divisor

    def _account(
        self, kind: str, full_bytes: int, start: float, tag: str, issued: float | None = None
    ) -> None:
        """Add one call that began at perf_counter() == start to the kind's Traffic record;
        when tracing, its span "kind tag" from `issued` (a Request's) or start."""
        if self.trace.spans is not None:
            self.trace.record("comm", f"{kind} {tag}" if tag else kind, issued or start)
        t = self.traffic[kind]
        t.calls += 1
        t.buffer_bytes += full_bytes
        if self.ring is None:  # counted: the ring model; in ring mode the ring measured it
            factor, messages = self._counted[kind]
            t.sent_bytes += factor * full_bytes / self.size
            t.messages += messages
        t.seconds += perf_counter() - start

    def allreduce_mean(self, buf: np.ndarray, tag: str = "") -> np.ndarray:
        """buf <- the mean of buf over all ranks, in place; the same bits on every rank.
        `tag` (every collective's) names the call in a trace, e.g. the unit it moves."""
        if buf.size == 0:  # a layer without parameters moves nothing
            return buf
        start = perf_counter()
        if self.size > 1:
            if self.ring is not None or buf.dtype.itemsize == 2:
                self._blocking("allreduce", self.numpy_ring.allreduce, buf)
            else:
                self._blocking(
                    "allreduce", self.mpi.Allreduce, self.MPI.IN_PLACE, buf, op=self.MPI.SUM
                )
            self._divide(buf)
        self._account("allreduce", buf.nbytes, start, tag)
        return buf

    def mean_scalar(self, value: float) -> float:
        """The mean of a Python float over ranks (the logged loss); a float64 allreduce."""
        self._scalar[0] = value
        return float(self.allreduce_mean(self._scalar)[0])

    def allgather(self, shard: np.ndarray | None, full: np.ndarray, tag: str = "") -> np.ndarray:
        """full <- every rank's shard, concatenated in rank order (full.size == N * shard.size).

        shard=None works in place: this rank's slice of `full` already holds its shard.
        """
        if full.size == 0:  # a layer without parameters moves nothing
            return full
        start = perf_counter()
        if shard is not None and (self.ring is not None or self.size == 1):
            s = full.size // self.size
            full[self.rank * s : (self.rank + 1) * s] = shard  # the ring gathers in place
        if self.size > 1:
            if self.ring is not None:
                self._blocking("allgather", self.ring.allgather, full)
            else:
                send = self.MPI.IN_PLACE if shard is None else on_wire(shard)
                self._blocking("allgather", self.mpi.Allgather, send, on_wire(full))
        self._account("allgather", full.nbytes, start, tag)
        return full

    def reduce_scatter_mean(
        self, full: np.ndarray, shard: np.ndarray | None, tag: str = ""
    ) -> np.ndarray:
        """shard <- this rank's slice of the mean over ranks of `full` (Reduce_scatter_block).

        shard=None works in place: the result lands in full[:S] (MPI_IN_PLACE), returned.
        """
        in_place = shard is None
        if in_place:
            shard = full[: full.size // self.size]
        if full.size == 0:
            return shard
        start = perf_counter()
        if self.size == 1:
            if not in_place:
                shard[...] = full
        else:
            if self.ring is not None or full.dtype.itemsize == 2:
                self._blocking("reduce_scatter", self.numpy_ring.reduce_scatter, full, shard)
            else:
                send, recv = (self.MPI.IN_PLACE, full) if in_place else (full, shard)
                self._blocking(
                    "reduce_scatter", self.mpi.Reduce_scatter_block, send, recv, op=self.MPI.SUM
                )
            self._divide(shard)
        self._account("reduce_scatter", full.nbytes, start, tag)
        return shard

    def bcast(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        """buf <- root's buf, in place."""
        start = perf_counter()
        if self.size > 1:
            if self.ring is not None:
                self._blocking("bcast", self.ring.bcast, buf, root)
            else:
                self._blocking("bcast", self.mpi.Bcast, on_wire(buf), root=root)
        self._account("bcast", buf.nbytes, start, "")
        return buf

    def barrier(self) -> None:
        if self.mpi is not None:
            self._blocking("barrier", self.mpi.Barrier)

    def all_agree(self, ok: bool) -> bool:
        """True on every rank only if `ok` is true on every rank (the library's; not counted)."""
        if self.mpi is None:
            return ok
        flag = np.array([1 if ok else 0], dtype=np.int32)
        self._blocking("allreduce", self.mpi.Allreduce, self.MPI.IN_PLACE, flag, op=self.MPI.MIN)
        return bool(flag[0])

    def same_everywhere(self, array: np.ndarray) -> bool:
        """Whether `array` is bit-identical on every rank (compares sha256 digests; not counted)."""
        if self.mpi is None:
            return True
        digest = np.frombuffer(hashlib.sha256(np.ascontiguousarray(array)).digest(), np.uint8)
        digests = np.empty((self.size, digest.size), dtype=np.uint8)
        self._blocking("allgather", self.mpi.Allgather, digest, digests)
        return bool((digests == digests[0]).all())

    def allgather_objects(self, obj) -> list:
        """Every rank's obj as a list, on every rank; pickled, so only for rare small things."""
        return [obj] if self.mpi is None else self._blocking("allgather", self.mpi.allgather, obj)

    def ranks_on_this_host(self) -> int:
        """How many ranks of this job share this machine (and so its memory)."""
        if self.mpi is None:
            return 1
        local = self._blocking("split", self.mpi.Split_type, self.MPI.COMM_TYPE_SHARED)
        size = local.Get_size()
        local.Free()
        return size

    def gather_objects(self, obj) -> list | None:
        """Every rank's obj as a list on rank 0 (None elsewhere); pickled, so once per run only."""
        return [obj] if self.mpi is None else self._blocking("gather", self.mpi.gather, obj, root=0)

    def traffic_report(self) -> dict[str, dict]:
        """Per kind: calls, buffer_bytes, sent_bytes, messages, seconds, and how the bytes and
        messages were obtained: "measured" (ring mode) or "counted" (the ring model, mpi mode)."""
        how = "measured" if self.ring is not None else "counted"
        return {
            kind: asdict(t) | {"how": how, "between_hosts": self.between_hosts[kind]}
            for kind, t in self.traffic.items()
        }

    # --- non-blocking collectives and sub-communicators (dp's and zero3's overlap, HSDP) ---

    def iallreduce_mean(self, buf: np.ndarray, tag: str = "") -> Request:
        """Start buf <- the mean of buf over ranks, in place (MPI_Iallreduce); wait() ends it."""
        if self.ring is not None or self.size == 1 or buf.size == 0 or buf.dtype.itemsize == 2:
            return Request.done(self, lambda: self.allreduce_mean(buf, tag))
        entered = self._arrive()
        started = self.mpi.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        return Request(self, "allreduce", buf.nbytes, started, buf, entered, tag)

    def iallgather(self, shard: np.ndarray, full: np.ndarray, tag: str = "") -> Request:
        """Start full <- every rank's shard (MPI_Iallgather); the Request's wait() completes it."""
        if self.ring is not None or self.size == 1 or full.size == 0:
            return Request.done(self, lambda: self.allgather(shard, full, tag))
        entered = self._arrive()
        started = self.mpi.Iallgather(on_wire(shard), on_wire(full))
        return Request(self, "allgather", full.nbytes, started, None, entered, tag)

    def ireduce_scatter_mean(self, full: np.ndarray, shard: np.ndarray, tag: str = "") -> Request:
        """Start shard <- this rank's slice of the mean of `full` (MPI_Ireduce_scatter_block)."""
        if self.ring is not None or self.size == 1 or full.size == 0 or full.dtype.itemsize == 2:
            return Request.done(self, lambda: self.reduce_scatter_mean(full, shard, tag))
        entered = self._arrive()
        started = self.mpi.Ireduce_scatter_block(full, shard, op=self.MPI.SUM)
        return Request(self, "reduce_scatter", full.nbytes, started, shard, entered, tag)

    def split(self, color: int, key: int, name: str) -> Comm:
        """The ranks with the same color, ordered by key (MPI_Comm_split), as a counted Comm.

        Its traffic shows in this Comm's report as "<kind> (<name>)", e.g. "allgather (shard)".
        """
        mpi = None if self.mpi is None else self._blocking("split", self.mpi.Split, color, key)
        child = Comm(mpi, self.collectives, self.timeout)
        child.name, child.trace = name, self.trace
        for kind, traffic in child.traffic.items():
            self.traffic[f"{kind} ({name})"] = traffic  # the same object: one count, two views
            self.between_hosts[f"{kind} ({name})"] = child.sends_between_hosts
        return child


def bytes_between_hosts(traffic_report: dict[str, dict]) -> float:
    """The bytes of one rank's report that went to a rank on another host: its sends on every
    communicator whose right ring neighbour is elsewhere (measured in ring mode, counted by the
    ring model in mpi mode, where the library may route them otherwise)."""
    return sum(t["sent_bytes"] for t in traffic_report.values() if t.get("between_hosts"))


class Trace:
    """One step's spans (lane, what, start, end) in perf_counter seconds, while `spans` is a
    list: every collective of a Comm and its split children ("comm", "allgather fc1"), from
    its issue to its completion, and what else records itself (zero3's units: "compute")."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, str, float, float]] | None = None

    def record(self, lane: str, what: str, start: float | None) -> None:
        """A span from `start` to now, when recording (and `start` is known)."""
        if self.spans is not None and start is not None:
            self.spans.append((lane, what, start, perf_counter()))


class Request:
    """A collective in flight: wait() completes it (dividing for a mean) and counts it.

    The seconds counted are those spent blocked in wait(); `issued` and `completed` are the
    wall-clock span a timeline draws. The ring and a one-rank Comm run the collective at once
    (Request.done): the ring's Sendrecv calls block.
    """

    def __init__(
        self,
        comm: Comm,
        kind: str,
        nbytes: int,
        mpi_request,
        mean_into,
        entered: int = 0,
        tag: str = "",
    ) -> None:
        self.comm, self.kind, self.nbytes, self.tag = comm, kind, nbytes, tag
        self.mpi_request, self.mean_into = mpi_request, mean_into
        self.entered = entered  # its number among the communicator's collectives (Arrivals)
        self.issued, self.completed = perf_counter(), None

    @classmethod
    def done(cls, comm: Comm, collective) -> Request:
        """A request whose collective ran to completion right here (and was counted there)."""
        request = cls(comm, "", 0, None, None)
        collective()
        request.completed = perf_counter()
        return request

    def test(self) -> bool:
        """Let MPI progress the collective (MPI_Test); True once it is complete."""
        return self.mpi_request is None or self.mpi_request.Test()

    def wait(self) -> None:
        if self.completed is not None:
            return
        start = perf_counter()
        # watched as a blocking call is: past the Comm's timeout the watchdog ends the job
        WATCHDOG.waiting = (self.comm, self.kind, self.entered, monotonic(), threading.get_ident())
        try:
            self.mpi_request.Wait()
        finally:
            WATCHDOG.waiting = None
        if self.mean_into is not None:
            self.comm._divide(self.mean_into)
        self.comm._account(self.kind, self.nbytes, start, self.tag, self.issued)
        self.completed = perf_counter()


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


# the functions whose frames say where a waiting rank was (read on a timeout only)
STRATEGIES_DIR = str(Path(__file__).parent / "strategies")
PHASES = {
    "evaluate": "the validation loss",
    "sample_name": "sampling",
    "save_checkpoint": "a checkpoint save",
    "load_checkpoint": "a checkpoint load",
    "check_replicas": "the replicas' check",
    "full_params": "the final gather",
}


def whereabouts(frame) -> str:
    """Where the waiting thread was, from its stack: "of step 12 at layer fc1", "" if unknown.

    Read only when a collective has timed out, so the hot path pays nothing for it: the layer
    is the innermost `layer` or `unit` of a strategy's hook (its argument), the phase the
    innermost function of PHASES, else the training loop's step (train.train_loop's `step`).
    """
    layer = phase = None
    while frame is not None:
        name, local = frame.f_code.co_name, frame.f_locals
        if layer is None and STRATEGIES_DIR in frame.f_code.co_filename:
            for key in ("unit", "layer"):
                label = getattr(local.get(key), "name", None)
                if isinstance(label, str):
                    layer = label
                    break
        if phase is None and name in PHASES:
            phase = PHASES[name]
        if phase is None and name == "train_loop" and isinstance(local.get("step"), int):
            phase = f"step {local['step']}"
        frame = frame.f_back
    return " ".join(
        part for part in (phase and f"of {phase}", layer and f"at layer {layer}") if part
    )


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
    but are stopped (a non-blocking collective needs its ranks to make progress too).
    """
    head = f"rank {rank}: {what}" + (f" {where}" if where else "") + f" waited {waited:.0f} s"
    s = "s" if len(missing) > 1 else ""
    if missing:
        ranks = ", ".join(f"{r} ({state})" for r, state in missing)
        who = f"rank{s} {ranks} {'have' if s else 'has'} not arrived"
    elif stopped:
        who = f"every rank has arrived, but rank {', '.join(map(str, stopped))} is stopped"
    else:
        who = "every rank it can see has arrived"
    if unknown:
        who += f"; {unknown} rank{'s' if unknown > 1 else ''} on other hosts not checked"
    return f"{head}; {who}: every rank stops now (exit code {EXIT_TIMEOUT}, --timeout {timeout:g})"


class Watchdog:
    """The process's watchdog: a daemon thread that ends the job when a collective waits too long.

    The thread that calls a collective sets `waiting` = (comm, kind, number, start, thread id)
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
            comm, kind, entered, since, thread = waiting
            waited = monotonic() - since
            if waited > comm.timeout:
                frame = sys._current_frames().get(thread)
                end_the_job(comm, kind, entered, waited, whereabouts(frame))
                return


WATCHDOG = Watchdog()


def _barrier_at_exit() -> None:
    """At exit (atexit, while the watchdog still runs): a watched barrier of every rank.

    MPI_Finalize, which mpi4py calls after this, waits for every rank, and the watchdog cannot
    watch it (MPI is half gone inside it); so the ranks meet here first, on a communicator of
    their own, and a rank stalled after its last collective ends the job as in any other.
    """
    comm = Comm._at_exit
    if comm.MPI.Is_finalized():
        return
    comm.timeout = Comm._last_world.timeout
    comm.barrier()


def end_the_job(comm: Comm, kind: str, entered: int, waited: float, where: str) -> None:
    """A collective waited longer than comm.timeout: one line on stderr, then MPI_Abort(4).

    The first rank of this host to time out says it (Arrivals.claim_report); the others, in
    the same or another collective waiting for the same stalled rank, stay silent and give it
    three seconds to end the job, so that the line comes once (once per host).
    """
    arrivals = comm.arrivals
    what = kind if comm.name is None else f"{kind} ({comm.name})"
    missing = [(r, process_state(pid)) for r, pid in arrivals.missing(entered)]
    stopped = []
    if not missing:
        stopped = [r for r, pid in arrivals.pids() if process_state(pid).startswith("stopped")]
    readable = 1 if arrivals.table is None else len(arrivals.world_ranks)  # itself at least
    rank = comm.MPI.COMM_WORLD.Get_rank()
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


def together(comm: Comm, work, refusals: tuple[type[Exception], ...]):
    """Run work() on every rank; if it raises one of `refusals` on any rank, raise it on all.

    Without this, a rank that refuses alone (a file missing on one host, a full disk) would
    leave the others waiting forever in their next collective. The message names the ranks
    when not all of them refused.
    """
    try:
        result, problem = work(), None
    except refusals as err:
        result, problem = None, (type(err).__name__, str(err))
    problems = comm.allgather_objects(problem)
    failed = [p for p in problems if p is not None]
    if not failed:
        return result
    lines = []
    for kind, text in dict.fromkeys(failed):
        ranks = [r for r, p in enumerate(problems) if p == (kind, text)]
        where = "" if len(ranks) == len(problems) else f" (on rank {', '.join(map(str, ranks))})"
        lines.append(text + where)
    raise {cls.__name__: cls for cls in refusals}[failed[0][0]]("\n".join(lines))
