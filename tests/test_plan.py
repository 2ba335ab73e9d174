"""fsdp_lesson.plan: the ZeRO paper's figures, and the ledger predicted to the byte."""

import pytest

from fsdp_lesson import dryrun
from fsdp_lesson.config import ModelConfig, TrainConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.plan import (
    FP32_ADAM,
    PLANNED,
    ledger_bytes,
    state_bytes,
    step_seconds,
    traffic_bytes,
)
from fsdp_lesson.train import run


def test_reproduces_the_zero_papers_7_5b_on_64_gpus():
    gb = {stage: round(sum(state_bytes(stage, 7.5e9, 64).values()) / 1e9, 1) for stage in PLANNED}
    assert gb == {"dp": 120.0, "zero1": 31.4, "zero2": 16.6, "zero3": 1.9}


def test_fp32_adam_table():
    psi, n = 1000, 4
    assert state_bytes("zero1", psi, n, FP32_ADAM) == {
        "params": 4000,
        "grads": 4000,
        "optimizer": 2000,
    }
    assert sum(state_bytes("zero3", psi, n, FP32_ADAM).values()) == 16 * psi / n


def test_traffic_is_2_psi_or_3_psi_and_zero_on_one_rank():
    assert traffic_bytes("dp", 1000, 4) == traffic_bytes("zero2", 1000, 4) == 2 * 0.75 * 4000
    assert traffic_bytes("zero3", 1000, 4) == 1.5 * traffic_bytes("dp", 1000, 4)
    assert all(traffic_bytes(stage, 1000, 1) == 0 for stage in PLANNED)
    assert step_seconds("dp", 1e9, 2, bandwidth=1e9) == pytest.approx(2.0)  # 2 B/elem, ring 1/2


@pytest.mark.parametrize("strategy", ["single", "dp", "zero1", "zero2", "zero3"])
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("model", [ModelConfig(), ModelConfig(layers=3, hidden=32)])
def test_predicts_the_ledger_on_one_rank(strategy, optimizer, model):
    config = TrainConfig(strategy=strategy, optimizer=optimizer, steps=2, eval_batches=0, samples=0)
    history, _ = run(model, config, data=Dataset.load())
    assert history.memory["peak"] == ledger_bytes(strategy, model, 1, optimizer, micro_batch=32)


@pytest.mark.parametrize("strategy", ["dp", "zero2", "zero3"])
def test_a_1f1b_stage_is_predicted_from_its_warm_up_and_three_micro_batches(strategy, monkeypatch):
    """1F1B's steady state repeats as train_step's micro-batches do: the dry run that stops
    after the warm-up's forwards and three more micro-batches predicts what all M would."""
    model = ModelConfig(layers=3, hidden=32)  # 4 blocks: stage 0 of 4 warms up with 3

    def stages() -> list[dict]:
        pipeline = dict(pp=4, micro_batches=12, schedule="1f1b", accum_reduce="last")
        return [ledger_bytes(strategy, model, 2, "adam", 24, stage=s, **pipeline) for s in range(4)]

    capped = stages()
    monkeypatch.setattr(dryrun, "micro_batches_to_run", lambda M, pp, stage, schedule: M)
    assert stages() == capped


def test_real_model_planner_has_every_lever():
    """The 7B/70B planner: Ψ of the published models, the activations' terms, and the answer
    the lesson gives: 70B on 80 GiB needs ZeRO-3 and recomputation."""
    from fsdp_lesson.plan import LLAMA_7B, LLAMA_70B, gpu_bytes, transformer_activation_bytes

    assert LLAMA_7B.params == 6_738_415_616  # Llama 2 7B's model card
    s, b, h = 4096, 1, LLAMA_70B.hidden
    # a 70B layer per token, 16 bits: norms 4h, Q and O 2h, K and V 2·1024, MLP 3·28,672,
    # attention's probabilities 64·s
    layer = s * b * 2 * (4 * h + 2 * h + 2 * 1024 + 3 * 28_672 + 64 * s)
    assert transformer_activation_bytes(LLAMA_70B, s, b, recompute=False) == 80 * layer
    assert transformer_activation_bytes(LLAMA_70B, s, b, recompute=True) == 80 * 2 * s * h + layer
    gib = 80 * 2**30

    def fits(stage, n, **levers):
        return sum(gpu_bytes(LLAMA_70B, stage, n, **levers).values()) <= gib

    assert not any(fits("zero3", n) for n in (8, 64, 512, 4096))  # activations alone > 80 GiB
    assert fits("zero3", 64, recompute=True) and not fits("zero3", 8, recompute=True)
    assert not fits("zero2", 4096, recompute=True)  # 2 bytes of params per GPU: 141 GB
    fp32 = gpu_bytes(LLAMA_7B, "zero1", 8, precision="fp32")
    bf16 = gpu_bytes(LLAMA_7B, "zero1", 8)
    logits = 4 * s * b * 32_000  # fp32 in both
    assert fp32["params"] == 2 * bf16["params"]
    assert fp32["activations"] - logits == 2 * (bf16["activations"] - logits)


@pytest.mark.parametrize("strategy", ["dp", "zero2", "zero3"])
def test_the_dry_run_counts_a_large_model_while_allocating_next_to_nothing(strategy):
    import tracemalloc

    big = ModelConfig(hidden=1024, layers=11)  # 10.8 M parameters
    ledger_bytes(strategy, ModelConfig(), 4, "adam", 64, precision="bf16")  # imports done
    tracemalloc.start()
    try:
        predicted = ledger_bytes(strategy, big, 4, "adam", 64, precision="bf16", accum=4)
        _, allocated = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert predicted["optimizer"] >= 12 * 10_000_000 // 4  # fp32 master, m and v of a shard
    # placeholders: what it made is a bf16 cast's scratch at most, not the arrays it counted
    assert allocated < sum(predicted.values()) // 20
