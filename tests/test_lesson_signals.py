"""tools/lesson.py (make test / make run) stops the cluster it started, however it ends: a
SIGTERM (CI's time-out), a SIGHUP (a closed terminal) or a SIGKILL (no `finally` runs at all)."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)


def cluster_processes(ipython_dir: Path) -> list[psutil.Process]:
    """The controller and engines whose command line or environment names ipython_dir."""
    found = []
    for proc in psutil.process_iter(["cmdline", "environ"]):
        with_dir = " ".join(proc.info["cmdline"] or []) + str(proc.info["environ"] or "")
        if str(ipython_dir) in with_dir and any(
            name in " ".join(proc.info["cmdline"] or [])
            for name in ("ipyparallel.engine", "ipyparallel.controller")
        ):
            found.append(proc)
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGKILL])
def test_the_cluster_is_stopped_whatever_ends_lesson_py(tmp_path, sig):
    ipython_dir = tmp_path / "ipython"
    env = dict(os.environ, LESSON_IPYTHONDIR=str(ipython_dir))
    # a test selection that keeps pytest busy while the signal comes
    slow = tmp_path / "test_wait.py"
    slow.write_text("import time\n\ndef test_wait():\n    time.sleep(120)\n")
    job = subprocess.Popen(
        [sys.executable, str(ROOT / "tools" / "lesson.py"), "test", str(slow)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: the finally below ends all of it
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while len(cluster_processes(ipython_dir)) < 2:  # the controller and the engines
            assert job.poll() is None and time.monotonic() < deadline, "no cluster started"
            time.sleep(0.5)
        time.sleep(3)  # pytest is running now
        job.send_signal(sig)
        job.wait(timeout=60)
        deadline = time.monotonic() + 60
        while cluster_processes(ipython_dir) and time.monotonic() < deadline:
            time.sleep(1)
        left = cluster_processes(ipython_dir)
        assert not left, f"left running after {sig.name}: {[p.pid for p in left]}"
    finally:
        with contextlib.suppress(ProcessLookupError):  # pytest under a SIGKILLed lesson.py
            os.killpg(job.pid, signal.SIGKILL)
        for proc in cluster_processes(ipython_dir):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
