"""Command line: python -m fsdp_lesson train|commbench|hosts|bench|plan|data (train: mpiexec too).

python -m fsdp_lesson train --strategy single --steps 1000
mpiexec -n 4 python -m fsdp_lesson train --strategy dp --steps 1000 --out runs/dp
python -m fsdp_lesson data build
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import Field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .launch import (
    end_every_rank_on_interrupt,
    launcher_rank_and_size,
    rank_settings,
)

# A rank started by a plain `mpiexec -n 4 python -m fsdp_lesson train`: the launch settings
# (one BLAS thread, waiting ranks that yield their core) must be in place before numpy and MPI
# load; a value the user set wins. And one Ctrl-C ends it at once, even while it is still
# loading.
os.environ.update(rank_settings())
end_every_rank_on_interrupt(launcher_rank_and_size()[0])

try:  # numpy, and the package's modules below, load only after the settings above
    import numpy as np
except ImportError:  # a Python without the project's packages, e.g. outside .venv
    sys.exit(
        f"error: {sys.executable} lacks the project's packages (numpy, mpi4py, ...): activate "
        f"the project's environment first (. .venv/bin/activate), or run make run / make test"
    )

from .config import ConfigError, ModelConfig, RunConfig, TrainConfig
from .data import DEFAULT_PATH, NAMES_SHA256, DataError, build_names_file, sha256_of
from .watchdog import DEFAULT_TIMEOUT

if TYPE_CHECKING:  # train.py loads only when a run starts (train_command)
    from .train import History

# The configs whose flagged fields are train's flags (config.flag), in --help's order.
CONFIGS = (TrainConfig, ModelConfig, RunConfig)
Config = TypeVar("Config", ModelConfig, TrainConfig, RunConfig)


class UsageError(Exception):
    """A bad flag or value: one line on stderr and exit code 2, no traceback."""


class TrainingDiverged(Exception):
    """The loss became NaN or infinite: one line on stderr and exit code 3."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows a flag's default only where it says something: not None, and not for a
    plain switch (--recompute, --no-reshard-after-forward), whose name says what it changes."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        plain_switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
        if plain_switch or action.default is None:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse's errors as a UsageError, which main() turns into one line and exit code 2."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see --help)")


def flagged_fields(config_class: type) -> list[Field]:
    """The fields of a config that are also flags of `train` (made with config.flag)."""
    return [f for f in fields(config_class) if "flag" in f.metadata]


def add_flags(parser: argparse.ArgumentParser, config_class: type) -> None:
    """One flag per flagged field: argparse's keywords from its metadata, its value stored
    under the field's name, its default the field's (unless the metadata names another)."""
    for f in flagged_fields(config_class):
        options = {"default": f.default, **f.metadata}
        parser.add_argument(options.pop("flag"), dest=f.name, **options)


def build_parser() -> Parser:
    """Every subcommand; train's flags are the configs' flagged fields, then --out."""
    parser = Parser(prog="python -m fsdp_lesson", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)

    train = commands.add_parser(
        "train",
        help="train the MLP with a strategy (runs under mpiexec)",
        description="Train the names MLP; under mpiexec -n N every rank runs this command.",
        formatter_class=HelpFormatter,
    )
    for config_class in CONFIGS:
        add_flags(train, config_class)
    train.add_argument(
        "--out", type=Path, default=None, help="write history.json and params.npz here"
    )

    commands.add_parser(
        "commbench",
        help="time each collective over message sizes and fit latency and bandwidth (see "
        "commbench --help)",
        add_help=False,
    )
    commands.add_parser(
        "hosts",
        help="simulated hosts joined by a link of known bandwidth: hosts up | shape | down (no"
        " root; see hosts --help)",
        add_help=False,
    )
    commands.add_parser(
        "bench",
        help="measure memory, traffic and time: strategy x ranks x model (see bench --help)",
        add_help=False,
    )
    commands.add_parser(
        "plan",
        help="predict a real model's memory, bubble and traffic on a (dp, tp, pp) mesh (see plan"
        " --help)",
        add_help=False,
    )
    data = commands.add_parser(
        "data",
        help="build or check the names file",
        description="build: write the names file from US Social Security data (needs the "
        "data extra); check: compare a names file with the lesson's checksum.",
    )
    data.add_argument("action", choices=["build", "check"], help="build or check")
    data.add_argument(
        "--path", type=Path, default=DEFAULT_PATH, help="the names file (default: %(default)s)"
    )
    return parser


