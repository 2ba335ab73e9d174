"""Attention (fsdp_lesson/attention.py) and ring attention (fsdp_lesson/ring_attention.py): the
kernel against finite differences and its merge, the layouts and their balance counted by hand,
then the ring under mpiexec (tests/ring_attention_worker.py, one launch of 4 ranks: C = 4, 2
and 1) against single-rank attention over the whole sequence, its sends counted by hand."""

import numpy as np
import pytest
from mpi_helpers import ROOT, mpiexec, worker_results
from ring_attention_worker import SHAPE, sequence  # noqa: E402

from fsdp_lesson.attention import attention, attention_backward, merge
from fsdp_lesson.comm import Comm
from fsdp_lesson.ring_attention import (
    LAYOUTS,
    RingWork,
    causal_work,
    contiguous_positions,
    layout,
    ring_attention,
    ring_attention_backward,
    ring_work,
    zigzag_positions,
)

TOLERANCE = 1e-5  # float32 ring against float32 single-rank attention


def random(shape, seed: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# --- the kernel ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "q_pos, k_pos",
    [
        (np.arange(5), np.arange(5)),  # causal, one block
        (np.arange(3, 6), np.arange(4)),  # later queries over earlier keys: nothing masked
        (np.array([0, 4, 6]), np.array([1, 2, 5, 6])),  # query 0 sees no key here
    ],
    ids=["causal", "earlier-keys", "one-row-masked"],
)
def test_attention_backward_is_the_gradient_by_finite_differences(q_pos, k_pos):
    """float64, loss = sum(out * dout): every entry of dq, dk, dv against central differences."""
    q, k, v = (
        random((1, 2, len(p), 3), s, np.float64) for s, p in ((1, q_pos), (2, k_pos), (3, k_pos))
    )
    dout = random(q.shape, 4, np.float64)
    out, lse = attention(q, k, v, q_pos, k_pos)
    grads = attention_backward(q, k, v, out, lse, dout, q_pos, k_pos)
    eps = 1e-6
    for name, x, grad in zip("qkv", (q, k, v), grads, strict=True):
        numeric = np.zeros_like(x)
        for i in np.ndindex(x.shape):
            saved = x[i]
            x[i] = saved + eps
            up = np.sum(attention(q, k, v, q_pos, k_pos)[0] * dout)
            x[i] = saved - eps
            down = np.sum(attention(q, k, v, q_pos, k_pos)[0] * dout)
            x[i] = saved
            numeric[i] = (up - down) / (2 * eps)
        assert np.abs(grad - numeric).max() <= 1e-8, f"d{name} differs from finite differences"


def test_merging_two_halves_of_the_keys_gives_attention_over_all_of_them():
    positions = np.arange(12)
    q, k, v = (random((2, 2, 12, 4), seed) for seed in range(3))
    whole = attention(q, k, v, positions, positions)
    halves = [positions % 2 == 0, positions % 2 == 1]  # interleaved: both halves partly masked
    parts = [attention(q, k[:, :, h], v[:, :, h], positions, positions[h]) for h in halves]
    merged = merge(*parts[0], *parts[1])
    for what, a, b in zip(("out", "lse"), merged, whole, strict=True):
        assert np.abs(a - b).max() <= TOLERANCE, f"merged {what} is not attention over all keys"


def test_a_query_that_sees_no_key_adds_nothing_and_gets_no_gradient():
    q_pos, k_pos = np.array([0, 1]), np.array([5, 6])  # every key after every query
    q, k, v = random((1, 1, 2, 4), 0), random((1, 1, 2, 4), 1), random((1, 1, 2, 4), 2)
    out, lse = attention(q, k, v, q_pos, k_pos)
    assert np.array_equal(out, np.zeros_like(out)) and np.isneginf(lse).all()
    seen = attention(q, k, v, q_pos, q_pos)
    merged = merge(out, lse, *seen)
    assert all(np.array_equal(a, b) for a, b in zip(merged, seen, strict=True))
    grads = attention_backward(q, k, v, *seen, random(q.shape, 3), q_pos, k_pos)
    assert all(np.array_equal(g, np.zeros_like(g)) for g in grads)


