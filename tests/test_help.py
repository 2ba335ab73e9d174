"""Every command's --help: it names every subcommand, and no helper script ends in a traceback."""

import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_lesson.__main__ import build_parser

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = sorted((ROOT / "benchmarks").glob("bench_*.py"))


def test_the_command_lines_help_names_every_subcommand():
    result = subprocess.run(
        [sys.executable, "-m", "fsdp_lesson", "--help"], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    (commands,) = [a for a in build_parser()._actions if a.dest == "command"]
    description = build_parser().description
    for name in commands.choices:
        assert name in description, f"the first line of --help does not name {name!r}"
        assert f"\n    {name} " in result.stdout, f"--help does not list {name!r}"


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda path: path.stem)
def test_every_benchmark_answers_help_without_running(script):
    result = subprocess.run(
        [sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stdout.startswith("usage: "), result.stdout[:200]
