"""The environment every rank of this project is launched with, and why: one place.

The launchers (`make run/test/lab` through tools/lesson.py, the cluster `connect()` starts,
tools/execute_notebooks.py) start ranks with `rank_env()`. Each setting must be in the
environment before the rank's numpy or MPI loads (both read it once, at load), which is why
it is set by whoever starts the process, not when this package is imported. A value the user
already set wins.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

RANK_ENV: dict[str, str] = {
    # The lesson's matrices are small and every core already runs a rank: BLAS threads would
    # only add overhead and fight the ranks for the cores.
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def rank_settings(base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """RANK_ENV's variables with their values for a launch: base's value where base has one."""
    return {name: base.get(name, value) for name, value in RANK_ENV.items()}


def rank_env(base: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The whole environment to launch a rank with: base plus RANK_ENV where base has none."""
    return {**base, **rank_settings(base)}
