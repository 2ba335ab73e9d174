"""Comm: the communicator every part of the lesson talks through, counted and watched.

The collectives themselves, how they run (collectives="mpi": the library's calls, traffic
*counted* by the ring model; "ring": ring.py's rings of Sendrecv, traffic *measured*) and how
16-bit buffers move are collectives.py's; the calls that complete later are requests.py's.
Comm adds what concerns the whole communicator: the world (`Comm.world`), sub-communicators
(`split`: HSDP's groups, the mesh's dimensions) and the report of its traffic, with whether
each kind's bytes leave the host.

The non-blocking calls (iallreduce_mean, iallgather, ireduce_scatter_mean) and point-to-point
`send` and `recv` (a pipeline's activations and gradients, pipeline.py) are requests.py's
NonBlocking, Comm's base. Sends are the library's Isend in both modes; what a send hands to MPI
is recorded as it is sent (kind "send": one message, its buffer's bytes), so their numbers are
measured in either mode.

A Comm built without an MPI communicator is one rank and needs no MPI at all.

No collective waits forever (`timeout`, the CLI's --timeout): a Comm is a WatchedComm, and past
the timeout the watchdog ends every rank with one line saying who has not arrived (watchdog.py);
a send's or recv's line names the one peer it waits for.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict

import numpy as np

from .requests import NonBlocking
from .ring import POINT_TO_POINT
from .watchdog import BARRIER_AT_EXIT, DEFAULT_TIMEOUT


class Comm(NonBlocking):
    """The collectives (Collectives, NonBlocking), the world, sub-communicators, the report."""

    def __init__(
        self, mpi_comm=None, collectives: str = "mpi", timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        super().__init__(mpi_comm, collectives, timeout)
        n = self.size
        # whether this rank's right neighbour on the ring runs on another host: then, in the
        # ring model, every byte this rank sends on this communicator crosses the network
        self.sends_between_hosts = n > 1 and (self.rank + 1) % n not in self.arrivals.here
        self.between_hosts = dict.fromkeys(self.traffic, self.sends_between_hosts)
        # a send goes to a pipeline neighbour (rank - 1 or rank + 1): elsewhere if either is
        neighbours = {self.rank - 1, self.rank + 1} & set(range(n))
        self.between_hosts["send"] = any(r not in self.arrivals.here for r in neighbours)

    @classmethod
    def world(cls, collectives: str = "mpi", timeout: float = DEFAULT_TIMEOUT) -> Comm:
        """All ranks of the MPI job (mpiexec or the ipcluster's MPI engines)."""
        from .launch import drop_inherited_loopback

        drop_inherited_loopback()  # a job across hosts needs their interfaces (launch.py)
        from mpi4py import MPI

        comm = cls(MPI.COMM_WORLD, collectives, timeout)
        BARRIER_AT_EXIT.register(comm)  # MPI_Finalize waits for every rank: a barrier, watched
        return comm

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
