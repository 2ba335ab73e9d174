"""The strategy interface: the hooks the one training loop calls, and the state it owns.

    begin_phase(phase)          the loop starts a pass: "forward", "backward", "update"
    materialize(layer) -> p     the layer's full parameters, ready for forward or backward
    release(layer)              done with them (zero3 frees its gathered copy)
    grad_buffer(layer) -> g     where backward writes the layer's full gradient
    reduce_grads(layer)         average that gradient over ranks, into where the strategy keeps it
    step()                      update the parameters this rank owns

In PyTorch FSDP2 these are unshard, reshard, (the gradient's allocation), post_backward's
reduce-scatter and optimizer.step on the sharded parameters; DeepSpeed's stage 3 calls them
fetch, release, and reduce-scatter in its backward hooks.

Every strategy keeps each layer's parameters in the flat layout of FlatParam, allocates through
the memory ledger, reads from the sharding table (sharding.py) what it keeps whole and what as
a shard, and talks to other ranks only through Comm. It is given the mesh (mesh.py) and runs
over its dp ranks; every array of its state has a placement along each mesh dimension
(state_regions), from which clipping's norm and the replicas' check are computed generically.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..comm import Comm
from ..flat import FlatParam
from ..memory import MemoryLedger
from ..mesh import Mesh
from ..model import MLP, Params
from ..optim import clip_coefficient
from ..placement import OnStage, Placement, Region, Replicate, Shard, global_squares
from ..precision import Precision
from ..rng import Rng
from ..sharding import SHARD_LEVEL, is_sharded
from ..watchdog import in_phase


def drawn_bytes(layer, whole: Params, piece: Params) -> int:
    """A layer's initial values, and the piece a split layer (tensor.py) copies from them."""
    copied = sum(a.nbytes for a in piece.values()) if layer.split else 0
    return sum(a.nbytes for a in whole.values()) + copied


def placements(strategy: Strategy, sharded: bool, tp: Placement) -> dict[str, Placement]:
    """An array's placement along every dimension of the strategy's state mesh: a stage holds
    its own layers (pp), the sharding table says dp's, the layer tp's; a dimension that splits
    the data but not the state (HSDP's replicas) replicates it. Context parallelism's ranks are
    dp's too (dp_cp: mesh.state_mesh)."""
    stage = OnStage(strategy.state_mesh.coords["pp"])
    along = {"pp": stage, "tp": tp, "dp": Shard(0) if sharded else Replicate()}
    along["dp_shard"] = along["dp_cp"] = along["dp"]
    return {dim: along.get(dim, Replicate()) for dim in strategy.state_mesh.dims}


def kept_numel(shard_level: int, flat: FlatParam, category: str) -> int:
    """How many elements of a layer's `category` a rank keeps at ZeRO stage `shard_level` (the
    sharding table): a shard, 1/N of the padded vector; a whole vector, padded from zero1 on
    (cut into N)."""
    if is_sharded(shard_level, category):
        return flat.shard_size
    return flat.padded_numel if shard_level > 0 else flat.numel


def owner(key: str, entry: str) -> tuple[str, str]:
    """(layer, parameter) of a key in a layout entry: "W" in entry "fc1" is fc1's; an entry
    that holds several layers (a zero3 unit) keys them "fc1.W"."""
    layer, _, param = key.rpartition(".")
    return layer or entry, param


def where_held(layout: dict[str, FlatParam], layer: str) -> tuple[str | None, dict[str, str]]:
    """The layout entry that holds a layer's parameters, and each parameter's key in it; None
    for a layer without parameters (relu), whose state is empty wherever it is."""
    for entry, flat in layout.items():
        keys = {}
        for key in flat.shapes:
            held_by, param = owner(key, entry)
            if held_by == layer:
                keys[param] = key
        if keys:
            return entry, keys
    return None, {}


