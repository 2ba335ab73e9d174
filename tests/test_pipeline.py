"""Pipeline parallelism (fsdp_lesson/pipeline.py): placement and schedules without MPI, then
real pipelines under mpiexec (tests/pipeline_worker.py) against single-rank training: the same
model within 1e-5, every rank's ledger as the dry run predicts it to the byte, the sends counted
by hand, and a stage whose peer fails ending the job in seconds."""

import subprocess
import sys
import time
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from mpi_helpers import MPIEXEC, ROOT, worker_results

from fsdp_lesson.comm import Comm
from fsdp_lesson.config import ConfigError, ModelConfig, TrainConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.memory import MemoryLedger
from fsdp_lesson.model import MLP
from fsdp_lesson.optim import make_optimizer
from fsdp_lesson.pipeline import (
    Stage,
    bubble,
    chart,
    pipeline_step,
    schedule_ops,
    stages,
    unit_time_records,
)
from fsdp_lesson.plan import ledger_bytes
from fsdp_lesson.rng import make_rng
from fsdp_lesson.strategies import make_strategy
from fsdp_lesson.tensor import megatron
from fsdp_lesson.train import run
from fsdp_lesson.watchdog import peer_timeout_message

HERE = Path(__file__).parent

# --- without MPI: placement, schedules, the bubble, the memory the dry run predicts ----------


def names(blocks) -> list[str]:
    return [layer.name for block in blocks for layer in block]


def test_stages_place_blocks_as_the_c_program_at_p3_and_by_count_otherwise():
    model = MLP(ModelConfig())
    assert [names(s) for s in stages(model, 3)] == [["emb"], ["fc1", "relu1"], ["fc2"]]
    assert [names(s) for s in stages(model, 2)] == [["emb", "fc1", "relu1"], ["fc2"]]
    assert [names(s) for s in stages(model, 1)] == [["emb", "fc1", "relu1", "fc2"]]
    deep = MLP(ModelConfig(layers=2))
    assert [names(s) for s in stages(deep, 2)] == [["emb", "fc1", "relu1"], ["fc2", "relu2", "fc3"]]
    assert [names(s) for s in stages(deep, 3)] == [
        ["emb", "fc1", "relu1"],
        ["fc2", "relu2"],
        ["fc3"],
    ]


def test_more_stages_than_blocks_is_refused_with_the_most_it_can_take():
    with pytest.raises(ConfigError, match=r"--pp 4: the model has 3 blocks .* use --pp 3 or less"):
        stages(MLP(ModelConfig()), 4)


def test_a_stage_knows_what_it_receives_and_sends():
    model = MLP(ModelConfig())  # emb 16 x 16 tokens -> 256, hidden 64, vocabulary 27
    widths = [(Stage(model, 3, s).in_width, Stage(model, 3, s).out_width) for s in range(3)]
    assert widths == [(0, 256), (256, 64), (64, 27)]
    assert Stage(model, 3, 0).is_first and Stage(model, 3, 2).is_last


def test_a_stage_draws_every_layer_and_keeps_its_own():
    model = MLP(ModelConfig())
    whole = model.init_params(make_rng(42))
    rng = make_rng(42)
    mine = dict((layer.name, p) for layer, p in Stage(model, 3, 1).init_layers(rng))
    assert list(mine) == ["fc1", "relu1"]
    assert np.array_equal(mine["fc1"]["W"], whole["fc1"]["W"])
    after = make_rng(42)
    model.init_params(after)
    assert rng.uniform(4).tolist() == after.uniform(4).tolist()  # the same stream from here


@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("M", [1, 2, 4, 8])
def test_each_schedule_runs_every_op_once_and_holds_what_it_says(P, M):
    for s in range(P):
        gpipe, one_f_one_b = schedule_ops("gpipe", P, s, M), schedule_ops("1f1b", P, s, M)
        every = sorted((k, m) for k in "FB" for m in range(M))
        assert sorted(gpipe) == sorted(one_f_one_b) == every
        assert held(gpipe) == M and held(one_f_one_b) == min(P - s, M)


