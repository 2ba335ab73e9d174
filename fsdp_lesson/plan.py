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
    """A Llama decoder's shape, enough to count its bytes: RMSNorm before attention and MLP,
    grouped-query attention (kv_heads ≤ heads share keys and values), a SwiGLU MLP of width
    `ffn`, no biases, no dropout, input and output embeddings not tied."""

    name: str
    layers: int  # L
    hidden: int  # h
    heads: int  # a, query heads
    kv_heads: int  # key/value heads: a for multi-head attention, fewer with GQA
    ffn: int  # f, the MLP's intermediate width
    vocab: int  # V
    head_dim: int = 128  # d; a·d = h in every Llama

    @property
    def layer_params(self) -> int:
        """One layer: Q and O (2·h·a·d), K and V (2·h·kv·d), the MLP's gate, up and down
        (3·h·f), and the two RMSNorm weights (2·h): zero3's unit."""
        h, d = self.hidden, self.head_dim
        return 2 * h * self.heads * d + 2 * h * self.kv_heads * d + 3 * h * self.ffn + 2 * h

    @property
    def params(self) -> int:
        """Ψ: L layers, the input and output embeddings (2·V·h, untied) and the final norm."""
        return self.layers * self.layer_params + 2 * self.vocab * self.hidden + self.hidden


# The shapes of the published config.json files (num_hidden_layers, hidden_size,
# num_attention_heads, num_key_value_heads, intermediate_size, vocab_size; the Llama 3 paper's
# Table 3 has the same layers, widths and heads, and 128,000 words without the checkpoints' 256
# reserved tokens); Ψ lands on the checkpoints' counts to the parameter: 6,738,415,616 for
# Llama 2 7B, 8,030,261,248, 70,553,706,496 and 405,853,388,800 for Llama 3.1 8B, 70B, 405B.
LLAMA_7B = Transformer("7B", 32, 4096, heads=32, kv_heads=32, ffn=11_008, vocab=32_000)  # Llama 2
LLAMA_8B = Transformer("8B", 32, 4096, heads=32, kv_heads=8, ffn=14_336, vocab=128_256)
LLAMA_70B = Transformer("70B", 80, 8192, heads=64, kv_heads=8, ffn=28_672, vocab=128_256)
LLAMA_405B = Transformer("405B", 126, 16_384, heads=128, kv_heads=8, ffn=53_248, vocab=128_256)
MODELS = {model.name: model for model in (LLAMA_7B, LLAMA_8B, LLAMA_70B, LLAMA_405B)}

ATTENTION = ("materialized", "flash")  # attention's s×s probabilities kept, or FlashAttention
RECOMPUTE = ("none", "selective", "full")


def recompute_mode(recompute: bool | str) -> str:
    """`recompute` as one of RECOMPUTE: True is "full" (every layer), False "none"."""
    if isinstance(recompute, bool):
        return "full" if recompute else "none"
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r}: choose one of {', '.join(RECOMPUTE)}")
    return recompute


def layer_activation_bytes(
    model: Transformer,
    seq_len: int,
    micro_batch: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    item: int = 2,
    *,
    cp: int = 1,
    attention: str = "materialized",
    selective: bool = False,
) -> int:
    """Bytes one GPU keeps for one layer's backward, one micro-batch of b sequences of s tokens,
    activations of `item` bytes: Korthikanti et al. (2022, arXiv 2205.05198) counted term by
    term for a Llama layer (docs/long_context.md). Per token, in elements:

      whole on every tp GPU (cut by t along the sequence with sequence parallelism):
        4h   the two RMSNorms' inputs and outputs (the outputs feed QKV and the MLP)
      cut by t (Megatron splits heads and the MLP's width):
        a·d  Q, after RoPE               2·kv·d  K and V (GQA: kv heads, not a)
        a·d  attention's output, the input of the output projection
        3f   the MLP's gate and up outputs and their SwiGLU product (the down projection's input)
        a·s  "materialized": the softmax probabilities of every query against all s keys,
             kept for the softmax's backward and the product with V (no dropout in Llama);
             "flash" keeps a fp32 log-sum-exp per query and head instead, 4·a bytes.
    `selective` recomputation (Korthikanti's) drops the a·s probabilities. Context
    parallelism over `cp` GPUs gives each the queries, keys and values of s/cp tokens, so
    every term is /cp: the probabilities are the local queries' against all s keys. Ring
    attention keeps a GPU's own K/V for backward and passes them around again there; the
    blocks in flight (at most two of K and V, s/cp tokens each) are not counted.
    With MHA, a 4h GELU MLP and dropout the same count is the paper's sbh·(34 + 5as/h).
    """
    s, b, h, t, c = seq_len, micro_batch, model.hidden, tp, cp
    ad, kvd = model.heads * model.head_dim, model.kv_heads * model.head_dim
    whole = 4 * h * item  # bytes per token: the norms' inputs and outputs
    cut = (2 * ad + 2 * kvd + 3 * model.ffn) * item
    if attention == "flash":
        cut += 4 * model.heads  # the fp32 log-sum-exp of each head's softmax
    elif attention != "materialized":
        raise ValueError(f"attention {attention!r}: choose one of {', '.join(ATTENTION)}")
    elif not selective:
        cut += model.heads * s * item  # the probabilities: a·s per token, a·s²·b in all
    if sequence_parallel:
        return s * b * (whole + cut) // (t * c)
    return s * b * whole // c + s * b * cut // (t * c)


