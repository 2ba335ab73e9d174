"""Notebook 15's checkers: the log-sum-exp merge of two partial attentions (exercise A, on the
client) and one step of ring attention (exercise B, on the engines).

Exercise A, `my_merge(out1, lse1, out2, lse2) -> (out, lse)`, is run on two splits of a
sequence's keys; its result must be attention over the union (attention.attention), and the
usual mistakes (a plain average, weights that do not add up to one, the larger lse for the
log-sum-exp, ...) are named. Exercise B, `my_ring_step(q, k, v, out, lse, positions, cp)`, runs
twice on every rank, as notebook 12's stage pass does: first a rehearsal without MPI, whose `cp`
checks every send and receive and answers a receive with the block that rank holds, so a
missing send or a neighbour who never sends is one line and nothing waits; then the real run
over the world's ring with a short timeout. Its result must be attention over this rank's keys
and the previous rank's; the wrong neighbour, a missing merge and the wrong key positions are
named. No line gives an expected value.
"""

from __future__ import annotations

import numpy as np

from ..attention import attention, merge
from ..checks import NOT_SOLVED, fail, not_solved
from ..ring_attention import layout

TOLERANCE = 1e-5  # float32 merges against float32 attention over the union
REAL_RUN_TIMEOUT = 20.0  # seconds a real send or receive of exercise B may wait


