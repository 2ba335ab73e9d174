"""Notebook 11's checkers: a Linear cut into pieces (exercise 1), the forward with g (exercise
2) and the backward with f (exercise 3). Each runs on the engines with the names the notebook's
%%px cells made there (`split`, `single`, `whole`, `pieces`, `X`, `Y`, `tp`, `rank`, `T` and
the learner's functions), computes the expected pieces, logits and gradients here from the
package's layers, and names the first rank and array that differ and how (a shape; one of the
usual mistakes: no sum, a mean, the bias T times), never the expected values."""

from __future__ import annotations

import numpy as np

from ..checks import check, fail, not_solved, residue


def allreduces_counted(comm) -> tuple[int, int]:
    """(calls, bytes) of the allreduces `comm` has counted so far."""
    t = comm.traffic_report()["allreduce"]
    return t["calls"], t["buffer_bytes"]


def pieces_on_a_rank() -> list[tuple]:
    """On every rank: the learner's pieces of fc1 (column_piece) and fc2 (row_piece) beside the
    package's (`layer.piece` of `split`'s layers), as (what, answer, expected, {how it is
    wrong: what it would then be}): another rank's piece, or every T-th column (row)."""
    import __main__ as ns

    items, T = [], ns.T
    for layer, cut, axis in ((ns.split.layers[1], ns.column_piece, 1),
                             (ns.split.layers[3], ns.row_piece, 0)):  # fmt: skip
        piece, whole = cut(ns.whole[layer.name], ns.rank, T), ns.whole[layer.name]
        lines = "columns" if axis == 1 else "rows"
        for key, expected in layer.piece(whole).items():
            answer = piece.get(key) if isinstance(piece, dict) else piece
            mistakes, cut_axis = {}, axis if key == "W" else 0
            size = whole[key].shape[cut_axis]
            if expected.shape != whole[key].shape:  # a piece, not kept whole (fc2's bias is)

                def taken(indices, array=whole[key], cut_axis=cut_axis):
                    return np.take(array, list(indices), axis=cut_axis)

                strided = f"every {T}th of the {lines} from {ns.rank} on: rank r's are a block"
                mistakes[strided + " of consecutive ones"] = taken(range(ns.rank, size, T))
                for other in set(range(T)) - {ns.rank}:
                    block = range(other * size // T, (other + 1) * size // T)
                    mistakes[f"rank {other}'s {lines}, not rank {ns.rank}'s"] = taken(block)
            items.append((f"{layer.name}.{key} ({cut.__name__})", answer, expected, mistakes))
    return items


def check_pieces(ranks) -> bool:
    """Exercise 1: every rank's pieces against the package's; the first rank and array whose
    shape or values differ, and how (another rank's piece, a stride), never the values."""
    results = ranks.run(pieces_on_a_rank, timeout=60)
    if any(answer is None for items in results for _, answer, _, _ in items):
        return check("pieces", None, None)  # the placeholder: "not solved yet"
    for r, items in enumerate(results):
        for what, answer, expected, mistakes in items:
            answer = np.asarray(answer)
            if answer.shape != expected.shape:
                return fail(
                    f"✗ pieces: rank {r}, {what}: shape {answer.shape}, where"
                    f" {expected.shape} is expected"
                )
            if not np.array_equal(answer, expected):
                how = next((text for text, wrong in mistakes.items()
                            if np.array_equal(answer, wrong)), None)  # fmt: skip
                return fail(
                    f"✗ pieces: rank {r}, {what}: {how}"
                    if how
                    else f"✗ pieces: rank {r}, {what}: the right shape, other values — which"
                    " columns (rows) are rank r's, and which axis of W holds them?"
                )
    print(f"✓ pieces: correct on all {len(results)} ranks")
    return True


def tp_verdict(name: str, per_rank: list, operator: str, atol: float = 1e-6) -> bool:
    """One line for an exercise run on every rank. per_rank[r]: None (a placeholder), or
    {"items": [(what, answer, expected, {how it is wrong: what it would then be})],
     "allreduces": (calls, bytes) counted on tp, "needed": (calls, bytes)}."""
    if any(result is None for result in per_rank):
        return check(name, None, None)
    for r, result in enumerate(per_rank):
        for what, answer, expected, mistakes in result["items"]:
            answer = np.asarray(answer)
            if answer.shape != expected.shape:
                return fail(
                    f"✗ {name}: rank {r}, {what}: shape {answer.shape}, where"
                    f" {expected.shape} is expected"
                )
            if not residue(answer, expected) <= atol:
                how = next(
                    (text for text, wrong in mistakes.items() if residue(answer, wrong) <= atol),
                    f"differs by more than {atol:.0e}",
                )
                return fail(f"✗ {name}: rank {r}, {what}: {how}")
        if result["allreduces"] != result["needed"]:
            calls, sent = result["allreduces"]
            return fail(
                f"✗ {name}: rank {r}: the values are right, but tp counted {calls}"
                f" allreduce calls of {sent:,} bytes — {operator}"
            )
    print(f"✓ {name}: correct on all {len(per_rank)} ranks, one allreduce each")
    return True


def forward_on_a_rank() -> dict | None:
    """On every rank: the learner's tp_forward on the package's pieces, against the
    single-rank model's logits and this rank's fc1 output; None while it is a placeholder."""
    import __main__ as ns

    single, whole, tp, T = ns.single, ns.whole, ns.tp, ns.T
    x, _ = single.layers[0].forward(whole["emb"], ns.X)  # the embedding's output, (32, 256)
    y = x
    for layer in single.layers[1:]:
        y, _ = layer.forward(whole[layer.name], y)  # single's logits
    p1, p2, b = ns.pieces["fc1"], ns.pieces["fc2"], whole["fc2"]["b"]
    h = x @ p1["W"] + p1["b"]
    share = np.maximum(h, 0) @ p2["W"]
    before = allreduces_counted(tp)
    mine = ns.tp_forward(x.copy(), p1, p2, tp)
    after = allreduces_counted(tp)
    if not_solved(mine):
        return None
    logits = {
        "this rank's share only: g sums the shares of all ranks": share + b,
        "the mean of the shares: g is a sum": (y - b) / T + b,
        "the bias counted T times: add it once, after the sum": y + (T - 1) * b,
        "no bias": y - b,
    }
    return {
        "items": [
            ("the logits", mine[0], y, logits),
            (
                "h",
                mine[1],
                h,
                {
                    "h after the ReLU: return fc1's output before it (backward"
                    " needs it to know where the ReLU passed)": np.maximum(h, 0)
                },
            ),
        ],
        "allreduces": (after[0] - before[0], after[1] - before[1]),
        "needed": (1, y.nbytes),
    }


def check_tp_forward(ranks) -> bool:
    """Exercise 2: tp_forward on every rank, and its one allreduce."""
    return tp_verdict(
        "tp_forward",
        ranks.run(forward_on_a_rank, timeout=60),
        "g is one allreduce-sum of the row layer's output",
    )


def single_backward(single, whole: dict, X: np.ndarray, Y: np.ndarray) -> tuple:
    """The single-rank model's forward and backward from the embedding's output x, layer by
    layer: (x, dlogits, dx, each layer's whole gradients), what tp_backward must reproduce."""
    x, _ = single.layers[0].forward(whole["emb"], X)
    y, caches = x, []
    for layer in single.layers[1:]:
        y, cache = layer.forward(whole[layer.name], y)
        caches.append(cache)
    _, loss_cache = single.loss.forward(y, Y)
    dlogits = single.loss.backward(loss_cache)
    dx, grads = dlogits.copy(), {}
    for layer, cache in zip(reversed(single.layers[1:]), reversed(caches), strict=True):
        grads[layer.name] = {k: np.empty_like(v) for k, v in whole[layer.name].items()}
        dx = layer.backward(whole[layer.name], cache, dx, grads[layer.name])
    return x, dlogits, dx, grads


def backward_on_a_rank() -> dict | None:
    """On every rank: the learner's tp_backward against this rank's pieces of the single-rank
    model's gradients and the whole dx; None while it is a placeholder."""
    import __main__ as ns

    split, tp, T = ns.split, ns.tp, ns.T
    x, dlogits, dx, grads = single_backward(ns.single, ns.whole, ns.X, ns.Y)
    p1, p2 = ns.pieces["fc1"], ns.pieces["fc2"]
    h = x @ p1["W"] + p1["b"]
    own = ((dlogits @ p2["W"].T) * (h > 0)) @ p1["W"].T  # this rank's part of dx only
    before = allreduces_counted(tp)
    mine = ns.tp_backward(x.copy(), h.copy(), p1, p2, dlogits.copy(), tp)
    after = allreduces_counted(tp)
    if not_solved(mine):
        return None
    g1, g2, mine_dx = mine
    want1, want2 = split.layers[1].piece(grads["fc1"]), split.layers[3].piece(grads["fc2"])
    unmasked = dlogits @ p2["W"].T  # da, without the ReLU's mask
    no_mask = {"W": x.T @ unmasked, "b": unmasked.sum(axis=0)}
    items = [
        (f"fc1's {key} gradient", g1.get(key), want1[key],
         {"the ReLU's backward is missing between fc2 and fc1": no_mask[key]})
        for key in ("W", "b")
    ]  # fmt: skip
    items += [
        (
            "fc2's W gradient",
            g2.get("W"),
            want2["W"],
            {"fc2's input is the ReLU's output, not h": h.T @ dlogits},
        ),  # fmt: skip
        (
            "fc2's b gradient",
            g2.get("b"),
            want2["b"],
            {
                f"too large by a factor of {T}: dlogits is the same on every rank, so the"
                " bias's gradient needs no sum": T * want2["b"]
            },
        ),
        (
            "dx",
            mine_dx,
            dx,
            {
                "only the part through this rank's hidden units: f sums them over the ranks": own,
                f"too small by a factor of {T}: f is a sum, not a mean": dx / T,
            },
        ),
    ]
    return {
        "items": items,
        "allreduces": (after[0] - before[0], after[1] - before[1]),
        "needed": (1, dx.nbytes),
    }


def check_tp_backward(ranks) -> bool:
    """Exercise 3: tp_backward on every rank, and its one allreduce."""
    return tp_verdict(
        "tp_backward",
        ranks.run(backward_on_a_rank, timeout=60),
        "f is one allreduce-sum of the column layer's input gradient",
    )
