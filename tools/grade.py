"""Grade a class: run every submitted notebook on one local 4-engine MPI cluster, collect the
exercise checkers' verdicts, write build/grades.csv and build/grades.md.

    python tools/grade.py SUBMISSIONS [--timeout 900] [--out build]     (make grade SUBMISSIONS=dir)

SUBMISSIONS holds one folder per learner (every *.ipynb under it, at any depth, is that
learner's) and/or notebooks directly in it (each file is a submission of its own). Nothing in
SUBMISSIONS is changed: each submission is copied to a scratch folder and its notebooks run
there, one at a time, top to bottom in a fresh kernel, going on after a cell that raises, each
within --timeout seconds (kernel start included). The executed copies go to OUT/graded/.

A verdict is a line `✓ NAME: message` or `✗ NAME: message` that a cell prints. An exercise's
verdicts are those printed from its cell (the one with the solution markers, or its stub, or a
cell with the same id as the teacher's) through the code cells that follow, up to the next
markdown cell; the teacher's notebook of the same name (notebooks/) lists what to expect, so a
verdict never printed counts as "not reached". The prose's own checks are not graded. A
notebook matching no lesson and holding no exercise cell is graded on all its verdicts.

One cluster serves the whole run (its own IPython directory, build/ipython-grade, or
$LESSON_IPYTHONDIR): the notebooks' connect(n=4) uses it. Between notebooks the engines'
namespaces are cleared; engines that no longer answer (a notebook stopped while they were
still busy, or one died) are restarted. The cluster is stopped at the end, on an error and on
Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
TEACHER_NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
OUT = ROOT / "build"
IPYTHON_DIR = ROOT / "build" / "ipython-grade"  # apart from make run/test's build/ipython
TIMEOUT = 900  # seconds per notebook
HEALTH_TIMEOUT = 30  # seconds for the engines to clear their namespaces and answer
BUSY_GRACE = 5  # seconds a notebook's last task may still run on the engines after it ended
N_ENGINES = 4

VERDICT = re.compile(r"^([✓✗]) (.+?):(?: (.*))?$")
CLAIM = "claim does not hold"  # a prose claim's failure line: never an exercise
SOLUTION_MARKERS = ("### BEGIN SOLUTION", "# YOUR CODE HERE")  # teacher's and student's cells
SKIP_DIRS = {".ipynb_checkpoints", "__pycache__"}
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class Submission:
    name: str
    root: Path  # the learner's folder (a per-file submission: SUBMISSIONS itself)
    notebooks: list[Path]  # relative to root
    per_file: bool = False  # a notebook directly in SUBMISSIONS: only it is copied


Verdict = tuple[str, bool, str]  # (name, passed, message)


@dataclass
class Lesson:
    """A teacher's notebook's exercises: (the solution cell's id, the verdict names its
    region prints), in order."""

    exercises: list[tuple[str | None, list[str]]]

    @property
    def names(self) -> list[str]:
        return unique([name for _, names in self.exercises for name in names])


@dataclass
class Result:
    submission: str
    notebook: str
    key: str  # the lesson (teacher notebook stem), or the notebook's own path
    verdicts: dict[str, tuple[bool, str]] = field(default_factory=dict)  # exercise -> verdict
    note: str = ""
    seconds: float = 0.0


# ---------------------------------------------------------------------------------------------
# Finding submissions and reading verdicts


def find_submissions(folder: Path) -> list[Submission]:
    """A submission per subfolder (its notebooks, recursively) and per notebook file in folder."""
    found = []
    for entry in sorted(folder.iterdir()):
        if entry.name.startswith(".") or entry.name in SKIP_DIRS:
            continue
        if entry.is_file() and entry.suffix == ".ipynb":
            found.append(Submission(entry.stem, folder, [Path(entry.name)], per_file=True))
        elif entry.is_dir():
            notebooks = sorted(
                path.relative_to(entry)
                for path in entry.rglob("*.ipynb")
                if not any(
                    part.startswith(".") or part in SKIP_DIRS
                    for part in path.relative_to(entry).parts
                )
            )
            if notebooks:
                found.append(Submission(entry.name, entry, notebooks))
    return found


def verdict_lines(cell: nbformat.NotebookNode) -> list[Verdict]:
    """(name, passed, message) of each `✓ NAME: message` / `✗ NAME: message` line it printed."""
    text = "".join(
        out.get("text", "")
        for out in cell.get("outputs", [])
        if out.get("output_type") == "stream" and out.get("name") == "stdout"
    )
    found = []
    for line in text.splitlines():
        line = line.rsplit("\r", 1)[-1].rstrip()  # a line redrawn with \r: its last version
        match = VERDICT.match(line)
        if match:
            mark, name, message = match[1], match[2].strip(), (match[3] or "").strip()
            if mark == "✗" and name == CLAIM:
                continue
            found.append((name, mark == "✓", message))
    return found


def regions(
    nb: nbformat.NotebookNode, exercise_ids: set[str]
) -> tuple[list[tuple[str | None, list[Verdict]]], list[Verdict]]:
    """([(exercise cell id, verdicts of its region)], every verdict printed). A region runs from
    an exercise cell through the code cells after it, up to the next markdown cell."""
    found: list[tuple[str | None, list[Verdict]]] = []
    every: list[Verdict] = []
    current: list[Verdict] | None = None
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            current = None
            continue
        if cell.cell_type != "code":
            continue
        if cell.get("id") in exercise_ids or any(m in cell.source for m in SOLUTION_MARKERS):
            current = []
            found.append((cell.get("id"), current))
        lines = verdict_lines(cell)
        every += lines
        if current is not None:
            current += lines
    return found, every


def exercises(nb: nbformat.NotebookNode, lesson: Lesson) -> dict[str, tuple[bool, str]]:
    """name -> (passed, message) for each exercise verdict of an executed notebook.

    Each of the lesson's exercises takes the verdicts its region printed (the region of the
    cell with its id, else the next region in order): by name, and a name it did not print
    takes the verdict of a name the teacher's run never printed there (a checker may name a
    stub's verdict otherwise: "sent bytes: not solved yet" for "K=2, reshard=False: correct"),
    else the region's first failure (a checker that stopped at it); else it is not reached.
    A lesson's name printed elsewhere still counts; regions no exercise claims count by their
    own names. A notebook with no lesson and no exercise cell: every verdict counts.
    """
    teachers = {cell_id for cell_id, _ in lesson.exercises}
    found, every = regions(nb, teachers)
    if not (lesson.exercises or found):
        return {name: (passed, message) for name, passed, message in every}
    by_id = {cell_id: lines for cell_id, lines in found}
    unclaimed = [lines for cell_id, lines in found if cell_id not in teachers]
    graded: dict[str, tuple[bool, str]] = {}
    for cell_id, names in lesson.exercises:
        lines = by_id.get(cell_id)
        if lines is None:
            lines = unclaimed.pop(0) if unclaimed else []
        printed = {name: (passed, message) for name, passed, message in lines}
        others = [(name, passed, message) for name, passed, message in lines if name not in names]
        failed = [line for line in lines if not line[1]]
        stand_in = min(others, key=lambda v: v[1], default=None) or next(iter(failed), None)
        for name in names:
            if name in printed:
                graded[name] = printed[name]
            elif stand_in is not None:
                graded[name] = (stand_in[1], f"{stand_in[0]}: {stand_in[2]}")
        if stand_in is not None and not names:
            graded |= {name: (passed, message) for name, passed, message in others}
    known = set(lesson.names)
    for name, passed, message in every:  # the lesson's names, printed outside their region
        if name in known and name not in graded:
            graded[name] = (passed, message)
    for lines in unclaimed:
        graded |= {name: (passed, message) for name, passed, message in lines}
    return graded


def read_lessons(notebooks: list[Path]) -> dict[str, Lesson]:
    """Each teacher notebook's exercises: the solution cell's id, and the verdict names its
    region printed in the committed outputs."""
    lessons = {}
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        ids = {
            cell.get("id")
            for cell in nb.cells
            if cell.cell_type == "code" and SOLUTION_MARKERS[0] in cell.source
        }
        found, _ = regions(nb, ids)
        lessons[path.stem] = Lesson(
            [(cell_id, unique([name for name, _, _ in lines])) for cell_id, lines in found]
        )
    return lessons


def lesson_of(notebook: Path, lessons: dict[str, Lesson]) -> str | None:
    """The teacher notebook a submitted one is a copy of: the same name, or one containing it
    (01_dataset.ipynb, anna-01_dataset.ipynb)."""
    matches = [stem for stem in lessons if stem in notebook.stem]
    return max(matches, key=len) if matches else None


def unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


# ---------------------------------------------------------------------------------------------
# Running a notebook


def first_line(cell: nbformat.NotebookNode) -> str:
    line = next((x.strip() for x in cell.source.splitlines() if x.strip()), "")
    return line if len(line) <= 40 else line[:37] + "..."


def where(number: int, cell: nbformat.NotebookNode) -> str:
    return f"cell {number} ({first_line(cell)!r})" if first_line(cell) else f"cell {number}"


def error_line(out: nbformat.NotebookNode) -> str:
    """'RuntimeError: boom': the error's name and the first line of its value."""
    value = ANSI.sub("", str(out.get("evalue", ""))).strip().splitlines()
    return f"{out.get('ename', 'Error')}: {value[0]}" if value else str(out.get("ename", "Error"))


