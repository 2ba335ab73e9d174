"""Notebook 12's checkers: one micro-batch through two stages by hand (exercise 1) and the
1F1B order of one stage (exercise 2, against `pipeline.schedule_ops`, never shown).

Exercise 1:
The learner's `my_stage_pass(stage, params, pp, x, y)` runs twice on every rank. First a
rehearsal, without MPI: its `pp` is a `Rehearsal` that checks every buffer handed to send and
recv (float32, the boundary's shape, the neighbour's rank) and fills a receive with the values
the neighbour would send (computed here from the whole model), so a wrong buffer or a missing
send is one line naming the stage, before any byte moves and without anyone waiting. Then the
real run over the pair's communicator, with a short timeout, so that whatever the rehearsal
could not see ends within seconds, the watchdog naming the ranks, not after the client's wait.
"""

from __future__ import annotations

import numpy as np

REAL_RUN_TIMEOUT = 20.0  # seconds a real send or receive of the exercise may wait


class StagePassError(ValueError):
    """A buffer, a neighbour or a message of the exercise that is wrong: the one line says how."""


class Sent:
    """What Rehearsal.send returns: a send already done (wait() returns at once)."""

    def wait(self) -> None:
        return None


class Rehearsal:
    """A stand-in for `pp` on one rank: checks each send and receive against the boundary and
    answers a receive with what the neighbour would send (`inputs`: the true activations this
    stage receives; `output_grad`: the true gradient of its output)."""

    def __init__(self, stage, rank: int, rows: int, inputs, output_grad) -> None:
        self.stage, self.rank, self.size, self.rows = stage, rank, stage.count, rows
        self.inputs, self.output_grad = inputs, output_grad
        self.sent: list[int] = []  # the ranks sent to, in order
        self.received: list[int] = []

    def _boundary(self, what: str, buf, peer: int) -> None:
        """Refuse a buffer that is not float32 of the boundary's shape, or a rank that is not a
        neighbour, in one line."""
        ahead, behind = self.rank + 1, self.rank - 1
        if peer not in (ahead, behind) or not 0 <= peer < self.size:
            raise StagePassError(
                f"stage {self.rank}: {what} rank {peer}, which is not a"
                " neighbour stage (pp.rank + 1 forward, pp.rank - 1 back)"
            )
        buf = np.asarray(buf)
        if buf.dtype != np.float32:
            raise StagePassError(
                f"stage {self.rank}: {what} rank {peer} with a {buf.dtype}"
                " buffer; the stages exchange float32: np.empty(shape,"
                " np.float32)"
            )
        width = self.stage.out_width if peer == ahead else self.stage.in_width
        if buf.shape != (self.rows, width):
            side = "stage.out_width" if peer == ahead else "stage.in_width"
            raise StagePassError(
                f"stage {self.rank}: {what} rank {peer} with a buffer of shape"
                f" {buf.shape}; across that boundary go (rows of the"
                f" micro-batch, {side}) arrays"
            )

    def send(self, buf, to: int, tag: str = "") -> Sent:
        self._boundary("sends to", buf, to)
        self.sent.append(to)
        return Sent()

    def recv(self, buf, source: int, tag: str = ""):
        self._boundary("receives from", buf, source)
        self.received.append(source)
        buf[...] = self.inputs if source == self.rank - 1 else self.output_grad
        return buf


def boundary_values(model, params, stage, x, y) -> tuple[np.ndarray, np.ndarray]:
    """The activations stage receives and the gradient of its output, from the whole model."""
    layers = list(model.layers)
    first = layers.index(stage.layers[0])
    end = first + len(stage.layers)
    acts, caches = [x], []
    for layer in layers:
        out, cache = layer.forward(params[layer.name], acts[-1])
        acts.append(out)
        caches.append(cache)
    _, loss_cache = model.loss.forward(acts[-1], y)
    dx, output_grad = model.loss.backward(loss_cache), None
    for i in reversed(range(len(layers))):
        if i + 1 == end:
            output_grad = dx
        p = params[layers[i].name]
        dx = layers[i].backward(p, caches[i], dx, {k: np.empty_like(v) for k, v in p.items()})
    return acts[first].astype(np.float32), np.asarray(output_grad, np.float32)


