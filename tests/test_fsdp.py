"""zero3 as FSDP runs it, under real `mpiexec -n N` (N = 1..4): sharded initialisation, units,
prefetch, reshard-after-forward and hybrid sharding, each against single and the planner."""

from functools import cache
from pathlib import Path

import numpy as np
import pytest
from mpi_helpers import assert_prints_the_c_programs, mpiexec, worker_results

from fsdp_lesson.config import ModelConfig, TrainConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.model import MLP
from fsdp_lesson.plan import ledger_bytes
from fsdp_lesson.rng import make_rng
from fsdp_lesson.strategies.zero3 import make_units
from fsdp_lesson.train import run

HERE = Path(__file__).parent
OPTIONS = ("layers_per_unit", "prefetch", "reshard_after_forward", "replicate")
pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda n: f"N{n}")
def world(request, tmp_path_factory):
    return request.param, worker_results(request.param, "fsdp_worker.py", tmp_path_factory)


@cache
def single_reference(model_config, train_config):
    config = TrainConfig(**{k: v for k, v in train_config.to_dict().items() if k not in OPTIONS})
    config = TrainConfig(**(config.to_dict() | {"strategy": "single"}))
    history, strategy = run(model_config, config, data=Dataset.load())
    return history.losses, strategy.full_params()


def trained(results):
    return {name: r for name, r in results.items() if not name.startswith("init-")}


def test_sharded_init_is_the_full_init_sliced_bit_for_bit(world):
    """Every rank keeps exactly its slice of today's full init, at any N and in c-compat."""
    n, results = world
    for name, r in results.items():
        if not name.startswith("init-"):
            continue
        tc, mc = r["train_config"], r["model_config"]
        full = MLP(mc).init_params(make_rng(tc.seed, tc.c_compat))
        units = {u.name: u for u in make_units(MLP(mc).layers, tc.layers_per_unit, n)}
        for rank, report in enumerate(r["per_rank"]):
            for key, kept in report["initial"].items():
                unit = units[key.removesuffix(".params")]
                vector = np.zeros(unit.flat.padded_numel, dtype=np.float32)
                parts = [full[layer][k].ravel() for layer in unit.layers for k in full[layer]]
                vector[: unit.flat.numel] = np.concatenate(parts) if parts else []
                if report["sharded"][key]:
                    start, stop = unit.flat.shard_range(rank)
                    assert np.array_equal(kept, vector[start:stop]), f"{name} N={n} {key}"
                else:
                    assert np.array_equal(kept, vector[: kept.size]), f"{name} N={n} {key}"


def test_every_option_trains_the_same_model_as_single(world):
    n, results = world
    for name, r in trained(results).items():
        if name.startswith("c-compat") and n > 1:
            continue  # the C programs' local biases: not single's model (the next test)
        losses, params = single_reference(r["model_config"], r["train_config"])
        assert np.abs(r["losses"] - losses).max() <= 1e-5, f"{name} N={n}"
        for layer, p in params.items():
            for k, v in p.items():
                diff = np.abs(r["params"][layer][k] - v).max()
                assert diff <= 1e-5, f"{name} N={n}: {layer}.{k} differs by {diff:.1e}"


def test_c_compat_steps_each_ranks_own_biases_as_the_c_fsdp_programs_do(world):
    """--c-compat zero3: every rank steps its own biases with its own rows' gradient, so at
    N > 1 the ranks' biases drift apart (at N = 1 it is single's model: the test above);
    accumulating micro-batches and units of two layers print the same losses."""
    n, results = world
    for name in ("c-compat-sgd", "c-compat-adam"):
        biases = [report["local_biases"] for report in results[name]["per_rank"]]
        for layer in biases[0]:
            apart = max((np.abs(b[layer] - biases[0][layer]).max() for b in biases[1:]), default=0)
            assert (apart > 1e-4) == (n > 1), f"{name} N={n}: {layer}'s biases {apart:.1e} apart"
    for variant, plain in [
        ("c-compat-accum-sgd", "c-compat-sgd"),
        ("c-compat-units2-adam", "c-compat-adam"),
    ]:
        diff = np.abs(results[variant]["losses"] - results[plain]["losses"]).max()
        assert diff <= 1e-5, f"{variant} N={n}: {diff:.1e} from {plain}"


@pytest.mark.parametrize(
    "n, flags, program",
    [(2, [], "fsdp"), (2, ["--layers-per-unit", "2", "--no-prefetch"], "fsdp"), (4, [], "fsdp_n4")],
    ids=["N2", "N2-units2", "N4"],
)
def test_c_compat_zero3_prints_the_fsdp_c_program(n, flags, program):
    """The program this course grew from: --c-compat --strategy zero3 on N ranks prints the C
    FSDP program's losses, validation loss and samples at N, its local biases included."""
    assert_prints_the_c_programs(n, ["--strategy", "zero3", *flags], program)


def test_prefetch_is_bit_identical_to_no_prefetch(world):
    n, results = world
    for on, off in [("prefetch", "no-prefetch"), ("keep", "keep-no-prefetch")]:
        for opt in ("sgd", "adam"):
            a, b = results[f"{on}-{opt}"], results[f"{off}-{opt}"]
            assert np.array_equal(a["losses"], b["losses"]), f"{on}-{opt} N={n}"
            for layer, p in a["params"].items():
                for k, v in p.items():
                    assert np.array_equal(v, b["params"][layer][k]), f"{on}-{opt} N={n} {layer}"