def checkpoint_in(path: Path | None) -> Path | None:
    """--resume accepts the checkpoint itself or the --out directory that holds it."""
    if path is None or (path / "manifest.json").exists():
        return path
    inside = path / "checkpoint"
    candidates = [inside.with_name(inside.name + suffix) for suffix in ("", ".partial", ".old")]
    return inside if any(c.exists() for c in candidates) else path


def config_from(config_class: type[Config], args: argparse.Namespace, **others: Any) -> Config:
    """A config from the parsed flags: each flagged field's value, then `others`, the fields
    the command line sets some other way (a checkpoint_dir from --out)."""
    flags = {f.name: getattr(args, f.name) for f in flagged_fields(config_class)}
    return config_class(**(flags | others))


def configs_from(args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig, RunConfig]:
    """The three configs of a run from the flags (each flag sets the field it is made with)."""
    run_config = config_from(
        RunConfig,
        args,
        checkpoint_dir=None if args.out is None else args.out / "checkpoint",
        resume=checkpoint_in(args.resume),
    )
    return config_from(ModelConfig, args), config_from(TrainConfig, args), run_config


def check_out(out: Path | None) -> None:
    """--out must be a writable directory, or one that can be created: checked before training."""
    if out is None:
        return
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file, not a directory: choose another --out")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"--out {out} cannot be created ({err.strerror}): choose another --out"
        ) from None
    if not os.access(out, os.W_OK | os.X_OK):
        raise ConfigError(f"--out {out} is not writable: choose another --out")


def check_flags(args) -> None:
    """Flags each fine alone that together would run something other than asked: refused
    before any work, the same on every rank."""
    from .bounds import layers_with_parameters

    count, names = layers_with_parameters(ModelConfig(layers=args.layers))
    if args.layers_per_unit > count:
        raise UsageError(
            f"error: argument --layers-per-unit: {args.layers_per_unit} is more than the "
            f"model's {count} layers with parameters ({names}): use at most "
            f"{count}, which makes the whole model one unit"
        )
    if args.trace_step is not None and args.strategy != "zero3":
        raise UsageError(
            "error: argument --trace-step: only zero3 records a step's spans (its gathers and "
            "reduce-scatters beside its compute): use it with --strategy zero3"
        )
    if args.trace_step is not None and args.trace_step >= args.steps:
        last = f"the last is {args.steps - 1}" if args.steps else "--steps 0 runs none"
        raise UsageError(
            f"error: argument --trace-step: step {args.trace_step} is past the last step "
            f"({last}; steps count from 0): choose a step below {args.steps} or more --steps"
        )


