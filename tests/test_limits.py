"""Limits: runs too big for the machine refused before allocating, final files that are never
torn, validation that stays bounded, and the messages of issue 22.

Every case runs the real CLI (under mpiexec where ranks matter) with a timeout and checks what
a user sees: the exit code, one line on stderr, no traceback, nothing left running.
"""

import contextlib
import hashlib
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import psutil
import pytest
from mpi_helpers import error_when_rank_2_is_killed

from fsdp_lesson.admission import predicted_peak
from fsdp_lesson.checkpoint import CheckpointError, rank_file, read_manifest
from fsdp_lesson.config import ConfigError, ModelConfig, RunConfig, TrainConfig
from fsdp_lesson.data import DEFAULT_PATH, Dataset, load_bytes
from fsdp_lesson.train import run

HERE = Path(__file__).parent
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
TRAIN = [sys.executable, "-m", "fsdp_lesson", "train"]
QUIET = ["--eval-batches", "1", "--samples", "0"]


def cli(args, ranks=2, timeout=60, **kwargs) -> subprocess.CompletedProcess:
    prefix = [MPIEXEC, "-n", str(ranks)] if ranks > 1 else []
    return subprocess.run(
        [*prefix, *TRAIN, *args], capture_output=True, text=True, timeout=timeout, **kwargs
    )


def one_clean_line(result, text: str) -> None:
    assert result.returncode == 2, result.stderr
    assert result.stderr.count(text) == 1, result.stderr
    assert result.stderr.count("\n") == 1, result.stderr  # one line, the same on every rank
    assert "Traceback" not in result.stderr, result.stderr


def resign(ckpt: Path, edit=None, files=()) -> None:
    """Edit a checkpoint's manifest and sign it again, as someone who means it would: the
    digests of `files` (rewritten) and the manifest's own checksum match again."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for name in files:
        manifest["files"][name] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    text = json.dumps(edit(manifest) if edit else manifest).encode()
    (ckpt / "manifest.json").write_bytes(text)
    (ckpt / "manifest.sha256").write_text(hashlib.sha256(text).hexdigest())


@pytest.fixture(scope="module")
def data():
    return Dataset.load()


@pytest.fixture
def checkpoint(tmp_path, data) -> Path:
    """A single-rank checkpoint after 4 steps of Adam."""
    config = TrainConfig(optimizer="adam", steps=4, eval_batches=1, samples=0)
    run(ModelConfig(), config, RunConfig(save_every=4, checkpoint_dir=tmp_path / "c"), data=data)
    return tmp_path / "c"


# --- 1. the memory check counts the micro-batches and the dataset -----------------------------


@pytest.mark.parametrize(
    "args, ranks, message",
    [
        (  # 10^9 micro-batches: ~1 TB of batch indices; it used to die allocating 238 GiB
            ["--accum", "1000000000", "--steps", "1"],
            1,
            "lower --accum or --batch (32 x 1,000,000,000 rows a step",
        ),
        (  # 10^7: 10 GB a rank; it used to run out of memory after a minute of np.split
            ["--strategy", "dp", "--accum", "10000000", "--steps", "1"]
            + ["--memory-budget-mb", "1000"],
            2,
            "more than the budget of 1000 MiB: lower --accum or --batch",
        ),
    ],
)
def test_micro_batches_are_counted_before_allocating(args, ranks, message):
    result = cli(args, ranks=ranks)  # allocating first would run out of memory (or time)
    one_clean_line(result, "predicted before allocating anything")
    assert message in result.stderr


def test_a_names_file_too_big_to_load_is_refused_before_reading_it(tmp_path):
    big = tmp_path / "names.txt"
    with open(big, "wb") as f:
        f.truncate(2**40)  # 1 TiB of holes: written at once, and never read by the refusal
    # reading 1 TiB, even of holes, would take far longer than cli's timeout (60 s)
    result = cli(["--strategy", "dp", "--steps", "1", "--data", str(big), *QUIET])
    one_clean_line(result, "predicted before allocating anything; loading")
    assert f"{big} (1,099,511,627,776 bytes) takes up to" in result.stderr
    assert "use a smaller names file (--data), or fewer ranks on this machine" in result.stderr


@pytest.mark.parametrize("lines", ["one-letter", "the lesson's"])
def test_the_dataset_bound_holds_what_loading_takes(tmp_path, lines):
    """load_bytes bounds Dataset.load's peak from the file's size alone: for the worst file
    (names of one letter) and within 2x of it for the usual names."""
    path = DEFAULT_PATH
    if lines == "one-letter":
        path = tmp_path / "a.txt"
        path.write_text("a\nb\n" * 50_000)
    peak, kept = load_bytes(path)
    tracemalloc.start()
    try:
        dataset = Dataset.load(path)
        measured = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert measured <= peak, f"loading took {measured:,} bytes, {peak:,} were predicted"
    if lines == "the lesson's":
        assert peak <= 2 * measured, f"{peak:,} predicted for {measured:,}"
    arrays = (dataset.X_train, dataset.Y_train, dataset.X_test, dataset.Y_test)
    assert sum(a.nbytes for a in arrays) <= kept


def test_the_prediction_holds_a_step_of_many_micro_batches(data):
    """What a step's batch takes (every index, this rank's rows, np.split's micro-batches) is
    in the prediction: tracemalloc's peak of a run stays below it, and near it."""
    config = TrainConfig(accum=800, batch=128, steps=1, eval_batches=0, samples=0)
    history, _ = run(ModelConfig(), config, RunConfig(trace_memory=True), data=data)
    measured = history.memory["tracemalloc_peak"]
    predicted = predicted_peak("single", ModelConfig(), config, 1)
    assert 0.6 * predicted <= measured <= predicted, (measured, predicted)


