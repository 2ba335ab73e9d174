"""Student copies of the notebooks: every solution replaced by a stub, outputs cleared.

    python tools/student.py                       notebooks/*.ipynb -> build/student/
    python tools/student.py NB.ipynb ... [--out DIR]

How a teacher notebook marks a solution: nbgrader's markers, each alone on its line and
indented like the code around it. A function exercise marks the function's body, a value
exercise the assignment; the checker's call stays outside the markers:

    def relu_backward(x, dout):
        # dL/dx of out = max(x, 0), given x and dout = dL/d(out)
        ### BEGIN SOLUTION
        return dout * (x > 0)
        ### END SOLUTION

    _ = check("relu_backward", relu_backward(x_try, dout_try), expected)

    ### BEGIN SOLUTION
    rows_of_rank_2 = [b for b in range(32) if b % 8 == 2]
    ### END SOLUTION
    _ = check("rank 2 of 8", rows_of_rank_2, rank_slice(np.arange(32), 2, 8))

In the student copy these become `return None  # YOUR CODE HERE` (in the function) and
`rows_of_rank_2 = None  # YOUR CODE HERE`, and both checkers print "not solved yet".

The stub that replaces a region is a placeholder the checkers report as "not solved yet"
(fsdp_lesson.checks.not_solved), so no later cell breaks; at the BEGIN marker's indentation:
  1. the lines `# stub: CODE` that open the region, if any: CODE each (`# stub: return None, None`
     for a function that returns a pair); `  # YOUR CODE HERE` is added to a CODE without a comment;
  2. else, inside a function (an indented marker): `return None  # YOUR CODE HERE`;
  3. else (top level): `NAME = None  # YOUR CODE HERE` for each NAME the region assigns.
A stub that would not compile where the solution did is refused: add a `# stub:` line there.
A markdown solution sits between the lines `<!-- BEGIN SOLUTION -->` and `<!-- END SOLUTION -->`
and is dropped (and its cell with it, when nothing else is left). Outputs, execution counts and
timings are cleared. Unbalanced or misspelt markers stop the tool with one line naming the
notebook and the cell.

Why not nbgrader's ClearSolutions: nbgrader installs cleanly, but its preprocessor puts one
stub into every region (by default `raise NotImplementedError()`, which stops the cell and
every later cell using the name), drops a stray END marker silently, names neither notebook nor
cell when it fails, and requires nbgrader's cell metadata unless told otherwise. The markers are
nbgrader's, so an instructor can still run `nbgrader generate_assignment` on these notebooks
(the `# stub:` lines are inside the regions, which nbgrader drops).
"""

from __future__ import annotations

import argparse
import ast
import copy
import re
import sys
import textwrap
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
OUT = ROOT / "build" / "student"

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"  # code cells
MD_BEGIN, MD_END = "<!-- BEGIN SOLUTION -->", "<!-- END SOLUTION -->"  # markdown cells
STUB = "# stub:"
YOUR_CODE = "# YOUR CODE HERE"
MARKER_WORDS = re.compile(r"(BEGIN|END) SOLUTION")
# The first code cell of every student copy: in the teacher's notebooks a failed checker raises
# (fsdp_lesson.checks.STRICT); here a wrong or missing answer prints ✗ and the notebook goes on.
# It loads numpy (through checks) before the notebook's own first cell, so it sets first what
# that cell sets before numpy loads (02, 10): one BLAS thread, without which a busy machine runs
# notebook 02's 25,000 steps many times slower (900 s and more at load 30).
STUDENT_MODE = (
    "# A student copy: a checker that finds a wrong or missing answer prints ✗ and goes on.\n"
    "import os\n"
    "\n"
    'os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # before numpy loads: tiny matrices\n'
    "\n"
    "from fsdp_lesson import checks\n"
    "\n"
    "checks.STRICT = False"
)


class MarkerError(ValueError):
    """A solution region that cannot be stripped; the message says where and how to fix it."""


def regions(lines: list[str], begin: str, end: str, where: str) -> list[tuple[int, int]]:
    """(begin, end) line indices of each region; MarkerError unless the markers pair up."""
    found, start = [], None
    for i, line in enumerate(lines):
        text = line.strip()
        if text == begin:
            if start is not None:
                raise MarkerError(
                    f"{where}: {begin} on line {i + 1} inside the region of line "
                    f"{start + 1}; close that one with {end} first"
                )
            start = i
        elif text == end:
            if start is None:
                raise MarkerError(f"{where}: {end} on line {i + 1} has no {begin} before it")
            found.append((start, i))
            start = None
        elif MARKER_WORDS.search(line):
            raise MarkerError(
                f"{where}: line {i + 1} {text!r} is not a marker; write "
                f"{begin} or {end} alone on its line"
            )
    if start is not None:
        raise MarkerError(f"{where}: {begin} on line {start + 1} has no {end} after it")
    return found


