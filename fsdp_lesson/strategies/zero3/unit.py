"""Units: the groups of consecutive layers that zero3 shards, gathers and frees together.

PyTorch FSDP shards what `fully_shard` wraps (usually one transformer block; FSDP2 calls its
state an FSDPParamGroup); DeepSpeed's stage 3 fetches sub-modules. Here a unit is K
parameterised layers, with the ReLUs between them, laid out as one flat vector (FlatParam over
"layer.param" keys):

    K = 1   emb | fc1 | relu1 | fc2          every layer its own unit (a ReLU's unit is empty)
    K = 2   emb fc1 relu1 | fc2              one allgather and one reduce-scatter per unit
    K >= the number of parameterised layers: the whole model is one unit (root-only wrapping)

Bigger units mean fewer, larger collectives and more memory gathered at once.

A unit does its own work: it keeps this rank's shards, gathers its full parameters into a
buffer the ledger counts and frees it, holds its full gradient from backward to the
reduce-scatter, and records its compute span when the step is traced. Which unit runs (and
prefetches) when is the schedule's business (schedule.py).
"""

from __future__ import annotations

from time import perf_counter

import numpy as np

from ...comm import Comm
from ...flat import FlatParam
from ...memory import MemoryLedger
from ...model import Params
from ...requests import Request


class Unit:
    """A group of consecutive layers, the flat layout of all their parameters, and zero3's
    work on them (after `own`): gather, free, hold the full gradient, reduce-scatter."""

    def __init__(self, name: str, layers: tuple[str, ...], flat: FlatParam) -> None:
        self.name, self.layers, self.flat = name, layers, flat  # layers in forward order
        self.empty = not flat.numel  # a ReLU alone: nothing to gather, reduce or free
        # the ledger's labels of its transients, made once: the hooks ask for them every step
        self.gathered_label, self.grad_label = f"{name} gathered", f"{name} full grad"
        self.micro_label = f"{name} micro-batch grad shard"
        self.layer_spans = layer_spans(layers, flat)  # where views() cuts, worked out once
        # zero3's state of the unit on this rank, set by own() and changed by the step
        self.params: dict[str, Params] | None = None  # each layer's full parameters, gathered
        self.gathering: tuple[Request, dict[str, Params]] | None = None  # a prefetch in flight
        self.full_grad: np.ndarray | None = None  # from its backward to its reduce-scatter
        self.full_grad_views: dict[str, Params] = {}  # each layer's views into full_grad
        self.reducing: tuple[Request, np.ndarray | None] | None = None  # a reduce-scatter
        self.computing: float | None = None  # when its compute began, for the trace

    def own(
        self,
        comm: Comm,
        ledger: MemoryLedger,
        dtype: np.dtype,
        param_shard: np.ndarray,
        grad_shard: np.ndarray,
    ) -> None:
        """Take this rank's shards; gather and reduce-scatter over `comm` from now on."""
        self.comm, self.ledger, self.dtype = comm, ledger, dtype
        self.param_shard, self.grad_shard = param_shard, grad_shard

    def views(self, full: np.ndarray) -> dict[str, Params]:
        """Each layer's parameters as shaped views into the unit's full flat buffer (plain
        loops: zero3 takes them at every gather)."""
        views = {}
        for layer, spans in self.layer_spans:
            views[layer] = params = {}
            for name, where, shape in spans:
                params[name] = full[where].reshape(shape)
        return views

    # --- the full parameters ------------------------------------------------------------

    def _alloc_gathered(self) -> np.ndarray:
        """The full parameter buffer, counted until free_params (the allgather fills it)."""
        numel = self.flat.padded_numel
        return self.ledger.alloc("buffers", numel, self.gathered_label, self.dtype, zeroed=False)

    @property
    def idle(self) -> bool:
        """Neither gathered nor being gathered: prefetch may start its allgather."""
        return self.params is None and self.gathering is None

    def start_gather(self) -> None:
        """Prefetch: allocate the full buffer and start the allgather into it."""
        full = self._alloc_gathered()
        self.gathering = (self.comm.iallgather(self.param_shard, full, self.name), self.views(full))

    def gather(self) -> None:
        """The full parameters are needed now: wait for the prefetch, or gather them."""
        if self.gathering is not None:
            request, self.params = self.gathering
            self.gathering = None
            request.wait()
        else:
            full = self._alloc_gathered()
            self.comm.allgather(self.param_shard, full, self.name)
            self.params = self.views(full)

    def free_params(self) -> None:
        """Free the full parameters: only the shard remains (FSDP2: reshard)."""
        self.params = None
        self.ledger.free(self.gathered_label)

    def begin_compute(self) -> None:
        self.computing = perf_counter()

    def end_compute(self, phase: str) -> None:
        """The unit's forward or backward compute ends: its span, when the step is traced."""
        if self.comm.trace.spans is not None:
            self.comm.trace.record("compute", f"{phase} {self.name}", self.computing)
        self.computing = None

    # --- the full gradient --------------------------------------------------------------

    def grads(self, layer: str) -> Params:
        """The layer's full gradient, in the unit's buffer allocated (counted) at its first
        backward and kept until finish_reduce_scatter."""
        if self.full_grad is None:
            numel = self.flat.padded_numel
            self.full_grad = self.ledger.alloc(
                "buffers", numel, self.grad_label, self.dtype, zeroed=False
            )
            if self.flat.padding:  # backward writes all but the padding
                self.full_grad[self.flat.numel :] = 0
            self.full_grad_views = self.views(self.full_grad)
        return self.full_grad_views[layer]

    def start_reduce_scatter(self, add: bool) -> None:
        """Start reduce-scattering the mean of the full gradient into the owned shard; with
        `add`, into a counted micro-batch shard that finish_reduce_scatter adds to it."""
        shard, added = self.grad_shard, None
        if add:
            shard = added = self.ledger.alloc("buffers", shard.size, self.micro_label, self.dtype)
        self.reducing = (self.comm.ireduce_scatter_mean(self.full_grad, shard, self.name), added)

    def finish_reduce_scatter(self, replicas: Comm | None) -> None:
        """The mean gradient shard is in place; the full gradient is free again. HSDP: the
        shard is averaged over the replica groups too (`replicas`)."""
        request, added = self.reducing
        self.reducing = None
        request.wait()
        if added is not None:
            self.grad_shard += added
            self.ledger.free(self.micro_label)
        self.full_grad, self.full_grad_views = None, {}  # no view keeps the buffer alive
        self.ledger.free(self.grad_label)
        if replicas is not None:
            replicas.allreduce_mean(self.grad_shard, self.name)


