"""Notebook 07's checkers: each rank's bytes against live ledgers (exercises 1 and 4), the GPUs
a 70 B model needs (exercise 2) and from which N each stage fits (exercise 3). The expected
answers are the engines' ledgers, or searches over N with `plan.state_bytes` (mixed-precision
Adam), so the formula the learner writes appears nowhere in the notebook."""

from __future__ import annotations

import math
from collections.abc import Callable

from fsdp_lesson import plan
from fsdp_lesson.checks import NOT_SOLVED, check, fail, how_wrong
from fsdp_lesson.config import ModelConfig

GPU_40 = 40 * 2**30  # what a GPU sold as "40 GB" holds: 40 GiB
UNSEEN = ModelConfig(layers=2, hidden=50, emb=10)  # exercise 1's model: not shown in 07
CATEGORIES = ("params", "grads", "optimizer", "buffers")


def _figures(
    strategy: str,
    sizes: list[int],
    n: int,
    *,
    pad: str = "zero",
    element: int = 4,
    state: int = 8,
    buffers: str = "right",
) -> dict:
    """Exercise 1's figures with Adam in float32, or one of its usual mistakes: pad "none" or
    "all" (dp too), element bytes (2: the paper's fp16), state bytes of Adam per parameter
    (12: the paper's fp32 master too), buffers "sum" (zero2's gradient plus initialisation's
    layer), "once" (zero3's parameters only), "no init"."""
    stage = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[strategy]
    padding = pad == "all" or (pad == "zero" and stage > 0)
    padded = [-(-size // n) * n for size in sizes] if padding else list(sizes)
    psi = sum(padded)
    init = 0 if buffers == "no init" else 4 * max(sizes)
    largest = 4 * max(padded)
    gather = {"sum": largest + init, "once": largest}.get(buffers, 2 * largest)
    return {
        "params": element * psi // (n if stage >= 3 else 1),
        "grads": element * psi // (n if stage >= 2 else 1),
        "optimizer": state * psi // (n if stage >= 1 else 1),
        "buffers": {
            0: init,
            1: init,
            2: max(largest + (init if buffers == "sum" else 0), init),
            3: max(gather, init),
        }[stage],
    }


MISTAKES = (  # (what _figures is told, what the line says): the first that matches is named
    ({"pad": "none"}, "the unpadded size: from zero1 on every layer is padded to a multiple of N"),
    ({"pad": "all"}, "padded: dp pads nothing, it keeps every layer whole"),
    ({"element": 2}, "2 bytes an element: this package's parameters and gradients are float32"),
    (
        {"state": 12},
        "12 bytes a parameter: the paper's fp32 master copy; here the parameters"
        " are float32 already, Adam adds m and v",
    ),
    (
        {"buffers": "sum"},
        "initialisation's layer added to the gradient buffer: the one is"
        " freed before the other is allocated",
    ),
    ({"buffers": "once"}, "one layer's gathered parameters alone: zero3 holds its gradient too"),
    (
        {"buffers": "no init"},
        "no initialisation: each layer is drawn in float32 before it is"
        " sharded, the largest held while it is copied",
    ),
)


def _how(answer, want, strategy: str, category: str, sizes: list[int], n: int) -> str:
    """How one figure is off: a usual mistake by name, else how_wrong's factor or direction."""
    for told, words in MISTAKES:
        if answer == _figures(strategy, sizes, n, **told)[category] != want:
            return words
    return how_wrong(answer, want)


def _figure_list(found: list[tuple], how: str) -> str:
    """'zero1 params, grads; zero2 buffers': the figures off in the same way, by strategy."""
    by_strategy: dict[str, list[str]] = {}
    for strategy, category, said in found:
        if said == how:
            by_strategy.setdefault(strategy, []).append(category)
    return "; ".join(f"{s} {', '.join(categories)}" for s, categories in by_strategy.items())


def check_state_and_buffer_bytes(
    state_and_buffer_bytes: Callable, ranks, config: ModelConfig = UNSEEN
) -> bool:
    """Exercise 1: trains each of dp, zero1, zero2, zero3 (no prefetch) one Adam step on the
    engines and compares every category of every rank's ledger with the learner's figure,
    naming strategy, rank, category and how it is off (a usual mistake by name)."""
    from dataclasses import replace

    from fsdp_lesson.checks import not_solved
    from fsdp_lesson.cluster import run_on_engine
    from fsdp_lesson.config import TrainConfig

    name, n = "state_and_buffer_bytes", ranks.n
    answers = {s: state_and_buffer_bytes(s, config, n) for s in plan.PLANNED}
    if any(not_solved(answer) for answer in answers.values()):
        return fail(f"✗ {name}: {NOT_SOLVED}")
    for strategy, answer in answers.items():
        if not isinstance(answer, dict) or set(answer) != set(CATEGORIES):
            return fail(
                f"✗ {name}: {strategy} returned {type(answer).__name__}"
                + (f" {sorted(map(str, answer))}" if isinstance(answer, dict) else "")
                + ","
                f" where a dict of {', '.join(CATEGORIES)} is expected"
            )
    one_step = TrainConfig(optimizer="adam", steps=1, eval_batches=0, samples=0)
    sizes, wrong = plan.layer_sizes(config), {}  # rank -> [(strategy, category, how)]
    for strategy, answer in answers.items():
        run_config = replace(one_step, strategy=strategy, prefetch=strategy != "zero3")
        results = ranks.run(run_on_engine, config, run_config, timeout=120)
        for r, ledger in enumerate(result["memory"]["peak"] for result in results):
            wrong.setdefault(r, []).extend(
                (strategy, category, _how(answer[category], ledger[category], strategy,
                                          category, sizes, n))
                for category in CATEGORIES
                if answer[category] != ledger[category]
            )  # fmt: skip
    if any(wrong.values()):
        count = sum(map(len, wrong.values()))
        same = all(found == wrong[0] for found in wrong.values())
        by_rank = {"every rank": wrong[0]} if same else {f"rank {r}": w for r, w in wrong.items()}
        lines = [f"  {where}, {_figure_list(found, how)}: {how}"
                 for where, found in by_rank.items()
                 for how in dict.fromkeys(how for *_, how in found)]  # fmt: skip
        print(f"✗ {name}: {count} of the ledgers' figures differ", *lines[:7], sep="\n")
        return fail(f"  ({name}: see the lines above)")
    print(f"✓ {name}: correct — every category of every rank's ledger")
    return True


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


def _lever_figures(
    stage: str,
    sizes: list[int],
    n: int,
    precision: str,
    *,
    pad: str = "zero",
    item16: int = 2,
    master: bool = True,
) -> dict:
    """Exercise 4's figures (params, grads, optimizer with Adam), or one of its usual mistakes:
    pad "none" or "all" (dp too), 4-byte bf16 elements, or bf16's optimizer state without its
    fp32 master."""
    item = 4 if precision == "fp32" else item16
    state = 8 if precision == "fp32" else (12 if master else 8)
    padded = pad == "all" or (pad == "zero" and stage != "dp")
    psi = sum(-(-size // n) * n if padded else size for size in sizes)
    level = {"dp": 0, "zero1": 1, "zero2": 2, "zero3": 3}[stage]
    return {
        "params": item * psi // (n if level >= 3 else 1),
        "grads": item * psi // (n if level >= 2 else 1),
        "optimizer": state * psi // (n if level >= 1 else 1),
    }  # fmt: skip


LEVER_MISTAKES = (  # (what _lever_figures is told, what the line says)
    ({"pad": "none"}, "the unpadded size: from zero1 on every layer is padded to a multiple of N"),
    ({"pad": "all"}, "padded: dp pads nothing, it keeps every layer whole"),
    (
        {"master": False},
        "bf16's Adam state without its fp32 master copy of the parameters",
    ),
    ({"item16": 4}, "4 bytes an element in bf16: its parameters and gradients are 2 bytes"),
)


def _lever_how(
    answer, want, stage: str, sizes: list[int], n: int, precision: str, category: str
) -> str:
    """How one of exercise 4's figures is off: a usual mistake by name, else how_wrong's."""
    for told, words in LEVER_MISTAKES:
        if answer == _lever_figures(stage, sizes, n, precision, **told)[category]:
            return words
    return how_wrong(answer, want)


def check_bytes_per_rank(
    bytes_per_rank: Callable, model_config, configs: dict, peaks: dict, n: int
) -> bool:
    """Exercise 4: bytes_per_rank(stage, sizes, n, precision) against every rank's live zero3
    ledger of 07's section 5.1 (`configs` by name, `peaks`: each one's ledgers by rank), and
    dp, zero1 and zero2 at N = n against the planner (`plan.ledger_bytes`, equal to the ledger
    in 07's section 1), fp32 and bf16. A wrong figure is named by its usual mistake when it
    is one, the same mistake once for every rank and configuration it shows in."""
    from fsdp_lesson.checks import not_solved

    name, categories = "bytes_per_rank", ("params", "grads", "optimizer")
    sizes, cases = plan.layer_sizes(model_config), {}
    for config_name, config in configs.items():
        cases[config_name] = ("zero3", config.precision, peaks[config_name])
    for stage in ("dp", "zero1", "zero2"):
        for precision in ("fp32", "bf16"):
            planned = plan.ledger_bytes(stage, model_config, n, "adam", 32, precision=precision)
            cases[f"{stage} {precision}"] = (stage, precision, [planned])
    answers = {key: bytes_per_rank(stage, sizes, n, p) for key, (stage, p, _) in cases.items()}
    if any(not_solved(answer) for answer in answers.values()):
        return fail(f"✗ {name}: {NOT_SOLVED}")
    for key, answer in answers.items():
        if not isinstance(answer, dict) or not set(categories) <= set(answer):
            return fail(
                f"✗ {name}: {key} returned {type(answer).__name__}, where a dict of"
                f" {', '.join(categories)} is expected"
            )
    wrong: dict[str, dict[tuple[str, str], list[int]]] = {}  # how -> (case, category) -> ranks
    for key, (stage, precision, ledgers) in cases.items():
        for r, ledger in enumerate(ledgers):
            for category in categories:
                answer, want = answers[key][category], ledger[category]
                if answer != want:
                    how = _lever_how(answer, want, stage, sizes, n, precision, category)
                    wrong.setdefault(how, {}).setdefault((key, category), []).append(r)
    count = sum(len(ranks) for found in wrong.values() for ranks in found.values())
    if count:
        lines = []
        for how, found in wrong.items():
            where: dict[str, list[str]] = {}  # 'zero3 fp32 every rank' -> categories
            for (key, category), ranks in found.items():
                everyone = len(ranks) == len(cases[key][2])
                who = key if len(cases[key][2]) == 1 else (
                    f"{key} every rank" if everyone else f"{key} rank {', '.join(map(str, ranks))}"
                )  # fmt: skip
                where.setdefault(who, []).append(category)
            places = "; ".join(f"{who} {', '.join(found)}" for who, found in where.items())
            lines.append(f"  {places}: {how}")
        print(f"✗ {name}: {count} of the ledger's figures differ", *lines[:7], sep="\n")
        return fail(f"  ({name}: see the lines above)")
    print(f"✓ {name}: correct — every category of every rank's ledger")
    return True
