"""A dry run: a strategy's own code runs initialisation and one training step on placeholders.

The planner (plan.ledger_bytes) predicts what MemoryLedger will measure by running the very
lines that allocate: the real strategy and the real loop (a pipeline stage's pipeline_step; with
one stage, train_step's work), with

    placeholders   arrays of the asked shape that hold one element (memory.placeholder)
    DryComm        N ranks seen from one of them; every collective and message returns at once
    DryModel       the model's layers with forward and backward that compute nothing
    DryOptimizer   the optimizer's state allocated as usual, its update skipped

so the ledger counts every hold and free in their real order, and no schedule (zero3's
prefetch, zero2's transient, the memory options' scratch buffers, a pipeline's micro-batches in
flight) is written a second time.
The same dry step, with an EventLog, lists what a strategy computes and which collectives it
runs, in order (step_events: the picture of notebooks 03 to 05).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from .comm import Comm
from .config import ModelConfig
from .memory import MemoryLedger, placeholder
from .model import Embedding, Model, Params
from .models import build_model
from .optim import make_optimizer
from .pipeline import Stage, pipeline_step
from .requests import Request
from .rng import Rng
from .strategies import make_strategy

# train_step's micro-batches between the first and the last repeat one another exactly: three
# stand for any number (a step of --accum 10^9 is predicted at once, not run 10^9 times).
MICRO_BATCHES_THAT_DIFFER = 3


COMPUTE = "compute"  # an EventLog's kind for a layer's forward or backward, or an update


class EventLog(list):
    """(phase, kind, label) of one dry step, in order: phase is the pass the loop says the
    strategy is in (forward, backward, update); kind COMPUTE or a collective that moves bytes."""

    def __init__(self) -> None:
        super().__init__()
        self.strategy = None  # set when the step begins

    def add(self, kind: str, label: str) -> None:
        self.append((self.strategy.phase, kind, label))

    def collective(self, kind: str, buf: np.ndarray, tag: str) -> None:
        if buf.size:  # Comm moves nothing for a layer without parameters
            self.add(kind, f"{'params' if kind == 'allgather' else 'grad'} {tag}")

    def update(self, params: np.ndarray, state: dict) -> None:
        """The optimizer updates a layer (or unit): all of it, or this rank's shard."""
        if params.size:
            strategy = self.strategy
            name = next(name for name, s in strategy.opt_state.items() if s is state)
            self.add(COMPUTE, f"{'shard' if strategy.shard_level else 'all of'} {name}")


