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


# --- predicting this package's ledger exactly ----------------------------------------------


def layer_sizes(model_config: ModelConfig) -> list[int]:
    """Parameters of each layer, in order (0 for ReLU)."""
    return [sum(math.prod(s) for s in layer.shapes.values()) for layer in MLP(model_config).layers]


def padded(size: int, n: int) -> int:
    """A layer's size rounded up to a multiple of N, as FlatParam lays it out."""
    return -(-size // n) * n


def activation_peak(model_config: ModelConfig, micro_batch: int) -> int:
    """The ledger's activation peak: replay the loop's holds and frees over the layer shapes.

    Forward keeps each layer's cache (the embedding its tokens, 1 byte each; every other
    layer its float32 input); backward counts each new dx (the size of the layer's input)
    before it frees the old dx and the layer's cache.
    """
    c, b = model_config, micro_batch
    layers = MLP(c).layers
    caches, width = [b * c.seq_len], c.seq_len * c.emb
    for layer in layers[1:]:
        caches.append(4 * b * width)
        width = layer.shapes["W"][1] if layer.shapes else width
    dx = 4 * b * c.vocab_size  # dlogits
    live = peak = sum(caches) + dx
    for i in reversed(range(len(layers))):
        new_dx = caches[i] if i > 0 else 0  # the embedding passes no gradient on
        peak = max(peak, live + new_dx)
        live += new_dx - dx - caches[i]
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
) -> dict:
    """What MemoryLedger's peaks per category will be for this run, to the byte.

    The keyword arguments are zero3's options (TrainConfig's fields of the same names).
    """
    sizes = layer_sizes(model_config)
    precision = FP32_ADAM if optimizer == "adam" else FP32_SGD
    init = 4 * max(sizes)  # initialisation draws one layer at a time (Strategy.init_params)
    if strategy == "zero3":
        group = n // replicate  # the ranks that shard; HSDP replicates R such groups
        units = make_units(MLP(model_config).layers, layers_per_unit, group)
        state = state_bytes(strategy, sum(u.flat.padded_numel for u in units), group, precision)
        full = [4 * u.flat.padded_numel for u in units if u.flat.numel]
        buffers = max(init, gathered_peak(full, prefetch, reshard_after_forward))
    else:
        psi_pad, largest = sum(padded(s, n) for s in sizes), max(padded(s, n) for s in sizes)
        if strategy in ("single", "dp"):
            psi_pad, largest = sum(sizes), 0
        state = state_bytes(strategy, psi_pad, n, precision)
        buffers = (4 * largest if strategy == "zero2" else 0) + init
    return {
        **{k: int(v) for k, v in state.items()},
        "buffers": buffers,
        "activations": activation_peak(model_config, micro_batch),
    }