def state_regions(strategy: Strategy, name: str, array: np.ndarray, sharded: bool) -> list[Region]:
    """Where a layout entry's local array (its whole vector, or this rank's shard) lies in the
    entry's flat vector, parameter by parameter, with each one's placements (padding lies in
    no region). Computed once per entry and kind of array: clipping asks every step."""
    known = strategy.regions.get((name, array.size, sharded))
    if known is not None:
        return known
    layers = {layer.name: layer for layer in strategy.model.layers}
    start, regions = strategy.shard_comm.rank * array.size if sharded else 0, []
    for key, first, end, _ in strategy.layout[name].spans:
        layer, param = owner(key, name)
        lo, hi = max(start, first), min(start + array.size, end)
        if lo < hi:
            along = placements(strategy, sharded, layers[layer].placement(param))
            regions.append(Region(lo - start, hi - start, along, f"{layer}.{param}"))
    strategy.regions[(name, array.size, sharded)] = regions
    return regions


def placement_table(strategy: Strategy) -> list[tuple[str, str, int]]:
    """Where this rank's state lies, one row per parameter of each state array: (what, its
    placement along every mesh dimension in DTensor's words, the bytes this rank holds), e.g.
    ("fc1.W params", "pp stage 0, dp Shard(0), tp Shard(1)", 16384). For notebooks' tables."""
    rows = []
    for key, entry in strategy.local_state().items():
        what = key.rsplit(".", 1)[1]
        for region in state_regions(strategy, entry.layer, entry.array, entry.sharded):
            where = ", ".join(f"{dim} {p}" for dim, p in region.placements.items())
            size = (region.stop - region.start) * entry.array.itemsize
            rows.append((f"{region.name} {what}", where, size))
    return rows


@dataclass(frozen=True)
class StateArray:
    """One array of a strategy's state, and how it lies in the layer's flat vector."""

    array: np.ndarray
    layer: str
    sharded: bool  # True: this rank's shard [r*S, (r+1)*S); False: the whole vector

    def set_from_arrays(self, flat: FlatParam, rank: int, arrays: Params) -> None:
        """Copy the layer's shaped arrays (keyed as in `flat`) in: all, or only `rank`'s shard."""
        if self.sharded:
            flat.copy_shard(arrays, rank, out=self.array)
        else:
            flat.flatten(arrays, out=self.array)

    def set_from_vector(self, flat: FlatParam, rank: int, vector: np.ndarray) -> None:
        """Copy the layer's whole vector in: all of it, or only `rank`'s shard."""
        if self.sharded:
            self.array[...] = flat.owned_shard(flat.padded(vector), rank)
        else:
            self.array[: flat.numel] = vector[: flat.numel]  # the padding stays zero


