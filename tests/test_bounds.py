"""Issue 35's unbounded inputs: sizes, names and tampered checkpoints refused in one line, before
anything is built or read whole.

Each CLI case runs under a CPU-time and an address-space limit (resource limits, not wall-clock
time, which a busy machine moves): the old code took minutes of CPU (a dry run writing every
element, a setup quadratic in the layers) or gigabytes (a model of 10^8 layers, an array read
whole), so it fails here; a bounded refusal takes a fraction of a second and ~50 MB.
"""

import resource
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
from test_limits import resign  # a checkpoint manifest edited and signed again

from fsdp_lesson.bounds import layers_with_parameters, parameter_count
from fsdp_lesson.checkpoint import rank_file
from fsdp_lesson.config import ModelConfig, RunConfig, TrainConfig
from fsdp_lesson.data import DataError, Dataset
from fsdp_lesson.model import MLP
from fsdp_lesson.train import run

CPU_SECONDS = 20  # a bounded refusal takes well under 1 s of CPU, the old code minutes
ADDRESS_SPACE = 2**30  # bytes: python and numpy fit; a 1 GiB array does not
TRAIN = [sys.executable, "-m", "fsdp_lesson", "train"]


def limited() -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (CPU_SECONDS, CPU_SECONDS))
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def bounded(command: list[str]) -> subprocess.CompletedProcess:
    """Run command under the limits (SIGXCPU or a MemoryError if it is not bounded)."""
    return subprocess.run(command, capture_output=True, text=True, timeout=300, preexec_fn=limited)


def one_line(result: subprocess.CompletedProcess, text: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert text in result.stderr, result.stderr[-2000:]
    assert result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and "unexpected" not in result.stderr


# --- model sizes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config", [ModelConfig(), ModelConfig(layers=3, hidden=7, emb=5), ModelConfig(hidden=1)]
)
def test_the_parameter_count_is_the_models(config):
    assert parameter_count(config) == MLP(config).num_params
    count, names = layers_with_parameters(config)
    assert count == sum(1 for layer in MLP(config).layers if layer.shapes)
    assert names.split(", ")[:2] == ["emb", "fc1"] and names.endswith(f"fc{config.layers + 1}")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hidden", "1000000000"], "(the model's 2.84e+11 parameters in float32"),
        (["--emb", "100000000000000000000"], "(the model's 1.05e+23 parameters in float32"),
        (["--layers", "100000000"], "(the model's 4.16e+11 parameters in float32"),
        (["--layers", "1000", "--memory-budget-mb", "1"], "more than the budget of 1 MiB"),
        (["--layers", "100000000", "--layers-per-unit", "1000000000"], "100000002 layers"),
    ],
)
def test_a_model_that_cannot_fit_is_refused_before_it_is_built(args, message):
    result = bounded([*TRAIN, *args, "--steps", "1"])
    one_line(result, message)


def test_a_layer_quadratic_setup_is_gone(tmp_path):
    """1000 layers pass the bound (16 MiB of parameters) and reach the exact prediction, whose
    setup asked every layer's entries once per layer (187 s): now one entry per layer."""
    result = bounded([*TRAIN, "--layers", "1000", "--memory-budget-mb", "20", "--steps", "1"])
    one_line(result, "predicted before allocating anything), more than the budget of 20 MiB")


def test_plan_of_a_trillion_gpus_is_bounded_and_of_more_than_floats_hold_refused():
    plan = [sys.executable, "-m", "fsdp_lesson", "plan"]
    trillion = bounded([*plan, "--gpus", str(10**12)])
    assert trillion.returncode == 0, trillion.stderr
    assert "meshes of 1000000000000 GPUs" in trillion.stdout
    huge = bounded([*plan, "--gpus", str(10**20)])
    assert huge.returncode == 2 and "--gpus has 21 digits" in huge.stderr, huge.stderr


# --- a bad name is quoted short ----------------------------------------------------------------


@pytest.mark.parametrize("name", ["a" * 5_000_000, "a" * 5_000_000 + "7"])
def test_a_long_bad_name_is_quoted_as_an_excerpt(tmp_path, name):
    path = tmp_path / "names.txt"
    path.write_text(f"emma\n{name}\n")
    with pytest.raises(DataError) as info:
        Dataset.load(path)
    message = str(info.value)
    assert len(message) < 300, message[:300]
    assert "line 2" in message and "5,000,00" in message
    assert "seq_len" not in message  # no flag sets it


