"""Notebook 05's exercises (ZeRO-3): each checker computes the expected answer with the package
(its zero3 strategy, the planner), runs the learner's code where it lives, and says where and
how an answer is wrong, never what is right."""

from __future__ import annotations

import numpy as np
from ipyparallel import Reference

from .. import plan
from ..checks import NOT_SOLVED, check, fail, not_solved
from ..config import ModelConfig

OPTIONS = {"dp": {}, "zero2": {}, "zero3": {"prefetch": False}}  # notebook 05's zero3


def _held_label(err: KeyError) -> str:
    """The label of the ledger's "ledger already holds 'fc1 gathered'", quotes included."""
    text = str(err.args[0]) if err.args else ""
    return text.partition("holds ")[2] or "a label"


def _kept(strategy, hook: str, store: str, problems: list[str]):
    """hook, which afterwards notes a layer that strategy.<store> still holds: its memory is
    alive whatever the ledger says."""
    original = getattr(strategy, hook)

    def call(layer):
        returned = original(layer)
        if layer.name in getattr(strategy, store, {}) and len(problems) < 1:
            problems.append(
                f"after {hook}({layer.name}), self.{store} still holds its array:"
                " the ledger freed the count, but the array is still alive"
            )
        return returned

    return call


def _watched(hook, returned):
    """hook, which also appends what it returns to `returned` (None: not solved yet)."""

    def call(layer):
        returned.append(hook(layer))
        return returned[-1]

    return call


def _snapshot_then(step, grad_shards, into):
    """step, after copying the gradient shards into `into` (Adam uses them as scratch)."""

    def call():
        into.update({name: shard.copy() for name, shard in grad_shards.items()})
        step()

    return call


def _zero3_run(strategy_class, options, data, steps, returned, kept):
    """On this rank: strategy_class trains `steps` Adam steps from the seed; the learner's
    (options None) has its hooks watched, into `returned` and `kept`. Returns its losses,
    parameter shards, reduced gradient shards, traffic and ledger peak; raises what it raises."""
    from ..comm import Comm
    from ..data import GlobalBatchSampler, rank_slice
    from ..memory import MemoryLedger
    from ..model import MLP
    from ..optim import Adam
    from ..rng import make_rng
    from ..train import train_step

    comm, model, rng = Comm.world(), MLP(ModelConfig()), make_rng(42)
    ledger = MemoryLedger(comm.rank)
    strategy = strategy_class(model, Adam(lr=1e-3), comm, ledger, **(options or {}))
    strategy.load_params(model.init_params(rng))
    sampler = GlobalBatchSampler(data.X_train, data.Y_train, 32, rng)
    if options is None:  # the learner's
        for hook in ("materialize", "grad_buffer"):
            setattr(strategy, hook, _watched(getattr(strategy, hook), returned))
        strategy.release = _kept(strategy, "release", "gathered", kept)
        strategy.reduce_grads = _kept(strategy, "reduce_grads", "full_grads", kept)
    reduced = {}  # the gradient shards as the update found them
    strategy.step = _snapshot_then(strategy.step, strategy.grad_shards, reduced)
    losses = []
    for _ in range(steps):
        X, Y = sampler.next()
        X, Y = rank_slice(X, comm.rank, comm.size), rank_slice(Y, comm.rank, comm.size)
        losses.append(train_step(model, strategy, X, Y))
    return losses, strategy.param_shards, reduced, comm.traffic_report(), ledger.peak


def _raised_problems(err, kept):
    """What the learner's run raising err says: an array kept alive first (the cause, before
    what it led to), a ledger label allocated twice, else the error itself."""
    if kept:
        return [*kept, f"then {type(err).__name__}: {err}"]
    if isinstance(err, KeyError) and "already holds" in str(err):
        return [
            f"the ledger already holds {_held_label(err)}: something allocated"
            " under that label was never freed"
        ]
    return [f"{type(err).__name__}: {err}"]


