"""Mixed precision: 16-bit parameters and gradients, fp32 master weights, dynamic loss scaling.

    --precision   params, grads (and on the wire)   optimizer state          bytes per parameter
    fp32          float32                           Adam m, v                4 + 4 + 8  = 16
    bf16, fp16    bfloat16 / float16                fp32 master, Adam m, v   2 + 2 + 12 = 16

The ZeRO paper's accounting (K = 12 with Adam) is the second row. numpy has no 16-bit matrix
multiply that helps, so a layer computes in float32: its 16-bit parameters are upcast for the
layer's forward and backward, and its gradient is computed in float32 and stored in 16 bits.
Both transients are counted by the ledger as buffers. bfloat16 comes from `ml_dtypes` (the
NumPy dtype extension JAX uses); float16 is numpy's own.

`Precision` holds all of it for a strategy: the dtype, the upcast copies, the float32
gradient scratch, the loss scale and the update on the master. The strategies call it, and the
loop stores each layer's gradient through it after backward (store_grad, in passes.backward),
so that no strategy can forget to.

float16 keeps 5 exponent bits: small gradients underflow to 0 and large ones overflow to inf.
Loss scaling multiplies the gradient by S before it is stored in 16 bits and divides it out in
float32 before the update; `LossScaler` adapts S as PyTorch's GradScaler does. bfloat16 has
float32's exponent range and needs no scaling.
"""

from __future__ import annotations

import numpy as np

from .comm import all_agree
from .flat import FlatParam, Params
from .memory import MemoryLedger


def dtype_of(precision: str) -> np.dtype:
    """The dtype of parameters and gradients (and of what collectives move) at `precision`.

    ml_dtypes is imported only for bf16: loading it takes most of a second, longer than the
    rest of a run's start-up (benchmarks/bench_startup.py).
    """
    if precision == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"fp32": np.float32, "fp16": np.float16}[precision])


class LossScaler:
    """Dynamic loss scaling: S doubles after `growth_interval` good steps in a row; a step with
    an inf or NaN in any gradient is skipped and halves S (PyTorch's GradScaler defaults)."""

    def __init__(self, scale: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale, self.growth_interval = scale, growth_interval
        self.good_steps = 0
        self.last_skipped = False  # whether the last step was skipped (the loop records it)

    def update(self, finite: bool) -> bool:
        """Adapt S after a step's gradients were checked; True if the step may update."""
        self.last_skipped = not finite
        if not finite:
            self.scale, self.good_steps = self.scale / 2, 0
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale, self.good_steps = self.scale * 2, 0
        return True


def all_finite(arrays) -> bool:
    """Whether no array holds an inf or a NaN (checked without a full-size temporary)."""
    return all(bool(np.isfinite(a.sum(dtype=np.float32))) for a in arrays if a.size)


class Precision:
    """A strategy's precision policy and its mechanics: what a layer computes with, where its
    gradient is written and how it is stored, and how the update reaches the fp32 master."""

    def __init__(self, precision: str, ledger: MemoryLedger) -> None:
        self.name, self.ledger = precision, ledger
        self.dtype, self.mixed = dtype_of(precision), precision != "fp32"
        self.scaler = LossScaler() if precision == "fp16" else None
        self.upcasts: dict[str, Params] = {}  # float32 copies of 16-bit params, until release
        # float32 gradients backward wrote, to store into (target, whether to add) at land
        self.scratch_grads: dict[str, tuple[Params, Params, bool]] = {}

    def compute_params(self, layer, views: Params) -> Params:
        """The parameters a layer computes with: the views themselves in fp32; in 16 bits,
        float32 copies, counted as a buffer until release (numpy has no fast 16-bit matmul)."""
        if not self.mixed or not views:
            return views
        if layer.name not in self.upcasts:  # once until release (--recompute asks twice)
            flat = FlatParam(layer.shapes)
            full = self.ledger.alloc("buffers", flat.numel, f"{layer.name} upcast")
            self.upcasts[layer.name] = flat.views(full)
            for key, view in views.items():
                self.upcasts[layer.name][key][...] = view
        return self.upcasts[layer.name]

    def release(self, layer) -> None:
        """The layer's float32 copy is free again."""
        if self.upcasts.pop(layer.name, None) is not None:
            self.ledger.free(f"{layer.name} upcast")

    def grad_target(self, layer, target: Params, accumulate: bool) -> Params:
        """Where backward writes the layer's gradient: `target` itself in fp32 unless it
        accumulates; else a float32 scratch (counted) that `store_grad` stores into `target`,
        scaled by the loss scale and rounded to 16 bits, added when accumulating."""
        if not target or not (self.mixed or accumulate):
            return target
        flat = FlatParam(layer.shapes)
        scratch = flat.views(self.ledger.alloc("buffers", flat.numel, f"{layer.name} grad fp32"))
        self.scratch_grads[layer.name] = (scratch, target, accumulate)
        return scratch

    def store_grad(self, layer) -> None:
        """Store the scratch gradient of grad_target into its target and free the scratch."""
        if layer.name not in self.scratch_grads:
            return
        scratch, target, accumulate = self.scratch_grads.pop(layer.name)
        for key, g in scratch.items():
            if self.scaler is not None:
                g *= np.float32(self.scaler.scale)  # a power of two: exact in float32
            if accumulate:
                target[key] += g
            else:
                target[key][...] = g
        self.ledger.free(f"{layer.name} grad fp32")

    def overflowed(self, world, grads) -> bool:
        """fp16: whether any rank's gradients hold an inf or NaN; then the step is skipped and
        the loss scale halved (LossScaler). Always False without loss scaling. Agreed over the
        whole mesh (`world`): a stage or a tensor-parallel piece that overflows alone makes
        every rank skip."""
        if self.scaler is None:
            return False
        return not self.scaler.update(all_agree(world, all_finite(grads)))

    def update(self, optimizer, params: np.ndarray, grad: np.ndarray, state: dict, clip: float):
        """optimizer.update on what this rank owns, the gradient scaled by `clip` (<= 1).
        Mixed precision: the gradient upcast to float32 and unscaled, the update on the fp32
        master, the 16-bit copy refreshed from it."""
        if not self.mixed:
            if clip < 1.0:
                grad *= np.float32(clip)  # this step's gradient: free to scale
            optimizer.update(params, grad, state)
            return
        g = self.ledger.alloc("buffers", grad.size, "step grad fp32")
        g[...] = grad
        if self.scaler is not None:
            g *= np.float32(1 / self.scaler.scale)
        if clip < 1.0:
            g *= np.float32(clip)
        optimizer.update(state["master"], g, state)
        params[...] = state["master"]  # rounded to the nearest 16-bit value
        self.ledger.free("step grad fp32")
