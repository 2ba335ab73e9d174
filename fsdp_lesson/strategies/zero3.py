"""zero3 (ZeRO stage 3, P_os+g+p, the idea of PyTorch FSDP): shard the parameters themselves.

A rank keeps only its shard of every layer's parameters, gradients and optimizer state.
Before a layer runs (forward, and again in backward) its shards are allgathered into one
preallocated gather buffer, sized for the largest layer's parameters and gradients as in the
seed's flat buffer; after backward the layer's gradient is reduce-scattered into the owned
gradient shard. Traffic: allgather forward + allgather backward + reduce-scatter = 3Ψ.
"""

from __future__ import annotations

from ..model import Params
from .base import Strategy


class ZeRO3(Strategy):
    """Shards only; one layer at a time is gathered into the gather buffer."""

    name = "zero3"

    def __init__(self, model, optimizer, comm, ledger) -> None:
        super().__init__(model, optimizer, comm, ledger)
        self.param_shards = self.alloc_per_layer("params", "param_shard")
        self.grad_shards = self.alloc_per_layer("grads", "grad_shard")
        self.opt_state = self.init_optimizer_state()
        largest = max(flat.padded_numel for flat in self.layout.values())
        gather = ledger.alloc("buffers", 2 * largest, "gather_buffer")  # [params | grads]
        self.gathered_params, self.gathered_grads = gather[:largest], gather[largest:]
        self.gathered: str | None = None  # the one layer materialized now, if any

    def param_arrays(self):
        return self.param_shards

    def materialize(self, layer) -> Params:
        """Allgather the layer's shards into the gather buffer; return views of the full layer."""
        assert self.gathered is None, f"{self.gathered} is still materialized"
        flat = self.layout[layer.name]
        full = self.comm.allgather(
            self.param_shards[layer.name], self.gathered_params[: flat.padded_numel]
        )
        self.gathered = layer.name
        self.ledger.mark(f"gather {layer.name}")
        return flat.views(full)

    def release(self, layer) -> None:
        self.gathered = None  # the buffer is free for the next layer
        self.ledger.mark(f"release {layer.name}")

    def grad_buffer(self, layer) -> Params:
        flat = self.layout[layer.name]
        return flat.views(self.gathered_grads[: flat.padded_numel])

    def reduce_grads(self, layer) -> None:
        flat = self.layout[layer.name]
        full = self.gathered_grads[: flat.padded_numel]
        full[flat.numel :] = 0  # the reused buffer's padding may hold a larger layer's values
        self.comm.reduce_scatter_mean(full, self.grad_shards[layer.name])

    def step(self) -> None:
        self.optimizer.start_step()
        for name in self.layout:
            shard, grad = self.param_shards[name], self.grad_shards[name]
            self.optimizer.update(shard, grad, self.opt_state[name])