class DryComm(Comm):
    """N ranks as `rank` (0 by default) sees them, moving no data. `groups` sizes the
    communicators that split() makes, by name (zero3's HSDP: "shard" and "replicate"); `log`
    lists the collectives."""

    def __init__(
        self,
        size: int,
        groups: dict[str, int] | None = None,
        log: EventLog | None = None,
        rank: int = 0,
    ) -> None:
        super().__init__()
        self.size, self.rank, self.groups, self.log = size, rank, groups or {}, log

    def _called(self, kind: str, buf: np.ndarray, tag: str) -> Request:
        if self.log is not None:
            self.log.collective(kind, buf, tag)
        return Request.done(self, lambda: None)

    def allreduce_mean(self, buf: np.ndarray, tag: str = "") -> np.ndarray:
        self._called("allreduce", buf, tag)
        return buf

    def allreduce_sum(self, buf: np.ndarray, tag: str = "") -> np.ndarray:
        self._called("allreduce", buf, tag)
        return buf

    def allgather(self, shard: np.ndarray | None, full: np.ndarray, tag: str = "") -> np.ndarray:
        self._called("allgather", full, tag)
        return full

    def reduce_scatter_mean(
        self, full: np.ndarray, shard: np.ndarray | None, tag: str = ""
    ) -> np.ndarray:
        self._called("reduce_scatter", full, tag)
        return full[: full.size // self.size] if shard is None else shard

    def reduce_scatter_sum(
        self, full: np.ndarray, shard: np.ndarray | None, tag: str = ""
    ) -> np.ndarray:
        return self.reduce_scatter_mean(full, shard, tag)

    def bcast(self, buf: np.ndarray, root: int = 0) -> np.ndarray:
        return buf

    def iallreduce_mean(self, buf: np.ndarray, tag: str = "") -> Request:
        return self._called("allreduce", buf, tag)

    def iallgather(self, shard: np.ndarray, full: np.ndarray, tag: str = "") -> Request:
        return self._called("allgather", full, tag)

    def ireduce_scatter_mean(self, full: np.ndarray, shard: np.ndarray, tag: str = "") -> Request:
        return self._called("reduce_scatter", full, tag)

    def send(self, buf: np.ndarray, to: int, tag: str = "") -> Request:
        """A pipeline's message (not a collective: the EventLog does not list it), done at once."""
        return Request.done(self, lambda: None)

    def recv(self, buf: np.ndarray, source: int, tag: str = "") -> np.ndarray:
        return buf

    def split(self, color: int, key: int, name: str) -> DryComm:
        return DryComm(self.groups[name], log=self.log)


class DryLayer:
    """A layer's name and shapes, with a forward and backward that hand on placeholders of
    the shapes the real ones return, and keep a cache of the real one's bytes (the layer's
    input, or for a layer that keeps more, its `cache_bytes`). A split layer (tensor.py) cuts
    a piece of its shapes from the whole, as the real one does."""

    def __init__(self, layer, seq_len: int, log: EventLog | None) -> None:
        self.name, self.shapes, self.log = layer.name, layer.shapes, log
        self.whole_shapes, self.split = layer.whole_shapes, layer.split
        self.layer, self.seq_len, self.cache_is_input = layer, seq_len, layer.cache_is_input
        self.out_width = layer.out_width
        self.embeds = isinstance(layer, Embedding)
        self.in_width = 0  # the input's features, for backward's gradient (tokens: 0)

    def piece(self, whole: Params) -> Params:
        if not self.split:
            return whole
        return {name: placeholder(shape) for name, shape in self.shapes.items()}

    def forward(self, p: Params, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.log is not None and self.shapes:
            self.log.add(COMPUTE, self.name)
        self.in_width = 0 if self.embeds else x.shape[1]
        out = placeholder((len(x), self.layer.out_width(self.in_width, self.seq_len)))
        if self.cache_is_input:
            return out, x
        return out, placeholder(self.layer.cache_bytes(len(x)), np.uint8)

    def backward(self, p: Params, x: np.ndarray, dout: np.ndarray, g: Params) -> np.ndarray | None:
        if self.log is not None and self.shapes:
            self.log.add(COMPUTE, self.name)
        return None if self.embeds else placeholder((len(dout), self.in_width))


class DryLoss:
    """The loss's cache is its probabilities, and backward returns them as dlogits."""

    def forward(self, logits: np.ndarray, targets: np.ndarray) -> tuple[float, np.ndarray]:
        return 0.0, placeholder(logits.shape)

    def backward(self, cache: np.ndarray, rows: int | None = None) -> np.ndarray:
        return cache


class DryModel:
    """What the loop and the strategies read of a model, with layers that compute nothing."""

    def __init__(self, model: Model, log: EventLog | None = None) -> None:
        dry = {layer.name: DryLayer(layer, model.config.seq_len, log) for layer in model.layers}
        self.config, self.block_inputs = model.config, model.block_inputs
        self.targets = model.targets
        self.layers = [dry[layer.name] for layer in model.layers]
        self.blocks = [[dry[layer.name] for layer in block] for block in model.blocks]
        self.loss = DryLoss()

    def init_layers(
        self, rng: Rng | None = None, dtype=np.float32
    ) -> Iterator[tuple[DryLayer, Params]]:
        """Each whole layer's initial parameters, as placeholders: one at a time, as MLP's."""
        for layer in self.layers:
            shapes = layer.whole_shapes.items()
            yield layer, {name: placeholder(shape, dtype) for name, shape in shapes}


class DryOptimizer:
    """The optimizer's state allocated through the ledger as usual; its update skipped."""

    def __init__(self, name: str, log: EventLog | None = None) -> None:
        self.optimizer, self.log = make_optimizer(name, lr=0.1), log
        self.init_state = self.optimizer.init_state
        self.start_step = self.optimizer.start_step

    def update(self, p: np.ndarray, g: np.ndarray, state: dict) -> None:
        if self.log is not None:
            self.log.update(p, state)


def micro_batches_to_run(M: int, pp: int, stage: int, schedule: str) -> int:
    """How many of a step's M micro-batches the dry run takes to meet every peak of the step."""
    if pp == 1:  # train_step holds one micro-batch at a time: the first, a middle one, the last
        return min(M, MICRO_BATCHES_THAT_DIFFER)
    if schedule == "1f1b":  # after the warm-up's P - stage - 1 forwards, each forward and
        # backward in turn holds P - stage micro-batches: that steady state repeats as
        # train_step's micro-batches do, and its first, a middle and the last one stand for all
        return min(M, pp - stage - 1 + MICRO_BATCHES_THAT_DIFFER)
    return M  # gpipe: every forward before any backward, all M micro-batches held at once


def dry_run(
    strategy: str,
    model_config: ModelConfig,
    n: int,
    optimizer: str,
    micro_batch: int,
    *,
    accum: int = 1,
    recompute: bool = False,
    log: EventLog | None = None,
    tp: int = 1,
    pp: int = 1,
    stage: int = 0,
    micro_batches: int = 1,
    schedule: str = "gpipe",
    sequence_parallel: bool = False,
    cp: int = 1,
    cp_layout: str = "zigzag",
    **options,
) -> MemoryLedger:
    """Rank 0's ledger after `strategy` (with its own and the memory options) initialised the
    model and took one step of `accum` micro-batches of `micro_batch` rows, on N ranks; the
    step's events in `log`, if given. With tp = T, the model is tensor-parallel over T more
    ranks (tensor.py) and `strategy` runs over the N data-parallel ones: every rank's pieces
    have the same shapes (padded), so rank 0's ledger is every rank's. With pp = P, the model
    is pipeline rank `stage`'s Stage and the step pipeline_step's: each of the `accum`
    micro-batches split in `micro_batches`, run in `schedule`'s order (pipeline.py). With
    cp = C, each of the N holds S/C positions of its rows, and `strategy` runs over N * C."""
    replicate, n = options.get("replicate", 1), n * cp  # the strategy's ranks: dp and cp's
    comm = DryComm(n, {"shard": n // replicate, "replicate": replicate}, log)
    model = DryModel(
        build_model(model_config, DryComm(tp), False, sequence_parallel, DryComm(cp), cp_layout),
        log,
    )
    model = Stage(model, pp, stage, DryComm(pp, rank=stage))
    M = micro_batches_to_run(accum * micro_batches, pp, stage, schedule)
    ledger = MemoryLedger(dry=True)
    built = make_strategy(
        strategy, model, DryOptimizer(optimizer, log), comm, ledger, accum=M, **options
    )
    built.init_params(rng=None)
    rows = micro_batch // micro_batches * M
    X = placeholder((rows, model_config.seq_len), np.uint8)
    Y = model.targets(X, placeholder((rows,), np.uint8))
    if log is not None:  # the step's events from here on
        log.strategy = built
    pipeline_step(model, built, model.pp, X, Y, M, schedule, recompute=recompute)
    return ledger


def step_events(strategy: str, model_config: ModelConfig | None = None, n: int = 2, **options):
    """(phase, kind, label) of one training step of `strategy` on N ranks, in order: each
    layer's compute and update, and each collective that moves bytes, as the strategy's own
    code runs them (dry); then the loop's one allreduce of the loss (train_loop's log)."""
    log = EventLog()
    dry_run(strategy, model_config or ModelConfig(), n, "sgd", 1, log=log, **options)
    return [*log, ("log", "allreduce", "loss (8 B)")]
