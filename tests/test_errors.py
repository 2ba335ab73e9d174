"""Bad input, table-driven: one clear line with cause and fix, exit code 2, every rank, no hang.

Each case runs the real CLI under `mpiexec -n 2` (or plain python for single), bounded by a
timeout; docs/troubleshooting.md's table lists the same cases.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_lesson.config import ConfigError, ModelConfig, TrainConfig

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
TIMEOUT = 30  # seconds; these answer in 1-3 s, a hang would not


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.txt").write_text("")
    (d / "digit.txt").write_text("emma\nolivia\nr2d2\n")
    (d / "long.txt").write_text("emma\n" + "a" * 16 + "\n")
    (d / "crlf.txt").write_bytes(b"emma\r\nolivia\r\nava\r\n" * 50)
    return d


def cli(args: list[str], ranks: int = 2) -> subprocess.CompletedProcess:
    prefix = [MPIEXEC, "-n", str(ranks)] if ranks > 1 else []
    return subprocess.run(
        [*prefix, sys.executable, "-m", "fsdp_lesson", "train", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


CASES = [
    # (id, args, ranks, what stderr must say)
    (
        "batch-not-divisible",
        ["--strategy", "dp", "--batch", "31"],
        2,
        "global batch 31 is not divisible by 2 ranks",
    ),
    (
        "more-ranks-than-batch",
        ["--strategy", "zero3", "--batch", "1"],
        2,
        "2 ranks but a global batch of 1",
    ),
    ("unknown-strategy", ["--strategy", "zero4"], 2, "invalid choice: 'zero4'"),
    ("unknown-optimizer", ["--optimizer", "rmsprop"], 2, "invalid choice: 'rmsprop'"),
    ("steps-negative", ["--steps", "-1"], 1, "--steps: must be 0 or more, got -1"),
    ("lr-negative", ["--lr", "-0.1"], 1, "--lr: must be a positive finite number, got -0.1"),
    ("hidden-zero", ["--hidden", "0"], 1, "--hidden: must be a positive integer, got 0"),
    ("layers-zero", ["--layers", "0"], 1, "--layers: must be a positive integer, got 0"),
    ("emb-not-a-number", ["--emb", "sixteen"], 1, "--emb: 'sixteen' is not an integer"),
    (
        "single-under-mpiexec",
        ["--strategy", "single"],
        2,
        "strategy 'single' keeps one copy of the model",
    ),
    (
        "save-without-out",
        ["--strategy", "dp", "--save-every", "5"],
        2,
        "--save-every needs --out DIR",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_flags(case):
    _, args, ranks, message = case
    result = cli(["--steps", "3", *args] if "--steps" not in args else args, ranks)
    assert result.returncode == 2, result.stderr
    assert result.stderr.count(message) == 1, result.stderr  # once, not once per rank
    assert "Traceback" not in result.stderr and "step:" not in result.stdout


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "missing.txt",
            "missing.txt: no such file; build it with `python -m fsdp_lesson data build`",
        ),
        ("empty.txt", "empty.txt is empty"),
        (
            "digit.txt",
            "digit.txt, line 3: 'r2d2' contains '2'; only lowercase letters a-z are allowed",
        ),
        (
            "long.txt",
            "long.txt, line 2: 'aaaaaaaaaaaaaaaa' has 16 letters; the model reads at most 15",
        ),
        (".", "is a directory"),
    ],
)
def test_bad_names_files(files, name, message):
    result = cli(["--strategy", "dp", "--steps", "3", "--data", str(files / name)])
    assert result.returncode == 2
    assert result.stderr.count(message) == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_windows_line_endings_are_accepted(files):
    result = cli(
        [
            "--strategy",
            "dp",
            "--steps",
            "3",
            "--data",
            str(files / "crlf.txt"),
            "--eval-batches",
            "1",
            "--samples",
            "1",
        ]
    )
    assert result.returncode == 0, result.stderr


def test_checkpoint_errors_at_the_cli(tmp_path):
    out = tmp_path / "run"
    assert (
        cli(
            [
                "--strategy",
                "zero3",
                "--steps",
                "4",
                "--save-every",
                "4",
                "--out",
                str(out),
                "--eval-batches",
                "0",
                "--samples",
                "0",
            ]
        ).returncode
        == 0
    )
    ckpt = out / "checkpoint"
    other_n = cli(["--strategy", "zero3", "--steps", "8", "--resume", str(ckpt)], ranks=4)
    assert other_n.returncode == 2
    assert "saved by zero3 on 2 ranks, this run is zero3 on 4: pass --reshard" in other_n.stderr
    other_model = cli(
        ["--strategy", "zero3", "--steps", "8", "--hidden", "32", "--resume", str(ckpt)]
    )
    assert other_model.returncode == 2 and "another model" in other_model.stderr
    too_few = cli(["--strategy", "zero3", "--steps", "3", "--resume", str(out)])  # --out works too
    assert too_few.returncode == 2
    assert "the checkpoint is at step 4, past this run's last step 3" in too_few.stderr
    done = cli(["--strategy", "zero3", "--steps", "4", "--resume", str(out), "--samples", "0"])
    assert (
        done.returncode == 0
        and "nothing to train: the checkpoint is already at step 4" in done.stdout
    )
    onward = cli(
        [
            "--strategy",
            "zero3",
            "--steps",
            "6",
            "--resume",
            str(out),
            "--eval-batches",
            "0",
            "--samples",
            "0",
            "--log-every",
            "1",
        ]
    )
    assert onward.returncode == 0 and onward.stdout.startswith("step: 4, loss")
    shard = next(ckpt.glob("rank*.npz"))
    shard.write_bytes(b"not a checkpoint")
    corrupted = cli(["--strategy", "zero3", "--steps", "8", "--resume", str(ckpt)])
    assert corrupted.returncode == 2 and "missing or corrupted" in corrupted.stderr
    assert "Traceback" not in other_n.stderr + other_model.stderr + corrupted.stderr


def test_python_api_raises_config_errors():
    with pytest.raises(ConfigError, match="unknown strategy 'zero4'"):
        TrainConfig(strategy="zero4").validate()
    with pytest.raises(ConfigError, match="unknown optimizer"):
        TrainConfig(optimizer="rmsprop").validate()
    with pytest.raises(ConfigError, match="hidden must be a positive integer"):
        ModelConfig(hidden=0).validate()
    with pytest.raises(ConfigError, match="lr must be a positive finite number"):
        TrainConfig(lr=0.0).validate()
