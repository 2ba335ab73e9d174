"""The ring collectives (fsdp_lesson/ring.py) under real `mpiexec -n N`, N = 1..4.

One mpiexec per N (tests/ring_worker.py) runs every collective through Comm with ring and with
mpi collectives, the Ring on lengths N does not divide, and every strategy trained with ring
collectives; the tests compare results with the library's and with single, and the measured
bytes and messages with the ring formula, exactly.
"""

import math
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from mpi_helpers import assert_same_as_single, worker_results

from fsdp_lesson.comm import Comm
from fsdp_lesson.config import ModelConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.model import MLP
from fsdp_lesson.ring import Ring, chunk_bounds
from fsdp_lesson.train import run

HERE = Path(__file__).parent
pytestmark = pytest.mark.mpi
TOLERANCE = {4: 1e-5, 8: 1e-13}  # float32, float64: the sums differ only in their order


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda n: f"N{n}")
def world(request, tmp_path_factory):
    return request.param, worker_results(
        request.param, "ring_worker.py", tmp_path_factory, timeout=300
    )


def cases(results, kind=None):
    """(case name, [every rank's view of the case]) for each case of the kind."""
    per_case = zip(*results["comm"], strict=True)
    for ranks in per_case:
        c = ranks[0]
        if kind is None or c["kind"] == kind:
            yield f"{c['name']} {c['length']}x{c['itemsize']}B {c.get('root', '')}", ranks


def ring_allreduce_bytes(length: int, itemsize: int, n: int, rank: int) -> int:
    """What rank sends in a ring allreduce: every chunk but its own (reduce-scatter) and every
    chunk but its right neighbour's (allgather)."""
    sizes = [stop - start for start, stop in chunk_bounds(length, n)]
    return itemsize * (2 * length - sizes[rank] - sizes[(rank + 1) % n])


def test_chunk_bounds_cut_like_flat_param():
    assert chunk_bounds(10, 4) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert chunk_bounds(1, 3) == [(0, 1), (1, 1), (1, 1)]
    assert chunk_bounds(12, 3) == [(0, 4), (4, 8), (8, 12)]


def test_one_rank_ring_sends_nothing_and_copies():
    comm = Comm(collectives="ring")
    full = np.zeros(4, dtype=np.float32)
    assert comm.allgather(np.arange(4, dtype=np.float32), full).tolist() == [0, 1, 2, 3]
    shard = np.empty(4, dtype=np.float32)
    assert comm.reduce_scatter_mean(full, shard).tolist() == [0, 1, 2, 3]
    assert comm.mean_scalar(2.5) == 2.5
    report = comm.traffic_report()
    assert all(
        t["how"] == "measured" and t["messages"] == t["sent_bytes"] == 0 for t in report.values()
    )
    assert report["allgather"]["calls"] == 1 and report["allgather"]["buffer_bytes"] == 16
    ring = Ring()
    assert ring.allreduce(np.ones(3)).tolist() == [1, 1, 1]


def test_unknown_collectives_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="use 'mpi' .* or 'ring'"):
        Comm(collectives="nccl")


def test_reductions_equal_the_library_within_tolerance_and_everywhere_the_same(world):
    n, results = world
    for name, ranks in cases(results):
        if ranks[0]["kind"] not in ("allreduce", "reduce_scatter"):
            continue
        for rank, r in enumerate(ranks):
            diff = float(np.abs(r["ring"] - r["mpi"]).max())
            assert diff <= TOLERANCE[r["itemsize"]], f"{name} N={n} rank {rank}: {diff:.1e}"
            assert r["ring_input_kept"] == r["mpi_input_kept"], f"{name}: input kept?"
        if ranks[0]["kind"] == "allreduce":
            assert ranks[0]["ring_same_everywhere"], f"{name} N={n}: ranks' means differ"


def test_allgather_and_bcast_equal_the_library_exactly(world):
    n, results = world
    for name, ranks in cases(results):
        if ranks[0]["kind"] in ("allgather", "bcast"):
            for rank, r in enumerate(ranks):
                assert np.array_equal(r["ring"], r["mpi"]), f"{name} N={n} rank {rank}"
                assert r["ring_same_everywhere"] and r["mpi_input_kept"] == r["ring_input_kept"]


