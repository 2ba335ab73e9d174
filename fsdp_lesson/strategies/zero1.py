"""zero1 (ZeRO stage 1, P_os): shard the optimizer state; keep full parameters and gradients.

Backward is exactly dp's, without the allreduce. Then, per layer: reduce-scatter-mean the
full gradient (each rank gets the mean of its own slice), update the owned slice of the
parameters with the owned slice of Adam's state, and allgather the updated slices. An
allreduce is a reduce-scatter plus an allgather, so this moves the same 2Ψ as dp.
"""

from __future__ import annotations

from .single import Single


class ZeRO1(Single):
    """Full (padded) params and grads on every rank; optimizer state for the owned shard only.

    Allocation (by the sharding table's row) and the hooks are single's: what differs is
    the step, which reduces the gradients itself."""

    name = "zero1"

    def reduce_grads(self, layer) -> None:
        """Nothing after backward (not single's mean over cp ranks): step reduce-scatters."""

    def owned_grad(self, name: str):
        """The mean over ranks of this rank's slice of the layer's gradient."""
        return self.comm.reduce_scatter_mean(self.grads[name], None, name)  # in place: in [:S]

    def step(self) -> None:
        grads = {name: self.owned_grad(name) for name in self.layout}
        if self.precision.overflowed(self.mesh.world, grads.values()):  # fp16: an inf skips it
            return
        self.clip_grads(grads, sharded=True)  # the owned shards of the mean
        self.optimizer.start_step()
        for name, flat in self.layout.items():
            owned_params = flat.owned_shard(self.params[name], self.comm.rank)
            self.update(owned_params, grads[name], self.opt_state[name])
            self.comm.allgather(None, self.params[name], name)  # in place: slices from their owners
