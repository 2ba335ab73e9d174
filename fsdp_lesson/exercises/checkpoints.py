"""Notebook 09's checkers: a rank's owned shards (exercise 1), whose elements at N = 3
(exercise 2) and the bytes of a rank's file (exercise 3). The expected values are the
package's own (`owned_shards`, FlatParam's shard sizes, the files written); a wrong answer is
described (which array, its dtype, how it differs), never shown."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from fsdp_lesson.checkpoint import rank_file
from fsdp_lesson.checks import check, fail, how_wrong, not_solved
from fsdp_lesson.flat import FlatParam


def shard_problems(yours: dict, expected: dict) -> list[str]:
    """What differs between two {key: array} dicts: missing or unexpected keys, a dtype, a
    shape, values (where and how, from checks.how_wrong)."""
    problems = [f"missing {key}" for key in expected if key not in yours]
    problems += [f"unexpected {key}" for key in yours if key not in expected]
    for key in expected:
        if key not in yours:
            continue
        mine, theirs = np.asarray(yours[key]), expected[key]
        if mine.dtype != theirs.dtype:  # one line for all: a conversion is rarely one array's
            converted = [
                k
                for k in expected
                if k in yours and np.asarray(yours[k]).dtype != expected[k].dtype
            ]
            more = f" (and {len(converted) - 1} more arrays)" if len(converted) > 1 else ""
            return problems + [
                f"{key}: {mine.dtype} values, where the state is {theirs.dtype}"
                f"{more}: keep the array's own dtype (cut it, do not convert it)"
            ]
        elif not np.array_equal(mine, theirs):
            problems.append(f"{key}: {how_wrong(mine, theirs)}")
    return problems


def owned_shards_verdict(strategy_name: str, mine: Callable) -> list[str] | None:
    """On every rank: build strategy_name, train two Adam steps, compare mine(strategy) with
    the package's owned_shards. None while mine returns None, else what differs and how."""
    from fsdp_lesson.checkpoint import owned_shards
    from fsdp_lesson.comm import Comm
    from fsdp_lesson.config import ModelConfig
    from fsdp_lesson.data import Dataset, GlobalBatchSampler, rank_slice
    from fsdp_lesson.memory import MemoryLedger
    from fsdp_lesson.model import MLP
    from fsdp_lesson.optim import Adam
    from fsdp_lesson.rng import make_rng
    from fsdp_lesson.strategies import make_strategy
    from fsdp_lesson.train import train_step

    comm, model, rng, data = Comm.world(), MLP(ModelConfig()), make_rng(7), Dataset.load()
    strategy = make_strategy(strategy_name, model, Adam(lr=1e-3), comm, MemoryLedger(comm.rank))
    strategy.load_params(model.init_params(rng))
    sampler = GlobalBatchSampler(data.X_train, data.Y_train, 32, rng)
    for _ in range(2):
        X, Y = sampler.next()
        x, y = rank_slice(X, comm.rank, comm.size), rank_slice(Y, comm.rank, comm.size)
        train_step(model, strategy, x, y)
    yours = mine(strategy)
    return None if yours is None else shard_problems(yours, owned_shards(strategy))


def check_owned_shards(ranks, my_owned_shards: Callable) -> bool:
    """Exercise 1: my_owned_shards against the package's on every rank of dp, zero1, zero2
    and zero3."""
    wrong = []
    for name in ("dp", "zero1", "zero2", "zero3"):
        verdicts = ranks.run(owned_shards_verdict, name, my_owned_shards, timeout=120)
        if any(verdict is None for verdict in verdicts):
            return check("my_owned_shards", None, None)
        wrong += [
            f"  {name} rank {r}: {p}" for r, problems in enumerate(verdicts) for p in problems
        ]
    if wrong:
        print("✗ my_owned_shards differs from what the package saves:", *wrong[:8], sep="\n")
        return fail("  (my_owned_shards: see the lines above)")
    print("✓ my_owned_shards: correct — dp, zero1, zero2 and zero3, every rank, every array")
    return True


