"""environment.yml (conda) and pyproject.toml (pip) must ask for the same packages."""

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def names(requirements) -> dict[str, str]:
    """{'mpi4py': '>=4', ...} from requirement strings (markers and extras ignored)."""
    out = {}
    for req in requirements:
        match = re.match(r"\s*([A-Za-z0-9_.\-]+)\s*([<>=!~].*)?$", req)
        if match:
            out[match.group(1).lower()] = (match.group(2) or "").replace(" ", "")
    return out


def test_conda_and_pip_dependencies_agree():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pip = names(pyproject["project"]["dependencies"])
    text = (ROOT / "environment.yml").read_text()
    dependencies = text.split("dependencies:")[1].splitlines()
    conda = names(line.strip()[2:] for line in dependencies if re.match(r"^  - [a-z]", line))
    assert conda.pop("python") == pyproject["project"]["requires-python"]
    conda.pop("pip")
    assert conda == pip, f"environment.yml {conda} != pyproject.toml {pip}"
