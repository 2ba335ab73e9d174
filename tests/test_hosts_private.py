"""Simulated hosts without root, one private set per checkout (fsdp_lesson/hosts.py).

An unprivileged user (uid 65534 when the tests run as root) brings hosts up, runs ranks and
ipyparallel engines across them and takes them down; root refuses to act on that user's record;
two sets of hosts with the same names and addresses run jobs at the same time, and taking one
down leaves the other running. Needs user namespaces (skips and says why elsewhere).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from mpi_helpers import simulated_hosts

from fsdp_lesson import hosts

ROOT = Path(__file__).resolve().parent.parent
REASON = hosts.unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=str(REASON))
NOBODY = 65534
ALLREDUCE = (  # rank 0 prints each rank's line: ranks printing at once may interleave
    "import socket; import numpy as np; from mpi4py import MPI; w = MPI.COMM_WORLD; "
    "s = np.empty(2**18); w.Allreduce(np.full(2**18, w.rank + 1.0), s); "
    "lines = w.gather(f'{w.rank} {socket.gethostname()} {s[0]}'); "
    "lines and print(*lines, sep=chr(10))"
)
ENGINES = """
import sys
import ipyparallel as ipp
from fsdp_lesson.cluster import connect
@ipp.interactive
def where():
    import socket
    from mpi4py import MPI
    return MPI.COMM_WORLD.rank, socket.gethostname()
with connect(n=4, profile="hosts", timeout=120) as ranks:
    print(ranks.run(where))
"""


def hidden_ancestor(path: Path) -> Path | None:
    """The first directory above path that others may not enter (as /root, 0700), if any."""
    for parent in reversed(path.parents):
        if parent != Path("/") and not parent.stat().st_mode & 0o001:
            return parent
    return None


def as_unprivileged(home: Path) -> list[str]:
    """The prefix of a command run as an unprivileged user with HOME=home: the tests' own user
    if it is not root; else uid 65534, in a private mount namespace that lets it reach this
    Python where it lives under a directory closed to others (the machine is not changed)."""
    if os.geteuid() != 0:
        return ["env", f"HOME={home}"]
    drop = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
            "env", f"HOME={home}"]  # fmt: skip
    python = Path(sys.executable).resolve()
    closed = hidden_ancestor(python)
    if closed is None:
        return drop
    shown = closed / python.relative_to(closed).parts[0]  # e.g. /root/.pyenv
    view = home / "view"
    script = (
        f"set -e; mkdir -p {view}; mount --bind {shown} {view}; "
        f"mount -t tmpfs -o mode=755 fsdpl-t-view {closed}; mkdir {shown}; "
        f'mount --move {view} {shown}; exec "$@"'
    )
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *drop]


@contextmanager
def unprivileged_home() -> Iterator[Path]:
    """A directory of the unprivileged user's own, removed at the end."""
    home = Path(tempfile.mkdtemp(prefix="fsdpl-t-user-"))
    try:
        if os.geteuid() == 0:
            os.chown(home, NOBODY, NOBODY)
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


def run(command: list[str], timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, **env})  # fmt: skip


def placed(out: subprocess.CompletedProcess, names: list[str]) -> None:
    """Four ranks, two per host in order, and the allreduce's sum 1 + 2 + 3 + 4."""
    assert out.returncode == 0, out.stderr[-2000:]
    lines = sorted(line.split() for line in out.stdout.splitlines())
    assert lines == [[str(r), names[r // 2], "10.0"] for r in range(4)], out.stdout


@pytest.mark.timeout(300)
def test_an_unprivileged_user_runs_ranks_and_engines_on_hosts_of_its_own():
    with unprivileged_home() as home:
        user, directory = as_unprivileged(home), home / "hosts"
        python = [sys.executable, "-m", "fsdp_lesson", "hosts"]
        up = run([*user, *python, "up", "--dir", str(directory)])
        assert up.returncode == 0, up.stderr
        try:
            names = ["fsdpl-h0", "fsdpl-h1"]
            placed(run([*user, str(directory / "mpiexec"), "-n", "4", sys.executable, "-c",
                        ALLREDUCE]), names)  # fmt: skip
            engines = run([*user, sys.executable, "-c", ENGINES], timeout=240,
                          FSDP_LESSON_HOSTS_DIR=str(directory),
                          IPYTHONDIR=str(home / "ipython"))  # fmt: skip
            assert engines.returncode == 0, engines.stderr[-2000:]
            assert engines.stdout.splitlines()[-1] == str([(r, names[r // 2]) for r in range(4)])
            if os.geteuid() == 0:  # root refuses a record that is not its own
                theirs = run([*python, "down", "--dir", str(directory)])
                assert theirs.returncode == 2 and theirs.stderr.count("\n") == 1, theirs.stderr
                assert f"uid {NOBODY}" in theirs.stderr and "--dir" in theirs.stderr
                # and the user's hosts still run
                placed(run([*user, str(directory / "mpiexec"), "-n", "4", sys.executable, "-c",
                            ALLREDUCE]), names)  # fmt: skip
        finally:
            down = run([*user, *python, "down", "--dir", str(directory)])
        assert down.returncode == 0 and "removed" in down.stdout, down.stderr
        assert sorted(directory.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root's hosts and another user")
@pytest.mark.timeout(120)
def test_an_unprivileged_user_cannot_take_roots_hosts_down(tmp_path):
    """One line naming the owner and the --dir to give, exit 2, no traceback; root's hosts run."""
    directory = Path(tempfile.mkdtemp(prefix="fsdpl-t-root-"))
    directory.chmod(0o755)
    try:
        with simulated_hosts(directory, "fsdpl-") as up, unprivileged_home() as home:
            down = run([*as_unprivileged(home), sys.executable, "-m", "fsdp_lesson", "hosts",
                        "down", "--dir", str(up)])  # fmt: skip
            assert down.returncode == 2 and down.stderr.count("\n") == 1, down.stderr
            assert "root" in down.stderr and f"--dir {up}" in down.stderr
            assert hosts.keeper_alive(hosts.up_record(up))
    finally:
        shutil.rmtree(directory, ignore_errors=True)


@pytest.mark.timeout(300)
def test_two_checkouts_have_hosts_of_the_same_names_at_once(tmp_path):
    """Two sets of hosts named and addressed alike (two checkouts' build/hosts) run jobs at the
    same time; taking one down leaves the other's hosts running."""
    first, second = tmp_path / "one", tmp_path / "two"
    with simulated_hosts(first, "fsdpl-") as one, simulated_hosts(second, "fsdpl-") as two:
        jobs = [subprocess.Popen([str(d / "mpiexec"), "-n", "4", sys.executable, "-c", ALLREDUCE],
                                 cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True) for d in (one, two)]  # fmt: skip
        for job in jobs:
            out, err = job.communicate(timeout=120)
            placed(subprocess.CompletedProcess(job.args, job.returncode, out, err),
                   ["fsdpl-h0", "fsdpl-h1"])  # fmt: skip
        hosts.down(one)
        placed(run([str(two / "mpiexec"), "-n", "4", sys.executable, "-c", ALLREDUCE]),
               ["fsdpl-h0", "fsdpl-h1"])  # fmt: skip
