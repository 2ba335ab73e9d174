"""Notebook 08's checkers: the bytes per step by collective (exercise 1, expected from what
`Comm` counts on the engines), the batch that hides a stage's communication (exercise 2,
expected from `plan.step_seconds`), the allgather calls per step (exercise 3, counted on the
engines) and a collective's time from α and β (exercise 4, expected from
`commbench.predict_seconds`), computed here, so the learner's cell shows only the call."""

from __future__ import annotations

import math
from collections.abc import Callable

from fsdp_lesson import commbench, plan
from fsdp_lesson.checks import check, fail, how_wrong, not_solved

PSI = 1e9  # any Ψ: the batch does not depend on it


def batch_that_hides(stage: str, n: int, flops: float, bandwidth: float) -> float:
    """The batch per GPU at which 6·b·Ψ / flops equals plan.step_seconds (2-byte elements)."""
    return plan.step_seconds(stage, PSI, n, bandwidth) * flops / (6 * PSI)


def _traffic(
    strategy: str,
    sizes: list[int],
    n: int,
    *,
    pad: bool = True,
    ring: bool = True,
    element: int = 4,
    passes: dict | None = None,
) -> dict:
    """Exercise 1's bytes per step (ring model, the loss left out), or a usual mistake's:
    no padding, no (N-1)/N, 2-byte elements, other passes per kind."""
    share = (n - 1) / n if ring else 1.0
    count = {"dp": (2, 0, 0), "zero1": (0, 1, 1), "zero2": (0, 1, 1), "zero3": (0, 2, 1)}
    counts = dict(zip(("allreduce", "allgather", "reduce_scatter"), count[strategy], strict=True))
    counts.update((passes or {}).get(strategy, {}))
    padded = sum(-(-s // n) * n for s in sizes) if pad and strategy != "dp" else sum(sizes)
    return {kind: k * share * element * padded for kind, k in counts.items()}


TRAFFIC_MISTAKES = (  # (what _traffic is told, what the line says)
    ({"pad": False}, "the unpadded size: the sharded stages pad every layer to a multiple of N"),
    ({"ring": False}, "too large by N/(N-1): a ring sends (N-1)/N of a buffer per pass"),
    ({"element": 2}, "too small by a factor of 2: the package's gradients are float32, 4 bytes"),
    ({"passes": {"dp": {"allreduce": 1}}}, "too small by a factor of 2: an allreduce is a"
     " reduce-scatter and an allgather, two passes"),
    ({"passes": {"zero3": {"allgather": 1}}}, "too small by a factor of 2: zero3 gathers every"
     " layer in forward and again in backward"),
)  # fmt: skip


def _traffic_how(
    yours: float, counted: float, strategy: str, kind: str, sizes, n, whole: str | None
) -> str:
    """A usual mistake by name (the one the whole answer makes, `whole`, when it fits here;
    else the only one that fits), else how_wrong's words."""
    fits = [words for told, words in TRAFFIC_MISTAKES
            if math.isclose(yours, value := _traffic(strategy, sizes, n, **told)[kind],
                            rel_tol=1e-9) and not math.isclose(value, counted)]  # fmt: skip
    if whole in fits:
        return whole
    return fits[0] if len(fits) == 1 else how_wrong(yours, counted)


def _whole_mistake(answers: dict, sizes, n) -> str | None:
    """The usual mistake that every strategy's answer makes, if one does."""
    for told, words in TRAFFIC_MISTAKES:
        if all(math.isclose(answer.get(kind, 0.0), value, rel_tol=1e-9, abs_tol=1e-6)
               for strategy, answer in answers.items()
               for kind, value in _traffic(strategy, sizes, n, **told).items()):  # fmt: skip
            return words
    return None


def check_traffic(ranks, traffic_per_step: Callable) -> bool:
    """Exercise 1: traffic_per_step(strategy, layer_sizes, n) for every strategy of
    `bench.STRATEGIES` on a model the notebook does not show, against every rank's `Comm` count
    per kind over two Adam steps (the logged loss's allreduce taken out); one line per
    strategy and kind that differs (on every rank, or the rank named), a usual mistake by name."""
    from fsdp_lesson.bench import STRATEGIES
    from fsdp_lesson.cluster import run_on_engine
    from fsdp_lesson.config import ModelConfig, TrainConfig

    config, k, steps = ModelConfig(layers=2, hidden=50, emb=10), ranks.n, 2
    sizes = plan.layer_sizes(config)
    loss = 2 * (k - 1) / k * 8  # the logged loss's float64 allreduce, per step
    answers = {strategy: traffic_per_step(strategy, sizes, k) for strategy in STRATEGIES}
    if any(answer is None for answer in answers.values()):
        return check("traffic_per_step", None, None)  # the placeholder: "not solved yet"
    whole, wrong = _whole_mistake(answers, sizes, k), []
    for strategy, yours in answers.items():
        train = TrainConfig(
            strategy=strategy, optimizer="adam", steps=steps, eval_batches=0, samples=0
        )
        off = {}  # (kind, how) -> the ranks where it is so
        for r, result in enumerate(ranks.run(run_on_engine, config, train, timeout=120)):
            for kind in ("allreduce", "allgather", "reduce_scatter"):
                counted = result["traffic"].get(kind, {}).get("sent_bytes", 0.0) / steps
                counted -= loss if kind == "allreduce" else 0
                mine = yours.get(kind, 0.0)
                if not math.isclose(mine, counted, rel_tol=1e-9, abs_tol=1e-6):
                    how = _traffic_how(mine, counted, strategy, kind, sizes, k, whole)
                    off.setdefault((kind, how), []).append(r)
        for (kind, how), where in off.items():
            ranks_named = "every rank" if len(where) == k else f"rank {', '.join(map(str, where))}"
            wrong.append(f"  {strategy} {kind}, {ranks_named}: {how}")
    if wrong:
        print("✗ traffic_per_step differs from what Comm counted:", *wrong[:8], sep="\n")
        return fail("  (traffic_per_step: see the lines above)")
    print("✓ traffic_per_step: correct — every kind on every rank, as Comm counted")
    return True


def check_allgather_calls(ranks, allgather_calls, model_config) -> bool:
    """Exercise 3: (zero3's, zero2's) allgather calls per step for model_config, against the
    calls every rank's `Comm` counts in one Adam step of each."""
    from dataclasses import replace

    from fsdp_lesson.cluster import run_on_engine
    from fsdp_lesson.config import TrainConfig

    one_step = TrainConfig(optimizer="adam", steps=1, eval_batches=0, samples=0)
    counted = [
        [
            result["traffic"]["allgather"]["calls"]
            for result in ranks.run(
                run_on_engine, model_config, replace(one_step, strategy=s), timeout=120
            )
        ]
        for s in ("zero3", "zero2")
    ]
    if any(len(set(calls)) != 1 for calls in counted):  # every rank makes the same calls
        raise RuntimeError(
            "the ranks made different allgather calls in one step: a bug of the package"
        )
    every_layer = len(plan.layer_sizes(model_config))  # the ReLUs too
    if counted[0][0] != 2 * every_layer and allgather_calls in (
        (2 * every_layer, every_layer),
        [2 * every_layer, every_layer],
    ):
        return fail(
            "✗ allgather calls (zero3, zero2): the layers without parameters counted too:"
            " a ReLU has nothing to gather, so it makes no call"
        )
    return check(
        "allgather calls (zero3, zero2)",
        allgather_calls,
        (counted[0][0], counted[1][0]),
        hint="one allgather per layer with parameters: zero3 in forward and again in backward",
    )


def _close(answers: list, expected: list) -> bool:
    """Every answer a number within 1e-9 (relative) of the expected one."""
    try:
        return all(
            math.isclose(float(a), e, rel_tol=1e-9) for a, e in zip(answers, expected, strict=True)
        )
    except (TypeError, ValueError):
        return False


def check_hiding_batch(hiding_batch: Callable) -> bool:
    """dp and zero3 on an A100-like and an H100-like GPU, 25, 50 and 450 GB/s, N = 8 and 512;
    one verdict per stage, so that it names the stage that is wrong."""
    for stage in ("dp", "zero3"):
        cases = [
            (stage, n, f, w)
            for n in (8, 512)
            for f, w in ((312e12, 25e9), (989e12, 50e9), (989e12, 450e9))
        ]
        answers = [hiding_batch(*case) for case in cases]
        dps = [batch_that_hides("dp", *case[1:]) for case in cases]
        if stage == "zero3" and not not_solved(answers) and _close(answers, dps):
            return fail(
                "✗ hiding_batch (zero3): dp's batch — zero3 moves more bytes per step than dp:"
                " it gathers every layer in forward and again in backward"
            )
        if not check(
            f"hiding_batch ({stage})",
            answers,
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
