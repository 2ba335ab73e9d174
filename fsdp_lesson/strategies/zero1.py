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
    shards_params, shards_grads, shards_optimizer = False, False, True

    def __init__(self, model, params, optimizer, comm, ledger) -> None:
        super().__init__(model, params, optimizer, comm, ledger, world_size=comm.size)
        self.params = self.alloc_per_layer("params", "padded_numel")
        self.opt_state = self.init_optimizer_state("shard_size")
        self.load_full_params(params, into=self.params)
        self.param_views = {name: f.views(self.params[name]) for name, f in self.layout.items()}
        self.alloc_grads()

    def alloc_grads(self) -> None:
        """zero1 keeps every layer's full gradient (zero2 changes only this and reduce_grads)."""
        self.grads = self.alloc_per_layer("grads", "padded_numel")
        self.grad_views = {name: f.views(self.grads[name]) for name, f in self.layout.items()}

    def materialize(self, layer) -> Params:
        return self.param_views[layer.name]

    def grad_buffer(self, layer) -> Params:
        return self.grad_views[layer.name]

    def owned_grad(self, name: str):
        """The mean over ranks of this rank's slice of the layer's gradient."""
        return self.comm.reduce_scatter_mean(self.grads[name], None)  # in place: lands in [:S]

    def step(self) -> None:
        for name, flat in self.layout.items():
            owned_params = flat.owned_shard(self.params[name], self.comm.rank)
            self.optimizer.update(owned_params, self.owned_grad(name), self.opt_state[name])
            self.comm.allgather(None, self.params[name])  # in place: each slice from its owner

    def full_params(self) -> dict[str, Params]:
        return {n: {k: v.copy() for k, v in views.items()} for n, views in self.param_views.items()}

    def replicated(self):
        return {f"{name}.params": p for name, p in self.params.items()}
