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

Gradient accumulation (zero2's docstring has the trade): "every" reduce-scatters each unit's
gradient after every micro-batch and adds it into the owned shard; "last" keeps every unit's
full gradient across the micro-batches and reduce-scatters once (FSDP1's `no_sync()`, FSDP2's
`set_requires_gradient_sync(False)`).
"""

from __future__ import annotations

import time

import numpy as np

from ..comm import Request
from ..model import Params
from ..units import make_units
from .base import Strategy


class ZeRO3(Strategy):
    """Shards only; a unit's full parameters and gradient exist only while it runs."""

    name = "zero3"
    options = ("layers_per_unit", "prefetch", "reshard_after_forward", "replicate", "shard_group")
    # shard_group places --replicate's groups, and runs with --replicate do not checkpoint
    options_a_resume_may_change = frozenset({"prefetch", "reshard_after_forward", "shard_group"})

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
        **levers,
    ) -> None:
        super().__init__(model, optimizer, comm, ledger, **levers)
        self.prefetch, self.reshard_after_forward = prefetch, reshard_after_forward
        self.shard_comm, self.replica_comm = comm, None
        if replicate > 1:  # a shard group and a replica group through every rank
            group = comm.size // replicate
            shard_color, replica_color = comm.rank // group, comm.rank % group
            if shard_group == "strided":  # ranks R apart shard; consecutive ones replicate
                shard_color, replica_color = comm.rank % replicate, comm.rank // replicate
            self.shard_comm = comm.split(shard_color, comm.rank, "shard")
            self.replica_comm = comm.split(replica_color, comm.rank, "replicate")
        self.units = make_units(model.layers, layers_per_unit, self.shard_comm.size)
        self.unit_of = {layer: u for u, unit in enumerate(self.units) for layer in unit.layers}
        self.nonempty = [u for u, unit in enumerate(self.units) if unit.flat.numel]
        self.layout = {unit.name: unit.flat for unit in self.units}  # state is per unit
        self.param_shards = self.alloc_per_layer("params", "param_shard")
        self.grad_shards = self.alloc_per_layer("grads", "grad_shard")
        self.opt_state = self.init_optimizer_state()
        self.gathered: dict[int, Params] = {}  # unit -> its layers' full parameters (views)
        self.gathering: dict[int, tuple[Request, Params]] = {}  # prefetches in flight
        self.full_grads: dict[int, np.ndarray] = {}  # unit -> its full gradient buffer
        # gradient reduce-scatters in flight: (unit, request, the micro-batch's shard to add)
        self.reducing: list[tuple[int, Request, np.ndarray | None]] = []
        self.keep_full = self.accum_reduce == "last" and self.accum > 1
        self.trace: list | None = None  # (lane, label, start, end) spans, when recording
        self.computing: float | None = None

    def param_arrays(self):
        return self.param_shards

    def keep_initial(self, layer: str, arrays: Params) -> None:
        unit = self.units[self.unit_of[layer]]
        named = {f"{layer}.{k}": v for k, v in arrays.items()}
        unit.flat.copy_shard(named, self.shard_comm.rank, out=self.param_shards[unit.name])
        if self.mixed:  # and the fp32 master, of which param_shards is the 16-bit copy
            master = self.opt_state[unit.name]["master"]
            unit.flat.copy_shard(named, self.shard_comm.rank, out=master)

    def set_from_vector(self, entry, vector: np.ndarray) -> None:
        flat = self.layout[entry.layer]
        entry.array[...] = flat.owned_shard(flat.padded(vector), self.shard_comm.rank)

    def begin_micro_batch(self, micro: int) -> None:
        """A micro-batch's reduce-scatters complete before the next micro-batch begins."""
        while self.reducing:
            self._finish_reduce(*self.reducing.pop(0))
        super().begin_micro_batch(micro)

    # --- gather and free a unit's full parameters ---------------------------------------

    def _gather(self, u: int, blocking: bool) -> None:
        """Allocate unit u's full buffer (counted) and allgather into it, or start to."""
        unit = self.units[u]
        label = f"{unit.name} gathered"  # not zeroed: the allgather fills it
        full = self.ledger.alloc("buffers", unit.flat.padded_numel, label, self.dtype, zeroed=False)
        shard = self.param_shards[unit.name]
        if blocking:
            start = time.perf_counter()
            self.shard_comm.allgather(shard, full)
            self._span("comm", f"allgather {unit.name}", start)
            self.gathered[u] = unit.views(full)
        else:
            self.gathering[u] = (self.shard_comm.iallgather(shard, full), unit.views(full))

    def _arrive(self, u: int) -> None:
        """Unit u's parameters are needed now: wait for its prefetch, or gather it."""
        if u in self.gathering:
            request, views = self.gathering.pop(u)
            request.wait()
            self._span("comm", f"allgather {self.units[u].name}", request.issued)
            self.gathered[u] = views
        elif u not in self.gathered:
            self._gather(u, blocking=True)

    def _next(self, u: int, backward: bool) -> int | None:
        """The unit that runs after u (forward: the next one; backward: the one before)."""
        i = self.nonempty.index(u) + (-1 if backward else 1)
        return self.nonempty[i] if 0 <= i < len(self.nonempty) else None

    # --- the hooks ------------------------------------------------------------------------

    def materialize(self, layer) -> Params:
        """FSDP2: unshard. The unit's full parameters (waiting for its prefetch if any)."""
        u = self.unit_of[layer.name]
        if not self.units[u].flat.numel:
            return {}  # a ReLU alone: nothing to gather
        if u not in self.gathered:
            self._arrive(u)
            following = self._next(u, backward=self.phase == "backward")
            if self.prefetch and following is not None and following not in self.gathered:
                if following not in self.gathering:
                    self._gather(following, blocking=False)  # runs while this unit computes
            self.computing = time.perf_counter()
        return self.upcast(layer, self.gathered[u][layer.name])

    def release(self, layer) -> None:
        """FSDP2: reshard. Free the unit's full parameters after its last layer has run."""
        self.drop_upcast(layer)
        u, unit = self.unit_of[layer.name], self.units[self.unit_of[layer.name]]
        backward = self.phase == "backward"
        if not unit.flat.numel or layer.name != (unit.layers[0] if backward else unit.layers[-1]):
            return  # a ReLU alone, or the unit's other layers still run
        self._span("compute", f"{self.phase} {unit.name}", self.computing)
        if backward or self.reshard_after_forward:
            del self.gathered[u]
            self.ledger.free(f"{unit.name} gathered")

    def grad_buffer(self, layer) -> Params:
        """The unit's full gradient buffer, allocated (counted) at its first layer's backward
        ("last": at the first micro-batch's, kept and added to until the last one)."""
        u = self.unit_of[layer.name]
        unit = self.units[u]
        if u not in self.full_grads:
            label, numel = f"{unit.name} full grad", unit.flat.padded_numel
            full = self.ledger.alloc("buffers", numel, label, self.dtype, zeroed=False)
            full[unit.flat.numel :] = 0  # backward writes all but the padding
            self.full_grads[u] = full
        target = unit.views(self.full_grads[u])[layer.name]
        return self.backward_buffer(layer, target, accumulate=self.keep_full and self.micro > 0)

    def reduce_grads(self, layer) -> None:
        """After the unit's backward: reduce-scatter its gradient (non-blocking with prefetch)."""
        self.land_grad(layer)
        u = self.unit_of[layer.name]
        unit = self.units[u]
        if not unit.flat.numel or layer.name != unit.layers[0] or not self.reducing_now:
            return
        self._span("compute", f"backward {unit.name}", self.computing)  # its compute ends here
        self.computing = None
        full, shard, micro_shard = self.full_grads[u], self.grad_shards[unit.name], None
        if self.micro > 0 and not self.keep_full:  # "every": this micro-batch's, to add
            label = f"{unit.name} micro-batch grad shard"
            shard = micro_shard = self.ledger.alloc("buffers", shard.size, label, self.dtype)
        if self.prefetch:  # runs during the next unit's backward; wait for the one before
            self.reducing.append(
                (u, self.shard_comm.ireduce_scatter_mean(full, shard), micro_shard)
            )
            while len(self.reducing) > 1:
                self._finish_reduce(*self.reducing.pop(0))
        else:  # the same call, waited for at once: MPI sums in the same order either way
            self._finish_reduce(u, self.shard_comm.ireduce_scatter_mean(full, shard), micro_shard)

    def _finish_reduce(self, u: int, request: Request, micro_shard: np.ndarray | None) -> None:
        request.wait()
        self._span("comm", f"reduce_scatter {self.units[u].name}", request.issued)
        self._free_grad(u, micro_shard)

    def _free_grad(self, u: int, micro_shard: np.ndarray | None = None) -> None:
        """The unit's mean gradient shard is in place (a micro-batch's `micro_shard` added to it):
        its full gradient is free again."""
        if micro_shard is not None:
            self.grad_shards[self.units[u].name] += micro_shard
            self.ledger.free(f"{self.units[u].name} micro-batch grad shard")
        del self.full_grads[u]
        self.ledger.free(f"{self.units[u].name} full grad")
        if self.replica_comm is not None:  # HSDP: the mean over the groups as well
            start = time.perf_counter()
            self.replica_comm.allreduce_mean(self.grad_shards[self.units[u].name])
            self._span("comm", f"allreduce {self.units[u].name}", start)

    def step(self) -> None:
        while self.reducing:
            self._finish_reduce(*self.reducing.pop(0))
        if self.skip_step(self.grad_shards.values()):  # fp16: an overflow anywhere skips it
            return
        self.clip_grads(self.grad_shards.values(), over=self.shard_comm)  # HSDP: one group's
        self.optimizer.start_step()
        for name in self.layout:
            shard, grad = self.param_shards[name], self.grad_shards[name]
            self.update(shard, grad, self.opt_state[name])

    def _span(self, lane: str, label: str, start: float | None) -> None:
        """Record a span of this step (compute or communication), when recording."""
        if self.trace is not None and start is not None:
            self.trace.append((lane, label, start, time.perf_counter()))
