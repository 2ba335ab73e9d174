"""Notebook 04's exercises (ZeRO-1 and ZeRO-2): each checker computes the expected answer with
the package (its strategies, FlatParam, the planner), runs the learner's function where it
lives, and says where and how an answer is wrong, never what is right."""

from __future__ import annotations

import numpy as np
from ipyparallel import Reference

from .. import plan
from ..checks import NOT_SOLVED, check, fail, how_wrong, not_solved
from ..config import ModelConfig
from ..flat import FlatParam
from ..model import MLP
from .data_parallel import _verdict, _world

ATOL = 1e-6


def _differs(mine, expected) -> bool:
    mine, expected = np.asarray(mine), np.asarray(expected)
    return mine.shape != expected.shape or not np.max(np.abs(mine - expected), initial=0) <= ATOL


def _try_zero1_update(zero1_update) -> str | None:
    # On every rank: the package's ZeRO1.step and the learner's zero1_update, from the same
    # parameters and this rank's own random gradient.
    from ..comm import Comm
    from ..memory import MemoryLedger
    from ..optim import Adam
    from ..rng import make_rng
    from ..strategies import ZeRO1

    _, comm = _world()
    model = MLP(ModelConfig())
    package = ZeRO1(model, Adam(lr=1e-3), Comm(comm), MemoryLedger(comm.rank))
    package.load_params(model.init_params(make_rng(42)))
    layout = {name: f for name, f in package.layout.items() if f.numel}
    noise = np.random.default_rng(comm.rank)  # each rank its own gradient
    for name, f in layout.items():
        package.grads[name][: f.numel] = noise.standard_normal(f.numel)
    full_grads = {name: package.grads[name].copy() for name in layout}
    given = {name: package.params[name].copy() for name in layout}
    package.step()  # reduce-scatter-mean, Adam on the owned slice, allgather
    my_adam = Adam(lr=1e-3)
    my_adam.start_step()
    problems = []  # every layer on every rank: leaving early would strand the others in MPI
    for name, f in layout.items():
        shard = np.empty(f.shard_size, np.float32)
        Comm(comm).reduce_scatter_mean(full_grads[name], shard)
        state = {"m": np.zeros(f.shard_size, np.float32), "v": np.zeros(f.shard_size, np.float32)}
        mine = given[name].copy()
        returned = zero1_update(my_adam, f, mine, shard, state)
        problems.append(_zero1_problem(name, f, comm.rank, returned, mine, given[name],
                                       package.params[name]))  # fmt: skip
    return next((problem for problem in problems if problem is not None), None)


def _zero1_problem(name, f, rank, returned, mine, given, expected) -> str | None:
    """What is wrong with one layer's zero1_update on this rank, or None."""
    if returned is None:
        return NOT_SOLVED
    a, b = f.shard_range(rank)
    own = np.s_[a:b]
    if _differs(mine[own], expected[own]):
        if not _differs(mine[own], given[own]):
            return f"{name}, its own slice [{a:,}, {b:,}): not updated"
        return f"{name}, its own slice [{a:,}, {b:,}): not Adam's update of it"
    if _differs(np.delete(mine, own), np.delete(expected, own)):
        if not _differs(np.delete(mine, own), np.delete(given, own)):
            return (
                f"{name}, the other ranks' slices: still the old parameters; every rank"
                " must end with every owner's updated slice"
            )
        return f"{name}, the other ranks' slices: not their owners' updated values"
    if returned is not mine:
        return f"{name}: params holds the update, but the function returns another array"
    return None


def check_zero1_update(ranks) -> bool:
    """Exercise 1: the engines' `zero1_update(adam, flat, params, grad_shard, state)` per layer
    on every rank, against the package's `ZeRO1.step` on the same inputs."""
    found = ranks.run(_try_zero1_update, Reference("zero1_update"), timeout=60)
    return _verdict("zero1_update", found, f"correct on all {ranks.n} ranks")


def check_padding_bug(n: int, bug_rank, bug_element) -> bool:
    """Exercise 2: which rank's shard and which element of fc2's padded flat vector carried
    the leftover of the unzeroed buffer, on n ranks."""
    fc2 = {layer.name: layer for layer in MLP(ModelConfig()).layers}["fc2"]
    padded = FlatParam(fc2.shapes, n)
    owner = padded.numel // padded.shard_size  # the rank whose slice holds the padding
    return check(
        "rank and element",
        [bug_rank, bug_element],
        [owner, padded.numel],
        hint="elements count from 0; the padding is the end of the padded flat vector",
    )


