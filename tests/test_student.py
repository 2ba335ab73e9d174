"""make student (tools/student.py): solutions out, stubs in, the rest kept, outputs cleared."""

import subprocess
import sys
from collections import defaultdict
from copy import deepcopy
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output
from nbval.plugin import coalesce_streams, transform_streams_for_comparison

from fsdp_lesson.checks import NOT_SOLVED

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import student  # noqa: E402  (tools/student.py)
from execute_notebooks import execute  # noqa: E402  (tools/execute_notebooks.py)
from lesson import hosts_are_up, needs_hosts, needs_torch, torch_missing  # noqa: E402

CHECK_IMPORT = "from fsdp_lesson.checks import check, compare"
FUNCTION = """\
def relu_backward(x, dout):
    # dL/dx of out = max(x, 0)
    ### BEGIN SOLUTION
    mask = x > 0
    return dout * mask
    ### END SOLUTION


print(check("relu_backward", relu_backward(np.array([-1.0, 2.0]), np.ones(2)), [0.0, 1.0]))"""
VALUE = """\
### BEGIN SOLUTION
first, (second, *rest) = 2, (5, 16, 17)
third: int = 99
### END SOLUTION
check("rows", [first, second, third], [2, 5, 99])"""
HINTED = """\
def shard(numel, n):
    ### BEGIN SOLUTION
    # stub: return None, None
    size = -(-numel // n)
    return size, n * size - numel
    ### END SOLUTION


compare("shard", shard(10, 4), (3, 2))"""
PX = """\
%%px
def allreduce_mean(comm, buf):
    ### BEGIN SOLUTION
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    buf /= comm.size
    return buf
    ### END SOLUTION"""
ANSWER_TEXT = "The gradient is dout where x > 0: **the mask**."
QUESTION = f"Why is it so?\n<!-- BEGIN SOLUTION -->\n{ANSWER_TEXT}\n<!-- END SOLUTION -->\nOn."
SOLUTION_TEXTS = ["mask = x > 0", "dout * mask", "first, (second", "third: int", "-(-numel",
                  "Allreduce", "comm.size", ANSWER_TEXT]  # fmt: skip


def teacher_notebook() -> nbformat.NotebookNode:
    """A small teacher notebook: each kind of exercise, a markdown solution, executed outputs."""
    cells = [
        new_markdown_cell("# 99 · A synthetic lesson\n\nIt tests make student."),
        new_code_cell(f"import numpy as np\n\n{CHECK_IMPORT}", execution_count=1),
        new_code_cell(FUNCTION, execution_count=2, outputs=[new_output("stream", text="✓\n")]),
        new_code_cell(VALUE, execution_count=3),
        new_code_cell(HINTED, execution_count=4, metadata={"jupyter": {"source_hidden": True}}),
        new_code_cell(PX, execution_count=5),
        new_markdown_cell(QUESTION),
        new_markdown_cell(
            "<!-- BEGIN SOLUTION -->\nA whole cell of answer.\n<!-- END SOLUTION -->"
        ),
        new_code_cell(
            "print(1 + 1)", execution_count=6, outputs=[new_output("stream", text="2\n")]
        ),
    ]
    nb = new_notebook(cells=cells)
    nb.metadata.kernelspec = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def test_solutions_become_stubs_and_everything_else_stays():
    teacher = teacher_notebook()
    copy = student.student_copy(teacher, "99_synthetic.ipynb")
    sources = [cell.source for cell in copy.cells]
    assert (
        sources
        == [
            teacher.cells[0].source,
            student.STUDENT_MODE,  # before the first code cell: a failed checker goes on
            teacher.cells[1].source,
            "def relu_backward(x, dout):\n    # dL/dx of out = max(x, 0)\n"
            "    return None  # YOUR CODE HERE" + FUNCTION[FUNCTION.index("\n\n\n") :],
            "first = None  # YOUR CODE HERE\nsecond = None  # YOUR CODE HERE\n"
            "rest = None  # YOUR CODE HERE\nthird = None  # YOUR CODE HERE\n"
            'check("rows", [first, second, third], [2, 5, 99])',
            'def shard(numel, n):\n    return None, None  # YOUR CODE HERE\n\n\ncompare("shard", '
            "shard(10, 4), (3, 2))",
            "%%px\ndef allreduce_mean(comm, buf):\n    return None  # YOUR CODE HERE",
            "Why is it so?\nOn.",  # the cell holding only a solution is gone
            "print(1 + 1)",
        ]
    )
    assert [cell.get("id") for cell in copy.cells if cell.source != student.STUDENT_MODE] == [
        cell.get("id") for i, cell in enumerate(teacher.cells) if i != 7
    ]
    text = nbformat.writes(copy)
    for solution in SOLUTION_TEXTS:
        assert solution not in text
    assert "SOLUTION" not in text
    assert "source_hidden" not in text  # the stub of a hidden solution cell is shown
    assert teacher.cells[2].source == FUNCTION  # the teacher's notebook is left as it was


