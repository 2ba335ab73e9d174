"""Every strategy under real `mpiexec -n N` (N = 1, 2, 3, 4) against single-rank training.

One mpiexec per N runs all strategies (tests/mpi_worker.py); the tests compare what it
wrote with `single` computed here: equivalence, memory to the byte, traffic to the byte.
"""

import json
import math
import re
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from mpi_helpers import assert_same_as_single, mpiexec, worker_results

from fsdp_lesson.config import ModelConfig, TrainConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.model import MLP
from fsdp_lesson.plan import ledger_bytes
from fsdp_lesson.train import run

HERE = Path(__file__).parent
WORLD_SIZES = [1, 2, 3, 4]
pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"N{n}")
def world(request, tmp_path_factory):
    return request.param, worker_results(request.param, "mpi_worker.py", tmp_path_factory)


@cache
def single_reference(model_config, train_config):
    """The same run with strategy single, in this process."""
    config = train_config.__class__(**(train_config.to_dict() | {"strategy": "single"}))
    history, strategy = run(model_config, config, data=Dataset.load())
    return history, strategy.full_params()


def equivalence_runs(results):
    return [name for name in results if not name.endswith("-wide")]


def test_every_strategy_trains_the_same_model_as_single(world):
    n, results = world
    for name in equivalence_runs(results):
        r = results[name]
        history, params = single_reference(r["model_config"], r["train_config"])
        assert_same_as_single(f"{name} at N={n}", r, history, params)


def layer_sizes(model_config) -> list[int]:
    return [sum(math.prod(s) for s in layer.shapes.values()) for layer in MLP(model_config).layers]


