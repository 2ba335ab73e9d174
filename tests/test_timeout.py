"""A stalled rank does not stall the job: every collective waits at most --timeout seconds.

A rank stopped with SIGSTOP (a hung node, a debugger, a laptop lid) leaves the others waiting in
their next collective. Past the timeout, the first rank to notice prints one line naming the
collective, where the loop was and the ranks that have not arrived, and every rank ends with
exit code 4 (watchdog.py, Watchdog). Checked on the real path: the CLI under mpiexec, a rank
stopped by SIGSTOP, each wait bounded, and no process left behind.
"""

import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
from mpi_helpers import MPIEXEC, ROOT

from fsdp_lesson.checkpoint import MAY_CHANGE
from fsdp_lesson.comm import Comm
from fsdp_lesson.config import ConfigError, ModelConfig, TrainConfig
from fsdp_lesson.launch import rank_env
from fsdp_lesson.train import run as train
from fsdp_lesson.watchdog import (
    DEFAULT_TIMEOUT,
    EXIT_TIMEOUT,
    WHERE,
    in_phase,
    timeout_message,
)

TRAIN = [sys.executable, "-m", "fsdp_lesson", "train"]

# --- the message and the setting -------------------------------------------------------------


def test_the_message_names_the_collective_where_and_who_has_not_arrived():
    line = timeout_message(0, "allreduce", "of step 12", 30.2, 30, [(1, "stopped")], 0)
    assert line == (
        "rank 0: allreduce of step 12 waited 30 s; rank 1 (stopped) has not arrived: every "
        "rank stops now (exit code 4, --timeout 30)"
    )
    two = timeout_message(2, "allgather (shard)", "", 5, 5, [(0, "running"), (3, "stopped")], 4)
    assert "ranks 0 (running), 3 (stopped) have not arrived" in two
    assert "4 ranks on other hosts not checked" in two
    inside = timeout_message(0, "allreduce", "", 5, 5, [], 0, stopped=[1])
    assert "every rank has arrived, but rank 1 is stopped" in inside  # a non-blocking one
    assert "\n" not in line + two + inside


@in_phase("the validation loss")
def evaluate():
    return WHERE.text()


def test_where_the_rank_was_is_what_the_loop_said():
    """The loop tells WHERE its step and the passes their layer; a phase wins over the step."""
    assert WHERE.text() == ""
    WHERE.step, WHERE.layer = 12, "fc1"
    try:
        assert WHERE.text() == "of step 12 at layer fc1"
        WHERE.layer = None
        assert evaluate() == "of the validation loss"  # the innermost phase wins
        assert WHERE.text() == "of step 12"  # and ends with its function
    finally:
        WHERE.step = WHERE.layer = None


def test_the_timeout_is_a_positive_number_of_seconds_and_changes_no_number():
    assert TrainConfig().timeout == DEFAULT_TIMEOUT == 300
    for bad in (0, -1, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="timeout must be a positive finite number"):
            TrainConfig(timeout=bad).validate()
    assert "timeout" in MAY_CHANGE  # a checkpoint resumes with any --timeout


