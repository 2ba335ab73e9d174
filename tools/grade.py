"""Grade a class: each submission's answers run inside the teacher's notebooks, in a sandbox
of its own, graded on what the package's checkers computed: OUT/grades.csv and OUT/grades.md.

    python tools/grade.py SUBMISSIONS [--out DIR] [--timeout 900] [--replace] [--lessons DIR]
    make grade SUBMISSIONS=dir [OUT=dir] [TIMEOUT=900] [REPLACE=1]

SUBMISSIONS holds one folder per learner (every *.ipynb under it, at any depth, is that
learner's) and/or notebooks directly in it (each file is a submission of its own). Nothing in
it is changed. A link or anything but a regular file is refused by name, never read.

What runs (docs/teaching.md, "Grading a class", says why): the teacher's notebook of the same
name (notebooks/), every cell restored from it, with only the code between each exercise's
solution markers taken from the submission (a student's own cells and edits elsewhere are not
run). A verdict counts only when the package's checker or a teacher's line prints it: the
kernel signs those with a key per notebook that never appears in any cell, and the grader
keeps only signed verdicts from an exercise's region (its cell through the code cells after
it, up to the next markdown cell). Printed text earns nothing.

Where it runs: each submission in a sandbox of its own (tools/sandbox.py: namespaces, a root
holding only the Python, the package and its data, an account with no rights, limits, its own
MPI cluster when a notebook needs one); nothing it started outlives its grading.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import signal
import stat
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import sandbox  # tools/, beside this file

ROOT = Path(__file__).resolve().parent.parent
LESSONS = ROOT / "notebooks"
OUT = ROOT / "build" / "grades"  # OUT/<the submissions folder's name> unless --out
TIMEOUT = 900  # seconds per notebook
MAX_NOTEBOOK_BYTES = 20 * 2**20
VERDICT_MIME = "application/vnd.fsdp-lesson.verdict+json"

VERDICT = re.compile(r"^([✓✗]) (.+?):(?: (.*))?$")
CLAIM = "claim does not hold"  # a prose claim's failure line: never an exercise
SOLUTION_MARKERS = ("### BEGIN SOLUTION", "# YOUR CODE HERE")  # teacher's and student's cells
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
SKIP_DIRS = {".ipynb_checkpoints", "__pycache__"}

# Run silently (store_history=False) in each kernel before the first cell. The key is read
# from a file the kernel deletes at once, so it is in no cell, no history and no message.
# Every print whose caller (outside fsdp_lesson) is one of the teacher's lines, by cell and line
# number, also publishes each ✓/✗ line with its HMAC; nothing else is signed.
CHANNEL = r"""
def _grade_channel(key_file, allowed, mime):
    import builtins, hashlib, hmac, linecache, os, sys
    from IPython.display import publish_display_data
    from fsdp_lesson import checks
    with open(key_file, "rb") as f:
        key = f.read()
    os.unlink(key_file)
    checks.STRICT = False
    allowed = {digest: frozenset(lines) for digest, lines in allowed.items()}
    real_print, sent = builtins.print, [0]

    def the_teachers(frame):
        while frame is not None and str(frame.f_globals.get("__name__")).startswith("fsdp_lesson"):
            frame = frame.f_back
        if frame is None:
            return False
        text = "".join(linecache.getlines(frame.f_code.co_filename)).rstrip()
        return frame.f_lineno in allowed.get(hashlib.sha256(text.encode()).hexdigest(), ())

    def print(*args, sep=" ", end="\n", file=None, flush=False):
        real_print(*args, sep=sep, end=end, file=file, flush=flush)
        if file not in (None, sys.stdout) or not the_teachers(sys._getframe(1)):
            return
        for line in (" " if sep is None else sep).join(map(str, args)).splitlines():
            if line.startswith(("✓ ", "✗ ")):
                sent[0] += 1
                mac = hmac.new(key, f"{sent[0]}\0{line}".encode(), "sha256").hexdigest()
                publish_display_data({mime: {"n": sent[0], "line": line, "mac": mac}})

    builtins.print = print


