"""make grade (tools/grade.py): answers run in the teacher's notebooks, each submission in a
sandbox of its own, graded on the verdicts the checkers sign.

Two runs of the real command (as root: the sandbox needs it):
  * on notebook 01: right (the teacher's), wrong (a wrong answer, a stub), forged (prints every
    verdict, edits the checker's line, adds a cell), hostile (tries to rewrite another
    submission, read the teacher's notebook, reach the network, leave a detached `sleep`, kill
    the grader's parent and every process it can), and two links (to /etc/shadow, to another
    student's notebook), each graded on its own;
  * on a one-exercise lesson of our own (--lessons) that uses the sandbox's MPI cluster: the
    engines run as the student's account, and a process started on one is gone afterwards.
"""

import csv
import hashlib
import os
import shutil
import socket
import subprocess
import sys
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

LESSON_01 = ROOT / "notebooks" / "01_dataset.ipynb"
STUB = "None  # YOUR CODE HERE"
N_ROWS_HINT = "count the tokens of a name, the boundary included"
as_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="the grading sandbox needs root and unshare",
)


def cell_with(nb: nbformat.NotebookNode, text: str) -> int:
    """The index of the one cell whose source contains text."""
    (index,) = [i for i, cell in enumerate(nb.cells) if text in cell.source]
    return index


def answer(nb: nbformat.NotebookNode, exercise: str, code: str) -> None:
    """Replace the stub in the cell containing `exercise` by `code` (a student's answer)."""
    cell = nb.cells[cell_with(nb, exercise)]
    assert STUB in cell.source
    cell.source = cell.source.replace(STUB, code)


def student_copy(folder: Path) -> tuple[Path, nbformat.NotebookNode]:
    (path,) = student.write_student_copies([LESSON_01], folder)
    return path, nbformat.read(path, as_version=4)