def run_notebook(nb: nbformat.NotebookNode, folder: Path, timeout: float) -> str:
    """Execute nb in place in a fresh kernel in `folder`, on past errors, within `timeout`
    seconds in all; return a note: where it stopped, or the first cell that raised, or ''."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    deadline = time.monotonic() + timeout

    def left(_cell=None) -> int:  # a cell's timeout: what is left of the notebook's (0 = none)
        return max(1, math.ceil(deadline - time.monotonic()))

    client = NotebookClient(
        nb,
        timeout=left(),
        timeout_func=left,
        startup_timeout=left(),
        allow_errors=True,
        kernel_name="python3",
        record_timing=False,
        shutdown_kernel="immediate",
        resources={"metadata": {"path": str(folder)}},
        extra_arguments=["--IPKernelApp.log_level=ERROR"],
    )
    for cell in nb.cells:  # verdicts come from this run only, not from a submission's outputs
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    stopped = ""
    try:
        with client.setup_kernel():
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code" or not cell.source.strip():
                    continue
                at = f"stopped at {where(index + 1, cell)}"
                if time.monotonic() >= deadline:
                    stopped = f"{at}: time limit of {timeout:g} s"
                    break
                try:
                    client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
                except CellTimeoutError:
                    stopped = f"{at}: time limit of {timeout:g} s"
                    break
                except DeadKernelError:
                    stopped = f"{at}: the kernel died"
                    break
    except Exception as err:  # the kernel did not start, or stopped answering
        stopped = f"not run to the end: {type(err).__name__}: {str(err).strip()[:200]}"
    raised = [
        (number, cell, out)
        for number, cell in enumerate(nb.cells, start=1)
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
        if out.get("output_type") == "error"
    ]
    notes = []
    if raised:
        number, cell, out = raised[0]
        more = len({n for n, _, _ in raised}) - 1
        notes.append(
            f"{where(number, cell)} raised {error_line(out)}"
            + (f" (and {more} more cell{'s' if more > 1 else ''})" if more else "")
        )
    if stopped:
        notes.append(stopped)
    return "; ".join(notes)


# ---------------------------------------------------------------------------------------------
# The cluster


def prepare_environment(ipython_dir: Path) -> None:
    """This venv's mpiexec first on PATH; the grading cluster's own IPython directory (the
    kernels inherit it, so their connect() finds this cluster); the ranks' launch settings."""
    from fsdp_lesson.launch import rank_settings

    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]
    os.environ["IPYTHONDIR"] = str(ipython_dir)
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")  # no progress widgets in the outputs
    os.environ.update(rank_settings())
    os.environ.pop("FSDP_LESSON_DOCS", None)  # notebook 07 would write the README's plots


