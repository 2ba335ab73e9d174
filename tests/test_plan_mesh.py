"""fsdp_lesson.plan on a (dp, tp, pp) mesh: the formulas against hand-computed values, the 405B
answer, the `plan` command and its refusals, and the figure of the meshes that fit. (Context
parallelism and long sequences: test_plan_long_context.py.)"""

import subprocess
import sys

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402

from fsdp_lesson.plan import (  # noqa: E402
    GPU_CAPACITY,
    LLAMA_7B,
    LLAMA_70B,
    LLAMA_405B,
    MODELS,
    PLANNED,
    bubble_fraction,
    fitting_meshes,
    gpu_bytes,
    layer_activation_bytes,
    mesh_gpu_bytes,
    mesh_traffic_bytes,
    meshes,
    pipeline_in_flight,
    stage_params,
    traffic_bytes,
    transformer_activation_bytes,
)
from fsdp_lesson.plan_cli import main  # noqa: E402

S, B = 4096, 1  # sequence length and micro-batch of every hand-computed value below


def test_405b_shape_is_llama_3_1():
    h = 16384
    attention = 2 * h * 128 * 128 + 2 * h * 8 * 128  # Q and O of 128 heads, K and V of 8
    layer = attention + 3 * h * 53_248 + 2 * h  # the SwiGLU MLP and two RMSNorms
    assert LLAMA_405B.layer_params == layer
    assert LLAMA_405B.params == 126 * layer + 2 * 128_256 * h + h == 405_853_388_800
    assert set(MODELS) == {"7B", "8B", "70B", "405B"}


@pytest.mark.parametrize("model", [LLAMA_7B, LLAMA_70B, LLAMA_405B])
@pytest.mark.parametrize("stage", PLANNED)
@pytest.mark.parametrize("recompute", [False, True])
def test_one_tp_and_one_pp_is_gpu_bytes(model, stage, recompute):
    levers = {"recompute": recompute, "precision": "fp32", "micro_batch": 2}
    expected = gpu_bytes(model, stage, 64, **levers)
    assert mesh_gpu_bytes(model, stage, 64, micro_batches=8, schedule="gpipe", **levers) == expected


@pytest.mark.parametrize("stage", PLANNED)
def test_tp_halves_the_state_embeddings_too(stage):
    one, two = (mesh_gpu_bytes(LLAMA_70B, stage, 8, tp) for tp in (1, 2))
    for part in ("params", "grads", "optimizer", "gathered"):
        assert two[part] == one[part] / 2


def test_pp_keeps_ceil_of_l_over_p_layers_and_one_embedding():
    h, v, layer = LLAMA_70B.hidden, LLAMA_70B.vocab, LLAMA_70B.layer_params
    assert stage_params(LLAMA_70B, 1, 8) == 10 * layer + v * h  # 80 layers on 8 stages
    h, v, layer = LLAMA_405B.hidden, LLAMA_405B.vocab, LLAMA_405B.layer_params
    assert stage_params(LLAMA_405B, 8, 16) == (8 * layer + v * h) / 8  # 126 / 16 -> 8
    assert stage_params(LLAMA_405B, 1, 1) == LLAMA_405B.params  # one stage: everything
    zero1 = mesh_gpu_bytes(LLAMA_405B, "zero1", 8, 8, 16)
    share = stage_params(LLAMA_405B, 8, 16)
    state = (zero1["params"], zero1["grads"], zero1["optimizer"])
    assert state == (2 * share, 2 * share, 12 * share / 8)  # bf16 params, grads; K = 12 over dp