def close(a, b) -> bool:
    """Same shape and within TOLERANCE everywhere, equal infinities (an lse of -inf) equal."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return False
    with np.errstate(invalid="ignore"):
        return bool(np.all((a == b) | (np.abs(a - b) <= TOLERANCE)))


# --- exercise A: the merge -----------------------------------------------------------------


def merge_cases() -> dict[str, tuple[tuple[np.ndarray, ...], tuple[np.ndarray, np.ndarray]]]:
    """Two splits of 12 causal keys, each part's (out, lse) and attention over all of them:
    interleaved keys (both parts partly masked), and the first 5 keys against the other 7 (the
    first 5 queries see no key of the second part: its lse is -inf there)."""
    positions = np.arange(12)
    rng = np.random.default_rng(15)
    q, k, v = (rng.standard_normal((2, 2, 12, 4)).astype(np.float32) for _ in range(3))
    whole = attention(q, k, v, positions, positions)
    cases = {}
    for name, first in (
        ("interleaved keys", positions % 2 == 0),
        ("keys 0-4 | 5-11", positions < 5),
    ):
        parts = [
            attention(q, k[:, :, m], v[:, :, m], positions, positions[m]) for m in (first, ~first)
        ]
        cases[name] = ((*parts[0], *parts[1]), whole)
    return cases


def merge_mistakes(
    out1, lse1, out2, lse2
) -> dict[str, tuple[np.ndarray | None, np.ndarray | None]]:
    """The usual wrong merges, as (out, lse) (None: that half is not what the mistake changes),
    by the words the checker prints when an answer is one of them."""
    with np.errstate(invalid="ignore", over="ignore"):
        top = np.maximum(lse1, lse2)
        w1, w2 = np.exp(lse1 - top)[..., None], np.exp(lse2 - top)[..., None]
        lse = np.logaddexp(lse1, lse2)
        share1, share2 = np.exp(lse1 - lse)[..., None], np.exp(lse2 - lse)[..., None]
    return {
        "out is the plain average of the two parts — a part whose scores carry more of the "
        "softmax's mass must weigh more": ((out1 + out2) / 2, None),
        "out is the sum of the two parts — each part is already a weighted average (its"
        " softmax's weights add up to 1), so the merge's two weights must add up to 1 too": (
            out1 + out2,
            None,
        ),
        "out weights each part by exp(its lse - the larger lse), but the weights do not add up "
        "to one — renormalise": (w1 * out1 + w2 * out2, None),
        "out weights each part by the other part's share — the weights are swapped": (
            share2 * out1 + share1 * out2,
            None,
        ),
        "lse is the larger of the two — the log of a sum of exponentials is more than its "
        "largest term (the max needs the exp and the log around it)": (None, top),
        "lse is lse1 + lse2, the log of a product — the two parts' exponentials are added, "
        "not multiplied": (None, lse1 + lse2),
    }


def how_merge_differs(answer, parts: tuple[np.ndarray, ...], whole) -> str | None:
    """Where and how a merge's (out, lse) differs from attention over the union, in words; None
    when it is right."""
    if not isinstance(answer, (tuple, list)) or len(answer) != 2:
        return "return a pair (out, lse)"
    for what, got, want in zip(("out", "lse"), answer, whole, strict=True):
        got = np.asarray(got)
        if got.shape != want.shape:
            return f"{what} has shape {got.shape}: it must have the shape of {what}1"
        if got.dtype.kind == "f" and got.dtype.itemsize < np.asarray(want).dtype.itemsize:
            return (
                f"{what} is {got.dtype}, narrower than the parts' {np.asarray(want).dtype}:"
                " keep their precision (no cast)"
            )
    for text, (out, lse) in merge_mistakes(*parts).items():  # before NaN: a wrong lse makes
        if (out is None or close(answer[0], out)) and (lse is None or close(answer[1], lse)):
            if not close(answer[0], whole[0]) or not close(answer[1], whole[1]):  # out NaN
                return text
    for what, got in zip(("out", "lse"), answer, strict=True):
        if np.isnan(np.asarray(got)).any():
            return f"{what} holds NaN: a part whose lse is -inf must add nothing, not NaN"
    for what, got, want in zip(("out", "lse"), answer, whole, strict=True):
        got = np.asarray(got, np.float64)
        wrong = np.abs(got - want) > TOLERANCE
        if wrong.any():
            b, h, t = (int(i) for i in np.argwhere(wrong)[0][:3])
            return (
                f"{what} differs by more than {TOLERANCE:.0e} at batch {b}, head {h}, query {t}"
                f" ({int(wrong.sum())} entries in all)"
            )
    return None


def check_merge(fn) -> bool:
    """Exercise A: `fn(out1, lse1, out2, lse2)` on both splits against attention over all keys."""
    for name, (parts, whole) in merge_cases().items():
        answer = fn(*(part.copy() for part in parts))
        if not_solved(answer):
            return fail(f"✗ my_merge: {NOT_SOLVED}")
        how = how_merge_differs(answer, parts, whole)
        if how:
            return fail(f"✗ my_merge: {name}: {how}")
    print(f"✓ my_merge: correct on both splits ({len(merge_cases())} cases)")
    return True


# --- exercise B: one ring step --------------------------------------------------------------

RING_SHAPE = (2, 2, 16, 8)  # (B, H, T, D): T = 16 is 2·C zig-zag chunks of 2 for C = 4


def ring_inputs(cp: int, rank: int) -> dict:
    """The sequence every rank draws alike (seeded), the zig-zag layout over cp ranks, and this
    rank's q, k, v, its own block's (out, lse) and every rank's K/V block as one message."""
    rng = np.random.default_rng(36)
    q, k, v = (rng.standard_normal(RING_SHAPE).astype(np.float32) for _ in range(3))
    positions = layout("zigzag", RING_SHAPE[2], cp)
    mine = positions[rank]
    local = {name: x[:, :, mine].copy() for name, x in (("q", q), ("k", k), ("v", v))}
    blocks = [np.stack([k[:, :, p], v[:, :, p]]) for p in positions]
    out, lse = attention(local["q"], local["k"], local["v"], mine, mine)
    return local | dict(positions=positions, out=out, lse=lse, blocks=blocks)


class RingStepError(ValueError):
    """A send or receive of exercise B that cannot work: the one line says how."""


class Done:
    """A rehearsed send or receive: wait() returns at once (a receive's buffer is filled). A
    receive waited for before this rank has sent anything is noted (`waited_first`): on the
    real ring every rank would wait for a block that no rank has sent yet."""

    def __init__(self, rehearsal: RingRehearsal | None = None, buf: np.ndarray | None = None):
        self.rehearsal, self.buf = rehearsal, buf

    def wait(self) -> np.ndarray | None:
        if self.rehearsal is not None and not self.rehearsal.sent:
            self.rehearsal.waited_first = True
        return self.buf