def check_rank_1_of_3(rank_1: tuple, padding: int, model_config) -> bool:
    """Exercise 2: the (start, stop) of fc1's padded vector that rank 1 of 3 owns, and the
    padding of that vector, against FlatParam of model_config's fc1 at N = 3."""
    from fsdp_lesson.model import MLP

    fc1 = next(layer for layer in MLP(model_config).layers if layer.name == "fc1")
    f = FlatParam(fc1.shapes, 3)
    size, down = f.shard_size, f.numel // 3  # S, and S rounded down (the usual mistake)
    named = {  # the usual wrong (start, stop), by what its hint says
        (down, 2 * down): "S rounded down: three slices of S must hold all of fc1",
        (size, 2 * size - 1): "stop is exclusive, as in a Python slice",
        (0, size): "rank 0's slice: ranks count from 0",
        (2 * size, 3 * size): "rank 2's slice: ranks count from 0",
    }
    answer = tuple(rank_1) if isinstance(rank_1, (tuple, list)) else rank_1
    owned = check(
        "fc1_rank_1_of_3",
        rank_1,
        f.shard_range(1),
        hint=named.get(answer, "the slices are S long each, in rank order"),
    )
    padded = _check_padding(padding, f, f.numel - 3 * down)  # both answers judged, always
    return owned and padded


def _check_padding(padding, f: FlatParam, short: int) -> bool:
    """fc1_padding_at_3 against f.padding; `short` is what three slices rounded down leave out.
    Never "by a factor of k": with a padding of 1 that factor would be the answer itself."""
    name = "fc1_padding_at_3"
    if not_solved(padding) or padding == f.padding:
        return check(name, padding, f.padding)
    if not isinstance(padding, (int, float, np.integer, np.floating)):
        return fail(f"✗ {name}: {how_wrong(padding, f.padding)} — a number of elements")
    if padding == short:
        how = "what S rounded down leaves out: with S rounded up the slices hold more than fc1"
    elif padding == f.padded_numel:
        how = "that is the padded vector's whole length: count only what it adds to fc1"
    else:
        how = "the padding fills up the last slice to S"
    if padding == -f.padding:
        return fail(f"✗ {name}: the sign is wrong — {how}")
    if abs(padding - f.padding) == 1:
        return fail(f"✗ {name}: one too {'many' if padding > f.padding else 'few'} — {how}")
    return fail(f"✗ {name}: too {'large' if padding > f.padding else 'small'} — {how}")


def file_array_bytes(path: Path) -> int:
    """The bytes of array data in one .npz file (headers not counted)."""
    with np.load(path) as arrays:
        return sum(arrays[key].nbytes for key in arrays.files)


def check_checkpoint_bytes(
    checkpoint_array_bytes: Callable, layouts: dict[str, FlatParam], written: dict[int, Path]
) -> bool:
    """Exercise 3: checkpoint_array_bytes(n) against the files written at each N of `written`
    (a checkpoint directory per N) and, at N = 1 and 3, against FlatParam's shard sizes."""
    expected = {}
    for n, directory in written.items():
        sizes = {file_array_bytes(directory / rank_file(r, n)) for r in range(n)}
        if len(sizes) != 1:
            raise AssertionError(f"the ranks' files at N = {n} hold different bytes: {sizes}")
        expected[n] = sizes.pop()
    for n in (1, 3):  # three float32 arrays (params, m, v) of each layer's shard
        expected[n] = 3 * 4 * sum(FlatParam(f.shapes, n).shard_size for f in layouts.values())
    counts = sorted(expected)
    return check(
        "checkpoint_array_bytes",
        [checkpoint_array_bytes(k) for k in counts],
        [expected[k] for k in counts],
        hint="a rank's file holds its slice of each layer's padded vector, for each"
        " array Adam keeps",
    )