class Strategy:
    """Common state: the model, the optimizer, the Comm, the ledger, and each layer's FlatParam."""

    name = "base"
    shard_level = 0  # the strategy's row of the sharding table (ZeRO's stage), from its name
    # its own TrainConfig fields (zero3: FSDP's), and those a resume may change (bytes, not numbers)
    options: tuple[str, ...] = ()
    options_a_resume_may_change: frozenset[str] = frozenset()

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        cls.shard_level = SHARD_LEVEL.get(cls.name, cls.shard_level)  # a variant: its parent's

    def __init__(
        self,
        model: MLP,
        optimizer,
        comm: Comm | Mesh,
        ledger: MemoryLedger,
        precision: str = "fp32",
        accum: int = 1,
        accum_reduce: str = "every",
        clip_grad_norm: float | None = None,
    ) -> None:
        # the run's mesh (a Comm alone: a mesh of data-parallel ranks); the strategy runs over
        # the ranks that split the batch: dp, and cp's with it (mesh.state_mesh)
        self.mesh = comm if isinstance(comm, Mesh) else Mesh.alone(comm)
        self.state_mesh = self.mesh.state_mesh()  # where the state is placed (HSDP: dp cut in two)
        self.model, self.optimizer, self.ledger = model, optimizer, ledger
        self.comm = self.state_mesh.data()
        self.shard_comm = self.comm  # the ranks a sharded array is split over (HSDP: a group)
        self.regions: dict[tuple, list[Region]] = {}  # state_regions' answers
        n = self.comm.size
        self.layout = {layer.name: FlatParam(layer.shapes, n) for layer in model.layers}
        # mixed precision (precision.py): 16-bit params and grads, an fp32 master in the state
        self.precision = Precision(precision, ledger)
        self.dtype, self.mixed = self.precision.dtype, self.precision.mixed
        # gradient accumulation: micro-batch `micro` of `accum`; "last" reduces only at the last
        self.accum, self.accum_reduce, self.micro = accum, accum_reduce, 0
        self.clip_grad_norm, self.clip_factor = clip_grad_norm, 1.0  # the factor: clip_grads'

    # --- allocation, as the sharding table says -------------------------------------------

    def alloc_per_layer(self, category: str, label: str) -> dict[str, np.ndarray]:
        """One zeroed flat array per layer, in the run's precision, sized by the table."""
        arrays = {}
        for name, flat in self.layout.items():
            numel = kept_numel(self.shard_level, flat, category)
            arrays[name] = self.ledger.alloc(category, numel, f"{name}.{label}", self.dtype)
        return arrays

    def init_optimizer_state(self) -> dict[str, dict[str, np.ndarray]]:
        """The optimizer's arrays per layer (Adam's m, v; mixed: the fp32 master), by the table."""
        state = {}
        for name, flat in self.layout.items():
            numel, state[name] = kept_numel(self.shard_level, flat, "optimizer"), {}
            if self.mixed:
                state[name]["master"] = self.ledger.alloc("optimizer", numel, f"{name}.master")
            state[name] |= self.optimizer.init_state(numel, self.ledger, name)
        return state

    # --- the state a checkpoint saves and loads -------------------------------------------

    def param_arrays(self) -> dict[str, np.ndarray]:
        """This rank's parameters per layer: whole vectors or shards (see local_state)."""
        raise NotImplementedError

    def local_state(self) -> dict[str, StateArray]:
        """Everything that defines the model and the optimizer on this rank, by "layer.what" (not
        gradients, nor optimizer.t); mixed precision: the params are the fp32 master."""
        state, optimizer_sharded = {}, is_sharded(self.shard_level, "optimizer")
        for name in self.param_arrays():
            state[f"{name}.params"] = self.params_entry(name)
            for key, array in self.opt_state[name].items():
                if key != "master":  # mixed: the master is the params
                    state[f"{name}.{key}"] = StateArray(array, name, optimizer_sharded)
        return state

    def load_state(self, vectors: dict[str, np.ndarray], optimizer_steps: int = 0) -> None:
        """Set the whole state from each entry's whole (unpadded) vector, e.g. a checkpoint's."""
        rank = self.shard_comm.rank
        for key, entry in self.local_state().items():
            flat = self.layout[entry.layer]
            entry.set_from_vector(flat, rank, vectors[key])
            if self.mixed and key.endswith(".params"):  # the 16-bit copy, from the master
                self.sixteen_bit(entry.layer).set_from_vector(flat, rank, vectors[key])
        self.optimizer.t = optimizer_steps

    def params_entry(self, layer: str) -> StateArray:
        """local_state()[f"{layer}.params"] alone, without building every layer's entries
        (init_params asks once per layer): the fp32 master under mixed precision."""
        if self.mixed:
            master = self.opt_state[layer]["master"]
            return StateArray(master, layer, is_sharded(self.shard_level, "optimizer"))
        return self.sixteen_bit(layer)

    def sixteen_bit(self, layer: str) -> StateArray:
        """This rank's parameters of a layer as it computes with them (whole or shard): 16-bit
        under mixed precision."""
        return StateArray(self.param_arrays()[layer], layer, is_sharded(self.shard_level, "params"))

    def init_params(self, rng: Rng) -> None:
        """Initialise the parameters one layer at a time, keeping only what this rank holds.
        Every rank draws every whole layer (the same random stream at any N), one at a time,
        counted as a buffer with the piece a split layer cuts from it: no rank builds the whole
        model (FSDP1's `param_init_fn`, DeepSpeed's `zero.Init`; FSDP2: after `to_empty`)."""
        for layer, whole in self.model.init_layers(rng):
            label, piece = f"init {layer.name}", layer.piece(whole)  # tensor.py: a copy
            self.ledger.hold("buffers", label, drawn_bytes(layer, whole, piece))
            self.keep_initial(layer.name, piece)
            self.ledger.free(label)
            del whole, piece  # before the next layer is drawn: one layer at a time

    def load_params(self, params: dict[str, Params]) -> None:
        """Set the parameters from every whole layer's shaped arrays (a model built by hand)."""
        for layer in self.model.layers:
            self.keep_initial(layer.name, layer.piece(params[layer.name]))

    def keep_initial(self, layer: str, arrays: Params) -> None:
        """Copy one layer's initial values into this rank's parameters: all, or its shard."""
        name, keys = where_held(self.layout, layer)
        if name is None:
            return
        arrays = {keys[param]: array for param, array in arrays.items()}
        entries = [self.params_entry(name)]
        if self.mixed:  # the master and its 16-bit copy
            entries.append(self.sixteen_bit(name))
        for entry in entries:
            entry.set_from_arrays(self.layout[name], self.shard_comm.rank, arrays)

    # --- the hooks ---------------------------------------------------------------------------

    phase = "forward"  # which pass the hooks below serve; the loop says (begin_phase)

    def begin_phase(self, phase: str) -> None:
        """The loop starts a pass: "forward", "backward", "update" (FSDP2's training state)."""
        self.phase = phase

    def materialize(self, layer) -> Params:
        """FSDP2: unshard. The layer's full parameters as shaped views."""
        raise NotImplementedError

    def release(self, layer) -> None:
        """FSDP2: reshard. Done with the layer's full parameters for now."""
        self.precision.release(layer)

    def grad_buffer(self, layer) -> Params:
        """Where the layer's backward writes its full gradient, as shaped views."""
        raise NotImplementedError

    def reduce_grads(self, layer) -> None:
        """FSDP2: post_backward. Average the layer's gradient over ranks into where it is kept."""

    def step(self) -> None:
        """optimizer.step(): update the parameters this rank owns."""
        raise NotImplementedError

    @in_phase("the final gather")
    def full_params(self, root: int | None = None) -> dict[str, Params]:
        """Every whole layer's parameters as shaped copies on all ranks (a collective, over tp too:
        `layer.whole`), one layer at a time; with `root`, only that rank keeps them (others: {})."""
        out = {}
        self.begin_phase("forward")
        for layer in self.model.layers:
            views = layer.whole(self.materialize(layer))
            if root is None or self.comm.rank == root:
                out[layer.name] = {k: v.copy() for k, v in views.items()}
            self.release(layer)
        return out

    # --- precision and accumulation, shared by every strategy's hooks ------------------------

    def begin_micro_batch(self, micro: int) -> None:
        """The loop starts micro-batch `micro` of `accum` (DDP and FSDP1: `no_sync()` around
        all but the last; FSDP2: `set_requires_gradient_sync(False)`)."""
        self.micro = micro

    @property
    def reducing_now(self) -> bool:
        """Whether this micro-batch's backward reduces gradients ("last": only the last one)."""
        return self.accum_reduce == "every" or self.micro == self.accum - 1

    def clip_grads(self, grads: dict[str, np.ndarray], sharded: bool) -> None:
        """--clip-grad-norm X: this step's factor, from the whole model's norm: this rank's
        gradients (whole, or its shards), each counted once over the mesh (global_squares)."""
        if self.clip_grad_norm is not None:
            scaler = self.precision.scaler  # fp16's gradients are still scaled by it
            scale = 1.0 if scaler is None else scaler.scale
            regions = [(g, state_regions(self, name, g, sharded)) for name, g in grads.items()]
            total = global_squares(regions, self.state_mesh)
            self.clip_factor = clip_coefficient(total, self.clip_grad_norm, scale)

    def update(self, params: np.ndarray, grad: np.ndarray, state: dict) -> None:
        """optimizer.update on what this rank owns, through the precision (fp32 master)."""
        self.precision.update(self.optimizer, params, grad, state, self.clip_factor)