def test_outputs_and_execution_counts_are_cleared():
    teacher = teacher_notebook()
    teacher.cells[1].metadata["execution"] = {"iopub.status.idle": "2026-01-01T00:00:00Z"}
    copy = student.student_copy(teacher, "99_synthetic.ipynb")
    code = [cell for cell in copy.cells if cell.cell_type == "code"]
    assert all(cell.outputs == [] and cell.execution_count is None for cell in code)
    assert all("execution" not in cell.metadata for cell in code)
    nbformat.validate(copy)


def test_student_copy_runs_and_every_checker_says_not_solved(tmp_path):
    teacher = teacher_notebook()
    del teacher.cells[5]  # the %%px cell needs a cluster: the cluster test below runs those
    teacher_path = write(teacher, tmp_path / "99_synthetic.ipynb")
    (path,) = student.write_student_copies([teacher_path], tmp_path / "student")
    copy = nbformat.read(path, as_version=4)
    execute(copy, tmp_path)  # raises on the first error
    printed = "".join(out.get("text", "") for cell in copy.cells for out in cell.get("outputs", []))
    assert printed.splitlines() == [
        f"✗ relu_backward: {NOT_SOLVED}",
        "False",
        f"✗ rows: {NOT_SOLVED}",
        f"shard      {NOT_SOLVED}",
        "2",
    ]


def test_a_second_run_is_compared_but_at_the_exercises_and_the_unsolved_checkers():
    teacher = teacher_notebook()
    exercises = {cell.id for cell in teacher.cells if student.BEGIN in cell.source}
    second = student.student_copy(teacher, "99_synthetic.ipynb")
    by_source = {cell.source: cell for cell in second.cells}
    by_source["print(1 + 1)"].outputs = [new_output("stream", text="2\n")]
    exercise = next(cell for cell in second.cells if cell.id in exercises)
    exercise.outputs = [new_output("stream", text="anything\n")]
    assert_same_outputs_but_the_exercises("99", teacher, second, exercises)  # as committed

    by_source["print(1 + 1)"].outputs = [new_output("stream", text="3\n")]
    with pytest.raises(pytest.fail.Exception, match=r"cell 8 \('print\(1 \+ 1\)'\): printed\n3\n"):
        assert_same_outputs_but_the_exercises("99", teacher, second, exercises)
    by_source["print(1 + 1)"].outputs.append(new_output("stream", text=f"✗ x: {NOT_SOLVED}\n"))
    assert_same_outputs_but_the_exercises("99", teacher, second, exercises)  # a checker spoke


def write(nb: nbformat.NotebookNode, path: Path) -> Path:
    nbformat.write(nb, path)
    return path


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        (new_code_cell("x = 1\n### BEGIN SOLUTION\nx = 2"), "### BEGIN SOLUTION on line 2 has no"),
        (new_code_cell("x = 1\n### END SOLUTION"), "### END SOLUTION on line 2 has no"),
        (
            new_code_cell("### BEGIN SOLUTION\n### BEGIN SOLUTION\nx = 2\n### END SOLUTION"),
            "### BEGIN SOLUTION on line 2 inside the region of line 1",
        ),
        (new_code_cell("## BEGIN SOLUTION\nx = 2\n### END SOLUTION"), "line 1 '## BEGIN SOL"),
        (new_code_cell("x = 2  ### END SOLUTION"), "is not a marker"),
        (new_markdown_cell("<!-- BEGIN SOLUTION -->\nThe answer."), "has no <!-- END SOLUTION"),
        (new_markdown_cell("### BEGIN SOLUTION\nThe answer."), "is not a marker"),
    ],
)
def test_unbalanced_or_misspelt_markers_are_refused_naming_notebook_and_cell(cell, message):
    nb = new_notebook(cells=[new_markdown_cell("# title"), cell])
    with pytest.raises(student.MarkerError) as raised:
        student.student_copy(nb, "notebooks/99_broken.ipynb")
    assert str(raised.value).startswith(f"notebooks/99_broken.ipynb, cell 2 ({cell.cell_type}")
    assert message in str(raised.value)