def _traffic_problems(traffic, my_traffic):
    """Each collective whose calls or bytes differ from zero3's."""
    problems = []
    for kind in sorted(set(traffic) | set(my_traffic)):
        want = {k: traffic.get(kind, {}).get(k, 0) for k in ("calls", "buffer_bytes")}
        got = {k: my_traffic.get(kind, {}).get(k, 0) for k in ("calls", "buffer_bytes")}
        if got != want:
            problems.append(
                f"{kind}: {got['calls']} calls moving {got['buffer_bytes']:,} bytes,"
                f" zero3 makes {want['calls']} moving {want['buffer_bytes']:,}"
            )
    return problems


def _peak_problems(peak, my_peak):
    """Each ledger category whose peak is above (held too long) or below (uncounted) zero3's."""
    problems = []
    for category in peak:
        if my_peak[category] != peak[category]:
            more = "more" if my_peak[category] > peak[category] else "less"
            problems.append(
                f"the ledger's peak of {category} is {more} than zero3's: something "
                f"is held {'too long or twice' if more == 'more' else 'uncounted'}"
            )
    return problems


def _value_problems(theirs, yours, steps):
    """The gradient shards at the last update, the losses and the parameter shards after
    `steps` steps that differ from zero3's by more than 1e-6."""
    (losses, params, grads), (my_losses, my_params, my_grads) = theirs, yours
    how = {name: _how_shard_differs(my_grads[name], grads[name]) for name in params}
    problems = [f"{name}'s gradient shard at the last update {how[name]}"
                for name in params if params[name].size
                and not np.max(np.abs(my_grads[name] - grads[name])) <= 1e-6]  # fmt: skip
    problems += [f"step {step}: the loss differs from zero3's by more than 1e-6"
                 for step, (mine, loss) in enumerate(zip(my_losses, losses, strict=True))
                 if not abs(mine - loss) <= 1e-6]  # fmt: skip
    problems += [f"{name}'s parameter shard after {steps} steps differs by more than 1e-6"
                 for name in params if params[name].size
                 and not np.max(np.abs(my_params[name] - params[name])) <= 1e-6]  # fmt: skip
    return problems


def _how_shard_differs(mine, theirs) -> str:
    """'differs by more than 1e-6', or, when mine is a whole multiple of zero3's shard, that
    multiple named: N times is the sum over the ranks, where zero3 keeps their mean."""
    mine, theirs = np.asarray(mine, np.float64), np.asarray(theirs, np.float64)
    if np.any(theirs) and mine.shape == theirs.shape:
        ratio = float(np.dot(mine, theirs) / np.dot(theirs, theirs))
        k = round(ratio)
        # within a few %: Adam's steps hardly depend on a gradient's scale, but not exactly
        # (its eps), so by the last update the parameters, and zero3's gradient, moved a little
        if (k >= 2 and abs(ratio - k) <= 0.01 * k
                and np.max(np.abs(mine - k * theirs)) <= 0.05 * np.max(np.abs(mine))):  # fmt: skip
            return f"is {k} times zero3's: the sum over the ranks, where zero3 keeps their mean?"
    return "differs by more than 1e-6"


def _my_zero3_problems(MyZeRO3, steps: int = 3):  # noqa: N803  (the learner's class)
    # On every rank: the package's ZeRO3 (no prefetch) and the learner's MyZeRO3 train the same
    # `steps` Adam steps. None while a hook still returns None; else a list of what differs.
    from ..data import Dataset
    from ..strategies import zero3

    data, kept, outcome = Dataset.load(), [], {}
    for label, strategy_class, options in (("zero3", zero3.ZeRO3, OPTIONS["zero3"]),
                                           ("yours", MyZeRO3, None)):  # fmt: skip
        returned = []  # what materialize and grad_buffer return: None means not solved yet
        try:
            outcome[label] = _zero3_run(strategy_class, options, data, steps, returned, kept)
        except Exception as err:
            return None if any(r is None for r in returned) else _raised_problems(err, kept)
        if any(r is None for r in returned):
            return None
    (losses, params, grads, traffic, peak) = outcome["zero3"]
    (my_losses, my_params, my_grads, my_traffic, my_peak) = outcome["yours"]
    return [
        *kept,
        *_traffic_problems(traffic, my_traffic),
        *_peak_problems(peak, my_peak),
        *_value_problems((losses, params, grads), (my_losses, my_params, my_grads), steps),
    ]