class RingRehearsal:
    """A stand-in for `cp` on one rank: checks each message (float32, one block of K and V,
    a rank of the ring other than this one) and answers a receive with the block the source
    rank holds (`blocks[source]`)."""

    def __init__(self, rank: int, size: int, blocks: list[np.ndarray]) -> None:
        self.rank, self.size, self.blocks = rank, size, blocks
        self.sent: list[int] = []
        self.received: list[int] = []
        self.waited_first = False  # a receive waited for before any send started

    def _message(self, what: str, buf, peer) -> None:
        if not isinstance(peer, (int, np.integer)) or not 0 <= peer < self.size:
            raise RingStepError(
                f"rank {self.rank} {what} rank {peer!r}: the ring's ranks are 0 to {self.size - 1}"
            )
        if peer == self.rank:
            raise RingStepError(f"rank {self.rank} {what} itself: the block goes round the ring")
        buf = np.asarray(buf)
        shape = self.blocks[0].shape
        if buf.shape != shape or buf.dtype != np.float32:
            raise RingStepError(
                f"rank {self.rank} {what} rank {peer} a {buf.dtype} buffer of shape {buf.shape}:"
                " a block is K and V as one float32 message, np.stack([k, v])"
            )

    def send(self, buf, to: int, tag: str = "") -> Done:
        self._message("sends to", buf, to)
        self.sent.append(int(to))
        return Done()

    def irecv(self, buf, source: int, tag: str = "") -> Done:
        self._message("receives from", buf, source)
        self.received.append(int(source))
        buf[...] = self.blocks[source]
        return Done(self, buf)

    def recv(self, buf, source: int, tag: str = "") -> np.ndarray:
        return self.irecv(buf, source, tag).wait()


def rehearsal_mistake(rehearsal: RingRehearsal) -> str | None:
    """What this rank's messages lack on their own: one send and one receive."""
    rank = rehearsal.rank
    if len(rehearsal.sent) != 1:
        return (
            f"rank {rank} never sends its K/V block (cp.send): the rank after it would wait for"
            " it forever"
            if not rehearsal.sent
            else f"rank {rank} sends {len(rehearsal.sent)} messages; one step passes one block on"
        )
    if len(rehearsal.received) != 1:
        return (
            f"rank {rank} never receives a block (cp.irecv): it has only its own keys"
            if not rehearsal.received
            else f"rank {rank} receives {len(rehearsal.received)} messages; one step brings one"
            " block"
        )
    if rehearsal.waited_first:
        return (
            f"rank {rank} waits for its receive before it sends: every rank would wait for a"
            " block that no rank has sent yet (start the send first)"
        )
    return None


def ring_mistake(messages: list[tuple[int, int]]) -> str | None:
    """Whether the ring's sends and receives match: every rank receives from a rank that sends
    to it (else it would wait forever). messages[r] = (rank r sends to, rank r receives from)."""
    for rank, (_, source) in enumerate(messages):
        if messages[source][0] != rank:
            return (
                f"rank {rank} receives from rank {source}, which sends its block to rank"
                f" {messages[source][0]}: rank {rank} would wait forever"
            )
    return None