# each layer of a unit, and each of its parameters' (name, slice, shape) in the flat vector
LayerSpans = tuple[tuple[str, tuple[tuple[str, slice, tuple[int, ...]], ...]], ...]


def layer_spans(layers: tuple[str, ...], flat: FlatParam) -> LayerSpans:
    """Each layer and its parameters' (name, slice, shape) in the unit's flat vector (none for
    a ReLU)."""
    spans: dict[str, list] = {layer: [] for layer in layers}
    for key, start, stop, shape in flat.spans:
        layer, name = key.rsplit(".", 1)
        spans[layer].append((name, slice(start, stop), shape))
    return tuple((layer, tuple(s)) for layer, s in spans.items())


def make_units(layers: list, layers_per_unit: int, world_size: int) -> list[Unit]:
    """Group the model's layers into units of `layers_per_unit` parameterised layers."""
    if layers_per_unit == 1:  # every layer its own unit, as the strategies' per-layer layout
        groups = [[layer] for layer in layers]
    else:  # a parameterless layer joins the unit before it
        groups = []
        for layer in layers:
            if not groups or layer.shapes and _parameterised(groups[-1]) == layers_per_unit:
                groups.append([])
            groups[-1].append(layer)
    units = []
    for group in groups:
        name = group[0].name if len(group) == 1 else f"{group[0].name}..{group[-1].name}"
        shapes = {f"{g.name}.{k}": shape for g in group for k, shape in g.shapes.items()}
        units.append(Unit(name, tuple(g.name for g in group), FlatParam(shapes, world_size)))
    return units


def _parameterised(group: list) -> int:
    return sum(1 for layer in group if layer.shapes)
