"""dp: data parallelism. Every rank holds everything (as single); gradients are allreduce-meaned.

The whole difference from `single` is one collective per layer in reduce_grads: each rank
computed its gradient on B/N rows, and the mean of the N means is the full batch's gradient.

With gradient accumulation the gradient is a running sum over micro-batches. "every" allreduces
it after each micro-batch (PyTorch DDP's default): the part summed before is already the same on
every rank, so the mean of the sums adds just the mean of the new micro-batch's gradients.
"last" allreduces once, after the last micro-batch (DDP's `no_sync()` around the others).
"""

from __future__ import annotations

from .single import Single


class DataParallel(Single):
    """Full replicas; reduce_grads averages each layer's gradient over ranks (2Ψ traffic)."""

    name = "dp"

    def reduce_grads(self, layer) -> None:
        self.land_grad(layer)
        if self.reducing_now:
            self.comm.allreduce_mean(self.grads[layer.name])