@pytest.mark.timeout(60)  # the dry run runs three micro-batches, which stand for them all
def test_predicting_a_step_of_a_billion_micro_batches_runs_three():
    for strategy in ("dp", "zero2", "zero3"):
        predicted_peak(strategy, ModelConfig(), TrainConfig(strategy=strategy, accum=10**9), 2)


# --- 2. the final files are written as checkpoints are: whole, or not at all ------------------


def assert_nothing_torn(out: Path) -> None:
    """The files of an earlier run are untouched, and no temporary is left."""
    assert (out / "history.json").read_text() == "earlier"
    assert (out / "params.npz").read_text() == "earlier"
    assert sorted(p.name for p in out.iterdir()) == ["history.json", "params.npz"]


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (root only), unmounted afterwards, even when the test fails."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True, timeout=30)


def test_a_full_disk_at_the_final_write_is_exit_2_and_tears_nothing(small_disk):
    """ENOSPC for real: the 75 KB params.npz does not fit in what the disk has left."""
    out = small_disk / "run"
    out.mkdir()
    for name in ("history.json", "params.npz"):
        (out / name).write_text("earlier")
    (small_disk / "filler").write_bytes(b"\0" * (256 - 48) * 1024)  # 48 KiB left
    result = cli(["--strategy", "dp", "--steps", "2", "--out", str(out), *QUIET])
    one_clean_line(
        result,
        f"error: no space left on device writing {out}/params.npz: free space or choose "
        f"another --out",
    )
    assert_nothing_torn(out)
    (small_disk / "filler").unlink()  # with room, the same run writes both files
    done = cli(["--strategy", "dp", "--steps", "2", "--out", str(out), *QUIET])
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "history.json").read_text())["world_size"] == 2
    assert len(np.load(out / "params.npz").files) == 5  # emb.E, fc1.W, fc1.b, fc2.W, fc2.b


