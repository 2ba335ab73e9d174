"""The ring collectives built by hand from point-to-point messages, each byte counted.

N ranks sit on a ring; each sends only to its right neighbour (rank + 1) and receives only from
its left (rank - 1), with one `Sendrecv` per step. A buffer of any length is cut into N chunks
of ceil(len / N) elements, as FlatParam cuts a layer into shards; the last chunks of an
unpadded buffer are shorter or empty, so the padding is never sent. Chunk c is "owned" by rank c.

Reduce-scatter, N = 4 (ranks across, steps down; "c2" = rank's running sum of chunk 2):

    step 0:  r0 sends c3 -> r1   r1 sends c0 -> r2   r2 sends c1 -> r3   r3 sends c2 -> r0
    step 1:  r0 sends c2 -> r1   r1 sends c3 -> r2   r2 sends c0 -> r3   r3 sends c1 -> r0
    step 2:  r0 sends c1 -> r1   r1 sends c2 -> r2   r2 sends c3 -> r3   r3 sends c0 -> r0
             each receiver adds what it gets to its own values of that chunk and passes the
             sum on at the next step; after N - 1 steps rank r holds the full sum of chunk r.

Allgather, N = 4: rank r starts with chunk r and passes on what it received the step before.

    step 0:  r0 sends c0 -> r1   r1 sends c1 -> r2   r2 sends c2 -> r3   r3 sends c3 -> r0
    step 1:  r0 sends c3 -> r1   r1 sends c0 -> r2   r2 sends c1 -> r3   r3 sends c2 -> r0
    step 2:  r0 sends c2 -> r1   r1 sends c3 -> r2   r2 sends c0 -> r3   r3 sends c1 -> r0

Allreduce = reduce-scatter + allgather: every rank ends with the owner's bits of each chunk, so
the result is identical on every rank. Per rank, for a buffer of F bytes cut into equal chunks:
N - 1 messages and (N - 1)/N * F bytes for a reduce-scatter or an allgather, twice that for an
allreduce, whatever N is: the ring keeps every link busy and no rank sends more than its share.
Broadcast is a chain along the ring from the root: N - 1 messages of F bytes in all, one from
every rank but the last; per rank (N - 1)/N * F on average.

16-bit buffers (bfloat16, float16: precision.py) travel as their raw uint16 bits (`on_wire`),
since MPI has no bfloat16 type, and are summed by numpy: each hop adds in float32 and rounds the
partial sum to 16 bits before passing it on, so a sum over N ranks is rounded N - 1 times.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# the collectives, and "send": point-to-point messages (Comm.send, a pipeline's activations and
# gradients), recorded as they are sent in either mode, never by the ring model
KINDS = ("allreduce", "allgather", "reduce_scatter", "bcast", "send")
POINT_TO_POINT = ("send",)
TAG = 13  # the ring's own tag: its messages match no receive posted with another tag


@dataclass
class Sent:
    """What this rank handed to the network for one collective kind."""

    messages: int = 0  # calls of Sendrecv / Send
    sent_bytes: float = 0  # bytes of the send buffers of those calls


def on_wire(array: np.ndarray) -> np.ndarray:
    """What MPI is handed: the array itself, or a 16-bit float's bits as uint16 (a view)."""
    return array.view(np.uint16) if array.dtype.itemsize == 2 else array