def check_my_zero3(ranks) -> bool:
    """Exercise 1: the engines' MyZeRO3 against the package's zero3 (prefetch=False), 3 Adam
    steps on every rank: prints ✓, "not solved yet", or what differs (the cause first)."""
    try:
        verdicts = ranks.run(_my_zero3_problems, Reference("MyZeRO3"), timeout=120)
    except Exception as err:
        return fail(f"✗ MyZeRO3: the engines raised {str(err).splitlines()[0]}")
    if any(verdict is None for verdict in verdicts):
        return fail(f"✗ MyZeRO3: {NOT_SOLVED}")
    if all(problems == verdicts[0] for problems in verdicts):  # the usual case: say it once
        wrong = [f"  every rank: {problem}" for problem in verdicts[0]]
    else:
        wrong = [f"  rank {r}: {problem}" for r, problems in enumerate(verdicts)
                 for problem in problems]  # fmt: skip
    if wrong:
        return fail("\n".join(["✗ MyZeRO3 differs from the package's zero3:", *wrong[:8]]))
    print(
        "✓ MyZeRO3: correct — the same losses, shards, collectives and ledger peaks as zero3"
        " on every rank"
    )
    return True


def check_gather_buffer(gather_buffer_bytes) -> bool:
    """Exercise 3: zero3's buffers peak (one layer per unit, no prefetch) for four models and
    world sizes, against the planner (which notebook 05 shows equal to the ledger)."""
    cases = [(ModelConfig(), 4), (ModelConfig(), 3), (ModelConfig(layers=3, hidden=256), 4),
             (ModelConfig(emb=8, hidden=100), 6)]  # fmt: skip
    answers = [gather_buffer_bytes(config, k) for config, k in cases]
    expected = [plan.ledger_bytes("zero3", config, k, "sgd", 8, **OPTIONS["zero3"])["buffers"]
                for config, k in cases]  # fmt: skip
    return check(
        "gather_buffer_bytes",
        answers,
        expected,
        hint="items are (model, N) = (seed, 4), (seed, 3), (3 × 256, 4), (100 wide, 6);"
        " section 5's timeline shows which full arrays are alive at the worst"
        " moment",
    )


def check_zero3_saving(zero3_saving) -> bool:
    """Exercise 4: zero2's bytes per rank minus zero3's (Adam, notebook 05's options) for
    three models at N = 2, 4 and 8, against the planner."""
    answers, expected, asked = [], [], []
    for config in (ModelConfig(), ModelConfig(layers=2), ModelConfig(layers=4, hidden=256)):
        for k in (2, 4, 8):
            sizes = [plan.padded(size, k) for size in plan.layer_sizes(config)]
            asked.append((sum(sizes), max(sizes), k))
            answers.append(zero3_saving(*asked[-1]))
            ledgers = {label: plan.ledger_bytes(label, config, k, "adam", 4, **OPTIONS[label])
                       for label in ("zero2", "zero3")}  # fmt: skip
            expected.append(sum(ledgers["zero2"].values()) - sum(ledgers["zero3"].values()))
    mistakes = {  # the usual wrong savings, by what the checker says of them
        "the full layer zero3 gathers is left out: it costs a layer's parameters in full": (
            lambda psi, largest, n: 4 * psi * (n - 1) / n
        ),
        "two full layers counted: zero2 holds a layer's full gradient too, so only zero3's"
        " gathered parameters are extra": lambda psi, largest, n: (
            4 * psi * (n - 1) / n - 8 * largest
        ),
        "all the parameters saved: each rank still keeps its 1/N of them": (
            lambda psi, largest, n: 4 * psi - 4 * largest
        ),
    }
    for says, saving in mistakes.items():
        if not not_solved(answers) and all(
            isinstance(a, (int, float, np.number)) and abs(a - saving(*q)) <= 0.5
            for a, q in zip(answers, asked, strict=True)
        ):
            return fail(f"✗ zero3_saving: {says}")
    return check(
        "zero3_saving",
        answers,
        expected,
        atol=0.5,
        hint="items are the seed's model, 2 layers, 4 × 256, each at N = 2, 4, 8; which"
        " categories of section 6's table differ between the two stages?",
    )