def start_mpi(timeout: float = DEFAULT_TIMEOUT) -> None:
    """Initialise MPI with the kernel's own action for SIGINT and SIGTERM, then restore ours.

    mpi4py calls MPI_Init_thread as it is imported, holding the GIL, and MPI_Init waits for
    every rank. A signal then wakes the thread that ends the rank with one line (launch.py),
    but that thread cannot run before MPI_Init returns, which it never does once another rank
    has ended (mpiexec passes a SIGTERM to the ranks one by one): 4 of 18 SIGTERMs that came
    0.85-1.1 s into a 4-rank start left the job waiting forever. During MPI_Init a signal now
    ends the rank at once (with no line); before and after it, as launch.py says. A rank that
    never reaches MPI_Init ends the job after `timeout` seconds, named (startup.py).
    """
    from .launch import drop_inherited_loopback
    from .startup import watched_start

    drop_inherited_loopback()  # as Comm.world does: MPI reads its environment as it starts
    previous = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with watched_start(*launcher_rank_and_size(), timeout):
            from mpi4py import MPI  # noqa: F401  (MPI_Init_thread)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def say_results(
    say: Callable[[str], None], history: History, strategy: str, ranks: int, config: TrainConfig
) -> None:
    """What rank 0 prints after training: the checkpoint it resumed from, if any, the
    validation loss and the sampled names."""
    from .checkpoint import layout_of

    resumed = history.resumed_from
    if resumed is not None:
        layout = layout_of(strategy, config.to_dict())  # e.g. "zero3 with --tp 2"
        resharded = (resumed["layout"], resumed["world_size"]) != (layout, ranks)
        say(
            f"resumed from {resumed['path']} at step {resumed['step']} (saved by "
            f"{resumed['layout']} on {resumed['world_size']} ranks; this run: {layout} "
            f"on {ranks}" + (", resharded)" if resharded else ")")
        )
        if resumed["batch"] != config.batch:
            say(
                f"note: the global batch changes from {resumed['batch']} to {config.batch}:"
                f" this run no longer matches one that never stopped"
            )
        if resumed["step"] == config.steps:
            say(f"nothing to train: the checkpoint is already at step {config.steps}")
    if history.val_loss is None:
        say("no validation (--eval-batches 0)")
    else:
        say(f"Final validation loss: {history.val_loss:f}")
    for line in history.samples:
        say(line)


def say_between_hosts(say: Callable[[str], None], traffic: list[dict]) -> None:
    """When the ranks span hosts: how many of the bytes they sent went to another host."""
    from .comm import bytes_between_hosts

    between = [bytes_between_hosts(report) for report in traffic]
    if not any(between):
        return
    sent = sum(t["sent_bytes"] for report in traffic for t in report.values())
    how = next(iter(traffic[0].values()))["how"]  # measured (ring) or counted (ring model)
    say(
        f"between hosts: {sum(between) / 1e6:,.2f} MB of the {sent / 1e6:,.2f} MB the ranks sent"
        f" ({how}: the sends to a right ring neighbour on another host)"
    )


def train_command(args) -> None:
    from .comm import Comm, gather_objects, raise_on_every_rank
    from .train import REFUSALS, Diverged, run, whole_params

    check_flags(args)
    model_config, train_config, run_config = configs_from(args)
    launched_alone = launcher_rank_and_size()[1] == 1
    alone = args.strategy == "single" and launched_alone
    if not alone:
        start_mpi(train_config.timeout)
    comm = Comm() if alone else Comm.world(run_config.collectives, train_config.timeout)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    try:  # every refusal is agreed on, so all ranks raise it together: no hang
        raise_on_every_rank(comm, lambda: check_out(args.out), REFUSALS)
        history, strategy = run(
            model_config,
            train_config,
            run_config,
            comm,
            on_log=lambda step, loss: say(f"step: {step}, loss {loss:f}", flush=True),
        )
    except REFUSALS as err:
        raise UsageError("\n".join(f"error: {line}" for line in str(err).splitlines())) from None
    except Diverged as err:  # the same loss on every rank: every rank stops here
        raise TrainingDiverged(
            f"error: training diverged: {err}" if comm.rank == 0 else ""
        ) from None
    say_results(say, history, strategy.name, comm.size, train_config)

    # a collective under sharding: every rank takes part, one layer gathered at a time, and only
    # when params.npz is asked for; only rank 0, which writes it, keeps the copies
    params = whole_params(strategy) if args.out is not None else {}
    mine = {"memory": history.memory, "traffic": history.traffic, "trace": history.trace}
    per_rank = gather_objects(comm, mine)
    if comm.rank == 0:
        say_between_hosts(say, [r["traffic"] for r in per_rank])

    def write_run() -> None:  # rank 0 writes; every rank ends with its exit code
        if comm.rank == 0 and args.out is not None:
            write_out(args.out, history, per_rank, params, say)

    try:
        raise_on_every_rank(comm, write_run, REFUSALS)
    except REFUSALS as err:
        raise UsageError(f"error: {err}") from None