def ring_step_answer(answer, inputs: dict, rank: int, size: int) -> str | None:
    """How this rank's (out, lse) differs from attention over its keys and the previous rank's,
    in words (None: right)."""
    if not isinstance(answer, (tuple, list)) or len(answer) != 2:
        return f"rank {rank}: return a pair (out, lse)"
    q, positions = inputs["q"], inputs["positions"]
    mine = positions[rank]

    def over(source: int, k_pos=None) -> tuple[np.ndarray, np.ndarray]:
        kv = inputs["blocks"][source]
        return attention(q, kv[0], kv[1], mine, positions[source] if k_pos is None else k_pos)

    before, after = (rank - 1) % size, (rank + 1) % size
    right = merge(inputs["out"], inputs["lse"], *over(before))
    for what, got, want in zip(("out", "lse"), answer, right, strict=True):
        if np.shape(got) != want.shape:
            return f"rank {rank}: {what} has shape {np.shape(got)}, not that of the {what} given"
    if close(answer[0], right[0]) and close(answer[1], right[1]):
        return None
    candidates = {
        f"rank {rank}'s queries attended to the keys of rank {after}, the next rank — at step 1 a"
        " rank holds the block of the rank before it": merge(
            inputs["out"], inputs["lse"], *over(after)
        ),
        f"rank {rank} returned the received block's attention alone — merge it with the own"
        " block's (out, lse)": over(before),
        f"rank {rank} returned its own block's attention: the received block was not merged in": (
            inputs["out"],
            inputs["lse"],
        ),
        f"rank {rank} masked the received keys with its own positions — the block's keys sit at"
        " the positions of the rank that sent it": merge(
            inputs["out"], inputs["lse"], *over(before, mine)
        ),
    }
    candidates[
        f"rank {rank} merged its own block in a second time: attend to the received block's"
        " keys and values"
    ] = merge(inputs["out"], inputs["lse"], inputs["out"], inputs["lse"])
    for text, (out, lse) in candidates.items():
        if close(answer[0], out) and close(answer[1], lse):
            return text
    if close(answer[1], right[1]):
        return f"rank {rank}: lse is right, out is not — merge the two outputs as exercise A does"
    return f"rank {rank}: out or lse differs by more than {TOLERANCE:.0e}"


def ring_step_items() -> tuple | str | None:
    """On every rank, with the notebook's %%px names (cp, my_ring_step): the rehearsal's line
    if it finds a mistake, else the real run's verdict line (None: right); NOT_SOLVED for a stub."""
    import __main__

    cp = __main__.cp
    inputs = ring_inputs(cp.size, cp.rank)

    def call(comm):
        return __main__.my_ring_step(
            inputs["q"].copy(), inputs["k"].copy(), inputs["v"].copy(), inputs["out"].copy(),
            inputs["lse"].copy(), inputs["positions"], comm,
        )  # fmt: skip

    rehearsal = RingRehearsal(cp.rank, cp.size, inputs["blocks"])
    unsolved, mistake = False, None
    try:
        answer = call(rehearsal)
        unsolved = not_solved(answer)
        mistake = None if unsolved else rehearsal_mistake(rehearsal)
    except RingStepError as err:
        mistake = str(err)
    messages = (rehearsal.sent[:1] or [-1]) + (rehearsal.received[:1] or [-1])
    verdicts = cp.allgather_objects((unsolved, mistake, tuple(messages)))
    if any(stub for stub, _, _ in verdicts):
        return NOT_SOLVED
    if any(line for _, line, _ in verdicts):
        return mistake or ""  # the other ranks' lines come from them
    ring = ring_mistake([m for _, _, m in verdicts])
    if ring:
        return ring if cp.rank == 0 else ""
    timeout, cp.timeout = cp.timeout, REAL_RUN_TIMEOUT  # rehearsed: no wait should be long
    try:
        answer = call(cp)
    finally:
        cp.timeout = timeout
    return ring_step_answer(answer, inputs, cp.rank, cp.size)


def check_ring_step(ranks) -> bool:
    """Exercise B on the four engines: the rehearsal's first line, or the real run's verdict
    on every rank."""
    from ..cluster import RankError

    try:
        per_rank = ranks.run(ring_step_items, timeout=120)
    except RankError as err:
        if err.ename != "EngineError":  # the learner's code raised: its traceback says where
            raise
        return fail(
            f"✗ my_ring_step: in the real run rank {err.rank} (or its neighbour) waited more than"
            f" {REAL_RUN_TIMEOUT:g} s for a block no rank sent (the rehearsal passed: a rank takes"
            " a path the others do not); the engines were restarted: run the setup %%px cell"
            " above again"
        )
    if NOT_SOLVED in per_rank:
        return fail(f"✗ my_ring_step: {NOT_SOLVED}")
    lines = [line for line in per_rank if line]
    if lines:
        return fail(f"✗ my_ring_step: {lines[0]}")
    print(f"✓ my_ring_step: correct on all {len(per_rank)} ranks")
    return True