@pytest.mark.parametrize(
    ("source", "message"),
    [
        # an indented marker outside a function: `return None` would not compile
        ("for k in range(3):\n    ### BEGIN SOLUTION\n    x = k\n    ### END SOLUTION", "'return'"),
        ("### BEGIN SOLUTION\nprint(42)\n### END SOLUTION", "assigns no name"),
    ],
)
def test_a_region_without_a_stub_that_works_asks_for_a_stub_line(source, message):
    nb = new_notebook(cells=[new_code_cell(source)])
    with pytest.raises(student.MarkerError, match=message) as raised:
        student.student_copy(nb, "99.ipynb")
    assert "add '# stub: <code>' right after ### BEGIN SOLUTION" in str(raised.value)


def test_a_stub_line_fixes_it():
    source = "for k in range(3):\n    ### BEGIN SOLUTION\n    # stub: x = None\n    x = k\n"
    copy = student.student_copy(
        new_notebook(cells=[new_code_cell(source + "### END SOLUTION")]), ""
    )
    assert copy.cells[1].source == "for k in range(3):\n    x = None  # YOUR CODE HERE"


def test_command_line_writes_copies_and_refuses_bad_markers_writing_nothing(tmp_path):
    good = write(teacher_notebook(), tmp_path / "01_good.ipynb")
    bad = write(
        new_notebook(cells=[new_code_cell("### BEGIN SOLUTION")]), tmp_path / "02_bad.ipynb"
    )
    out = tmp_path / "student"
    tool = [sys.executable, str(ROOT / "tools" / "student.py"), "--out", str(out)]
    failed = subprocess.run(
        [*tool, str(good), str(bad)], capture_output=True, text=True, timeout=60
    )
    assert failed.returncode == 1 and not out.exists()
    assert failed.stderr.strip().splitlines() == [
        f"make student: {bad}, cell 1 (code, starting '### BEGIN SOLUTION'): ### BEGIN SOLUTION "
        "on line 1 has no ### END SOLUTION after it"
    ]
    done = subprocess.run([*tool, str(good)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == f"wrote {out / '01_good.ipynb'}\n"
    assert "mask = x > 0" not in (out / "01_good.ipynb").read_text()


def solution_only_lines(nb: nbformat.NotebookNode) -> set[str]:
    """Lines (stripped) found only between solution markers of nb: what must not leak."""
    inside, outside = set(), set()
    for cell in nb.cells:
        in_region = False
        for line in cell.source.splitlines():
            text = line.strip()
            if text in (student.BEGIN, student.MD_BEGIN, student.END, student.MD_END):
                in_region = text in (student.BEGIN, student.MD_BEGIN)
            elif not text.startswith(student.STUB):
                (inside if in_region else outside).add(text)
    return inside - outside - {""}


@pytest.fixture(scope="module")
def committed_pairs(
    tmp_path_factory,
) -> list[tuple[str, nbformat.NotebookNode, nbformat.NotebookNode]]:
    """(name, teacher, student copy) for each committed notebook."""
    written = student.write_student_copies(student.NOTEBOOKS, tmp_path_factory.mktemp("student"))
    return [
        (path.name, nbformat.read(path, as_version=4), nbformat.read(copy, as_version=4))
        for path, copy in zip(student.NOTEBOOKS, written, strict=True)
    ]


def test_student_copies_of_the_committed_notebooks_keep_every_other_cell(committed_pairs):
    for name, teacher, copy in committed_pairs:
        unmarked = {
            c.id: c.source for c in teacher.cells if not student.MARKER_WORDS.search(c.source)
        }
        assert {c.id: c.source for c in copy.cells if c.id in unmarked} == unmarked, name
        assert all(not cell.get("outputs") for cell in copy.cells), name


def test_student_copies_of_the_committed_notebooks_hold_no_solution(committed_pairs):
    if not any(student.has_solutions(teacher) for _, teacher, _ in committed_pairs):
        pytest.skip("no committed notebook has ### BEGIN SOLUTION markers yet")
    for name, teacher, copy in committed_pairs:
        copy_lines = {line.strip() for cell in copy.cells for line in cell.source.splitlines()}
        assert not solution_only_lines(teacher) & copy_lines, name
        assert not student.has_solutions(copy), name


NOTEBOOKS_WITH_SOLUTIONS = [
    path for path in student.NOTEBOOKS if student.has_solutions(nbformat.read(path, as_version=4))
]


@pytest.mark.cluster
@pytest.mark.timeout(3600)
@pytest.mark.skipif(
    not NOTEBOOKS_WITH_SOLUTIONS, reason="no notebook has ### BEGIN SOLUTION markers yet"
)
@pytest.mark.parametrize("teacher_path", NOTEBOOKS_WITH_SOLUTIONS, ids=lambda path: path.stem)
def test_student_copy_runs_on_the_cluster_and_every_checker_says_not_solved(teacher_path):
    """Executed where `make student` puts it (build/student/), as a student would run it: no
    error, and after each exercise a checker prints "not solved yet" before the next exercise.

    It is also the notebook's second run on the same engines (make test runs the teacher's
    notebook once under nbval, before this): every output nbval would compare is the committed
    one, but the exercises' own and where a checker says "not solved yet". So a notebook that
    leaves state behind fails here, and so does an exercise that feeds a later cell.
    """
    if needs_hosts(teacher_path) and not hosts_up():
        pytest.skip("notebook 13 runs on the simulated hosts, and none are up (make hosts)")
    if needs_torch(teacher_path) and torch_missing():
        pytest.skip(f"notebook 16 {torch_missing()}")
    (path,) = student.write_student_copies([teacher_path], student.OUT)
    copy = nbformat.read(path, as_version=4)
    execute(copy, path.parent)  # raises CellExecutionError on the first error
    teacher = nbformat.read(teacher_path, as_version=4)
    exercise_ids = {
        c.id for c in teacher.cells if c.cell_type == "code" and student.BEGIN in c.source
    }
    assert_same_outputs_but_the_exercises(path.name, teacher, copy, exercise_ids)
    teacher_output = output_text(teacher.cells)
    pending = None  # the exercise cell whose checker has not spoken yet
    for cell in copy.cells:
        if cell.cell_type != "code":
            continue
        if cell.id in exercise_ids:
            assert pending is None, f"{path.name}: no 'not solved yet' after the exercise {pending}"
            pending = cell.source.splitlines()[0]
        printed = output_text([cell])
        if NOT_SOLVED in printed:
            pending = None
        for line in printed.splitlines():  # "not solved yet" and nothing that might solve it
            if NOT_SOLVED in line:
                assert line.rstrip().endswith(NOT_SOLVED), f"{path.name}: a stub's hint: {line}"
        for line in printed.splitlines():  # a verdict the teacher's run did not print
            if ("✗" in line or "DIFFERS" in line) and line not in teacher_output:
                assert NOT_SOLVED in line, f"{path.name}: a stub gives a wrong answer: {line}"
    assert pending is None, f"{path.name}: no 'not solved yet' after the exercise {pending}"


# What nbval leaves out of a comparison (nbval.plugin.IPyNbFile.skip_compare, images included)
NOT_COMPARED = {"metadata", "traceback", "prompt_number", "output_type", "name",
                "execution_count", "application/vnd.jupyter.widget-view+json", "image/png",
                "image/jpeg"}  # fmt: skip


def compared(outputs: list) -> dict[str, list]:
    """A cell's outputs as nbval compares them: streams joined by name, every other output's
    fields and MIME types each a list of values, what nbval skips left out."""
    fields = defaultdict(list)
    for output in transform_streams_for_comparison(coalesce_streams(deepcopy(outputs))):
        for key, value in output.items():
            if key == "data":
                for mime, data in value.items():
                    if mime not in NOT_COMPARED:
                        fields[mime].append(data)
            elif key not in NOT_COMPARED:
                fields[key].append(value)
    return dict(fields)


def assert_same_outputs_but_the_exercises(name, teacher, student_copy, exercise_ids) -> None:
    """Every output of student_copy that nbval compares in teacher equals the teacher's, but
    the exercise cells' and those in which a checker says "not solved yet"."""
    committed = {cell.id: cell for cell in teacher.cells if cell.cell_type == "code"}
    differ = []
    for index, cell in enumerate(student_copy.cells):
        reference = committed.get(cell.id)
        if (
            reference is None  # the cell that sets student mode
            or reference.execution_count is None  # never run: nbval compares nothing either
            or cell.id in exercise_ids
            or "NBVAL_IGNORE_OUTPUT" in reference.source
            or NOT_SOLVED in output_text([cell])
        ):
            continue
        if compared(cell.outputs) != compared(reference.outputs):
            differ.append(
                f"cell {index} ({cell.source.splitlines()[0][:60]!r}): printed\n"
                f"{output_text([cell])[:600]}\ncommitted:\n{output_text([reference])[:600]}"
            )
    if differ:
        pytest.fail(f"{name}, a second run on the same engines:\n" + "\n".join(differ))


def hosts_up() -> bool:
    """Whether simulated hosts are up where notebook 13 looks for them (build/hosts)."""
    from fsdp_lesson import hosts

    return hosts_are_up(hosts)


def output_text(cells: list) -> str:
    """Everything the cells printed (streams and text results), one string."""
    parts = []
    for cell in cells:
        for out in cell.get("outputs", []):
            parts.append(out.get("text") or out.get("data", {}).get("text/plain", ""))
    return "\n".join(parts)
