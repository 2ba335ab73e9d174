"""make grade (tools/grade.py): submissions run on a real 4-engine MPI cluster, verdicts collected.

Two runs of the real command, each with a cluster of its own in a temporary IPython directory
(LESSON_IPYTHONDIR), never make run/test's build/ipython:
  * right (the teacher's 01 and 02), wrong (student copies: one answer wrong, the rest stubs),
    crash (a cell that raises mid-way) and a notebook that checks it runs on the grading cluster;
  * with a short time limit: a notebook that outlasts it, and one that leaves the engines busy.
"""

import csv
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from fsdp_lesson.checks import NOT_SOLVED

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import grade  # noqa: E402  (tools/grade.py)
import student  # noqa: E402  (tools/student.py)

LESSONS = [ROOT / "notebooks" / "01_dataset.ipynb", ROOT / "notebooks" / "02_single_rank_mlp.ipynb"]
STUB = "None  # YOUR CODE HERE"
N_ROWS_HINT = "count the tokens of a name, the boundary included"
MPIEXEC = shutil.which(
    "mpiexec", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
)
needs_mpi = pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec: the grading cluster needs MPI")


def cell_with(nb: nbformat.NotebookNode, text: str) -> int:
    """The index of the one cell whose source contains text."""
    (index,) = [i for i, cell in enumerate(nb.cells) if text in cell.source]
    return index


def answer(nb: nbformat.NotebookNode, exercise: str, code: str) -> None:
    """Replace the stub in the cell containing `exercise` by `code` (a student's answer)."""
    cell = nb.cells[cell_with(nb, exercise)]
    assert STUB in cell.source
    cell.source = cell.source.replace(STUB, code)


def notebook(*sources: str) -> nbformat.NotebookNode:
    nb = new_notebook(
        cells=[new_code_cell(s) if s[0] != "#" else new_markdown_cell(s) for s in sources]
    )
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


ON_THE_CLUSTER = """\
from fsdp_lesson import checks
from fsdp_lesson.checks import check
from fsdp_lesson.cluster import connect

checks.STRICT = False
ranks = connect(n=4)"""
CHECK_CLUSTER = """\
import os
from mpi4py import MPI

check("the grading cluster", [ranks.cluster is None, os.environ["IPYTHONDIR"]], [True, {ipython!r}])
check("one MPI world", ranks.run(lambda: (MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size)),
      [(r, 4) for r in range(4)])"""


def run_grade(
    folder: Path, out: Path, ipython: Path, timeout: float
) -> subprocess.CompletedProcess:
    """python tools/grade.py folder as make grade runs it; SIGTERM (which stops its cluster) if
    it takes too long, so that even a failing test leaves nothing running."""
    env = os.environ | {"LESSON_IPYTHONDIR": str(ipython)}
    command = [sys.executable, str(ROOT / "tools" / "grade.py"), str(folder), "--out", str(out)]
    with subprocess.Popen(
        [*command, "--timeout", str(timeout)], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    ) as proc:  # fmt: skip
        try:
            stdout, stderr = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGTERM)
            stdout, stderr = proc.communicate(timeout=120)
            pytest.fail(f"grade.py took more than 600 s:\n{stdout}\n{stderr}")
    assert proc.returncode == 0, f"{stdout}\n{stderr}"
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