class Engines:
    """One 4-engine MPI cluster (tools/lesson.py's mpi_cluster) for a whole grading run;
    restarted when it stops answering; always stopped on leaving."""

    def __init__(self, n: int = N_ENGINES) -> None:
        self.n = n
        self.restarts = 0
        self._stack: ExitStack | None = None
        self.cluster = None

    def __enter__(self) -> Engines:
        self._stop_leftover()
        self._start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop()

    def _start(self) -> None:
        from lesson import mpi_cluster  # tools/, beside this file

        self._stack = ExitStack()
        try:
            self.cluster = self._stack.enter_context(mpi_cluster(self.n))
        except BaseException:
            self._stop()
            raise

    def _stop(self) -> None:
        stack, self._stack, self.cluster = self._stack, None, None
        if stack is not None:
            stack.close()

    @staticmethod
    def _stop_leftover() -> None:
        """A cluster left in this IPython directory by a grading run that was killed."""
        import ipyparallel as ipp

        from fsdp_lesson.cluster import stop_cluster

        with contextlib.suppress(Exception):
            leftover = ipp.Cluster.from_file(profile="default", cluster_id="")
            if leftover.controller is not None or leftover.engines:
                print("stopping a cluster left by an earlier grading run", flush=True)
                stop_cluster(leftover)

    def healthy(self) -> bool:
        """All engines there and idle (a stopped notebook's tasks do not run on into the
        next one), their namespaces cleared, and each answering within seconds."""
        try:
            client = self.cluster.connect_client_sync(timeout=HEALTH_TIMEOUT)
        except Exception:
            return False
        try:
            client.wait_for_engines(self.n, timeout=HEALTH_TIMEOUT)
            deadline = time.monotonic() + BUSY_GRACE
            while any(
                status["queue"] or status["tasks"]
                for engine, status in client.queue_status().items()
                if engine != "unassigned"
            ):
                if time.monotonic() > deadline:
                    return False
                time.sleep(0.2)
            client.clear(block=False).result(timeout=HEALTH_TIMEOUT)
            pids = client[:].apply_async(os.getpid).get(timeout=HEALTH_TIMEOUT)
            return len(client.ids) == self.n == len(set(pids))
        except Exception:
            return False
        finally:
            client.close()

    def restart(self) -> None:
        """Kill the engines (a rank blocked in MPI ignores SIGTERM), stop, start afresh."""
        with contextlib.suppress(Exception):
            self.cluster.signal_engines_sync(signal.SIGKILL)
        self._stop()
        self._start()
        self.restarts += 1


