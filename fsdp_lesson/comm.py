"""Comm: the collectives the lesson uses, over mpi4py's buffer interface, with accounting.

Traffic is counted as the ring algorithm moves it (docs/zero_formulas.md): for a full buffer of
F bytes over N ranks each rank sends (N-1)/N * F for an allgather or a reduce-scatter and
2(N-1)/N * F for an allreduce. A Comm built without an MPI communicator is one rank and
needs no MPI at all.
"""

from __future__ import annotations

import hashlib
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import numpy as np

RING_FACTOR = {"allreduce": 2, "allgather": 1, "reduce_scatter": 1, "bcast": 1}


@dataclass
class Traffic:
    """One collective kind's totals on this rank."""

    calls: int = 0
    buffer_bytes: int = 0  # bytes of the full buffers handed to the collective
    sent_bytes: float = 0.0  # bytes this rank sends under the ring model
    seconds: float = 0.0


class Comm:
    """allreduce_mean, allgather, reduce_scatter_mean, bcast and barrier, each counted."""

    def __init__(self, mpi_comm=None) -> None:
        self.mpi = mpi_comm
        if mpi_comm is not None:
            from mpi4py import MPI

            self.MPI = MPI
        self.rank = 0 if mpi_comm is None else mpi_comm.Get_rank()
        self.size = 1 if mpi_comm is None else mpi_comm.Get_size()
        self.traffic = {kind: Traffic() for kind in RING_FACTOR}
        self._scalar = np.zeros(1, dtype=np.float64)

    @classmethod
    def world(cls) -> Comm:
        """All ranks of the MPI job (mpiexec or the ipcluster's MPI engines)."""
        from mpi4py import MPI

        return cls(MPI.COMM_WORLD)

    @contextmanager
    def _count(self, kind: str, full_bytes: int):
        start = time.perf_counter()
        yield
        t = self.traffic[kind]
        t.calls += 1
        t.buffer_bytes += full_bytes
        t.sent_bytes += RING_FACTOR[kind] * (self.size - 1) * full_bytes / self.size
        t.seconds += time.perf_counter() - start

    def allreduce_mean(self, buf: np.ndarray) -> np.ndarray:
        """buf <- the mean of buf over all ranks, in place."""
        if buf.size == 0:  # a layer without parameters moves nothing
            return buf
        with self._count("allreduce", buf.nbytes):
            if self.mpi is not None:
                self.mpi.Allreduce(self.MPI.IN_PLACE, buf, op=self.MPI.SUM)
                buf /= buf.dtype.type(self.size)
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
        with self._count("allgather", full.nbytes):
            if self.mpi is not None:
                self.mpi.Allgather(self.MPI.IN_PLACE if shard is None else shard, full)
            elif shard is not None:
                full[...] = shard
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
        with self._count("reduce_scatter", full.nbytes):
            if self.mpi is not None:
                send, recv = (self.MPI.IN_PLACE, full) if in_place else (full, shard)
                self.mpi.Reduce_scatter_block(send, recv, op=self.MPI.SUM)
                shard /= shard.dtype.type(self.size)
            elif not in_place:
                shard[...] = full
        return shard

    def bcast(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        """buf <- root's buf, in place."""
        with self._count("bcast", buf.nbytes):
            if self.mpi is not None:
                self.mpi.Bcast(buf, root=root)
        return buf

    def barrier(self) -> None:
        if self.mpi is not None:
            self.mpi.Barrier()

    def all_agree(self, ok: bool) -> bool:
        """True on every rank only if `ok` is true on every rank (not counted as traffic)."""
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
        return {kind: asdict(t) for kind, t in self.traffic.items()}

    # --- non-blocking collectives and sub-communicators (zero3's prefetch, HSDP) ----------

    def iallgather(self, shard: np.ndarray, full: np.ndarray) -> Request:
        """Start full <- every rank's shard (MPI_Iallgather); the Request's wait() completes it."""
        return self._start("allgather", full, shard, None, lambda: self.mpi.Iallgather(shard, full))

    def ireduce_scatter_mean(self, full: np.ndarray, shard: np.ndarray) -> Request:
        """Start shard <- this rank's slice of the mean of `full` (MPI_Ireduce_scatter_block)."""
        return self._start(
            "reduce_scatter",
            full,
            full,
            shard,
            lambda: self.mpi.Ireduce_scatter_block(full, shard, op=self.MPI.SUM),
        )

    def _start(self, kind: str, full: np.ndarray, source, mean_into, issue) -> Request:
        """Issue a non-blocking collective (one rank: copy at once); counted when waited for."""
        issued = time.perf_counter()
        if self.mpi is None or full.size == 0:
            if self.mpi is None and mean_into is not None:
                mean_into[...] = source
            elif self.mpi is None:
                full[...] = source
            return Request(self, kind, full.nbytes, None, mean_into, issued)
        return Request(self, kind, full.nbytes, issue(), mean_into, issued)

    def split(self, color: int, key: int, name: str) -> Comm:
        """The ranks with the same color, ordered by key (MPI_Comm_split), as a counted Comm.

        Its traffic shows in this Comm's report as "<kind> (<name>)", e.g. "allgather (shard)".
        """
        child = Comm(None if self.mpi is None else self.mpi.Split(color, key))
        for kind, traffic in child.traffic.items():
            self.traffic[f"{kind} ({name})"] = traffic  # the same object: one count, two views
        return child


class Request:
    """A collective in flight: wait() completes it (dividing for a mean) and counts it.

    The seconds counted are those spent blocked in wait(); `issued` and `completed` are the
    wall-clock span a timeline draws.
    """

    def __init__(self, comm: Comm, kind, nbytes, mpi_request, mean_into, issued) -> None:
        self.comm, self.kind, self.nbytes = comm, kind, nbytes
        self.mpi_request, self.mean_into, self.issued = mpi_request, mean_into, issued
        self.completed: float | None = None

    def test(self) -> bool:
        """Let MPI progress the collective (MPI_Test); True once it is complete."""
        return self.mpi_request is None or self.mpi_request.Test()

    def wait(self) -> None:
        if self.completed is not None:
            return
        with self.comm._count(self.kind, self.nbytes):
            if self.mpi_request is not None:
                self.mpi_request.Wait()
                if self.mean_into is not None:
                    self.mean_into /= self.mean_into.dtype.type(self.comm.size)
        self.completed = time.perf_counter()


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