_grade_channel(%r, %r, %r)
del _grade_channel
"""


@dataclass
class Entry:
    """One notebook of a submission: where it is, and why it is not read (or "")."""

    relative: str
    path: Path
    refused: str = ""


@dataclass
class Submission:
    name: str
    entries: list[Entry]


Verdict = tuple[str, bool, str]  # (name, passed, message)


@dataclass
class Lesson:
    """A teacher's notebook and its exercises: (the solution cell's id, the verdict names its
    region prints in the committed outputs), in order."""

    notebook: nbformat.NotebookNode
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


class Unreadable(ValueError):
    """A submitted notebook that is not read or cannot be; the message says why, never quoting
    the file."""


# ---------------------------------------------------------------------------------------------
# Finding submissions, without following a link


def hidden(name: str) -> bool:
    return name.startswith(".") or name in SKIP_DIRS


def refusal(path: Path) -> str:
    """Why path is not read (a link, a folder's link, not a regular file), or ""."""
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        return "refused: a symbolic link, not read"
    if not stat.S_ISREG(mode):
        return "refused: not a regular file, not read"
    return ""


def find_submissions(folder: Path) -> list[Submission]:
    """A submission per subfolder (its notebooks, at any depth) and per notebook file in folder.
    Links (to a file or a folder) and special files are listed, refused, never followed."""
    found = []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        path = Path(entry.path)
        if hidden(entry.name):
            continue
        if entry.is_symlink() or (entry.name.endswith(".ipynb") and refusal(path)):
            name = entry.name.removesuffix(".ipynb")
            found.append(Submission(name, [Entry(entry.name, path, refusal(path))]))
        elif entry.is_file(follow_symlinks=False) and entry.name.endswith(".ipynb"):
            found.append(Submission(path.stem, [Entry(entry.name, path)]))
        elif entry.is_dir(follow_symlinks=False):
            entries = notebooks_in(path)
            if entries:
                found.append(Submission(entry.name, entries))
    return found


def notebooks_in(folder: Path) -> list[Entry]:
    entries = []
    for where, dirs, files in os.walk(folder, followlinks=False):
        here = Path(where)
        dirs[:] = sorted(d for d in dirs if not hidden(d))
        for name in [d for d in dirs if (here / d).is_symlink()]:
            dirs.remove(name)
            relative = (here / name).relative_to(folder).as_posix()
            entries.append(Entry(relative, here / name, refusal(here / name)))
        for name in sorted(files):
            if name.endswith(".ipynb") and not hidden(name):
                path = here / name
                entries.append(Entry(path.relative_to(folder).as_posix(), path, refusal(path)))
    return sorted(entries, key=lambda e: e.relative)


def read_submitted(path: Path) -> nbformat.NotebookNode:
    """The notebook at path, opened without following a link; Unreadable says why not."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as err:
        raise Unreadable(f"not readable: {err.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise Unreadable("refused: not a regular file, not read")
        if info.st_nlink > 1:
            raise Unreadable("refused: a hard link to another file, not read")
        if info.st_size > MAX_NOTEBOOK_BYTES:
            raise Unreadable(f"refused: larger than {MAX_NOTEBOOK_BYTES >> 20} MB")
        data = f.read(MAX_NOTEBOOK_BYTES + 1)
    try:
        return nbformat.reads(data.decode("utf-8"), as_version=4)
    except Exception as err:  # what it says may quote the file: only its kind is told
        raise Unreadable(f"not a readable notebook ({type(err).__name__})") from None


# ---------------------------------------------------------------------------------------------
# Verdicts


def parse(line: str) -> Verdict | None:
    match = VERDICT.match(line.rstrip())
    if not match or (match[1] == "✗" and match[2].strip() == CLAIM):
        return None
    return match[2].strip(), match[1] == "✓", (match[3] or "").strip()


def verdict_lines(cell: nbformat.NotebookNode) -> list[Verdict]:
    """The ✓/✗ lines a cell printed: read from the teacher's committed notebooks only."""
    text = "".join(
        out.get("text", "")
        for out in cell.get("outputs", [])
        if out.get("output_type") == "stream" and out.get("name") == "stdout"
    )
    lines = [parse(line.rsplit("\r", 1)[-1]) for line in text.splitlines()]
    return [line for line in lines if line is not None]


def signature(key: bytes, number: int, line: str) -> str:
    return hmac.new(key, f"{number}\0{line}".encode(), "sha256").hexdigest()


def signed_verdicts(nb: nbformat.NotebookNode, key: bytes) -> dict[int, list[Verdict]]:
    """Each code cell's verdicts that carry the kernel's signature (numbered in order, each
    once); every verdict output is removed from nb, signed or not."""
    found: dict[int, list[Verdict]] = {}
    last = 0
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        kept = []
        for out in cell.get("outputs", []):
            data = out.get("data", {}) if out.get("output_type") == "display_data" else {}
            if VERDICT_MIME not in data:
                kept.append(out)
                continue
            sent = data[VERDICT_MIME]
            number, line = sent.get("n"), sent.get("line")
            if not (isinstance(number, int) and isinstance(line, str) and number > last):
                continue
            if hmac.compare_digest(str(sent.get("mac")), signature(key, number, line)):
                last = number
                if (verdict := parse(line)) is not None:
                    found.setdefault(index, []).append(verdict)
        cell.outputs = kept
    return found


def regions(
    nb: nbformat.NotebookNode, exercise_ids: set[str], lines_of
) -> tuple[list[tuple[str | None, list[Verdict]]], list[Verdict]]:
    """([(exercise cell id, verdicts of its region)], every verdict); lines_of(index, cell)
    gives a cell's verdicts. A region runs from an exercise cell through the code cells
    after it, up to the next markdown cell."""
    found: list[tuple[str | None, list[Verdict]]] = []
    every: list[Verdict] = []
    current: list[Verdict] | None = None
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "markdown":
            current = None
            continue
        if cell.cell_type != "code":
            continue
        if cell.get("id") in exercise_ids or any(m in cell.source for m in SOLUTION_MARKERS):
            current = []
            found.append((cell.get("id"), current))
        lines = lines_of(index, cell)
        every += lines
        if current is not None:
            current += lines
    return found, every


def exercises(
    nb: nbformat.NotebookNode, lesson: Lesson, signed: dict[int, list[Verdict]]
) -> dict[str, tuple[bool, str]]:
    """name -> (passed, message) for each of the lesson's exercises, from the signed verdicts
    of a restored notebook's run (its cells are the teacher's, ids included).

    An exercise takes its region's verdicts by name (a name printed twice: the last); a name
    its region did not print takes the verdict of a name the teacher's run never printed
    there (a checker may name a stub's verdict otherwise: "sent bytes: not solved yet" for
    "K=2, reshard=False: correct"), else the region's first failure (a checker that stopped
    at it); else it is not reached. A lesson's name printed outside its region still counts.
    """
    teachers = {cell_id for cell_id, _ in lesson.exercises}
    found, every = regions(nb, teachers, lambda index, _: signed.get(index, []))
    by_id = {cell_id: lines for cell_id, lines in found}
    graded: dict[str, tuple[bool, str]] = {}
    for cell_id, names in lesson.exercises:
        lines = by_id.get(cell_id, [])
        printed = {name: (passed, message) for name, passed, message in lines}
        others = [(name, passed, message) for name, passed, message in lines if name not in names]
        failed = [line for line in lines if not line[1]]
        stand_in = min(others, key=lambda v: v[1], default=None) or next(iter(failed), None)
        for name in names:
            if name in printed:
                graded[name] = printed[name]
            elif stand_in is not None:
                graded[name] = (stand_in[1], f"{stand_in[0]}: {stand_in[2]}")
    known = set(lesson.names)
    for name, passed, message in every:  # the lesson's names, printed outside their region
        if name in known and name not in graded:
            graded[name] = (passed, message)
    return graded


def read_lessons(notebooks: list[Path]) -> dict[str, Lesson]:
    """Each teacher notebook and its exercises: the solution cell's id, and the verdict names
    its region printed in the committed outputs."""
    lessons = {}
    for path in notebooks:
        nb = nbformat.read(path, as_version=4)
        ids = {
            cell.get("id") for cell in nb.cells if cell.cell_type == "code" and BEGIN in cell.source
        }
        found, _ = regions(nb, ids, lambda _, cell: verdict_lines(cell))
        lessons[path.stem] = Lesson(
            nb, [(cell_id, unique([name for name, _, _ in lines])) for cell_id, lines in found]
        )
    return lessons


def lesson_of(notebook: str, lessons: dict[str, Lesson]) -> str | None:
    """The teacher notebook a submitted one is a copy of: the same name, or one containing it
    (01_dataset.ipynb, anna-01_dataset.ipynb)."""
    stem = Path(notebook).stem
    matches = [name for name in lessons if name in stem]
    return max(matches, key=len) if matches else None


def unique(items: list[str]) -> list[str]:
    return list(dict.fromkeys(items))


# ---------------------------------------------------------------------------------------------
# Restoring the teacher's notebook around a submission's answers


def pieces(source: str) -> tuple[list[list[str]], list[tuple[str, list[str]]]]:
    """A teacher cell as (its fixed blocks of lines, [(indent, body)] of the regions between
    them): len(fixed) == len(regions) + 1; the marker lines belong to neither."""
    import student  # tools/, beside this file

    lines = source.split("\n")
    fixed, found, last = [], [], 0
    for begin, end in student.regions(lines, BEGIN, END, "the teacher's notebook"):
        fixed.append(lines[last:begin])
        line = lines[begin]
        found.append((line[: len(line) - len(line.lstrip())], lines[begin + 1 : end]))
        last = end + 1
    return [*fixed, lines[last:]], found


def find_block(lines: list[str], block: list[str]) -> int | None:
    if not any(line.strip() for line in block):
        return None
    for at in range(len(lines) - len(block) + 1):
        if lines[at : at + len(block)] == block:
            return at
    return None


def answers(teacher: str, submitted: str | None) -> list[list[str] | None]:
    """The submission's code for each region of a teacher cell (None: not found, the stub
    runs): between its own markers if it kept them, else what differs from the teacher's
    fixed lines at its start and end (an edited checker line is kept as an answer line, and
    the teacher's own follows it)."""
    fixed, found = pieces(teacher)
    if submitted is None:
        return [None] * len(found)
    lines = submitted.split("\n")
    try:
        own_fixed, own = pieces(submitted)
    except ValueError:
        own = []
    if len(own) == len(found):
        return [body for _, body in own]
    start = 0
    while start < min(len(fixed[0]), len(lines)) and lines[start] == fixed[0][start]:
        start += 1
    stop, tail = len(lines), fixed[-1]
    while (
        stop > start
        and len(lines) - stop < len(tail)
        and lines[stop - 1] == tail[len(tail) - (len(lines) - stop) - 1]
    ):
        stop -= 1
    middle, found_answers = lines[start:stop], []
    for block in fixed[1:-1]:
        at = find_block(middle, block)
        if at is None:
            break
        found_answers.append(middle[:at])
        middle = middle[at + len(block) :]
    found_answers.append(middle)
    return found_answers + [None] * (len(found) - len(found_answers))


def restored_cell(teacher: str, submitted: str | None) -> tuple[str, list[int]]:
    """The teacher's cell with the submission's answers in its regions (a missing one: the
    student copy's stub); and the numbers (from 1) of the teacher's own lines in it."""
    from student import stub  # tools/, beside this file

    fixed, found = pieces(teacher)
    given = answers(teacher, submitted)
    lines: list[str] = []
    theirs: list[int] = []
    for number, block in enumerate(fixed):
        theirs += range(len(lines) + 1, len(lines) + len(block) + 1)
        lines += block
        if number < len(found):
            indent, body = found[number]
            answer = given[number]
            lines += answer if answer is not None else stub(body, indent, "the teacher's cell")
    return "\n".join(lines), theirs


def restore(
    teacher: nbformat.NotebookNode, submitted: nbformat.NotebookNode
) -> tuple[nbformat.NotebookNode, dict[str, list[int]]]:
    """The notebook that runs: the teacher's cells, each exercise cell holding the submission's
    answers (its cell of the same id, else its next exercise-looking cell in order); and, per
    code cell (by the digest of the Python it runs), the teacher's line numbers."""
    nb = nbformat.from_dict(json.loads(json.dumps(teacher)))
    ids = {cell.get("id") for cell in nb.cells}
    theirs = {cell.get("id"): cell.source for cell in submitted.cells if cell.cell_type == "code"}
    loose = [
        cell.source
        for cell in submitted.cells
        if cell.cell_type == "code"
        and cell.get("id") not in ids
        and any(m in cell.source for m in SOLUTION_MARKERS)
    ]
    allowed: dict[str, list[int]] = {}
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        cell.outputs, cell.execution_count = [], None
        cell.metadata.pop("execution", None)
        if BEGIN in cell.source:
            own = theirs.get(cell.get("id"))
            cell.source, lines = restored_cell(
                cell.source, own if own is not None else (loose.pop(0) if loose else None)
            )
        else:
            lines = list(range(1, cell.source.count("\n") + 2))
        allowed[digest(cell.source)] = lines
    return nb, allowed


def digest(source: str) -> str:
    """What the kernel's channel looks up: the Python IPython runs for source, as its line
    cache holds it."""
    from IPython.core.inputtransformer2 import TransformerManager

    text = TransformerManager().transform_cell(source).rstrip()
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
# One sandbox per submission


@dataclass
class Job:
    entry: Entry
    lesson: str
    notebook: sandbox.Notebook  # the teacher's cells and the submission's answers


def grade_submission(
    submission: Submission,
    lessons: dict[str, Lesson],
    scratch: Path,
    graded: Path,
    timeout: float,
    say: Callable[[Result], None],
) -> list[Result]:
    """Each notebook of one submission, run in its sandbox; its results (say(result) as each
    is known)."""
    results, jobs = [], []
    for entry in submission.entries:
        lesson = lesson_of(entry.relative, lessons)
        result = Result(submission.name, entry.relative, lesson or entry.relative)
        try:
            if entry.refused:
                raise Unreadable(entry.refused)
            nb = read_submitted(entry.path)
            if lesson is None:
                raise Unreadable(
                    "not graded: its name matches no lesson (name it as the teacher's, "
                    "e.g. 01_dataset.ipynb)"
                )
            restored, allowed = restore(lessons[lesson].notebook, nb)
        except ValueError as err:  # Unreadable, or a teacher cell's markers (MarkerError)
            result.note = str(err)
            results.append(result)
            say(result)
            continue
        key = secrets.token_bytes(32)
        setup = CHANNEL % (sandbox.KEY_FILE, allowed, VERDICT_MIME)
        file = f"{len(jobs):03d}.ipynb"
        jobs.append(Job(entry, lesson, sandbox.Notebook(file, restored, key, setup)))
        results.append(result)

    def finished(file: str, line: dict) -> None:
        job = next(job for job in jobs if job.notebook.file == file)
        result = next(r for r in results if r.notebook == job.entry.relative)
        result.note, result.seconds = line["note"], line.get("seconds", 0.0)
        executed_path = scratch / "out" / file
        if executed_path.is_file():
            executed = nbformat.read(executed_path, as_version=4)
            signed = signed_verdicts(executed, job.notebook.key)
            result.verdicts = exercises(executed, lessons[job.lesson], signed)
            out = graded / submission.name / job.entry.relative
            out.parent.mkdir(parents=True, exist_ok=True)
            nbformat.write(executed, out)
        say(result)

    if jobs:
        sandbox.run_sandboxed([job.notebook for job in jobs], scratch, timeout, finished)
    shutil.rmtree(scratch / "work", ignore_errors=True)
    shutil.rmtree(scratch / "out", ignore_errors=True)
    return results


# ---------------------------------------------------------------------------------------------
# The reports


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
        f"{timeout:g} s in a sandbox of its own (tools/grade.py). A cell says `pass` or `fail` "
        "and the checker's signed message; `not reached`: the checker never said.",
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
    out: Path,
    timeout: float = TIMEOUT,
    teacher_notebooks: list[Path] | None = None,
) -> list[Result]:
    """Grade every submission in folder, each in its sandbox; write OUT/grades.csv and
    OUT/grades.md (after each submission, so an interrupted run leaves what it graded)."""
    submissions = find_submissions(folder)
    if not submissions:
        raise ValueError(f"{folder}: no notebooks (*.ipynb) in it or in its subfolders")
    lessons = read_lessons(teacher_notebooks or sorted(LESSONS.glob("[0-9][0-9]_*.ipynb")))
    graded = out / "graded"
    shutil.rmtree(graded, ignore_errors=True)  # main() asked first, if anything was there
    out.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    total = sum(len(s.entries) for s in submissions)
    print(f"grading {len(submissions)} submissions ({total} notebooks) in {folder}", flush=True)

    said: list[Result] = []

    def say(result: Result) -> None:
        """A console line per notebook as it is graded, or refused: [k/n] who / what: how."""
        said.append(result)
        line = f"[{len(said)}/{total}] {result.submission} / {result.notebook}: "
        if result.seconds:
            passed = sum(p for p, _ in result.verdicts.values())
            of = len(lessons[result.key].names) if result.key in lessons else 0
            line += f"{passed}/{of} passed ({result.seconds:.1f} s)"
            line += f"  {result.note}" if result.note else ""
        else:
            line += result.note or "not run"
        print(line, flush=True)

    base = "/run" if os.access("/run", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="fsdp-grade-", dir=base) as scratch:
        os.chmod(scratch, 0o700)
        for submission in submissions:
            results += grade_submission(submission, lessons, Path(scratch), graded, timeout, say)
            by_key = columns(results, lessons)
            write_csv(results, by_key, out / "grades.csv")
            write_md(results, by_key, out / "grades.md", timeout)
    return results


