"""What the MPI tests share: running `mpiexec -n N python ...` with a timeout, the check that a
run trained the same model as single-rank training, simulated hosts, and killing a rank."""

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import psutil
import pytest

from fsdp_lesson.launch import rank_env

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = str(Path(sys.executable).parent / "mpiexec")  # the mpich wheel's, beside this Python


def mpiexec(n: int, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run `mpiexec -n n python ARGS` from the repository with a timeout; never hangs a test.

    The ranks get the project's launch settings (fsdp_lesson/launch.py): with more ranks than
    cores, a waiting rank yields its core to the working ones.
    """
    return subprocess.run(
        [MPIEXEC, "-n", str(n), sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=rank_env(),
    )


def worker_results(n: int, worker: str, tmp_path_factory, timeout: float = 300):
    """What tests/WORKER wrote (a pickle) after running on n ranks; a failed run fails the test."""
    out = tmp_path_factory.mktemp(f"{Path(worker).stem}{n}") / "results.pkl"
    result = mpiexec(n, str(ROOT / "tests" / worker), str(out), timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return pickle.loads(out.read_bytes())


def assert_same_as_single(what: str, run: dict, history, params: dict, atol: float = 1e-5) -> None:
    """run's losses, parameters and samples equal single's (history, params) within atol."""
    loss_diff = np.abs(np.asarray(run["losses"]) - history.losses).max()
    assert loss_diff <= atol, f"{what}: loss differs by {loss_diff:.1e}"
    for layer, p in params.items():
        for k, v in p.items():
            diff = np.abs(run["params"][layer][k] - v).max()
            assert diff <= atol, f"{what}: {layer}.{k} differs by {diff:.1e}"
    assert run["samples"] == history.samples, f"{what}: samples differ from single's"


def fixture_lines(name: str) -> list[list[str]]:
    """tests/fixtures/NAME's lines but its comments, each split at its first space."""
    text = (ROOT / "tests" / "fixtures" / name).read_text()
    return [line.split(" ", 1) for line in text.splitlines() if not line.startswith("#")]


def assert_prints_the_c_programs(n: int, flags: list[str], program: str) -> None:
    """`mpiexec -n n train --c-compat FLAGS --steps 1000` prints the C program's 1,000 losses
    (tests/fixtures/c_PROGRAM_losses.txt) within 1e-5, its validation loss and its samples."""
    args = ["train", "--c-compat", *flags, "--steps", "1000", "--log-every", "1"]
    result = mpiexec(n, "-m", "fsdp_lesson", *args, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    losses = [float(line.split("loss ")[1]) for line in lines if line.startswith("step:")]
    expected = [float(loss) for step, loss in fixture_lines(f"c_{program}_losses.txt")]
    assert len(losses) == len(expected) == 1000
    assert np.abs(np.array(losses) - expected).max() <= 1e-5
    (_, validation), *samples = fixture_lines(f"c_{program}_samples.txt")
    printed = next(line for line in lines if line.startswith("Final validation loss: "))
    assert abs(float(printed.split(": ")[1]) - float(validation)) <= 1e-5
    assert [line for line in lines if "  --> " in line] == [" ".join(s) for s in samples]


@contextmanager
def simulated_hosts(directory: Path, prefix: str, bandwidth: str = "1gbit", slots: int = 2):
    """2 simulated hosts of `slots` ranks (fsdp_lesson/hosts.py) in directory, named with the
    test module's own prefix; always taken down at the end."""
    from fsdp_lesson import hosts

    try:
        hosts.up(hosts.Layout(hosts=2, slots=slots, bandwidth=bandwidth, prefix=prefix), directory)
        yield directory
    finally:
        hosts.down(directory)


def kill_engine_of(ranks, rank: int) -> None:
    """SIGKILL `rank`'s engine, as the out-of-memory killer would, with mpiexec's proxies paused
    (SIGSTOP) until the watch of connect() has seen that engine end. Unpaused, mpiexec ends the
    others milliseconds later, and on a loaded machine the watch may see them all end together,
    so that no message can name the first (test_cluster tests what it says then)."""
    proxies = {psutil.Process(pid).ppid() for pid in ranks.pids}  # hydra_pmi_proxy, per host
    for proxy in proxies:
        os.kill(proxy, signal.SIGSTOP)
    try:
        os.kill(ranks.pids[rank], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while not ranks._exits and time.monotonic() < deadline:  # the watch's record
            time.sleep(0.01)
    finally:
        for proxy in proxies:
            with suppress(ProcessLookupError):
                os.kill(proxy, signal.SIGCONT)


def error_when_rank_2_is_killed(ranks):
    """The RankError of a ranks.run during which rank 2's engine is killed (kill_engine_of)."""
    from fsdp_lesson.cluster import RankError

    killer = threading.Timer(1.0, kill_engine_of, (ranks, 2))
    killer.start()
    try:
        with pytest.raises(RankError) as info:
            ranks.run(time.sleep, 30, timeout=60)
    finally:
        killer.cancel()
        killer.join()
    return info.value
