"""zero2 (ZeRO stage 2, P_os+g): shard the gradients too.

Each layer's full gradient lives only from its backward to its reduce-scatter, in one
transient buffer that every layer reuses; what stays is the owned gradient shard. The
update and the allgather of parameters are zero1's. Traffic: the same 2Ψ.

Gradient accumulation over K micro-batches, the trade DeepSpeed and FSDP both face:
    every   reduce-scatter after every micro-batch and add into the owned shard: memory stays
            sharded, the gradient traffic is K times (DeepSpeed's stage 2, FSDP's default)
    last    keep every layer's full gradient across the micro-batches and reduce-scatter once
            after the last: traffic once, memory of a full gradient (FSDP1's `no_sync()`,
            FSDP2's `set_requires_gradient_sync(False)`)
"""

from __future__ import annotations

from .zero1 import ZeRO1


class ZeRO2(ZeRO1):
    """zero1 with a gradient shard per layer, reduce-scattered during backward."""

    name = "zero2"

    def alloc_grads(self) -> None:
        self.grad_shards = self.alloc_per_layer("grads", "grad_shard")
        self.accumulate_full_grads = self.accum_reduce == "last" and self.accum > 1
        self.accumulated: dict[str, object] = {}  # "last": layer -> its full gradient
        self.full_grad = None  # the transient, allocated at the first backward (transient_views)

    def transient_views(self, name: str):
        """Views of the one full-gradient buffer every layer reuses, sized for the largest layer.
        Allocated when first needed, after initialisation's layer is freed: the two never
        coexist, so the buffer peak is the larger of them, not their sum."""
        if self.full_grad is None:
            largest = max(flat.padded_numel for flat in self.layout.values())
            label = "transient_full_grad"
            self.full_grad = self.ledger.alloc("buffers", largest, label, self.dtype)
            self.grad_views = {
                layer: flat.views(self.full_grad[: flat.padded_numel])
                for layer, flat in self.layout.items()
            }
        return self.grad_views[name]

    def grad_buffer(self, layer):
        """The reused transient buffer, or ("last") the layer's full gradient, kept until the
        last micro-batch has added to it."""
        if not self.accumulate_full_grads:
            return self.precision.grad_target(
                layer, self.transient_views(layer.name), accumulate=False
            )
        flat = self.layout[layer.name]
        if layer.name not in self.accumulated:
            label = f"{layer.name} accumulated grad"
            full = self.ledger.alloc("buffers", flat.padded_numel, label, self.dtype)
            self.accumulated[layer.name] = full
        full = self.accumulated[layer.name]
        return self.precision.grad_target(layer, flat.views(full), accumulate=self.micro > 0)

    def reduce_grads(self, layer) -> None:
        """Right after the layer's backward: its mean gradient shard; the buffer is free again."""
        if self.accumulate_full_grads:
            if self.micro == self.accum - 1:
                full = self.accumulated.pop(layer.name)
                self.comm.reduce_scatter_mean(full, self.grad_shards[layer.name], layer.name)
                self.ledger.free(f"{layer.name} accumulated grad")
            return
        flat = self.layout[layer.name]
        full = self.full_grad[: flat.padded_numel]
        full[flat.numel :] = 0  # the reused buffer's padding may hold a larger layer's values
        shard = self.grad_shards[layer.name]
        if self.micro == 0:
            self.comm.reduce_scatter_mean(full, shard, layer.name)
            return
        # "every": this micro-batch's mean gradient shard, added to the owned one
        label = "micro-batch grad shard"
        micro_shard = self.ledger.alloc("buffers", shard.size, label, self.dtype)
        shard += self.comm.reduce_scatter_mean(full, micro_shard, layer.name)
        self.ledger.free("micro-batch grad shard")

    def owned_grad(self, name: str):
        return self.grad_shards[name]  # already reduced during backward
