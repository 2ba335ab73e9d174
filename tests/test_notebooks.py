"""The committed notebooks: nbval compares every output except those that really vary."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# What makes an output vary from run to run, as code: time, progress lines, process ids,
# tracemalloc and RSS, %px/%%px (engine order), subprocesses, which rank answers first, the
# cluster's address, long float32 training (its last digits depend on the CPU's kernels),
# the first matplotlib import (a one-time font-cache notice), and timed collectives: commbench,
# the alpha-beta lines fitted to its timings (fits[N]) and the seconds inside a run's collectives,
# rounding residues (checks.residue: their digits depend on the CPU's BLAS kernels), and a
# pipeline's measured idle fractions (bubbles[M], from its ops' perf_counter spans).
VOLATILE = re.compile(
    r"perf_counter|time\.|step_seconds|cpu_count|progress=|tracemalloc|rss|getpid|%%?px"
    r"|subprocess|RankError|connect\(|history\.(names|samples|val_loss)|\[\"names\"\]"
    r"|^import matplotlib|commbench|fits\[|\[\"seconds\"\]|residue\(|bubbles\[",
    re.MULTILINE,
)
# A printed rounding residue ("max diff 7e-11", "relative error 3e-10"): its digits differ from
# one CPU's kernels to another's, so no output nbval compares may hold one.
RESIDUE = re.compile(r"(diff|differ\w*|error|residue)\D{0,25}\d(\.\d+)?e-\d+", re.IGNORECASE)
# What a failed check prints (fsdp_lesson.checks): a teacher's notebook never shows one.
FAILED = re.compile(r"^\s*✗|not solved yet|claim does not hold", re.MULTILINE)


def ignored_cells():
    for path in NOTEBOOKS:
        for index, cell in enumerate(json.loads(path.read_text())["cells"]):
            source = "".join(cell["source"])
            if cell["cell_type"] == "code" and "NBVAL_IGNORE_OUTPUT" in source:
                yield pytest.param(path.name, index, source, id=f"{path.stem}-cell{index}")


@pytest.mark.parametrize("name, index, source", list(ignored_cells()))
def test_every_ignored_cell_is_volatile_and_says_why(name, index, source):
    lines = source.splitlines()
    assert lines[0] == "# NBVAL_IGNORE_OUTPUT", "the marker is the first line"
    assert lines[1].startswith("# ("), "the second line says why the output varies"
    assert "getsource" not in source, "printed source is deterministic: nbval must compare it"
    code = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    assert VOLATILE.search(code), "nothing in this cell varies from run to run"


def test_notebooks_are_ruff_clean():
    """The notebooks' code is held to the package's lint rules (pyproject.toml)."""
    ruff = Path(sys.executable).parent / "ruff"
    result = subprocess.run(
        [str(ruff), "check", "notebooks"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 0, result.stdout[-3000:]


def compared_outputs():
    """(notebook, cell index, text) of every output nbval compares."""
    for path in NOTEBOOKS:
        for index, cell in enumerate(json.loads(path.read_text())["cells"]):
            source = "".join(cell["source"])
            if cell["cell_type"] != "code" or "NBVAL_IGNORE_OUTPUT" in source:
                continue
            for output in cell.get("outputs", []):
                text = "".join(output.get("text", "")) + "".join(
                    output.get("data", {}).get("text/plain", "")
                )
                yield path.name, index, output, text


def test_no_compared_output_prints_a_rounding_residue():
    found = [
        f"{name} cell {index}: {match.group(0)!r}"
        for name, index, _, text in compared_outputs()
        for match in RESIDUE.finditer(text)
        if not re.search(r"than|within", match.group(0))  # a tolerance is not a residue
    ]
    assert not found, "print the verdict against the tolerance instead:\n" + "\n".join(found)


def test_no_committed_output_shows_a_failure():
    """A teacher's notebook shows every checker passing, no error and no unsolved exercise."""
    found = []
    for path in NOTEBOOKS:
        for index, cell in enumerate(json.loads(path.read_text())["cells"]):
            for output in cell.get("outputs", []) if cell["cell_type"] == "code" else []:
                text = "".join(output.get("text", "")) + "".join(
                    output.get("data", {}).get("text/plain", "")
                )
                if output["output_type"] == "error" or FAILED.search(text):
                    found.append(f"{path.name} cell {index}: {output.get('ename') or text[:120]}")
    assert not found, "\n".join(found)
