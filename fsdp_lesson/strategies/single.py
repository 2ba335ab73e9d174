"""single: every parameter, gradient and optimizer state on one rank: the reference."""

from __future__ import annotations

from ..model import Params
from .base import Strategy


class Single(Strategy):
    """Each layer: one flat parameter vector, one flat gradient vector, full optimizer state."""

    name = "single"

    def __init__(self, model, optimizer, comm, ledger) -> None:
        super().__init__(model, optimizer, comm, ledger)
        self.params = self.alloc_per_layer("params", "params")
        self.grads = self.alloc_per_layer("grads", "grads")
        self.opt_state = self.init_optimizer_state()
        self.param_views = {name: f.views(self.params[name]) for name, f in self.layout.items()}
        self.grad_views = {name: f.views(self.grads[name]) for name, f in self.layout.items()}

    def param_arrays(self):
        return self.params

    def materialize(self, layer) -> Params:
        return self.param_views[layer.name]

    def grad_buffer(self, layer) -> Params:
        return self.grad_views[layer.name]

    def step(self) -> None:
        self.optimizer.start_step()
        for name in self.layout:
            self.optimizer.update(self.params[name], self.grads[name], self.opt_state[name])
