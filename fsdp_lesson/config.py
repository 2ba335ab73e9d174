"""The three configs of a run; ModelConfig's and TrainConfig's defaults are the C program's.

    ModelConfig   the network: vocabulary, context, widths, depth
    TrainConfig   how to train it: strategy, optimizer, steps, batch, seed (all a checkpoint keeps)
    RunConfig     where a run reads and writes, and what it records beside training

A field made with `flag(...)` is also a flag of `python -m fsdp_lesson train`: its name, help
and parsing sit here beside its default, once, and __main__ builds the parser from them.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .data import DEFAULT_PATH
from .sharding import STRATEGIES
from .watchdog import DEFAULT_TIMEOUT

OPTIMIZERS = ("sgd", "adam")
ACCUM_REDUCE = ("every", "last")
SHARD_GROUPS = ("consecutive", "strided")
COLLECTIVES = ("mpi", "ring")
SCHEDULES = ("gpipe", "1f1b")
CP_LAYOUTS = ("contiguous", "zigzag")  # ring_attention.py's: which positions a cp rank holds
MODELS = ("mlp", "gpt")  # model.py's MLP (the C program's), gpt.py's transformer
PRECISIONS = ("fp32", "bf16", "fp16")  # precision.py: what each keeps in 16 bits
DEFAULT_LR = {"sgd": 0.1, "adam": 1e-3}  # sgd: the C program's rate


class ConfigError(ValueError):
    """A configuration that cannot train; the message says what to change."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _require_positive_finite(name: str, value, unit: str = "", optional: bool = False) -> None:
    """Refuse a value that is not above 0 and below infinity (None passes when optional)."""
    _require(
        (optional and value is None) or (value is not None and 0 < value < math.inf),
        f"{name} must be a positive finite number{unit}, got {value}",
    )


def flag(name: str, default: Any, help: str, **parsing: Any) -> Any:
    """A field with this default that `train` also takes as the flag `name`, with this help.

    Its metadata holds argparse's keywords (help, and type, choices, action or metavar), so
    __main__ builds the parser from the fields and nothing is said a second time.
    """
    return field(default=default, metadata={"flag": name, "help": help, **parsing})


def _require_choices(config) -> None:
    """Every field of config that is a flag with choices holds one of them."""
    for f in fields(config):
        choices, value = f.metadata.get("choices"), getattr(config, f.name)
        _require(
            choices is None or value in choices,
            f"unknown {f.name} {value!r}: choose one of {', '.join(choices or ())}",
        )


def integer_at_least(minimum: int, wording: str) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum, else the one line `must be <wording>, got X`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be {wording}, got {value}")
        return value

    return parse


positive_int = integer_at_least(1, "a positive integer")
nonnegative_int = integer_at_least(0, "0 or more")