def held(ops) -> int:
    """The most micro-batches between their forward and their backward at once."""
    live = most = 0
    for kind, _ in ops:
        live += 1 if kind == "F" else -1
        most = max(most, live)
    return most


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("P", [2, 3, 4])
@pytest.mark.parametrize("M", [1, 4, 8])
def test_the_bubble_in_unit_time_is_p_minus_1_over_m_plus_p_minus_1(schedule, P, M):
    records = unit_time_records(schedule, P, M)
    span = max(record[-1][3] for record in records)
    for record in records:
        assert bubble(record, span) == pytest.approx((P - 1) / (M + P - 1))


def test_the_charts_of_the_docs():
    assert chart(unit_time_records("gpipe", 2, 4)) == (
        "stage 0 | F0 F1 F2 F3 .. .. B0 B1 B2 B3\nstage 1 | .. F0 F1 F2 F3 B0 B1 B2 B3 .."
    )
    assert chart(unit_time_records("1f1b", 3, 4)).splitlines() == [
        "stage 0 | F0 F1 F2 .. .. B0 F3 B1 .. B2 .. B3",
        "stage 1 | .. F0 F1 .. B0 F2 B1 F3 B2 .. B3 ..",
        "stage 2 | .. .. F0 B0 F1 B1 F2 B2 F3 B3 .. ..",
    ]
    docs = (ROOT / "docs" / "pipeline_parallelism.md").read_text()
    for schedule in ("gpipe", "1f1b"):
        for P in (2, 3):
            assert chart(unit_time_records(schedule, P, 4)) in docs, f"{schedule} P={P}"


def test_gpipe_holds_m_micro_batches_and_1f1b_at_most_p_minus_stage():
    """The dry run of each stage (plan.ledger_bytes): each micro-batch held from its forward to
    its backward adds what it keeps, and nothing else grows with M. At P = 3, per row, 16 tokens
    of 1 byte (stage 0), fc1's and relu1's inputs (256 + 64) x 4 bytes (stage 1), fc2's input
    and the dlogits (64 + 27) x 4 bytes (stage 2)."""
    model, b = ModelConfig(), 4  # rows per micro-batch
    kept = [16 * b, (256 + 64) * 4 * b, (64 + 27) * 4 * b]
    for s in range(3):
        one = ledger_bytes("single", model, 1, "sgd", b, pp=3, stage=s)
        for M in (1, 2, 4, 8):
            for schedule, held in (("gpipe", M), ("1f1b", min(3 - s, M))):
                pipeline = dict(pp=3, stage=s, micro_batches=M, schedule=schedule)
                peaks = ledger_bytes("single", model, 1, "sgd", b * M, **pipeline)
                assert peaks == one | {"activations": one["activations"] + (held - 1) * kept[s]}


def test_a_pipeline_step_refuses_pieces_that_do_not_fit():
    model = MLP(ModelConfig())
    stage = Stage(model, 1, 0)
    optimizer, ledger = make_optimizer("sgd", 0.1), MemoryLedger()
    strategy = make_strategy("single", stage, optimizer, Comm(), ledger, accum=1)
    strategy.init_params(make_rng(42))
    X, Y = np.zeros((8, 16), np.uint8), np.zeros(8, np.int64)
    with pytest.raises(ConfigError, match="build the strategy with accum=4"):
        pipeline_step(stage, strategy, Comm(), X, Y, micro_batches=4)
    with pytest.raises(ConfigError, match=r"Stage\(model, mesh.pp.size, mesh.pp.rank\)"):
        pipeline_step(Stage(model, 3, 0), strategy, Comm(), X, Y)
    assert pipeline_step(stage, strategy, Comm(), X, Y) > 0  # one stage: train_step's work


def test_one_stage_trains_as_single():
    """P = 1: pipeline_step is train_step (the same ops in the same order), bit for bit."""
    from fsdp_lesson.data import GlobalBatchSampler

    history, reference = single_reference(1, "sgd", 5, 24)
    tc = TrainConfig()
    model, data, rng = MLP(ModelConfig()), Dataset.load(), make_rng(tc.seed)
    stage = Stage(model, 1, 0)
    optimizer = make_optimizer("sgd", tc.lr)
    strategy = make_strategy("single", stage, optimizer, Comm(), MemoryLedger())
    strategy.init_params(rng)
    sampler = GlobalBatchSampler(data.X_train, data.Y_train, 24, rng)
    losses = [pipeline_step(stage, strategy, Comm(), *sampler.next_slice(0, 1)) for _ in range(5)]
    assert losses == history.losses.tolist()
    for layer, p in strategy.full_params().items():
        for k, v in p.items():
            assert np.array_equal(v, reference[layer][k])


