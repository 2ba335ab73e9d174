"""Notebook 06's checkers: the prefetch order (exercise 1), zero3's bytes per step (exercise
2), the HSDP groups (exercise 3) and clipping under sharding (exercise 4).

Each runs the real strategy (on the engines where it must), computes the expected answer from
it, and says which mistake an answer makes (the first unit and direction that is not zero3's
choice; a collective's bytes too large or too small; a group that is not its communicator's; a
norm of one rank's shards, of squares averaged without ×N, or an average of norms) without
printing the expected value.
"""

from __future__ import annotations

from collections.abc import Callable

from fsdp_lesson.checks import NOT_SOLVED, check, fail, not_solved

GROUP_HINTS = {
    "shard": "a shard group is N/R consecutive ranks",
    "replicate": "a replicate group takes the rank at the same place in every shard group",
}


def groups_on_engine(model_config, replicate: int) -> tuple[list[int], list[int]]:
    """On every rank: the world ranks its zero3's shard and replicate communicators hold."""
    from fsdp_lesson.comm import Comm
    from fsdp_lesson.memory import MemoryLedger
    from fsdp_lesson.model import MLP
    from fsdp_lesson.optim import SGD
    from fsdp_lesson.strategies import ZeRO3

    world = Comm.world()
    strategy = ZeRO3(MLP(model_config), SGD(0.1), world, MemoryLedger(), replicate=replicate)
    return (
        strategy.shard_comm.allgather_objects(world.rank),
        strategy.replica_comm.allgather_objects(world.rank),
    )


def groups_mistake(answer, actual: dict[str, list[list[int]]]) -> str | None:
    """Which group of the answer is not what the communicators hold, in words; None if none."""
    if not (isinstance(answer, (list, tuple)) and len(answer) == 2):
        return "return a pair: (shard groups, replicate groups)"
    for kind, yours in zip(("shard", "replicate"), answer, strict=True):
        groups = actual[kind]
        try:
            yours = [[int(rank) for rank in group] for group in yours]
        except (TypeError, ValueError):
            return f"the {kind} groups must be a list of lists of ranks"
        if len(yours) != len(groups):
            return (
                f"{len(yours)} {kind} groups, not as many as the communicators form"
                f" — {GROUP_HINTS[kind]}"
            )
        for i, (mine, theirs) in enumerate(zip(yours, groups, strict=True)):
            if mine != theirs:
                return (
                    f"{kind} group {i} is {mine}: not the ranks that communicator holds"
                    f" — {GROUP_HINTS[kind]}"
                )
    return None


def check_groups(ranks, hsdp_groups: Callable, model_config) -> bool:
    """Exercise 3: hsdp_groups(n, R) against the communicators zero3 builds, for R = 2 and 4."""
    for r in (2, 4):
        answer = hsdp_groups(ranks.n, r)
        if not_solved(answer):
            return check("groups", None, None)  # the placeholder: "not solved yet"
        per_rank = ranks.run(groups_on_engine, model_config, r, timeout=120)
        actual = {
            kind: [list(group) for group in sorted({tuple(g[i]) for g in per_rank})]
            for i, kind in enumerate(("shard", "replicate"))
        }
        mistake = groups_mistake(answer, actual)
        if mistake:
            return fail(f"✗ R={r}: {mistake}")
        print(f"✓ R={r}: correct")
    return True


def clip_factors_on_a_rank(max_norm: float = 0.001) -> dict[str, float]:
    """On every rank: one step's gradient shards under zero2 (the update skipped); the engine's
    clip_factor (defined there by %%px) and the factors of the whole gradient and of three
    mistakes. The default bound is below every rank's own norm, so every rank clips."""
    import numpy as np

    import __main__
    from fsdp_lesson.comm import Comm
    from fsdp_lesson.config import ModelConfig
    from fsdp_lesson.data import Dataset, GlobalBatchSampler, rank_slice
    from fsdp_lesson.memory import MemoryLedger
    from fsdp_lesson.model import MLP, loss_and_grads
    from fsdp_lesson.optim import SGD
    from fsdp_lesson.rng import make_rng
    from fsdp_lesson.strategies import zero2
    from fsdp_lesson.train import train_step

    class GradientsOnly(zero2.ZeRO2):  # zero2 without its update: the shards stay the mean's
        name = "gradients_only"

        def step(self):
            pass

    data, comm, model, rng = Dataset.load(), Comm.world(), MLP(ModelConfig()), make_rng(42)
    params = model.init_params(rng)
    strategy = GradientsOnly(model, SGD(0.1), comm, MemoryLedger(comm.rank))
    strategy.load_params(params)
    X, Y = GlobalBatchSampler(data.X_train, data.Y_train, 32, rng).next()
    train_step(
        model, strategy, rank_slice(X, comm.rank, comm.size), rank_slice(Y, comm.rank, comm.size)
    )
    _, whole = loss_and_grads(model, params, X, Y)  # the whole batch's gradient, on one rank
    norm = np.sqrt(
        sum(np.sum(g.astype(np.float64) ** 2) for p in whole.values() for g in p.values())
    )
    squares = sum(float(np.dot(g.astype(np.float64), g)) for g in strategy.grad_shards.values())

    def factor(of_norm: float) -> float:
        return min(1.0, max_norm / (of_norm + 1e-6))

    answer = __main__.clip_factor(strategy.grad_shards, comm, max_norm)
    above = __main__.clip_factor(strategy.grad_shards, comm, 1e6 * (norm + 1))  # no clipping
    return {
        "answer": None if not_solved(answer) else float(answer),
        "above": None if not_solved(above) else float(above),
        "whole": factor(norm),
        "own shards": factor(np.sqrt(squares)),
        "mean of squares": factor(np.sqrt(comm.mean_scalar(squares))),
        "mean of norms": factor(comm.mean_scalar(float(np.sqrt(squares)))),
    }


