"""single: every parameter, gradient and optimizer state on one rank: the reference."""

from __future__ import annotations

from ..model import Params
from .base import Strategy


class Single(Strategy):
    """Each layer: one flat parameter vector, one flat gradient vector, full optimizer state."""

    name = "single"

    def __init__(self, model, params, optimizer, comm, ledger) -> None:
        super().__init__(model, params, optimizer, comm, ledger, world_size=1)
        self.params = self.alloc_per_layer("params", "numel")
        self.grads = self.alloc_per_layer("grads", "numel")
        self.opt_state = self.init_optimizer_state("numel")
        self.load_full_params(params, into=self.params)
        self.param_views = {name: f.views(self.params[name]) for name, f in self.layout.items()}
        self.grad_views = {name: f.views(self.grads[name]) for name, f in self.layout.items()}

    def materialize(self, layer) -> Params:
        return self.param_views[layer.name]

    def grad_buffer(self, layer) -> Params:
        return self.grad_views[layer.name]

    def step(self) -> None:
        for name in self.layout:
            self.optimizer.update(self.params[name], self.grads[name], self.opt_state[name])

    def full_params(self) -> dict[str, Params]:
        return {n: {k: v.copy() for k, v in views.items()} for n, views in self.param_views.items()}