def test_a_one_rank_comm_has_no_peer_and_reports_no_sends():
    comm = Comm()
    with pytest.raises(ValueError, match="no other rank to send to"):
        comm.send(np.zeros(2), 1)
    assert "send" not in comm.traffic_report()  # listed once some were made


def test_a_point_to_point_timeout_names_the_peer():
    line = peer_timeout_message(1, "recv (pp) from rank 0", "of step 3", 3.2, 3, 0, "stopped")
    assert line == (
        "rank 1: recv (pp) from rank 0 of step 3 waited 3 s; rank 0 (stopped) has not sent it:"
        " every rank stops now (exit code 4, --timeout 3)"
    )
    far = peer_timeout_message(0, "send to rank 5", "", 9, 5, 5, None)
    assert "rank 5 (on another host, not checked) has not received it" in far


# --- under mpiexec ------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 3, 4], ids=lambda n: f"N{n}")
def world(request, tmp_path_factory):
    return request.param, worker_results(request.param, "pipeline_worker.py", tmp_path_factory)


@cache
def single_reference(layers: int, optimizer: str, steps: int, batch: int):
    config = TrainConfig(
        strategy="single", optimizer=optimizer, steps=steps, batch=batch, eval_batches=0, samples=0
    )
    history, strategy = run(ModelConfig(layers=layers), config, comm=Comm(), data=Dataset.load())
    return history, strategy.full_params()


def assert_trains_as_single(name: str, r: dict, atol: float = 1e-5) -> None:
    c = r["case"]
    history, params = single_reference(c["layers"], c["optimizer"], c["steps"], c["batch"])
    diff = np.abs(np.asarray(r["losses"]) - history.losses).max()
    assert diff <= atol, f"{name}: loss differs by {diff:.1e}"
    assert list(r["params"]) == list(params), f"{name}: layers {list(r['params'])}"
    for layer, p in params.items():
        for k, v in p.items():
            diff = np.abs(r["params"][layer][k] - v).max()
            assert diff <= atol, f"{name}: {layer}.{k} differs by {diff:.1e}"


@pytest.mark.mpi
def test_every_pipeline_trains_the_same_model_as_single(world):
    n, results = world
    assert results, f"no case on {n} ranks"
    for name, r in results.items():
        assert_trains_as_single(name, r)


def stage_of(case: dict, stage: int) -> Stage:
    """A rank's Stage as the worker built it; under --tp with a stand-in for mesh.tp (the
    pieces' shapes need only its size and rank, alike on every tensor-parallel rank here)."""
    tp = SimpleNamespace(size=case["tp"], rank=0) if case["tp"] > 1 else None
    return Stage(MLP(ModelConfig(layers=case["layers"]), megatron(tp)), case["pp"], stage)


def rows_per_rank(case: dict) -> int:
    return case["batch"] * case["pp"] * case["tp"] // case["n"]  # B / dp


def check_ledgers(results: dict) -> None:
    """Every rank's ledger peaks, every category, as plan.ledger_bytes predicts for its stage."""
    for name, r in results.items():
        c = r["case"]
        dp = c["n"] // (c["tp"] * c["pp"])
        for rank, mine in enumerate(r["per_rank"]):
            want = ledger_bytes(
                c["strategy"],
                ModelConfig(layers=c["layers"]),
                dp,
                c["optimizer"],
                rows_per_rank(c),
                tp=c["tp"],
                pp=c["pp"],
                stage=mine["stage"],
                micro_batches=c["micro_batches"],
                schedule=c["schedule"],
                recompute=c["recompute"],
            )
            assert mine["peak"] == want, f"{name} rank {rank}"