def test_a_file_size_limit_at_the_final_write_is_exit_2_and_tears_nothing(tmp_path):
    """EFBIG, without root: the process may write no file larger than 40 KiB (RLIMIT_FSIZE)."""
    out = tmp_path / "run"
    out.mkdir()
    for name in ("history.json", "params.npz"):
        (out / name).write_text("earlier")

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (40 * 1024, 40 * 1024))

    env = os.environ | {"PYTHONDONTWRITEBYTECODE": "1"}
    result = cli(["--steps", "2", "--out", str(out), *QUIET], 1, preexec_fn=limit, env=env)
    one_clean_line(
        result, f"error: file too large writing {out}/params.npz: free space or choose another"
    )
    assert_nothing_torn(out)


# --- 3. validation is bounded ---------------------------------------------------------------


def test_a_resigned_manifest_of_a_billion_ranks_is_refused_at_once(checkpoint):
    resign(checkpoint, lambda m: m | {"world_size": 10**9})
    start = time.monotonic()
    with pytest.raises(CheckpointError) as info:
        read_manifest(checkpoint)
    assert time.monotonic() - start < 30  # it built 10^9 file names first (minutes); now: ms
    assert "world_size 1000000000, but it lists 1 shard files and the directory holds 1" in str(
        info.value
    )
    result = cli(["--steps", "8", "--resume", str(checkpoint), *QUIET], ranks=1)
    one_clean_line(result, "world_size 1000000000, but it lists 1 shard files")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda m: m | {"optimizer_steps": 10**30}, "is more than its 4 steps"),
        (lambda m: m | {"strategy": "zero9"}, "'strategy' 'zero9' is none of"),
        (
            lambda m: m | {"train_config": m["train_config"] | {"layers_per_unit": 0}},
            "'layers_per_unit' is 0, not a positive integer",
        ),
        (lambda m: m | {"loss_scaler": {"scale": 1e400, "good_steps": 0}}, "'loss_scaler' is"),
        (lambda m: m | {"rng": {"glibc_ring": [1] * 10**5, "glibc_pos": 0}}, "RNG state"),
    ],
)
def test_out_of_range_manifest_fields_are_refused(checkpoint, data, edit, message):
    resign(checkpoint, edit)
    config = TrainConfig(optimizer="adam", steps=8, eval_batches=1, samples=0)
    with pytest.raises(CheckpointError, match=re.escape(message)):
        run(ModelConfig(), config, RunConfig(resume=checkpoint), data=data)


def test_data_check_refuses_what_is_not_a_regular_file(tmp_path):
    command = [sys.executable, "-m", "fsdp_lesson", "data", "check", "--path"]
    zero = subprocess.run([*command, "/dev/zero"], capture_output=True, text=True, timeout=30)
    one_clean_line(zero, "/dev/zero is not a regular file; --path wants a names file")
    here = subprocess.run([*command, str(tmp_path)], capture_output=True, text=True, timeout=30)
    one_clean_line(here, f"{tmp_path} is a directory")


# --- 4. messages -------------------------------------------------------------------------------


@pytest.mark.parametrize("tamper", ["object array", "wrong length", "float64", "not a zip"])
def test_tampered_shards_are_a_damaged_checkpoint(checkpoint, tamper):
    shard = checkpoint / rank_file(0, 1)
    arrays = dict(np.load(shard))
    if tamper == "object array":
        arrays["fc1.params"] = np.array([{"a": 1}, None], dtype=object)
    elif tamper == "wrong length":
        arrays["fc1.params"] = arrays["fc1.params"][:-3]
    elif tamper == "float64":
        arrays["fc1.params"] = arrays["fc1.params"].astype(np.float64)
    if tamper == "not a zip":
        shard.write_bytes(b"PK\x03\x04 not really")
    else:
        with open(shard, "wb") as f:
            np.savez(f, **arrays)
    resign(checkpoint, files=[shard.name])
    result = cli(["--optimizer", "adam", "--steps", "8", "--resume", str(checkpoint)], ranks=1)
    one_clean_line(result, f"{shard} is a damaged checkpoint (")
    assert "unexpected" not in result.stderr