def positive_float(text: str) -> float:
    """An argparse type: a number above 0 and below infinity, else one line saying so."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


@dataclass(frozen=True)
class ModelConfig:
    """The network. mlp, the C program's: embedding -> layers x (Linear, ReLU) -> Linear ->
    softmax; gpt: embedding -> layers x transformer block -> LayerNorm, Linear (gpt.py)."""

    vocab_size: int = 27  # token 0 is '.', the boundary; a-z are 1-26
    seq_len: int = 16  # context length
    emb: int = flag("--emb", 16, "embedding width", type=positive_int)
    hidden: int = flag(
        "--hidden", 64, "hidden width (gpt: its MLP's, 4 x the default --emb)", type=positive_int
    )
    layers: int = flag(
        "--layers",
        1,
        "mlp: hidden Linear+ReLU blocks (1: the C program's model); gpt: transformer blocks",
        type=positive_int,
    )
    model: str = flag(
        "--model",
        "mlp",
        "mlp: the C program's character-level MLP; gpt: a causal transformer that predicts"
        " every position (gpt.py)",
        choices=MODELS,
    )
    heads: int = flag(
        "--heads", 4, "gpt: attention heads (--emb must be a multiple)", type=positive_int
    )

    def validate(self) -> None:
        _require_choices(self)
        for name, value in asdict(self).items():
            _require(
                name == "model" or (isinstance(value, int) and value >= 1),
                f"{name} must be a positive integer, got {value!r}",
            )
        _require(
            self.model != "gpt" or self.emb % self.heads == 0,
            f"--emb {self.emb} does not split into {self.heads} heads: use an --emb that is a"
            f" multiple of --heads (e.g. --emb {self.heads * max(1, self.emb // self.heads)})",
        )


@dataclass(frozen=True)
class TrainConfig:
    """How to train: strategy, optimizer, steps, global batch, seed; the defaults are those of
    the C program the course grew from (docs/seed_semantics.md)."""

    strategy: str = flag(
        "--strategy",
        "single",
        "where the bytes live: single (one rank, everything), dp (every rank a full replica, "
        "gradients allreduced), zero1 (optimizer state sharded), zero2 (+ gradients sharded), "
        "zero3 (+ parameters sharded: gathered layer by layer)",
        choices=STRATEGIES,
    )
    optimizer: str = flag("--optimizer", "sgd", "the update", choices=OPTIMIZERS)
    lr: float | None = flag(  # None: the optimizer's default (DEFAULT_LR), filled in at creation
        "--lr",
        None,
        "learning rate (default: 0.1 for sgd, the C program's; 1e-3 for adam)",
        type=positive_float,
    )
    steps: int = flag(
        "--steps",
        25_000,
        "optimizer steps (0: initialise, evaluate, sample, exit)",
        type=nonnegative_int,
    )
    batch: int = flag("--batch", 32, "global batch, split over the ranks", type=positive_int)
    seed: int = flag("--seed", 42, "random seed", type=int)
    c_compat: bool = flag(
        "--c-compat",
        False,
        "glibc rand() and the C program's order: its numbers (docs/seed_semantics.md)",
        action="store_true",
    )
    eval_batches: int = flag(
        "--eval-batches",
        100,
        "test batches for the final validation loss (0: no validation)",
        type=nonnegative_int,
    )
    samples: int = flag("--samples", 10, "names to sample at the end", type=nonnegative_int)
    log_every: int = flag("--log-every", 100, "print the loss every K steps", type=positive_int)
    memory_budget_mb: float | None = flag(
        "--memory-budget-mb",
        None,
        "per-rank budget in MiB: a run that would need more is refused",
        type=positive_float,
    )
    # zero3 only (FSDP's options): units, prefetch, reshard after forward, hybrid sharding
    layers_per_unit: int = flag(
        "--layers-per-unit",
        1,
        "zero3: gather, free and reduce-scatter K consecutive layers as one unit",
        type=positive_int,
    )
    prefetch: bool = flag(  # the same numbers either way
        "--prefetch",
        True,
        "zero3: gather the next unit and reduce-scatter gradients while computing",
        action=argparse.BooleanOptionalAction,
    )
    reshard_after_forward: bool = flag(
        "--no-reshard-after-forward",
        True,
        "zero3: keep each unit gathered from forward to backward (2x instead of 3x traffic)",
        action="store_false",
    )
    replicate: int = flag(
        "--replicate",
        1,
        "zero3 HSDP: R replica groups of N/R ranks; shard within, average across",
        type=positive_int,
    )
    shard_group: str = flag(
        "--shard-group",
        "consecutive",
        "zero3 HSDP: shard over N/R consecutive ranks (a host's, when hosts hold N/R ranks each:"
        " the fast links) and replicate across them; or over ranks R apart (the opposite)",
        choices=SHARD_GROUPS,
    )
    # the mesh (mesh.py): tensor and pipeline parallelism; --strategy runs along what is left
    tp: int = flag(
        "--tp",
        1,
        "tensor parallelism: T consecutive ranks split each pair of hidden layers (Megatron)",
        type=positive_int,
    )
    pp: int = flag(
        "--pp",
        1,
        "pipeline parallelism: P stages of consecutive layers; --strategy runs over the"
        " N / (T * P) ranks that hold the same piece",
        type=positive_int,
    )
    cp: int = flag(
        "--cp",
        1,
        "gpt: context parallelism, C ranks each hold a slice of every sequence and pass K/V"
        " around a ring in attention (ring attention); --strategy runs over dp and cp together",
        type=positive_int,
    )
    cp_layout: str = flag(
        "--cp-layout",
        "zigzag",
        "--cp: which positions each rank holds; zigzag (chunks i and 2C-1-i of 2C) balances"
        " causal attention's work, contiguous (slice i of C) does not",
        choices=CP_LAYOUTS,
    )
    sequence_parallel: bool = flag(
        "--sequence-parallel",
        False,
        "gpt with --tp: split the LayerNorms and the residual stream along the sequence over"
        " the tp ranks (allgather + reduce-scatter in place of tp's allreduce)",
        action="store_true",
    )
    micro_batches: int = flag(
        "--micro-batches",
        1,
        "pipeline: split each rank's batch into M micro-batches that flow through the stages",
        type=positive_int,
    )
    schedule: str = flag(
        "--schedule",
        "gpipe",
        "pipeline: every forward then every backward (gpipe), or one forward one backward in"
        " the steady state (1f1b: at most P micro-batches' activations held)",
        choices=SCHEDULES,
    )
    # the other memory levers (precision.py, docs/architecture.md "Memory levers")
    precision: str = flag(
        "--precision",
        "fp32",
        "bf16/fp16: 16-bit params and grads, fp32 master weights (fp16: loss scaling)",
        choices=PRECISIONS,
    )
    accum: int = flag(
        "--accum",
        1,
        "gradient accumulation: K micro-batches of --batch rows per optimizer step",
        type=positive_int,
    )
    accum_reduce: str = flag(  # zero2/zero3
        "--accum-reduce",
        "every",
        "reduce gradients after every micro-batch, or once after the last (DDP's no_sync,"
        " FSDP2's set_requires_gradient_sync(False))",
        choices=ACCUM_REDUCE,
    )
    recompute: bool = flag(
        "--recompute",
        False,
        "activation recomputation: keep each block's input, recompute the rest in backward",
        action="store_true",
    )
    clip_grad_norm: float | None = flag(
        "--clip-grad-norm",
        None,
        "scale each step's gradient down to a global norm of at most X, over all shards"
        " (torch.nn.utils.clip_grad_norm_)",
        type=positive_float,
        metavar="X",
    )
    timeout: float = flag(  # watchdog.py
        "--timeout",
        DEFAULT_TIMEOUT,
        "a rank that waits longer than this in one collective (another rank stopped, hung"
        " or gone) ends every rank with one line naming the collective and the ranks that did"
        " not arrive, exit code 4; the default is far above this lesson's longest healthy wait"
        " (a peer's start-up or checkpoint write: seconds) and ends a stalled job in minutes",
        type=positive_float,
        metavar="SECONDS",
    )

    def __post_init__(self) -> None:
        if self.lr is None and self.optimizer in DEFAULT_LR:
            object.__setattr__(self, "lr", DEFAULT_LR[self.optimizer])

    def validate(self, world_size: int = 1) -> None:
        """Raise ConfigError before any work (and so before any collective)."""
        check_values(self)
        check_zero3_options(self)
        check_ranks(self, world_size)

    def to_dict(self) -> dict:
        return asdict(self)


def check_values(tc: TrainConfig) -> None:
    """Each flag's value on its own: a choice it offers, a count or a rate in its range."""
    _require_choices(tc)
    _require(tc.steps >= 0, f"steps must be 0 or more, got {tc.steps}")
    _require_positive_finite("lr", tc.lr)
    _require(
        0 <= tc.seed < 2**32,
        f"seed must be between 0 and 2**32 - 1 (an unsigned 32-bit number, as C's srand "
        f"takes), got {tc.seed}",
    )
    _require(tc.batch >= 1, f"batch must be positive, got {tc.batch}")
    _require_positive_finite("memory budget", tc.memory_budget_mb, " of MiB", optional=True)
    _require(
        tc.eval_batches >= 0 and tc.samples >= 0 and tc.log_every >= 1,
        "eval_batches and samples must be >= 0 and log_every >= 1",
    )
    _require(tc.accum >= 1, f"accum must be a positive integer, got {tc.accum}")
    _require(
        min(tc.tp, tc.pp, tc.cp, tc.micro_batches) >= 1,
        "tp, pp, cp and micro_batches must be positive integers",
    )
    _require_positive_finite("clip_grad_norm", tc.clip_grad_norm, optional=True)
    _require(
        isinstance(tc.timeout, int | float) and 0 < tc.timeout < math.inf,
        f"timeout must be a positive finite number of seconds, got {tc.timeout}",
    )