# --- layouts and their balance ------------------------------------------------------------


@pytest.mark.parametrize("name", LAYOUTS)
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_a_layout_partitions_the_sequence_in_equal_ascending_parts(name, cp):
    positions = layout(name, 24, cp)
    assert all(len(p) == 24 // cp and np.all(np.diff(p) > 0) for p in positions)
    assert np.array_equal(np.sort(np.concatenate(positions)), np.arange(24))


def test_zigzag_gives_rank_i_chunks_i_and_2c_minus_1_minus_i():
    # T = 16 in 8 chunks of 2: rank 0 holds chunks 0 and 7, rank 3 chunks 3 and 4
    expected = [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11], [6, 7, 8, 9]]
    assert [zigzag_positions(16, 4, r).tolist() for r in range(4)] == expected
    assert [contiguous_positions(16, 4, r).tolist() for r in range(4)] == [
        list(range(4 * r, 4 * r + 4)) for r in range(4)
    ]


def test_a_sequence_that_does_not_divide_is_refused_with_what_would():
    with pytest.raises(ValueError, match="divisible by --cp 4"):
        contiguous_positions(10, 4, 0)
    with pytest.raises(ValueError, match="2 \\* cp = 8 chunks.*divisible by 8"):
        zigzag_positions(12, 4, 0)
    with pytest.raises(ValueError, match="use one of contiguous, zigzag"):
        layout("striped", 16, 4)


def test_zigzag_balances_causal_work_and_contiguous_does_not():
    """T = 16, C = 4, by hand: a query at position p sees p + 1 keys. Contiguous rank r holds
    4r..4r+3: 1+2+3+4 = 10, 5+..+8 = 26, 42, 58. Zig-zag rank 0 holds 0, 1, 14, 15:
    1+2+15+16 = 34, rank 1 2, 3, 12, 13: 3+4+13+14 = 34, and so on: 136 / 4 each."""
    assert causal_work(layout("contiguous", 16, 4)) == [10, 26, 42, 58]
    assert causal_work(layout("zigzag", 16, 4)) == [34, 34, 34, 34]


def test_the_ring_computes_zigzags_half_blocks_and_skips_contiguous_masked_blocks():
    """T = 16, C = 4, Tl = 4, by hand. Contiguous rank r computes its own block and the r
    earlier ones whole (16 scores each) and skips the 3 - r later ones. Zig-zag computes its
    own block (16) and, of each other one, 4 queries x 2 keys (an earlier rank's first chunk)
    or 2 queries x 4 keys (a later rank's block, for our second chunk): 16 + 3 * 8 = 40."""
    assert ring_work(layout("contiguous", 16, 4)) == [
        RingWork(16 * (r + 1), r + 1, 3 - r) for r in range(4)
    ]
    assert ring_work(layout("zigzag", 16, 4)) == [RingWork(40, 4, 0)] * 4


# --- one rank: the ring is attention itself -----------------------------------------------


def test_on_one_rank_the_ring_is_attention_and_sends_nothing():
    comm = Comm()
    positions = layout("zigzag", 8, 1)
    q, k, v, dout = (random((2, 2, 8, 4), seed) for seed in range(4))
    out, lse = ring_attention(q, k, v, positions, comm)
    expected = attention(q, k, v, positions[0], positions[0])
    assert np.array_equal(out, expected[0]) and np.array_equal(lse, expected[1])
    grads = ring_attention_backward(q, k, v, out, lse, dout, positions, comm)
    expected = attention_backward(q, k, v, out, lse, dout, positions[0], positions[0])
    assert all(np.array_equal(a, b) for a, b in zip(grads, expected, strict=True))
    assert "send" not in comm.traffic_report()


def test_positions_that_do_not_fit_the_ring_are_refused():
    q = random((1, 1, 4, 2), 0)
    with pytest.raises(ValueError, match="2 lists of positions for 1 cp ranks: pass one per"):
        ring_attention(q, q, q, layout("zigzag", 8, 2), Comm())
    with pytest.raises(ValueError, match="not 4 ascending positions"):
        ring_attention(q, q, q, [np.array([0, 2, 1, 3])], Comm())