def chunk_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """The [start, stop) of each of the n chunks of a buffer: ceil(length / n) elements each,
    the last ones shorter (or empty) when n does not divide length."""
    size = -(-length // n)
    return [(min(c * size, length), min((c + 1) * size, length)) for c in range(n)]


class Ring:
    """allreduce, reduce_scatter, allgather and bcast as rings of Sendrecv on one communicator.

    `sent` maps each kind to a counter with `messages` and `sent_bytes` (Comm passes its own
    Traffic records); a communicator of None is one rank, which sends nothing.
    """

    def __init__(self, mpi_comm=None, sent: dict | None = None) -> None:
        self.mpi = mpi_comm
        self.rank = 0 if mpi_comm is None else mpi_comm.Get_rank()
        self.size = 1 if mpi_comm is None else mpi_comm.Get_size()
        self.right, self.left = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        self.sent = sent if sent is not None else {kind: Sent() for kind in KINDS}
        self._scratch: dict[np.dtype, np.ndarray] = {}  # per dtype: [received | running sum]

    def _sendrecv(self, kind: str, send: np.ndarray, recv: np.ndarray) -> None:
        """Send to the right neighbour while receiving from the left one; count what was sent."""
        self.mpi.Sendrecv(on_wire(send), self.right, TAG, on_wire(recv), self.left, TAG)
        counter = self.sent[kind]
        counter.messages += 1
        counter.sent_bytes += send.nbytes

    def _scratch_for(self, dtype: np.dtype, chunk: int) -> tuple[np.ndarray, np.ndarray]:
        """Two preallocated chunk-sized buffers of this dtype, grown only when too small."""
        buf = self._scratch.get(dtype)
        if buf is None or buf.size < 2 * chunk:
            buf = self._scratch[dtype] = np.empty(2 * chunk, dtype=dtype)
        return buf[:chunk], buf[chunk : 2 * chunk]

    def reduce_scatter(
        self, full: np.ndarray, out: np.ndarray, kind: str = "reduce_scatter"
    ) -> np.ndarray:
        """out <- the sum over ranks of chunk `rank` of `full`; `full` itself is only read.

        `out` may be a view into `full` (the in-place forms): it is written only at the end.
        """
        n, rank = self.size, self.rank
        bounds = chunk_bounds(full.size, n)
        if n == 1:
            out[...] = full
            return out
        received, running = self._scratch_for(full.dtype, bounds[0][1])
        for step in range(n - 1):
            # pass on the chunk summed at the previous step; receive the next one to add into
            send, recv = (rank - step - 1) % n, (rank - step - 2) % n
            (s0, s1), (r0, r1) = bounds[send], bounds[recv]
            outgoing = full[s0:s1] if step == 0 else running[: s1 - s0]  # step 0: own values
            self._sendrecv(kind, outgoing, received[: r1 - r0])
            target = out if step == n - 2 else running[: r1 - r0]  # the last sum is chunk rank
            np.add(full[r0:r1], received[: r1 - r0], out=target)
        return out

    def allgather(self, full: np.ndarray, kind: str = "allgather") -> np.ndarray:
        """full <- every rank's chunk, in place: chunk r of `full` comes from rank r."""
        n, rank = self.size, self.rank
        bounds = chunk_bounds(full.size, n)
        for step in range(n - 1):
            # pass on the chunk received at the previous step (step 0: this rank's own)
            send, recv = (rank - step) % n, (rank - step - 1) % n
            (s0, s1), (r0, r1) = bounds[send], bounds[recv]
            self._sendrecv(kind, full[s0:s1], full[r0:r1])
        return full

    def allreduce(self, buf: np.ndarray) -> np.ndarray:
        """buf <- the sum over ranks of buf, in place, the same bits on every rank."""
        start, stop = chunk_bounds(buf.size, self.size)[self.rank]
        self.reduce_scatter(buf, buf[start:stop], kind="allreduce")
        return self.allgather(buf, kind="allreduce")

    def bcast(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        """buf <- root's buf, in place, passed along the ring: root -> root+1 -> ... -> root-1."""
        hops = (self.rank - root) % self.size  # this rank's distance from the root
        if hops > 0:
            self.mpi.Recv(on_wire(buf), self.left, TAG)
        if hops < self.size - 1:
            self.mpi.Send(on_wire(buf), self.right, TAG)
            counter = self.sent["bcast"]
            counter.messages += 1
            counter.sent_bytes += buf.nbytes
        return buf
