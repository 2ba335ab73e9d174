"""The memory levers under real `mpiexec -n N` (N = 1..4): mixed precision, gradient
accumulation and activation recomputation with every strategy, against single-rank runs, the
paper's accounting and the planner (tests/levers_worker.py runs them)."""

import math
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest

from fsdp_lesson.comm import Comm
from fsdp_lesson.config import ModelConfig, TrainConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.memory import MemoryLedger
from fsdp_lesson.model import MLP
from fsdp_lesson.optim import make_optimizer
from fsdp_lesson.plan import ledger_bytes
from fsdp_lesson.rng import make_rng
from fsdp_lesson.strategies import make_strategy, strategy_options
from fsdp_lesson.train import memory_options, train_step

sys.path.insert(0, str(Path(__file__).parent))
from levers_worker import master_params  # noqa: E402
from mpi_helpers import worker_results  # noqa: E402

HERE = Path(__file__).parent
OPTIONS = ("layers_per_unit", "prefetch", "reshard_after_forward", "replicate")


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda n: f"N{n}")
def world(request, tmp_path_factory):
    return request.param, worker_results(
        request.param, "levers_worker.py", tmp_path_factory, timeout=900
    )


@cache
def single(model_config, train_config):
    """The same run on one rank; with accumulation, as one batch of batch * accum rows."""
    d = {k: v for k, v in train_config.to_dict().items() if k not in OPTIONS}
    d["strategy"] = "single"
    if train_config.accum > 1:
        d |= dict(batch=train_config.batch * train_config.accum, accum=1, accum_reduce="every")
    from fsdp_lesson.train import run

    history, strategy = run(model_config, TrainConfig(**d), data=Dataset.load())
    return history, master_params(strategy)


def sizes_of(model_config) -> list[int]:
    return [sum(math.prod(s) for s in layer.shapes.values()) for layer in MLP(model_config).layers]


