"""Notebook 03's exercises (data parallelism): each checker computes the expected answer with
the package, runs the learner's function where it lives (a `%%px` function on the engines,
fetched there by name), and says where and how an answer is wrong, never what is right."""

from __future__ import annotations

import numpy as np
from ipyparallel import Reference

from ..checks import NOT_SOLVED, check, fail, not_solved
from ..config import ModelConfig
from ..model import MLP

ATOL = 1e-6


def _world():
    from mpi4py import MPI

    return MPI, MPI.COMM_WORLD


def _mean_or_what(mine: np.ndarray, mean: np.ndarray, total: np.ndarray, given: np.ndarray,
                  n: int) -> str | None:  # fmt: skip
    """None if mine is the mean; else how it is wrong, in words that do not give it away."""
    if mine.shape != mean.shape:
        return f"of shape {mine.shape}, not the buffer's {mean.shape}"
    if np.max(np.abs(mine - mean), initial=0) <= ATOL:
        return None
    if np.max(np.abs(mine - total), initial=0) <= ATOL:
        return f"too large by a factor of {n} (N): the sum over the ranks, not their mean"
    if np.array_equal(mine, given):
        return "still this rank's own values: nothing was combined with the other ranks"
    if not mine.any():
        return (
            "all zeros: this rank received nothing (a Reduce leaves the result on its root alone)"
        )
    return f"not the mean over the ranks: off by more than {ATOL:.0e}"


def _try_allreduce_mean(allreduce_mean) -> str | None:
    # On every rank: the learner's allreduce_mean on this rank's random buffer.
    MPI, comm = _world()
    given = np.random.default_rng(comm.rank).standard_normal(6).astype(np.float32)
    total = given.copy()
    comm.Allreduce(MPI.IN_PLACE, total, op=MPI.SUM)
    mean = total / comm.size
    buf = given.copy()
    returned = allreduce_mean(comm, buf)
    if returned is None:
        return NOT_SOLVED
    how = _mean_or_what(buf, mean, total, given, comm.size)
    if how is not None:
        if _mean_or_what(np.asarray(returned), mean, total, given, comm.size) is None:
            return "the returned array is the mean, but buf itself was not changed (in place)"
        return f"buf is {how}"
    if returned is not buf:
        return "buf holds the mean, but the function returns another array: return buf"
    return None


def _verdict(name: str, per_rank: list[str | None], done: str) -> bool:
    """One line from what every rank found (None: right): the first rank's problem, named."""
    if any(problem == NOT_SOLVED for problem in per_rank):
        return fail(f"✗ {name}: {NOT_SOLVED}")
    wrong = [(r, problem) for r, problem in enumerate(per_rank) if problem is not None]
    if wrong:
        r, problem = wrong[0]
        also = f" (and {len(wrong) - 1} more ranks)" if len(wrong) > 1 else ""
        return fail(f"✗ {name}: rank {r}: {problem}{also}")
    print(f"✓ {name}: {done}")
    return True


def check_allreduce_mean(ranks) -> bool:
    """Exercise 1: the engines' `allreduce_mean(comm, buf)` on every rank's own random buffer."""
    found = ranks.run(_try_allreduce_mean, Reference("allreduce_mean"), timeout=30)
    return _verdict("allreduce_mean", found, f"correct on all {ranks.n} ranks")


def _try_average_grads(average_grads, grads) -> str | None:
    # On every rank: the learner's average_grads on this rank's gradients of step 2.
    MPI, comm = _world()
    given = {name: {key: g.copy() for key, g in layer.items()} for name, layer in grads.items()}
    totals = {}  # the sums over the ranks first: every rank makes the same collectives
    for name, layer in given.items():
        for key, g in layer.items():
            totals[name, key] = g.copy()
            comm.Allreduce(MPI.IN_PLACE, totals[name, key], op=MPI.SUM)
    try:
        mine = average_grads(comm, grads)
        if mine is None:
            return NOT_SOLVED
        for (name, key), total in totals.items():
            g = given[name][key]
            if not np.array_equal(grads[name][key], g):
                return (
                    f"{name}.{key} as given was changed: average a copy and leave grads as it was"
                )
            if name not in mine or key not in mine[name]:
                return f"the returned dict has no {name}.{key}"
            how = _mean_or_what(np.asarray(mine[name][key]), total / comm.size, total, g, comm.size)
            if how is not None:
                return f"{name}.{key} is {how}"
        return None
    finally:
        for name, layer in given.items():  # put them back, whatever the function did
            for key, g in layer.items():
                grads[name][key][...] = g


