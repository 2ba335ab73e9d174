"""The planner at long sequences: a Llama layer's activations counted by hand (flash or
materialized attention, sequence and context parallelism, recomputation), the published
parameter counts, ring attention's traffic, the answer for Llama 3.1 405B at 128k tokens, and
the docs' plan outputs and table of fitting meshes as the code prints them."""

import re
import shlex
from pathlib import Path

import pytest

from fsdp_lesson.plan import (
    ATTENTION,
    GPU_CAPACITY,
    LLAMA_8B,
    LLAMA_70B,
    LLAMA_405B,
    MODELS,
    fitting_meshes,
    layer_activation_bytes,
    layer_input_bytes,
    mesh_gpu_bytes,
    mesh_problem,
    mesh_traffic_bytes,
    meshes,
    transformer_activation_bytes,
)
from fsdp_lesson.plan_cli import main

ROOT = Path(__file__).resolve().parent.parent
K128 = 131_072  # 128k tokens
LONG = dict(seq_len=K128, micro_batches=16, sequence_parallel=True, recompute=True)


@pytest.mark.parametrize(
    "name, published",  # the model cards' counts
    [("7B", 6_738_415_616), ("8B", 8_030_261_248), ("70B", 70_553_706_496),
     ("405B", 405_853_388_800)],
)  # fmt: skip
def test_parameters_are_the_published_counts(name, published):
    assert MODELS[name].params == published


def test_8b_layer_by_hand_at_8k_tokens():
    # per token, 16 bits: norms 4·4096 = 16,384 elements; Q and O 2·4096 = 8,192; K and V
    # 2·8·128 = 2,048; MLP 3·14,336 = 43,008; the probabilities 32·8192 = 262,144
    per_token = 2 * (16_384 + 8_192 + 2_048 + 43_008)  # 139,264 bytes
    assert layer_activation_bytes(LLAMA_8B, 8192, 1) == 8192 * (per_token + 2 * 262_144)
    assert layer_activation_bytes(LLAMA_8B, 8192, 1) == 5_435_817_984
    # FlashAttention keeps a fp32 log-sum-exp per head instead: 4·32 bytes a token
    assert layer_activation_bytes(LLAMA_8B, 8192, 1, attention="flash") == 8192 * (per_token + 128)
    # selective recomputation drops the probabilities
    assert layer_activation_bytes(LLAMA_8B, 8192, 1, selective=True) == 8192 * per_token


def test_405b_layer_by_hand_at_128k_on_tp_8_and_cp_16():
    # per token, 16 bits: norms 4·16384 = 65,536 elements (131,072 bytes), whole on every tp
    # GPU without sequence parallelism; cut by tp: Q and O 2·16384, K and V 2·1024, MLP
    # 3·53,248 (389,120 bytes) and the log-sum-exp 4·128 = 512 bytes
    whole, cut = 131_072, 389_120 + 512
    tokens = K128 // 16  # cp 16: 8,192 tokens a GPU
    plain = layer_activation_bytes(LLAMA_405B, K128, 1, 8, False, 2, cp=16, attention="flash")
    assert plain == tokens * whole + tokens * cut // 8 == 1_472_724_992
    parallel = layer_activation_bytes(LLAMA_405B, K128, 1, 8, True, 2, cp=16, attention="flash")
    assert parallel == tokens // 8 * (whole + cut) == 533_200_896  # everything over tp
    assert layer_input_bytes(LLAMA_405B, K128, 1, 8, True, 2, 16) == 2 * K128 * 16384 // 128