CLIP_MISTAKES = {
    "own shards": "the norm of this rank's shards alone: every rank clips by a different factor"
    " — the squares of every rank's shards must be added up (comm.mean_scalar)",
    "mean of squares": "the mean of the ranks' squares is the sum / N: multiply by comm.size"
    " before the square root",
    "mean of norms": "the mean of the ranks' norms is not the whole gradient's norm: add up"
    " the squares, not the norms",
}


def check_clip_factor(ranks, atol: float = 1e-6) -> bool:
    """Exercise 4: the engines' clip_factor against the whole gradient's, on every rank; a
    wrong answer is matched against the three usual mistakes and named."""
    name = "clip_factor"
    factors = ranks.run(clip_factors_on_a_rank, timeout=120)
    if any(f["answer"] is None for f in factors):
        return fail(f"✗ {name}: {NOT_SOLVED}")
    wrong = [r for r, f in enumerate(factors) if not abs(f["answer"] - f["whole"]) <= atol]
    grows = [r for r, f in enumerate(factors) if f["above"] is None or f["above"] != 1.0]
    if not wrong and grows:
        return fail(
            f"✗ {name}: rank {grows[0]}: with a max_norm far above the gradient's norm the factor"
            " is not 1: clipping may shrink a gradient, never scale it up"
        )
    if not wrong:
        print(f"✓ {name}: correct on all {len(factors)} ranks")
        return True
    for mistake, words in CLIP_MISTAKES.items():
        if all(abs(f["answer"] - f[mistake]) <= atol for f in factors):
            return fail(f"✗ {name}: {words}")
    same = len({round(f["answer"], 12) for f in factors}) == 1
    how = (
        "the same on every rank, but not the whole gradient's"
        if same
        else ("different on the ranks: every rank must find the whole gradient's factor")
    )
    return fail(
        f"✗ {name}: rank {wrong[0]}'s factor is {how}; the norm is the square root"
        " of the sum of every rank's squares"
    )


def zero3_order(model_config) -> dict[tuple[int, bool], int | None]:
    """zero3's own prefetch choice for every (unit index, backward), from a one-rank zero3's
    schedule: the index of the unit it gathers next, or None."""
    from fsdp_lesson.comm import Comm
    from fsdp_lesson.memory import MemoryLedger
    from fsdp_lesson.model import MLP
    from fsdp_lesson.optim import SGD
    from fsdp_lesson.strategies import ZeRO3

    schedule = ZeRO3(MLP(model_config), SGD(0.1), Comm(), MemoryLedger()).schedule

    def index(unit):
        return None if unit is None else schedule.order.index(unit)

    return {
        (i, backward): index(schedule.following(unit, backward))
        for i, unit in enumerate(schedule.order)
        for backward in (False, True)
    }


def run_with_order(order: Callable, model_config, train_config, run_config) -> dict:
    """On every rank: train (cluster.run_on_engine) with order(i, backward, count) choosing
    zero3's prefetch in place of Schedule.following."""
    from fsdp_lesson.cluster import run_on_engine
    from fsdp_lesson.strategies.zero3 import Schedule

    def learner_following(self, unit, backward):
        j = order(self.order.index(unit), backward, len(self.order))
        return None if j is None else self.order[j]

    builtin, Schedule.following = Schedule.following, learner_following
    try:
        return run_on_engine(model_config, train_config, run_config)
    finally:
        Schedule.following = builtin


def issue_order(trace: list) -> list[str]:
    """The labels of a traced step's collectives, in the order they were issued."""
    return [what for lane, what, start, _ in sorted(trace, key=lambda s: s[2]) if lane == "comm"]


def _by_direction(choices: dict) -> dict[str, object]:
    return {
        f"{'backward' if b else 'forward'} {u}": "end" if v is None else v
        for (u, b), v in sorted(choices.items())
    }


def _prefetch_mistake(answers: dict, expected: dict, count: int) -> str:
    """The hint for a wrong prefetch table: an index past either end (where there is no next
    unit), or a direction that goes the wrong way; never the expected table."""
    outside = [
        key
        for key, answer in answers.items()
        if isinstance(answer, int) and not 0 <= answer < count
    ]
    if outside:
        return (
            "past the last unit of a direction there is none to prefetch: return None there"
            " (Python would take -1 as the last unit)"
        )
    return "forward goes up, backward down"


