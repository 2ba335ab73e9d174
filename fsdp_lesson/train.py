"""The one training loop, evaluation and sampling; every strategy runs through these functions.

Only the strategy's hooks differ between single, dp and the ZeRO stages: the loop below is
the same for all of them (docs/architecture.md, "The loop and its hooks").
"""

from __future__ import annotations

import math
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from .admission import check_memory, memory_options
from .bounds import check_model_fits
from .checkpoint import (
    CheckpointError,
    find_checkpoint,
    layout_of,
    load_checkpoint,
    save_checkpoint,
)
from .comm import Comm, raise_on_every_rank
from .config import ConfigError, ModelConfig, RunConfig, TrainConfig, check_model_options
from .data import DEFAULT_PATH, DataError, Dataset, GlobalBatchSampler, decode, rank_slice
from .memory import Activations, MemoryBudgetError, MemoryLedger
from .mesh import Mesh
from .model import Model, Params
from .models import build_model
from .optim import make_optimizer
from .passes import backward, forward
from .pipeline import Stage, gather_stages, pipeline_loss, pipeline_next_token, pipeline_step
from .placement import differing_replicas
from .rng import Rng, make_rng
from .strategies import Strategy, make_strategy, strategy_options
from .strategies.base import state_regions
from .watchdog import WHERE, in_phase


def train_step(
    model: Model,
    strategy: Strategy,
    X: np.ndarray,
    Y: np.ndarray,
    accum: int = 1,
    recompute: bool = False,
) -> float:
    """Forward, loss, backward (mirroring forward), reduce gradients, update. This rank's loss.

    With accum K, X holds K micro-batches: each runs forward and backward in turn, their
    gradients add up (each is a mean over all K micro-batches' rows), and one update follows.
    With recompute, forward keeps only each block's input and backward recomputes the rest.
    """
    losses = []
    for micro, (x, y) in enumerate(zip(np.split(X, accum), np.split(Y, accum), strict=True)):
        strategy.begin_micro_batch(micro)
        acts = Activations(strategy.ledger)
        logits = forward(model, strategy, x, acts, recompute)
        loss, loss_cache = model.loss.forward(logits, y)
        acts.gradient("dlogits", model.loss.backward(loss_cache, rows=len(Y)))  # in the probs
        del logits, loss_cache  # no stray references: the ledger's frees are real
        backward(model, strategy, acts, recompute)  # from acts' gradient, layer by layer
        acts.clear()
        losses.append(loss)
    strategy.begin_phase("update")
    strategy.step()
    return sum(losses) / accum


def training_step(stage: Stage, strategy: Strategy, X: np.ndarray, Y: np.ndarray, tc: TrainConfig):
    """One optimizer step on this rank's rows: its stage's part of the pipeline's schedule
    (with one stage, train_step's forward and backward of each micro-batch); this rank's loss."""
    M, targets = tc.accum * tc.micro_batches, stage.targets(X, Y)
    return pipeline_step(
        stage, strategy, stage.pp, X, targets, M, tc.schedule, recompute=tc.recompute
    )


def whole_params(strategy: Strategy) -> dict[str, Params]:
    """Every layer's whole parameters on world rank 0 ({} elsewhere): gathered over the
    data-parallel and tensor-parallel ranks one layer at a time, then over the stages."""
    return gather_stages(strategy.full_params(root=0), strategy.model.pp)


@in_phase("the validation loss")
def evaluate(
    stage: Stage, strategy: Strategy, data: Dataset, rng: Rng, batch_size: int, n_batches: int
) -> float:
    """Mean loss over n_batches global batches of the test split (every data-parallel rank its
    slice; the last stage's loss, told to every stage; averaged over dp and cp)."""
    dp, sampler = strategy.mesh.dp, GlobalBatchSampler(data.X_test, data.Y_test, batch_size, rng)
    total = 0.0
    for _ in range(n_batches):
        X, Y = sampler.next()
        x, y = rank_slice(X, dp.rank, dp.size), rank_slice(Y, dp.rank, dp.size)
        total += strategy.comm.mean_scalar(
            pipeline_loss(stage, strategy, stage.pp, x, stage.targets(x, y))
        )
    return total / n_batches


