"""single: every parameter, gradient and optimizer state on one rank: the reference.

With context parallelism alone (`--cp C`, dp = 1) the one copy of the model runs on C ranks, each
holding a slice of every sequence; their gradients are averaged (reduce_grads).
"""

from __future__ import annotations

from ..model import Params
from .base import Strategy


class Single(Strategy):
    """Full parameters, full gradients, full optimizer state. Its hooks (whole parameters,
    whole gradients) are dp's, zero1's and zero2's too; those change what follows backward."""

    name = "single"

    def __init__(self, model, optimizer, comm, ledger, **memory_options) -> None:
        super().__init__(model, optimizer, comm, ledger, **memory_options)
        self.params = self.alloc_per_layer("params", "params")
        self.opt_state = self.init_optimizer_state()
        self.param_views = {name: f.views(self.params[name]) for name, f in self.layout.items()}
        self.alloc_grads()

    def alloc_grads(self) -> None:
        """Every layer's whole gradient, where backward writes it (zero2 keeps a shard)."""
        self.grads = self.alloc_per_layer("grads", "grads")
        self.grad_views = {name: f.views(self.grads[name]) for name, f in self.layout.items()}

    def param_arrays(self):
        return self.params

    def materialize(self, layer) -> Params:
        return self.precision.compute_params(layer, self.param_views[layer.name])

    def grad_buffer(self, layer) -> Params:
        """The layer's whole gradient; after the first micro-batch, added to (accumulation)."""
        return self.precision.grad_target(layer, self.grad_views[layer.name], self.micro > 0)

    def reduce_grads(self, layer) -> None:
        """With context parallelism alone (dp = 1, cp = C: the ranks single runs over) each rank
        computed the gradient of its slice of every sequence, and their mean is the sequences'
        (Megatron averages over cp too when dp is 1). On one rank there is nothing to do."""
        if self.comm.size > 1 and self.reducing_now:
            self.comm.allreduce_mean(self.grads[layer.name], layer.name)

    def step(self) -> None:
        if self.precision.overflowed(self.mesh.world, self.grads.values()):
            return
        self.clip_grads(self.grads, sharded=False)  # whole gradients, alike on every dp rank
        self.optimizer.start_step()
        for name in self.layout:
            self.update(self.params[name], self.grads[name], self.opt_state[name])