def assigned_names(code: str, where: str) -> list[str]:
    """The names a top-level region assigns (a, b = ... gives a and b), in order."""
    try:
        tree = ast.parse(textwrap.dedent(code))
    except SyntaxError as err:
        raise MarkerError(
            f"{where}: the solution is not plain Python ({err.msg}); "
            f"add '{STUB} <code>' right after {BEGIN}"
        ) from None
    names: list[str] = []

    def collect(target: ast.expr) -> None:
        if isinstance(target, ast.Name) and target.id not in names:
            names.append(target.id)
        elif isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                collect(element)
        elif isinstance(target, ast.Starred):
            collect(target.value)

    for node in tree.body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                collect(target)
        elif isinstance(node, ast.AnnAssign):
            collect(node.target)
    if not names:
        raise MarkerError(
            f"{where}: the solution assigns no name to stub with None; "
            f"add '{STUB} <code>' right after {BEGIN}"
        )
    return names


def stub(body: list[str], indent: str, where: str) -> list[str]:
    """The lines that replace one region's body (see the module's docstring for the rule)."""
    hints = []
    for line in body:
        if not line.strip().startswith(STUB):
            break
        code = line.strip()[len(STUB) :].strip()
        hints.append(code if "#" in code else f"{code}  {YOUR_CODE}".strip())
    if hints:
        return [indent + code for code in hints]
    if indent:
        return [f"{indent}return None  {YOUR_CODE}"]
    return [f"{name} = None  {YOUR_CODE}" for name in assigned_names("\n".join(body), where)]


def python_of(source: str) -> str | None:
    """The Python a cell runs: a %%px cell's body, line magics as IPython rewrites them;
    None for another cell magic."""
    from IPython.core.inputtransformer2 import TransformerManager

    if source.startswith("%%"):
        magic, _, source = source.partition("\n")
        if magic.split()[0] != "%%px":
            return None
    return TransformerManager().transform_cell(source)


def syntax_error(source: str) -> SyntaxError | None:
    code = python_of(source)
    try:
        compile(code or "", "<cell>", "exec")
    except SyntaxError as err:
        return err
    return None


def strip_code(source: str, where: str) -> str:
    """source with each region replaced by its stub; MarkerError if that breaks its syntax."""
    lines = source.split("\n")
    found = regions(lines, BEGIN, END, where)
    if not found:
        return source
    out, last = [], 0
    for begin, end in found:
        indent = lines[begin][: len(lines[begin]) - len(lines[begin].lstrip())]
        out += lines[last:begin] + stub(lines[begin + 1 : end], indent, where)
        last = end + 1
    stripped = "\n".join(out + lines[last:])
    err = syntax_error(stripped)
    if err is not None and syntax_error(source) is None:
        raise MarkerError(
            f"{where}: the stubbed cell does not compile ({err.msg}, line "
            f"{err.lineno}); add '{STUB} <code>' right after {BEGIN}"
        )
    return stripped


def strip_markdown(source: str, where: str) -> str:
    """source without its regions (markers included)."""
    lines = source.split("\n")
    keep = [True] * len(lines)
    for begin, end in regions(lines, MD_BEGIN, MD_END, where):
        keep[begin : end + 1] = [False] * (end + 1 - begin)
    return "\n".join(line for line, kept in zip(lines, keep, strict=True) if kept)


def student_copy(nb: nbformat.NotebookNode, name: str) -> nbformat.NotebookNode:
    """A copy of nb with solutions stubbed (code) or dropped (markdown), outputs cleared, and
    the checkers set to go on after a failure (STUDENT_MODE, before the first code cell)."""
    student = copy.deepcopy(nb)
    cells = []
    for number, cell in enumerate(student.cells, start=1):
        first_line = cell.source.strip().split("\n")[0][:60]
        where = f"{name}, cell {number} ({cell.cell_type}, starting {first_line!r})"
        cell.metadata.pop("execution", None)  # timings of the teacher's run
        if cell.cell_type == "code":
            source = strip_code(cell.source, where)
            cell.outputs, cell.execution_count = [], None
        elif cell.cell_type == "markdown":
            source = strip_markdown(cell.source, where)
            if not source.strip():
                continue  # the cell held only a solution
        else:
            source = cell.source
        if source != cell.source:  # a stub is for the student to see: never hidden
            cell.metadata.pop("jupyter", None)
            cell.metadata.pop("collapsed", None)
            cell.source = source
        cells.append(cell)
    first_code = next((i for i, cell in enumerate(cells) if cell.cell_type == "code"), len(cells))
    cells.insert(first_code, nbformat.v4.new_code_cell(STUDENT_MODE))
    student.cells = cells
    return student


def has_solutions(nb: nbformat.NotebookNode) -> bool:
    """True if a cell of nb holds a solution marker."""
    return any(
        cell.cell_type in ("code", "markdown") and MARKER_WORDS.search(cell.source)
        for cell in nb.cells
    )


def write_student_copies(notebooks: list[Path], out: Path) -> list[Path]:
    """Write a student copy of each notebook to out/ (same file name); return their paths.

    Every notebook is checked before any is written, so a marker error leaves out/ as it was.
    """
    copies = {}
    for path in notebooks:
        name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        copies[path.name] = student_copy(nbformat.read(path, as_version=4), str(name))
    out.mkdir(parents=True, exist_ok=True)
    for file_name, nb in copies.items():
        nbformat.write(nb, out / file_name)
    return [out / file_name for file_name in copies]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: notebooks/*.ipynb")
    parser.add_argument("--out", type=Path, default=OUT, help=f"default: {OUT.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    notebooks = [path.resolve() for path in args.notebooks] or NOTEBOOKS
    try:
        written = write_student_copies(notebooks, args.out.resolve())
    except MarkerError as err:
        print(f"make student: {err}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