def refuse(message: str) -> int:
    print(f"make grade: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("submissions", type=Path, help="a folder of submissions")
    parser.add_argument(
        "--timeout", type=float, default=TIMEOUT, help=f"seconds per notebook (default {TIMEOUT})"
    )
    parser.add_argument(
        "--out", type=Path, help="where grades.csv/.md and graded/ go (build/grades/FOLDER)"
    )
    parser.add_argument(
        "--replace", action="store_true", help="replace the grades already in --out"
    )
    parser.add_argument(
        "--lessons", type=Path, default=LESSONS, help="the teacher's notebooks (notebooks/)"
    )
    args = parser.parse_args(argv)
    folder = args.submissions.resolve()
    if not folder.is_dir():
        return refuse(f"{args.submissions} is not a folder")
    if not find_submissions(folder):
        return refuse(f"{args.submissions} holds no notebooks (*.ipynb)")
    if args.timeout <= 0:
        return refuse("--timeout must be a positive number of seconds")
    out = (args.out or OUT / folder.name).resolve()
    if not args.replace and ((out / "grades.csv").exists() or (out / "graded").exists()):
        return refuse(
            f"{out} already holds a class's grades: give another OUT=DIR, or REPLACE=1 "
            f"(--replace) to replace them"
        )
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return refuse(
            "the sandbox each submission runs in needs root (namespaces, a root folder of its "
            "own, an account with no rights): run `sudo make grade ...`"
        )
    teachers = sorted(args.lessons.resolve().glob("*.ipynb"))
    # A terminated job (CI's timeout, a closed terminal) still ends its sandbox: exit via finally.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        grade(folder, out, args.timeout, teachers)
    except KeyboardInterrupt:  # the sandbox is ended by now; what was graded is written
        print(f"make grade: interrupted (Ctrl-C); the notebooks graded so far are in {out}")
        return 130
    print(f"wrote {out / 'grades.csv'} and {out / 'grades.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