@pytest.mark.mpi
def test_every_ranks_ledger_is_predicted_to_the_byte(world):
    check_ledgers(world[1])


def sends(traffic: dict) -> tuple:
    """(calls, messages, sent bytes) of every "send" key of a rank's report ("send (pp)")."""
    kinds = [t for kind, t in traffic.items() if kind.split(" (")[0] == "send"]
    return tuple(sum(t[f] for t in kinds) for f in ("calls", "messages", "sent_bytes"))


def check_sends(results: dict) -> None:
    """Per step, a stage sends M micro-batches' activations (B/M rows x its output width x 4
    bytes) on and M gradients (B/M rows x its input width x 4 bytes) back."""
    for name, r in results.items():
        c = r["case"]
        b, M = rows_per_rank(c) // c["micro_batches"], c["micro_batches"]
        for rank, mine in enumerate(r["per_rank"]):
            stage = stage_of(c, mine["stage"])
            forward = 0 if stage.is_last else M * b * stage.out_width * 4
            backward = 0 if stage.is_first else M * b * stage.in_width * 4
            messages = M * ((not stage.is_last) + (not stage.is_first))
            want = (messages * c["steps"], messages * c["steps"], (forward + backward) * c["steps"])
            assert sends(mine["traffic"]) == want, f"{name} rank {rank}"
            for kind, t in mine["traffic"].items():
                assert kind.split(" (")[0] != "send" or t["how"] == "measured"


@pytest.mark.mpi
def test_sends_are_counted_as_by_hand_and_alike_in_mpi_and_ring_mode(world):
    _, results = world
    check_sends(results)
    if "p2-m4-1f1b-ring" in results:  # the same per step in either mode
        ring, mpi = results["p2-m4-1f1b-ring"], results["p2-m4-1f1b"]
        for a, b in zip(ring["per_rank"], mpi["per_rank"], strict=True):
            per_step_ring = [x / ring["case"]["steps"] for x in sends(a["traffic"])]
            assert per_step_ring == [x / mpi["case"]["steps"] for x in sends(b["traffic"])]


@pytest.mark.mpi
def test_the_record_follows_the_schedule_and_shows_a_bubble(world):
    _, results = world
    for name, r in results.items():
        c = r["case"]
        for mine in r["per_rank"]:
            ops = [(kind, m) for m, kind, _, _ in mine["record"]]
            assert ops == schedule_ops(c["schedule"], c["pp"], mine["stage"], c["micro_batches"])
            assert all(0 <= a <= b for _, _, a, b in mine["record"]), name
            assert 0 <= bubble(mine["record"]) < 1


@pytest.mark.mpi
def test_tp2_pp2_zero2_on_eight_ranks_trains_as_single(tmp_path_factory):
    """--tp 2 --pp 2 --strategy zero2 --micro-batches 2, both schedules: stage 0 sends each
    tensor-parallel rank's 32 of relu1's 64 columns to the same rank of stage 1."""
    results = worker_results(8, "pipeline_worker.py", tmp_path_factory, timeout=600)
    assert results
    for name, r in results.items():
        assert_trains_as_single(name, r)
    check_ledgers(results)
    check_sends(results)


# --- a stage whose peer fails: the job ends everywhere, in seconds ---------------------------


def failing(mode: str, rank: int, step: int) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    result = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, str(HERE / "pipeline_worker.py"), mode, str(rank)]
        + [str(step)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
    )
    return result, time.monotonic() - start


@pytest.mark.mpi
def test_a_stage_whose_peer_raises_ends_every_rank_in_seconds():
    result, took = failing("raise", 1, 3)
    assert took < 15 and result.returncode != 0
    assert result.stderr.count("rank 1: RuntimeError: injected failure (a bug on one stage)") == 1


@pytest.mark.mpi
def test_a_stage_whose_peer_stops_times_out_naming_the_peer():
    result, took = failing("stop", 0, 3)
    assert took < 20 and result.returncode == 4, result.stderr
    line = "rank 1: recv from rank 0 of step 3 waited 3 s; rank 0 (stopped) has not sent it"
    assert result.stderr.count(line) == 1, result.stderr
    assert "Traceback" not in result.stderr