def processes_of(ipython: Path) -> list[str]:
    """Processes (controller, engines, mpiexec, kernels) started with this IPython directory."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if proc.environ().get("IPYTHONDIR") == str(ipython):
                found.append(f"{proc.pid} {' '.join(proc.info['cmdline'] or [])[:120]}")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            pass
    return found


def no_process_left(ipython: Path) -> list[str]:
    deadline = time.monotonic() + 10
    while (left := processes_of(ipython)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


def read_grades(out: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(out / "grades.csv", encoding="utf-8") as f:
        return {(row["submission"], row["notebook"]): row for row in csv.DictReader(f)}


def digest(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """One grading run over right/, wrong/, crash/ and cluster.ipynb: (rows, md, stdout, ...)."""
    if MPIEXEC is None:
        pytest.skip("no mpiexec: the grading cluster needs MPI")
    tmp = tmp_path_factory.mktemp("grade")
    folder, ipython = tmp / "submissions", tmp / "ipython"
    (folder / "right").mkdir(parents=True)
    for path in LESSONS:  # the teacher's solutions, as committed
        shutil.copy(path, folder / "right" / path.name)
    wrong_01, _ = student.write_student_copies(LESSONS, folder / "wrong")
    nb = nbformat.read(wrong_01, as_version=4)
    answer(nb, "def n_rows(L):", "L  # the boundary forgotten")  # wrong; rank 2 of 8 unsolved
    nbformat.write(nb, wrong_01)
    (crash_01,) = student.write_student_copies(LESSONS[:1], folder / "crash")
    nb = nbformat.read(crash_01, as_version=4)
    answer(nb, "def n_rows(L):", "L + 1")
    answer(nb, "rows_of_rank_2 =", "list(range(2, 32, 8))")
    boom = cell_with(nb, "def n_rows(L):") + 1
    nb.cells.insert(boom, new_code_cell('raise RuntimeError("boom")'))
    nbformat.write(nb, crash_01)
    nbformat.write(
        notebook(ON_THE_CLUSTER, CHECK_CLUSTER.format(ipython=str(ipython))),
        folder / "cluster.ipynb",
    )
    before = digest(folder)
    out = tmp / "build"
    done = run_grade(folder, out, ipython, timeout=300)
    return {
        "rows": read_grades(out),
        "md": (out / "grades.md").read_text(encoding="utf-8"),
        "stdout": done.stdout,
        "out": out,
        "folder": folder,
        "unchanged": digest(folder) == before,
        "left": no_process_left(ipython),
        "boom": boom + 1,  # cell numbers count from 1
    }


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_the_teachers_solutions_pass_every_exercise(graded):
    rows = graded["rows"]
    assert rows["right", "01_dataset.ipynb"]["n_rows"] == "pass: correct"
    assert rows["right", "01_dataset.ipynb"]["rank 2 of 8"] == "pass: correct"
    assert rows["right", "02_single_rank_mlp.ipynb"]["count_params"] == "pass: correct"
    assert rows["right", "02_single_rank_mlp.ipynb"]["relu_backward"] == "pass: correct"
    for notebook_name in ("01_dataset.ipynb", "02_single_rank_mlp.ipynb"):
        assert rows["right", notebook_name]["total"] == "2/2"
        assert rows["right", notebook_name]["note"] == ""
        assert (
            rows["right", notebook_name]["the grading cluster"] == ""
        )  # another notebook's column


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_a_wrong_answer_fails_with_its_message_and_a_stub_is_not_solved_yet(graded):
    rows = graded["rows"]
    wrong = rows["wrong", "01_dataset.ipynb"]
    assert wrong["n_rows"] == f"fail: item 0: one too few (and 2 more) — {N_ROWS_HINT}"
    assert wrong["rank 2 of 8"] == f"fail: {NOT_SOLVED}"  # a stub gets no hint
    assert (wrong["total"], wrong["note"]) == ("0/2", "")
    stubs = rows["wrong", "02_single_rank_mlp.ipynb"]
    assert stubs["count_params"].startswith(f"fail: {NOT_SOLVED}")
    assert stubs["relu_backward"].startswith(f"fail: {NOT_SOLVED}")
    assert stubs["total"] == "0/2"


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_a_cell_that_raises_is_named_and_the_exercises_after_it_still_count(graded):
    crash = graded["rows"]["crash", "01_dataset.ipynb"]
    assert crash["note"] == (
        f"cell {graded['boom']} ('raise RuntimeError(\"boom\")') raised RuntimeError: boom"
    )
    assert (crash["n_rows"], crash["rank 2 of 8"], crash["total"]) == (
        "pass: correct",
        "pass: correct",
        "2/2",
    )


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_notebooks_connect_to_the_grading_cluster_as_one_mpi_world(graded):
    row = graded["rows"]["cluster", "cluster.ipynb"]  # a file directly in SUBMISSIONS
    assert (row["the grading cluster"], row["one MPI world"]) == ("pass: correct",) * 2
    assert (row["total"], row["note"]) == ("2/2", "")


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_the_report_has_a_table_per_lesson_and_nothing_is_left_behind(graded):
    md = graded["md"]
    assert "| crash | 2/2 | — | — | 2/2 |" in md  # summary: 01, 02, cluster.ipynb, total
    assert "| right | 2/2 | 2/2 | — | 4/4 |" in md
    assert "| wrong | 0/2 | 0/2 | — | 0/4 |" in md
    assert "| submission | notebook | n_rows | rank 2 of 8 | total | note |" in md
    assert (
        f"| wrong | 01_dataset.ipynb | fail: item 0: one too few (and 2 more) — {N_ROWS_HINT} | "
        f"fail: {NOT_SOLVED} | 0/2 |  |"
    ) in md
    assert len(graded["rows"]) == 6
    assert graded["unchanged"], "grade.py changed the submissions"
    executed = nbformat.read(graded["out"] / "graded" / "right" / "01_dataset.ipynb", 4)
    n_rows_cell = executed.cells[cell_with(executed, "def n_rows")]
    assert grade.verdict_lines(n_rows_cell) == [("n_rows", True, "correct")]  # the executed copy
    assert graded["left"] == [], f"left running: {graded['left']}"
    assert "cluster stopped" in graded["stdout"]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run with a 25 s limit: a notebook that leaves the engines busy when it is stopped,
    one after it (on the restarted engines), and 01 with a cell that sleeps past the limit."""
    if MPIEXEC is None:
        pytest.skip("no mpiexec: the grading cluster needs MPI")
    tmp = tmp_path_factory.mktemp("stopped")
    folder, ipython, out = tmp / "submissions", tmp / "ipython", tmp / "build"
    folder.mkdir()
    busy = notebook(ON_THE_CLUSTER, "import time\n\nranks.run(time.sleep, 600)", 'check("x", 1, 1)')
    nbformat.write(busy, folder / "1_busy.ipynb")
    after = notebook(ON_THE_CLUSTER, CHECK_CLUSTER.format(ipython=str(ipython)))
    nbformat.write(after, folder / "2_after.ipynb")
    (slow_01,) = student.write_student_copies(LESSONS[:1], folder / "3_slow")
    nb = nbformat.read(slow_01, as_version=4)
    answer(nb, "def n_rows(L):", "L + 1")
    answer(nb, "rows_of_rank_2 =", "list(range(2, 32, 8))")
    sleep = cell_with(nb, "rows_of_rank_2 =")
    nb.cells.insert(sleep, new_code_cell("import time\n\ntime.sleep(600)"))
    nbformat.write(nb, slow_01)
    start = time.monotonic()
    done = run_grade(folder, out, ipython, timeout=25)
    return {
        "rows": read_grades(out),
        "seconds": time.monotonic() - start,
        "stdout": done.stdout,
        "left": no_process_left(ipython),
        "sleep": sleep + 1,
    }


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_a_notebook_past_its_time_limit_scores_what_it_reached(stopped):
    slow = stopped["rows"]["3_slow", "01_dataset.ipynb"]
    assert slow["note"] == f"stopped at cell {stopped['sleep']} ('import time'): time limit of 25 s"
    assert (slow["n_rows"], slow["rank 2 of 8"], slow["total"]) == (
        "pass: correct",
        "fail: not reached",
        "1/2",
    )