def check_prefetch_order(ranks, next_unit: Callable, model_config, train_config) -> bool:
    """Exercise 1: next_unit(u, backward, count) against zero3's own choice for every unit and
    direction of model_config; if they agree, 3 steps of train_config on the ranks with the
    learner's choice in zero3's place: the same order of collectives, bit-identical parameters."""
    from dataclasses import replace

    from fsdp_lesson.checks import compare, model_vector
    from fsdp_lesson.cluster import run_on_engine
    from fsdp_lesson.config import RunConfig

    expected = zero3_order(model_config)
    count = len(expected) // 2
    answers = {key: next_unit(key[0], key[1], count) for key in expected}
    if all(answer is None for answer in answers.values()):
        return check("prefetch order", None, None)  # the placeholder: "not solved yet"
    if not check(
        "prefetch order",
        _by_direction(answers),
        _by_direction(expected),
        hint=_prefetch_mistake(answers, expected, count),
    ):
        return False
    config, traced = replace(train_config, steps=3), RunConfig(trace_step=1)
    yours = ranks.run(run_with_order, next_unit, model_config, config, traced, timeout=300)
    theirs = ranks.run(run_on_engine, model_config, config, traced, timeout=300)
    if not check(
        "issued in zero3's order",
        [issue_order(r["trace"]) for r in yours],
        [issue_order(r["trace"]) for r in theirs],
    ):
        return False
    return compare(
        "parameters",
        model_vector(yours[0]["params"]),
        model_vector(theirs[0]["params"]),
        exact=True,
    )


def _sent_bytes_mistake(answer, counted: dict, n: int, reshard: bool) -> str:
    """The hint for a wrong zero3_sent_bytes: which usual mistake the ratios of the answer to
    the counted bytes show (a rank's shard, the allgathers per unit, the reduce-scatters),
    or a general one; never the expected bytes."""
    general = "count the collectives per unit and step, and what a ring sends of each buffer"
    if not isinstance(answer, dict) or set(answer) != set(counted):
        return general
    try:
        ratio = {kind: float(answer[kind]) / counted[kind] for kind in counted}
    except (TypeError, ValueError):
        return general

    def near(x: float, y: float) -> bool:
        return abs(x - y) <= 1e-9 * max(1.0, abs(y))

    if all(near(r, 1 / n) for r in ratio.values()):
        return "unit_bytes are the whole units' bytes, not a rank's shard of them"
    gathers = ratio["allgather"] * (2 if reshard else 1)
    if near(ratio["reduce_scatter"], 1) and near(gathers, 1 if reshard else 2):
        return (
            "kept from its forward to its backward, a unit is gathered once per step"
            if not reshard
            else "resharded after its forward, a unit is gathered again for its backward"
        )
    if near(ratio["reduce_scatter"], 1):
        return "how many times is a unit gathered per step, with and without resharding?"
    if near(ratio["allgather"], 1):
        return "each unit's gradient is reduce-scattered once per step"
    return general


def check_sent_bytes(ranks, zero3_sent_bytes: Callable, model_config, train_config) -> bool:
    """Exercise 2: zero3_sent_bytes(unit_bytes, n, reshard_after_forward) against the bytes per
    step every kind of collective sent on rank 0, as `Comm` counted them, in two steps of
    train_config with K = 2 layers per unit kept whole, then K = 3 resharded after forward."""
    from dataclasses import replace

    from fsdp_lesson.cluster import run_on_engine
    from fsdp_lesson.model import MLP
    from fsdp_lesson.strategies.zero3 import make_units

    layers, n = MLP(model_config).layers, ranks.n
    for k, reshard in ((2, False), (3, True)):
        config = replace(train_config, steps=2, layers_per_unit=k, reshard_after_forward=reshard)
        unit_bytes = [4 * unit.flat.padded_numel for unit in make_units(layers, k, n)]
        answer = zero3_sent_bytes(unit_bytes, n, reshard)
        if answer is None:
            return check("sent bytes", None, None)  # the placeholder: "not solved yet"
        traffic = ranks.run(run_on_engine, model_config, config, timeout=300)[0]["traffic"]
        counted = {
            kind: traffic[kind]["sent_bytes"] / config.steps
            for kind in ("allgather", "reduce_scatter")
        }
        hint = _sent_bytes_mistake(answer, counted, n, reshard)
        whole = {kind: bytes_ * n / (n - 1) for kind, bytes_ in counted.items()}
        if (
            isinstance(answer, dict)
            and set(answer) == set(counted)
            and all(abs(answer[kind] - whole[kind]) <= 1e-6 for kind in counted)
        ):
            return fail(
                f"✗ K={k}, reshard={reshard}: allgather and reduce_scatter: too large by"
                " N/(N-1): a ring sends (N-1)/N of each buffer"
            )
        if not check(f"K={k}, reshard={reshard}", answer, counted, atol=1e-6, hint=hint):
            return False
    return True