def missing_messages(stage, rehearsal: Rehearsal) -> str | None:
    """The send or receive a stage must make and did not (or made twice), in words."""
    rank = rehearsal.rank
    wanted_sends = ([] if stage.is_last else [rank + 1]) + ([] if stage.is_first else [rank - 1])
    wanted_recvs = ([] if stage.is_first else [rank - 1]) + ([] if stage.is_last else [rank + 1])
    for peer in wanted_sends:
        if peer not in rehearsal.sent:
            what = "its output" if peer == rank + 1 else "the gradient of its input"
            return (
                f"stage {rank} never sends {what} to stage {peer} (pp.send(..., {peer})):"
                f" stage {peer} would wait for it forever"
            )
    for peer in wanted_recvs:
        if peer not in rehearsal.received:
            what = "its input" if peer == rank - 1 else "the gradient of its output"
            return f"stage {rank} never receives {what} from stage {peer} (pp.recv)"
    if sorted(rehearsal.sent) != sorted(wanted_sends):
        return (
            f"stage {rank} sends {len(rehearsal.sent)} messages; it has {len(wanted_sends)} to send"
        )
    if sorted(rehearsal.received) != sorted(wanted_recvs):
        return (
            f"stage {rank} receives {len(rehearsal.received)} messages; it has"
            f" {len(wanted_recvs)} to receive"
        )
    return None


def stage_pass_items() -> list | str:
    """On every rank, with the notebook's %%px names (stage, params, pair, model, X, Y,
    my_stage_pass): the rehearsal's one line if it finds a mistake, else the real run's
    (what, answer, expected) per parameter of this rank's stage (check_stage_pass judges them)."""
    import __main__
    from fsdp_lesson.checks import not_solved
    from fsdp_lesson.model import loss_and_grads

    ns = __main__
    stage, params, pair, X, Y = ns.stage, ns.params, ns.pair, ns.X, ns.Y
    inputs, output_grad = boundary_values(ns.model, params, stage, X, Y)
    rehearsal = Rehearsal(stage, pair.rank, len(Y), inputs, output_grad)
    unsolved, mistake = False, None
    try:
        unsolved = not_solved(ns.my_stage_pass(stage, params, rehearsal, X, Y))
        mistake = None if unsolved else missing_messages(stage, rehearsal)
    except StagePassError as err:
        mistake = str(err)
    # the real run only if both stages rehearsed well: a stage that returned here would leave
    # its neighbour waiting in the real run
    verdicts = pair.allgather_objects((unsolved, mistake))
    if any(stub for stub, _ in verdicts):
        return [("gradients", None, None)]
    if any(line for _, line in verdicts):
        return mistake or ""  # the neighbour's line comes from the neighbour
    timeout, pair.timeout = pair.timeout, REAL_RUN_TIMEOUT  # rehearsed: no wait should be long
    try:
        answer = ns.my_stage_pass(stage, params, pair, X, Y)
    finally:
        pair.timeout = timeout
    _, whole = loss_and_grads(ns.model, params, X, Y)
    return [
        (f"{name}.{k}", (answer.get(name) or {}).get(k, np.empty(0)), whole[name][k])
        for name in (layer.name for layer in stage.layers)
        for k in whole[name]
    ]


def check_stage_pass(ranks) -> bool:
    """Exercise 1 on the four engines: the rehearsal's first line, or one verdict over the
    real run's gradients against single-rank training's."""
    from fsdp_lesson.checks import NOT_SOLVED, fail, not_solved
    from fsdp_lesson.cluster import RankError

    try:
        per_rank = ranks.run(stage_pass_items, timeout=120)
    except RankError as err:
        if err.ename != "EngineError":  # the learner's code raised: its traceback says where
            raise
        # the watchdog ended the job: a real send or receive waited past REAL_RUN_TIMEOUT
        return fail(
            f"✗ my_stage_pass: in the real run rank {err.rank} (or its neighbour) waited"
            f" more than {REAL_RUN_TIMEOUT:g} s for a message the other stage never sent"
            " (the rehearsal passed: one stage takes a path the other does not); the"
            " engines were restarted: run the setup %%px cell above again"
        )
    lines = [line for line in per_rank if isinstance(line, str) and line]
    if lines:
        return fail(f"✗ my_stage_pass: {lines[0]}")
    if any(not_solved(answer) for items in per_rank for _, answer, _ in items):
        return fail(f"✗ my_stage_pass: {NOT_SOLVED}")
    hint = (
        "forward: receive, run the layers, send on (or the loss); backward: receive the"
        " gradient (or the loss's), layers in reverse, send dx back"
    )
    for r, items in enumerate(per_rank):
        for what, answer, expected in items:
            how = gradient_mistake(answer, expected)
            if how:
                return fail(f"✗ my_stage_pass: rank {r}, {what}: {how} — {hint}")
    print(f"✓ my_stage_pass: correct on all {len(per_rank)} ranks")
    return True


