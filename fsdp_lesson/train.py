"""The one training loop, evaluation and sampling; every strategy runs through these functions.

Only the strategy's hooks differ between single, dp and the ZeRO stages: the loop below is
the same for all of them (DESIGN.md, "the one idea the code is built around").
"""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from .checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from .comm import Comm
from .config import ConfigError, ModelConfig, TrainConfig
from .data import Dataset, GlobalBatchSampler, decode, rank_slice
from .memory import MemoryLedger
from .model import MLP, softmax
from .optim import make_optimizer
from .rng import Rng, make_rng
from .strategies import Strategy, make_strategy


def forward(model: MLP, strategy: Strategy, x: np.ndarray, keep: bool = False):
    """Run every layer on x; return the logits and, when keep, the caches backward needs."""
    caches = []
    for layer in model.layers:
        p = strategy.materialize(layer)
        x, cache = layer.forward(p, x)
        strategy.release(layer)
        if keep:
            caches.append(cache)
            strategy.ledger.hold("activations", layer.name, cache.nbytes)
        strategy.ledger.mark(f"forward {layer.name}")
    return x, caches


def train_step(model: MLP, strategy: Strategy, X: np.ndarray, Y: np.ndarray) -> float:
    """Forward, loss, backward (mirroring forward), reduce gradients, update. This rank's loss.

    The ledger counts as activations the caches kept for backward and the gradient that
    flows back (dx), so that it accounts for every sizeable array of the step.
    """
    ledger = strategy.ledger
    logits, caches = forward(model, strategy, X, keep=True)
    loss, loss_cache = model.loss.forward(logits, Y)
    dx = model.loss.backward(loss_cache)  # in place in the cache's probs
    del logits, loss_cache  # no stray references: what the ledger frees is really freed
    dx_label = "dlogits"
    ledger.hold("activations", dx_label, dx.nbytes)
    ledger.mark("loss")
    for layer in reversed(model.layers):
        p = strategy.materialize(layer)
        # the cache is popped so that its array is really freed after this layer
        dx = layer.backward(p, caches.pop(), dx, strategy.grad_buffer(layer))
        strategy.reduce_grads(layer)
        strategy.release(layer)
        # the new dx (the gradient of the layer's input) exists while the old one still does
        ledger.hold("activations", f"d_in {layer.name}", 0 if dx is None else dx.nbytes)
        ledger.mark(f"backward {layer.name}")
        ledger.free(dx_label)
        ledger.free(layer.name)  # this layer's cache is no longer needed
        dx_label = f"d_in {layer.name}"
    ledger.free(dx_label)
    strategy.step()
    ledger.mark("step")
    return loss


def evaluate(
    model: MLP, strategy: Strategy, data: Dataset, rng: Rng, batch_size: int, n_batches: int
) -> float:
    """Mean loss over n_batches global batches of the test split (every rank its slice)."""
    comm, sampler = strategy.comm, GlobalBatchSampler(data.X_test, data.Y_test, batch_size, rng)
    total = 0.0
    for _ in range(n_batches):
        X, Y = sampler.next()
        logits, _ = forward(model, strategy, rank_slice(X, comm.rank, comm.size))
        loss, _ = model.loss.forward(logits, rank_slice(Y, comm.rank, comm.size))
        total += comm.mean_scalar(loss)
    return total / max(n_batches, 1)


def sample_name(model: MLP, strategy: Strategy, rng: Rng, max_tokens: int = 64) -> list[int]:
    """Generate one name as the seed does: the tokens drawn, ending with 0 (unless cut off).

    Every rank runs the forward (zero3 needs all ranks to gather) and draws u, keeping the
    random streams aligned; rank 0's choice is broadcast so ranks can never disagree.
    """
    context = np.zeros((1, model.config.seq_len), dtype=np.uint8)
    token = np.zeros(1, dtype=np.int32)
    tokens = []
    for _ in range(max_tokens):
        logits, _ = forward(model, strategy, context)
        probs = softmax(logits)[0]
        u = rng.uniform(1)[0]
        # walk the probabilities with a running float32 sum; the first with sum >= u
        token[0] = min(np.searchsorted(np.cumsum(probs), u), len(probs) - 1)
        strategy.comm.bcast(token, root=0)
        tokens.append(int(token[0]))
        if token[0] == 0:  # the boundary token ends the name
            break
        context = np.roll(context, -1, axis=1)
        context[0, -1] = token[0]
    return tokens


def format_sample(tokens: list[int], seq_len: int) -> str:
    """The seed's line: the final context (left-padded with '.'), '-->', the last token."""
    context = ([0] * seq_len + tokens[:-1])[-seq_len:]
    return " ".join(decode(context)) + "  --> " + decode(tokens[-1:])


@dataclass
class History:
    """What a run produced: losses, validation loss, samples, memory and traffic of this rank.

    The per-step series are numpy arrays allocated before training, so recording a step
    allocates nothing (and tracemalloc sees only what training itself allocates).
    """

    model_config: dict
    train_config: dict
    world_size: int
    losses: np.ndarray  # the global (rank-averaged) loss per step
    local_losses: np.ndarray  # this rank's micro-batch loss per step
    step_seconds: np.ndarray
    val_loss: float | None = None
    samples: list[str] = field(default_factory=list)  # the seed's lines: context --> last token
    names: list[str] = field(default_factory=list)  # the sampled names themselves
    memory: dict = field(default_factory=dict)  # this rank's ledger report
    traffic: dict = field(default_factory=dict)  # this rank's bytes by collective kind
    timeline: list = field(default_factory=list)  # (event, live bytes) over one step, if asked

    @classmethod
    def for_steps(cls, model_config: ModelConfig, train_config: TrainConfig, world_size: int):
        steps = train_config.steps
        return cls(
            asdict(model_config),
            train_config.to_dict(),
            world_size,
            np.zeros(steps),
            np.zeros(steps),
            np.zeros(steps),
        )

    def to_dict(self) -> dict:
        return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in vars(self).items()}


