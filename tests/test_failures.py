"""No hang, no lost data: failures on some ranks, interrupted saves, bad manifests, budgets.

Every case runs the real CLI (under mpiexec where ranks matter) with a timeout, and checks
what a user sees: the exit code, one line on stderr, no traceback, nothing left running.
"""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fsdp_lesson.checkpoint import CheckpointError, find_checkpoint, read_manifest

HERE = Path(__file__).parent
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
TRAIN = [sys.executable, "-m", "fsdp_lesson", "train"]
QUIET = ["--eval-batches", "1", "--samples", "0"]
pytestmark = pytest.mark.mpi


def cli(args, ranks=2, timeout=60, **kwargs) -> subprocess.CompletedProcess:
    prefix = [MPIEXEC, "-n", str(ranks)] if ranks > 1 else []
    return subprocess.run(
        [*prefix, *TRAIN, *args], capture_output=True, text=True, timeout=timeout, **kwargs
    )


def one_clean_line(result, text: str) -> None:
    assert result.stderr.count(text) == 1, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def alive(pattern: str, grace: float = 5.0) -> list[str]:
    """Processes matching pattern still running after grace seconds (killed ranks may
    take a moment to exit after mpiexec has returned)."""
    deadline = time.monotonic() + grace
    while True:
        found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
        if not found.stdout.split() or time.monotonic() > deadline:
            return found.stdout.split()
        time.sleep(0.1)


# --- one rank fails: the job ends everywhere, in seconds -----------------------------------