# --- under mpiexec: C = 4, 2 (two rings side by side) and 1 in one launch -----------------


@pytest.fixture(scope="module")
def ring_runs(tmp_path_factory):
    return worker_results(4, "ring_attention_worker.py", tmp_path_factory, timeout=120)


def whole(ranks: list[dict], group: int, what: str) -> np.ndarray:
    """One group's local `what` of every rank, put back at their positions: (B, H, T, ...)."""
    mine = [r for r in ranks if r["group"] == group]
    shape = list(mine[0]["results"][what].shape)
    shape[2] = SHAPE[2]
    gathered = np.full(shape, np.nan, np.float32)
    for r in mine:
        gathered[:, :, r["positions"]] = r["results"][what]
    return gathered


@pytest.mark.mpi
def test_the_ring_equals_single_rank_attention_over_the_whole_sequence(ring_runs):
    assert sorted(ring_runs) == sorted((c, name) for c in (4, 2, 1) for name in LAYOUTS)
    everything = np.arange(SHAPE[2])
    for (cp, name), ranks in ring_runs.items():
        for group in range(4 // cp):
            q, k, v, dout = sequence(cp, name, group)
            out, lse = attention(q, k, v, everything, everything)
            dq, dk, dv = attention_backward(q, k, v, out, lse, dout, everything, everything)
            expected = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
            for what, single in expected.items():
                ring = whole(ranks, group, what)
                ok = np.abs(ring - single).max() <= TOLERANCE  # NaN (a position missed) fails
                assert ok, f"C={cp} {name} group {group}: {what} not within {TOLERANCE} of single"


@pytest.mark.mpi
def test_the_sends_are_the_blocks_counted_by_hand(ring_runs):
    """A block is K and V (or dK and dV) of B*H*Tl*D float32 each: 2 * 2*3*(24/C)*8 * 4 bytes.
    Forward sends C - 1 of them; backward C - 1 K/V blocks and C dK/dV blocks (the last one
    home to the keys' owner): 2C - 1. On one rank nothing."""
    b, h, t, d = SHAPE
    for (cp, name), ranks in ring_runs.items():
        block = 2 * b * h * (t // cp) * d * 4
        forward = (cp - 1, (cp - 1) * block)
        backward = (2 * cp - 1, (2 * cp - 1) * block) if cp > 1 else (0, 0)
        for r in ranks:
            assert r["forward_sends"] == forward, f"C={cp} {name}: forward sends miscounted"
            assert r["backward_sends"] == backward, f"C={cp} {name}: backward sends miscounted"


@pytest.mark.mpi
def test_a_traced_step_shows_each_kv_send_in_flight_over_a_blocks_compute(ring_runs):
    """Each K/V block is sent before the compute on the block in hand begins and waited for
    after it ends; zig-zag computes at every step, so every "send ring kv" span holds one."""
    for r in ring_runs[(4, "zigzag")]:
        computes = [(s, e) for lane, _, s, e in r["spans"] if lane == "compute"]
        sends = [(s, e) for lane, what, s, e in r["spans"] if what == "send ring kv"]
        assert len(computes) == 2 * 4 and len(sends) == 2 * 3  # forward and backward
        for start, end in sends:
            assert any(start <= s and e <= end for s, e in computes), "a K/V send held no compute"


@pytest.mark.mpi
def test_a_ring_whose_rank_stops_times_out_naming_who_is_waited_for():
    """Rank 2 stops before it sends: rank 3 waits to receive from it, and the ranks behind rank
    3 wait for rank 3 in turn; whichever times out first says so in one line, and every rank
    ends with the watchdog's exit code 4."""
    result = mpiexec(4, str(ROOT / "tests" / "ring_attention_worker.py"), "stop", "2", timeout=60)
    assert result.returncode == 4, result.stderr
    lines = [line for line in result.stderr.splitlines() if "waited 3 s" in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    named = "rank 2 (stopped) has not sent it" in lines[0] or "rank 2 is stopped" in lines[0]
    assert " (cp) from rank " in lines[0] and named, lines[0]