def write_out(
    out: Path, history: History, per_rank: list[dict], params: dict, say: Callable[[str], None]
) -> None:
    """history.json (every rank's memory, traffic and --trace-step spans with it, in rank
    order) and params.npz into out, as checkpoints are written: no torn file, even on a full
    disk."""
    from .checkpoint import write_atomically, write_failure

    record = history.to_dict() | {
        "memory": [r["memory"] for r in per_rank],
        "traffic": [r["traffic"] for r in per_rank],
        "trace": [r["trace"] for r in per_rank],
    }
    text = json.dumps(record, indent=1, allow_nan=False).encode()
    arrays = {f"{layer}.{k}": v for layer, p in params.items() for k, v in p.items()}
    try:
        out.mkdir(parents=True, exist_ok=True)
        write_atomically(
            {
                out / "history.json": lambda f: f.write(text),
                out / "params.npz": lambda f: np.savez(f, **arrays),
            }
        )
    except OSError as err:
        raise ConfigError(write_failure(err)) from None
    say(f"wrote {out / 'history.json'} and {out / 'params.npz'}")


def data_command(args) -> int:
    try:
        if args.action == "build":
            digest = build_names_file(args.path)
            print(f"rebuilt {args.path} from the SSA baby names")
        else:
            digest = sha256_of(args.path, flag="--path")  # a regular file, as train reads
    except DataError as err:
        raise UsageError(f"error: {err}") from None
    status = "matches" if digest == NAMES_SHA256 else "DIFFERS from"
    print(f"{args.path}: sha256 {digest} ({status} the lesson's {NAMES_SHA256[:12]}...)")
    return 0 if digest == NAMES_SHA256 else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the sweep has its own flags (fsdp_lesson.bench)
        from .bench import main as bench_main

        return bench_main(argv[1:])
    if argv[:1] == ["commbench"]:  # the α–β fit has its own flags (fsdp_lesson.commbench)
        from .commbench import main as commbench_main

        return commbench_main(argv[1:])
    if argv[:1] == ["hosts"]:  # simulated hosts: up, shape and down (fsdp_lesson.hosts)
        from .hosts import main as hosts_main

        return hosts_main(argv[1:])
    if argv[:1] == ["plan"]:  # the mesh planner has its own flags (fsdp_lesson.plan_cli)
        from .plan_cli import main as plan_main

        return plan_main(argv[1:])
    try:
        args = build_parser().parse_args(argv)
        if args.command == "data":
            return data_command(args)
        train_command(args)
    except UsageError as err:
        if str(err) and launcher_rank_and_size()[0] == 0:
            print(err, file=sys.stderr)
        return 2
    except TrainingDiverged as err:
        if str(err):
            print(err, file=sys.stderr)
        return 3
    except Exception as err:  # anything unforeseen, on some ranks only perhaps
        abort_on_unforeseen(err)
    return 0


def abort_on_unforeseen(err: Exception) -> None:
    """An unforeseen error on this rank: say so in one line, then end every rank of the job.

    The other ranks may be waiting for this one inside a collective: MPI_Abort ends them all,
    where a plain exit would leave them waiting forever.
    """
    rank, size = launcher_rank_and_size()
    text = str(err).splitlines()[0] if str(err) else ""
    sys.stderr.write(
        f"rank {rank}: {type(err).__name__}: {text} -- unexpected, so every rank stops now; "
        f"run again with the same flags, and if it repeats, report this line\n"
    )
    sys.stderr.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    if size > 1 and mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        time.sleep(0.5)  # let mpiexec pass the line on before MPI_Abort tears the job down
        mpi.COMM_WORLD.Abort(1)
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