@in_phase("sampling")
def sample_name(
    stage: Stage, strategy: Strategy, rng: Rng, max_tokens: int = 64, root: int = 0
) -> list[int]:
    """Generate one name as the C program does: the tokens drawn, ending with 0 (unless cut off).

    Every rank runs the forward (zero3 needs all ranks to gather) and draws u, keeping the
    random streams aligned; data-parallel rank `root`'s choice is broadcast so ranks can never
    disagree. (The tensor-parallel ranks of one group hold the same logits bit for bit, g's
    allreduce gives every rank the same sum, so they draw the same token.)
    """
    context = np.zeros((1, stage.config.seq_len), dtype=np.uint8)
    token = np.zeros(1, dtype=np.int32)
    tokens = []
    for _ in range(max_tokens):
        u = rng.uniform(1)[0]
        token[0] = pipeline_next_token(stage, strategy, stage.pp, context, u)  # the last stage's
        strategy.comm.bcast(token, root=root)
        tokens.append(int(token[0]))
        if token[0] == 0:  # the boundary token ends the name
            break
        context = np.roll(context, -1, axis=1)
        context[0, -1] = token[0]
    return tokens


def format_sample(tokens: list[int], seq_len: int) -> str:
    """The C program's line: the final context (left-padded with '.'), '-->', the last token."""
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
    samples: list[str] = field(default_factory=list)  # the C program's: context --> token
    names: list[str] = field(default_factory=list)  # the sampled names themselves
    memory: dict = field(default_factory=dict)  # this rank's ledger report
    traffic: dict = field(default_factory=dict)  # this rank's bytes by collective kind
    timeline: list = field(default_factory=list)  # (event, live bytes) over one step, if asked
    resumed_from: dict | None = None  # the checkpoint this run continued, if any
    trace: list = field(default_factory=list)  # (lane, what, start s, end s) of one step, if asked
    skipped_steps: list = field(default_factory=list)  # fp16: steps skipped on an overflow

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
        """Plain lists and numbers; steps that did not run here (before a resume) are None."""
        return {k: _plain(v) for k, v in vars(self).items()}


def _plain(value):
    """numpy arrays as lists, NaN as None: strict JSON that every parser reads."""
    if isinstance(value, np.ndarray):
        return [None if math.isnan(x) else x for x in value.tolist()]
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


class ReplicaMismatch(RuntimeError):
    """State that every rank should hold identically differs between ranks: a sharding bug."""


@in_phase("the replicas' check")
def check_replicas(strategy: Strategy) -> None:
    """Raise on every rank if any replicated state is not bit-identical on all ranks that hold
    it: every parameter and optimizer array, along every mesh dimension it is Replicate over
    (placement.py): the data-parallel replicas, and along tp the embedding or a row layer's bias.

    The C program this course grew from let bias gradients stay local, so the ranks' biases drifted
    apart; this check catches that class of bug after every run.
    """
    arrays = []
    for key, entry in strategy.local_state().items():
        what = key.rsplit(".", 1)[1]
        what = "" if what == "params" else f" {what}"
        arrays.append(
            (what, entry.array, state_regions(strategy, entry.layer, entry.array, entry.sharded))
        )
    if strategy.mixed:  # and the 16-bit copy of the parameters
        for name in strategy.layout:
            entry = strategy.sixteen_bit(name)
            arrays.append(
                (
                    " params16",
                    entry.array,
                    state_regions(strategy, name, entry.array, entry.sharded),
                )
            )
    differ = differing_replicas(arrays, strategy.state_mesh)
    if differ:
        raise ReplicaMismatch(f"replicated state differs between ranks: {', '.join(differ)}")


# Refusals every rank can reach on its own (a bad config, a missing file, a checkpoint that
# does not fit): `raise_on_every_rank` makes every rank raise them, never one rank alone.
REFUSALS = (ConfigError, DataError, CheckpointError, MemoryBudgetError)


class Diverged(ArithmeticError):
    """The loss became NaN or infinite: training stops there (the CLI exits with code 3)."""