# --- tampered checkpoints ------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A single-rank checkpoint after 2 steps of Adam, copied fresh for each test."""
    where = tmp_path_factory.mktemp("saved") / "c"
    config = TrainConfig(optimizer="adam", steps=2, eval_batches=0, samples=0)
    run(ModelConfig(), config, RunConfig(save_every=2, checkpoint_dir=where))
    return where


@pytest.fixture
def checkpoint(saved, tmp_path) -> Path:
    copy = tmp_path / "c"
    copy.mkdir()
    for f in saved.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    return copy


def resume(checkpoint: Path, *extra: str) -> subprocess.CompletedProcess:
    args = ["--optimizer", "adam", "--steps", "4", "--eval-batches", "0", "--samples", "0"]
    return bounded([*TRAIN, *args, "--resume", str(checkpoint), *extra])


def rewrite_member(shard: Path, name: str, write) -> None:
    """Replace one member of a rank's .npz (kept as it is otherwise): write(f) writes it."""
    members = {}
    with zipfile.ZipFile(shard) as z:
        for info in z.infolist():
            if info.filename != name:
                members[info.filename] = z.read(info)
    with zipfile.ZipFile(shard, "w", zipfile.ZIP_DEFLATED) as z:
        for member, data in members.items():
            z.writestr(member, data)
        with z.open(name, "w", force_zip64=True) as f:
            write(f)


def npy_header(f, shape) -> None:
    np.lib.format.write_array_header_1_0(
        f, {"descr": "<f4", "fortran_order": False, "shape": shape}
    )


def test_an_rng_state_too_big_for_its_generator_is_refused(checkpoint):
    resign(checkpoint, lambda m: m | {"rng": m["rng"] | {"state": {"state": 2**300, "inc": 1}}})
    one_line(resume(checkpoint), "its RNG state cannot be restored")


def test_a_shard_header_of_a_terabyte_is_refused_from_the_header(checkpoint):
    shard = checkpoint / rank_file(0, 1)
    rewrite_member(
        shard, "fc1.params.npy", lambda f: (npy_header(f, (2**40,)), f.write(b"\0" * 64))
    )
    resign(checkpoint, files=[shard.name])
    one_line(resume(checkpoint), "fc1.params is float32 of shape (1099511627776,)")


def test_a_small_shard_that_inflates_to_a_gibibyte_is_never_inflated(checkpoint):
    shard = checkpoint / rank_file(0, 1)

    def gibibyte(f) -> None:
        npy_header(f, (2**28,))
        zeros = bytes(2**20)
        for _ in range(2**10):
            f.write(zeros)

    rewrite_member(shard, "fc1.params.npy", gibibyte)
    assert shard.stat().st_size < 2**21  # ~1 MB on the disk
    resign(checkpoint, files=[shard.name])
    one_line(resume(checkpoint), "fc1.params is float32 of shape (268435456,) in 1,073,741,952")


@pytest.mark.parametrize(
    "layout, message",
    [
        ({"tp": 10**9, "pp": -5}, "'pp' is -5, not a positive integer"),
        ({"tp": 10**9}, "'tp' 1000000000 x 'pp' 1 does not divide its world_size 1"),
    ],
)
def test_a_tampered_layout_is_refused_even_with_reshard(checkpoint, layout, message):
    resign(checkpoint, lambda m: m | {"train_config": m["train_config"] | layout})
    one_line(resume(checkpoint, "--reshard"), message)


def test_a_rank_file_without_a_layer_it_wrote_is_damaged_not_another_optimizer(checkpoint):
    """The manifest says rank 0 wrote fc2 (as a pipeline rank writes its stage's layers), but
    its file holds none of it: a damaged checkpoint, not 'resume with the same optimizer'."""
    shard = checkpoint / rank_file(0, 1)
    arrays = {k: v for k, v in np.load(shard).items() if not k.startswith("fc2.")}
    with open(shard, "wb") as f:
        np.savez(f, **arrays)
    resign(checkpoint, files=[shard.name])
    result = resume(checkpoint)
    one_line(result, "holds no slice of fc2, which the manifest says it does")
    assert "optimizer" not in result.stderr
