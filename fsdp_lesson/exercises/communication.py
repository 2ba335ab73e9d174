"""Notebook 08's checkers: the batch that hides a stage's communication (exercise 2, expected
from `plan.step_seconds`) and a collective's time from α and β (exercise 4, expected from
`commbench.predict_seconds`), computed here, so the learner's cell shows only the call."""

from __future__ import annotations

from collections.abc import Callable

from fsdp_lesson import commbench, plan
from fsdp_lesson.checks import check

PSI = 1e9  # any Ψ: the batch does not depend on it


def batch_that_hides(stage: str, n: int, flops: float, bandwidth: float) -> float:
    """The batch per GPU at which 6·b·Ψ / flops equals plan.step_seconds (2-byte elements)."""
    return plan.step_seconds(stage, PSI, n, bandwidth) * flops / (6 * PSI)


def check_hiding_batch(hiding_batch: Callable) -> bool:
    """dp and zero3 on an A100-like and an H100-like GPU, 25, 50 and 450 GB/s, N = 8 and 512;
    one verdict per stage, so that it names the stage that is wrong."""
    for stage in ("dp", "zero3"):
        cases = [
            (stage, n, f, w)
            for n in (8, 512)
            for f, w in ((312e12, 25e9), (989e12, 50e9), (989e12, 450e9))
        ]
        if not check(
            f"hiding_batch ({stage})",
            [hiding_batch(*case) for case in cases],
            [batch_that_hides(*case) for case in cases],
            atol=1e-6,
            hint="set the compute time equal to the communication time and solve for"
            " the batch; count the bytes of each collective of the stage",
        ):
            return False
    return True


KINDS = ("allreduce", "allgather", "reduce_scatter")


def check_ring_call_seconds(ring_call_seconds: Callable, runs: dict, line: dict) -> bool:
    """Exercise 4: ring_call_seconds(line, kind, n, calls, buffer_bytes) for the calls and
    buffer bytes of every kind on every rank of `runs` ((model, N, strategy) -> the ranks'
    traffic reports), against `commbench.predict_seconds` of the same reports with `line`;
    one verdict per kind, so that it names the kind that is wrong."""
    yours: dict[str, list] = {kind: [] for kind in KINDS}
    expected: dict[str, list] = {kind: [] for kind in KINDS}
    for (_, n, _), reports in runs.items():
        for report in reports:
            predicted = commbench.predict_seconds(report, dict.fromkeys(KINDS, line))
            for kind in KINDS:
                t = report[kind]
                yours[kind].append(ring_call_seconds(line, kind, n, t["calls"], t["buffer_bytes"]))
                expected[kind].append(predicted[kind])
    for kind in KINDS:
        if not check(
            f"ring_call_seconds ({kind})",
            yours[kind],
            expected[kind],
            atol=1e-12,
            hint="per call N-1 messages of F/N bytes; an allreduce sends twice that",
        ):
            return False
    return True
