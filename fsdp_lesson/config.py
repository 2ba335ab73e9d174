"""ModelConfig and TrainConfig: the defaults are the seed program's numbers."""

from __future__ import annotations

from dataclasses import asdict, dataclass

STRATEGIES = ("single", "dp", "zero1", "zero2", "zero3")
OPTIMIZERS = ("sgd", "adam")


class ConfigError(ValueError):
    """A configuration that cannot train; the message says what to change."""


@dataclass(frozen=True)
class ModelConfig:
    """The character-level MLP: embedding -> n_layers x (Linear, ReLU) -> Linear -> softmax."""

    vocab_size: int = 27  # token 0 is '.', the boundary; a-z are 1-26
    seq_len: int = 16  # context length
    emb_size: int = 16
    hidden_size: int = 64
    n_layers: int = 1  # hidden Linear+ReLU blocks; 1 is the seed's model

    def validate(self) -> None:
        for name in ("vocab_size", "seq_len", "emb_size", "hidden_size", "n_layers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be a positive integer, got {getattr(self, name)}")


@dataclass(frozen=True)
class TrainConfig:
    """How to train: strategy, optimizer, steps, batch, seed; defaults as in train_fsdp.c."""

    strategy: str = "single"
    optimizer: str = "sgd"
    lr: float | None = None  # None: 0.1 for SGD (the seed), 1e-3 for Adam
    steps: int = 25_000
    batch_size: int = 32  # the global batch, split over ranks
    seed: int = 42
    c_compat: bool = False  # glibc rand() and the seed's init/data/sampling order
    eval_batches: int = 100
    n_samples: int = 10
    log_every: int = 100
    memory_budget_mb: float | None = None  # per rank; the ledger refuses allocations beyond it

    @property
    def learning_rate(self) -> float:
        if self.lr is not None:
            return self.lr
        return 0.1 if self.optimizer == "sgd" else 1e-3

    def validate(self, world_size: int = 1) -> None:
        """Raise ConfigError before any work (and so before any collective) on every rank."""
        if self.strategy not in STRATEGIES:
            raise ConfigError(
                f"unknown strategy {self.strategy!r}: choose one of {', '.join(STRATEGIES)}"
            )
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}: choose sgd or adam")
        if self.steps < 1:
            raise ConfigError(f"steps must be at least 1, got {self.steps}")
        if not self.learning_rate > 0:
            raise ConfigError(f"lr must be positive, got {self.learning_rate}")
        if self.batch_size < 1:
            raise ConfigError(f"batch size must be positive, got {self.batch_size}")
        if self.memory_budget_mb is not None and not self.memory_budget_mb > 0:
            raise ConfigError(f"memory budget must be positive, got {self.memory_budget_mb} MB")
        if self.eval_batches < 0 or self.n_samples < 0 or self.log_every < 1:
            raise ConfigError("eval_batches and n_samples must be >= 0 and log_every >= 1")
        if self.strategy == "single" and world_size != 1:
            raise ConfigError(
                f"strategy 'single' runs on one rank, but this run has {world_size}: "
                "use --strategy dp (or zero1/zero2/zero3), or run without mpiexec"
            )
        if world_size > self.batch_size:
            raise ConfigError(
                f"{world_size} ranks but a global batch of {self.batch_size}: every rank needs "
                f"at least one sample; use --batch {world_size} or more, or fewer ranks"
            )
        if self.batch_size % world_size:
            raise ConfigError(
                f"global batch {self.batch_size} is not divisible by {world_size} ranks: "
                f"use a batch that is a multiple of {world_size} (e.g. --batch "
                f"{world_size * max(1, round(self.batch_size / world_size))}) or another rank count"
            )

    def to_dict(self) -> dict:
        return asdict(self)
