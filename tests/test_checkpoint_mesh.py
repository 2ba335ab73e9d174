"""Checkpoints of every mesh (issue 25): a checkpoint saved by any (tp, pp, dp, strategy) is
resumed by any other, by plain runs, and the reverse; training goes on as if it never stopped.
Format 4 (before meshes) is still read; damaged or foreign checkpoints are still refused."""

import hashlib
import json
import re
import shutil
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from checkpoint_mesh_worker import COMMON, SAVE_AT, STEPS  # noqa: E402
from mpi_helpers import ROOT, mpiexec  # noqa: E402

from fsdp_lesson.checkpoint import CheckpointError, rank_file, read_manifest  # noqa: E402
from fsdp_lesson.config import ModelConfig, RunConfig, TrainConfig  # noqa: E402
from fsdp_lesson.data import Dataset, sha256_of  # noqa: E402
from fsdp_lesson.train import run  # noqa: E402


@cache
def data() -> Dataset:
    return Dataset.load()


@cache
def single(optimizer: str):
    """Single-rank training of STEPS steps that never stopped: (losses, whole params)."""
    history, strategy = run(ModelConfig(), config(optimizer=optimizer), data=data())
    params = {
        f"{layer}.{k}": v for layer, p in strategy.full_params().items() for k, v in p.items()
    }
    return history.losses, params


def config(steps: int = STEPS, **settings) -> TrainConfig:
    return TrainConfig(steps=steps, **COMMON | settings)


