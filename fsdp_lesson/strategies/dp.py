"""dp: data parallelism. Every rank holds everything (as single); gradients are allreduce-meaned.

The whole difference from `single` is one collective per layer in reduce_grads: each rank
computed its gradient on B/N rows, and the mean of the N means is the full batch's gradient.
"""

from __future__ import annotations

from .single import Single


class DataParallel(Single):
    """Full replicas; reduce_grads averages each layer's gradient over ranks (2Ψ traffic)."""

    name = "dp"

    def reduce_grads(self, layer) -> None:
        self.comm.allreduce_mean(self.grads[layer.name])
