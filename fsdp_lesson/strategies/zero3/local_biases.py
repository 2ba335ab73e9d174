"""--c-compat's zero3: the biases of the C FSDP and 3-D programs (docs/seed_semantics.md).

Those programs shard only the weight matrices. Every rank keeps each layer's whole bias and
steps it with the gradient of its own rows, never averaged over the ranks, so from the first
update on the ranks' biases differ: each data-parallel rank trains a slightly different model
(notebook 05's puzzle). zero3 with `c_compat` does the same with these arrays, so that it
prints those programs' numbers; the sharded copy of each bias is still gathered, reduced and
stepped, and nothing reads it.
"""

from __future__ import annotations

import numpy as np

from ...memory import MemoryLedger
from ...model import Params


class LocalBiases:
    """Each layer's whole bias on this rank, its gradient and its optimizer state."""

    def __init__(self, layers: list, ledger: MemoryLedger, optimizer) -> None:
        self.params, self.grads, self.state = {}, {}, {}
        for layer in layers:
            if "b" in layer.shapes:
                name, n = layer.name, layer.shapes["b"][0]
                self.params[name] = ledger.alloc("params", n, f"{name}.local b")
                self.grads[name] = ledger.alloc("grads", n, f"{name}.local b grad")
                self.state[name] = optimizer.init_state(n, ledger, f"{name}.local b")

    def keep_initial(self, layer: str, arrays: Params) -> None:
        if layer in self.params and "b" in arrays:
            self.params[layer][...] = arrays["b"]

    def swap_in(self, layer: str, params: Params) -> Params:
        """The layer's gathered parameters with this rank's own bias in place of the gathered."""
        return params | {"b": self.params[layer]} if layer in self.params else params

    def keep_grad(self, layer: str, grads: Params, add: bool) -> None:
        """This rank's gradient of the bias, before the unit's reduce-scatter averages it."""
        if layer in self.grads:
            if add:  # accumulating micro-batches: their gradients add up
                self.grads[layer] += grads["b"]
            else:
                np.copyto(self.grads[layer], grads["b"])

    def step(self, update) -> None:
        for name, params in self.params.items():
            update(params, self.grads[name], self.state[name])
