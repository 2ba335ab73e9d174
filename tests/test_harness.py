"""make test / make run (tools/lesson.py) stop the cluster they start, also when things fail."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.cluster


def processes_using(ipython_dir: Path) -> list[int]:
    """Pids of live processes whose environment points at this IPYTHONDIR (engines, controller)."""
    needle = f"IPYTHONDIR={ipython_dir}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes() + b"\0":
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def lesson(job: str, *args: str, ipython_dir: Path) -> subprocess.CompletedProcess:
    env = os.environ | {"LESSON_IPYTHONDIR": str(ipython_dir)}
    return subprocess.run(
        [sys.executable, "tools/lesson.py", job, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.timeout(300)
def test_make_test_stops_its_cluster_when_a_test_fails(tmp_path):
    failing = tmp_path / "test_fails.py"
    failing.write_text("def test_fails():\n    assert False\n")
    result = lesson("test", str(failing), ipython_dir=tmp_path / "ipython")
    assert result.returncode == 1, result.stdout[-2000:]
    assert "1 failed" in result.stdout and "cluster stopped" in result.stdout
    assert processes_using(tmp_path / "ipython") == []


@pytest.mark.timeout(300)
def test_make_run_executes_renders_and_reports_failures(tmp_path):
    broken = ROOT / "build" / "test_harness_broken.ipynb"
    broken.parent.mkdir(exist_ok=True)
    broken.write_text(
        '{"cells": [{"cell_type": "code", "execution_count": null, "metadata": {},'
        ' "outputs": [], "source": ["1 / 0"]}], "metadata": {}, "nbformat": 4,'
        ' "nbformat_minor": 5}'
    )
    try:
        result = lesson(
            "run", "notebooks/01_dataset.ipynb", str(broken), ipython_dir=tmp_path / "ipython"
        )
    finally:
        broken.unlink()
        (ROOT / "build" / "html" / f"{broken.stem}.html").unlink(missing_ok=True)
    assert result.returncode == 1
    assert "01_dataset.ipynb" in result.stdout and "executed OK" in result.stdout
    assert "FAILED" in result.stdout and "ZeroDivisionError" in result.stdout
    assert (ROOT / "build" / "html" / "01_dataset.html").stat().st_size > 100_000
    assert processes_using(tmp_path / "ipython") == []


def test_the_tests_beside_the_notebooks_fail_the_run_and_are_reported_after_them(tmp_path, capfd):
    sys.path.insert(0, str(ROOT / "tools"))
    import lesson  # tools/lesson.py

    def prints(text: str, code: int = 0) -> list[str]:
        return [sys.executable, "-c", f"print({text!r}); raise SystemExit({code})"]

    log = tmp_path / "beside.log"
    assert lesson.run_side_by_side(prints("first"), prints("second"), log) == 0
    out = capfd.readouterr().out
    assert out.index("first") < out.index("second")  # the second's report follows the first's
    assert lesson.run_side_by_side(prints("first"), prints("second", 3), log) == 3
    assert lesson.run_side_by_side(prints("first", 2), prints("second"), log) == 2
    assert "second" in capfd.readouterr().out  # also reported when the first failed


def test_arguments_that_name_no_file_are_pytest_options():
    sys.path.insert(0, str(ROOT / "tools"))
    import lesson

    paths = ["tests", "tests/test_rng.py", "tests/test_rng.py::x", "notebooks/01_dataset.ipynb"]
    assert all(lesson.is_test_path(path) for path in paths)
    assert not any(lesson.is_test_path(arg) for arg in ["-k", "16", "-x", "not_a_file.py"])


def test_every_test_file_named_to_run_beside_the_notebooks_exists():
    sys.path.insert(0, str(ROOT / "tools"))
    import lesson

    for names in ("WAITING_TESTS", "AFTER_THE_NOTEBOOKS"):
        missing = [name for name in getattr(lesson, names) if not (ROOT / "tests" / name).is_file()]
        assert not missing, f"tools/lesson.py's {names} names no file: {missing}"
    assert not set(lesson.WAITING_TESTS) & set(lesson.AFTER_THE_NOTEBOOKS)