def run(
    model_config: ModelConfig,
    train_config: TrainConfig,
    run_config: RunConfig | None = None,
    comm: Comm | None = None,
    data: Dataset | None = None,
    on_log: Callable[[int, float], None] | None = None,
) -> tuple[History, Strategy]:
    """Train, evaluate and sample with the configured strategy on this rank's Comm.

    Every rank calls it with the same configs; data, when given, saves loading names.txt.
    on_log(step, loss) is called every train_config.log_every steps and at the last one.
    """
    comm, rc, tc = comm or Comm(), run_config or RunConfig(), train_config
    data = raise_on_every_rank(comm, lambda: prepare(model_config, tc, rc, comm, data), REFUSALS)
    comm.timeout = tc.timeout  # validated: from here each collective waits at most this long
    settings = comm.allgather_objects((asdict(model_config), tc.to_dict()))
    if any(other != settings[0] for other in settings):  # every rank sees the same list
        raise ConfigError("the ranks were started with different settings: give all the same flags")
    # tensor parallelism splits the model over mesh.tp, context parallelism its sequences over
    # mesh.cp, a pipeline gives each of mesh.pp's ranks a stage of its layers, and the
    # strategy, given the mesh, runs over mesh.dp (and mesh.cp's ranks with them)
    mesh = Mesh.of(comm, tc.tp, tc.pp, tc.cp)
    rng = make_rng(tc.seed, tc.c_compat)
    # this rank's stage of the model (P = 1: all of it), its Linears split over mesh.tp
    model = build_model(
        model_config, mesh.tp, tc.c_compat, tc.sequence_parallel, mesh.cp, tc.cp_layout
    )
    model = Stage(model, tc.pp, mesh.pp.rank, mesh.pp)
    budget = None if tc.memory_budget_mb is None else int(tc.memory_budget_mb * 2**20)
    ledger = MemoryLedger(rank=comm.rank, budget_bytes=budget)
    optimizer = make_optimizer(tc.optimizer, tc.lr)
    history = History.for_steps(model_config, tc, comm.size)
    if rc.trace_memory:
        tracemalloc.start()
    options = memory_options(tc) | strategy_options(tc.strategy, tc)
    options["accum"] *= tc.micro_batches  # a pipeline's micro-batches are accumulation's
    options["clip_grad_norm"] = tc.clip_grad_norm  # allocates nothing: not the planner's
    strategy = raise_on_every_rank(
        comm,
        lambda: make_strategy(tc.strategy, model, optimizer, mesh, ledger, **options),
        REFUSALS,
    )
    # layer by layer, each rank only what it holds
    raise_on_every_rank(comm, lambda: strategy.init_params(rng), REFUSALS)
    first_step = 0 if rc.resume is None else resume(rc, strategy, rng, history)
    train_loop(model, strategy, data, rng, history, first_step, tc, rc, on_log)
    history.traffic = comm.traffic_report()  # every dimension's: "allreduce (tp)", ...
    finish(model, strategy, data, rng, history, tc, rc)
    check_replicas(strategy)
    return history, strategy


def prepare(
    model_config: ModelConfig, tc: TrainConfig, rc: RunConfig, comm: Comm, data: Dataset | None
) -> Dataset:
    """Every refusal a rank can reach before anything is allocated, then the data."""
    tc.validate(comm.size)
    model_config.validate()
    check_model_options(model_config, tc)
    check_model_fits(model_config, comm.size, tc.memory_budget_mb)  # before any dry run
    rc.validate()
    if rc.resume is None and rc.checkpoint_dir is not None and not rc.overwrite:
        existing = find_checkpoint(rc.checkpoint_dir)
        if existing is not None:
            raise ConfigError(
                f"{existing} already holds a checkpoint: continue it with --resume "
                f"{rc.checkpoint_dir.parent}, or replace it with --overwrite"
            )
    if tc.strategy == "zero3" and tc.c_compat and (rc.save_every or rc.resume):
        raise ConfigError(
            "--c-compat zero3 keeps each rank's own biases, as the C FSDP programs do, and a "
            "checkpoint holds one model: save or resume without --c-compat"
        )
    check_memory(model_config, tc, comm, None if data else rc.data or DEFAULT_PATH)
    return data or Dataset.load(rc.data or DEFAULT_PATH, seq_len=model_config.seq_len)