def check_zero3_options(tc: TrainConfig) -> None:
    """zero3's own options (FSDP's) only with zero3, and what its --c-compat cannot follow."""
    _require(
        tc.layers_per_unit >= 1 and tc.replicate >= 1,
        "layers_per_unit and replicate must be positive integers",
    )
    _require(
        tc.strategy == "zero3"
        or (tc.layers_per_unit, tc.reshard_after_forward, tc.replicate) == (1, True, 1),
        "--layers-per-unit, --no-reshard-after-forward and --replicate shape how zero3 "
        "shards: use them with --strategy zero3",
    )
    _require(
        tc.shard_group == "consecutive" or tc.replicate > 1,
        "--shard-group strided places HSDP's groups: use it with --strategy zero3"
        " --replicate R (R > 1)",
    )
    _require(
        tc.strategy != "zero3"
        or not tc.c_compat
        or (tc.precision, tc.clip_grad_norm) == ("fp32", None),
        "--c-compat zero3 reproduces the C FSDP programs, which keep each rank's biases "
        "local in float32 (strategies/zero3/local_biases.py): drop --precision and "
        "--clip-grad-norm, or --c-compat",
    )


def check_model_options(mc: ModelConfig, tc: TrainConfig) -> None:
    """What the model and the way it is trained must agree on."""
    if mc.model == "mlp":
        _require(
            not tc.sequence_parallel and tc.cp == 1,
            f"--{'sequence-parallel' if tc.sequence_parallel else 'cp'} splits a transformer's"
            " sequence: use it with --model gpt",
        )
        return
    _require(
        not tc.c_compat,
        "--c-compat reproduces the C programs, which train the MLP: drop --model gpt or --c-compat",
    )
    _require(
        mc.heads % tc.tp == 0,
        f"--tp {tc.tp} splits attention by heads, and {mc.heads} heads do not split into"
        f" {tc.tp}: use --heads that is a multiple of --tp",
    )
    _require(
        not tc.sequence_parallel or tc.tp > 1,
        "--sequence-parallel splits along the sequence what --tp replicates: use it with"
        " --tp T (T > 1)",
    )
    _require(
        not tc.sequence_parallel or mc.seq_len % tc.tp == 0,
        f"--sequence-parallel gives each of --tp {tc.tp} ranks an equal part of the"
        f" {mc.seq_len} positions: use a --tp that divides {mc.seq_len}",
    )
    chunks = tc.cp * (2 if tc.cp_layout == "zigzag" else 1)  # a rank holds seq_len / cp of them
    _require(
        mc.seq_len % chunks == 0,
        f"--cp {tc.cp} --cp-layout {tc.cp_layout} cuts each sequence into {chunks} equal chunks,"
        f" and {mc.seq_len} positions do not divide into them: use a --seq-len that is a"
        f" multiple of {chunks}",
    )
    local = mc.seq_len // tc.cp  # the positions a cp rank holds, cut again by sp's tp ranks
    _require(
        not tc.sequence_parallel or local % tc.tp == 0,
        f"--sequence-parallel gives each of --tp {tc.tp} ranks an equal part of a cp rank's"
        f" {local} positions: use a --tp that divides {local}",
    )


