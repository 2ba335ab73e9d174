"""A command-line run loads only what it uses: the notebooks' and the bf16 run's libraries stay out.

Each of these takes a noticeable part of a second to import (ml_dtypes most of one), which every
rank of every run would pay at start-up; benchmarks/bench_startup.py measures the start-up
itself. Checked on the real path: `mpiexec -n 2`, zero3, the CLI's main().
"""

import pytest
from mpi_helpers import mpiexec

# what the notebooks (plots, the cluster), bench, bf16 and `data build` use; a fp32 run does not
NOT_FOR_A_TRAINING_RUN = ("matplotlib", "ipyparallel", "IPython", "psutil", "ml_dtypes", "pandas")

# On each rank: the CLI's main(), then the top-level packages loaded, one a line, to OUT/rankR
RUN_AND_LIST_MODULES = """
import os, sys
from pathlib import Path
from fsdp_lesson.__main__ import main
status = main(["train", "--strategy", "zero3", "--steps", "2", "--eval-batches", "1",
               "--samples", "1"])
loaded = sorted({name.split(".")[0] for name in sys.modules})
Path(sys.argv[1], "rank" + os.environ["PMI_RANK"]).write_text("\\n".join(loaded))
sys.exit(status)
"""


@pytest.mark.mpi
def test_a_training_run_imports_no_notebook_or_optional_library(tmp_path):
    result = mpiexec(2, "-c", RUN_AND_LIST_MODULES, str(tmp_path), timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):
        modules = (tmp_path / f"rank{rank}").read_text().splitlines()
        assert "mpi4py" in modules  # the list is real: the run used MPI
        unused = sorted(set(NOT_FOR_A_TRAINING_RUN) & set(modules))
        assert not unused, f"a training run imported {unused}: import them where they are used"
