"""zero2 (ZeRO stage 2, P_os+g): shard the gradients too.

Each layer's full gradient lives only from its backward to its reduce-scatter, in one
transient buffer that every layer reuses; what stays is the owned gradient shard. The
update and the allgather of parameters are zero1's. Traffic: the same 2Ψ.
"""

from __future__ import annotations

from .zero1 import ZeRO1


class ZeRO2(ZeRO1):
    """zero1 with a gradient shard per layer, reduce-scattered during backward."""

    name = "zero2"

    def alloc_grads(self) -> None:
        self.grad_shards = self.alloc_per_layer("grads", "grad_shard")
        largest = max(flat.padded_numel for flat in self.layout.values())
        self.full_grad = self.ledger.alloc("buffers", largest, "transient_full_grad")
        self.grad_views = {
            name: flat.views(self.full_grad[: flat.padded_numel])
            for name, flat in self.layout.items()
        }

    def reduce_grads(self, layer) -> None:
        """Right after the layer's backward: its mean gradient shard; the buffer is free again."""
        flat = self.layout[layer.name]
        full = self.full_grad[: flat.padded_numel]
        full[flat.numel :] = 0  # the reused buffer's padding may hold a larger layer's values
        self.comm.reduce_scatter_mean(full, self.grad_shards[layer.name])

    def owned_grad(self, name: str):
        return self.grad_shards[name]  # already reduced during backward
