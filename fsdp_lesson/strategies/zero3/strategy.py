"""zero3 (ZeRO stage 3, P_os+g+p, what PyTorch FSDP runs): shard the parameters themselves.

A rank keeps only its shard of every unit's parameters, gradients and optimizer state (a
unit is K consecutive layers, units.py). A unit's full parameters exist only while it runs:
allgathered into a buffer the ledger counts at the gather and frees at the release, forward
and again in backward; after its backward, the unit's full gradient is reduce-scattered into
the owned gradient shard. Traffic: allgather forward + allgather backward + reduce-scatter = 3Ψ.

Options, with their FSDP2 (`fully_shard`) and DeepSpeed names:
    prefetch                 gather the next unit (forward: i+1, backward: i-1) while this one
                             computes, and reduce-scatter a unit's gradient while the one
                             before it computes (FSDP2's implicit prefetch; DeepSpeed's
                             stage3_prefetch_bucket_size). Same numbers, at most two units up.
    reshard_after_forward    False keeps each unit gathered from forward to its backward:
                             2Ψ instead of 3Ψ, all the parameters up at the end of forward
                             (DeepSpeed's cousin: stage3_param_persistence_threshold).
    replicate R              HSDP: N/R ranks shard, R such groups replicate; gradient shards
                             are averaged across groups (FSDP2's 2-D device mesh).
    shard_group              which ranks shard together under HSDP: "consecutive" (FSDP2's
                             mesh of shape (R, N/R): the ranks of one host, where the links are
                             fast, when hosts hold N/R ranks each) or "strided" (ranks R apart:
                             the shard groups span the hosts; the contrast).
    c_compat                 the C FSDP programs' biases: whole on every rank, each stepped with
                             its own rows' gradient, never averaged (local_biases.py).

Gradient accumulation (zero2's docstring has the trade): "every" reduce-scatters each unit's
gradient after every micro-batch and adds it into the owned shard; "last" keeps every unit's
full gradient across the micro-batches and reduce-scatters once (FSDP1's `no_sync()`, FSDP2's
`set_requires_gradient_sync(False)`).
"""

from __future__ import annotations

from ...model import Params
from ..base import Strategy
from .local_biases import LocalBiases
from .schedule import Schedule
from .unit import Unit, make_units


