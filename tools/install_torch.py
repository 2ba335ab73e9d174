"""What `make torch` does: install the optional torch extra (PyTorch's CPU build) into this venv.

pip first resolves the extra without installing (--dry-run --report); when what it would take
is PyTorch's CUDA build (its nvidia-* packages, several GB), nothing is installed and one line
says how to get the CPU build instead. The course is tested with torch 2.13.0's CPU wheel, the
one pip finds on the course's machines (docs/pytorch.md).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIP = [sys.executable, "-m", "pip", "install", "--quiet", "-e", f"{ROOT}[torch]"]
CPU_ADVICE = (
    "pip would install PyTorch's CUDA build ({packages}, several GB): install the CPU build "
    "first, pip install torch==2.13.0 --index-url <PyTorch's CPU wheel index, from pytorch.org's "
    "install page>, then run make torch again"
)


def would_install() -> list[str]:
    """The distributions pip would install for the extra, as name==version."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([*PIP, "--dry-run", "--report", str(report)], check=True)
        items = json.loads(report.read_text())["install"]
    return [f"{item['metadata']['name']}=={item['metadata']['version']}" for item in items]


def main() -> int:
    planned = would_install()
    cuda = [name for name in planned if name.lower().startswith("nvidia")]
    if cuda:
        print(CPU_ADVICE.format(packages=", ".join(cuda[:2] + ["..."])), file=sys.stderr)
        return 1
    start = time.perf_counter()
    subprocess.run(PIP, check=True)
    import torch  # the one just installed

    others = [name for name in planned if not name.startswith(("torch==", "fsdp-lesson=="))]
    print(
        f"installed torch {torch.__version__} (CUDA: {torch.version.cuda}) with "
        f"{', '.join(others) or 'nothing else'} in {time.perf_counter() - start:.0f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
