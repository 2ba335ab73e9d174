"""Ring attention: causal attention over a sequence split across C context-parallel ranks.

Each of the C ranks of `cp` holds the queries, keys and values of its own tokens (B, H, Tl, D),
Tl = T / C, at the global positions its layout gives it:

    contiguous_positions(T, C, r)   [r*Tl, (r+1)*Tl): the later ranks' queries see more keys
    zigzag_positions(T, C, r)       chunks r and 2C-1-r of 2C: every rank's see as many

The keys travel, the queries stay. At step s rank r holds the K/V block of rank (r - s) % C:
it attends its queries to that block while the block travels on to rank r + 1 and the next one
arrives from rank r - 1, and merges the partial results by their log-sum-exp (attention.merge).
After C steps every query has seen every key, and out and lse are single-rank attention's.

Of each block only the queries that see one of its keys and the keys one of its queries sees
are computed (with ascending positions, a suffix of the queries and a prefix of the keys), and
a block after all the queries is skipped. Contiguous rank r so computes its own block and the r
earlier ones whole and skips C-1-r: rank C-1 computes C times the scores rank 0 does. Zig-zag skips
no block but halves every other one: from an earlier rank only its first chunk is seen, from a
later rank only our second chunk sees it, so every rank computes its own block and C - 1 half
blocks (`ring_work`; `causal_work` counts the unmasked scores themselves).

Backward is the mirror (FlashAttention's: a block's gradients need the final out and lse and
that block alone): K/V travel the ring again, and with them their dK/dV, to which every rank
adds its queries' share before passing them on. After C steps one more hop takes each block's
dK/dV home to the rank that owns those keys. dQ never leaves its rank.

What each rank sends (a block is 2 * B*H*Tl*D numbers, its K and V or its dK and dV, in one
message; counted under the Comm's "send", "send (cp)" in the report of the Comm cp was split
from; "ring kv" and "ring dkv" name them in a trace):

    forward    C - 1 messages: K/V "ring kv", sent as the step's compute starts
    backward   C - 1 K/V messages "ring kv" as in forward, and C dK/dV messages "ring dkv", each
               sent after its step's compute (the last one home), received during the next
"""

from __future__ import annotations

from time import perf_counter
from typing import NamedTuple

import numpy as np

from .attention import attention, attention_backward, merge
from .comm import Comm
from .config import CP_LAYOUTS as LAYOUTS
from .requests import Receiving, Sending

Passing = tuple[Sending, Receiving] | tuple[()]  # a block on its way round, or nothing (C = 1)


# --- layouts: which positions of a sequence each cp rank holds -------------------------------


def contiguous_positions(seq_len: int, cp: int, rank: int) -> np.ndarray:
    """Rank `rank`'s positions when the sequence is cut into cp consecutive slices: (T/cp,)."""
    if seq_len % cp:
        raise ValueError(
            f"a sequence of {seq_len} tokens does not split into {cp} equal slices: "
            f"use a sequence length divisible by --cp {cp}"
        )
    local = seq_len // cp
    return np.arange(rank * local, (rank + 1) * local)


def zigzag_positions(seq_len: int, cp: int, rank: int) -> np.ndarray:
    """Rank `rank`'s positions when the sequence is cut into 2*cp chunks and rank i holds chunks
    i and 2*cp-1-i (Megatron's and torchtitan's load-balanced causal layout): (T/cp,)."""
    if seq_len % (2 * cp):
        raise ValueError(
            f"zig-zag cuts a sequence into 2 * cp = {2 * cp} chunks, and {seq_len} tokens do not "
            f"divide into them: use a sequence length divisible by {2 * cp}"
        )
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return np.concatenate([np.arange(first, first + chunk), np.arange(second, second + chunk)])


def layout(name: str, seq_len: int, cp: int) -> list[np.ndarray]:
    """Every cp rank's positions in the named layout ("contiguous" or "zigzag"), by rank."""
    if name not in LAYOUTS:
        raise ValueError(f"layout {name!r}: use one of {', '.join(LAYOUTS)}")
    positions = contiguous_positions if name == "contiguous" else zigzag_positions
    return [positions(seq_len, cp, rank) for rank in range(cp)]


# --- which part of a block is computed, and the work per rank ------------------------------


def seen(q_pos: np.ndarray, k_pos: np.ndarray) -> tuple[slice, slice]:
    """The queries that see at least one of the keys (those at or after the first key) and the
    keys that at least one query sees (at or before the last query): with ascending positions
    a suffix of the queries and a prefix of the keys, both empty when the block is masked."""
    rows = slice(int(np.searchsorted(q_pos, k_pos[0])), len(q_pos))
    cols = slice(0, int(np.searchsorted(k_pos, q_pos[-1], side="right")))
    return rows, cols


class RingWork(NamedTuple):
    """What the ring computes on one rank: score entries (masked ones inside computed blocks
    included), blocks computed and blocks skipped (fully masked)."""

    scores: int
    blocks: int
    skipped: int


def ring_work(positions: list[np.ndarray]) -> list[RingWork]:
    """Per cp rank, what ring_attention computes (by the rule it uses, `seen`), counted."""
    work = []
    for rank, q_pos in enumerate(positions):
        scores = blocks = 0
        for step in range(len(positions)):
            rows, cols = seen(q_pos, positions[(rank - step) % len(positions)])
            size = (rows.stop - rows.start) * (cols.stop - cols.start)
            scores, blocks = scores + size, blocks + (size > 0)
        work.append(RingWork(scores, blocks, len(positions) - blocks))
    return work


