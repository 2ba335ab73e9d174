"""Tensor parallelism (fsdp_lesson/tensor.py): the layers at T = 1 against model.Linear, then
under real `mpiexec` (tests/tp_worker.py, one launch per N) every mesh against single-rank
training, the ledger against its prediction, the traffic of the tp dimension by hand, the
refusals, and --c-compat against the C program's printed losses."""

import pickle
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from mpi_helpers import assert_prints_the_c_programs, assert_same_as_single, mpiexec

from fsdp_lesson.comm import Comm
from fsdp_lesson.config import ModelConfig, TrainConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.dryrun import dry_run
from fsdp_lesson.model import MLP, Linear, ReLU
from fsdp_lesson.placement import piece_range
from fsdp_lesson.strategies import strategy_options
from fsdp_lesson.tensor import ColumnParallelLinear, RowParallelLinear, megatron
from fsdp_lesson.train import memory_options, run

HERE = Path(__file__).parent


# --- the layers, in one process ------------------------------------------------------------


@pytest.mark.parametrize("cls", [ColumnParallelLinear, RowParallelLinear])
def test_a_split_linear_on_one_rank_is_model_linear(cls):
    rng = np.random.default_rng(0)
    whole = {"W": rng.standard_normal((5, 7), np.float32), "b": rng.standard_normal(7, np.float32)}
    x, dy = rng.standard_normal((3, 5), np.float32), rng.standard_normal((3, 7), np.float32)
    plain, split = Linear("fc", 5, 7), cls("fc", 5, 7, Comm())
    assert split.shapes == split.whole_shapes == plain.shapes
    p = split.piece(whole)
    y, cache_ = split.forward(p, x)
    np.testing.assert_array_equal(y, plain.forward(whole, x)[0])
    g, g_plain = (
        {k: np.empty_like(v) for k, v in p.items()},
        {k: np.empty_like(v) for k, v in p.items()},
    )
    np.testing.assert_array_equal(
        split.backward(p, cache_, dy, g), plain.backward(whole, x, dy, g_plain)
    )
    for k in g:
        np.testing.assert_array_equal(g[k], g_plain[k])
        np.testing.assert_array_equal(split.whole(p)[k], whole[k])


def test_pieces_are_padded_columns_and_rows():
    """hidden 63 on T = 2: pieces of 32, the last one's final column (row) is zero padding."""
    last = SimpleNamespace(size=2, rank=1)  # what the layers read of a Comm before they talk
    assert piece_range(63, last.size, last.rank) == (32, 63, 32)
    whole = {"W": np.ones((4, 63), np.float32), "b": np.ones(63, np.float32)}
    column = ColumnParallelLinear("fc1", 4, 63, last).piece(whole)
    assert (
        column["W"].shape == (4, 32) and column["W"][:, :31].all() and not column["W"][:, 31:].any()
    )
    assert column["b"].shape == (32,) and not column["b"][31:].any()
    row = RowParallelLinear("fc2", 63, 4, last).piece(
        {"W": np.ones((63, 4), np.float32), "b": np.ones(4)}
    )
    assert row["W"].shape == (32, 4) and not row["W"][31:].any() and row["b"].shape == (4,)


@pytest.mark.parametrize(
    "layers, kinds",
    [
        (1, ["column", "row"]),  # the C program's: fc1 column, the output fc2 row
        (2, ["column", "row", "whole"]),  # the output layer has no partner: replicated
        (3, ["column", "row", "column", "row"]),
    ],
)
def test_megatron_pairs_the_linears(layers, kinds):
    kind = {ColumnParallelLinear: "column", RowParallelLinear: "row", Linear: "whole"}
    model = MLP(ModelConfig(layers=layers), megatron(SimpleNamespace(size=2, rank=0)))
    linears = [layer for layer in model.layers[1:] if not isinstance(layer, ReLU)]
    assert [kind[type(layer)] for layer in linears] == kinds
    assert model.num_params == MLP(ModelConfig(layers=layers)).num_params  # the whole model's


