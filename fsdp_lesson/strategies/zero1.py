"""zero1 (ZeRO stage 1, P_os): shard the optimizer state; keep full parameters and gradients.

Backward is exactly dp's, without the allreduce. Then, per layer: reduce-scatter-mean the
full gradient (each rank gets the mean of its own slice), update the owned slice of the
parameters with the owned slice of Adam's state, and allgather the updated slices. An
allreduce is a reduce-scatter plus an allgather, so this moves the same 2Ψ as dp.
"""

from __future__ import annotations

from ..model import Params
from .base import Strategy


class ZeRO1(Strategy):
    """Full (padded) params and grads on every rank; optimizer state for the owned shard only."""

    name = "zero1"

    def __init__(self, model, optimizer, comm, ledger, **levers) -> None:
        super().__init__(model, optimizer, comm, ledger, **levers)
        self.params = self.alloc_per_layer("params", "params")
        self.opt_state = self.init_optimizer_state()
        self.param_views = {name: f.views(self.params[name]) for name, f in self.layout.items()}
        self.alloc_grads()

    def alloc_grads(self) -> None:
        """zero1 keeps every layer's full gradient (zero2 changes only this and reduce_grads)."""
        self.grads = self.alloc_per_layer("grads", "grads")
        self.grad_views = {name: f.views(self.grads[name]) for name, f in self.layout.items()}

    def param_arrays(self):
        return self.params

    def materialize(self, layer) -> Params:
        return self.upcast(layer, self.param_views[layer.name])

    def grad_buffer(self, layer) -> Params:
        """The layer's whole gradient; after the first micro-batch, added to (accumulation)."""
        return self.backward_buffer(layer, self.grad_views[layer.name], self.micro > 0)

    def reduce_grads(self, layer) -> None:
        self.land_grad(layer)  # the reduction waits for step(): once per step, in either mode

    def owned_grad(self, name: str):
        """The mean over ranks of this rank's slice of the layer's gradient."""
        return self.comm.reduce_scatter_mean(self.grads[name], None)  # in place: lands in [:S]

    def step(self) -> None:
        grads = {name: self.owned_grad(name) for name in self.layout}
        if self.skip_step(grads.values()):  # fp16: an overflow anywhere skips the step
            return
        self.clip_grads(grads.values(), over=self.comm)  # the owned shards of the mean
        self.optimizer.start_step()
        for name, flat in self.layout.items():
            owned_params = flat.owned_shard(self.params[name], self.comm.rank)
            self.update(owned_params, grads[name], self.opt_state[name])
            self.comm.allgather(None, self.params[name])  # in place: each slice from its owner