def padded(size: int, n: int) -> int:
    return -(-size // n) * n


def expected_state_bytes(strategy: str, model_config, n: int, optimizer: str) -> dict:
    """docs/zero_formulas.md, per rank, in bytes; Ψ_pad pads every layer to a multiple of N."""
    sizes = layer_sizes(model_config)
    psi, psi_pad = sum(sizes), sum(padded(s, n) for s in sizes)
    largest = max(padded(s, n) for s in sizes)
    opt = 8 if optimizer == "adam" else 0
    init = 4 * max(sizes)  # initialisation's transient: one layer's values at a time
    return {
        "dp": dict(params=4 * psi, grads=4 * psi, optimizer=opt * psi, buffers=init),
        "zero1": dict(
            params=4 * psi_pad, grads=4 * psi_pad, optimizer=opt * psi_pad // n, buffers=init
        ),
        "zero2": dict(
            params=4 * psi_pad,
            grads=4 * psi_pad // n,
            optimizer=opt * psi_pad // n,
            buffers=max(4 * largest, init),
        ),  # the reused transient full-gradient buffer, allocated after initialisation
        "zero3": dict(
            params=4 * psi_pad // n,
            grads=4 * psi_pad // n,
            optimizer=opt * psi_pad // n,
            buffers=max(init, zero3_gathered(sizes, n)),
        ),  # gathered parameters and full gradients, as they come and go
    }[strategy]


def zero3_gathered(sizes: list[int], n: int) -> int:
    """zero3's default (one layer per unit, prefetch): the most full bytes up at once.

    Forward: layer i and the prefetched next one. Backward: layer i's parameters and
    gradient, the previous layer's prefetched parameters, the next one's gradient in flight.
    """
    full = [4 * padded(s, n) for s in sizes if s]
    forward = max(a + b for a, b in zip(full, full[1:] + [0], strict=True))
    backward = max(
        2 * full[i] + (full[i - 1] if i else 0) + (full[i + 1] if i + 1 < len(full) else 0)
        for i in range(len(full))
    )
    return max(forward, backward)


def test_ledger_equals_the_zero_accounting_to_the_byte(world):
    n, results = world
    for name, r in results.items():
        tc, mc = r["train_config"], r["model_config"]
        expected = expected_state_bytes(tc.strategy, mc, n, tc.optimizer)
        for rank, report in enumerate(r["per_rank"]):
            peak = {k: report["memory"]["peak"][k] for k in expected}
            assert peak == expected, f"{name} N={n} rank {rank}"


def test_activations_do_not_depend_on_the_stage(world):
    n, results = world
    peaks = {}  # model config -> activation peaks of every strategy and rank
    for r in results.values():
        peaks.setdefault(r["model_config"], set()).update(
            report["memory"]["peak"]["activations"] for report in r["per_rank"]
        )
    assert all(len(p) == 1 for p in peaks.values()), peaks
    # the seed's model peaks at fc1's backward: tokens, fc1's cached input, relu's dx, fc1's dx
    c, b = ModelConfig(), 24 // n
    expected = b * c.seq_len + 2 * 4 * b * c.seq_len * c.emb + 4 * b * c.hidden
    assert peaks[ModelConfig()] == {expected}


def test_tracemalloc_agrees_with_the_ledger_within_5_percent(world):
    n, results = world
    traced_runs = [name for name in results if name.endswith("-wide")]
    assert len(traced_runs) == 4  # dp, zero1, zero2, zero3 ran under tracemalloc
    for name in traced_runs:
        for rank, report in enumerate(results[name]["per_rank"]):
            ledger = report["memory"]["peak_total"]
            traced = report["memory"]["tracemalloc_peak"]  # a KeyError if it was not traced
            assert abs(traced - ledger) <= 0.05 * ledger, (
                f"{name} N={n} rank {rank}: {traced} vs {ledger}"
            )


def test_traffic_per_step_equals_the_formula(world):
    n, results = world
    ring = (n - 1) / n
    loss = 8  # the logged loss: one float64 allreduce per step
    for name, r in results.items():
        tc = r["train_config"]
        sizes = layer_sizes(r["model_config"])
        psi4, psi_pad4 = 4 * sum(sizes), 4 * sum(padded(s, n) for s in sizes)
        expected = {
            "dp": {"allreduce": 2 * ring * (psi4 + loss)},
            "zero1": {
                "allreduce": 2 * ring * loss,
                "reduce_scatter": ring * psi_pad4,
                "allgather": ring * psi_pad4,
            },
            "zero3": {
                "allreduce": 2 * ring * loss,
                "reduce_scatter": ring * psi_pad4,
                "allgather": 2 * ring * psi_pad4,
            },
        }
        expected["zero2"] = expected["zero1"]
        for rank, report in enumerate(r["per_rank"]):
            for kind, traffic in report["traffic"].items():
                per_step = traffic["sent_bytes"] / tc.steps
                want = expected[tc.strategy].get(kind, 0.0)
                assert per_step == pytest.approx(want, rel=1e-12, abs=1e-9), (
                    f"{name} N={n} rank {rank} {kind}"
                )


def test_sampling_broadcasts_one_int_per_token(world):
    n, results = world
    r = results["zero3-sgd"]
    tokens = sum(len(name) + 1 for name in r["names"])  # its letters and the final '.'
    for report in r["per_rank"]:
        bcast = report["after"]["bcast"]
        assert bcast["calls"] == tokens and bcast["buffer_bytes"] == 4 * tokens
        assert bcast["sent_bytes"] == pytest.approx(4 * tokens * (n - 1) / n)


@pytest.mark.parametrize("strategy", ["dp", "zero3"])
def test_batch_not_divisible_is_refused_on_every_rank_without_hang(strategy):
    result = mpiexec(
        4, "-m", "fsdp_lesson", "train", "--strategy", strategy, "--batch", "30", timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.count("global batch 30 is not divisible by 4 ranks") == 1
    assert "Traceback" not in result.stderr and "step:" not in result.stdout


def test_c_compat_dp_follows_the_c_trace():
    result = mpiexec(
        2,
        "-m",
        "fsdp_lesson",
        "train",
        "--strategy",
        "dp",
        "--c-compat",
        "--steps",
        "500",
        "--log-every",
        "1",
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    losses = [
        float(line.split("loss ")[1])
        for line in result.stdout.splitlines()
        if line.startswith("step:")
    ]
    rows = [
        line.split()
        for line in (HERE / "fixtures" / "c_reference_losses.txt").read_text().splitlines()
        if not line.startswith("#")
    ]
    expected = np.array([float(loss) for _, loss in rows[:500]])
    assert len(losses) == 500
    assert np.abs(np.array(losses) - expected).max() <= 1e-5


def test_cli_out_has_per_rank_memory_and_traffic(tmp_path):
    result = mpiexec(
        2,
        "-m",
        "fsdp_lesson",
        "train",
        "--strategy",
        "zero2",
        "--steps",
        "20",
        "--optimizer",
        "adam",
        "--out",
        str(tmp_path),
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    history = json.loads((tmp_path / "history.json").read_text())
    assert (
        history["world_size"] == 2 and len(history["memory"]) == 2 and len(history["traffic"]) == 2
    )
    adam_shard = 8 * sum(padded(s, 2) for s in layer_sizes(ModelConfig())) // 2
    assert all(rank["peak"]["optimizer"] == adam_shard for rank in history["memory"])
    params = np.load(tmp_path / "params.npz")
    assert params["fc1.W"].shape == (256, 64)


def test_cli_out_has_every_ranks_trace(tmp_path):
    """--trace-step S: history.json holds each rank's compute and collective spans of step S,
    in rank order, as the README says (not rank 0's alone)."""
    args = ["-m", "fsdp_lesson", "train", "--strategy", "zero3", "--steps", "4"]
    args += ["--trace-step", "2", "--samples", "0", "--out", str(tmp_path)]
    result = mpiexec(2, *args, timeout=120)
    assert result.returncode == 0, result.stderr
    traces = json.loads((tmp_path / "history.json").read_text())["trace"]
    assert len(traces) == 2 and all(traces), "one non-empty list of spans per rank"
    for trace in traces:
        assert {"compute", "comm"} <= {lane for lane, *_ in trace}, trace[:3]


def test_zero3_gathers_rise_and_fall_at_most_two_layers_at_a_time(world):
    """With prefetch, a layer's full parameters are held from its gather (or prefetch) to its
    release: forward emb, fc1, fc2 and backward fc2, fc1, emb; ReLUs gather nothing."""
    n, results = world
    for name in ("zero3-sgd", "zero3-adam"):
        timeline = results[name]["timeline"]
        gathers, up = [], set()
        sizes = dict(zip(["emb", "fc1", "relu1", "fc2"], layer_sizes(ModelConfig()), strict=True))
        for (event, live), (_, before) in zip(timeline[1:], timeline, strict=False):
            kind, _, label = event.partition(" ")
            if label.endswith(" gathered"):
                layer = label.removesuffix(" gathered")
                if kind == "hold":
                    gathers.append(layer)
                    up.add(layer)
                    assert len(up) <= 2, f"{name} N={n}: {sorted(up)} gathered at once"
                else:
                    up.remove(layer)
                sign = 1 if kind == "hold" else -1
                assert live - before == sign * 4 * padded(sizes[layer], n), event
        assert gathers == ["emb", "fc1", "fc2", "fc2", "fc1", "emb"], gathers
        assert not up


def test_memory_rises_and_falls_over_a_step(world):
    n, results = world
    for name in ("dp-sgd", "zero3-sgd"):
        timeline = results[name]["timeline"]
        live = [bytes_ for _, bytes_ in timeline]
        start, peak = live[0], max(live)
        assert live[-1] == start  # every activation freed by the end of the step
        assert peak > start  # activations were held in between
        events = [e for e, _ in timeline]
        forward_end = events.index("hold fc2")  # the last layer's cache: forward is done
        if name == "dp-sgd":  # (zero3's gathered layers come and go on top of it)
            assert max(live[: forward_end + 1]) == live[forward_end]  # rises through forward
        # the run's peak may be at initialisation instead: the state and one layer's values
        assert peak <= max(r["memory"]["peak_total"] for r in results[name]["per_rank"])


def test_the_planner_predicts_every_ledger_to_the_byte(world):
    n, results = world
    for name, r in results.items():
        tc = r["train_config"]
        predicted = ledger_bytes(tc.strategy, r["model_config"], n, tc.optimizer, tc.batch // n)
        for rank, report in enumerate(r["per_rank"]):
            assert report["memory"]["peak"] == predicted, f"{name} N={n} rank {rank}"


def test_memory_budget_refuses_dp_and_lets_zero3_train():
    model = ["--hidden", "512", "--layers", "8", "--optimizer", "adam", "--steps", "3"]
    model += ["--eval-batches", "2", "--samples", "1"]
    budget = ["--memory-budget-mb", "25"]
    dp = mpiexec(4, "-m", "fsdp_lesson", "train", "--strategy", "dp", *model, *budget, timeout=120)
    assert dp.returncode == 2
    assert dp.stderr.count("error: this run would need 31.6 MiB per rank (dp on 4 ranks") == 1
    assert "more than the budget of 25 MiB: --strategy zero1 would fit" in dp.stderr, dp.stderr
    zero3 = mpiexec(
        4, "-m", "fsdp_lesson", "train", "--strategy", "zero3", *model, *budget, timeout=120
    )
    assert zero3.returncode == 0, zero3.stderr
    assert "Final validation loss" in zero3.stdout


def test_zero3_past_four_ranks_eight_oversubscribed(tmp_path):
    """The sharding logic at N=8 (more ranks than cores): the CLI's params equal single's."""
    args = [
        "--strategy",
        "zero3",
        "--optimizer",
        "adam",
        "--steps",
        "20",  # a wrong shard at N = 8 shows at the first step
        "--eval-batches",
        "2",
        "--samples",
        "2",
        "--log-every",
        "1",
        "--out",
        str(tmp_path),
    ]
    result = mpiexec(8, "-m", "fsdp_lesson", "train", *args, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    config = TrainConfig(optimizer="adam", steps=20, eval_batches=2, samples=2)
    history, strategy = run(ModelConfig(), config, data=Dataset.load())
    saved = np.load(tmp_path / "params.npz")
    for layer, p in strategy.full_params().items():
        for k, v in p.items():
            assert np.abs(saved[f"{layer}.{k}"] - v).max() <= 1e-5, f"{layer}.{k}"
    logged = json.loads((tmp_path / "history.json").read_text())
    assert logged["world_size"] == 8 and len(logged["memory"]) == 8
    assert np.abs(np.array(logged["losses"]) - history.losses).max() <= 1e-5


def test_padding_stays_zero(world):
    n, results = world
    for name, r in results.items():
        assert all(report["padding_is_zero"] for report in r["per_rank"]), f"{name} N={n}"


def test_each_strategy_shards_what_it_declares(world):
    """The sharding table (sharding.py) is this literal table, and every rank allocates by it."""
    from fsdp_lesson.sharding import SHARD_LEVEL, is_sharded

    n, results = world
    if n == 1:
        pytest.skip("one rank: a shard is the whole vector, so sharding cannot be seen")
    table = {  # params, grads, optimizer: sharded?
        "dp": (False, False, False),
        "zero1": (False, False, True),
        "zero2": (False, True, True),
        "zero3": (True, True, True),
    }
    for name, r in results.items():
        tc, sizes = r["train_config"], layer_sizes(r["model_config"])
        expected = table[tc.strategy]
        level = SHARD_LEVEL[tc.strategy]
        assert tuple(is_sharded(level, c) for c in ("params", "grads", "optimizer")) == expected
        full = 4 * (sum(sizes) if tc.strategy == "dp" else sum(padded(s, n) for s in sizes))
        shard = 4 * sum(padded(s, n) for s in sizes) // n
        per_param = {"params": 1, "grads": 1, "optimizer": 2 if tc.optimizer == "adam" else 0}
        for rank, report in enumerate(r["per_rank"]):
            peak = report["memory"]["peak"]
            for category, sharded in zip(("params", "grads", "optimizer"), expected, strict=True):
                want = per_param[category] * (shard if sharded else full)
                assert peak[category] == want, f"{name} N={n} rank {rank} {category}"


GATHER_TO_ROOT = """
import numpy as np
from fsdp_lesson.comm import Comm
from fsdp_lesson.config import ModelConfig, TrainConfig
from fsdp_lesson.train import run
comm = Comm.world()
_, strategy = run(ModelConfig(), TrainConfig(strategy="zero3", steps=2, batch=24, eval_batches=0,
                                             samples=0), comm=comm)
everywhere, at_root = strategy.full_params(), strategy.full_params(root=0)
same = all(np.array_equal(at_root[layer][k], v) for layer, p in everywhere.items()
           for k, v in p.items()) if comm.rank == 0 else at_root == {}
print(f"rank {comm.rank}: {same}", flush=True)
"""


@pytest.mark.parametrize("n", [2, 3])
def test_full_params_to_the_root_gathers_there_only(n):
    """The end of a run writes params.npz from rank 0's copy: the other ranks keep nothing."""
    result = mpiexec(n, "-c", GATHER_TO_ROOT, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    said = sorted(re.findall(r"rank \d+: (?:True|False)", result.stdout))  # lines may run together
    assert said == [f"rank {r}: True" for r in range(n)]
