"""The strategy interface: the hooks the one training loop calls, and nothing else.

    materialize(layer) -> p     the layer's full parameters, ready for forward or backward
    release(layer)              done with them (zero3 drops its gathered copy)
    grad_buffer(layer) -> g     where backward writes the layer's full gradient
    reduce_grads(layer)         average that gradient over ranks, into where the strategy keeps it
    step()                      update the parameters this rank owns

Every strategy keeps each layer's parameters in the flat layout of FlatParam, allocates
through the memory ledger and talks to other ranks only through Comm.
"""

from __future__ import annotations

import numpy as np

from ..comm import Comm
from ..flat import FlatParam
from ..memory import MemoryLedger
from ..model import MLP, Params


class Strategy:
    """Common state: the model, the optimizer, the Comm, the ledger, and each layer's FlatParam."""

    name = "base"
    # What this stage shards over the ranks (the table of DESIGN.md); the rest is replicated.
    shards_params = shards_grads = shards_optimizer = False

    def __init__(
        self,
        model: MLP,
        params: dict[str, Params],
        optimizer,
        comm: Comm,
        ledger: MemoryLedger,
        world_size: int,
    ) -> None:
        self.model, self.optimizer, self.comm, self.ledger = model, optimizer, comm, ledger
        # world_size 1: one unpadded flat vector per layer; N: padded to a multiple of N
        self.layout = {layer.name: FlatParam(layer.shapes, world_size) for layer in model.layers}

    def alloc_per_layer(self, category: str, size: str, what: str = "") -> dict[str, np.ndarray]:
        """One zeroed flat float32 array per layer, counted by the ledger under `category`.

        size names the FlatParam length: "numel" (unpadded), "padded_numel" or "shard_size".
        """
        return {
            name: self.ledger.alloc(category, getattr(flat, size), f"{name}.{what or category}")
            for name, flat in self.layout.items()
        }

    def init_optimizer_state(self, size: str) -> dict[str, dict]:
        """The optimizer's state per layer for `size` parameters ("numel" or "shard_size")."""
        return {
            name: self.optimizer.init_state(getattr(flat, size), self.ledger, name)
            for name, flat in self.layout.items()
        }

    def load_full_params(self, params: dict[str, Params], into: dict[str, np.ndarray]) -> None:
        """Copy shaped initial parameters into full flat buffers (padding stays zero)."""
        for name, flat in self.layout.items():
            flat.flatten(params[name], out=into[name])

    def materialize(self, layer) -> Params:
        raise NotImplementedError

    def release(self, layer) -> None:
        pass

    def grad_buffer(self, layer) -> Params:
        raise NotImplementedError

    def reduce_grads(self, layer) -> None:
        pass

    def step(self) -> None:
        raise NotImplementedError

    def full_params(self) -> dict[str, Params]:
        """Every layer's parameters as shaped copies, identical on all ranks (a collective)."""
        raise NotImplementedError

    def replicated(self) -> dict[str, np.ndarray]:
        """Arrays that must be bit-identical on every rank after a step (checked after a run)."""
        return {}
