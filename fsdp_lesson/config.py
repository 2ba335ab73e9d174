"""The three configs of a run; ModelConfig's and TrainConfig's defaults are the seed's numbers.

    ModelConfig   the network: vocabulary, context, widths, depth
    TrainConfig   how to train it: strategy, optimizer, steps, batch, seed (all a checkpoint keeps)
    RunConfig     where a run reads and writes, and what it records beside training

Field names are the command line's flags (`--batch` is `batch`, `--hidden` is `hidden`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

from .precision import PRECISIONS
from .sharding import STRATEGIES

OPTIMIZERS = ("sgd", "adam")
ACCUM_REDUCE = ("every", "last")
DEFAULT_LR = {"sgd": 0.1, "adam": 1e-3}  # sgd: the seed's rate


class ConfigError(ValueError):
    """A configuration that cannot train; the message says what to change."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


@dataclass(frozen=True)
class ModelConfig:
    """The character-level MLP: embedding -> layers x (Linear, ReLU) -> Linear -> softmax."""

    vocab_size: int = 27  # token 0 is '.', the boundary; a-z are 1-26
    seq_len: int = 16  # context length
    emb: int = 16  # embedding width
    hidden: int = 64  # width of every hidden layer
    layers: int = 1  # hidden Linear+ReLU blocks; 1 is the seed's model

    def validate(self) -> None:
        for name, value in asdict(self).items():
            _require(
                isinstance(value, int) and value >= 1,
                f"{name} must be a positive integer, got {value!r}",
            )