def test_an_unforeseen_error_on_one_rank_ends_every_rank():
    # in seconds: the other ranks' 10^6 steps would take far longer than the 120 s timeout
    result = subprocess.run(
        [
            MPIEXEC,
            "-n",
            "4",
            sys.executable,
            str(HERE / "failing_rank_worker.py"),
            "raise",
            "2",
            "5",
        ]
        + ["--strategy", "zero3", "--steps", "1000000"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0
    one_clean_line(result, "rank 2: RuntimeError: injected failure (a bug on one rank)")
    assert alive("failing_rank_worker") == []


def test_one_ctrl_c_ends_the_run():
    mark = "--seed 4242"  # to find this run's processes
    job = subprocess.Popen(
        [MPIEXEC, "-n", "4", *TRAIN, "--strategy", "dp", "--steps", "1000000", *mark.split()],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        time.sleep(4)  # started and training
        job.send_signal(signal.SIGINT)  # what a terminal's Ctrl-C sends mpiexec
        _, stderr = job.communicate(timeout=60)  # its 10^6 steps would take far longer
    finally:
        job.kill()
    assert job.returncode != 0
    assert stderr.count("interrupted (Ctrl-C): every rank stops") == 1, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    assert alive(mark) == []


def test_an_out_that_is_a_file_is_refused_before_training(tmp_path):
    (tmp_path / "taken").write_text("a file")
    result = cli(["--strategy", "dp", "--save-every", "5", "--out", str(tmp_path / "taken")])
    assert result.returncode == 2 and "step:" not in result.stdout
    one_clean_line(result, "is a file, not a directory: choose another --out")


def test_a_full_disk_on_one_rank_is_the_same_error_on_every_rank(tmp_path):
    # rank 1 may write files of at most 4 KB: its checkpoint shard does not fit
    out = tmp_path / "run"
    worker = [sys.executable, str(HERE / "failing_rank_worker.py"), "full-disk", "1", "0"]
    args = ["--strategy", "dp", "--steps", "6", "--save-every", "3", "--out", str(out)]
    result = subprocess.run(
        [MPIEXEC, "-n", "2", *worker, *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2, result.stderr
    one_clean_line(result, "rank 1 could not write the checkpoint")
    assert "free some space, or save elsewhere" in result.stderr


def test_ranks_started_with_different_checkpoints_are_refused(tmp_path):
    for name, steps in (("a", "4"), ("b", "8")):
        done = cli(
            ["--strategy", "dp", "--steps", steps, "--save-every", "4", *QUIET]
            + ["--out", str(tmp_path / name)]
        )
        assert done.returncode == 0, done.stderr
    common = [*TRAIN, "--strategy", "dp", "--steps", "12", *QUIET]
    result = subprocess.run(
        [MPIEXEC, "-n", "1", *common, "--resume", str(tmp_path / "a"), ":"]
        + ["-n", "1", *common, "--resume", str(tmp_path / "b")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    one_clean_line(result, "the ranks loaded different checkpoints")


def test_ranks_started_with_different_flags_are_refused():
    common = [*TRAIN, "--strategy", "dp", "--steps", "3", *QUIET]
    result = subprocess.run(
        [MPIEXEC, "-n", "1", *common, "--hidden", "32", ":", "-n", "1", *common],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    one_clean_line(result, "the ranks were started with different settings")


def test_two_runs_into_the_same_out_at_once_end_cleanly(tmp_path):
    out = str(tmp_path / "shared")
    args = ["-n", "2", *TRAIN, "--strategy", "dp", "--steps", "60", "--save-every", "1"]
    jobs = [
        subprocess.Popen([MPIEXEC, *args, "--out", out, *QUIET], stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        errors = [job.communicate(timeout=120)[1] for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    assert all(job.returncode in (0, 2) for job in jobs), errors
    assert all("Traceback" not in e for e in errors), errors
    assert find_checkpoint(tmp_path / "shared" / "checkpoint") is not None


# --- checkpoints: never overwritten by accident, never trusted blindly ---------------------


def test_a_fresh_run_does_not_replace_a_checkpoint_unless_asked(tmp_path):
    out = str(tmp_path / "run")
    first = cli(["--strategy", "dp", "--steps", "8", "--save-every", "4", "--out", out, *QUIET])
    assert first.returncode == 0, first.stderr
    again = cli(["--strategy", "dp", "--steps", "4", "--save-every", "4", "--out", out, *QUIET])
    assert again.returncode == 2
    one_clean_line(again, "already holds a checkpoint: continue it with --resume")
    assert read_manifest(tmp_path / "run" / "checkpoint")["step"] == 8  # untouched
    replaced = cli(
        ["--strategy", "dp", "--steps", "4", "--save-every", "4", "--out", out, "--overwrite"]
        + QUIET
    )
    assert replaced.returncode == 0, replaced.stderr
    assert read_manifest(tmp_path / "run" / "checkpoint")["step"] == 4


def test_resuming_into_the_same_out_keeps_the_whole_history(tmp_path):
    out = str(tmp_path / "run")
    straight = cli(["--strategy", "dp", "--steps", "20", "--out", str(tmp_path / "s"), *QUIET])
    half = cli(["--strategy", "dp", "--steps", "10", "--save-every", "10", "--out", out, *QUIET])
    rest = cli(["--strategy", "dp", "--steps", "20", "--resume", out, "--out", out, *QUIET])
    assert straight.returncode == half.returncode == rest.returncode == 0, rest.stderr
    assert "resumed from" in rest.stdout and "at step 10" in rest.stdout
    text = (tmp_path / "run" / "history.json").read_text()
    assert "NaN" not in text  # strict JSON
    losses = json.loads(text)["losses"]
    expected = json.loads((tmp_path / "s" / "history.json").read_text())["losses"]
    assert len(losses) == 20 and None not in losses
    assert np.abs(np.array(losses) - np.array(expected)).max() <= 1e-12


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    done = cli(
        ["--strategy", "dp", "--steps", "4", "--save-every", "4"]
        + ["--out", str(tmp_path / "run"), *QUIET]
    )
    assert done.returncode == 0, done.stderr
    return tmp_path / "run" / "checkpoint"


def rewrite_manifest(ckpt: Path, edit, fix_checksum: bool = True) -> None:
    manifest = json.loads((ckpt / "manifest.json").read_text())
    text = json.dumps(edit(manifest)).encode()
    (ckpt / "manifest.json").write_bytes(text)
    if fix_checksum:
        (ckpt / "manifest.sha256").write_text(hashlib.sha256(text).hexdigest())


@pytest.mark.parametrize(
    "edit, fix_checksum, message",
    [
        (lambda m: m | {"step": 2}, False, "does not match manifest.sha256"),
        (lambda m: m | {"rng": {"state": 1}}, False, "does not match manifest.sha256"),
        (lambda m: [], True, "the manifest is a list, not an object"),
        (lambda m: {k: v for k, v in m.items() if k != "step"}, True, "the manifest has no 'step'"),
        (lambda m: m | {"step": "four"}, True, "'step' is 'four', not a int"),
        (lambda m: m | {"world_size": 4}, True, "are not the 4 ranks' shards"),
        (lambda m: m | {"step": -1}, True, "out of range"),
    ],
)
def test_an_edited_manifest_is_refused(checkpoint, edit, fix_checksum, message):
    rewrite_manifest(checkpoint, edit, fix_checksum)
    with pytest.raises(CheckpointError, match=message):
        read_manifest(checkpoint)
    result = cli(["--strategy", "dp", "--steps", "8", "--resume", str(checkpoint), *QUIET])
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


# (the call the process dies before, the how-many-th of its kind within the second save)
SAVE_STEPS = {
    "before the first rename": ("replace", 1),  # ckpt -> ckpt.old
    "between the renames": ("replace", 2),  # ckpt.partial -> ckpt
    "before removing the old copy": ("rmtree", 3),  # the .partial, a stale .old, then .old
}


@pytest.mark.parametrize("step", list(SAVE_STEPS))
def test_a_crash_anywhere_in_a_save_leaves_a_checkpoint_to_resume(tmp_path, step):
    out = tmp_path / "run"
    args = ["--steps", "8", "--save-every", "4", "--out", str(out), *QUIET]
    worker = [sys.executable, str(HERE / "crashing_save_worker.py"), *map(str, SAVE_STEPS[step])]
    crashed = subprocess.run([*worker, *args], capture_output=True, text=True, timeout=60)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    assert find_checkpoint(out / "checkpoint") is not None, sorted(p.name for p in out.iterdir())
    resumed = cli(
        ["--steps", "12", "--save-every", "4", "--resume", str(out), "--out", str(out), *QUIET],
        ranks=1,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert read_manifest(out / "checkpoint")["step"] == 12
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name) == ["checkpoint"]


def test_a_checkpoint_left_as_old_by_a_crash_is_resumed_and_saved_over(tmp_path):
    out = tmp_path / "run"
    done = cli(["--strategy", "dp", "--steps", "4", "--save-every", "4", "--out", str(out)] + QUIET)
    assert done.returncode == 0, done.stderr
    shutil.copytree(out / "checkpoint", out / "checkpoint.old")
    onward = cli(
        ["--strategy", "dp", "--steps", "8", "--save-every", "4", "--resume", str(out)]
        + ["--out", str(out), *QUIET]
    )
    assert onward.returncode == 0, onward.stderr
    assert read_manifest(out / "checkpoint")["step"] == 8


# --- the memory budget holds from the first byte -------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--hidden", "1000000", "--memory-budget-mb", "100"], "more than the budget of 100 MiB"),
        (["--hidden", "10000000"], "more than this machine's available memory"),
        (["--steps", "1000000000000"], "more than this machine's available memory"),
        (["--batch", "2000000000"], "more than this machine's available memory"),
    ],
)
def test_a_run_that_cannot_fit_is_refused_before_allocating(args, message):
    result = cli(["--strategy", "dp", *args], timeout=60)  # refused, not stuck allocating
    assert result.returncode == 2
    one_clean_line(result, "predicted before allocating anything")
    assert message in result.stderr


# --- flags and data -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, message",
    [
        (["--seed", "-1"], "seed must be between 0 and 2**32 - 1"),
        (["--c-compat", "--seed", "4294967296"], "seed must be between 0 and 2**32 - 1"),
        (["--memory-budget-mb", "inf"], "--memory-budget-mb: must be a positive finite number"),
        (["--memory-budget-mb", "1e400"], "--memory-budget-mb: must be a positive finite number"),
        (["--lr", "inf"], "--lr: must be a positive finite number"),
    ],
)
def test_out_of_range_numbers_are_one_line(args, message):
    result = cli(["--strategy", "dp", "--steps", "2", *args])
    assert result.returncode == 2
    one_clean_line(result, message)


@pytest.mark.parametrize(
    "args",
    [["--precision", "bf16"], ["--clip-grad-norm", "1"], ["--save-every", "1", "--out", "{tmp}"]],
    ids=["precision", "clip", "checkpoint"],
)
def test_c_compat_zero3_refuses_what_its_local_biases_cannot_do(args, tmp_path):
    """--c-compat zero3 keeps each rank's own fp32 biases, as the C FSDP programs do: no 16-bit
    copy, no norm over them, no checkpoint (which holds one model). Each is one clear line."""
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    result = cli(["--strategy", "zero3", "--c-compat", "--steps", "2", *QUIET, *args])
    assert result.returncode == 2
    one_clean_line(result, "--c-compat zero3 ")
    assert "without --c-compat" in result.stderr or "or --c-compat" in result.stderr
    assert not (tmp_path / "checkpoint").exists()


def test_divergence_stops_with_exit_3_and_writes_no_finished_run(tmp_path):
    result = cli(["--strategy", "dp", "--lr", "1e6", "--steps", "50", "--out", str(tmp_path)])
    assert result.returncode == 3
    one_clean_line(result, "training diverged: the loss became")
    assert "lower the learning rate (--lr)" in result.stderr and "Warning" not in result.stderr
    assert not (tmp_path / "history.json").exists() and not (tmp_path / "params.npz").exists()


def test_a_byte_order_mark_is_accepted_and_a_fifo_refused(tmp_path):
    bom = tmp_path / "bom.txt"
    bom.write_bytes(b"\xef\xbb\xbf" + b"emma\nolivia\nava\n" * 50)
    ok = cli(["--strategy", "dp", "--steps", "2", "--data", str(bom), *QUIET])
    assert ok.returncode == 0, ok.stderr
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    refused = cli(["--strategy", "dp", "--steps", "2", "--data", str(fifo), *QUIET], timeout=30)
    assert refused.returncode == 2
    one_clean_line(refused, "is not a regular file")


def test_data_commands_say_what_is_wrong_in_one_line(tmp_path):
    data = [sys.executable, "-m", "fsdp_lesson", "data"]
    missing = subprocess.run(
        [*data, "check", "--path", str(tmp_path / "missing.txt")], capture_output=True, text=True
    )
    assert missing.returncode == 2
    one_clean_line(missing, "missing.txt: cannot read it")
    (tmp_path / "file").write_text("")
    unwritable = subprocess.run(
        [*data, "build", "--path", str(tmp_path / "file" / "names.txt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert unwritable.returncode == 2
    assert unwritable.stderr.count("\n") == 1 and "Traceback" not in unwritable.stderr


def test_reshard_accepts_a_new_global_batch_and_says_so(tmp_path):
    out = str(tmp_path / "run")
    saved = cli(["--strategy", "dp", "--steps", "4", "--save-every", "4", "--out", out, *QUIET])
    assert saved.returncode == 0, saved.stderr
    at_three = cli(
        ["--strategy", "zero3", "--steps", "8", "--resume", out, "--reshard"]
        + ["--batch", "33", *QUIET],
        ranks=3,
    )
    assert at_three.returncode == 0, at_three.stderr
    assert "the global batch changes from 32 to 33" in at_three.stdout
    assert "resharded" in at_three.stdout