def test_ledger_is_the_papers_mixed_precision_accounting_and_the_planner_predicts_it(world):
    """params and grads 2 bytes, optimizer 12 (Adam: master, m, v) or 4 (SGD: the master) per
    parameter, divided by N where the stage shards it; every category as plan predicts."""
    n, results = world
    sharded = {"dp": (), "zero1": ("optimizer",), "zero2": ("optimizer", "grads")}
    sharded["zero3"] = ("optimizer", "grads", "params")
    for name, r in results.items():
        tc, mc = r["train_config"], r["model_config"]
        opts = memory_options(tc) | strategy_options(tc.strategy, tc)
        micro_batch, recompute = tc.batch // n, tc.recompute
        predicted = ledger_bytes(
            tc.strategy, mc, n, tc.optimizer, micro_batch, recompute=recompute, **opts
        )
        sizes = sizes_of(mc)
        psi = sum(sizes) if tc.strategy == "dp" else sum(-(-s // n) * n for s in sizes)
        if tc.strategy == "zero3" and tc.layers_per_unit > 1:
            psi = None  # units pad differently; the planner alone predicts them
        per = {"params": 2, "grads": 2, "optimizer": 12 if tc.optimizer == "adam" else 4}
        if tc.precision == "fp32":
            per = {"params": 4, "grads": 4, "optimizer": 8 if tc.optimizer == "adam" else 0}
        for rank, report in enumerate(r["per_rank"]):
            peak = report["memory"]["peak"]
            assert peak == predicted, f"{name} N={n} rank {rank}"
            for cat, b in per.items():
                if psi is not None:
                    want = b * psi // (n if cat in sharded[tc.strategy] else 1)
                    assert peak[cat] == want, f"{name} N={n} rank {rank} {cat}"


# bf16 keeps 8 significant bits: a gradient is rounded on every rank and at every ring hop,
# so N-rank and one-rank runs part by a few roundings (2^-9 each) per step. The losses agree
# within bf16's relative precision 2^-8, the fp32 master weights within 2^-6 (four roundings)
# in relative L2 norm; measured over 40 steps: at most 1e-3 and 4e-3.
def test_bf16_at_every_stage_trains_as_single_bf16(world):
    n, results = world
    for name, r in results.items():
        if not name.endswith("-bf16") and "bf16-" not in name or "ring" in name:
            continue
        history, params = single(r["model_config"], r["train_config"])
        rel = np.abs(r["losses"] - history.losses) / history.losses
        assert rel.max() <= 2**-8, f"{name} N={n}: loss differs by {rel.max():.1e} (relative)"
        for layer, p in params.items():
            if p.size:
                diff = np.linalg.norm(r["params"][layer] - p) / np.linalg.norm(p)
                assert diff <= 2**-6, f"{name} N={n}: {layer} differs by {diff:.1e}"


def test_fp16_trains_with_the_same_skipped_steps_on_every_rank(world):
    n, results = world
    for strategy in ("dp", "zero1", "zero2", "zero3"):
        r = results[f"{strategy}-adam-fp16"]
        skipped = [report["skipped"] for report in r["per_rank"]]
        assert all(s == skipped[0] for s in skipped), f"{strategy} N={n}: {skipped}"
        assert np.isfinite(r["losses"]).all() and r["losses"][-10:].mean() < r["losses"][:10].mean()


def test_16_bit_traffic_is_half_of_fp32_measured_on_the_ring(world):
    """Measured bytes (--collectives ring): gradients and parameters move in 16 bits; the
    logged loss is a float64 allreduce in both (zero1's allreduce is that alone)."""
    n, results = world
    loss = [
        rank["traffic"]["allreduce"]["sent_bytes"]
        for rank in results["zero1-fp32-ring"]["per_rank"]
    ]
    for strategy in ("dp", "zero1", "zero2", "zero3"):
        fp32, bf16 = results[f"{strategy}-fp32-ring"], results[f"{strategy}-bf16-ring"]
        for rank in range(n):
            for kind in ("allreduce", "allgather", "reduce_scatter"):
                a = fp32["per_rank"][rank]["traffic"][kind]
                b = bf16["per_rank"][rank]["traffic"][kind]
                assert a["how"] == b["how"] == "measured"
                other = loss[rank] if kind == "allreduce" else 0
                assert b["sent_bytes"] - other == (a["sent_bytes"] - other) / 2, (
                    f"{strategy} N={n} rank {rank} {kind}"
                )
        if n > 1:
            assert fp32["per_rank"][0]["traffic"]["allgather"]["sent_bytes"] > 0 or strategy == "dp"


def test_accumulation_equals_one_big_batch_within_1e_5(world):
    """--batch 12 --accum 2 trains as --batch 24, every strategy, both reduce modes."""
    n, results = world
    for name, r in results.items():
        if "-accum-" not in name or r["train_config"].precision != "fp32":
            continue
        history, params = single(r["model_config"], r["train_config"])
        assert np.abs(r["losses"] - history.losses).max() <= 1e-5, f"{name} N={n}"
        for layer, p in params.items():
            if p.size:
                assert np.abs(r["params"][layer] - p).max() <= 1e-5, f"{name} N={n}: {layer}"


def test_accumulation_trades_traffic_for_memory(world):
    """ "every" reduces K times a step (traffic x K, sharded gradients); "last" once, keeping a
    full gradient (counted as buffers): zero2's and zero3's gradient traffic and buffers."""
    n, results = world
    if n == 1:
        pytest.skip("one rank sends nothing")
    k = 2
    sizes = sizes_of(ModelConfig())
    psi_pad = sum(-(-s // n) * n for s in sizes)
    for strategy in ("zero2", "zero3"):
        every, last = results[f"{strategy}-accum-every"], results[f"{strategy}-accum-last"]
        steps = every["train_config"].steps
        for rank in range(n):
            e = every["per_rank"][rank]["traffic"]["reduce_scatter"]["sent_bytes"] / steps
            la = last["per_rank"][rank]["traffic"]["reduce_scatter"]["sent_bytes"] / steps
            assert e == pytest.approx(k * 4 * psi_pad * (n - 1) / n)
            assert la == pytest.approx(4 * psi_pad * (n - 1) / n)
            mem_e = every["per_rank"][rank]["memory"]["peak"]["buffers"]
            mem_l = last["per_rank"][rank]["memory"]["peak"]["buffers"]
            assert mem_l > mem_e, f"{strategy} N={n}: last keeps a full gradient"


def test_clipping_by_the_global_norm_over_all_shards_equals_single_within_1e_5(world):
    """Every strategy clips the gradient by its norm over the whole model (one allreduce of the
    shards' squared norms), as single-rank training does, and the clipping really bites."""
    n, results = world
    clipped = [name for name in results if name.endswith("-clip")]
    assert len(clipped) == 9
    for name in clipped:
        r = results[name]
        history, params = single(r["model_config"], r["train_config"])
        assert np.max(np.abs(r["losses"] - np.asarray(history.losses))) <= 1e-5, (name, n)
        for layer, value in params.items():
            assert np.max(np.abs(r["params"][layer] - value), initial=0.0) <= 1e-5, (name, layer)
        unclipped = TrainConfig(**(r["train_config"].to_dict() | {"clip_grad_norm": None}))
        _, free = single(r["model_config"], unclipped)
        apart = max(np.max(np.abs(free[k] - v), initial=0.0) for k, v in params.items())
        assert apart > 1e-3, f"{name}: clipping changed nothing"


def test_clip_factor_is_torchs_and_each_shard_alone_would_be_wrong():
    """min(1, X / (norm + 1e-6)) of the whole gradient's norm; a rank that clipped its own shard
    by its own norm (the bug of 07's exercise) would find another factor."""
    comm, config = Comm.world(), ModelConfig()
    model = MLP(config)
    strategy = make_strategy("single", model, make_optimizer("sgd", 0.1), comm, MemoryLedger())
    grads = {name: np.zeros(flat.numel, np.float32) for name, flat in strategy.layout.items()}
    grads["emb"][:4], grads["fc1"][-1] = 3.0, 4.0  # a norm of sqrt(4 * 9 + 16) = sqrt(52)
    strategy.clip_grad_norm = 1.0
    strategy.clip_grads(grads, sharded=False)
    assert strategy.clip_factor == pytest.approx(1.0 / (np.sqrt(52.0) + 1e-6), rel=1e-12)
    strategy.clip_grads({"emb": grads["emb"]}, sharded=False)  # one part alone: 6, not sqrt(52)
    assert strategy.clip_factor == pytest.approx(1.0 / (6.0 + 1e-6), rel=1e-12)
    strategy.clip_grad_norm = 100.0
    strategy.clip_grads(grads, sharded=False)
    assert strategy.clip_factor == 1.0  # a gradient inside the bound is left alone


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    """A loss scale so large that the fp16 gradients overflow: the step is skipped (parameters
    and the optimizer's t unchanged), the scale halves, and training resumes once it fits."""
    model, data = MLP(ModelConfig()), Dataset.load()
    strategy = make_strategy(
        "single", model, make_optimizer("adam", 1e-3), Comm(), MemoryLedger(), precision="fp16"
    )
    strategy.init_params(make_rng(42))
    strategy.precision.scaler.scale = 2.0**40
    before = {k: e.array.copy() for k, e in strategy.local_state().items()}
    X, Y = data.X_train[:24], data.Y_train[:24]
    with np.errstate(over="ignore", invalid="ignore"):
        train_step(model, strategy, X, Y)
    assert strategy.precision.scaler.last_skipped and strategy.precision.scaler.scale == 2.0**39
    assert strategy.optimizer.t == 0
    for k, e in strategy.local_state().items():
        assert np.array_equal(e.array, before[k]), k
    with np.errstate(over="ignore", invalid="ignore"):
        for _ in range(40):
            train_step(model, strategy, X, Y)
            if not strategy.precision.scaler.last_skipped:
                break
    assert not strategy.precision.scaler.last_skipped and strategy.optimizer.t == 1
    assert strategy.precision.scaler.scale < 2.0**39  # halved until the gradients fit in fp16


def test_recompute_is_bit_identical_saves_the_predicted_activations_and_no_traffic(world):
    """--recompute: the same bits as without it (the recomputed forward is the same
    arithmetic); the activation peak drops to what the planner predicts; and not one byte
    more moves, because each block is recomputed while backward has its unit gathered."""
    n, results = world
    twins = [name[: -len("-True")] for name in results if name.endswith("recompute-True")]
    assert len(twins) == 5, twins
    for twin in twins:
        off, on = results[f"{twin}-False"], results[f"{twin}-True"]
        assert np.array_equal(off["losses"], on["losses"]), f"{twin} N={n}: losses differ"
        for layer, p in off["params"].items():
            assert np.array_equal(on["params"][layer], p), f"{twin} N={n}: {layer} differs"
        tc, mc = on["train_config"], on["model_config"]
        want = ledger_bytes(
            tc.strategy,
            mc,
            n,
            tc.optimizer,
            tc.batch // n,
            recompute=True,
            **memory_options(tc) | strategy_options(tc.strategy, tc),
        )["activations"]
        for rank in range(n):
            saved = off["per_rank"][rank]["memory"]["peak"]["activations"]
            kept = on["per_rank"][rank]["memory"]["peak"]["activations"]
            assert kept == want < saved, f"{twin} N={n} rank {rank}: {kept} vs {saved}"
            for kind, moved in on["per_rank"][rank]["traffic"].items():
                before = off["per_rank"][rank]["traffic"][kind]
                for what in ("calls", "messages", "sent_bytes"):
                    assert moved[what] == before[what], f"{twin} N={n} rank {rank} {kind} {what}"


def test_bf16_trains_as_well_as_fp32_over_2000_steps():
    """The issue's measure: after 2,000 Adam steps on the seed's model, bf16's validation loss
    is within 0.02 of fp32's (under 1 %, the size of the step-to-step noise of the loss; a
    bf16 rounding is 2^-9 relative). Measured: 2.41606 vs 2.41647."""
    from fsdp_lesson.train import run

    val = {}
    for precision in ("fp32", "bf16"):
        config = TrainConfig(
            optimizer="adam", steps=2000, eval_batches=50, samples=0, precision=precision
        )
        val[precision] = run(ModelConfig(), config, data=Dataset.load())[0].val_loss
    assert abs(val["bf16"] - val["fp32"]) < 0.02, val
    assert val["fp32"] < 2.5  # both trained: the first steps' loss is 3.3
