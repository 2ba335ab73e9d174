"""Calls that start now and complete later: the non-blocking half of Comm (comm.py).

    NonBlocking   iallreduce_mean, iallgather, ireduce_scatter_mean (dp's and zero3's overlap of
                  communication with compute) and send / recv (a pipeline's activations and
                  gradients, pipeline.py), on the blocking Collectives (collectives.py): their
                  Traffic records and Trace; the ring and a one-rank Comm run the blocking call
    Request       a collective in flight: wait() completes it and counts it (Collectives.count)
    Sending       a send in flight: wait() returns once MPI is done with the buffer
    Receiving     a receive in flight (irecv: ring attention's next K/V block arrives while
                  this one is computed on): wait() returns once the buffer holds the message

Every wait is watched as a blocking call is (watchdog.py): past the Comm's timeout the job ends
with a line naming who has not arrived, or for a send or recv the one peer it waits for.
"""

from __future__ import annotations

from time import monotonic, perf_counter

import numpy as np

from .collectives import Collectives
from .ring import on_wire
from .watchdog import WATCHDOG

P2P_TAG = 14  # point-to-point messages' tag: none matches a receive of the ring's (ring.TAG)


class NonBlocking(Collectives):
    """The non-blocking calls. The ring and a one-rank Comm run a collective at once through
    the blocking call (Request.done); sends and receives need P > 1 ranks."""

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

    def send(self, buf: np.ndarray, to: int, tag: str = "") -> Sending:
        """Start sending buf to rank `to` (MPI_Isend); buf must not change until the returned
        Sending's wait(). Recorded at once under "send", alike in mpi and ring mode: one
        message of buf.nbytes. It does not wait for the receiver, so two neighbours may both
        send and then receive (blocking sends would wait for each other's receive forever
        once a message is too large for MPI to buffer)."""
        if self.mpi is None:
            raise ValueError("a one-rank Comm has no other rank to send to: send over P > 1 ranks")
        start = perf_counter()
        t = self.traffic["send"]
        t.calls, t.messages = t.calls + 1, t.messages + 1
        t.buffer_bytes, t.sent_bytes = t.buffer_bytes + buf.nbytes, t.sent_bytes + buf.nbytes
        request = self.mpi.Isend(on_wire(buf), to, P2P_TAG)
        t.seconds += perf_counter() - start
        return Sending(self, request, to, buf, tag, start)

    def recv(self, buf: np.ndarray, source: int, tag: str = "") -> np.ndarray:
        """buf <- what rank `source` sent (MPI_Recv), in place. Watched: past the timeout the
        watchdog ends the job, naming `source` and what it is doing."""
        if self.mpi is None:
            raise ValueError("a one-rank Comm has no other rank to receive from")
        start = perf_counter()
        self._watched_p2p("recv", source, self.mpi.Recv, on_wire(buf), source, P2P_TAG)
        self.trace.record("comm", f"recv {tag}" if tag else "recv", start)
        return buf

    def irecv(self, buf: np.ndarray, source: int, tag: str = "") -> Receiving:
        """Start receiving into buf what rank `source` sends (MPI_Irecv); buf holds it once the
        returned Receiving's wait() returns. Watched there as recv is."""
        if self.mpi is None:
            raise ValueError("a one-rank Comm has no other rank to receive from")
        issued = perf_counter()
        request = self.mpi.Irecv(on_wire(buf), source, P2P_TAG)
        return Receiving(self, request, source, buf, tag, issued)


class Request:
    """A collective in flight: wait() completes it (dividing for a mean) and counts it.

    The seconds counted are those spent blocked in wait(); `issued` and `completed` are the
    wall-clock span a timeline draws. The ring and a one-rank Comm run the collective at once
    (Request.done): the ring's Sendrecv calls block.
    """

    def __init__(
        self,
        comm: Collectives,
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
    def done(cls, comm: Collectives, collective) -> Request:
        """A request whose collective ran to completion right here (and was counted there)."""
        request = cls(comm, "", 0, None, None)
        collective()
        request.completed = perf_counter()
        return request

    def wait(self) -> None:
        if self.completed is not None:
            return
        start = perf_counter()
        # watched as a blocking call is: past the Comm's timeout the watchdog ends the job
        WATCHDOG.waiting = (self.comm, self.kind, self.entered, monotonic())
        try:
            self.mpi_request.Wait()
        finally:
            WATCHDOG.waiting = None
        if self.mean_into is not None:
            self.comm.to_mean(self.mean_into)
        self.comm.count(self.kind, self.nbytes, start, self.tag, self.issued)
        self.completed = perf_counter()


class Sending:
    """A send in flight (Comm.send): wait() returns once MPI is done with the buffer. Watched
    as a recv is: past the Comm's timeout the watchdog names the rank that has not received."""

    kind = "send"

    def __init__(
        self, comm: Collectives, request, peer: int, buf: np.ndarray, tag: str, issued: float
    ):
        self.comm, self.request, self.peer, self.tag = comm, request, peer, tag
        self.issued = issued
        self.buf = buf  # kept alive until MPI is done with it

    def wait(self) -> None:
        if self.request is None:
            return
        start = perf_counter()
        self.comm._watched_p2p(self.kind, self.peer, self.request.Wait)
        self.request = self.buf = None
        if self.kind == "send":  # a receive's wait is for its sender, not traffic (as recv's)
            self.comm.traffic["send"].seconds += perf_counter() - start
        what = f"{self.kind} {self.tag}" if self.tag else self.kind
        self.comm.trace.record("comm", what, self.issued)


class Receiving(Sending):
    """A receive in flight (Comm.irecv): wait() returns once the buffer holds the message;
    watched as a send is, naming the rank that has not sent."""

    kind = "recv"