@dataclass(frozen=True)
class TrainConfig:
    """How to train: strategy, optimizer, steps, global batch, seed; defaults as in train_fsdp.c."""

    strategy: str = "single"
    optimizer: str = "sgd"
    lr: float | None = None  # None: the optimizer's default (DEFAULT_LR), filled in at creation
    steps: int = 25_000
    batch: int = 32  # the global batch, split over ranks
    seed: int = 42
    c_compat: bool = False  # glibc rand() and the seed's init/data/sampling order
    eval_batches: int = 100  # test batches for the final validation loss (0: none)
    samples: int = 10  # names sampled at the end
    log_every: int = 100
    memory_budget_mb: float | None = None  # per rank; a run predicted to need more is refused
    # zero3 only (FSDP's options): units, prefetch, reshard after forward, hybrid sharding
    layers_per_unit: int = 1  # consecutive parameterised layers gathered as one unit
    prefetch: bool = True  # gather the next unit while this one computes (same numbers)
    reshard_after_forward: bool = True  # False: keep units gathered from forward to backward
    replicate: int = 1  # HSDP: R groups of N/R ranks; shard within, average across
    # the other memory levers (precision.py, docs/architecture.md "Memory levers")
    precision: str = "fp32"  # bf16/fp16: 16-bit params and grads, fp32 master weights
    accum: int = 1  # micro-batches of `batch` rows each per optimizer step
    accum_reduce: str = "every"  # zero2/zero3: reduce every micro-batch, or once at the "last"
    recompute: bool = False  # keep only each block's input in forward; recompute in backward
    clip_grad_norm: float | None = None  # scale the gradient down to this global norm at most
    timeout: float = 300.0  # seconds a collective may wait before the job ends (comm.py, exit 4)

    def __post_init__(self) -> None:
        if self.lr is None and self.optimizer in DEFAULT_LR:
            object.__setattr__(self, "lr", DEFAULT_LR[self.optimizer])

    def validate(self, world_size: int = 1) -> None:
        """Raise ConfigError before any work (and so before any collective)."""
        _require(
            self.strategy in STRATEGIES,
            f"unknown strategy {self.strategy!r}: choose one of {', '.join(STRATEGIES)}",
        )
        _require(
            self.optimizer in OPTIMIZERS,
            f"unknown optimizer {self.optimizer!r}: choose sgd or adam",
        )
        _require(self.steps >= 0, f"steps must be 0 or more, got {self.steps}")
        _require(
            self.lr is not None and 0 < self.lr < math.inf,
            f"lr must be a positive finite number, got {self.lr}",
        )
        _require(
            0 <= self.seed < 2**32,
            f"seed must be between 0 and 2**32 - 1 (an unsigned 32-bit number, as C's srand "
            f"takes), got {self.seed}",
        )
        _require(self.batch >= 1, f"batch must be positive, got {self.batch}")
        _require(
            self.memory_budget_mb is None or 0 < self.memory_budget_mb < math.inf,
            f"memory budget must be a positive finite number of MiB, got {self.memory_budget_mb}",
        )
        _require(
            self.eval_batches >= 0 and self.samples >= 0 and self.log_every >= 1,
            "eval_batches and samples must be >= 0 and log_every >= 1",
        )
        _require(
            self.layers_per_unit >= 1 and self.replicate >= 1,
            "layers_per_unit and replicate must be positive integers",
        )
        _require(
            self.strategy == "zero3"
            or (self.layers_per_unit, self.reshard_after_forward, self.replicate) == (1, True, 1),
            "--layers-per-unit, --no-reshard-after-forward and --replicate shape how zero3 "
            "shards: use them with --strategy zero3",
        )
        _require(
            self.precision in PRECISIONS,
            f"unknown precision {self.precision!r}: choose one of {', '.join(PRECISIONS)}",
        )
        _require(self.accum >= 1, f"accum must be a positive integer, got {self.accum}")
        _require(
            self.clip_grad_norm is None or 0 < self.clip_grad_norm < math.inf,
            f"clip_grad_norm must be a positive finite number, got {self.clip_grad_norm}",
        )
        _require(
            isinstance(self.timeout, int | float) and 0 < self.timeout < math.inf,
            f"timeout must be a positive finite number of seconds, got {self.timeout}",
        )
        _require(
            self.accum_reduce in ACCUM_REDUCE,
            f"unknown accum_reduce {self.accum_reduce!r}: choose every or last",
        )
        _require(
            world_size % self.replicate == 0,
            f"--replicate {self.replicate} does not divide {world_size} ranks into equal "
            f"groups: use a divisor of {world_size}",
        )
        _require(
            self.strategy != "single" or world_size == 1,
            f"strategy 'single' runs on one rank, but this run has {world_size}: "
            "use --strategy dp (or zero1/zero2/zero3), or run without mpiexec",
        )
        _require(
            world_size <= self.batch,
            f"{world_size} ranks but a global batch of {self.batch}: every rank needs "
            f"at least one sample; use --batch {world_size} or more, or fewer ranks",
        )
        _require(
            self.batch % world_size == 0,
            f"global batch {self.batch} is not divisible by {world_size} ranks: "
            f"use a batch that is a multiple of {world_size} (e.g. --batch "
            f"{world_size * max(1, round(self.batch / world_size))}) or another rank count",
        )

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class RunConfig:
    """Where a run reads and writes, and what it records; none of it changes the numbers."""

    data: Path | None = None  # the names file; None: the lesson's data/names.txt
    checkpoint_dir: Path | None = None  # where sharded checkpoints go
    save_every: int | None = None  # save every so many steps (and at the end)
    resume: Path | None = None  # continue from this checkpoint
    reshard: bool = False  # allow resuming a checkpoint of another strategy, N or global batch
    overwrite: bool = False  # a fresh run may replace a checkpoint already in checkpoint_dir
    collectives: str = "mpi"  # "mpi": the library's; "ring": ring.py's, whose bytes are measured
    trace_memory: bool = False  # also measure the peak with tracemalloc (slower)
    timeline_step: int | None = None  # record the ledger's every change during this step
    trace_step: int | None = None  # record the wall-clock spans of compute and collectives

    def __post_init__(self) -> None:
        for name in ("data", "checkpoint_dir", "resume"):  # a str is a path too
            if isinstance(getattr(self, name), str):
                object.__setattr__(self, name, Path(getattr(self, name)))

    def validate(self) -> None:
        _require(
            self.collectives in ("mpi", "ring"),
            f"collectives {self.collectives!r}: choose mpi (the library's) or ring (ring.py's)",
        )
        _require(
            self.save_every is None or self.save_every >= 1,
            f"save_every must be a positive integer, got {self.save_every}",
        )
        _require(
            not self.save_every or self.checkpoint_dir is not None,
            "saving checkpoints needs a directory: --save-every needs --out DIR "
            "(checkpoints go to DIR/checkpoint)",
        )