def gradient_mistake(answer, expected, atol: float = 1e-6) -> str | None:
    """How a stage's gradient differs from single-rank training's, in words (None: within
    atol): a wrong shape, nothing written, the sign, a constant factor, else how far."""
    a, e = np.asarray(answer, np.float64), np.asarray(expected, np.float64)
    if a.shape != e.shape:
        return f"shape {a.shape}, expected {e.shape}"
    if np.max(np.abs(a - e), initial=0) <= atol:
        return None
    if not a.any():
        return "all zeros: this layer's backward never wrote its gradient"
    if np.max(np.abs(a + e)) <= atol:
        return "the sign is wrong"
    k = float(np.dot(a.ravel(), e.ravel()) / np.dot(e.ravel(), e.ravel()))
    if k > 0 and np.max(np.abs(a - k * e)) <= atol + 1e-4 * np.max(np.abs(a)):
        if k > 1:
            return f"too large by a factor of {k:.3g} (the same direction)"
        return f"too small by a factor of {1 / k:.3g} (the same direction)"
    return f"differs by more than {atol:.0e} (not by a constant factor)"


def _leading_forwards(ops) -> int:
    return next((i for i, (kind, _) in enumerate(ops) if kind != "F"), len(ops))


def how_1f1b_differs(answer, expected) -> str:
    """Where and how a stage's order first differs from 1F1B's (`expected`), without giving it:
    a malformed list, a missing or repeated op, a micro-batch out of order, or a forward where
    a backward was due (warm-up too long or too short, or the steady state not alternating)."""
    if not isinstance(answer, (list, tuple)) or not all(
        isinstance(op, (list, tuple)) and len(op) == 2 and op[0] in ("F", "B") for op in answer
    ):
        return "give a list of ('F', m) and ('B', m) pairs"
    answer = [tuple(op) for op in answer]
    if sorted(answer) != sorted(expected):
        if len(answer) != len(expected):
            return f"{len(answer)} ops where {len(expected)} are due"
        missing = sorted(set(expected) - set(answer))
        return f"{missing[0][0]}{missing[0][1]} is missing (each op exactly once)"
    i = next(i for i, (a, e) in enumerate(zip(answer, expected, strict=True)) if a != e)
    kind, m = answer[i]
    if kind == expected[i][0]:
        return f"op {i} is {kind}{m}: another micro-batch was due (each kind in order)"
    word = {"F": "a forward", "B": "a backward"}
    longer = _leading_forwards(answer) - _leading_forwards(expected)
    reason = (
        "warm-up too long"
        if longer > 0
        else "warm-up too short"
        if longer < 0
        else "steady state: one forward, then one backward"
    )
    return f"op {i} is {word[kind]}, {word[expected[i][0]]} was due — {reason}"


def check_1f1b(my_1f1b) -> bool:
    """Exercise 2: my_1f1b(P, stage, M) against `schedule_ops("1f1b", ...)` for every P = 2..5,
    stage and M = 1..8; names the first (stage, P, M) that differs and how."""
    from fsdp_lesson.checks import NOT_SOLVED, fail, not_solved
    from fsdp_lesson.pipeline import schedule_ops

    if not_solved(my_1f1b(2, 0, 1)):
        return fail(f"✗ my_1f1b: {NOT_SOLVED}")
    for P in range(2, 6):
        for s in range(P):
            for M in range(1, 9):
                answer, expected = my_1f1b(P, s, M), schedule_ops("1f1b", P, s, M)
                if answer != expected and not (
                    isinstance(answer, (list, tuple))
                    and [tuple(op) if isinstance(op, (list, tuple)) else op for op in answer]
                    == expected
                ):
                    how = how_1f1b_differs(answer, expected)
                    return fail(f"✗ my_1f1b: stage {s} of {P}, M = {M}: {how}")
    print("✓ my_1f1b: correct for every P = 2..5, stage and M = 1..8")
    return True
