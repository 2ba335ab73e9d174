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
# the alpha-beta lines fitted to its timings (fits[N]) and the seconds inside a run's collectives.
VOLATILE = re.compile(
    r"perf_counter|time\.|step_seconds|cpu_count|progress=|tracemalloc|rss|getpid|%%?px"
    r"|subprocess|RankError|connect\(|history\.(names|samples|val_loss)|\[\"names\"\]"
    r"|^import matplotlib|commbench|fits\[|\[\"seconds\"\]",
    re.MULTILINE,
)


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