def _nothing(grads, comm):
    return grads


def _biases_only(grads, comm):
    if "b" in grads:
        comm.allreduce_mean(grads["b"])
    return grads


def _weights_summed(grads, comm):
    if "W" in grads:
        comm.allreduce_sum(grads["W"])
    return grads


C_MISTAKES = {  # the usual wrong c_reduce_grads, by what its line says
    "nothing averaged: every rank steps on its own rows' gradient alone": _nothing,
    "the biases averaged and the weights left local: the other way round": _biases_only,
    "the weights' gradients summed, not averaged: a step N times too long": _weights_summed,
}


def _c_step1_losses(seed_run, c_reduce_grads, world, pair) -> dict | None:
    # On every rank, with the notebook's %%px seed_run (the C program's setup) and the learner's
    # c_reduce_grads as a DataParallel's reduce_grads: the printed step-1 losses at N = 4
    # (world) and N = 2 (pair), and for contrast the package's dp's (every gradient averaged)
    # and the usual mistakes'. None while c_reduce_grads returns None.
    from ..strategies.dp import DataParallel

    def reducing(reduce):
        class Reduced(DataParallel):
            name = "c_reduce"
            unsolved = False

            def reduce_grads(self, layer):
                if reduce(self.grad_views[layer.name], self.comm) is None:
                    self.unsolved = True

        return Reduced

    yours = reducing(c_reduce_grads)
    (four, four_losses), (two, two_losses) = seed_run(yours, world, 2), seed_run(yours, pair, 2)
    if four.unsolved or two.unsolved:
        return None
    step1 = {"yours": [four_losses[1], two_losses[1]]}
    others = [("dp", DataParallel)] + [(how, reducing(f)) for how, f in C_MISTAKES.items()]
    for label, strategy in others:
        step1[label] = [seed_run(strategy, comm, 2)[1][1] for comm in (world, pair)]
    return step1


def check_c_bug(ranks, c_step1: dict[int, float]) -> bool:
    """Exercise 2: the engines' `c_reduce_grads(grads, comm)` in a DataParallel run by their
    `seed_run` at N = 4 and N = 2; its printed step-1 losses (six decimals) against the C FSDP
    program's (`c_step1`, by N: what the notebook read from its traces). A usual mistake is
    named by what it does; else each N's loss is said too large or too small."""
    name = "c_reduce_grads"
    found = ranks.run(
        _c_step1_losses,
        Reference("seed_run"),
        Reference("c_reduce_grads"),
        Reference("world"),
        Reference("pair"),
        timeout=120,
    )[0]
    if found is None:
        return fail(f"✗ {name}: {NOT_SOLVED}")
    printed = {label: [f"{loss:f}" for loss in losses] for label, losses in found.items()}
    if printed["yours"] == [f"{c_step1[4]:f}", f"{c_step1[2]:f}"]:
        print(f"✓ {name}: correct")
        return True
    if printed["yours"] == printed["dp"]:
        return fail(
            f"✗ {name}: step 1 is what the package's dp prints, every gradient averaged;"
            " C's FSDP printed something else: which gradients did it really average?"
        )
    hint = "step 0 agrees, so the forward is right: which gradients are really averaged?"
    for how in C_MISTAKES:
        if printed["yours"] == printed[how]:
            return fail(f"✗ {name}: step 1 shows {how} — {hint}")
    off = [
        f"at N = {n} step 1's loss is {'too large' if mine > c else 'too small'}"
        for n, mine, c in zip((4, 2), found["yours"], (c_step1[4], c_step1[2]), strict=True)
        if f"{mine:f}" != f"{c:f}"
    ]
    return fail(f"✗ {name}: {'; '.join(off)} — {hint}")
