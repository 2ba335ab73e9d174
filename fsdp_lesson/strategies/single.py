"""single: every parameter, gradient and optimizer state on one rank: the reference."""

from __future__ import annotations

from ..model import Params
from .base import Strategy


class Single(Strategy):
    """Each layer: one flat parameter vector, one flat gradient vector, full optimizer state."""

    name = "single"

    def __init__(self, model, params, optimizer, comm, ledger) -> None:
        super().__init__(model, params, optimizer, comm, ledger, world_size=1)
        self.params, self.grads, self.opt_state = {}, {}, {}
        self.param_views, self.grad_views = {}, {}
        for name, flat in self.layout.items():
            self.params[name] = ledger.alloc("params", flat.numel, f"{name}.params")
            self.grads[name] = ledger.alloc("grads", flat.numel, f"{name}.grads")
            self.opt_state[name] = optimizer.init_state(flat.numel, ledger, name)
            flat.flatten(params[name], out=self.params[name])
            self.param_views[name] = flat.views(self.params[name])
            self.grad_views[name] = flat.views(self.grads[name])

    def materialize(self, layer) -> Params:
        return self.param_views[layer.name]

    def grad_buffer(self, layer) -> Params:
        return self.grad_views[layer.name]

    def step(self) -> None:
        for name in self.layout:
            self.optimizer.update(self.params[name], self.grads[name], self.opt_state[name])

    def full_params(self) -> dict[str, Params]:
        return {
            name: {k: v.copy() for k, v in views.items()}
            for name, views in self.param_views.items()
        }