def layer_input_bytes(
    model: Transformer,
    seq_len: int,
    micro_batch: int,
    tp: int,
    sequence_parallel: bool,
    item: int,
    cp: int = 1,
) -> int:
    """What full recomputation keeps of a layer: its input, s·b·h, cut along the sequence by
    cp, and by tp too with sequence parallelism."""
    cut = cp * (tp if sequence_parallel else 1)
    return seq_len * micro_batch * model.hidden * item // cut


def logits_bytes(
    model: Transformer, seq_len: int, micro_batch: int, tp: int = 1, cp: int = 1
) -> int:
    """The output layer's fp32 logits, which the cross-entropy keeps for backward: s·b·V·4
    bytes, the vocabulary cut by tp (Megatron's vocab-parallel loss), the tokens by cp."""
    return 4 * seq_len * micro_batch * model.vocab // (tp * cp)


def transformer_activation_bytes(
    model: Transformer,
    seq_len: int,
    micro_batch: int,
    recompute: bool | str,
    item: int = 2,
    *,
    tp: int = 1,
    sequence_parallel: bool = False,
    cp: int = 1,
    attention: str = "materialized",
    layers: int | None = None,
) -> int:
    """Activations one GPU keeps for backward over `layers` layers (default: all L) of one
    micro-batch, a prediction by `layer_activation_bytes`. "none" keeps every layer's;
    "selective" every layer's but attention's probabilities; "full" (or True) only each
    layer's input, plus one layer's full activations while backward recomputes it."""
    mode, layers = recompute_mode(recompute), model.layers if layers is None else layers
    shape = dict(tp=tp, sequence_parallel=sequence_parallel, item=item, cp=cp, attention=attention)
    full = layer_activation_bytes(model, seq_len, micro_batch, **shape)
    if mode == "none":
        return layers * full
    if mode == "selective":
        return layers * layer_activation_bytes(model, seq_len, micro_batch, **shape, selective=True)
    kept = layer_input_bytes(model, seq_len, micro_batch, tp, sequence_parallel, item, cp)
    return layers * kept + full


def gpu_bytes(model: Transformer, strategy: str, n: int, **levers) -> dict[str, float]:
    """Bytes per GPU of a real model with Adam on n GPUs of data parallelism alone: the ZeRO
    state (`state_bytes`), zero3's gathered layers (one computing, one prefetched, in 16 bits)
    and the activations with the logits. `levers`: mesh_gpu_bytes' (precision, seq_len,
    micro_batch, recompute, attention)."""
    return mesh_gpu_bytes(model, strategy, n, **levers)