def check_ranks(tc: TrainConfig, world_size: int) -> None:
    """TrainConfig.validate's checks that need the rank count (after its own: every size >= 1)."""
    model_ranks = tc.tp * tc.pp * tc.cp  # the ranks that hold one copy of the model
    flags = f"--tp {tc.tp} --pp {tc.pp}" + (f" --cp {tc.cp}" if tc.cp > 1 else "")
    _require(
        world_size % model_ranks == 0,
        f"{flags} need a multiple of {model_ranks} ranks, but this run has {world_size}: start"
        f" a multiple of {model_ranks} ranks, or choose sizes whose product divides {world_size}",
    )
    dp = world_size // model_ranks  # the ranks that split the batch (mesh.py)
    ranks = "ranks" if dp == world_size else "data-parallel ranks (N / (tp * pp * cp))"
    _require(
        tc.replicate == 1 or tc.cp == 1,
        "--replicate (HSDP) groups the data-parallel ranks, and --cp folds its ranks into them:"
        " use one of --replicate and --cp",
    )
    _require(
        dp % tc.replicate == 0,
        f"--replicate {tc.replicate} does not divide {dp} {ranks} into equal "
        f"groups: use a divisor of {dp}",
    )
    _require(
        tc.strategy != "single" or dp == 1,
        f"strategy 'single' keeps one copy of the model, but this run has {dp} {ranks}"
        ": use --strategy dp (or zero1/zero2/zero3), or run without mpiexec",
    )
    _require(
        dp <= tc.batch,
        f"{dp} {ranks} but a global batch of {tc.batch}: every rank needs "
        f"at least one sample; use --batch {dp} or more, or fewer ranks",
    )
    _require(
        tc.batch % dp == 0,
        f"global batch {tc.batch} is not divisible by {dp} {ranks}: "
        f"use a batch that is a multiple of {dp} (e.g. --batch "
        f"{dp * max(1, round(tc.batch / dp))}) or another rank count",
    )
    rows = tc.batch // dp
    _require(
        tc.micro_batches == 1 or tc.pp > 1,
        "--micro-batches feeds a pipeline's stages: use it with --pp P (P > 1)",
    )
    _require(
        rows % tc.micro_batches == 0,
        f"each rank's {rows} rows do not split into {tc.micro_batches} equal micro-batches:"
        f" use a --micro-batches that divides {rows}",
    )


