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

The non-blocking calls (iallreduce_mean, iallgather, ireduce_scatter_mean) and point-to-point
`send` and `recv` (a pipeline's activations and gradients, pipeline.py) are Comm's base,
requests.py's NonBlocking. Sends are the library's Isend in both modes; what a send hands to MPI
is recorded as it is sent (kind "send": one message, its buffer's bytes), so their numbers are
measured in either mode.

A Comm built without an MPI communicator is one rank and needs no MPI at all.

No collective waits forever (`timeout`, the CLI's --timeout): a Comm is a WatchedComm, and past
the timeout the watchdog ends every rank with one line saying who has not arrived (watchdog.py);
a send's or recv's line names the one peer it waits for.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from time import perf_counter

import numpy as np

from .requests import NonBlocking
from .ring import KINDS, POINT_TO_POINT, Ring, Sent, on_wire
from .watchdog import BARRIER_AT_EXIT, DEFAULT_TIMEOUT

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


class Comm(NonBlocking):
    """allreduce_mean/_sum, allgather, reduce_scatter_mean, bcast, barrier: accounted, watched."""

    def __init__(
        self, mpi_comm=None, collectives: str = "mpi", timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        if collectives not in COLLECTIVES:
            raise ValueError(f"collectives={collectives!r}: use 'mpi' (the library's) or 'ring'")
        super().__init__(mpi_comm, timeout)  # mpi, MPI, rank, size, timeout, name, arrivals
        n = self.size
        self.collectives = collectives
        self.traffic = {kind: Traffic() for kind in KINDS}
        self.trace = Trace()  # a step's spans, while recording (shared with split's children)
        # whether this rank's right neighbour on the ring runs on another host: then, in the
        # ring model, every byte this rank sends on this communicator crosses the network
        self.sends_between_hosts = n > 1 and (self.rank + 1) % n not in self.arrivals.here
        self.between_hosts = dict.fromkeys(self.traffic, self.sends_between_hosts)
        # a send goes to a pipeline neighbour (rank - 1 or rank + 1): elsewhere if either is
        neighbours = {self.rank - 1, self.rank + 1} & set(range(n))
        self.between_hosts["send"] = any(r not in self.arrivals.here for r in neighbours)
        # ring mode: the ring adds what it sends straight into the Traffic records
        self.ring = Ring(mpi_comm, sent=self.traffic) if collectives == "ring" else None
        # mpi mode's 16-bit reductions: the ring summing in numpy (its own sends not recorded:
        # the call is counted by the ring model, as every call of mpi mode)
        self.numpy_ring = self.ring or Ring(mpi_comm)
        self._counted = counted_per_call(n)  # mpi mode: the ring model
        self._scalar = np.zeros(1, dtype=np.float64)
        self._divisors: dict[np.dtype, np.generic] = {}  # N as a scalar of each dtype, made once

    @classmethod
    def world(cls, collectives: str = "mpi", timeout: float = DEFAULT_TIMEOUT) -> Comm:
        """All ranks of the MPI job (mpiexec or the ipcluster's MPI engines)."""
        from .launch import drop_inherited_loopback

        drop_inherited_loopback()  # a job across hosts needs their interfaces (launch.py)
        from mpi4py import MPI

        comm = cls(MPI.COMM_WORLD, collectives, timeout)
        BARRIER_AT_EXIT.register(comm)  # MPI_Finalize waits for every rank: a barrier, watched
        return comm

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

    def allgather_objects(self, obj) -> list:
        """Every rank's obj as a list, on every rank; pickled, so only for rare small things."""
        return [obj] if self.mpi is None else self._blocking("allgather", self.mpi.allgather, obj)

    def traffic_report(self) -> dict[str, dict]:
        """Per kind: calls, buffer_bytes, sent_bytes, messages, seconds, and how the bytes and
        messages were obtained: "measured" (ring mode) or "counted" (the ring model, mpi mode).
        Sends are always "measured", and listed only once some were made."""
        report = {}
        for kind, t in self.traffic.items():
            point_to_point = kind.split(" (")[0] in POINT_TO_POINT
            if point_to_point and not t.calls:
                continue
            how = "measured" if self.ring is not None or point_to_point else "counted"
            report[kind] = asdict(t) | {"how": how, "between_hosts": self.between_hosts[kind]}
        return report

    # --- sub-communicators (HSDP's groups, the mesh's dimensions) ---------------------------

    def split(self, color: int, key: int, name: str) -> Comm:
        """The ranks with the same color, ordered by key (MPI_Comm_split), as a counted Comm.

        Its traffic shows in this Comm's report as "<kind> (<name>)", e.g. "allgather (shard)".
        """
        mpi = None if self.mpi is None else self._blocking("split", self.mpi.Split, color, key)
        child = Comm(mpi, self.collectives, self.timeout)
        child.name, child.trace = name, self.trace
        for kind, traffic in child.traffic.items():
            self.traffic[f"{kind} ({name})"] = traffic  # the same object: one count, two views
            self.between_hosts[f"{kind} ({name})"] = child.between_hosts[kind]
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


# --- the library's own calls on small things, not counted: flags, digests, objects, hosts ---
# (and Comm.allgather_objects, which the notebooks call as a method)


def all_agree(comm: Comm, ok: bool) -> bool:
    """True on every rank only if `ok` is true on every rank (the library's; not counted)."""
    if comm.mpi is None:
        return ok
    flag = np.array([1 if ok else 0], dtype=np.int32)
    comm._blocking("allreduce", comm.mpi.Allreduce, comm.MPI.IN_PLACE, flag, op=comm.MPI.MIN)
    return bool(flag[0])


def same_everywhere(comm: Comm, array: np.ndarray) -> bool:
    """Whether `array` is bit-identical on every rank (compares sha256 digests; not counted)."""
    if comm.mpi is None:
        return True
    digest = np.frombuffer(hashlib.sha256(np.ascontiguousarray(array)).digest(), np.uint8)
    digests = np.empty((comm.size, digest.size), dtype=np.uint8)
    comm._blocking("allgather", comm.mpi.Allgather, digest, digests)
    return bool((digests == digests[0]).all())


def gather_objects(comm: Comm, obj) -> list | None:
    """Every rank's obj as a list on rank 0 (None elsewhere); pickled, so once per run only."""
    return [obj] if comm.mpi is None else comm._blocking("gather", comm.mpi.gather, obj, root=0)


def ranks_on_this_host(comm: Comm) -> int:
    """How many ranks of this job share this machine (and so its memory)."""
    if comm.mpi is None:
        return 1
    local = comm._blocking("split", comm.mpi.Split_type, comm.MPI.COMM_TYPE_SHARED)
    size = local.Get_size()
    local.Free()
    return size


def raise_on_every_rank(comm: Comm, work, refusals: tuple[type[Exception], ...]):
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