class ZeRO3(Strategy):
    """Shards only; a unit's full parameters and gradient exist only while it runs."""

    name = "zero3"
    options = (
        "layers_per_unit",
        "prefetch",
        "reshard_after_forward",
        "replicate",
        "shard_group",
        "c_compat",
    )
    # a checkpoint holds whole layers: how they are sharded, gathered and replicated may change
    options_a_resume_may_change = frozenset(
        {"prefetch", "reshard_after_forward", "replicate", "shard_group"}
    )
    backward = False  # whether the pass is backward (begin_phase)

    def __init__(
        self,
        model,
        optimizer,
        comm,
        ledger,
        layers_per_unit: int = 1,
        prefetch: bool = True,
        reshard_after_forward: bool = True,
        replicate: int = 1,
        shard_group: str = "consecutive",
        c_compat: bool = False,
        **memory_options,
    ) -> None:
        super().__init__(model, optimizer, comm, ledger, **memory_options)
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.replica_comm = None
        if replicate > 1:  # a shard group and a replica group through every rank
            dp = self.comm
            group = dp.size // replicate
            shard_color, replica_color = dp.rank // group, dp.rank % group
            if shard_group == "strided":  # ranks R apart shard; consecutive ones replicate
                shard_color, replica_color = dp.rank % replicate, dp.rank // replicate
            self.shard_comm = dp.split(shard_color, dp.rank, "shard")
            self.replica_comm = dp.split(replica_color, dp.rank, "replicate")
            self.state_mesh = self.state_mesh.split_dp(self.replica_comm, self.shard_comm)
        self.units = make_units(model.layers, layers_per_unit, self.shard_comm.size)
        self.unit_of = {layer: unit for unit in self.units for layer in unit.layers}
        self.schedule = Schedule(self.units)
        self.layout = {unit.name: unit.flat for unit in self.units}  # state is per unit
        self.param_shards = self.alloc_per_layer("params", "param_shard")
        self.grad_shards = self.alloc_per_layer("grads", "grad_shard")
        self.opt_state = self.init_optimizer_state()
        for unit in self.units:
            shards = self.param_shards[unit.name], self.grad_shards[unit.name]
            unit.own(self.shard_comm, ledger, self.dtype, *shards)
        self.reducing: list[Unit] = []  # units whose gradient reduce-scatter is in flight
        # "last": every unit's full gradient is kept and added to until the last micro-batch
        self.accumulate_full_grads = self.accum_reduce == "last" and self.accum > 1
        self.local_biases = LocalBiases(model.layers, ledger, optimizer) if c_compat else None

    def param_arrays(self):
        return self.param_shards

    def keep_initial(self, layer: str, arrays: Params) -> None:
        super().keep_initial(layer, arrays)
        if self.local_biases is not None:
            self.local_biases.keep_initial(layer, arrays)

    def finish_reduce_scatters(self, keep: int = 0) -> None:
        """Wait for the gradient reduce-scatters in flight, all but the newest `keep`."""
        while len(self.reducing) > keep:
            self.reducing.pop(0).finish_reduce_scatter(self.replica_comm)

    def begin_phase(self, phase: str) -> None:
        """A forward (the next micro-batch's, evaluation's) starts once the reductions are done:
        with one pipeline stage, exactly where train_step's next micro-batch begins."""
        if phase == "forward":
            self.finish_reduce_scatters()
        super().begin_phase(phase)
        self.backward = phase == "backward"  # asked by every hook of the pass

    def begin_micro_batch(self, micro: int) -> None:
        """A micro-batch's reduce-scatters complete before the next micro-batch begins."""
        self.finish_reduce_scatters()
        super().begin_micro_batch(micro)

    # --- the hooks ------------------------------------------------------------------------

    def materialize(self, layer) -> Params:
        """FSDP2: unshard. The unit's full parameters (waiting for its prefetch, if any); with
        prefetch, the allgather of the unit that runs next starts while this one computes."""
        unit = self.unit_of[layer.name]
        if unit.empty:
            return {}  # a ReLU alone: nothing to gather
        if unit.params is None:
            unit.gather()
            if self.prefetch:
                following = self.schedule.following(unit, self.backward)
                if following is not None and following.idle:
                    following.start_gather()
        if unit.computing is None:  # the unit's first layer of this pass
            unit.begin_compute()
        params = unit.params[layer.name]
        if self.local_biases is not None:
            params = self.local_biases.swap_in(layer.name, params)
        return self.precision.compute_params(layer, params)

    def release(self, layer) -> None:
        """FSDP2: reshard. Free the unit's full parameters after its last layer has run."""
        self.precision.release(layer)
        unit = self.unit_of[layer.name]
        if unit.empty or layer.name != (unit.layers[0] if self.backward else unit.layers[-1]):
            return  # a ReLU alone, or the unit's other layers still run
        if unit.computing is not None:  # (unless reduce_grads ended it: recorded once)
            unit.end_compute(self.phase)
        if self.backward or self.reshard_after_forward:
            unit.free_params()

    def grad_buffer(self, layer) -> Params:
        """The layer's part of its unit's full gradient ("last": kept and added to until the
        last micro-batch)."""
        add = self.accumulate_full_grads and self.micro > 0
        return self.precision.grad_target(layer, self.unit_of[layer.name].grads(layer.name), add)

    def reduce_grads(self, layer) -> None:
        """After the unit's backward: reduce-scatter its gradient (with prefetch, it runs during
        the next unit's backward, and the one before it is waited for)."""
        unit = self.unit_of[layer.name]
        if unit.empty:
            return  # a ReLU alone: no gradient
        add = self.micro > 0 and not self.accumulate_full_grads  # to an earlier micro-batch's
        if self.local_biases is not None:
            self.local_biases.keep_grad(layer.name, unit.grads(layer.name), add)
        if layer.name != unit.layers[0] or not self.reducing_now:
            return
        unit.end_compute("backward")  # its compute ends where its reduce-scatter begins
        unit.start_reduce_scatter(add)
        self.reducing.append(unit)
        # without prefetch, the same call waited for at once: MPI sums in the same order
        self.finish_reduce_scatters(keep=1 if self.prefetch else 0)

    def step(self) -> None:
        self.finish_reduce_scatters()
        if self.precision.overflowed(self.mesh.world, self.grad_shards.values()):  # inf: skip
            return
        self.clip_grads(self.grad_shards, sharded=True)  # HSDP: over its group, replicated
        self.optimizer.start_step()
        for name in self.layout:
            shard, grad = self.param_shards[name], self.grad_shards[name]
            self.update(shard, grad, self.opt_state[name])
        if self.local_biases is not None:
            self.local_biases.step(self.update)
