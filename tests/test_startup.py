"""How a rank starts: with only the libraries it uses, and the launch settings (launch.py).

A command-line run leaves out the notebooks' and the bf16 run's libraries: each takes a
noticeable part of a second to import (ml_dtypes most of one), which every rank of every run
would pay (benchmarks/bench_startup.py measures the start-up). And a plain `mpiexec -n N python
-m fsdp_lesson` with more ranks than cores makes its waiting ranks sleep. Checked on the real
path: the CLI under mpiexec.
"""

import os
import subprocess
import sys

import pytest
from mpi_helpers import MPIEXEC, mpiexec

from fsdp_lesson.launch import OVERSUBSCRIBED_ENV, rank_settings

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


def test_waiting_ranks_sleep_only_when_there_are_more_ranks_than_cores():
    cores = os.cpu_count() or 1
    assert OVERSUBSCRIBED_ENV.items() <= rank_settings({}, ranks_here=cores + 1).items()
    assert not OVERSUBSCRIBED_ENV.keys() & rank_settings({}, ranks_here=cores).keys()
    assert rank_settings({}, ranks_here=cores)["MPI4PY_RC_THREAD_LEVEL"] == "multiple"
    mine = {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "0", "MPI4PY_RC_THREAD_LEVEL": "funneled"}
    assert mine.items() <= rank_settings(mine, ranks_here=cores + 1).items()  # the user's win


# On each rank: what the CLI's start-up set, and the thread level MPI then gave, to OUT/rankR
SETTINGS_OF_A_RANK = """
import os, sys
from pathlib import Path
import fsdp_lesson.__main__
from mpi4py import MPI
heavy = os.environ.get("MPIR_CVAR_ENABLE_HEAVY_YIELD", "unset")
level = "multiple" if MPI.Query_thread() == MPI.THREAD_MULTIPLE else "less"
Path(sys.argv[1], "rank" + os.environ["PMI_RANK"]).write_text(heavy + " " + level)
"""


@pytest.mark.mpi
@pytest.mark.skipif((os.cpu_count() or 1) > 7, reason="oversubscribing needs > 8 ranks here")
@pytest.mark.parametrize("extra_ranks, heavy", [(0, "unset"), (1, "1")])
def test_the_cli_launched_by_plain_mpiexec_sets_heavy_yield_only_when_oversubscribed(
    tmp_path, extra_ranks, heavy
):
    n = (os.cpu_count() or 1) + extra_ranks
    command = [MPIEXEC, "-n", str(n), sys.executable, "-c", SETTINGS_OF_A_RANK, str(tmp_path)]
    plain = {k: v for k, v in os.environ.items() if k not in rank_settings({}, n)}
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, env=plain)
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in range(n):
        assert (tmp_path / f"rank{rank}").read_text() == f"{heavy} multiple"