def load(path: Path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def meshes(tmp_path_factory) -> Path:
    """The worker's jobs at N = 4 (saves A: tp 2 zero3, B: pp 2 sgd), N = 8 (saves C: tp 2 x
    pp 2 x dp 2), N = 2 (resumes them and P, which single saves here, into other meshes)."""
    root = tmp_path_factory.mktemp("meshes")
    for n in (4, 8, 2):
        if n == 2:  # P: a plain checkpoint for a mesh to resume
            saving = RunConfig(save_every=SAVE_AT, checkpoint_dir=root / "P")
            run(ModelConfig(), config(SAVE_AT, optimizer="adam"), saving, data=data())
        result = mpiexec(n, str(ROOT / "tests" / "checkpoint_mesh_worker.py"), str(root))
        assert result.returncode == 0, result.stderr[-3000:]
    return root


def assert_trains_on_as_single(what: str, got: dict, optimizer: str) -> None:
    """Every step's loss and the final whole parameters equal single's within 1e-5."""
    losses, params = single(optimizer)
    loss_diff = np.abs(got["losses"] - losses).max()
    assert loss_diff <= 1e-5, f"{what}: loss differs by {loss_diff:.1e}"
    for key, want in params.items():
        diff = np.abs(got[key] - want).max()
        assert diff <= 1e-5, f"{what}: {key} differs by {diff:.1e}"


RESUMED = {  # the worker's result -> its optimizer (A, C: adam; B: sgd)
    "A-to-dp2": "adam",  # tp 2 zero3 @ 4 -> zero1 @ 2
    "A-to-tp2-pp2-dp2": "adam",  # tp 2 zero3 @ 4 -> tp 2 x pp 2 x dp 2 zero2 @ 8
    "B-to-tp2": "sgd",  # pp 2 zero1 @ 4 -> tp 2 single @ 2
    "C-to-zero3": "adam",  # tp 2 x pp 2 x dp 2 zero2 @ 8 -> zero3 @ 2
    "P-to-tp2": "adam",  # single @ 1 -> tp 2 single @ 2
    "A2-to-units-of-3": "adam",  # tp 2 zero3 units of 2 layers @ 4 -> units of 3 @ 2
    "H-same": "adam",  # zero3 --replicate 2 @ 4 -> the same
    "H-to-zero3": "adam",  # zero3 --replicate 2 @ 4 -> zero3 @ 2
    "A-to-hsdp": "adam",  # tp 2 zero3 @ 4 -> zero3 --replicate 4 @ 8 (groups of 2)
}


@pytest.mark.mpi
@pytest.mark.parametrize("name", list(RESUMED))
def test_a_checkpoint_resumed_on_another_mesh_trains_on_as_single(meshes, name):
    assert_trains_on_as_single(name, load(meshes / f"{name}.npz"), RESUMED[name])


@pytest.mark.mpi
@pytest.mark.parametrize("mesh", ["A", "H"])  # tp 2 zero3; zero3 --replicate 2 (HSDP)
def test_the_same_mesh_resumes_bit_identically(meshes, mesh):
    straight, resumed = load(meshes / f"{mesh}-straight.npz"), load(meshes / f"{mesh}-same.npz")
    for key, want in straight.items():
        assert want.tobytes() == resumed[key].tobytes(), key


@pytest.mark.mpi
@pytest.mark.parametrize("source, optimizer", [("B", "sgd"), ("C", "adam")])
def test_a_mesh_checkpoint_resumes_on_one_rank(meshes, source, optimizer):
    rc = RunConfig(resume=meshes / source, reshard=True)
    history, strategy = run(ModelConfig(), config(optimizer=optimizer), rc, data=data())
    params = {
        f"{layer}.{k}": v for layer, p in strategy.full_params().items() for k, v in p.items()
    }
    assert_trains_on_as_single(
        f"{source} -> single", params | {"losses": history.losses}, optimizer
    )


@pytest.mark.mpi
def test_the_manifest_lists_every_whole_layer_once_with_its_writers(meshes):
    manifest = read_manifest(meshes / "C")
    stage_0, stage_1 = [0, 1, 2, 3], [4, 5, 6, 7]  # tp 2 x dp 2 ranks each (mesh.py)
    assert manifest["world_size"] == 8 and manifest["format"] == 5
    assert manifest["layers"] == {
        "emb": {"shapes": {"W": [27, 16]}, "ranks": stage_0},
        "fc1": {"shapes": {"W": [256, 64], "b": [64]}, "ranks": stage_0},
        "relu1": {"shapes": {}, "ranks": stage_0},
        "fc2": {"shapes": {"W": [64, 27], "b": [27]}, "ranks": stage_1},
    }
    with np.load(meshes / "C" / rank_file(5, 8)) as f:  # a slice of fc2 (1755) of 4 ranks
        assert {k: f[k].shape for k in f.files} == {
            f"fc2.{w}": (439,) for w in "params m v".split()
        }


@pytest.mark.mpi
def test_a_mesh_checkpoint_is_refused_without_reshard_or_damaged(meshes, tmp_path):
    with pytest.raises(CheckpointError, match="saved by zero2 with --tp 2 --pp 2 on 8 ranks, this"):
        adam = config(strategy="zero2", optimizer="adam")
        run(ModelConfig(), adam, RunConfig(resume=meshes / "C"), data=data())
    damaged = tmp_path / "C"
    shutil.copytree(meshes / "C", damaged)
    path = damaged / rank_file(5, 8)
    path.write_bytes(path.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(CheckpointError, match="missing or corrupted"):
        run(ModelConfig(), adam, RunConfig(resume=damaged, reshard=True), data=data())


@pytest.mark.mpi
def test_a_refusal_on_one_stage_is_every_ranks(meshes, tmp_path):
    """Only stage 1 reads fc2's slices: one of the wrong length (signed anew) is refused by
    both stages, not by stage 1 alone while stage 0 waits for it."""
    ckpt = tmp_path / "B"
    shutil.copytree(meshes / "B", ckpt)
    shard = ckpt / rank_file(2, 4)
    arrays = load(shard)
    np.savez(shard, **arrays | {"fc2.params": arrays["fc2.params"][:-3]})
    rewrite_manifest(ckpt, lambda m: m | {"files": m["files"] | {shard.name: sha256_of(shard)}})
    flags = ["--pp", "2", "--micro-batches", "2", "--optimizer", "sgd", "--batch", "24"]
    flags += ["--steps", "8", "--eval-batches", "0", "--samples", "0"]
    result = mpiexec(2, "-m", "fsdp_lesson", "train", *flags, "--resume", str(ckpt), "--reshard")
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{shard} is a damaged checkpoint" in result.stderr, result.stderr[-3000:]
    assert "(on rank 1)" in result.stderr and "Traceback" not in result.stderr


# --- on one rank: zero3's units, format 4, a foreign manifest ---------------------------------


def saved(where: Path, **settings) -> Path:
    rc = RunConfig(save_every=SAVE_AT, checkpoint_dir=where)
    run(ModelConfig(), config(SAVE_AT, optimizer="adam", **settings), rc, data=data())
    return where


def rewrite_manifest(ckpt: Path, edit) -> None:
    """Edit the manifest and sign it again (manifest.sha256), as a foreign writer would."""
    text = json.dumps(edit(json.loads((ckpt / "manifest.json").read_text()))).encode()
    (ckpt / "manifest.json").write_bytes(text)
    (ckpt / "manifest.sha256").write_text(hashlib.sha256(text).hexdigest())


def test_zero3_units_are_saved_as_layers_and_resumed_into_any_units(tmp_path):
    ckpt = saved(tmp_path / "c", strategy="zero3", layers_per_unit=2)
    assert list(read_manifest(ckpt)["layers"]) == ["emb", "fc1", "relu1", "fc2"]
    for settings in (dict(strategy="single"), dict(strategy="zero3", layers_per_unit=3)):
        rc = RunConfig(resume=ckpt, reshard=True)
        history, s = run(ModelConfig(), config(optimizer="adam", **settings), rc, data=data())
        params = {f"{layer}.{k}": v for layer, p in s.full_params().items() for k, v in p.items()}
        assert_trains_on_as_single(str(settings), params | {"losses": history.losses}, "adam")


def as_format_4(manifest: dict) -> dict:
    """What the version before meshes wrote: each layer's shapes, no writers."""
    layers = {name: entry["shapes"] for name, entry in manifest["layers"].items()}
    return manifest | {"format": 4, "layers": layers}


def test_a_format_4_checkpoint_resumes_bit_identically(tmp_path):
    straight, s1 = run(ModelConfig(), config(optimizer="adam"), data=data())
    ckpt = saved(tmp_path / "c")
    rewrite_manifest(ckpt, as_format_4)
    resumed, s2 = run(ModelConfig(), config(optimizer="adam"), RunConfig(resume=ckpt), data=data())
    assert np.array_equal(straight.losses, resumed.losses)
    for key, entry in s1.local_state().items():
        assert entry.array.tobytes() == s2.local_state()[key].array.tobytes(), key


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda m: as_format_4(m) | {"train_config": m["train_config"] | {"layers_per_unit": 2}},
            "format 4 with --layers-per-unit 2 saves units, not layers: resume it with the version",
        ),
        (
            lambda m: m | {"layers": m["layers"] | {"fc2": {"shapes": {}, "ranks": [1]}}},
            "layer 'fc2' is {'shapes': {}, 'ranks': [1]}, not its shapes and the ranks that",
        ),
        (lambda m: m | {"format": 3}, "format 3, this version reads formats 4 and 5"),
    ],
)
def test_a_foreign_manifest_is_refused(tmp_path, edit, message):
    ckpt = saved(tmp_path / "c", strategy="zero3")
    rewrite_manifest(ckpt, edit)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        read_manifest(ckpt)