# ---------------------------------------------------------------------------------------------
# Grading and the reports


def grade_submission(
    submission: Submission,
    lessons: dict[str, Lesson],
    scratch: Path,
    graded: Path,
    timeout: float,
    engines: Engines | None,
) -> list[Result]:
    """Run each notebook of one submission (from a scratch copy); its results."""
    work = scratch / "work"
    shutil.rmtree(work, ignore_errors=True)
    if submission.per_file:
        work.mkdir(parents=True)
        shutil.copy2(submission.root / submission.notebooks[0], work / submission.notebooks[0])
    else:
        shutil.copytree(
            submission.root, work, ignore=shutil.ignore_patterns(*SKIP_DIRS), symlinks=True
        )
    results = []
    for relative in submission.notebooks:
        path = work / relative
        lesson = lesson_of(relative, lessons)
        result = Result(submission.name, relative.as_posix(), lesson or relative.as_posix())
        start = time.perf_counter()
        try:
            nb = nbformat.read(path, as_version=4)
        except Exception as err:
            result.note = f"not a readable notebook: {type(err).__name__}: {err}"[:300]
            results.append(result)
            continue
        result.note = run_notebook(nb, path.parent, timeout)
        result.seconds = time.perf_counter() - start
        result.verdicts = exercises(nb, lessons[lesson] if lesson else Lesson([]))
        if engines is not None and not engines.healthy():
            engines.restart()
            result.note += ("; " if result.note else "") + "the engines were restarted after it"
        out = graded / submission.name / relative
        out.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, out)
        results.append(result)
        passed = sum(p for p, _ in result.verdicts.values())
        note = f"  {result.note}" if result.note else ""
        print(
            f"  {submission.name} / {result.notebook}: {passed} passed ({result.seconds:.1f} s)"
            + note,
            flush=True,
        )
    return results


def columns(results: list[Result], lessons: dict[str, Lesson]) -> dict[str, list[str]]:
    """The exercises of each lesson (or notebook), in order: the teacher's, then any others."""
    keys = unique([r.key for r in results])
    order = list(lessons)
    keys.sort(key=lambda k: (order.index(k) if k in order else len(order), k))
    found = {}
    for key in keys:
        names = list(lessons[key].names) if key in lessons else []
        for r in results:
            if r.key == key:
                names += [n for n in r.verdicts if n not in names]
        found[key] = names
    return found


def cell_value(result: Result, name: str) -> str:
    if name not in result.verdicts:
        return "fail: not reached"
    passed, message = result.verdicts[name]
    word = "pass" if passed else "fail"
    return f"{word}: {message}" if message else word


def score(result: Result, names: list[str]) -> tuple[int, int]:
    return sum(result.verdicts.get(n, (False, ""))[0] for n in names), len(names)


def write_csv(results: list[Result], by_key: dict[str, list[str]], path: Path) -> None:
    """One row per submission and notebook, one column per exercise (of any lesson)."""
    every = unique([name for names in by_key.values() for name in names])
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["submission", "notebook", *every, "total", "note"])
        for r in results:
            names = by_key[r.key]
            passed, total = score(r, names)
            cells = [cell_value(r, n) if n in names else "" for n in every]
            writer.writerow([r.submission, r.notebook, *cells, f"{passed}/{total}", r.note])