@dataclass(frozen=True)
class RunConfig:
    """Where a run reads and writes, and what it records; none of it changes the numbers."""

    data: Path | None = field(  # None: the lesson's data/names.txt, the flag's default
        default=None,
        metadata={
            "flag": "--data",
            "help": "names file, one per line",
            "type": Path,
            "default": DEFAULT_PATH,
        },
    )
    checkpoint_dir: Path | None = None  # where sharded checkpoints go (the CLI: OUT/checkpoint)
    save_every: int | None = flag(
        "--save-every",
        None,
        "save a sharded checkpoint to OUT/checkpoint every K steps (and at the end)",
        type=positive_int,
    )
    resume: Path | None = flag(
        "--resume",
        None,
        "continue from a checkpoint (its directory, or the --out that holds it)",
        type=Path,
    )
    reshard: bool = flag(  # also of another global batch
        "--reshard",
        False,
        "allow resuming a checkpoint saved by another strategy or rank count",
        action="store_true",
    )
    overwrite: bool = flag(
        "--overwrite",
        False,
        "a fresh run (no --resume) may replace the checkpoint already in OUT/checkpoint",
        action="store_true",
    )
    collectives: str = flag(
        "--collectives",
        "mpi",
        "mpi: the MPI library's collectives (traffic counted by the ring model); ring: the "
        "lesson's rings of Sendrecv (traffic measured: the bytes really sent)",
        choices=COLLECTIVES,
    )
    trace_memory: bool = False  # also measure the peak with tracemalloc (slower)
    timeline_step: int | None = None  # record the ledger's every change during this step
    trace_step: int | None = flag(
        "--trace-step",
        None,
        "record the wall-clock spans of this step's compute and collectives",
        type=nonnegative_int,
    )

    def __post_init__(self) -> None:
        for name in ("data", "checkpoint_dir", "resume"):  # a str is a path too
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, Path(getattr(self, name)))

    def validate(self) -> None:
        _require_choices(self)
        _require(
            self.save_every is None or self.save_every >= 1,
            f"save_every must be a positive integer, got {self.save_every}",
        )
        _require(
            not self.save_every or self.checkpoint_dir is not None,
            "saving checkpoints needs a directory: --save-every needs --out DIR "
            "(checkpoints go to DIR/checkpoint)",
        )
