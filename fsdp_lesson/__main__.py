"""Command line: `python -m fsdp_lesson train|bench|data ...`; train runs under mpiexec too.

python -m fsdp_lesson train --strategy single --steps 1000
mpiexec -n 4 python -m fsdp_lesson train --strategy dp --out runs/dp
python -m fsdp_lesson data build
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from .checkpoint import CheckpointError
from .config import OPTIMIZERS, STRATEGIES, ConfigError, ModelConfig, TrainConfig
from .data import DEFAULT_PATH, NAMES_SHA256, DataError, Dataset, build_names_file
from .memory import MemoryBudgetError


class UsageError(Exception):
    """A bad flag or value: one line on stderr and exit code 2, no traceback."""


def launcher_rank_and_size() -> tuple[int, int]:
    """This process's rank and the job's size as the MPI launcher announced them, before MPI starts.

    Bad flags are caught before MPI starts, and only rank 0 should say so.
    """
    for rank_var, size_var in [
        ("PMI_RANK", "PMI_SIZE"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMIX_RANK", "PMIX_SIZE"),
        ("SLURM_PROCID", "SLURM_NTASKS"),
    ]:
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see --help)")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def build_parser() -> Parser:
    parser = Parser(prog="python -m fsdp_lesson", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    train = commands.add_parser(
        "train",
        help="train the MLP with a strategy (runs under mpiexec)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    train.add_argument("--strategy", choices=STRATEGIES, default="single", help="where bytes live")
    train.add_argument("--steps", type=positive_int, default=TrainConfig.steps, help="steps")
    train.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd", help="optimizer")
    train.add_argument(
        "--lr", type=positive_float, default=None, help="default: 0.1 sgd, 1e-3 adam"
    )
    train.add_argument(
        "--batch", type=positive_int, default=TrainConfig.batch_size, help="global batch"
    )
    train.add_argument("--emb", type=positive_int, default=ModelConfig.emb_size, help="embedding")
    train.add_argument("--hidden", type=positive_int, default=ModelConfig.hidden_size, help="width")
    train.add_argument(
        "--layers",
        type=positive_int,
        default=ModelConfig.n_layers,
        help="hidden Linear+ReLU blocks (1 is the seed's model)",
    )
    train.add_argument("--seed", type=int, default=TrainConfig.seed, help="random seed")
    train.add_argument("--data", type=Path, default=DEFAULT_PATH, help="names file, one per line")
    train.add_argument(
        "--c-compat",
        action="store_true",
        help="glibc rand() and the seed's order: reproduces train.c's numbers",
    )
    train.add_argument(
        "--eval-batches",
        type=int,
        default=TrainConfig.eval_batches,
        help="test batches for the final validation loss",
    )
    train.add_argument(
        "--samples", type=int, default=TrainConfig.n_samples, help="names to sample at the end"
    )
    train.add_argument(
        "--log-every", type=positive_int, default=TrainConfig.log_every, help="print every K steps"
    )
    train.add_argument(
        "--memory-budget-mb",
        type=positive_float,
        default=None,
        help="per-rank budget: the memory ledger refuses to allocate beyond it",
    )
    train.add_argument(
        "--save-every",
        type=positive_int,
        default=None,
        help="save a sharded checkpoint to OUT/checkpoint every K steps",
    )
    train.add_argument("--resume", type=Path, default=None, help="continue from a checkpoint")
    train.add_argument(
        "--reshard",
        action="store_true",
        help="allow resuming a checkpoint of another strategy or rank count",
    )
    train.add_argument("--out", type=Path, default=None, help="write history.json and params.npz")

    commands.add_parser("bench", help="the memory/traffic/time sweep (see bench --help)")
    data = commands.add_parser("data", help="build or check data/names.txt")
    data.add_argument("action", choices=["build", "check"])
    data.add_argument("--path", type=Path, default=DEFAULT_PATH)
    return parser


def describe_problems(problems: list[str | None]) -> str:
    """One 'error:' line per distinct problem; names the ranks when not all ranks share it."""
    lines = []
    for text in dict.fromkeys(p for p in problems if p is not None):
        ranks = [r for r, p in enumerate(problems) if p == text]
        where = "" if len(ranks) == len(problems) else f" (on rank {', '.join(map(str, ranks))})"
        lines.append(f"error: {text}{where}")
    return "\n".join(lines)


def checkpoint_in(path: Path | None) -> Path | None:
    """--resume accepts the checkpoint itself or the --out directory that holds it."""
    if path is not None and not (path / "manifest.json").exists():
        if (path / "checkpoint" / "manifest.json").exists():
            return path / "checkpoint"
    return path


def train_command(args) -> None:
    from .comm import Comm
    from .train import run

    model_config = ModelConfig(emb_size=args.emb, hidden_size=args.hidden, n_layers=args.layers)
    train_config = TrainConfig(
        strategy=args.strategy,
        optimizer=args.optimizer,
        lr=args.lr,
        steps=args.steps,
        batch_size=args.batch,
        memory_budget_mb=args.memory_budget_mb,
        eval_batches=args.eval_batches,
        n_samples=args.samples,
        seed=args.seed,
        c_compat=args.c_compat,
        log_every=args.log_every,
    )
    launched_alone = launcher_rank_and_size()[1] == 1
    comm = Comm() if args.strategy == "single" and launched_alone else Comm.world()
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    problem = None
    try:
        if args.save_every and args.out is None:
            raise ConfigError("--save-every needs --out DIR: checkpoints go to DIR/checkpoint")
        train_config.validate(comm.size)
        model_config.validate()
        data = Dataset.load(args.data, seq_len=model_config.seq_len)
    except (ConfigError, DataError) as err:
        problem = str(err)
    # Agree before any other collective: if one rank cannot start, no rank starts (no hang).
    problems = comm.gather_objects(problem)
    if not comm.all_agree(problem is None):
        raise UsageError(describe_problems(problems) if comm.rank == 0 else "")

    try:  # every rank allocates the same bytes in the same order, so all refuse together
        history, strategy = run(
            model_config,
            train_config,
            comm,
            data,
            on_log=lambda step, loss: say(f"step: {step}, loss {loss:f}", flush=True),
            save_every=args.save_every,
            checkpoint_dir=None if args.out is None else args.out / "checkpoint",
            resume=checkpoint_in(args.resume),
            reshard=args.reshard,
        )
    except (MemoryBudgetError, CheckpointError) as err:
        raise UsageError(f"error: {err}" if comm.rank == 0 else "") from None
    if np.isnan(history.losses).all():
        say(f"nothing to train: the checkpoint is already at step {train_config.steps}")
    say(f"Final validation loss: {history.val_loss:f}")
    for line in history.samples:
        say(line)

    params = strategy.full_params()  # a collective under sharding: every rank takes part
    per_rank = comm.gather_objects({"memory": history.memory, "traffic": history.traffic})
    if args.out is not None and comm.rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        record = history.to_dict() | {
            "memory": [r["memory"] for r in per_rank],
            "traffic": [r["traffic"] for r in per_rank],
        }
        (args.out / "history.json").write_text(json.dumps(record, indent=1))
        np.savez(
            args.out / "params.npz",
            **{f"{layer}.{k}": v for layer, p in params.items() for k, v in p.items()},
        )
        say(f"wrote {args.out / 'history.json'} and {args.out / 'params.npz'}")


def data_command(args) -> int:
    if args.action == "build":
        digest = build_names_file(args.path)
    else:
        from .data import sha256_of

        digest = sha256_of(args.path)
    status = "matches" if digest == NAMES_SHA256 else "DIFFERS from"
    print(f"{args.path}: sha256 {digest} ({status} the lesson's {NAMES_SHA256[:12]}...)")
    return 0 if digest == NAMES_SHA256 else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the sweep has its own flags (fsdp_lesson.bench)
        from .bench import main as bench_main

        return bench_main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
        if args.command == "data":
            return data_command(args)
        train_command(args)
    except (UsageError, DataError) as err:
        if str(err) and launcher_rank_and_size()[0] == 0:
            print(err, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