# --- under mpiexec ---------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"N{n}")
def world(request, tmp_path_factory):
    n = request.param
    out = tmp_path_factory.mktemp(f"tp{n}") / "results.pkl"
    result = mpiexec(n, str(HERE / "tp_worker.py"), str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    return n, pickle.loads(out.read_bytes())


@cache
def single_reference(model_config, train_config):
    """The same model and steps trained by strategy single on one rank, in this process."""
    config = TrainConfig(**(train_config.to_dict() | {"strategy": "single", "tp": 1}))
    history, strategy = run(model_config, config, data=Dataset.load())
    return history, strategy.full_params()


def test_every_mesh_trains_the_same_model_as_single(world):
    n, results = world
    for name, r in results.items():
        history, params = single_reference(r["model_config"], r["train_config"])
        assert_same_as_single(f"{name} at N={n}", r, history, params)
        assert all(rank["padding_is_zero"] for rank in r["per_rank"]), name


def test_every_ranks_ledger_is_the_prediction_to_the_byte(world):
    n, results = world
    for name, r in results.items():
        tc, mc = r["train_config"], r["model_config"]
        dp = n // tc.tp
        options = memory_options(tc) | strategy_options(tc.strategy, tc)
        predicted = dry_run(tc.strategy, mc, dp, tc.optimizer, tc.batch // dp, tp=tc.tp, **options)
        for rank, report in enumerate(r["per_rank"]):
            assert report["memory"]["peak"] == predicted.peak, f"{name} N={n} rank {rank}"


def test_split_parameters_by_hand():
    """--tp 2 on the seed's model: each rank keeps the embedding and fc2's bias whole, half of
    fc1's columns and half of fc2's rows; initialisation holds fc1 whole beside its piece."""
    c, T = ModelConfig(), 2
    ledger = dry_run("single", c, 1, "sgd", 32, tp=T)
    S, E, H, V = c.seq_len, c.emb, c.hidden, c.vocab_size
    assert ledger.peak["params"] == 4 * (V * E + S * E * H // T + H // T + H // T * V + V)
    assert ledger.peak["buffers"] == 4 * (S * E * H + H) * (1 + 1 / T)


def tp_allreduce_bytes(mc: ModelConfig, tc: TrainConfig, n: int) -> float:
    """What one rank sends over tp per step in the ring model: f's backward allreduces a column
    layer's dx (B/D, in), g's forward a row layer's output (B/D, out), 2 (T-1)/T of each."""
    rows, T = tc.batch // (n // tc.tp), tc.tp
    model = MLP(mc, megatron(SimpleNamespace(size=T, rank=0)))
    widths = [
        layer.whole_shapes["W"][0]
        if isinstance(layer, ColumnParallelLinear)
        else layer.shapes["W"][1]
        for layer in model.layers
        if layer.split
    ]
    return 2 * (T - 1) / T * 4 * rows * sum(widths)


def test_tp_traffic_is_counted_and_measured_as_by_hand(world):
    n, results = world
    for name, r in results.items():
        tc = r["train_config"]
        key = "allreduce" if tc.tp == n else "allreduce (tp)"  # tp is the world, or a split of it
        want = tp_allreduce_bytes(r["model_config"], tc, n)
        for rank, report in enumerate(r["per_rank"]):
            traffic = report["traffic"][key]
            assert traffic["how"] == ("measured" if r["collectives"] == "ring" else "counted")
            assert traffic["sent_bytes"] / tc.steps == pytest.approx(want, rel=1e-12), (
                f"{name} N={n} rank {rank}"
            )


def test_the_strategy_runs_over_the_data_parallel_ranks(world):
    """--tp 2 at N = 4: dp's allreduce of the (local) gradients goes over 2 ranks, not 4."""
    n, results = world
    if n != 4:
        pytest.skip("data parallelism beside tp needs N > T")
    r = results["tp2-dp-sgd"]
    local = sum(
        int(np.prod(s))
        for layer in MLP(ModelConfig(), megatron(SimpleNamespace(size=2, rank=0))).layers
        for s in layer.shapes.values()
    )
    want = 2 * (2 - 1) / 2 * (4 * local + 8)  # the gradients and the logged loss
    for report in r["per_rank"]:
        assert report["traffic"]["allreduce (dp)"]["sent_bytes"] / 30 == pytest.approx(want)


def test_a_bad_tp_is_refused_on_every_rank_without_hang():
    result = mpiexec(2, "-m", "fsdp_lesson", "train", "--tp", "3", "--steps", "2", timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("--tp 3 --pp 1 need a multiple of 3 ranks") == 1
    assert "Traceback" not in result.stderr and "step:" not in result.stdout


def test_c_compat_tp_prints_the_c_programs_losses():
    """train_tp.c reduces the row layer's output and the embedding's gradient with a mean
    (docs/seed_semantics.md, "The TP program"): --c-compat --tp 2 follows it, samples too."""
    assert_prints_the_c_programs(2, ["--tp", "2"], "tp")