class ReplicaMismatch(RuntimeError):
    """State that every rank should hold identically differs between ranks: a sharding bug."""


def check_replicas(strategy: Strategy) -> None:
    """Raise on every rank if any replicated array is not bit-identical on all ranks.

    The seed's FSDP program let bias gradients stay local, so the ranks' biases drifted
    apart; this check catches that class of bug after every run.
    """
    differ = [
        name for name, a in strategy.replicated().items() if not strategy.comm.same_everywhere(a)
    ]
    if differ:
        raise ReplicaMismatch(f"replicated state differs between ranks: {', '.join(differ)}")


def run(
    model_config: ModelConfig,
    train_config: TrainConfig,
    comm: Comm | None = None,
    data: Dataset | None = None,
    on_log: Callable[[int, float], None] | None = None,
    trace_memory: bool = False,
    timeline_step: int | None = None,
    save_every: int | None = None,
    checkpoint_dir: str | Path | None = None,
    resume: str | Path | None = None,
    reshard: bool = False,
) -> tuple[History, Strategy]:
    """Train, evaluate and sample with the configured strategy on this rank's Comm.

    trace_memory: also measure the peak with tracemalloc (slower), to check the ledger.
    timeline_step: record the ledger's live bytes at every layer boundary of this step.
    save_every, checkpoint_dir: save a sharded checkpoint every so many steps (and at the end).
    resume: continue from a checkpoint; reshard: allow one of another strategy or N.
    """
    comm = comm or Comm()
    train_config.validate(comm.size)  # the same verdict on every rank, before any collective
    model_config.validate()
    if save_every and checkpoint_dir is None:
        raise ConfigError("save_every needs a checkpoint_dir to save into")
    data = data or Dataset.load(seq_len=model_config.seq_len)
    tc = train_config
    rng = make_rng(tc.seed, tc.c_compat)
    model = MLP(model_config)
    params = model.init_params(rng)
    budget = None if tc.memory_budget_mb is None else int(tc.memory_budget_mb * 2**20)
    ledger = MemoryLedger(rank=comm.rank, budget_bytes=budget)
    optimizer = make_optimizer(tc.optimizer, tc.learning_rate)
    history = History.for_steps(model_config, tc, comm.size)
    if trace_memory:
        tracemalloc.start()
    strategy = make_strategy(tc.strategy, model, params, optimizer, comm, ledger)
    del params  # the strategy holds the parameters now, laid out its way
    sampler = GlobalBatchSampler(data.X_train, data.Y_train, tc.batch_size, rng)
    configs = (asdict(model_config), tc.to_dict())
    first_step = 0
    if resume is not None:
        first_step = load_checkpoint(resume, strategy, rng, *configs, reshard=reshard)
        if first_step > tc.steps:  # equal is fine: nothing to train, evaluate and sample
            raise CheckpointError(
                f"the checkpoint is at step {first_step}, past this run's last step {tc.steps}: "
                f"ask for more steps (--steps) to train on from it"
            )
        for series in (history.losses, history.local_losses, history.step_seconds):
            series[:first_step] = np.nan  # those steps ran before the checkpoint

    for step in range(first_step, tc.steps):
        start = time.perf_counter()
        X, Y = sampler.next()
        X, Y = rank_slice(X, comm.rank, comm.size), rank_slice(Y, comm.rank, comm.size)
        if step == timeline_step:
            ledger.timeline = [("start", ledger.live_total)]
        local_loss = train_step(model, strategy, X, Y)
        if step == timeline_step:
            history.timeline, ledger.timeline = ledger.timeline, None
        loss = comm.mean_scalar(local_loss)
        history.step_seconds[step] = time.perf_counter() - start
        history.losses[step] = loss
        history.local_losses[step] = local_loss
        if on_log is not None and (step % tc.log_every == 0 or step == tc.steps - 1):
            on_log(step, loss)
        if save_every and ((step + 1) % save_every == 0 or step == tc.steps - 1):
            save_checkpoint(checkpoint_dir, strategy, step + 1, rng, *configs)

    history.traffic = comm.traffic_report()
    history.val_loss = evaluate(model, strategy, data, rng, tc.batch_size, tc.eval_batches)
    for _ in range(tc.n_samples):
        tokens = sample_name(model, strategy, rng)
        history.names.append(decode(tokens).rstrip("."))
        history.samples.append(format_sample(tokens, model_config.seq_len))
    history.memory = ledger.report()
    if trace_memory:
        history.memory["tracemalloc_peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    check_replicas(strategy)
    return history, strategy


def run_on_engine(model_config: ModelConfig, train_config: TrainConfig, **kwargs) -> dict:
    """What a notebook runs on every engine (Ranks.run): train on MPI.COMM_WORLD.

    Returns this rank's History as a dict, plus "params", the full parameters gathered
    (identical on every rank). Rank 0 feeds the notebook's progress line.
    """
    from .cluster import report_progress  # imported here: plain mpiexec runs don't need it

    history, strategy = run(
        model_config, train_config, Comm.world(), on_log=report_progress, **kwargs
    )
    return history.to_dict() | {"params": strategy.full_params(), "rank": strategy.comm.rank}
