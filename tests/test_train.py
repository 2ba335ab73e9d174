"""The single-rank loop: c-compat reproduces the C program; determinism; the CLI."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fsdp_lesson.config import ModelConfig, TrainConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.model import MLP, loss_and_grads
from fsdp_lesson.rng import make_rng
from fsdp_lesson.train import run

FIXTURE = Path(__file__).parent / "fixtures" / "c_reference_losses.txt"


@pytest.fixture(scope="module")
def data():
    return Dataset.load()


def c_reference_losses() -> np.ndarray:
    rows = [line.split() for line in FIXTURE.read_text().splitlines() if not line.startswith("#")]
    assert [int(step) for step, _ in rows] == list(range(1000))
    return np.array([float(loss) for _, loss in rows])


def test_c_compat_reproduces_the_c_trace(data):
    history, _ = run(
        ModelConfig(),
        TrainConfig(steps=1000, c_compat=True, eval_batches=0, samples=0),
        data=data,
    )
    diff = np.abs(np.array(history.losses) - c_reference_losses())
    assert diff.max() <= 1e-5, f"step {diff.argmax()} differs by {diff.max():.2e}"


def test_training_is_deterministic_and_learns(data):
    config = TrainConfig(steps=300, eval_batches=5, samples=3)
    a, _ = run(ModelConfig(), config, data=data)
    b, _ = run(ModelConfig(), config, data=data)
    assert np.array_equal(a.losses, b.losses)
    assert a.val_loss == b.val_loss and a.samples == b.samples
    assert np.mean(a.losses[-50:]) < np.mean(a.losses[:50]) - 0.3


def test_first_step_equals_the_reference_loss(data):
    model = MLP(ModelConfig())
    rng = make_rng(42)
    params = model.init_params(rng)
    idx = rng.indices(len(data.X_train), 32)
    expected, _ = loss_and_grads(model, params, data.X_train[idx], data.Y_train[idx])
    history, _ = run(ModelConfig(), TrainConfig(steps=1, eval_batches=0, samples=0), data=data)
    assert history.losses[0] == expected


def test_adam_trains_faster_than_sgd_early(data):
    sgd, _ = run(ModelConfig(), TrainConfig(steps=200, eval_batches=0, samples=0), data=data)
    adam, _ = run(
        ModelConfig(),
        TrainConfig(steps=200, optimizer="adam", eval_batches=0, samples=0),
        data=data,
    )
    assert np.mean(adam.losses[-50:]) < np.mean(sgd.losses[-50:])


def test_samples_have_the_seed_format(data):
    history, _ = run(ModelConfig(), TrainConfig(steps=50, eval_batches=2, samples=4), data=data)
    assert len(history.samples) == 4
    for line in history.samples:
        context, last = line.split("  --> ")
        assert len(context.split(" ")) == 16 and last == "."


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "fsdp_lesson", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def test_cli_train_prints_the_seed_lines_and_writes_out(tmp_path):
    out = tmp_path / "run"
    result = cli("train", "--steps", "20", "--log-every", "10", "--out", str(out))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("step: 0, loss 3.29")
    assert [line.split(",")[0] for line in lines[:3]] == ["step: 0", "step: 10", "step: 19"]
    assert lines[3].startswith("Final validation loss: ")
    assert sum("  --> " in line for line in lines) == 10
    history = json.loads((out / "history.json").read_text())
    assert len(history["losses"]) == 20 and history["world_size"] == 1
    assert history["memory"][0]["peak"]["params"] == 18_635 * 4
    params = np.load(out / "params.npz")
    assert sorted(params.files) == ["emb.W", "fc1.W", "fc1.b", "fc2.W", "fc2.b"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "-3"], "--steps: must be 0 or more, got -3"),
        (["--lr", "-1"], "--lr: must be a positive finite number"),
        (["--strategy", "zero9"], "invalid choice: 'zero9'"),
        (["--optimizer", "lbfgs"], "invalid choice: 'lbfgs'"),
        (["--hidden", "x"], "'x' is not an integer"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--data", "/nonexistent/names.txt"], "no such file"),
        (["--data", "."], "is a directory"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args, message):
    result = cli("train", "--steps", "5", *args) if args[0] != "--steps" else cli("train", *args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_steps_zero_initialises_evaluates_and_exits():
    result = cli("train", "--steps", "0", "--eval-batches", "1", "--samples", "1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("Final validation loss: ") and len(lines) == 2


def test_no_validation_is_said_not_printed_as_zero():
    result = cli("train", "--steps", "2", "--eval-batches", "0", "--samples", "0")
    assert result.returncode == 0, result.stderr
    assert "no validation (--eval-batches 0)" in result.stdout
    assert "Final validation loss" not in result.stdout