def test_activations_of_a_llama_layer_with_tp():
    # 70B, s = 4096, b = 1, 16 bits, per token: the norms' 4h = 32,768 elements whole; Q and
    # attention's output 2·8192, K and V 2·1024, the MLP's 3·28,672 and the probabilities
    # a·s = 64·4096 = 262,144 cut by t
    whole, cut = 4 * 8192, 2 * 8192 + 2 * 1024 + 3 * 28_672 + 64 * 4096
    assert layer_activation_bytes(LLAMA_70B, S, B) == S * 2 * (whole + cut) == 3_271_557_120
    assert layer_activation_bytes(LLAMA_70B, S, B, 2, False, 2) == S * 2 * (whole + cut // 2)
    assert layer_activation_bytes(LLAMA_70B, S, B, 2, True, 2) == S * 2 * (whole + cut) // 2
    assert layer_activation_bytes(LLAMA_70B, S, B, 8, False, 4) == S * 4 * (whole + cut // 8)
    for model in (LLAMA_7B, LLAMA_70B, LLAMA_405B):  # t = 1: sequence parallelism cuts nothing
        one_layer = transformer_activation_bytes(model, S, B, recompute=False) // model.layers
        assert layer_activation_bytes(model, S, B, 1, False, 2) == one_layer
        assert layer_activation_bytes(model, S, B, 1, True, 2) == one_layer


def test_pipeline_holds_micro_batches_by_schedule():
    assert pipeline_in_flight(4, 8, "gpipe") == 8
    assert pipeline_in_flight(4, 8, "1f1b") == 4 and pipeline_in_flight(4, 2, "1f1b") == 2
    assert pipeline_in_flight(1, 8, "gpipe") == 1  # one stage: gradient accumulation
    with pytest.raises(ValueError, match="1f1b, gpipe"):
        pipeline_in_flight(4, 8, "interleaved")
    layer = layer_activation_bytes(LLAMA_70B, S, B, 1, False, 2)
    gpipe = mesh_gpu_bytes(LLAMA_70B, "zero1", 1, 1, 4, micro_batches=8, schedule="gpipe")
    assert gpipe["activations"] == 8 * 20 * layer
    recomputed = mesh_gpu_bytes(LLAMA_70B, "zero1", 1, 1, 4, micro_batches=8, recompute=True)
    assert recomputed["activations"] == 4 * 20 * 2 * S * B * LLAMA_70B.hidden + layer
    alone = mesh_gpu_bytes(LLAMA_70B, "zero1", 1)  # one stage is also the last: the logits
    assert alone["activations"] == 80 * layer + 4 * S * B * 128_256


def test_bubble():
    assert bubble_fraction(1, 8) == 0
    assert bubble_fraction(4, 4) == pytest.approx(3 / 7)
    assert bubble_fraction(16, 32) == pytest.approx(15 / 47)
    assert bubble_fraction(8, 64) < bubble_fraction(8, 8)  # more micro-batches, less idle


def test_traffic_per_dimension():
    message = 2 * S * B * LLAMA_70B.hidden  # one s·b·h activation in 16 bits
    alone = mesh_traffic_bytes(LLAMA_70B, "zero3", 1)
    assert alone == {"dp": 0, "tp": 0, "pp": 0, "cp": 0}
    tp8 = mesh_traffic_bytes(LLAMA_70B, "zero1", 4, 8, micro_batches=2)
    assert tp8["tp"] == 2 * 80 * 4 * 2 * 7 / 8 * message
    assert tp8["dp"] == traffic_bytes("zero1", LLAMA_70B.params / 8, 4, bytes_per_element=2)
    redone = mesh_traffic_bytes(LLAMA_70B, "zero1", 4, 8, micro_batches=2, recompute=True)
    assert redone["tp"] == 1.5 * tp8["tp"]  # recomputation repeats forward's 2 allreduces
    assert mesh_traffic_bytes(LLAMA_70B, "dp", 1, 1, 2, micro_batches=3)["pp"] == 3 * message
    assert mesh_traffic_bytes(LLAMA_70B, "dp", 1, 1, 8, micro_batches=3)["pp"] == 6 * message


def test_meshes_use_every_gpu_and_respect_the_limits():
    found = meshes(LLAMA_405B, 1024)
    assert all(dp * tp * pp * cp == 1024 and tp <= 8 and pp <= 126 for dp, tp, pp, cp in found)
    assert (1024, 1, 1, 1) in found and (8, 8, 16, 1) in found and (1, 8, 128, 1) not in found
    assert len(found) == 4 * 7  # tp 1..8, pp 1..64 (128 would leave stages empty), cp 1


def test_405b_needs_a_mesh_and_recomputation():
    pure_dp = [(n, 1, 1) for n in (8, 64, 1024)]
    for dp, tp, pp in pure_dp:
        zero1 = mesh_gpu_bytes(LLAMA_405B, "zero1", dp, tp, pp, recompute=True)
        assert sum(zero1.values()) > GPU_CAPACITY  # 4 bytes a parameter unsharded: 1.5 TiB
    assert not fitting_meshes(LLAMA_405B, 8, "zero3", recompute=True)
    assert not fitting_meshes(LLAMA_405B, 1024, "zero1", micro_batches=32)  # activations
    fitting = fitting_meshes(LLAMA_405B, 1024, "zero1", micro_batches=32, recompute=True)
    assert (8, 8, 16, 1) in fitting and (1024, 1, 1, 1) not in fitting


def run_plan(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "fsdp_lesson", "plan", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_plan_command_prints_one_mesh():
    done = run_plan("--model", "405B", "--gpus", "1024", "--tp", "8", "--pp", "16", "--recompute")
    assert done.returncode == 0, done.stderr
    levers = {"micro_batches": 32, "recompute": True}
    memory = mesh_gpu_bytes(LLAMA_405B, "zero1", 8, 8, 16, **levers)
    total = sum(memory.values()) / 2**30
    assert "405B on dp 8 × tp 8 × pp 16 × cp 1 = 1024 GPUs, zero1" in done.stdout
    assert f"{total:9.1f} GiB: fits an 80 GiB GPU" in done.stdout
    assert f"bubble: {15 / 47:.1%}" in done.stdout
    sent = mesh_traffic_bytes(LLAMA_405B, "zero1", 8, 8, 16, **levers)
    assert f"  tp  {sent['tp'] / 2**30:9.1f} GiB" in done.stdout


def test_plan_command_lists_the_meshes_that_fit(capsys):
    assert main(["--model", "70B", "--gpus", "64", "--recompute", "--max-cp", "1"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[3:]]
    fitting = fitting_meshes(LLAMA_70B, 64, "zero1", micro_batches=32, recompute=True)
    assert [tuple(map(int, row[:4])) for row in rows] == fitting
    assert main(["--model", "405B", "--gpus", "1024", "--max-cp", "1"]) == 0
    assert "none: the least, dp 2 × tp 8 × pp 64 × cp 1" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, says",
    [
        (["--gpus", "1000", "--tp", "8", "--pp", "16"], "type --gpus 1024 or --gpus 896"),
        (["--tp", "3"], "use one of 1, 2, 4, 8 (within one 8-GPU server)"),
        (["--pp", "200"], "use --pp 126 or fewer"),
        (["--micro-batches", "0"], "--micro-batches 0: it must be 1 or more"),
        (["--model", "13B"], "no model '13B': choose one of 7B, 8B, 70B, 405B"),
        (["--cp", "3", "--seq-len", "8192"], "a multiple of 2·cp = 6 tokens"),
        (["--gpus", "1024", "--tp", "8", "--cp", "3", "--seq-len", "6144"], "tp·pp·cp = 8·1·3"),
        (["--recompute", "some"], "invalid choice: 'some'"),
    ],
)
def test_plan_command_refuses_bad_input_with_exit_code_2(args, says):
    done = run_plan(*args)
    assert done.returncode == 2 and says in done.stderr and not done.stdout


def test_mesh_figure_draws_every_mesh_and_the_capacity():
    from fsdp_lesson.plots import MESH_PARTS, mesh_memory

    fig = mesh_memory({"7B": 8, "405B": 1024}, recompute=True, micro_batches=32)
    assert [ax.get_title() for ax in fig.axes] == ["7B on 8 GPUs", "405B on 1024 GPUs"]
    for ax, gpus, model in zip(fig.axes, (8, 1024), (LLAMA_7B, LLAMA_405B), strict=True):
        assert len(ax.patches) == len(MESH_PARTS) * len(meshes(model, gpus))
        assert [line.get_ydata()[0] for line in ax.get_lines()] == [80]
    matplotlib.pyplot.close(fig)
