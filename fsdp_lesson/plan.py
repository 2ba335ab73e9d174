"""The ZeRO accounting as formulas: bytes per rank and traffic per step for any model and N.

Two uses: plan a real model (7 B parameters on 64 GPUs, the paper's mixed precision), and
predict, to the byte, what this package's MemoryLedger measures (docs/zero_formulas.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .config import ModelConfig
from .model import MLP
from .sharding import STRATEGIES, ZERO_STAGE, is_sharded
from .units import make_units

STAGES = tuple(s for s in STRATEGIES if s != "single")  # what one plans for N ranks


@dataclass(frozen=True)
class Precision:
    """Bytes per parameter of the parameters, the gradients and the optimizer state."""

    params: int
    grads: int
    optimizer: int


FP32_SGD = Precision(4, 4, 0)  # this package with --optimizer sgd
FP32_ADAM = Precision(4, 4, 8)  # this package with --optimizer adam: m and v
MIXED_ADAM = Precision(2, 2, 12)  # the ZeRO paper: fp16 params and grads, K = 12 (fp32 copy, m, v)
MIXED_SGD = Precision(2, 2, 4)  # --precision bf16/fp16 --optimizer sgd: the fp32 master only


def precision_of(precision: str, optimizer: str) -> Precision:
    """Bytes per parameter of a run of this package (--precision, --optimizer)."""
    if precision == "fp32":
        return FP32_ADAM if optimizer == "adam" else FP32_SGD
    return MIXED_ADAM if optimizer == "adam" else MIXED_SGD


def state_bytes(stage: str, psi: float, n: int, precision: Precision = MIXED_ADAM) -> dict:
    """Bytes per rank of params, grads and optimizer state (the paper's table; Ψ = psi)."""
    full = {
        "params": precision.params * psi,
        "grads": precision.grads * psi,
        "optimizer": precision.optimizer * psi,
    }
    return {cat: b / n if is_sharded(ZERO_STAGE[stage], cat) else b for cat, b in full.items()}


def traffic_bytes(stage: str, psi: float, n: int, bytes_per_element: int = 4) -> float:
    """Bytes one rank sends per step under the ring model: 2Ψ for dp/zero1/zero2, 3Ψ for zero3."""
    passes = 3 if stage == "zero3" else 2  # zero3: allgather fwd + allgather bwd + reduce-scatter
    return passes * (n - 1) / n * psi * bytes_per_element


def step_seconds(
    stage: str, psi: float, n: int, bandwidth: float, bytes_per_element: int = 2
) -> float:
    """A model, not a measurement: the step's communication time, traffic / bandwidth (B/s).

    2 bytes per element by default: the paper's fp16 gradients and parameters on the wire.
    """
    return traffic_bytes(stage, psi, n, bytes_per_element) / bandwidth


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
    stage: str,
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
    out = state_bytes(stage, model.params, n, bytes_per)
    layer = 12 * model.hidden**2  # one transformer layer's parameters: zero3's unit
    out["gathered"] = 2 * layer * bytes_per.params if stage == "zero3" else 0
    item = bytes_per.params  # activations in the compute precision
    out["activations"] = transformer_activation_bytes(model, seq_len, micro_batch, recompute, item)
    return out


# --- predicting this package's ledger exactly ----------------------------------------------


def layer_sizes(model_config: ModelConfig) -> list[int]:
    """Parameters of each layer, in order (0 for ReLU)."""
    return [sum(math.prod(s) for s in layer.shapes.values()) for layer in MLP(model_config).layers]


def padded(size: int, n: int) -> int:
    """A layer's size rounded up to a multiple of N, as FlatParam lays it out."""
    return -(-size // n) * n


def activation_peak(model_config: ModelConfig, micro_batch: int, recompute: bool = False) -> int:
    """The ledger's activation peak: replay the loop's holds and frees over the layer shapes.

    Forward keeps each layer's cache (the embedding its tokens, 1 byte each; every other
    layer its float32 input); with recompute it drops each cache but a block's first once
    the layer has run, and backward pushes them again just before the block's backward.
    Backward counts each new dx (the size of the layer's input) before it frees the old dx
    and the layer's cache.
    """
    c, b = model_config, micro_batch
    model = MLP(c)
    caches, width = [b * c.seq_len], c.seq_len * c.emb
    for layer in model.layers[1:]:
        caches.append(4 * b * width)
        width = layer.shapes["W"][1] if layer.shapes else width
    first, index = [], 0  # each block's first layer index, and the layers after it
    for block in model.blocks:
        first.append((index, range(index + 1, index + len(block))))
        index += len(block)
    kept = {i for i, _ in first}
    live = peak = 0
    for i, size in enumerate(caches):  # forward
        live += size
        peak = max(peak, live)
        if recompute and i not in kept:
            live -= size
    dx = 4 * b * c.vocab_size  # dlogits
    live += dx
    peak = max(peak, live)
    for i, rest in reversed(first):  # backward, a block at a time
        if recompute:
            for j in rest:
                live += caches[j]
                peak = max(peak, live)
        for j in reversed(range(i, rest.stop)):
            new_dx = caches[j] if j > 0 else 0  # the embedding passes no gradient on
            peak = max(peak, live + new_dx)
            live += new_dx - dx - caches[j]
            dx = new_dx
    return peak


def gathered_peak(units: list[int], prefetch: bool, reshard_after_forward: bool) -> int:
    """zero3's peak of gathered parameters and full gradients, from its units' full bytes.

    Replays the order of zero3's allocations: forward holds unit u (and u+1 when
    prefetching; without resharding, every unit so far); backward holds u's parameters and
    gradient, u-1's prefetched parameters, and u+1's gradient while it is reduce-scattered.
    """
    peak, count = 0, len(units)
    for u in range(count):  # forward
        held = sum(units[: u + 1]) if not reshard_after_forward else units[u]
        ahead = units[u + 1] if prefetch and u + 1 < count else 0
        peak = max(peak, held + ahead)
    for u in reversed(range(count)):  # backward
        if reshard_after_forward:
            params = units[u] + (units[u - 1] if prefetch and u > 0 else 0)
        else:
            params = sum(units[: u + 1])  # kept since forward, freed after each backward
        grads = units[u] + (units[u + 1] if prefetch and u + 1 < count else 0)
        peak = max(peak, params + grads)
    return peak


def kept_full_peak(
    kept: list[int], upcast: list[int], sizes: list[int], mixed: bool, accum: int
) -> int:
    """zero2 with accum_reduce "last": the peak of every layer's kept full gradient (bytes
    `kept`) plus one layer's float32 upcast and gradient scratch.

    Micro-batch 0 allocates them from the last layer down; the middle micro-batches hold all
    of them; the last frees each after its reduce-scatter, from the last layer down.
    """
    first = [u + (4 * s if mixed else 0) for u, s in zip(upcast, sizes, strict=True)]
    later = [u + 4 * s for u, s in zip(upcast, sizes, strict=True)]
    peak = sum(kept) + max(upcast)  # forward of micro-batch 1
    if accum >= 3:
        peak = max(peak, sum(kept) + max(later))
    for i in range(len(kept)):
        peak = max(peak, sum(kept[i:]) + first[i], sum(kept[: i + 1]) + later[i])
    return peak


def per_layer(flat, layer: str) -> int:
    """Parameters of one layer of a unit's flat layout (its keys are "layer.param")."""
    return sum(size for key, size in flat.sizes.items() if key.rsplit(".", 1)[0] == layer)


def zero3_buffer_peak(
    units: list[list[int]],
    padded_numels: list[int],
    group: int,
    item: int,
    *,
    mixed: bool,
    accum: int,
    keep_full: bool,
    prefetch: bool,
    reshard_after_forward: bool,
) -> int:
    """zero3's peak of buffers over one step, replaying its allocations in their order.

    units: each non-empty unit's layers' parameter counts; its full buffers (gathered
    parameters, full gradient) hold `item` bytes per element of its padded size. The levers
    add: each layer's float32 upcast (mixed precision), its float32 gradient scratch (mixed,
    or adding into a kept gradient), a micro-batch's gradient shard to add ("every", after
    the first micro-batch) and full gradients kept across micro-batches ("last").
    """
    live: dict[tuple, int] = {}
    peak, count, pending = 0, len(units), []
    full = [item * p for p in padded_numels]
    # the micro-batches between the first and the last repeat one another exactly: one of
    # them stands for all (a step of --accum 10^9 is predicted at once, not replayed 10^9 times)
    accum = min(accum, 3)

    def hold(key: tuple, nbytes: int) -> None:
        nonlocal peak
        if key not in live:
            live[key] = nbytes
            peak = max(peak, sum(live.values()))

    def finish(u: int) -> None:  # a unit's reduce-scatter completes: its buffers are free
        live.pop(("grad", u))
        live.pop(("part", u), None)

    for micro in range(accum):
        while pending:  # begin_micro_batch
            finish(pending.pop(0))
        for u in range(count):  # forward
            hold(("params", u), full[u])
            if prefetch and u + 1 < count:
                hold(("params", u + 1), full[u + 1])
            for numel in units[u]:
                hold(("upcast",), 4 * numel if mixed else 0)
                live.pop(("upcast",))
            if reshard_after_forward:
                live.pop(("params", u))
        for u in reversed(range(count)):  # backward
            hold(("params", u), full[u])
            if prefetch and u > 0:
                hold(("params", u - 1), full[u - 1])
            for i in reversed(range(len(units[u]))):
                hold(("upcast",), 4 * units[u][i] if mixed else 0)
                hold(("grad", u), full[u])
                if mixed or (keep_full and micro > 0):
                    hold(("scratch",), 4 * units[u][i])
                    live.pop(("scratch",))
                if i == 0 and (not keep_full or micro == accum - 1):
                    if micro > 0 and not keep_full:
                        hold(("part", u), full[u] // group)
                    pending.append(u)
                    while len(pending) > (1 if prefetch else 0):
                        finish(pending.pop(0))
                live.pop(("upcast",))
            live.pop(("params", u))
    if mixed:  # step(): each owned gradient shard upcast to float32 for the update
        hold(("step",), max(4 * p // group for p in padded_numels))
    return peak


def ledger_bytes(
    strategy: str,
    model_config: ModelConfig,
    n: int,
    optimizer: str,
    micro_batch: int,
    *,
    layers_per_unit: int = 1,
    prefetch: bool = True,
    reshard_after_forward: bool = True,
    replicate: int = 1,
    precision: str = "fp32",
    accum: int = 1,
    accum_reduce: str = "every",
    recompute: bool = False,
) -> dict:
    """What MemoryLedger's peaks per category will be for this run, to the byte.

    The keyword arguments are zero3's options and the memory levers (TrainConfig's fields
    of the same names); the defaults are a run without them.
    """
    sizes = layer_sizes(model_config)
    bytes_per = precision_of(precision, optimizer)
    mixed, item = precision != "fp32", bytes_per.params
    keep_full = accum_reduce == "last" and accum > 1
    init = 4 * max(sizes)  # initialisation draws one layer at a time (Strategy.init_params)
    if strategy == "zero3":
        group = n // replicate  # the ranks that shard; HSDP replicates R such groups
        units = make_units(MLP(model_config).layers, layers_per_unit, group)
        state = state_bytes(strategy, sum(u.flat.padded_numel for u in units), group, bytes_per)
        units = [u for u in units if u.flat.numel]
        numels = [[per_layer(u.flat, layer) for layer in u.layers] for u in units]
        replay = zero3_buffer_peak(
            [[x for x in layers if x] for layers in numels],
            [u.flat.padded_numel for u in units],
            group,
            item,
            mixed=mixed,
            accum=accum,
            keep_full=keep_full,
            prefetch=prefetch,
            reshard_after_forward=reshard_after_forward,
        )
        buffers = max(init, replay)
    else:
        psi_pad, largest = sum(padded(s, n) for s in sizes), max(padded(s, n) for s in sizes)
        owned = [padded(s, n) // n for s in sizes]  # a shard of the optimizer state
        if strategy in ("single", "dp"):
            psi_pad, largest, owned = sum(sizes), 0, sizes
        state = state_bytes(strategy, psi_pad, n, bytes_per)
        persistent = item * largest if strategy == "zero2" and not keep_full else 0
        accumulating = accum > 1 and (strategy != "zero2" or keep_full)
        scratch = [4 * s if mixed or accumulating else 0 for s in sizes]
        every = strategy == "zero2" and accum > 1 and not keep_full
        part = [item * o if every else 0 for o in owned]  # a micro-batch's shard, to add
        upcast = [4 * s if mixed else 0 for s in sizes]
        during = max(u + max(c, p) for u, c, p in zip(upcast, scratch, part, strict=True))
        if strategy == "zero2" and keep_full:  # every layer's full gradient, kept
            kept = [item * padded(s, n) for s in sizes]
            during = kept_full_peak(kept, upcast, sizes, mixed, accum)
        step = 4 * max(owned) if mixed else 0  # the owned gradient, upcast for the update
        # zero2's transient is allocated at the first backward, after initialisation's layer
        buffers = max(init, persistent + during, persistent + step)
    return {
        **{k: int(v) for k, v in state.items()},
        "buffers": buffers,
        "activations": activation_peak(model_config, micro_batch, recompute),
    }