def check_average_grads(ranks) -> bool:
    """Exercise 2: the engines' `average_grads(comm, grads)` on every rank's `grads` of step 2:
    a new dict of means, and `grads` left as it was."""
    found = ranks.run(_try_average_grads, Reference("average_grads"), Reference("grads"),
                      timeout=30)  # fmt: skip
    return _verdict("average_grads", found, f"correct on all {ranks.n} ranks")


def check_losses_by_rank(ranks, losses_by_rank) -> bool:
    """Exercise 3: `losses_by_rank(view)` with views of the engines in three orders."""
    expected = ranks.view.pull("loss")  # ranks.view is in rank order
    rank_of = {engine: r for r, engine in enumerate(ranks.view.targets)}
    by_rank = list(ranks.view.targets)
    for targets in (by_rank, by_rank[::-1], by_rank[1:] + by_rank[:1]):
        answer = losses_by_rank(ranks.client.direct_view(targets))
        if not_solved(answer):
            return fail(f"✗ losses_by_rank: {NOT_SOLVED}")
        order = [rank_of[engine] for engine in targets]
        if len(answer) != len(expected):
            return fail(f"✗ losses_by_rank: with the engines of ranks {order}, {len(answer)}"
                        f" losses for {len(expected)} ranks")  # fmt: skip
        for r, value in enumerate(answer):
            if value != expected[r]:
                holder = expected.index(value) if value in expected else "no rank"
                return fail(
                    f"✗ losses_by_rank: with the engines of ranks {order}, position {r}"
                    f" holds the loss of rank {holder}"
                )
    print("✓ losses_by_rank: correct, whatever the order of the engines")
    return True


def dp_bytes_per_step(n: int, psi: int) -> float:
    """What one rank sends per dp step on n ranks (the ring model): the allreduce of every
    float32 gradient and of the logged float64 loss."""
    return 2 * (n - 1) / n * (4 * psi + 8)


def check_dp_traffic(dp_traffic_per_step, counted: float) -> bool:
    """Exercise 4: `dp_traffic_per_step(n, psi)` for the notebook's model (the seed's
    `ModelConfig()`, whose Ψ it takes here): at N = 4 against what `Comm` counted on the
    cluster (`counted`, bytes per step), at N = 1, 2 and 8 against the ring model."""
    psi = MLP(ModelConfig()).num_params
    world_sizes = [1, 2, 4, 8]
    expected = [counted if k == 4 else dp_bytes_per_step(k, psi) for k in world_sizes]
    answers = [dp_traffic_per_step(k, psi) for k in world_sizes]
    name = "dp_traffic_per_step"
    if not not_solved(answers) and all(isinstance(a, (int, float)) for a in answers):
        mistakes = {  # what each named mistake would answer
            "the gradients' bytes are right, the logged loss's are missing": [
                2 * (k - 1) / k * 4 * psi for k in world_sizes
            ],
            "the same at every N, but one rank alone sends nothing: a ring's phases send part"
            " of the buffer, a part that depends on N": [2 * (4 * psi + 8)] * len(world_sizes),
            "half of it: an allreduce on a ring has two phases (section 2)": [
                e / 2 for e in expected
            ],
            "it grows without bound as N grows: a ring rank sends more pieces at larger N,"
            " but each piece is smaller": [2 * (k - 1) * (4 * psi + 8) for k in world_sizes],
        }
        for mistake, answered in mistakes.items():
            if np.allclose(answers, answered, rtol=0, atol=ATOL):
                return fail(f"✗ {name}: {mistake}")
    return check(
        name,
        answers,
        expected,
        atol=ATOL,
        hint="items are N = 1, 2, 4, 8; section 2's table gives an allreduce's bytes",
    )


