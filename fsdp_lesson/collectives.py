"""Collectives: the blocking collectives the lesson uses, each rank's traffic measured or counted.

Two ways to run them, chosen once per communicator:

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

The layers of a communicator, each on the one below (nothing reaches up or into another's
private parts): watchdog.WatchedComm (watched blocking calls) <- Collectives (here: the
blocking collectives, their Traffic records and Trace, `count` and `to_mean` for whoever
completes a call) <- requests.NonBlocking (the calls that complete later) <- comm.Comm (the
world, sub-communicators, the report).
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter

import numpy as np

from .ring import KINDS, Ring, Sent, on_wire
from .watchdog import DEFAULT_TIMEOUT, WatchedComm

COLLECTIVES = ("mpi", "ring")
# messages and bytes a rank sends per call in the ring model, in units of (N-1) and (N-1)/N * F
RING_FACTOR = {"allreduce": 2, "allgather": 1, "reduce_scatter": 1, "bcast": 1}


def counted_per_call(n: int) -> dict[str, tuple[float, float]]:
    """mpi mode, per kind: (factor, messages) of one call on n ranks in the ring model, with
    factor = RING_FACTOR * (n-1); the call adds factor * F / n to sent_bytes (F: its buffer)."""
    counted = {kind: (f * (n - 1), f * (n - 1)) for kind, f in RING_FACTOR.items()}
    counted["bcast"] = (n - 1, (n - 1) / n)  # N-1 messages of F bytes, shared by N ranks
    return counted


@dataclass
class Traffic(Sent):
    """One collective kind's totals on this rank: `messages` and `sent_bytes` (from Sent: in
    ring mode what the ring sent, in mpi mode the ring model's count; a counted broadcast's
    messages are a per-rank mean, so a fraction), and:"""

    calls: int = 0
    buffer_bytes: int = 0  # bytes of the full buffers handed to the collective
    seconds: float = 0.0  # wall-clock time inside the calls


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


class Collectives(WatchedComm):
    """allreduce_mean/_sum, allgather, reduce_scatter_mean, bcast, barrier: counted, watched."""

    def __init__(
        self, mpi_comm=None, collectives: str = "mpi", timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        if collectives not in COLLECTIVES:
            raise ValueError(f"collectives={collectives!r}: use 'mpi' (the library's) or 'ring'")
        super().__init__(mpi_comm, timeout)  # mpi, MPI, rank, size, timeout, name, arrivals
        self.collectives = collectives
        self.traffic = {kind: Traffic() for kind in KINDS}
        self.trace = Trace()  # a step's spans, while recording (shared with split's children)
        # ring mode: the ring adds what it sends straight into the Traffic records
        self.ring = Ring(mpi_comm, sent=self.traffic) if collectives == "ring" else None
        # mpi mode's 16-bit reductions: the ring summing in numpy (its own sends not recorded:
        # the call is counted by the ring model, as every call of mpi mode)
        self.numpy_ring = self.ring or Ring(mpi_comm)
        self.counted = counted_per_call(self.size)  # mpi mode: the ring model
        self._scalar = np.zeros(1, dtype=np.float64)
        self._divisors: dict[np.dtype, np.generic] = {}  # N as a scalar of each dtype, made once

    def to_mean(self, buf: np.ndarray) -> None:
        """buf /= N in buf's own precision: the sum over ranks becomes the mean."""
        divisor = self._divisors.get(buf.dtype)
        if divisor is None:
            divisor = self._divisors[buf.dtype] = buf.dtype.type(self.size)
        buf /= divisor

    def count(
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
            factor, messages = self.counted[kind]
            t.sent_bytes += factor * full_bytes / self.size
            t.messages += messages
        t.seconds += perf_counter() - start

    def allreduce_mean(self, buf: np.ndarray, tag: str = "") -> np.ndarray:
        """buf <- the mean of buf over all ranks, in place; the same bits on every rank.
        `tag` (every collective's) names the call in a trace, e.g. the unit it moves."""
        return self._allreduce(buf, tag, mean=True)

    def allreduce_sum(self, buf: np.ndarray, tag: str = "") -> np.ndarray:
        """buf <- the sum of buf over all ranks, in place; the same bits on every rank
        (tensor parallelism's partial products, tensor.py)."""
        return self._allreduce(buf, tag, mean=False)

    def _allreduce(self, buf: np.ndarray, tag: str, mean: bool) -> np.ndarray:
        """The sum over ranks in place, divided by N for a mean; counted as one allreduce."""
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
            if mean:
                self.to_mean(buf)
        self.count("allreduce", buf.nbytes, start, tag)
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
        self.count("allgather", full.nbytes, start, tag)
        return full

    def reduce_scatter_mean(
        self, full: np.ndarray, shard: np.ndarray | None, tag: str = ""
    ) -> np.ndarray:
        """shard <- this rank's slice of the mean over ranks of `full` (Reduce_scatter_block).

        shard=None works in place: the result lands in full[:S] (MPI_IN_PLACE), returned.
        """
        return self._reduce_scatter(full, shard, tag, mean=True)

    def reduce_scatter_sum(
        self, full: np.ndarray, shard: np.ndarray | None, tag: str = ""
    ) -> np.ndarray:
        """shard <- this rank's slice of the sum over ranks of `full` (sequence parallelism's
        partial products, gpt.py)."""
        return self._reduce_scatter(full, shard, tag, mean=False)

    def _reduce_scatter(
        self, full: np.ndarray, shard: np.ndarray | None, tag: str, mean: bool
    ) -> np.ndarray:
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
            if mean:
                self.to_mean(shard)
        self.count("reduce_scatter", full.nbytes, start, tag)
        return shard

    def bcast(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        """buf <- root's buf, in place."""
        start = perf_counter()
        if self.size > 1:
            if self.ring is not None:
                self._blocking("bcast", self.ring.bcast, buf, root)
            else:
                self._blocking("bcast", self.mpi.Bcast, on_wire(buf), root=root)
        self.count("bcast", buf.nbytes, start, "")
        return buf

    def barrier(self) -> None:
        if self.mpi is not None:
            self._blocking("barrier", self.mpi.Barrier)

    def allgather_objects(self, obj) -> list:
        """Every rank's obj as a list, on every rank; pickled, so only for rare small things."""
        return [obj] if self.mpi is None else self._blocking("allgather", self.mpi.allgather, obj)
