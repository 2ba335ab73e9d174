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
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from time import perf_counter

import numpy as np

from .ring import KINDS, Ring, Sent, on_wire

COLLECTIVES = ("mpi", "ring")
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

    def __init__(self, mpi_comm=None, collectives: str = "mpi") -> None:
        if collectives not in COLLECTIVES:
            raise ValueError(f"collectives={collectives!r}: use 'mpi' (the library's) or 'ring'")
        self.mpi = mpi_comm
        if mpi_comm is not None:
            from mpi4py import MPI

            self.MPI = MPI
        self.rank = 0 if mpi_comm is None else mpi_comm.Get_rank()
        self.size = n = 1 if mpi_comm is None else mpi_comm.Get_size()
        self.collectives = collectives
        self.traffic = {kind: Traffic() for kind in KINDS}
        # ring mode: the ring adds what it sends straight into the Traffic records
        self.ring = Ring(mpi_comm, sent=self.traffic) if collectives == "ring" else None
        # mpi mode's 16-bit reductions: the ring summing in numpy (its own sends not recorded:
        # the call is counted by the ring model, as every call of mpi mode)
        self.summing = self.ring or Ring(mpi_comm)
        # mpi mode, per call: (RING_FACTOR * (N-1), messages); sent_bytes += that * F / N
        self._counted = {kind: (f * (n - 1), f * (n - 1)) for kind, f in RING_FACTOR.items()}
        self._counted["bcast"] = (n - 1, (n - 1) / n)
        self._scalar = np.zeros(1, dtype=np.float64)
        self._divisors: dict[np.dtype, np.generic] = {}  # N as a scalar of each dtype, made once

    @classmethod
    def world(cls, collectives: str = "mpi") -> Comm:
        """All ranks of the MPI job (mpiexec or the ipcluster's MPI engines)."""
        from mpi4py import MPI

        return cls(MPI.COMM_WORLD, collectives)

    def _divide(self, buf: np.ndarray) -> None:
        """buf /= N in buf's own precision: the sum over ranks becomes the mean."""
        divisor = self._divisors.get(buf.dtype)
        if divisor is None:
            divisor = self._divisors[buf.dtype] = buf.dtype.type(self.size)
        buf /= divisor

    def _account(self, kind: str, full_bytes: int, start: float) -> None:
        """Add one call that began at perf_counter() == start to the kind's Traffic record."""
        t = self.traffic[kind]
        t.calls += 1
        t.buffer_bytes += full_bytes
        if self.ring is None:  # counted: the ring model; in ring mode the ring measured it
            factor, messages = self._counted[kind]
            t.sent_bytes += factor * full_bytes / self.size
            t.messages += messages
        t.seconds += perf_counter() - start

    def allreduce_mean(self, buf: np.ndarray) -> np.ndarray:
        """buf <- the mean of buf over all ranks, in place; the same bits on every rank."""
        if buf.size == 0:  # a layer without parameters moves nothing
            return buf
        start = perf_counter()
        if self.size > 1:
            if self.ring is not None or buf.dtype.itemsize == 2:
                self.summing.allreduce(buf)
            else:
                self.mpi.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
            self._divide(buf)
        self._account("allreduce", buf.nbytes, start)
        return buf

    def mean_scalar(self, value: float) -> float:
        """The mean of a Python float over ranks (the logged loss); a float64 allreduce."""
        self._scalar[0] = value
        return float(self.allreduce_mean(self._scalar)[0])

    def allgather(self, shard: np.ndarray | None, full: np.ndarray) -> np.ndarray:
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
                self.ring.allgather(full)
            else:
                send = self.MPI.IN_PLACE if shard is None else on_wire(shard)
                self.mpi.Allgather(send, on_wire(full))
        self._account("allgather", full.nbytes, start)
        return full

    def reduce_scatter_mean(self, full: np.ndarray, shard: np.ndarray | None) -> np.ndarray:
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
                self.summing.reduce_scatter(full, shard)
            else:
                send, recv = (self.MPI.IN_PLACE, full) if in_place else (full, shard)
                self.mpi.Reduce_scatter_block(send, recv, op=self.MPI.SUM)
            self._divide(shard)
        self._account("reduce_scatter", full.nbytes, start)
        return shard

    def bcast(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        """buf <- root's buf, in place."""
        start = perf_counter()
        if self.size > 1:
            if self.ring is not None:
                self.ring.bcast(buf, root)
            else:
                self.mpi.Bcast(on_wire(buf), root=root)
        self._account("bcast", buf.nbytes, start)
        return buf

    def barrier(self) -> None:
        if self.mpi is not None:
            self.mpi.Barrier()

    def all_agree(self, ok: bool) -> bool:
        """True on every rank only if `ok` is true on every rank (the library's; not counted)."""
        if self.mpi is None:
            return ok
        flag = np.array([1 if ok else 0], dtype=np.int32)
        self.mpi.Allreduce(self.MPI.IN_PLACE, flag, op=self.MPI.MIN)
        return bool(flag[0])

    def same_everywhere(self, array: np.ndarray) -> bool:
        """Whether `array` is bit-identical on every rank (compares sha256 digests; not counted)."""
        if self.mpi is None:
            return True
        digest = np.frombuffer(hashlib.sha256(np.ascontiguousarray(array)).digest(), np.uint8)
        digests = np.empty((self.size, digest.size), dtype=np.uint8)
        self.mpi.Allgather(digest, digests)
        return bool((digests == digests[0]).all())

    def allgather_objects(self, obj) -> list:
        """Every rank's obj as a list, on every rank; pickled, so only for rare small things."""
        return [obj] if self.mpi is None else self.mpi.allgather(obj)

    def ranks_on_this_host(self) -> int:
        """How many ranks of this job share this machine (and so its memory)."""
        if self.mpi is None:
            return 1
        local = self.mpi.Split_type(self.MPI.COMM_TYPE_SHARED)
        size = local.Get_size()
        local.Free()
        return size

    def gather_objects(self, obj) -> list | None:
        """Every rank's obj as a list on rank 0 (None elsewhere); pickled, so once per run only."""
        return [obj] if self.mpi is None else self.mpi.gather(obj, root=0)

    def traffic_report(self) -> dict[str, dict]:
        """Per kind: calls, buffer_bytes, sent_bytes, messages, seconds, and how the bytes and
        messages were obtained: "measured" (ring mode) or "counted" (the ring model, mpi mode)."""
        how = "measured" if self.ring is not None else "counted"
        return {kind: asdict(t) | {"how": how} for kind, t in self.traffic.items()}

    # --- non-blocking collectives and sub-communicators (dp's and zero3's overlap, HSDP) ---

    def iallreduce_mean(self, buf: np.ndarray) -> Request:
        """Start buf <- the mean of buf over ranks, in place (MPI_Iallreduce); wait() ends it."""
        if self.ring is not None or self.size == 1 or buf.size == 0 or buf.dtype.itemsize == 2:
            return Request.done(self, lambda: self.allreduce_mean(buf))
        started = self.mpi.Iallreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
        return Request(self, "allreduce", buf.nbytes, started, buf)

    def iallgather(self, shard: np.ndarray, full: np.ndarray) -> Request:
        """Start full <- every rank's shard (MPI_Iallgather); the Request's wait() completes it."""
        if self.ring is not None or self.size == 1 or full.size == 0:
            return Request.done(self, lambda: self.allgather(shard, full))
        started = self.mpi.Iallgather(on_wire(shard), on_wire(full))
        return Request(self, "allgather", full.nbytes, started, None)

    def ireduce_scatter_mean(self, full: np.ndarray, shard: np.ndarray) -> Request:
        """Start shard <- this rank's slice of the mean of `full` (MPI_Ireduce_scatter_block)."""
        if self.ring is not None or self.size == 1 or full.size == 0 or full.dtype.itemsize == 2:
            return Request.done(self, lambda: self.reduce_scatter_mean(full, shard))
        started = self.mpi.Ireduce_scatter_block(full, shard, op=self.MPI.SUM)
        return Request(self, "reduce_scatter", full.nbytes, started, shard)

    def split(self, color: int, key: int, name: str) -> Comm:
        """The ranks with the same color, ordered by key (MPI_Comm_split), as a counted Comm.

        Its traffic shows in this Comm's report as "<kind> (<name>)", e.g. "allgather (shard)".
        """
        child = Comm(None if self.mpi is None else self.mpi.Split(color, key), self.collectives)
        for kind, traffic in child.traffic.items():
            self.traffic[f"{kind} ({name})"] = traffic  # the same object: one count, two views
        return child


class Request:
    """A collective in flight: wait() completes it (dividing for a mean) and counts it.

    The seconds counted are those spent blocked in wait(); `issued` and `completed` are the
    wall-clock span a timeline draws. The ring and a one-rank Comm run the collective at once
    (Request.done): the ring's Sendrecv calls block.
    """

    def __init__(self, comm: Comm, kind: str, nbytes: int, mpi_request, mean_into) -> None:
        self.comm, self.kind, self.nbytes = comm, kind, nbytes
        self.mpi_request, self.mean_into = mpi_request, mean_into
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
        self.mpi_request.Wait()
        if self.mean_into is not None:
            self.comm._divide(self.mean_into)
        self.comm._account(self.kind, self.nbytes, start)
        self.completed = perf_counter()


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