# --- meshes: tensor, pipeline and context parallelism composed with ZeRO -------------------
#
# N = dp·tp·pp·cp GPUs. Megatron's tensor parallelism (Shoeybi et al. 2019, arXiv 1909.08053)
# cuts every layer's weights, and the vocab-parallel embeddings, across tp GPUs; pipeline
# parallelism gives each of pp stages ceil(L/pp) consecutive layers; context parallelism gives
# each of cp GPUs s/cp tokens of every sequence (ring attention, Liu et al. 2023, arXiv
# 2310.01889), all of the model; ZeRO's stage shards what one GPU still holds across the
# dp·cp GPUs that hold the same piece (Megatron's distributed optimizer and torchtitan's FSDP
# both shard over dp × cp: those GPUs hold the same weights and sum the same gradients).
# Every figure is for a GPU of the first pipeline stage, the worst: it has the most layers,
# the input embedding, and under 1F1B the most micro-batches in flight. Predicted by formula,
# not measured.

GPU_CAPACITY = 80 * 2**30  # an 80 GiB GPU
SCHEDULES = ("1f1b", "gpipe")


def stage_layers(model: Transformer, pp: int) -> int:
    """Layers of the first pipeline stage: ceil(L/pp), so the stages hold all L (126 over 16: 8)."""
    return -(-model.layers // pp)


def stage_params(model: Transformer, tp: int, pp: int) -> float:
    """Parameters one GPU of the first stage holds before ZeRO shards them: its ceil(L/pp)
    layers and the input embedding (with one stage, the output embedding and the final norm
    too), all over tp. stage_params(model, 1, 1) is model.params."""
    ends = model.vocab * model.hidden + (pp == 1) * (model.vocab + 1) * model.hidden
    return (stage_layers(model, pp) * model.layer_params + ends) / tp


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


def splits_heads(model: Transformer, tp: int) -> bool:
    """Whether tp GPUs split the query and the key/value heads evenly (Megatron's cut)."""
    return model.heads % tp == 0 and model.kv_heads % tp == 0


def mesh_problem(
    model: Transformer,
    seq_len: int,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
) -> str | None:
    """Why the formulas cannot plan this mesh (what would not split evenly), or None."""
    if not splits_heads(model, tp):
        return (
            f"tp {tp} does not divide {model.name}'s {model.heads} query and"
            f" {model.kv_heads} key/value heads"
        )
    if pp > model.layers:
        return f"pp {pp} leaves stages of {model.name}'s {model.layers} layers empty"
    if cp > 1 and seq_len % (2 * cp):
        return (
            f"cp {cp} needs a sequence of whole zig-zag chunks, a multiple of 2·cp ="
            f" {2 * cp} tokens; {seq_len} is not"
        )
    if sequence_parallel and seq_len % (cp * tp):
        return f"sequence parallelism cuts s/cp over tp: {seq_len} is not a multiple of {cp * tp}"
    return None


def mesh_gpu_bytes(
    model: Transformer,
    strategy: str,
    dp: int,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    *,
    precision: str = "bf16",
    seq_len: int = 4096,
    micro_batch: int = 1,
    micro_batches: int = 1,
    schedule: str = "1f1b",
    sequence_parallel: bool = False,
    recompute: bool | str = False,
    attention: str = "materialized",
) -> dict[str, float]:
    """Bytes per GPU of the first pipeline stage on a (dp, tp, pp, cp) mesh, Adam: the ZeRO
    state of the stage's parameters over tp (`stage_params`) sharded over dp·cp, zero3's two
    gathered layers cut by tp, and activations (`transformer_activation_bytes`) for ceil(L/pp)
    layers times the micro-batches in flight, with the logits when one stage is also the last.

    attention="materialized" (the default) keeps attention's s×s probabilities, as the course's
    own attention and Korthikanti et al. do: the term that grows with s². "flash" is what
    long-context runs use (FlashAttention keeps none). With tp = pp = cp = 1 it is gpu_bytes."""
    bytes_per = precision_of(precision, "adam")
    out = state_bytes(strategy, stage_params(model, tp, pp), dp * cp, bytes_per)
    out["gathered"] = 2 * model.layer_params / tp * bytes_per.params if strategy == "zero3" else 0
    item = bytes_per.params  # activations in the compute precision
    layers = pipeline_in_flight(pp, micro_batches, schedule) * stage_layers(model, pp)
    out["activations"] = transformer_activation_bytes(
        model,
        seq_len,
        micro_batch,
        recompute,
        item,
        tp=tp,
        sequence_parallel=sequence_parallel,
        cp=cp,
        attention=attention,
        layers=layers,
    ) + (logits_bytes(model, seq_len, micro_batch, tp, cp) if pp == 1 else 0)
    return out


def mesh_traffic_bytes(
    model: Transformer,
    strategy: str,
    dp: int,
    tp: int = 1,
    pp: int = 1,
    cp: int = 1,
    *,
    precision: str = "bf16",
    seq_len: int = 4096,
    micro_batch: int = 1,
    micro_batches: int = 1,
    recompute: bool | str = False,
) -> dict[str, float]:
    """Bytes one GPU sends per step along each dimension of the mesh (ring model, 16 bits):

    dp: the strategy's `traffic_bytes` over the GPU's parameters (`stage_params`, ≈ Ψ/(tp·pp))
        among the dp·cp GPUs that share them, once per step: the m micro-batches' gradients
        summed before the reduction.
    tp: per layer and micro-batch, Megatron's 4 allreduces of s/cp·b·h (2 forward, 2 backward;
        full recomputation runs forward's 2 again), each sending 2(t−1)/t of it. Sequence
        parallelism turns each into an allgather and a reduce-scatter: the same bytes.
    pp: per micro-batch, s/cp·b·h activations forward over a stage boundary and their gradient
        backward; a middle stage sends both, an end stage one (Megatron's scatter/gather
        would send 1/t of it per GPU, Narayanan et al. 2021, section 4.1: not counted here).
    cp: per layer and micro-batch, ring attention passes each GPU's K and V block
        (2·s/cp·b·kv·d/t elements) cp − 1 hops forward, and in backward again with its dK and
        dV: 3 passes (4 with full recomputation, which runs the forward ring again).
    """
    item, full = precision_of(precision, "adam").params, recompute_mode(recompute) == "full"
    message = item * seq_len * micro_batch * model.hidden / cp  # one s/cp·b·h activation
    per_layer = (6 if full else 4) * 2 * (tp - 1) / tp * message
    kv_block = item * 2 * seq_len / cp * micro_batch * model.kv_heads * model.head_dim / tp
    layers = micro_batches * stage_layers(model, pp)
    return {
        "dp": traffic_bytes(strategy, stage_params(model, tp, pp), dp * cp, item),
        "tp": layers * per_layer,
        "pp": micro_batches * min(2, pp - 1) * message,
        "cp": layers * (4 if full else 3) * (cp - 1) * kv_block,
    }


def meshes(
    model: Transformer, gpus: int, max_tp: int = 8, max_cp: int = 1
) -> list[tuple[int, int, int, int]]:
    """Every (dp, tp, pp, cp) of `gpus` GPUs worth planning: tp inside one 8-GPU server (its
    allreduces run every layer) dividing the query and key/value heads, pp at most one layer per
    stage, cp at most max_cp (1: no context parallelism)."""
    # only tp <= max_tp, pp <= the layers and cp <= max_cp are tried: time in those, not in
    # `gpus` (10^12)
    return [
        (gpus // (tp * pp * cp), tp, pp, cp)
        for tp in range(1, min(max_tp, gpus) + 1)
        if gpus % tp == 0 and splits_heads(model, tp)
        for pp in range(1, min(model.layers, gpus // tp) + 1)
        if (gpus // tp) % pp == 0
        for cp in range(1, min(max_cp, gpus // (tp * pp)) + 1)
        if (gpus // (tp * pp)) % cp == 0
    ]


def fitting_meshes(
    model: Transformer,
    gpus: int,
    strategy: str = "zero1",
    *,
    capacity: float = GPU_CAPACITY,
    max_cp: int = 1,
    **levers,
) -> list[tuple[int, int, int, int]]:
    """The meshes of `meshes` whose first-stage GPU needs at most `capacity` bytes and whose
    sequence splits evenly (`mesh_problem`); `levers` are mesh_gpu_bytes' keywords
    (seq_len, micro_batches, schedule, sequence_parallel, recompute, attention, ...)."""
    seq_len, parallel = levers.get("seq_len", 4096), levers.get("sequence_parallel", False)
    return [
        mesh
        for mesh in meshes(model, gpus, max_cp=max_cp)
        if mesh_problem(model, seq_len, *mesh[1:], sequence_parallel=parallel) is None
        and sum(mesh_gpu_bytes(model, strategy, *mesh, **levers).values()) <= capacity
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