def test_a_losses_file_of_another_length_is_a_damaged_checkpoint(checkpoint):
    np.save(checkpoint / "losses.npy", np.zeros(3))
    resign(checkpoint, files=["losses.npy"])
    result = cli(["--optimizer", "adam", "--steps", "8", "--resume", str(checkpoint)], ranks=1)
    one_clean_line(result, "losses.npy is a damaged checkpoint (float64 (3,), not the float64")


def test_a_symlink_loop_as_data_says_so(tmp_path):
    loop = tmp_path / "names.txt"
    loop.symlink_to(loop)
    result = cli(["--strategy", "dp", "--steps", "2", "--data", str(loop), *QUIET])
    one_clean_line(result, f"{loop} is a symbolic link loop")
    dangling = tmp_path / "gone.txt"
    dangling.symlink_to(tmp_path / "nowhere.txt")
    result = cli(["--strategy", "dp", "--steps", "2", "--data", str(dangling), *QUIET])
    one_clean_line(result, f"{dangling} is a symbolic link to {tmp_path / 'nowhere.txt'}")


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--strategy", "zero3", "--layers-per-unit", "4"],
            "--layers-per-unit: 4 is more than the model's 3 layers with parameters (emb, fc1,"
            " fc2): use at most 3, which makes the whole model one unit",
        ),
        (
            ["--strategy", "zero3", "--steps", "5", "--trace-step", "5"],
            "--trace-step: step 5 is past the last step (the last is 4; steps count from 0)",
        ),
        (
            ["--strategy", "dp", "--steps", "5", "--trace-step", "1"],
            "--trace-step: only zero3 records a step's spans",
        ),
    ],
)
def test_flags_that_would_do_nothing_are_refused(args, message):
    result = cli(["--steps", "3", *args] if "--steps" not in args else args)
    one_clean_line(result, message)


def test_a_trace_step_before_the_resumed_step_is_refused(tmp_path, data):
    config = TrainConfig(strategy="zero3", steps=4, eval_batches=0, samples=0)
    run(ModelConfig(), config, RunConfig(save_every=4, checkpoint_dir=tmp_path / "c"), data=data)
    onward = RunConfig(resume=tmp_path / "c", trace_step=2)
    with pytest.raises(ConfigError, match="--trace-step 2 comes before step 4"):
        run(ModelConfig(), TrainConfig(strategy="zero3", steps=8), onward, data=data)


# zero3 units resharded: saved with --layers-per-unit 2 on 2 ranks, resumed by anything


UNITS = ["--layers", "3", "--optimizer", "adam", "--batch", "24", "--eval-batches", "2"]
UNITS += ["--samples", "1", "--log-every", "1"]


def trained(out: Path) -> tuple[dict, np.ndarray]:
    """A finished run's parameters and its global loss per step."""
    with np.load(out / "params.npz") as f:
        params = {k: f[k] for k in f.files}
    return params, np.array(json.loads((out / "history.json").read_text())["losses"])


