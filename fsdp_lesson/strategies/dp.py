"""dp: data parallelism. Every rank holds everything (as single); gradients are allreduce-meaned.

The whole difference from `single` is one collective per layer: each rank computed its
gradient on B/N rows, and the mean of the N means is the full batch's gradient. As PyTorch
DDP does, a layer's allreduce starts in reduce_grads, as soon as its backward is done, and
runs while the layers below compute theirs; step() waits for them all before updating. The
ranks then meet once per step instead of once per layer, with the same numbers.

With gradient accumulation the gradient is a running sum over micro-batches. "every" allreduces
it after each micro-batch (PyTorch DDP's default): the part summed before is already the same on
every rank, so the mean of the sums adds just the mean of the new micro-batch's gradients.
"last" allreduces once, after the last micro-batch (DDP's `no_sync()` around the others).
"""

from __future__ import annotations

from ..requests import Request
from .single import Single


class DataParallel(Single):
    """Full replicas; reduce_grads averages each layer's gradient over ranks (2Ψ traffic)."""

    name = "dp"

    def __init__(self, model, optimizer, comm, ledger, **memory_options) -> None:
        super().__init__(model, optimizer, comm, ledger, **memory_options)
        self.reducing: list[Request] = []  # the allreduces in flight, one per layer

    def reduce_grads(self, layer) -> None:
        if self.reducing_now:
            self.reducing.append(self.comm.iallreduce_mean(self.grads[layer.name], layer.name))

    def finish_reductions(self) -> None:
        """Wait for every allreduce in flight: the gradients are the means from here on."""
        for request in self.reducing:
            request.wait()
        self.reducing.clear()

    def begin_phase(self, phase: str) -> None:
        """A forward (the next micro-batch's, evaluation's) starts once the reductions are done:
        with one pipeline stage, exactly where train_step's next micro-batch begins."""
        if phase == "forward":
            self.finish_reductions()
        super().begin_phase(phase)

    def begin_micro_batch(self, micro: int) -> None:
        self.finish_reductions()  # the next backward adds to these gradients
        super().begin_micro_batch(micro)

    def step(self) -> None:
        self.finish_reductions()
        super().step()