def test_the_planner_predicts_every_option_to_the_byte(world):
    n, results = world
    for name, r in trained(results).items():
        tc = r["train_config"]
        options = (
            {k: getattr(tc, k) for k in (*OPTIONS, "c_compat")} if tc.strategy == "zero3" else {}
        )
        micro = tc.batch // n
        options |= dict(accum=tc.accum)
        predicted = ledger_bytes(tc.strategy, r["model_config"], n, tc.optimizer, micro, **options)
        for rank, report in enumerate(r["per_rank"]):
            assert report["memory"]["peak"] == predicted, f"{name} N={n} rank {rank}"


def test_at_most_two_units_are_gathered_and_keeping_them_costs_memory(world):
    n, results = world
    buffers = {name: r["per_rank"][0]["memory"]["peak"]["buffers"] for name, r in results.items()}

    def full(name, k=1):  # the full bytes of each unit of that run's model
        units = make_units(MLP(results[name]["model_config"]).layers, k, n)
        return [4 * u.flat.padded_numel for u in units]

    assert buffers["no-prefetch-sgd"] == 2 * max(full("no-prefetch-sgd"))  # params + gradient
    assert buffers["prefetch-sgd"] > buffers["no-prefetch-sgd"]
    kept = full("keep-no-prefetch-sgd")  # at layer i's backward: layers 0..i, i's gradient
    assert buffers["keep-no-prefetch-sgd"] == max(sum(kept[: i + 1]) + kept[i] for i in range(4))
    assert buffers["whole-sgd"] == 2 * sum(full("whole-sgd", 99))  # all params and all grads


def test_traffic_follows_units_resharding_and_groups(world):
    n, results = world
    for name, r in trained(results).items():
        tc = r["train_config"]
        g = n // tc.replicate
        units = make_units(MLP(r["model_config"]).layers, tc.layers_per_unit, g)
        psi4 = 4 * sum(u.flat.padded_numel for u in units)
        calls = sum(1 for u in units if u.flat.numel)
        ring = (g - 1) / g
        gathers = 2 if tc.reshard_after_forward else 1  # forward (+ backward when resharded)
        a = tc.accum  # every micro-batch gathers and reduce-scatters
        where = "" if tc.replicate == 1 else " (shard)"
        for report in r["per_rank"]:
            traffic = {k: v["sent_bytes"] / tc.steps for k, v in report["traffic"].items()}
            assert traffic["allgather" + where] == pytest.approx(a * gathers * ring * psi4), name
            assert traffic["reduce_scatter" + where] == pytest.approx(a * ring * psi4)
            assert report["traffic"]["reduce_scatter" + where]["calls"] == a * calls * tc.steps
            if tc.replicate > 1:  # the gradient shards averaged across the R groups
                across = 2 * (tc.replicate - 1) / tc.replicate * psi4 / g
                assert traffic["allreduce (replicate)"] == pytest.approx(across)


def test_the_trace_shows_prefetch_issued_during_compute(world):
    n, results = world
    for name in ("prefetch-sgd", "no-prefetch-sgd"):
        for report in results[name]["per_rank"]:
            spans = {}  # each label's first span: forward's
            for _, what, a, b in report["trace"]:
                spans.setdefault(what, (a, b))
            lanes = {lane for lane, *_ in report["trace"]}
            assert lanes == {"compute", "comm"}
            assert all(0 <= a <= b for _, _, a, b in report["trace"])
            issued = spans["allgather fc2"][0] < spans["forward fc1"][1]
            assert issued == (name == "prefetch-sgd"), name  # fc2 starts while fc1 computes


def test_sharded_init_lets_zero3_train_under_a_budget_dp_cannot_meet(tmp_path):
    """16 x 512: the full parameters (16.3 MB) exceed the budget; zero3 at N=4 never holds them."""
    model = ModelConfig(layers=16, hidden=512)
    predicted = ledger_bytes("zero3", model, 4, "sgd", 6)
    full = 4 * MLP(model).num_params
    budget_mb = 14
    assert sum(predicted.values()) < budget_mb * 2**20 < full
    # 10 steps: the peak is reached in the first; each further step only adds time
    args = ["--layers", "16", "--hidden", "512", "--steps", "10", "--batch", "24"]
    args += ["--eval-batches", "0", "--samples", "0", "--memory-budget-mb", str(budget_mb)]
    dp = mpiexec(4, "-m", "fsdp_lesson", "train", "--strategy", "dp", *args, timeout=120)
    assert dp.returncode == 2 and "predicted before allocating anything" in dp.stderr
    zero3 = mpiexec(
        4, "-m", "fsdp_lesson", "train", "--strategy", "zero3", *args, "--out", str(tmp_path)
    )
    assert zero3.returncode == 0, zero3.stderr[-2000:]
    config = TrainConfig(steps=10, batch=24, eval_batches=0, samples=0)
    history, strategy = run(model, config, data=Dataset.load())
    saved = np.load(tmp_path / "params.npz")
    for layer, p in strategy.full_params().items():
        for k, v in p.items():
            assert np.abs(saved[f"{layer}.{k}"] - v).max() <= 1e-5, f"{layer}.{k}"