def md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(map(md_cell, header)) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(map(md_cell, row)) + " |" for row in rows]


def write_md(
    results: list[Result], by_key: dict[str, list[str]], path: Path, timeout: float
) -> None:
    """A summary (passed/total per submission and lesson), then one table per lesson."""
    submissions = unique([r.submission for r in results])
    lines = [
        "# Grades",
        "",
        f"{len(submissions)} submissions, {len(results)} notebooks, each run within "
        f"{timeout:g} s on a 4-engine MPI cluster (tools/grade.py). A cell says `pass` or "
        "`fail` and the checker's message; `not reached`: the checker never printed.",
        "",
        "## Summary",
        "",
    ]
    rows = []
    for s in submissions:
        row, all_passed, all_total = [s], 0, 0
        for key, names in by_key.items():
            mine = [r for r in results if r.submission == s and r.key == key]
            passed = sum(score(r, names)[0] for r in mine)
            total = sum(score(r, names)[1] for r in mine)
            row.append(f"{passed}/{total}" if mine else "—")
            all_passed, all_total = all_passed + passed, all_total + total
        rows.append([*row, f"{all_passed}/{all_total}"])
    lines += md_table(["submission", *by_key, "total"], rows)
    for key, names in by_key.items():
        lines += ["", f"## {key}", ""]
        mine = [r for r in results if r.key == key]
        rows = [
            [r.submission, r.notebook, *(cell_value(r, n) for n in names),
             "{}/{}".format(*score(r, names)), r.note]
            for r in mine
        ]  # fmt: skip
        lines += md_table(["submission", "notebook", *names, "total", "note"], rows)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def grade(
    folder: Path,
    out: Path = OUT,
    timeout: float = TIMEOUT,
    engines: Engines | None = None,
    teacher_notebooks: list[Path] = TEACHER_NOTEBOOKS,
) -> list[Result]:
    """Grade every submission in folder on the running `engines`; write OUT/grades.csv and
    OUT/grades.md (after each notebook, so an interrupted run leaves what it graded)."""
    submissions = find_submissions(folder)
    if not submissions:
        raise ValueError(f"{folder}: no notebooks (*.ipynb) in it or in its subfolders")
    lessons = read_lessons(teacher_notebooks)
    out.mkdir(parents=True, exist_ok=True)
    graded = out / "graded"
    shutil.rmtree(graded, ignore_errors=True)
    results: list[Result] = []
    count = sum(len(s.notebooks) for s in submissions)
    print(f"grading {len(submissions)} submissions ({count} notebooks) in {folder}", flush=True)
    with tempfile.TemporaryDirectory(prefix="grade-") as scratch:
        for submission in submissions:
            results += grade_submission(
                submission, lessons, Path(scratch), graded, timeout, engines
            )
            by_key = columns(results, lessons)
            write_csv(results, by_key, out / "grades.csv")
            write_md(results, by_key, out / "grades.md", timeout)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("submissions", type=Path, help="a folder of submissions")
    parser.add_argument(
        "--timeout", type=float, default=TIMEOUT, help=f"seconds per notebook (default {TIMEOUT})"
    )
    parser.add_argument("--out", type=Path, default=OUT, help="where grades.csv/.md go (build/)")
    args = parser.parse_args(argv)
    folder = args.submissions.resolve()
    if not folder.is_dir():
        print(f"make grade: {args.submissions} is not a folder", file=sys.stderr)
        return 2
    if not find_submissions(folder):
        print(f"make grade: {args.submissions} holds no notebooks (*.ipynb)", file=sys.stderr)
        return 2
    if args.timeout <= 0:
        print("make grade: --timeout must be a positive number of seconds", file=sys.stderr)
        return 2
    # A terminated job (CI's timeout, a closed terminal) still stops its cluster: exit via finally.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    prepare_environment(Path(os.environ.get("LESSON_IPYTHONDIR", IPYTHON_DIR)))
    out = args.out.resolve()
    try:
        with Engines() as engines:
            grade(folder, out, args.timeout, engines)
    except KeyboardInterrupt:  # the cluster is stopped by now; what was graded is written
        print(f"make grade: interrupted (Ctrl-C); the notebooks graded so far are in {out}")
        return 130
    print(f"wrote {out / 'grades.csv'} and {out / 'grades.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
