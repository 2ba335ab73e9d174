"""The ZeRO accounting as formulas: bytes per rank and traffic per step for any model and N.

Two uses: plan a real model (7 B parameters on 64 GPUs, the paper's mixed precision), and
predict, to the byte, what this package's MemoryLedger measures (docs/zero_formulas.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import ModelConfig
from .models import build_model
from .sharding import SHARD_LEVEL, STRATEGIES, is_sharded

PLANNED = tuple(s for s in STRATEGIES if s != "single")  # the strategies one plans for N ranks


@dataclass(frozen=True)
class BytesPerParam:
    """Bytes per parameter of the parameters, the gradients and the optimizer state."""

    params: int
    grads: int
    optimizer: int


FP32_SGD = BytesPerParam(4, 4, 0)  # this package with --optimizer sgd
FP32_ADAM = BytesPerParam(4, 4, 8)  # this package with --optimizer adam: m and v
MIXED_ADAM = BytesPerParam(
    2, 2, 12
)  # the ZeRO paper: fp16 params and grads, K = 12 (fp32 copy, m, v)
MIXED_SGD = BytesPerParam(2, 2, 4)  # --precision bf16/fp16 --optimizer sgd: the fp32 master only


def precision_of(precision: str, optimizer: str) -> BytesPerParam:
    """Bytes per parameter of a run of this package (--precision, --optimizer)."""
    if precision == "fp32":
        return FP32_ADAM if optimizer == "adam" else FP32_SGD
    return MIXED_ADAM if optimizer == "adam" else MIXED_SGD


def state_bytes(strategy: str, psi: float, n: int, precision: BytesPerParam = MIXED_ADAM) -> dict:
    """Bytes per rank of params, grads and optimizer state (the paper's table; Ψ = psi)."""
    full = {
        "params": precision.params * psi,
        "grads": precision.grads * psi,
        "optimizer": precision.optimizer * psi,
    }
    return {cat: b / n if is_sharded(SHARD_LEVEL[strategy], cat) else b for cat, b in full.items()}


def traffic_bytes(strategy: str, psi: float, n: int, bytes_per_element: int = 4) -> float:
    """Bytes one rank sends per step under the ring model: 2Ψ for dp/zero1/zero2, 3Ψ for zero3."""
    passes = (
        3 if strategy == "zero3" else 2
    )  # zero3: allgather fwd + allgather bwd + reduce-scatter
    return passes * (n - 1) / n * psi * bytes_per_element


def step_seconds(
    strategy: str, psi: float, n: int, bandwidth: float, bytes_per_element: int = 2
) -> float:
    """A model, not a measurement: the step's communication time, traffic / bandwidth (B/s).

    2 bytes per element by default: the paper's fp16 gradients and parameters on the wire
    (4 for this package's fp32 runs). Across hosts, bandwidth is one cable's payload rate each
    way: a ring in host order puts one rank's sends on each cable, whatever the ranks per host
    (benchmarks/bench_hosts.py: within 1.5x of zero3's and dp's measured collective seconds).
    """
    return traffic_bytes(strategy, psi, n, bytes_per_element) / bandwidth


# --- planning a real model: every term of a GPU's memory -----------------------------------


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer's shape (Llama-like): enough to count its bytes."""

    name: str
    layers: int  # L
    hidden: int  # h
    heads: int  # a
    vocab: int = 32_000

    @property
    def params(self) -> int:
        """Ψ ≈ 12·L·h² (attention 4h², MLP 8h²) plus the input and output embeddings, 2·V·h."""
        return 12 * self.layers * self.hidden**2 + 2 * self.vocab * self.hidden


LLAMA_7B = Transformer("7B", layers=32, hidden=4096, heads=32)  # Ψ ≈ 6.7 B, Llama 2 7B's shape
LLAMA_70B = Transformer("70B", layers=80, hidden=8192, heads=64)  # Ψ ≈ 65 B (no GQA)
# Ψ ≈ 410 B, 1 % over Llama 3.1 405B's 405.9 B: no GQA (attention 4h², not 2.125h²) and an MLP
# of 8h², not 3·h·53,248 = 9.75h²; the two errors nearly cancel, 12h² against 11.875h² a layer
LLAMA_405B = Transformer("405B", layers=126, hidden=16384, heads=128, vocab=128_256)
MODELS = {model.name: model for model in (LLAMA_7B, LLAMA_70B, LLAMA_405B)}


def transformer_activation_bytes(
    model: Transformer, seq_len: int, micro_batch: int, recompute: bool, item: int = 2
) -> int:
    """Activations one GPU keeps for backward, by the formula of Korthikanti et al. (2022),
    "Reducing Activation Recomputation in Large Transformer Models", for 16-bit activations.

    A layer keeps s·b·h·(34 + 5·a·s/h) bytes (the 5·a·s/h term: attention's s×s scores).
    Recomputing every layer keeps only each layer's input, 2·s·b·h bytes, plus one layer's
    full activations while it is recomputed in backward. A formula: predicted, not measured.
    """
    s, b, h, a = seq_len, micro_batch, model.hidden, model.heads
    per_layer = s * b * h * (34 + 5 * a * s // h) * item // 2
    if not recompute:
        return model.layers * per_layer
    return model.layers * item * s * b * h + per_layer


def gpu_bytes(
    model: Transformer,
    strategy: str,
    n: int,
    *,
    precision: str = "bf16",
    seq_len: int = 4096,
    micro_batch: int = 1,
    recompute: bool = False,
) -> dict[str, float]:
    """Bytes per GPU of a real model with Adam: the ZeRO state (`state_bytes`), zero3's
    gathered layers (one computing, one prefetched, in 16 bits), and the activations."""
    bytes_per = precision_of(precision, "adam")
    out = state_bytes(strategy, model.params, n, bytes_per)
    layer = 12 * model.hidden**2  # one transformer layer's parameters: zero3's unit
    out["gathered"] = 2 * layer * bytes_per.params if strategy == "zero3" else 0
    item = bytes_per.params  # activations in the compute precision
    out["activations"] = transformer_activation_bytes(model, seq_len, micro_batch, recompute, item)
    return out


# --- meshes: tensor and pipeline parallelism composed with ZeRO ----------------------------
#
# N = dp·tp·pp GPUs. Megatron's tensor parallelism (Shoeybi et al. 2019, arXiv 1909.08053)
# cuts every layer's weights, and the vocab-parallel embeddings, across tp GPUs; pipeline
# parallelism gives each of pp stages ceil(L/pp) consecutive layers; ZeRO's stage shards what
# one GPU still holds across the dp GPUs that hold the same piece. Every figure is for a GPU of
# the first pipeline stage, the worst: it has the most layers, the input embedding, and under
# 1F1B the most micro-batches in flight. Predicted by formula, not measured.

GPU_CAPACITY = 80 * 2**30  # an 80 GiB GPU
SCHEDULES = ("1f1b", "gpipe")


def stage_layers(model: Transformer, pp: int) -> int:
    """Layers of the first pipeline stage: ceil(L/pp), so the stages hold all L (126 over 16: 8)."""
    return -(-model.layers // pp)


def stage_params(model: Transformer, tp: int, pp: int) -> float:
    """Parameters one GPU of the first stage holds before ZeRO shards them: its ceil(L/pp)
    layers and the input embedding (with one stage, the output embedding too), all over tp."""
    embeddings = (2 if pp == 1 else 1) * model.vocab * model.hidden
    return (stage_layers(model, pp) * 12 * model.hidden**2 + embeddings) / tp


def layer_activation_bytes(
    model: Transformer, seq_len: int, micro_batch: int, tp: int, sequence_parallel: bool, item: int
) -> int:
    """One micro-batch's activations one GPU keeps for one layer: Korthikanti et al. (2022),
    Table 2, in 16 bits (item = 2). With tp GPUs a layer keeps s·b·h·(10 + 24/t + 5·a·s/(h·t)):
    the layer norms' and dropouts' 10·s·b·h stay whole on every GPU; sequence parallelism cuts
    those along the sequence too, s·b·h/t·(34 + 5·a·s/h). At t = 1 both are s·b·h·(34 + 5·a·s/h).
    """
    s, b, h, a, t = seq_len, micro_batch, model.hidden, model.heads, tp
    scores = 5 * a * s * s * b  # attention's s×s scores, softmax and dropout: cut by t
    replicated = 34 * s * b * h if sequence_parallel else (10 * t + 24) * s * b * h
    return (replicated + scores) * item // (2 * t)


def pipeline_in_flight(pp: int, micro_batches: int, schedule: str) -> int:
    """Micro-batches whose activations the first stage keeps at once: GPipe (Huang et al. 2019)
    runs all m forwards before any backward, m; 1F1B (Narayanan et al. 2021, arXiv 2104.04473)
    starts backward after p forwards, min(m, p). One stage is gradient accumulation: 1."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: choose one of {', '.join(SCHEDULES)}")
    if pp == 1:
        return 1
    return micro_batches if schedule == "gpipe" else min(micro_batches, pp)


def bubble_fraction(pp: int, micro_batches: int) -> float:
    """The share of a step a pipeline's GPUs wait, (p−1)/(m+p−1) (GPipe, Huang et al. 2019,
    arXiv 1811.06965): each GPU idles p−1 of a step's m+p−1 forward-and-backward slots, while
    the pipe fills and drains.
    (Narayanan et al. write (p−1)/m: the same idle time over the compute instead of the step.)"""
    return (pp - 1) / (micro_batches + pp - 1)


def mesh_gpu_bytes(
    model: Transformer,
    strategy: str,
    dp: int,
    tp: int = 1,
    pp: int = 1,
    *,
    precision: str = "bf16",
    seq_len: int = 4096,
    micro_batch: int = 1,
    micro_batches: int = 1,
    schedule: str = "1f1b",
    sequence_parallel: bool = False,
    recompute: bool = False,
) -> dict[str, float]:
    """Bytes per GPU of the first pipeline stage on a (dp, tp, pp) mesh, Adam: gpu_bytes with
    the stage's parameters over tp (`stage_params`) as ZeRO's Ψ over dp, zero3's two gathered
    layers cut by tp, and activations for ceil(L/pp) layers times the micro-batches in flight.
    With tp = pp = 1 it is gpu_bytes(model, strategy, dp, ...)."""
    bytes_per = precision_of(precision, "adam")
    out = state_bytes(strategy, stage_params(model, tp, pp), dp, bytes_per)
    layer = 12 * model.hidden**2 / tp  # zero3's unit: one layer's share of this GPU
    out["gathered"] = 2 * layer * bytes_per.params if strategy == "zero3" else 0
    item = bytes_per.params
    full = layer_activation_bytes(model, seq_len, micro_batch, tp, sequence_parallel, item)
    # recomputation keeps each layer's input, cut along the sequence with sequence parallelism,
    # and one layer's full activations while backward recomputes it
    kept = item * seq_len * micro_batch * model.hidden // (tp if sequence_parallel else 1)
    layers = pipeline_in_flight(pp, micro_batches, schedule) * stage_layers(model, pp)
    out["activations"] = layers * kept + full if recompute else layers * full
    return out


def mesh_traffic_bytes(
    model: Transformer,
    strategy: str,
    dp: int,
    tp: int = 1,
    pp: int = 1,
    *,
    precision: str = "bf16",
    seq_len: int = 4096,
    micro_batch: int = 1,
    micro_batches: int = 1,
    recompute: bool = False,
) -> dict[str, float]:
    """Bytes one GPU sends per step along each dimension of the mesh (ring model, 16 bits):

    dp: the strategy's `traffic_bytes` over the GPU's parameters (`stage_params`, ≈ Ψ/(tp·pp)),
        once per step: the m micro-batches' gradients summed before the reduction.
    tp: per layer and micro-batch, Megatron's 4 allreduces of s·b·h (2 forward, 2 backward;
        recomputation runs forward's 2 again), each sending 2(t−1)/t of it. Sequence
        parallelism turns each into an allgather and a reduce-scatter: the same bytes.
    pp: per micro-batch, s·b·h activations forward over a stage boundary and their gradient
        backward; a middle stage sends both, an end stage one (Megatron's scatter/gather
        would send 1/t of it per GPU, Narayanan et al. 2021, section 4.1: not counted here).
    """
    item = precision_of(precision, "adam").params
    message = item * seq_len * micro_batch * model.hidden  # one s·b·h activation
    allreduces = 6 if recompute else 4
    per_layer = allreduces * 2 * (tp - 1) / tp * message
    return {
        "dp": traffic_bytes(strategy, stage_params(model, tp, pp), dp, item),
        "tp": micro_batches * stage_layers(model, pp) * per_layer,
        "pp": micro_batches * min(2, pp - 1) * message,
    }


def meshes(model: Transformer, gpus: int, max_tp: int = 8) -> list[tuple[int, int, int]]:
    """Every (dp, tp, pp) of `gpus` GPUs worth planning: tp inside one 8-GPU server (its
    allreduces run every layer) and dividing the heads, pp at most one layer per stage."""
    # only tp <= max_tp and pp <= the layers are tried: time in those, not in `gpus` (10^12)
    return [
        (gpus // (tp * pp), tp, pp)
        for tp in range(1, min(max_tp, gpus) + 1)
        if gpus % tp == 0 and model.heads % tp == 0
        for pp in range(1, min(model.layers, gpus // tp) + 1)
        if (gpus // tp) % pp == 0
    ]


def fitting_meshes(
    model: Transformer,
    gpus: int,
    strategy: str = "zero1",
    *,
    capacity: float = GPU_CAPACITY,
    **levers,
) -> list[tuple[int, int, int]]:
    """The meshes of `meshes` whose first-stage GPU needs at most `capacity` bytes; `levers`
    are mesh_gpu_bytes' keywords (micro_batches, schedule, sequence_parallel, recompute, ...)."""
    return [
        mesh
        for mesh in meshes(model, gpus)
        if sum(mesh_gpu_bytes(model, strategy, *mesh, **levers).values()) <= capacity
    ]


# --- predicting this package's ledger exactly ----------------------------------------------


def layer_sizes(model_config: ModelConfig) -> list[int]:
    """Parameters of each layer, in order (0 for ReLU)."""
    return [
        sum(math.prod(s) for s in layer.shapes.values())
        for layer in build_model(model_config).layers
    ]


def padded(size: int, n: int) -> int:
    """A layer's size rounded up to a multiple of N, as FlatParam lays it out."""
    return -(-size // n) * n


def activation_peak(model_config: ModelConfig, micro_batch: int, recompute: bool = False) -> int:
    """The ledger's activation peak of a step: the loop itself, run dry (ledger_bytes).

    Forward keeps each layer's cache (the embedding its tokens, 1 byte each; every other
    layer its float32 input); with recompute it drops each cache but a block's first, and
    backward pushes them again just before the block's backward. Backward counts each new
    dx before it frees the old dx and the layer's cache.
    """
    return ledger_bytes("single", model_config, 1, "sgd", micro_batch, recompute=recompute)[
        "activations"
    ]


def ledger_bytes(
    strategy: str,
    model_config: ModelConfig,
    n: int,
    optimizer: str,
    micro_batch: int,
    *,
    precision: str = "fp32",
    accum: int = 1,
    accum_reduce: str = "every",
    recompute: bool = False,
    tp: int = 1,
    pp: int = 1,
    stage: int = 0,
    micro_batches: int = 1,
    schedule: str = "gpipe",
    sequence_parallel: bool = False,
    cp: int = 1,
    cp_layout: str = "zigzag",
    **options,
) -> dict:
    """What MemoryLedger's peaks per category will be for this run, to the byte: the
    strategy's own code initialises the model and takes one step on placeholders (dryrun.py),
    so the prediction comes from the lines that allocate. N is the ranks the batch is split
    over (micro_batch rows each); with cp = C each holds S/C positions of its rows, and the
    strategy runs over N * C ranks; with tp = T the model's pieces are those of T
    tensor-parallel ranks (tensor.py);
    with pp = P, pipeline rank `stage`'s, stepping `micro_batches` in `schedule` (pipeline.py).

    The keyword arguments are the memory levers and the strategies' own options (zero3's
    layers_per_unit, prefetch, ...; TrainConfig's fields of the same names); the defaults
    are a run without them. Another strategy's options are ignored.
    """
    from .dryrun import dry_run  # it runs the loop, which plans its memory with this module
    from .strategies import STRATEGY_CLASSES

    known = set().union(*(s.options for s in STRATEGY_CLASSES.values()))
    if set(options) - known:
        raise TypeError(f"ledger_bytes: no strategy has the options {sorted(set(options) - known)}")
    ledger = dry_run(
        strategy,
        model_config,
        n,
        optimizer,
        micro_batch,
        precision=precision,
        accum=accum,
        accum_reduce=accum_reduce,
        recompute=recompute,
        tp=tp,
        pp=pp,
        stage=stage,
        micro_batches=micro_batches,
        schedule=schedule,
        sequence_parallel=sequence_parallel,
        cp=cp,
        cp_layout=cp_layout,
        **{k: v for k, v in options.items() if k in STRATEGY_CLASSES[strategy].options},
    )
    return dict(ledger.peak)