def _try_reduce_grads(reduce_grads) -> str | None:
    # On every rank: the package's ZeRO2.reduce_grads and the learner's, on one buffer of
    # leftovers per layer, in backward's order.
    from ..comm import Comm
    from ..memory import MemoryLedger
    from ..optim import Adam
    from ..strategies import ZeRO2

    MPI, comm = _world()
    model = MLP(ModelConfig())
    package = ZeRO2(model, Adam(lr=1e-3), Comm(comm), MemoryLedger(comm.rank))
    package.transient_views("fc1")  # the reused buffer, allocated as the first backward does
    noise = np.random.default_rng(comm.rank)
    problems = []  # every layer on every rank: leaving early would strand the others in MPI
    for layer in reversed(model.layers):
        f = package.layout[layer.name]
        if not f.numel:
            continue
        leftovers = noise.standard_normal(package.full_grad.size).astype(np.float32)
        package.full_grad[:] = leftovers
        package.reduce_grads(layer)
        unzeroed = np.empty(f.shard_size, np.float32)  # the colleague's: padding summed in
        comm.Reduce_scatter_block(leftovers[: f.padded_numel].copy(), unzeroed, op=MPI.SUM)
        shard = np.zeros(f.shard_size, np.float32)
        returned = reduce_grads(f, leftovers.copy(), shard)
        a, b = f.shard_range(comm.rank)
        where = f"{layer.name}, its shard [{a:,}, {b:,})"
        expected = package.grad_shards[layer.name]
        if returned is None:
            problems.append(NOT_SOLVED)
        elif not _differs(shard, expected):
            if returned is not shard:
                problems.append(f"{where}: grad_shard is right, but the function returns another"
                                " array")  # fmt: skip
        elif not _differs(shard, unzeroed / comm.size):
            problems.append(
                f"{where}: the padding [{f.numel:,}, {f.padded_numel:,}) of full_grad was"
                " summed in: it holds a larger layer's leftovers"
            )
        elif not _differs(shard, comm.size * expected):
            problems.append(f"{where}: too large by a factor of {comm.size} (N): the sum, not the"
                            " mean")  # fmt: skip
        elif not _differs(shard, np.zeros_like(shard)):
            problems.append(f"{where}: still zero: nothing was written into grad_shard")
        else:
            problems.append(
                f"{where}: differs from the mean over the ranks by more than {ATOL:.0e}"
            )
    return next((problem for problem in problems if problem is not None), None)


def check_reduce_grads(ranks) -> bool:
    """Exercise 3: the engines' ZeRO-2 hook `reduce_grads(flat, full_grad, grad_shard)` per
    layer on every rank, against `ZeRO2.reduce_grads` on the same buffer of leftovers."""
    found = ranks.run(_try_reduce_grads, Reference("reduce_grads"), timeout=60)
    return _verdict("reduce_grads", found, f"correct on all {ranks.n} ranks")


def check_zero2_bytes(answer, psi: float = 1e9, n: int = 8) -> bool:
    """Exercise 4: params + grads + optimizer state per GPU under ZeRO-2 (float32 Adam), with
    the stage whose figure a wrong answer is named when it is another stage's."""
    name = "zero2_bytes_per_gpu"
    if not_solved(answer):
        return fail(f"✗ {name}: {NOT_SOLVED}")
    figures = {stage: sum(plan.state_bytes(stage, psi, n, plan.FP32_ADAM).values())
               for stage in ("dp", "zero1", "zero2", "zero3")}  # fmt: skip
    try:
        value = float(answer)
    except (TypeError, ValueError):
        return fail(f"✗ {name}: {answer!r} is not a number of bytes")
    if abs(value - figures["zero2"]) <= 1:
        print(f"✓ {name}: correct")
        return True
    for stage, figure in figures.items():
        if stage != "zero2" and abs(value - figure) <= 1:
            return fail(
                f"✗ {name}: {how_wrong(value, figures['zero2'])}: that is {stage}'s"
                " figure; which arrays does ZeRO-2 shard, which does it keep whole?"
            )
    return fail(
        f"✗ {name}: {how_wrong(value, figures['zero2'])} — count params, grads and"
        " Adam's m and v, each in float32, and divide what ZeRO-2 shards by N"
    )


def check_shard(shard) -> bool:
    """Exercise 5: `shard(numel, n)` for five layers over 3 ranks, against FlatParam."""
    shapes = {"emb": {"W": (27, 16)}, "fc1": {"W": (256, 64), "b": (64,)},
              "fc2": {"W": (64, 27), "b": (27,)}, "Linear(64, 23)": {"W": (64, 23), "b": (23,)},
              "Linear(12, 5)": {"W": (12, 5), "b": (5,)}}  # fmt: skip
    layers = [FlatParam(s, world_size=3) for s in shapes.values()]
    answers = [shard(f.numel, 3) for f in layers]
    expected = [(f.shard_size, f.padding) for f in layers]
    return check(
        "shard",
        answers,
        expected,
        hint="every rank owns the same whole number of elements; the padding fills up",
    )