@pytest.mark.parametrize("attention", ["materialized", "flash"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_context_parallelism_divides_every_term(attention, recompute):
    one, four = (
        transformer_activation_bytes(
            LLAMA_70B, 32_768, 1, recompute, tp=8, sequence_parallel=True, cp=cp,
            attention=attention,
        )
        for cp in (1, 4)
    )  # fmt: skip
    assert one == 4 * four


def test_sequence_parallelism_and_recomputation_divide_as_korthikanti_says():
    s, h = 32_768, LLAMA_70B.hidden
    alone = layer_activation_bytes(LLAMA_70B, s, 1)
    assert layer_activation_bytes(LLAMA_70B, s, 1, 8, True, 2) * 8 == alone  # all over tp
    without = layer_activation_bytes(LLAMA_70B, s, 1, 8, False, 2)
    assert without - alone // 8 == 2 * s * 4 * h * 7 // 8  # only the norms' 4h stay whole
    selective = transformer_activation_bytes(LLAMA_70B, s, 1, "selective")
    assert transformer_activation_bytes(LLAMA_70B, s, 1, "none") - selective == 80 * 2 * 64 * s * s
    assert transformer_activation_bytes(LLAMA_70B, s, 1, "full") == 80 * 2 * s * h + alone
    with pytest.raises(ValueError, match="none, selective, full"):
        transformer_activation_bytes(LLAMA_70B, s, 1, "some")
    with pytest.raises(ValueError, match="materialized, flash"):
        layer_activation_bytes(LLAMA_70B, s, 1, attention="paged")


def test_zero_shards_over_dp_times_cp():
    dp_only = mesh_gpu_bytes(LLAMA_70B, "zero3", 64, 8, 1, 1)
    with_cp = mesh_gpu_bytes(LLAMA_70B, "zero3", 16, 8, 1, 4)
    for part in ("params", "grads", "optimizer", "gathered"):
        assert with_cp[part] == dp_only[part]  # the same 64 GPUs share every piece
    assert mesh_gpu_bytes(LLAMA_70B, "zero1", 8, 8, 1) == mesh_gpu_bytes(
        LLAMA_70B, "zero1", 8, 8, 1, 1
    )  # (dp, tp, pp) callers: cp is 1


def test_ring_attention_traffic_by_hand():
    # 405B, tp 8, pp 16 (8 layers), cp 16, 16 micro-batches, full recomputation: each GPU's K
    # and V block, 2 · 8,192 tokens · 1,024 · 2 bytes / 8 = 4 MiB, goes 15 hops 4 times
    sent = mesh_traffic_bytes(LLAMA_405B, "zero1", 8, 8, 16, 16, micro_batches=16,
                              seq_len=K128, recompute=True)  # fmt: skip
    assert sent["cp"] == 16 * 8 * 4 * 15 * 4 * 2**20 == 30 * 2**30
    assert sent["tp"] == 16 * 8 * 6 * 2 * 7 / 8 * 2 * K128 // 16 * 16384  # s/cp per message
    plain = mesh_traffic_bytes(LLAMA_405B, "zero1", 8, 8, 16, 16, seq_len=K128)
    assert plain["cp"] == 8 * 3 * 15 * 4 * 2**20  # forward, and backward's K/V with dK/dV


def test_meshes_with_cp_and_what_cannot_split():
    found = meshes(LLAMA_405B, 16384, max_cp=16)
    assert (8, 8, 16, 16) in found and (128, 8, 16, 1) in found
    assert all(dp * tp * pp * cp == 16384 and cp <= 16 for dp, tp, pp, cp in found)
    assert mesh_problem(LLAMA_405B, K128, 8, 16, 16) is None
    assert "2·cp = 6" in mesh_problem(LLAMA_405B, K128, 1, 1, 3)
    assert "key/value" in mesh_problem(LLAMA_405B, K128, 16)  # 8 key/value heads over 16


def test_405b_at_128k_fits_meta_s_mesh_and_nothing_on_64_gpus():
    """Meta trained Llama 3.1 405B's long-context stage on 16,384 GPUs as tp 8 × cp 16 × pp
    16 × dp 8; the planner says that mesh fits (FlashAttention, sequence parallelism, full
    recomputation, 16 micro-batches in flight), that the same tp and pp without cp do not, and
    that no mesh of 64 GPUs does: 16 bytes a parameter over 64 are more than 80 GiB alone."""
    levers = dict(LONG, attention="flash")
    meta = mesh_gpu_bytes(LLAMA_405B, "zero1", 8, 8, 16, 16, **levers)
    assert sum(meta.values()) <= GPU_CAPACITY
    assert (8, 8, 16, 16) in fitting_meshes(LLAMA_405B, 16384, max_cp=16, **levers)
    no_cp = mesh_gpu_bytes(LLAMA_405B, "zero1", 128, 8, 16, 1, **levers)
    assert sum(no_cp.values()) > GPU_CAPACITY  # 16 micro-batches × 8 layers × 512 MiB inputs
    assert 16 * LLAMA_405B.params / 64 > GPU_CAPACITY
    assert fitting_meshes(LLAMA_405B, 64, "zero3", max_cp=64, **levers) == []
    # with attention's probabilities kept, even cp 16 leaves 32 GiB of them a layer
    kept = mesh_gpu_bytes(LLAMA_405B, "zero1", 8, 8, 16, 16, **dict(LONG, recompute="none"))
    assert kept["activations"] > 16 * 8 * 2 * 128 * K128 * K128 // 128


def test_plan_command_answers_for_405b_at_128k(capsys):
    flags = ["--model", "llama3-405b", "--seq-len", str(K128), "--attention", "flash",
             "--sequence-parallel", "--recompute", "--micro-batches", "16"]  # fmt: skip
    assert main([*flags, "--gpus", "16384", "--tp", "8", "--pp", "16", "--cp", "16"]) == 0
    out = capsys.readouterr().out
    memory = mesh_gpu_bytes(LLAMA_405B, "zero1", 8, 8, 16, 16, **LONG, attention="flash")
    assert "405B on dp 8 × tp 8 × pp 16 × cp 16 = 16384 GPUs, zero1" in out
    assert f"{sum(memory.values()) / 2**30:9.1f} GiB: fits an 80 GiB GPU" in out
    assert "  cp       30.0 GiB" in out and "full recompute, flash attention" in out
    assert main([*flags, "--gpus", "16384"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[3:]]
    listed = [tuple(map(int, row[:4])) for row in rows]
    fitting = fitting_meshes(LLAMA_405B, 16384, max_cp=32, **LONG, attention="flash")
    assert set(listed) <= set(fitting) and len({m[1:3] for m in listed}) == len(listed)
    assert all(m[3] <= n[3] for m in listed for n in fitting if n[1:3] == m[1:3])  # least cp
    assert main([*flags, "--gpus", "64", "--strategy", "zero3", "--max-cp", "64"]) == 0
    assert "none: the least" in capsys.readouterr().out


def test_70b_mesh_at_32k_by_hand():
    """Llama 3.1 70B at 32k tokens on dp 2 × tp 8 × pp 1 × cp 4 (64 GPUs), zero3, bf16, Adam,
    FlashAttention, sequence parallelism, full recomputation, one micro-batch: every byte."""
    s, h, psi = 32_768, 8192, 70_553_706_496
    got = mesh_gpu_bytes(LLAMA_70B, "zero3", 2, 8, 1, 4, seq_len=s, sequence_parallel=True,
                         recompute="full", attention="flash")  # fmt: skip
    share = psi / 8 / (2 * 4)  # the parameters over tp, sharded over dp·cp
    assert (got["params"], got["grads"], got["optimizer"]) == (2 * share, 2 * share, 12 * share)
    assert got["gathered"] == 2 * 855_654_400 / 8 * 2  # two layers over tp, 16 bits
    tokens = s // (8 * 4)  # 1,024 tokens a GPU: s over cp, and over tp with sequence parallel
    # a layer per token: norms 4h, Q and O 2h, K and V 2·1024, MLP 3·28,672, in 2 bytes; the
    # log-sum-exp 4 bytes × 64 heads
    layer = tokens * (2 * (4 * h + 2 * h + 2 * 1024 + 3 * 28_672) + 4 * 64)
    inputs = 80 * tokens * h * 2  # each layer's input, kept
    logits = 4 * s * 128_256 // (8 * 4)  # fp32, vocab over tp, tokens over cp
    assert got["activations"] == inputs + layer + logits


def doc_commands(text: str) -> list[tuple[list[str], str]]:
    """Each `$ python -m fsdp_lesson plan ...` block of a doc: its flags and the lines shown."""
    found = []
    for block in re.findall(r"```\n\$ python -m fsdp_lesson plan (.*?)```", text, re.S):
        lines = block.splitlines(keepends=True)
        command = 1 + next(i for i, line in enumerate(lines) if not line.endswith("\\\n"))
        flags = " ".join(line.rstrip("\\\n") for line in lines[:command])
        found.append((shlex.split(flags), "".join(lines[command:])))
    return found


@pytest.mark.parametrize("doc", ["zero_formulas.md", "long_context.md"])
def test_the_docs_show_what_the_plan_command_prints(doc, capsys):
    commands = doc_commands((ROOT / "docs" / doc).read_text())
    assert commands, f"docs/{doc} shows no plan command"
    for flags, shown in commands:
        assert main(flags) == 0
        assert capsys.readouterr().out == shown, f"docs/{doc}: python -m fsdp_lesson plan {flags}"


FIT_GPUS = {"8B": 8, "70B": 64, "405B": 1024}  # one server, eight, 128
FIT_LEVERS = dict(micro_batches=16, sequence_parallel=True, recompute="full")


def fits_row(name: str, seq_len: int) -> str:
    """A row of long_context.md's table: for each attention, how many meshes without cp fit
    (of all that split evenly), then how many with cp up to the GPUs."""
    model, gpus = MODELS[name], FIT_GPUS[name]
    cells = []
    for attention in ATTENTION:
        for max_cp in (1, gpus):
            every = [
                mesh
                for mesh in meshes(model, gpus, max_cp=max_cp)
                if mesh_problem(model, seq_len, *mesh[1:], sequence_parallel=True) is None
            ]
            found = fitting_meshes(
                model, gpus, max_cp=max_cp, seq_len=seq_len, attention=attention, **FIT_LEVERS
            )
            cells.append(f"{len(found)} of {len(every)}")
    return f"| {name} | {gpus} | {seq_len // 1024}k | " + " | ".join(cells) + " |"


@pytest.mark.parametrize("name", FIT_GPUS)
def test_long_context_table_is_what_the_planner_finds(name):
    doc = (ROOT / "docs" / "long_context.md").read_text()
    for seq_len in (8192, 32_768, K128):
        row = fits_row(name, seq_len)
        assert row in doc, f"docs/long_context.md should have the row {row}"
    # what the table teaches, asserted: at 128k the s×s probabilities fit nowhere without cp
    # (70B on 64 GPUs: nowhere at all), and FlashAttention fits without it
    probabilities = dict(seq_len=K128, attention="materialized", **FIT_LEVERS)
    kept = fitting_meshes(MODELS[name], FIT_GPUS[name], max_cp=FIT_GPUS[name], **probabilities)
    assert all(mesh[3] > 1 for mesh in kept)
    flash = dict(probabilities, attention="flash")
    assert any(mesh[3] == 1 for mesh in fitting_meshes(MODELS[name], FIT_GPUS[name], **flash))


def test_cp_lets_405b_at_128k_fit_with_fewer_stages():
    levers = dict(seq_len=K128, attention="flash", **FIT_LEVERS)
    without = {pp for _, _, pp, _ in fitting_meshes(LLAMA_405B, 1024, **levers)}
    with_cp = {pp for _, _, pp, _ in fitting_meshes(LLAMA_405B, 1024, max_cp=1024, **levers)}
    assert min(without) == 32 and min(with_cp) == 4  # bubbles of 66% and 16% at m = 16
