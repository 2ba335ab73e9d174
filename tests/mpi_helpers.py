"""What the MPI tests share: running `mpiexec -n N python ...` with a timeout, and the check
that a run trained the same model as single-rank training."""

import subprocess
import sys
from pathlib import Path

import numpy as np

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


def assert_same_as_single(what: str, run: dict, history, params: dict, atol: float = 1e-5) -> None:
    """run's losses, parameters and samples equal single's (history, params) within atol."""
    loss_diff = np.abs(np.asarray(run["losses"]) - history.losses).max()
    assert loss_diff <= atol, f"{what}: loss differs by {loss_diff:.1e}"
    for layer, p in params.items():
        for k, v in p.items():
            diff = np.abs(run["params"][layer][k] - v).max()
            assert diff <= atol, f"{what}: {layer}.{k} differs by {diff:.1e}"
    assert run["samples"] == history.samples, f"{what}: samples differ from single's"