def test_measured_bytes_and_messages_equal_the_ring_formula(world):
    n, results = world
    for name, ranks in cases(results):
        c = ranks[0]
        kind, full = c["kind"], c["length"] * c["itemsize"]
        for rank, r in enumerate(ranks):
            measured, counted = r["ring_traffic"][kind], r["mpi_traffic"][kind]
            assert measured["how"] == "measured" and counted["how"] == "counted"
            assert not measured["between_hosts"] and not counted["between_hosts"]  # one machine
            assert measured["calls"] == counted["calls"] == 1
            assert measured["buffer_bytes"] == counted["buffer_bytes"] == full
            if kind == "bcast":  # a chain: every rank but the root's left neighbour passes it on
                last = rank == (c["root"] - 1) % n
                want = (0, 0) if last or n == 1 else (1, full)
                assert (counted["messages"], counted["sent_bytes"]) == (
                    (n - 1) / n,
                    (n - 1) * full / n,
                )
            elif kind == "allreduce":
                want = (2 * (n - 1), ring_allreduce_bytes(c["length"], c["itemsize"], n, rank))
                if c["length"] % n == 0:
                    assert want[1] == 2 * (n - 1) * full / n
            else:  # allgather, reduce-scatter: padded buffers, (N-1)/N * F each in N-1 messages
                want = (n - 1, (n - 1) * full // n)
            assert (measured["messages"], measured["sent_bytes"]) == want, f"{name} N={n} r{rank}"
            if kind != "bcast":
                assert (counted["messages"], counted["sent_bytes"]) == pytest.approx(
                    (want[0], (n - 1) * full * (2 if kind == "allreduce" else 1) / n), rel=1e-12
                )
        # however uneven the chunks, the ranks together send the counted total: (N-1) copies
        total = sum(r["ring_traffic"][kind]["sent_bytes"] for r in ranks)
        assert total == pytest.approx(n * ranks[0]["mpi_traffic"][kind]["sent_bytes"], rel=1e-12)


def test_ring_on_lengths_n_does_not_divide(world):
    n, results = world
    for rank, rank_cases in enumerate(results["uneven"]):
        for c in rank_cases:
            assert c["reduce_scatter_diff"] <= TOLERANCE[8], f"length {c['length']} N={n}"
            assert c["allgather_equal"], f"length {c['length']} N={n} rank {rank}"
            sizes = [b - a for a, b in chunk_bounds(c["length"], n)]
            assert c["sent"]["reduce_scatter"] == (n - 1, 8 * (c["length"] - sizes[rank]))
            assert c["sent"]["allgather"] == (n - 1, 8 * (c["length"] - sizes[(rank + 1) % n]))


@cache
def single_reference(train_config):
    config = train_config.__class__(**(train_config.to_dict() | {"strategy": "single"}))
    history, strategy = run(ModelConfig(), config, data=Dataset.load())
    return history, strategy.full_params()


def test_every_strategy_with_ring_collectives_trains_the_same_model_as_single(world):
    n, results = world
    for name, r in results["train"].items():
        history, params = single_reference(r["train_config"])
        assert_same_as_single(f"{name} N={n}", r, history, params)


def test_training_traffic_is_measured_to_the_byte(world):
    """Per step: the loss's float64 allreduce, and per layer dp's allreduce of its gradient or
    the reduce-scatter and allgather(s) of its padded buffer."""
    n, results = world
    sizes = [
        sum(math.prod(s) for s in layer.shapes.values()) for layer in MLP(ModelConfig()).layers
    ]
    sizes = [s for s in sizes if s]  # a layer without parameters sends nothing
    padded = [4 * -(-s // n) * n for s in sizes]
    for name, r in results["train"].items():
        strategy, steps = r["train_config"].strategy, r["train_config"].steps
        for rank, traffic in enumerate(r["traffic"]):
            allreduce = ring_allreduce_bytes(1, 8, n, rank)  # the loss
            expected = {kind: (0, 0) for kind in traffic}
            if strategy == "dp":
                allreduce += sum(ring_allreduce_bytes(s, 4, n, rank) for s in sizes)
                expected["allreduce"] = (2 * (n - 1) * (len(sizes) + 1), allreduce)
            else:
                gathers = 2 if strategy == "zero3" else 1  # forward and backward
                share = sum(padded) * (n - 1) // n
                expected["allreduce"] = (2 * (n - 1), allreduce)
                expected["reduce_scatter"] = ((n - 1) * len(sizes), share)
                expected["allgather"] = ((n - 1) * len(sizes) * gathers, share * gathers)
            for kind, t in traffic.items():
                assert t["how"] == "measured"
                per_step = (t["messages"] / steps, t["sent_bytes"] / steps)
                assert per_step == expected[kind], f"{name} N={n} rank {rank} {kind}"