def _try_ring_reduce_scatter(sends, recvs, chunk=3):
    # On every rank: a ring reduce-scatter in which rank r sends chunk sends[r][k] and receives
    # chunk recvs[r][k] at step k. Returns (this rank's chunk of the sum, the library's).
    MPI, comm = _world()
    rank, size = comm.rank, comm.size
    full = np.random.default_rng([rank, 5]).standard_normal(chunk * size)  # float64
    work, incoming = full.copy(), np.empty(chunk)
    for step in range(size - 1):
        send, recv = sends[rank][step], recvs[rank][step]
        outgoing = work[send * chunk : (send + 1) * chunk]
        comm.Sendrecv(outgoing, dest=(rank + 1) % size, recvbuf=incoming, source=(rank - 1) % size)
        work[recv * chunk : (recv + 1) * chunk] += incoming
    library = np.empty(chunk)
    comm.Reduce_scatter_block(full, library, op=MPI.SUM)
    return work[rank * chunk : (rank + 1) * chunk], library


def first_broken_rule(sends, recvs, n: int):
    """What the ring needs, as (rank, step, what is wrong); None if the indices obey it all."""
    for step in range(n - 1):
        for r in range(n):
            left = (r - 1) % n
            if recvs[r][step] != sends[left][step]:
                return r, step, (f"receives into chunk {recvs[r][step]}, but rank {left}"
                                 f" sends chunk {sends[left][step]}")  # fmt: skip
            if step > 0 and sends[r][step] != recvs[r][step - 1]:
                return (
                    r,
                    step,
                    (
                        f"sends chunk {sends[r][step]}, but the sum it made at step"
                        f" {step - 1} is chunk {recvs[r][step - 1]}: pass that on"
                    ),
                )
    for r in range(n):
        if recvs[r][n - 2] != r:
            return r, n - 2, f"completes chunk {recvs[r][n - 2]} at the last step, not its own {r}"
    return None


def check_ring_chunks(ranks, send_chunk, recv_chunk) -> bool:
    """Exercise 5: a ring reduce-scatter on the ranks with the learner's chunk indices,
    against the library's Reduce_scatter_block; names the first rank and step that is wrong."""
    n, name = ranks.n, "ring reduce-scatter"
    sends = [[send_chunk(r, k, n) for k in range(n - 1)] for r in range(n)]
    recvs = [[recv_chunk(r, k, n) for k in range(n - 1)] for r in range(n)]
    if not_solved(sends) or not_solved(recvs):
        return fail(f"✗ {name}: {NOT_SOLVED}")
    for what, table in (("send_chunk", sends), ("recv_chunk", recvs)):
        for r, k in np.ndindex(n, n - 1):  # check here: a bad index on one rank would hang MPI
            if not isinstance(table[r][k], (int, np.integer)) or not 0 <= table[r][k] < n:
                return fail(
                    f"✗ {name}: {what}({r}, {k}, {n}) = {table[r][k]!r}, not a chunk 0..{n - 1}"
                )
    results = ranks.run(_try_ring_reduce_scatter, sends, recvs, timeout=30)
    wrong = [r for r, (mine, library) in enumerate(results)
             if not np.allclose(mine, library, rtol=0, atol=1e-12)]  # fmt: skip
    if not wrong:
        print(f"✓ {name}: every rank ends with its chunk of the library's sum")
        return True
    rule = first_broken_rule(sends, recvs, n)
    where = "" if rule is None else " First: rank {}, step {}: {}.".format(*rule)
    return fail(f"✗ {name}: ranks {wrong} end with a chunk that is not the library's.{where}")