def resume(rc: RunConfig, strategy: Strategy, rng: Rng, history: History) -> int:
    """Load rc.resume into strategy and rng, carry its losses into history; the step it was at.
    Every rank of the mesh agrees (the strategy's Comm spans only the data-parallel ranks)."""
    comm = strategy.mesh.world
    manifest = raise_on_every_rank(
        comm,
        lambda: load_checkpoint(
            rc.resume, strategy, rng, history.model_config, history.train_config, reshard=rc.reshard
        ),
        REFUSALS,
    )
    loaded = comm.allgather_objects(manifest["files"])
    if any(files != loaded[0] for files in loaded):  # every rank sees the same list
        raise CheckpointError("the ranks loaded different checkpoints: give all the same --resume")
    first_step = manifest["step"]
    if rc.trace_step is not None and rc.trace_step < first_step:  # it would record nothing
        raise ConfigError(
            f"--trace-step {rc.trace_step} comes before step {first_step}, where this run "
            f"resumes: choose a step from {first_step} on"
        )
    history.losses[:first_step] = manifest["losses"]  # the checkpoint carries them
    for series in (history.local_losses, history.step_seconds):
        series[:first_step] = np.nan  # this rank's figures of an earlier process
    history.resumed_from = {
        "path": manifest["path"],
        "step": first_step,
        "strategy": manifest["strategy"],
        "world_size": manifest["world_size"],
        "batch": manifest["train_config"]["batch"],
        "layout": layout_of(manifest["strategy"], manifest["train_config"]),
    }
    return first_step


def train_loop(
    model: Stage,
    strategy: Strategy,
    data: Dataset,
    rng: Rng,
    history: History,
    first_step: int,
    tc: TrainConfig,
    rc: RunConfig,
    on_log: Callable[[int, float], None] | None,
) -> None:
    """Steps first_step .. steps - 1: train_step on this rank's slice of each global batch,
    the global loss, what the run records of a step, and checkpoints."""
    comm, ledger = strategy.comm, strategy.ledger  # comm: dp's ranks (and cp's with them)
    dp = strategy.mesh.dp  # the ranks that split the batch (cp's ranks share their rows)
    # a step takes accum global batches of tc.batch rows: as one batch of tc.batch * accum
    sampler = GlobalBatchSampler(data.X_train, data.Y_train, tc.batch * tc.accum, rng)
    # overflow and log(0) are expected when training diverges: the loss check below says so
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        for step in range(first_step, tc.steps):
            WHERE.step, start = step, time.perf_counter()
            X, Y = sampler.next_slice(dp.rank, dp.size)  # rank_slice of the global batch
            if step == rc.timeline_step:
                ledger.timeline = [("start", ledger.live_total)]
            if step == rc.trace_step:  # the collectives' spans, and zero3's units' compute
                comm.trace.spans = []
            local_loss = training_step(model, strategy, X, Y, tc)
            if strategy.precision.scaler is not None and strategy.precision.scaler.last_skipped:
                history.skipped_steps.append(step)
            if step == rc.timeline_step:
                history.timeline, ledger.timeline = ledger.timeline, None
            if step == rc.trace_step:
                history.trace = [
                    (lane, what, a - start, b - start) for lane, what, a, b in comm.trace.spans
                ]
                comm.trace.spans = None
            loss = comm.mean_scalar(local_loss)
            if not math.isfinite(loss):  # the same global loss on every rank: all stop here
                last = history.losses[first_step:step]
                raise Diverged(
                    f"the loss became {loss} at step {step} (the last finite loss: "
                    f"{last[-1] if len(last) else 'none'}): lower the learning rate (--lr)"
                )
            history.step_seconds[step] = time.perf_counter() - start
            history.losses[step] = loss
            history.local_losses[step] = local_loss
            if on_log is not None and (step % tc.log_every == 0 or step == tc.steps - 1):
                on_log(step, loss)
            if rc.save_every and ((step + 1) % rc.save_every == 0 or step == tc.steps - 1):
                configs = (history.model_config, history.train_config)
                save_checkpoint(
                    rc.checkpoint_dir, strategy, step + 1, rng, *configs, history.losses
                )
    WHERE.step = None  # what follows names its own phase


def finish(
    model: Stage,
    strategy: Strategy,
    data: Dataset,
    rng: Rng,
    history: History,
    tc: TrainConfig,
    rc: RunConfig,
) -> None:
    """After the last step: validation loss, samples, memory."""
    if tc.eval_batches:
        history.val_loss = evaluate(model, strategy, data, rng, tc.batch, tc.eval_batches)
    # --c-compat zero3's data-parallel ranks hold different biases (local_biases.py): the token
    # is the C programs' broadcasting rank's, the 3-D program's last, the FSDP program's first
    root = strategy.comm.size - 1 if tc.c_compat and tc.pp > 1 else 0
    for _ in range(tc.samples):
        tokens = sample_name(model, strategy, rng, root=root)
        history.names.append(decode(tokens).rstrip("."))
        history.samples.append(format_sample(tokens, model.config.seq_len))
    history.memory = strategy.ledger.report()
    if rc.trace_memory:
        history.memory["tracemalloc_peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