def causal_work(positions: list[np.ndarray]) -> list[int]:
    """Per cp rank, the (query, key) scores that causal attention does not mask: for each of
    its queries, the number of positions of the whole sequence at or before it. Counted."""
    everything = np.sort(np.concatenate(positions))
    return [int(np.searchsorted(everything, q_pos, side="right").sum()) for q_pos in positions]


# --- the ring, forward and backward ---------------------------------------------------------


def ring_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: list[np.ndarray], cp: Comm
) -> tuple[np.ndarray, np.ndarray]:
    """This rank's queries attended to the whole sequence's keys: out (B, H, Tl, D) and lse
    (B, H, Tl), as attention over all T positions gives them for these queries."""
    q_pos = local_positions(q, positions, cp)
    kv = message(k, v)  # (2, B, H, Tl, D): the block in hand, K and V as one message
    spare = np.empty_like(kv)  # where the next block arrives
    passing = pass_on(cp, kv, spare, "ring kv")
    start = perf_counter()
    out, lse = attention(q, k, v, q_pos, q_pos)  # step 0: our own block
    cp.trace.record("compute", "ring attention own block", start)
    for step in range(1, cp.size):
        wait(passing)
        kv, spare = spare, kv
        passing = pass_on(cp, kv, spare, "ring kv") if step < cp.size - 1 else ()
        source = (cp.rank - step) % cp.size
        k_pos = positions[source]
        rows, cols = seen(q_pos, k_pos)
        if rows.start == rows.stop:
            continue  # every key of the block comes after every query here
        start = perf_counter()
        k_seen, v_seen = kv[0, :, :, cols], kv[1, :, :, cols]  # (B, H, keys seen, D)
        part = attention(q[:, :, rows], k_seen, v_seen, q_pos[rows], k_pos[cols])
        out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], *part)
        cp.trace.record("compute", f"ring attention block {source}", start)
    return out, lse


def ring_attention_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    dout: np.ndarray,
    positions: list[np.ndarray],
    cp: Comm,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The gradients of this rank's q, k and v (each (B, H, Tl, D)) through ring_attention,
    given its out and lse and the gradient dout of out."""
    q_pos = local_positions(q, positions, cp)
    kv = message(k, v)  # (2, B, H, Tl, D): the block in hand
    spare = np.empty_like(kv)
    passing = pass_on(cp, kv, spare, "ring kv")
    start = perf_counter()
    dq, dk, dv = attention_backward(q, k, v, out, lse, dout, q_pos, q_pos)  # step 0: own block
    cp.trace.record("compute", "ring attention backward own block", start)
    if cp.size == 1:
        return dq, dk, dv
    dkv = message(dk, dv)  # (2, B, H, Tl, D): the block in hand's dK/dV, accumulating
    dkv_spare = np.empty_like(dkv)  # where the next block's dK/dV arrive
    returning = pass_on(cp, dkv, dkv_spare, "ring dkv")
    for step in range(1, cp.size):
        wait(passing)
        kv, spare = spare, kv
        passing = pass_on(cp, kv, spare, "ring kv") if step < cp.size - 1 else ()
        source = (cp.rank - step) % cp.size
        k_pos = positions[source]
        rows, cols = seen(q_pos, k_pos)
        part = None
        if rows.start < rows.stop:
            start = perf_counter()
            part = attention_backward(
                q[:, :, rows],
                kv[0, :, :, cols],
                kv[1, :, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                dout[:, :, rows],
                q_pos[rows],
                k_pos[cols],
            )
            cp.trace.record("compute", f"ring attention backward block {source}", start)
        wait(returning)  # the block's dK/dV so far are in, and our last ones are sent
        dkv, dkv_spare = dkv_spare, dkv
        if part is not None:
            dq_part, dk_part, dv_part = part
            dq[:, :, rows] += dq_part
            dkv[0, :, :, cols] += dk_part
            dkv[1, :, :, cols] += dv_part
        returning = pass_on(cp, dkv, dkv_spare, "ring dkv")
    wait(returning)  # the last hop: the dK/dV of our own keys, complete, are home
    return dq, dkv_spare[0], dkv_spare[1]


def local_positions(q: np.ndarray, positions: list[np.ndarray], cp: Comm) -> np.ndarray:
    """This rank's positions (Tl,), once they are known to fit the ring: one ascending list per
    cp rank, each as long as the local sequence."""
    if len(positions) != cp.size:
        raise ValueError(
            f"{len(positions)} lists of positions for {cp.size} cp ranks: pass one per rank "
            "(e.g. ring_attention.layout(name, seq_len, cp.size))"
        )
    for rank, p in enumerate(positions):
        if len(p) != q.shape[2] or np.any(np.diff(p) <= 0):
            raise ValueError(
                f"cp rank {rank}'s positions are not {q.shape[2]} ascending positions, one per "
                "local token: pass each rank's positions in ascending order, as layout() does"
            )
    return positions[cp.rank]


def message(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Two (B, H, Tl, D) arrays as one C-contiguous (2, B, H, Tl, D) buffer, one message."""
    both = np.empty((2, *first.shape), first.dtype)
    both[0], both[1] = first, second
    return both


def pass_on(cp: Comm, block: np.ndarray, into: np.ndarray, what: str) -> Passing:
    """Start sending `block` to the next rank of the ring and receiving the previous rank's
    into `into` (both tagged `what` in a trace); nothing on one rank."""
    if cp.size == 1:
        return ()
    right, left = (cp.rank + 1) % cp.size, (cp.rank - 1) % cp.size
    return cp.send(block, right, what), cp.irecv(into, left, what)


def wait(passing: Passing) -> None:
    """Both halves of a pass_on done: the block sent, the next one received."""
    for request in passing:
        request.wait()