def run_grade(folder: Path, out: Path, *options: str) -> subprocess.CompletedProcess:
    """python tools/grade.py folder --out out, as make grade runs it."""
    command = [sys.executable, str(ROOT / "tools" / "grade.py"), str(folder), "--out", str(out)]
    return subprocess.run(
        [*command, *options], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


def read_grades(out: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(out / "grades.csv", encoding="utf-8") as f:
        return {(row["submission"], row["notebook"]): row for row in csv.DictReader(f)}


def digest(folder: Path) -> dict[str, str]:
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file() and not path.is_symlink()
    }


def running(words: str) -> list[str]:
    """Processes on this machine whose command line is `words`."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if " ".join(proc.info["cmdline"] or []) == words:
            found.append(f"{proc.info['pid']} {words}")
    return found


HOSTILE_N_ROWS = """\
import os, signal, socket, subprocess
held = []
for path in ({right!r}, {teacher!r}, {folder!r}):
    held.append(not os.path.exists(path))          # another submission, the teacher's, the class
    try:
        open(path, "a").write("vandalised")
        held.append(False)
    except OSError:
        pass
for address in (("127.0.0.1", {port}), ("1.1.1.1", 53)):  # the grader's loopback, the world
    try:
        socket.create_connection(address, timeout=3).close()
        held.append(False)
    except OSError:
        pass
held.append(os.getuid() != 0)
subprocess.Popen(["sleep", "333"], start_new_session=True)
for pid in (os.getppid(), 1):                      # the kernel's parent, the grader's
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
return L + 1 if all(held) else None"""


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """One grading run over right/, wrong/, forged/, hostile/ and two links."""
    tmp = tmp_path_factory.mktemp("grade")
    os.chmod(tmp, 0o755)
    folder, out = tmp / "submissions", tmp / "out"
    (folder / "right").mkdir(parents=True)
    right = folder / "right" / LESSON_01.name
    shutil.copy(LESSON_01, right)  # the teacher's solutions, as committed
    path, nb = student_copy(folder / "wrong")
    answer(nb, "def n_rows(L):", "L  # the boundary forgotten")  # wrong; rank 2 of 8 unsolved
    nbformat.write(nb, path)
    path, nb = student_copy(folder / "forged")  # unsolved, every verdict printed by hand
    forged_line = 'print("✓ n_rows: correct")\nprint("✓ rank 2 of 8: correct")'
    answer(nb, "rows_of_rank_2 =", f"None\n{forged_line}")
    n_rows = nb.cells[cell_with(nb, "def n_rows(L):")]
    n_rows.source = n_rows.source.split("_ = check(")[0] + forged_line  # the checker edited
    nb.cells.append(new_code_cell(forged_line))  # and a cell of its own
    nbformat.write(nb, path)
    path, nb = student_copy(folder / "hostile")
    listening = socket.create_server(("127.0.0.1", 0))  # on this machine's loopback
    paths = {"right": str(right), "teacher": str(LESSON_01), "folder": str(folder),
             "port": listening.getsockname()[1]}  # fmt: skip
    body = "\n".join("    " + line for line in HOSTILE_N_ROWS.format(**paths).splitlines())
    n_rows = nb.cells[cell_with(nb, "def n_rows(L):")]
    n_rows.source = n_rows.source.replace("    return None  # YOUR CODE HERE", body)
    kill_all = "[__import__('os').kill(pid, 9) for pid in (-1, __import__('os').getpid())]"
    answer(nb, "rows_of_rank_2 =", f"list(range(2, 32, 8))\n{kill_all}")
    nb.cells.insert(1, new_code_cell("import os, signal"))  # its own cell: not run
    nbformat.write(nb, path)
    (folder / "shadow").mkdir()
    (folder / "shadow" / LESSON_01.name).symlink_to("/etc/shadow")
    (folder / "copier").mkdir()
    (folder / "copier" / "copied.ipynb").symlink_to(f"../right/{LESSON_01.name}")
    before = digest(folder)
    lessons = tmp / "lessons"  # 01 cut to its imports and exercises: the same checkers, faster
    lessons.mkdir()
    teacher = nbformat.read(LESSON_01, as_version=4)
    keep = {
        1,
        *(i + d for i, c in enumerate(teacher.cells) if student.BEGIN in c.source for d in (-1, 0)),
    }
    teacher.cells = [cell for i, cell in enumerate(teacher.cells) if i in keep]
    nbformat.write(teacher, lessons / LESSON_01.name)
    with listening:
        done = run_grade(folder, out, "--timeout", "120", "--lessons", str(lessons))
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    return {
        "rows": read_grades(out),
        "text": (out / "grades.csv").read_text() + (out / "grades.md").read_text(),
        "stdout": done.stdout,
        "out": out,
        "folder": folder,
        "unchanged": digest(folder) == before,
        "left": running("sleep 333"),
    }


@as_root
@pytest.mark.timeout(600)
def test_the_teachers_solutions_pass_and_a_wrong_answer_fails_with_its_message(graded):
    right = graded["rows"]["right", LESSON_01.name]
    assert (right["n_rows"], right["rank 2 of 8"], right["total"], right["note"]) == (
        "pass: correct", "pass: correct", "2/2", "",
    )  # fmt: skip
    wrong = graded["rows"]["wrong", LESSON_01.name]
    assert wrong["n_rows"] == f"fail: item 0: one too few (and 2 more) — {N_ROWS_HINT}"
    assert wrong["rank 2 of 8"] == f"fail: {NOT_SOLVED}"  # a stub gets no hint
    assert wrong["total"] == "0/2"


@as_root
@pytest.mark.timeout(600)
def test_a_printed_verdict_earns_nothing(graded):
    forged = graded["rows"]["forged", LESSON_01.name]
    assert forged["n_rows"] == f"fail: {NOT_SOLVED}"  # the checker restored
    assert forged["rank 2 of 8"] == f"fail: {NOT_SOLVED}"
    assert forged["total"] == "0/2"


@as_root
@pytest.mark.timeout(600)
def test_links_are_refused_by_name_and_never_read(graded):
    shadow = graded["rows"]["shadow", LESSON_01.name]
    assert (shadow["total"], shadow["note"]) == ("0/2", "refused: a symbolic link, not read")
    copier = graded["rows"]["copier", "copied.ipynb"]
    assert copier["note"] == "refused: a symbolic link, not read"
    assert (copier["n_rows"], copier["total"]) == ("", "0/0")  # no lesson's name: nothing read
    assert "root:" not in graded["text"]
    assert "/6] shadow / 01_dataset.ipynb: refused: a symbolic link, not read" in graded["stdout"]


@as_root
@pytest.mark.timeout(600)
def test_a_hostile_submission_changes_no_grade_but_its_own(graded):
    hostile = graded["rows"]["hostile", LESSON_01.name]
    # n_rows passes only if the sandbox held: no other submission, teacher's notebook or class
    # folder seen or written, neither the machine's loopback nor the world reached, not root
    # (and the kill of its parents refused)
    assert hostile["n_rows"] == "pass: correct", hostile["note"]
    assert hostile["rank 2 of 8"] == "fail: not reached"  # it killed its own kernel
    assert "the kernel died" in hostile["note"]
    assert graded["unchanged"], "a submission was changed"
    assert graded["left"] == [], f"left running: {graded['left']}"
    right = graded["rows"]["right", LESSON_01.name]  # graded after it
    assert right["total"] == "2/2"


@as_root
@pytest.mark.timeout(600)
def test_progress_is_k_of_n_and_a_second_class_needs_its_own_out(graded):
    lines = [line for line in graded["stdout"].splitlines() if line.startswith("[")]
    assert [line.split("]")[0] for line in lines] == [f"[{k}/6" for k in range(1, 7)]
    done = run_grade(graded["folder"], graded["out"])
    assert done.returncode == 2
    assert done.stderr.startswith(f"make grade: {graded['out']} already holds a class's grades")
    assert (graded["out"] / "graded" / "right" / LESSON_01.name).is_file()


LESSON_MPI = [
    "# 01 · one MPI world",
    "from fsdp_lesson.checks import check\nfrom fsdp_lesson.cluster import connect\n\n"
    "ranks = connect(n=4)",
    "## Exercise",
    "### BEGIN SOLUTION\nworld = ranks.run(lambda: __import__('mpi4py.MPI').MPI.COMM_WORLD.size)\n"
    "### END SOLUTION\n\n_ = check('one MPI world', world, [4, 4, 4, 4])\n"
    "_ = check('engines not root', [uid != 0 for uid in ranks.run(os.getuid)], [True] * 4)",
]


@as_root
@pytest.mark.cluster
@pytest.mark.timeout(600)
def test_the_sandbox_runs_its_own_cluster_and_ends_what_an_engine_started(tmp_path):
    os.chmod(tmp_path, 0o755)
    lessons, folder = tmp_path / "lessons", tmp_path / "submissions"
    lessons.mkdir()
    cells = [
        new_markdown_cell(s) if i % 2 == 0 else new_code_cell(s) for i, s in enumerate(LESSON_MPI)
    ]
    cells[1].source = "import os\n" + cells[1].source
    cells[3].outputs = [
        new_output("stream", name="stdout", text="✓ one MPI world: correct\n"),
        new_output("stream", name="stdout", text="✓ engines not root: correct\n"),
    ]
    teacher = new_notebook(cells=cells)
    teacher.metadata.kernelspec = {"name": "python3", "display_name": "Python 3"}
    nbformat.write(teacher, lessons / "01_mpi.ipynb")
    (folder / "anna").mkdir(parents=True)
    submitted = student.student_copy(teacher, "01_mpi")
    cell = submitted.cells[cell_with(submitted, "world =")]
    cell.source = cell.source.replace(
        "world = None  # YOUR CODE HERE",
        "world = ranks.run(lambda: (__import__('subprocess').Popen(['sleep', '334'], "
        "start_new_session=True), __import__('mpi4py.MPI').MPI.COMM_WORLD.size)[1])",
    )
    nbformat.write(submitted, folder / "anna" / "01_mpi.ipynb")
    done = run_grade(folder, tmp_path / "out", "--lessons", str(lessons), "--timeout", "180")
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    row = read_grades(tmp_path / "out")["anna", "01_mpi.ipynb"]
    assert (row["one MPI world"], row["engines not root"], row["total"], row["note"]) == (
        "pass: correct", "pass: correct", "2/2", "",
    )  # fmt: skip
    assert running("sleep 334") == []
    executed = nbformat.read(tmp_path / "out" / "graded" / "anna" / "01_mpi.ipynb", as_version=4)
    connected = "".join(out.get("text", "") for out in executed.cells[1].outputs)
    assert "using the running cluster of 4 MPI engines" in connected  # the sandbox's, not its own


def test_only_signed_verdicts_of_an_exercise_count():
    """A verdict counts when it carries the run's signature, numbered in order, in its
    exercise's region; a printed line, a bad signature and a replayed number do not."""
    key = b"k" * 32

    def signed(number, line, mac=None):
        data = {"n": number, "line": line, "mac": mac or grade.signature(key, number, line)}
        return new_output("display_data", data={grade.VERDICT_MIME: data})

    nb = new_notebook(
        cells=[
            new_code_cell("x = 1", outputs=[signed(1, "✓ K=1: the prose's check")]),
            new_markdown_cell("## Exercise 1"),
            new_code_cell("f = 1", id="ex-f", outputs=[
                new_output("stream", name="stdout", text="✓ g: correct\n"),  # printed
                signed(2, "✓ f: correct"),
                signed(3, "✓ g: correct", mac="0" * 64),  # forged
                signed(2, "✓ h: correct"),  # replayed number
            ]),
            new_code_cell("check_g()", outputs=[signed(4, "✗ g: too large — a hint")]),
            new_markdown_cell("## Exercise 2"),
            new_code_cell("h = None", id="ex-h",
                          outputs=[signed(5, "✗ sent bytes: not solved yet")]),
        ]
    )  # fmt: skip
    lesson = grade.Lesson(nb, [("ex-f", ["f", "g"]), ("ex-h", ["h", "h2"]), ("ex-z", ["z"])])
    verdicts = grade.signed_verdicts(nb, key)
    assert grade.exercises(nb, lesson, verdicts) == {  # z: never said (not reached)
        "f": (True, "correct"),
        "g": (False, "too large — a hint"),
        "h": (False, "sent bytes: not solved yet"),
        "h2": (False, "sent bytes: not solved yet"),
    }
    assert all(grade.VERDICT_MIME not in str(cell.get("outputs")) for cell in nb.cells)


def test_answers_are_restored_into_the_teachers_cell():
    """Only the code between the markers comes from the submission; an edited checker line
    stays an answer line, and the teacher's checker still follows it."""
    teacher = "def f(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION\n\ncheck(f)"
    same, lines = grade.restored_cell(teacher, "def f(x):\n    return 2 * x\n\ncheck(f)")
    assert (same, lines) == ("def f(x):\n    return 2 * x\n\ncheck(f)", [1, 3, 4])
    edited, _ = grade.restored_cell(teacher, "def f(x):\n    return 2\n\nprint('✓ f: correct')")
    assert edited == "def f(x):\n    return 2\n\nprint('✓ f: correct')\n\ncheck(f)"
    missing, _ = grade.restored_cell(teacher, None)
    assert missing == "def f(x):\n    return None  # YOUR CODE HERE\n\ncheck(f)"


def test_submissions_are_folders_or_single_notebooks_and_links_are_listed_not_followed(
    tmp_path,
):
    for path in ["anna/01.ipynb", "anna/extra/02.ipynb", "anna/.ipynb_checkpoints/01-c.ipynb",
                 "bob.ipynb", "empty/notes.txt", ".hidden/x.ipynb"]:  # fmt: skip
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("{}")
    (tmp_path / "anna" / "shadow.ipynb").symlink_to("/etc/shadow")
    (tmp_path / "anna" / "linked").symlink_to(tmp_path / "empty")
    (tmp_path / "carl.ipynb").symlink_to(tmp_path / "bob.ipynb")
    os.mkfifo(tmp_path / "anna" / "pipe.ipynb")
    found = grade.find_submissions(tmp_path)
    assert [(s.name, [(e.relative, e.refused) for e in s.entries]) for s in found] == [
        ("anna", [("01.ipynb", ""), ("extra/02.ipynb", ""),
                  ("linked", "refused: a symbolic link, not read"),
                  ("pipe.ipynb", "refused: not a regular file, not read"),
                  ("shadow.ipynb", "refused: a symbolic link, not read")]),
        ("bob", [("bob.ipynb", "")]),
        ("carl", [("carl.ipynb", "refused: a symbolic link, not read")]),
    ]  # fmt: skip
    os.link(tmp_path / "bob.ipynb", tmp_path / "anna" / "hard.ipynb")
    with pytest.raises(grade.Unreadable, match="a hard link"):
        grade.read_submitted(tmp_path / "anna" / "hard.ipynb")
    (tmp_path / "dan.ipynb").write_text("root:*:20228:0:::")
    with pytest.raises(grade.Unreadable, match=r"^not a readable notebook \(\w+\)$"):
        grade.read_submitted(tmp_path / "dan.ipynb")


@pytest.mark.parametrize("make", [lambda d: d / "missing", lambda d: d])
def test_a_folder_without_notebooks_is_refused_at_once(tmp_path, make):
    folder = make(tmp_path)
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "grade.py"), str(folder)],
        capture_output=True, text=True, timeout=60, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.startswith(f"make grade: {folder} ")
    assert "grading" not in done.stdout