@pytest.mark.parametrize("value", ["0", "-5", "inf", "soon"])
def test_a_bad_timeout_flag_is_refused_in_one_line(value):
    result = subprocess.run(
        [*TRAIN, "--timeout", value], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 2
    assert "argument --timeout" in result.stderr and "Traceback" not in result.stderr


def test_run_gives_its_comm_the_configured_timeout():
    # what connect()'s ranks get: run_on_engine passes Comm.world() and the TrainConfig
    comm = Comm()
    config = TrainConfig(steps=1, eval_batches=1, samples=0, timeout=7.5)
    train(ModelConfig(), config, comm=comm)
    assert comm.timeout == 7.5


def test_a_checkpoint_resumes_with_another_timeout(tmp_path):
    out = str(tmp_path / "run")
    quiet = ["--eval-batches", "1", "--samples", "0"]
    first = subprocess.run(
        [*TRAIN, "--steps", "2", "--save-every", "2", "--out", out, *quiet],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert first.returncode == 0, first.stderr
    again = subprocess.run(
        [*TRAIN, "--steps", "4", "--resume", out, "--timeout", "9", *quiet],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert again.returncode == 0, again.stderr
    assert "resumed from" in again.stdout


# --- a rank stopped by SIGSTOP: the job ends by itself ------------------------------------------


def ranks_of(launcher: psutil.Process) -> dict[int, psutil.Process]:
    """The job's ranks by PMI_RANK: the Python processes under mpiexec."""
    ranks = {}
    for process in launcher.children(recursive=True):
        try:
            rank = process.environ().get("PMI_RANK")
        except psutil.Error:
            continue
        if rank is not None and process.name().startswith("python"):
            ranks[int(rank)] = process
    return ranks


def end_everything(launcher: subprocess.Popen, ranks: dict[int, psutil.Process]) -> list[int]:
    """Wake and end whatever of the job is left (by pid); the pids that were still alive."""
    left = []
    for process in ranks.values():
        try:
            process.send_signal(signal.SIGCONT)
        except psutil.Error:
            continue
    gone, alive = psutil.wait_procs(list(ranks.values()), timeout=10)
    for process in alive:
        left.append(process.pid)
        process.kill()
    launcher.kill()
    launcher.wait(timeout=10)
    return left


@pytest.mark.mpi
@pytest.mark.parametrize(
    "strategy, n, stop, extra",
    [
        ("dp", 2, 1, []),
        ("zero3", 2, 1, []),
        ("zero3", 4, 2, []),
        ("zero3", 4, 1, ["--replicate", "2"]),  # sub-communicators: shard and replicate groups
        # rank 0 waits on a recv from rank 2 (running), which waits on rank 3: both named
        ("dp", 4, 3, ["--pp", "2", "--layers", "2"]),
    ],
)
def test_a_stopped_rank_ends_the_job_with_exit_code_4_and_one_line(strategy, n, stop, extra):
    timeout = 5
    command = [MPIEXEC, "-n", str(n), *TRAIN, "--strategy", strategy, "--steps", "1000000"]
    command += ["--log-every", "1000000", "--samples", "0", "--timeout", str(timeout), *extra]
    job = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=rank_env(),
    )
    ranks = {}
    try:
        first = job.stdout.readline()  # "step: 0, loss ...": every rank is training
        assert first.startswith("step: 0"), job.communicate(timeout=60)[1]
        ranks = ranks_of(psutil.Process(job.pid))
        assert sorted(ranks) == list(range(n))
        time.sleep(0.5)
        ranks[stop].send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        _, stderr = job.communicate(timeout=60)
        took = time.monotonic() - stopped_at
    finally:
        left = end_everything(job, ranks)
    assert job.returncode == EXIT_TIMEOUT, stderr
    assert timeout <= took < timeout + 10, f"the job took {took:.1f} s to end"
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr  # one line, no traceback, not MPICH's abort line
    line = lines[0]
    assert f"waited {timeout} s" in line and "every rank stops now (exit code 4" in line
    # the stopped rank is named; a running rank that waits on it may be named beside it
    # ("ranks 2 (stopped), 3 (running) have not arrived"); under pp, the first rank to time out
    # may be one that receives from it ("recv (pp) from rank 3 ...; rank 3 (stopped) has not
    # sent it"), whichever the scheduling lets wait longest
    named = re.search(r"ranks? ([\d, ()a-z]+?) ha(?:s|ve) not arrived", line)
    assert (
        (named and f"{stop} (stopped)" in named[1])
        or f"rank {stop} is stopped" in line
        or re.search(rf"rank {stop} \(stopped\) has not (sent|received) it", line)
    ), line
    assert " of step " in line, line  # where the loop was
    assert left == [], f"processes still alive after the job ended: {left}"


@pytest.mark.mpi
@pytest.mark.parametrize("n, stop", [(2, 1), (4, 0)])
def test_a_rank_stopped_before_mpi_init_ends_the_job_named(n, stop):
    """MPI_Init waits for every rank holding the GIL, so no watchdog thread runs: the start-up
    watch (startup.py), a forked watcher, ends each waiting rank with exit code 4, and the
    lowest rank that is not stopped names the stopped one (rank 1 when rank 0 is stopped)."""
    timeout = 5
    worker = [sys.executable, str(ROOT / "tests" / "startup_worker.py"), str(stop), "train"]
    command = [MPIEXEC, "-n", str(n), *worker, "--strategy", "dp", "--steps", "5"]
    command += ["--samples", "0", "--timeout", str(timeout)]
    job = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=rank_env())
    ranks = {}
    try:
        launcher = psutil.Process(job.pid)
        while len(ranks) < n and job.poll() is None:  # the pids, to check that none is left
            ranks = ranks_of(launcher)
            time.sleep(0.1)
        _, stderr = job.communicate(timeout=120)
    finally:
        left = end_everything(job, ranks)
    assert job.returncode == EXIT_TIMEOUT, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    named = min(r for r in range(n) if r != stop)
    assert lines[0].startswith(f"rank {named}: MPI_Init waited {timeout} s; "), lines[0]
    assert f"rank {stop} (stopped) has not arrived" in lines[0], lines[0]
    assert f"exit code 4, --timeout {timeout}" in lines[0]
    assert left == [], f"processes still alive after the job ended: {left}"


# Rank 1 of 2 sleeps 60 s before the collective named by argv[1]; rank 0 times out after 1 s
LATE_RANK = """
import sys, time
import numpy as np
from fsdp_lesson.comm import Comm, all_agree, gather_objects, same_everywhere
comm = Comm.world(timeout=1)
if comm.rank == 1:
    time.sleep(60)
x, full = np.ones(4, np.float32), np.ones(8, np.float32)
{
    "mean_scalar": lambda: comm.mean_scalar(1.0),
    "all_agree": lambda: all_agree(comm, True),
    "same_everywhere": lambda: same_everywhere(comm, x),
    "allgather_objects": lambda: comm.allgather_objects("hello"),
    "gather_objects": lambda: gather_objects(comm, "hello"),
    "bcast": lambda: comm.bcast(x, root=1),
    "barrier": comm.barrier,
    "iallgather": lambda: comm.iallgather(x, full).wait(),
    "ring allreduce": lambda: Comm(comm.mpi, "ring", timeout=1).allreduce_mean(x),
    "nothing": lambda: None,  # rank 0 exits, rank 1 has not: the barrier at exit waits
}[sys.argv[1]]()
"""


@pytest.mark.mpi
@pytest.mark.parametrize(
    "operation, kind",
    [
        ("mean_scalar", "allreduce"),
        ("all_agree", "allreduce"),
        ("same_everywhere", "allgather"),
        ("allgather_objects", "allgather"),
        ("gather_objects", "gather"),
        ("bcast", "bcast"),
        ("barrier", "barrier"),
        ("iallgather", "allgather"),
        ("ring allreduce", "allreduce"),
        ("nothing", "barrier (at exit)"),
    ],
)
def test_every_collective_is_watched(operation, kind):
    start = time.monotonic()
    result = subprocess.run(
        [MPIEXEC, "-n", "2", sys.executable, "-c", LATE_RANK, operation],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=ROOT,
        env=rank_env(),
    )
    assert result.returncode == EXIT_TIMEOUT, result.stderr
    assert time.monotonic() - start < 30
    assert result.stderr.startswith(f"rank 0: {kind} waited 1 s; rank 1 (sleeping) has not "), (
        result.stderr
    )
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
