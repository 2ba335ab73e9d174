"""Mixed precision: 16-bit parameters and gradients, fp32 master weights, dynamic loss scaling.

    --precision   params, grads (and on the wire)   optimizer state          bytes per parameter
    fp32          float32                           Adam m, v                4 + 4 + 8  = 16
    bf16, fp16    bfloat16 / float16                fp32 master, Adam m, v   2 + 2 + 12 = 16

The ZeRO paper's accounting (K = 12 with Adam) is the second row. numpy has no 16-bit matrix
multiply that helps, so a layer computes in float32: its 16-bit parameters are upcast for the
layer's forward and backward, and its gradient is computed in float32 and stored in 16 bits.
Both transients are counted by the ledger as buffers. bfloat16 comes from `ml_dtypes` (the
NumPy dtype extension JAX uses); float16 is numpy's own.

float16 keeps 5 exponent bits: small gradients underflow to 0 and large ones overflow to inf.
Loss scaling multiplies the gradient by S before it is stored in 16 bits and divides it out in
float32 before the update; `LossScaler` adapts S as PyTorch's GradScaler does. bfloat16 has
float32's exponent range and needs no scaling.
"""

from __future__ import annotations

import numpy as np

PRECISIONS = ("fp32", "bf16", "fp16")


def dtype_of(precision: str) -> np.dtype:
    """The dtype of parameters and gradients (and of what collectives move) at `precision`.

    ml_dtypes is imported only for bf16: loading it takes most of a second, longer than the
    rest of a run's start-up (benchmarks/bench_startup.py).
    """
    if precision == "bf16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"fp32": np.float32, "fp16": np.float16}[precision])


def is_16bit(dtype: np.dtype) -> bool:
    """bfloat16 or float16: MPI has no sum for them, so the ring reduces them in numpy."""
    return np.dtype(dtype).itemsize == 2


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
