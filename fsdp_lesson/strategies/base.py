"""The strategy interface: the hooks the one training loop calls, and the state it owns.

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
a shard, and talks to other ranks only through Comm.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..comm import Comm
from ..flat import FlatParam
from ..memory import MemoryLedger
from ..model import MLP, Params
from ..rng import Rng
from ..sharding import ZERO_STAGE, is_sharded


@dataclass(frozen=True)
class StateArray:
    """One array of a strategy's state, and how it lies in the layer's flat vector."""

    array: np.ndarray
    layer: str
    sharded: bool  # True: this rank's shard [r*S, (r+1)*S); False: the whole vector


class Strategy:
    """Common state: the model, the optimizer, the Comm, the ledger, and each layer's FlatParam."""

    name = "base"
    stage = 0  # the strategy's row of the sharding table, set from its name

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        # a variant under a name of its own (a notebook's) keeps its parent's row
        cls.stage = ZERO_STAGE.get(cls.name, cls.stage)

    def __init__(self, model: MLP, optimizer, comm: Comm, ledger: MemoryLedger) -> None:
        self.model, self.optimizer, self.comm, self.ledger = model, optimizer, comm, ledger
        self.layout = {layer.name: FlatParam(layer.shapes, comm.size) for layer in model.layers}

    # --- allocation, as the sharding table says -------------------------------------------

    def numel(self, flat: FlatParam, category: str) -> int:
        """How many elements of a layer's `category` this rank keeps (the sharding table).

        A shard is 1/N of the padded vector; a whole vector is padded only where a collective
        cuts it into N chunks (from zero1 on), so dp and single hold exactly numel.
        """
        if is_sharded(self.stage, category):
            return flat.shard_size
        return flat.padded_numel if self.stage > 0 else flat.numel

    def alloc_per_layer(self, category: str, label: str) -> dict[str, np.ndarray]:
        """One zeroed flat float32 array per layer, sized by the table, counted by the ledger."""
        return {
            name: self.ledger.alloc(category, self.numel(flat, category), f"{name}.{label}")
            for name, flat in self.layout.items()
        }

    def init_optimizer_state(self) -> dict[str, dict[str, np.ndarray]]:
        """The optimizer's arrays per layer (Adam's m and v), sized by the table."""
        return {
            name: self.optimizer.init_state(self.numel(flat, "optimizer"), self.ledger, name)
            for name, flat in self.layout.items()
        }

    # --- the state a checkpoint saves and loads -------------------------------------------

    def param_arrays(self) -> dict[str, np.ndarray]:
        """This rank's parameters per layer: whole vectors or shards (see local_state)."""
        raise NotImplementedError

    def local_state(self) -> dict[str, StateArray]:
        """Everything that defines the model and the optimizer on this rank, by "layer.what".

        Gradients are not state: the next backward rewrites them. The optimizer's step count
        is one number, kept by the optimizer (optimizer.t).
        """
        state = {}
        for name, params in self.param_arrays().items():
            state[f"{name}.params"] = StateArray(params, name, is_sharded(self.stage, "params"))
            for key, array in self.opt_state[name].items():
                state[f"{name}.{key}"] = StateArray(
                    array, name, is_sharded(self.stage, "optimizer")
                )
        return state

    def load_state(self, vectors: dict[str, np.ndarray], optimizer_steps: int = 0) -> None:
        """Set the whole state from each entry's whole (unpadded) vector, e.g. a checkpoint's."""
        for key, entry in self.local_state().items():
            self.set_from_vector(entry, vectors[key])
        self.optimizer.t = optimizer_steps

    def init_params(self, rng: Rng) -> None:
        """Initialise the parameters one layer at a time, keeping only what this rank holds.

        Every rank draws every layer (so the random stream is the seed's at any N), but only
        one layer's values exist at a time, counted as a buffer: no rank ever builds the whole
        model (FSDP initialises one unit at a time; DeepSpeed has zero.Init).
        """
        for layer, arrays in self.model.init_layers(rng):
            label = f"init {layer.name}"
            self.ledger.hold("buffers", label, sum(a.nbytes for a in arrays.values()))
            self.keep_initial(layer.name, arrays)
            self.ledger.free(label)
            del arrays  # before the next layer is drawn: one layer at a time

    def keep_initial(self, layer: str, arrays: Params) -> None:
        """Copy one layer's initial values into this rank's parameters: all, or its shard."""
        entry, flat = self.local_state()[f"{layer}.params"], self.layout[layer]
        if entry.sharded:
            flat.copy_shard(arrays, self.comm.rank, out=entry.array)
        else:
            flat.flatten(arrays, out=entry.array)

    def set_from_vector(self, entry: StateArray, vector: np.ndarray) -> None:
        """Copy a layer's whole vector into `entry`: all of it, or only this rank's shard."""
        flat = self.layout[entry.layer]
        if entry.sharded:
            entry.array[...] = flat.owned_shard(flat.padded(vector), self.comm.rank)
        else:
            entry.array[: flat.numel] = vector[: flat.numel]  # the padding stays zero

    def replicated(self) -> dict[str, np.ndarray]:
        """Arrays that must be bit-identical on every rank after a step: all that is not sharded."""
        if self.comm.size == 1:
            return {}
        return {key: s.array for key, s in self.local_state().items() if not s.sharded}

    # --- the hooks ---------------------------------------------------------------------------

    def materialize(self, layer) -> Params:
        """FSDP2: unshard. The layer's full parameters as shaped views."""
        raise NotImplementedError

    def release(self, layer) -> None:
        """FSDP2: reshard. Done with the layer's full parameters for now."""

    def grad_buffer(self, layer) -> Params:
        """Where the layer's backward writes its full gradient, as shaped views."""
        raise NotImplementedError

    def reduce_grads(self, layer) -> None:
        """FSDP2: post_backward. Average the layer's gradient over ranks into where it is kept."""

    def step(self) -> None:
        """optimizer.step(): update the parameters this rank owns."""
        raise NotImplementedError

    def full_params(self) -> dict[str, Params]:
        """Every layer's parameters as shaped copies, identical on all ranks (a collective)."""
        out = {}
        for layer in self.model.layers:
            out[layer.name] = {k: v.copy() for k, v in self.materialize(layer).items()}
            self.release(layer)
        return out