@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_engines_left_busy_are_restarted_for_the_next_notebook(stopped):
    busy = stopped["rows"]["1_busy", "1_busy.ipynb"]
    assert busy["note"] == (
        "stopped at cell 2 ('import time'): time limit of 25 s; the engines were restarted after it"
    )
    after = stopped["rows"]["2_after", "2_after.ipynb"]
    assert (after["the grading cluster"], after["one MPI world"], after["note"]) == (
        "pass: correct",
        "pass: correct",
        "",
    )
    assert stopped["left"] == [], f"left running: {stopped['left']}"
    assert stopped["stdout"].count("starting a local cluster") == 2  # the start and the restart


def test_only_the_exercises_verdicts_count():
    """Verdicts from an exercise cell on to the next markdown cell count, matched to the
    teacher's exercises by cell id (else in order); the prose's checks and claims do not."""

    def printed(text, source="x = 1", **kw):
        return new_code_cell(source, outputs=[new_output("stream", name="stdout", text=text)], **kw)

    nb = new_notebook(
        cells=[
            printed("✓ K=1: every category: correct\n"),  # the prose's check
            new_markdown_cell("## Exercise 1"),
            printed("✓ f: correct\n", "f = 1  # answered", id="ex-f"),
            printed("✗ g: too large — a hint\n  (details)\n"),
            new_markdown_cell("Prose."),
            printed("✓ zero3: the line\n✗ claim does not hold: dp: above\n"),
            new_markdown_cell("## Exercise 2"),
            printed("✗ h: not solved yet\n", "h = None  # YOUR CODE HERE", id="ex-h"),
            new_markdown_cell("## Exercise 3"),  # the cell pasted anew (another id); the stub's
            printed("✗ sent bytes: not solved yet\n", "k = None  # YOUR CODE HERE"),  # name
        ]
    )
    teacher = grade.Lesson(
        [("ex-f", ["f", "g"]), ("ex-h", ["h", "h2"]), ("ex-k", ["K=2", "K=3"]), ("ex-z", ["z"])]
    )
    assert grade.exercises(nb, teacher) == {  # z: never printed (not reached)
        "f": (True, "correct"),
        "g": (False, "too large — a hint"),
        "h": (False, "not solved yet"),
        "h2": (False, "h: not solved yet"),  # its checker stopped at h's failure
        "K=2": (False, "sent bytes: not solved yet"),
        "K=3": (False, "sent bytes: not solved yet"),
    }
    assert grade.exercises(nb, grade.Lesson([])) == {  # no lesson: the stubs mark exercises
        "h": (False, "not solved yet"),
        "sent bytes": (False, "not solved yet"),
    }
    for cell in nb.cells:
        cell.source = "x = 1"
    assert list(grade.exercises(nb, grade.Lesson([]))) == [
        "K=1",
        "f",
        "g",
        "zero3",
        "h",
        "sent bytes",
    ]


def test_submissions_are_folders_or_single_notebooks(tmp_path):
    for path in ["anna/01.ipynb", "anna/extra/02.ipynb", "anna/.ipynb_checkpoints/01-c.ipynb",
                 "bob.ipynb", "empty/notes.txt", ".hidden/x.ipynb"]:  # fmt: skip
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("{}")
    found = grade.find_submissions(tmp_path)
    assert [(s.name, [str(n) for n in s.notebooks], s.per_file) for s in found] == [
        ("anna", ["01.ipynb", "extra/02.ipynb"], False),
        ("bob", ["bob.ipynb"], True),
    ]


@pytest.mark.parametrize("make", [lambda d: d / "missing", lambda d: d])
def test_a_folder_without_notebooks_is_refused_at_once(tmp_path, make):
    folder = make(tmp_path)
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "grade.py"), str(folder)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith(f"make grade: {folder} ")
    assert "starting" not in done.stdout
