"""Re-execute notebooks in place, as they are committed: top to bottom in a fresh kernel.

    python tools/execute_notebooks.py notebooks/02_single_rank_mlp.ipynb [...]

Run it after a change that alters what a notebook prints, then check with nbval. Cluster
notebooks start their own cluster (fsdp_lesson.cluster.connect) unless one is running.
"""

import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from fsdp_lesson.launch import rank_settings


def execute(nb: nbformat.NotebookNode, folder: Path) -> None:
    """Run every cell of nb in a fresh kernel whose working directory is `folder`."""
    NotebookClient(
        nb,
        timeout=900,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(folder)}},
        extra_arguments=["--IPKernelApp.log_level=ERROR"],  # no notice about TCP on stderr
    ).execute()


if __name__ == "__main__":
    os.environ.setdefault("IPP_NONINTERACTIVE", "1")  # as under CI: no progress lines in outputs
    os.environ.update(rank_settings())  # the kernels and their clusters' engines inherit it
    for name in sys.argv[1:]:
        path = Path(name).resolve()
        nb = nbformat.read(path, as_version=4)
        execute(nb, path.parent)
        nbformat.write(nb, path)
        print(f"executed {path.name}")
