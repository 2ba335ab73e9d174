"""Sharded checkpoints: bit-identical resume, resharding between strategies and N, bad files."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fsdp_lesson.checkpoint import CheckpointError, read_manifest
from fsdp_lesson.config import ConfigError, ModelConfig, RunConfig, TrainConfig
from fsdp_lesson.data import Dataset
from fsdp_lesson.train import run

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from checkpoint_worker import SAVE_AT, STEPS  # noqa: E402

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
STRATEGIES = ["dp", "zero1", "zero2", "zero3"]


@pytest.fixture(scope="module")
def data():
    return Dataset.load()


def small(**kw) -> TrainConfig:
    return TrainConfig(**({"steps": 40, "eval_batches": 2, "samples": 2} | kw))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
@pytest.mark.parametrize("c_compat", [False, True])
def test_resume_is_bit_identical_to_a_run_that_never_stopped(tmp_path, data, optimizer, c_compat):
    config = small(optimizer=optimizer, c_compat=c_compat)
    straight, s1 = run(ModelConfig(), config, data=data)
    run(
        ModelConfig(),
        small(optimizer=optimizer, c_compat=c_compat, steps=20),
        RunConfig(save_every=10, checkpoint_dir=tmp_path / "ckpt"),
        data=data,
    )
    resumed, s2 = run(ModelConfig(), config, RunConfig(resume=tmp_path / "ckpt"), data=data)
    for layer, p in s1.full_params().items():
        for k, v in p.items():
            assert v.tobytes() == s2.full_params()[layer][k].tobytes(), f"{layer}.{k}"
    assert np.array_equal(straight.losses, resumed.losses)  # the checkpoint carries 0..19
    assert np.isnan(resumed.step_seconds[:20]).all()
    assert straight.samples == resumed.samples and straight.val_loss == resumed.val_loss


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("strategy", ["single", "zero3"])
def test_mixed_precision_resumes_bit_identically(tmp_path, data, precision, strategy):
    """The fp32 master is saved, the 16-bit copy derived from it; fp16's loss scale and its
    run of good steps are saved too (a resumed run doubles the scale when one that never
    stopped would)."""
    config = small(strategy=strategy, optimizer="adam", precision=precision, steps=60)
    straight, s1 = run(ModelConfig(), config, data=data)
    half = small(strategy=strategy, optimizer="adam", precision=precision, steps=30)
    run(ModelConfig(), half, RunConfig(save_every=30, checkpoint_dir=tmp_path / "c"), data=data)
    resumed, s2 = run(ModelConfig(), config, RunConfig(resume=tmp_path / "c"), data=data)
    for key, entry in s1.local_state().items():
        assert entry.array.tobytes() == s2.local_state()[key].array.tobytes(), key
    assert np.array_equal(straight.losses, resumed.losses)
    assert straight.skipped_steps == resumed.skipped_steps
    if precision == "fp16":
        scaler1, scaler2 = s1.precision.scaler, s2.precision.scaler
        assert (scaler2.scale, scaler2.good_steps) == (scaler1.scale, 60)
    with pytest.raises(CheckpointError, match="precision"):  # another precision is refused
        run(ModelConfig(), small(steps=60), RunConfig(resume=tmp_path / "c"), data=data)


def saved(tmp_path, data, **kw) -> Path:
    run(
        ModelConfig(),
        small(steps=10, **kw),
        RunConfig(save_every=10, checkpoint_dir=tmp_path / "c"),
        data=data,
    )
    return tmp_path / "c"


def test_a_corrupted_shard_is_refused(tmp_path, data):
    ckpt = saved(tmp_path, data)
    shard = next(ckpt.glob("rank*.npz"))
    shard.write_bytes(shard.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(CheckpointError, match="missing or corrupted"):
        run(ModelConfig(), small(), RunConfig(resume=ckpt), data=data)


def test_another_model_or_optimizer_is_refused(tmp_path, data):
    ckpt = saved(tmp_path, data)
    with pytest.raises(CheckpointError, match="another model"):
        run(ModelConfig(hidden=32), small(), RunConfig(resume=ckpt), data=data)
    with pytest.raises(CheckpointError, match="'optimizer': 'sgd'"):
        run(ModelConfig(), small(optimizer="adam"), RunConfig(resume=ckpt), data=data)
    with pytest.raises(CheckpointError, match="with --reshard the global batch may change"):
        run(ModelConfig(), small(batch=16), RunConfig(resume=ckpt), data=data)


def test_the_default_lr_spelled_out_resumes(tmp_path, data):
    ckpt = saved(tmp_path, data)  # lr left to the default
    history, _ = run(ModelConfig(), small(lr=0.1, steps=12), RunConfig(resume=ckpt), data=data)
    assert history.resumed_from["step"] == 10


def test_another_strategy_needs_reshard(tmp_path, data):
    ckpt = saved(tmp_path, data)  # saved by single
    with pytest.raises(CheckpointError, match="pass --reshard"):
        run(ModelConfig(), small(strategy="zero3"), RunConfig(resume=ckpt), data=data)


def test_a_half_written_checkpoint_is_not_one(tmp_path, data):
    ckpt = saved(tmp_path, data)
    (ckpt / "manifest.json").unlink()  # as if the save stopped before writing it
    with pytest.raises(CheckpointError, match="no manifest.json"):
        read_manifest(ckpt)


def test_manifest_lists_every_file_with_its_checksum(tmp_path, data):
    manifest = json.loads((saved(tmp_path, data) / "manifest.json").read_text())
    assert (
        manifest["strategy"] == "single" and manifest["world_size"] == 1 and manifest["step"] == 10
    )
    assert list(manifest["files"]) == ["rank00000-of-00001.npz", "losses.npy"]
    assert all(len(digest) == 64 for digest in manifest["files"].values())


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    """Save at N=4 with every strategy; resume every checkpoint into every strategy at 4, 3, 2."""
    root = tmp_path_factory.mktemp("ckpt")
    for n, mode in [(4, "save"), (4, "resume"), (3, "resume"), (2, "resume")]:
        result = subprocess.run(
            [
                MPIEXEC,
                "-n",
                str(n),
                sys.executable,
                str(HERE / "checkpoint_worker.py"),
                mode,
                str(root),
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-3000:]
    return root


def load(path: Path) -> dict:
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.mark.mpi
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_at_the_same_n_is_bit_identical(resharded, strategy):
    straight = load(resharded / f"straight-{strategy}-N4.npz")
    resumed = load(resharded / f"resumed-{strategy}-to-{strategy}-N4.npz")
    for key in straight:
        if key != "losses":
            assert straight[key].tobytes() == resumed[key].tobytes(), key
    assert np.array_equal(straight["losses"][SAVE_AT:], resumed["losses"][SAVE_AT:])


@pytest.mark.mpi
@pytest.mark.parametrize("n", [4, 3, 2, 1])
def test_resharding_every_strategy_pair_trains_on_equivalently(resharded, data, n):
    config = TrainConfig(
        strategy="single", optimizer="adam", batch=24, steps=STEPS, eval_batches=2, samples=1
    )
    reference, s = run(ModelConfig(), config, data=data)
    expected = {f"{layer}.{k}": v for layer, p in s.full_params().items() for k, v in p.items()}
    for source in STRATEGIES:
        if n == 1:  # into single, in this process
            h, s1 = run(
                ModelConfig(), config, RunConfig(resume=resharded / source, reshard=True), data=data
            )
            params = {
                f"{layer}.{k}": v for layer, p in s1.full_params().items() for k, v in p.items()
            }
            results = {"single": params | {"losses": h.losses}}
        else:
            results = {t: load(resharded / f"resumed-{source}-to-{t}-N{n}.npz") for t in STRATEGIES}
        for target, got in results.items():
            for key, want in expected.items():
                diff = np.abs(got[key] - want).max()
                assert diff <= 1e-5, f"{source}@4 -> {target}@{n}: {key} differs by {diff:.1e}"
            loss_diff = np.abs(got["losses"][SAVE_AT:] - reference.losses[SAVE_AT:]).max()
            assert loss_diff <= 1e-5, f"{source}@4 -> {target}@{n}: loss differs by {loss_diff:.1e}"


def test_paths_given_as_strings_work_as_paths(tmp_path, data):
    """RunConfig takes str paths (a notebook passes str(...) to its engines): the refusal of
    an existing checkpoint names the directory instead of failing on str.parent."""
    where = str(tmp_path / "c")
    run(ModelConfig(), small(steps=10), RunConfig(save_every=10, checkpoint_dir=where), data=data)
    with pytest.raises(ConfigError, match="--resume"):
        run(
            ModelConfig(),
            small(steps=10),
            RunConfig(save_every=10, checkpoint_dir=where),
            data=data,
        )
    resumed, _ = run(ModelConfig(), small(steps=20), RunConfig(resume=where), data=data)
    assert resumed.resumed_from["step"] == 10
