"""How a rank starts: with only the libraries it uses, and the launch settings (launch.py).

A command-line run leaves out the notebooks' and the bf16 run's libraries: each takes a
noticeable part of a second to import (ml_dtypes most of one), which every rank of every run
would pay (benchmarks/bench_startup.py measures the start-up). And a plain `mpiexec -n N python
-m fsdp_lesson` runs its ranks at MPI_THREAD_MULTIPLE, where a waiting rank yields its core, also
with more ranks than cores. Checked on the real path: the CLI under mpiexec.
"""

import os
import subprocess
import sys

import pytest
from mpi_helpers import MPIEXEC, mpiexec

from fsdp_lesson.launch import RANK_ENV, rank_settings

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


def test_the_launch_settings_are_one_blas_thread_and_thread_multiple_and_the_users_win():
    assert rank_settings({}) == RANK_ENV
    assert rank_settings({})["MPI4PY_RC_THREAD_LEVEL"] == "multiple"
    assert rank_settings({})["OPENBLAS_NUM_THREADS"] == "1"
    mine = {"OPENBLAS_NUM_THREADS": "2", "MPI4PY_RC_THREAD_LEVEL": "funneled"}
    assert mine.items() <= rank_settings(mine).items()  # the user's win
    # MPICH's heavy yield is not set: it made oversubscribed ranks slower (launch.py)
    assert "MPIR_CVAR_ENABLE_HEAVY_YIELD" not in rank_settings({})


# On each rank: what the CLI's start-up set, and the thread level MPI then gave, to OUT/rankR
SETTINGS_OF_A_RANK = """
import os, sys
from pathlib import Path
import fsdp_lesson.__main__
from mpi4py import MPI
blas = os.environ.get("OPENBLAS_NUM_THREADS", "unset")
level = "multiple" if MPI.Query_thread() == MPI.THREAD_MULTIPLE else "less"
Path(sys.argv[1], "rank" + os.environ["PMI_RANK"]).write_text(blas + " " + level)
"""


@pytest.mark.mpi
@pytest.mark.skipif((os.cpu_count() or 1) > 7, reason="oversubscribing needs > 8 ranks here")
def test_the_cli_launched_by_plain_mpiexec_sets_its_launch_settings_itself(tmp_path):
    n = (os.cpu_count() or 1) + 1  # more ranks than cores, where yielding matters
    command = [MPIEXEC, "-n", str(n), sys.executable, "-c", SETTINGS_OF_A_RANK, str(tmp_path)]
    plain = {k: v for k, v in os.environ.items() if k not in RANK_ENV}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=plain)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(n):
        assert (tmp_path / f"rank{rank}").read_text() == "1 multiple"
