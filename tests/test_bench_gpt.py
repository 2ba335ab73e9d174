"""benchmarks/bench_gpt.py runs end to end on a tiny transformer and prints a row per strategy
(figures only: nothing here asserts on time)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.mpi

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_gpt.py"


def test_bench_gpt_quick_prints_every_strategy_beside_its_floor():
    tiny = ["--emb", "16", "--hidden", "64", "--layers", "1", "--heads", "4"]
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", *tiny],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    labels = {"single", "dp", "zero1", "zero2", "zero3", "tp=2"}
    rows = {f[0]: f[1:] for f in map(str.split, out.splitlines()) if f and f[0] in labels}
    assert set(rows) == labels, out
    for label, fields in rows.items():
        megabytes, matmul, bytes_ms, floor, step, ratio = map(float, fields[:6])
        assert min(megabytes, matmul, floor, step, ratio) > 0 and bytes_ms >= 0, (label, out)
    assert "load average" in out and "Model name" not in out


def test_bench_gpt_help_is_no_traceback():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True
    )
    assert "floor" in out.stdout and not out.stderr