@pytest.mark.mpi
def test_a_checkpoint_of_zero3_units_reshards_to_any_layout(tmp_path):
    saved = tmp_path / "units2"
    half = ["--strategy", "zero3", "--layers-per-unit", "2", "--steps", "30", "--save-every"]
    result = cli([*UNITS, *half, "30", "--out", str(saved)], ranks=2, timeout=120)
    assert result.returncode == 0, result.stderr
    runs = {  # name: (ranks, flags); 60 steps in all
        "straight single": (1, ["--strategy", "single"]),
        "straight units2": (2, ["--strategy", "zero3", "--layers-per-unit", "2"]),
        "units2 again": (2, ["--strategy", "zero3", "--layers-per-unit", "2", "--resume"]),
        "dp at 3": (3, ["--strategy", "dp", "--reshard", "--resume"]),
        "zero3 units1 at 4": (4, ["--strategy", "zero3", "--reshard", "--resume"]),
    }
    results = {}
    for name, (ranks, flags) in runs.items():
        out = tmp_path / name.replace(" ", "-")
        flags = [*flags, str(saved)] if flags[-1] == "--resume" else flags
        done = cli([*UNITS, "--steps", "60", *flags, "--out", str(out)], ranks, timeout=120)
        assert done.returncode == 0, f"{name}: {done.stderr}"
        results[name] = trained(out)
    # the same layout: bit-identical to the run that never stopped
    params, losses = results["straight units2"]
    again, again_losses = results["units2 again"]
    assert all(params[k].tobytes() == again[k].tobytes() for k in params)
    assert np.array_equal(losses, again_losses)
    # another N, another strategy, other units: the model single-rank training trains
    reference, reference_losses = results["straight single"]
    for name in ("dp at 3", "zero3 units1 at 4"):
        params, losses = results[name]
        for key, want in reference.items():
            diff = np.abs(params[key] - want).max()
            assert diff <= 1e-5, f"{name}: {key} differs by {diff:.1e}"
        assert np.abs(losses[30:] - reference_losses[30:]).max() <= 1e-5, name
    # without --reshard the units are a layout like any other: named, and refused
    refused = cli([*UNITS, "--strategy", "zero3", "--steps", "60", "--resume", str(saved)], 2)
    one_clean_line(
        refused,
        "the checkpoint was saved by zero3 with --layers-per-unit 2 on 2 ranks, this run is "
        "zero3 on 2: pass --reshard to convert it",
    )


# --- a SIGTERM while MPI starts -----------------------------------------------------------------


@pytest.mark.mpi
def test_a_sigterm_inside_mpi_init_ends_the_rank(tmp_path):
    """mpi4py's MPI_Init holds the GIL: the thread that ends a rank on a signal cannot run
    there, and a rank whose peers had ended waited forever. start_mpi lets the kernel end it.
    Rank 0 waits in MPI_Init for rank 1, which sleeps: a SIGTERM must end rank 0 at once."""
    marker = tmp_path / "rank0.pid"
    job = subprocess.Popen(
        [MPIEXEC, "-n", "2", sys.executable, str(HERE / "limits_worker.py"), str(marker)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ranks = []
    try:
        deadline = time.monotonic() + 60
        while not (marker.exists() and marker.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        ranks = psutil.Process(job.pid).children(recursive=True)  # the proxy and both ranks
        rank0 = psutil.Process(int(marker.read_text()))
        time.sleep(1)  # inside MPI_Init by now, waiting for rank 1
        rank0.send_signal(signal.SIGTERM)
        _, alive = psutil.wait_procs([rank0], timeout=10)
        assert not alive, "rank 0 ignored the SIGTERM inside MPI_Init"
    finally:
        for process in [*ranks, psutil.Process(job.pid)]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.kill()
        job.wait(timeout=30)
        psutil.wait_procs(ranks, timeout=30)


# --- a RankError names one rank -----------------------------------------------------------------


@pytest.fixture(scope="module")
def own_cluster(tmp_path_factory):
    """Ranks on a 4-engine cluster connect() starts in a private IPYTHONDIR, stopped after."""
    from fsdp_lesson.cluster import connect

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("IPYTHONDIR", str(tmp_path_factory.mktemp("ipython")))
        mp.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
        with connect(n=4, profile="limits", timeout=60) as ranks:
            yield ranks


@pytest.mark.cluster
@pytest.mark.timeout(180)
def test_a_dead_engine_is_named_once_header_and_traceback_alike(own_cluster):
    """The header named the rank whose engine died first (rank 2) and the traceback under it
    said "rank 0 (engine 0) died": the lowest rank that went down with the job."""
    error = error_when_rank_2_is_killed(own_cluster)
    message = str(error)
    assert error.rank == 2, message
    assert set(re.findall(r"\brank (\d+)\b", message)) == {"2"}, message
    assert own_cluster.run(os.getpid) and own_cluster.n == 4  # the engines were restarted
