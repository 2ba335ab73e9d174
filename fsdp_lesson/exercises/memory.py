"""Notebook 07's planning checkers: the GPUs a 70 B model needs (exercise 2) and from which N
each stage fits (exercise 3). The expected answers are searches over N with `plan.state_bytes`
(mixed-precision Adam), so the formula the learner writes appears nowhere in the notebook."""

from __future__ import annotations

import math
from collections.abc import Callable

from fsdp_lesson import plan
from fsdp_lesson.checks import check, fail, how_wrong

GPU_40 = 40 * 2**30  # what a GPU sold as "40 GB" holds: 40 GiB


def per_gpu(stage: str, psi: float, n: int) -> float:
    """Bytes of model state per GPU (params, grads, optimizer) with mixed-precision Adam."""
    return sum(plan.state_bytes(stage, psi, n, plan.MIXED_ADAM).values())


def searched_n(stage: str, psi: float, gpu_bytes: float, most: int = 100_000) -> float:
    """The smallest N whose per-GPU model state fits gpu_bytes, by trying every N; math.inf."""
    return next((n for n in range(1, most) if per_gpu(stage, psi, n) <= gpu_bytes), math.inf)


def check_smallest_n_70b(answer) -> bool:
    """Exercise 2: the smallest N for 70 B parameters under ZeRO-3 on a "40 GB" GPU."""
    name = "smallest N for 70B under zero3 on 40 GB"
    expected = searched_n("zero3", 70e9, GPU_40)
    if answer is not None and answer != expected and answer == searched_n("zero3", 70e9, 40e9):
        return fail(
            f"✗ {name}: that N is for 40 × 10⁹ bytes per GPU; a GPU sold as 40 GB holds"
            " 40 GiB, 40 × 2³⁰ bytes"
        )
    return check(
        name,
        answer,
        expected,
        hint="ZeRO-3 divides all of the model state by N; N is a whole number of GPUs",
    )


def check_smallest_n(smallest_n: Callable) -> bool:
    """Exercise 3: smallest_n(stage, psi, gpu_bytes) against a search over N, for every stage,
    three model sizes and two GPUs; the first case that differs is named, and how."""
    hint = (
        "from the ZeRO table: which part does the stage keep whole on every GPU, which part"
        " does it divide by N?"
    )
    cases = [
        (s, p, g)
        for s in plan.PLANNED
        for p in (1.3e9, 7e9, 70e9)
        for g in (40 * 2**30, 80 * 2**30)
    ]
    answers = [smallest_n(*case) for case in cases]
    expected = [searched_n(*case) for case in cases]
    for (stage, psi, gpu), answer, want in zip(cases, answers, expected, strict=True):
        if answer is None or answer == want:
            continue  # a placeholder: check() below says so
        if math.inf in (answer, want):
            how = (
                "a finite N, where the part kept whole does not fit by itself"
                if want == math.inf
                else "math.inf, where some N fits"
            )
        else:
            how = how_wrong(answer, want)
        return fail(
            f"✗ smallest_n: {stage}, Ψ = {psi / 1e9:g} B, {gpu // 2**30} GiB: {how} — {hint}"
        )
    return check("smallest_n", answers, expected, hint=hint)


def check_bytes_per_rank(
    bytes_per_rank: Callable, model_config, configs: dict, peaks: dict, n: int
) -> bool:
    """Exercise 4: bytes_per_rank(stage, sizes, n, precision) against every rank's live zero3
    ledger of 07's section 5.1 (`configs` by name, `peaks`: each one's ledgers by rank), and
    dp, zero1 and zero2 at N = n against the planner (`plan.ledger_bytes`, equal to the ledger
    in 07's section 1), fp32 and bf16."""
    from fsdp_lesson.checks import check_bytes

    sizes, cases = plan.layer_sizes(model_config), {}
    for name, config in configs.items():
        cases[name] = (bytes_per_rank("zero3", sizes, n, config.precision), peaks[name])
    for stage in ("dp", "zero1", "zero2"):
        for precision in ("fp32", "bf16"):
            planned = plan.ledger_bytes(stage, model_config, n, "adam", 32, precision=precision)
            cases[f"{stage} {precision}"] = (bytes_per_rank(stage, sizes, n, precision), [planned])
    return check_bytes("bytes_per_rank", cases)
