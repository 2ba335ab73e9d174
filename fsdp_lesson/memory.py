"""MemoryLedger: live and peak bytes per category on this rank.

Strategies allocate their arrays through the ledger, and the training loop reports the
activations it keeps for backward, so every byte the ZeRO tables talk about is counted here.
"""

from __future__ import annotations

import math

import numpy as np

CATEGORIES = ("params", "grads", "optimizer", "activations", "buffers")


def placeholder(shape, dtype=np.float32) -> np.ndarray:
    """An array of `shape` that holds one element, seen through zero strides: its nbytes are
    what the shape says, its memory one element (what a dry run allocates; dryrun.py)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    one = np.zeros(1, dtype=dtype)
    return np.lib.stride_tricks.as_strided(one, shape, (0,) * len(shape), writeable=True)


class MemoryBudgetError(MemoryError):
    """An allocation would exceed the rank's memory budget."""


class MemoryLedger:
    """Bytes by category: `peak` holds each category's high-water mark, `peak_total` the sum's."""

    def __init__(self, rank: int = 0, budget_bytes: int | None = None, dry: bool = False) -> None:
        self.rank, self.budget_bytes = rank, budget_bytes
        self.dry = dry  # count as usual, but hand out placeholders (a dry run's ledger)
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.peak = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0
        self.live_total = 0  # sum(live.values()), kept as it changes: hold runs on every layer
        self.held: dict[str, tuple[str, int]] = {}  # label -> (category, bytes)
        # when recording: (event, live total) at every hold and free
        self.timeline: list[tuple[str, int]] | None = None

    def alloc(
        self, category: str, shape, label: str, dtype=np.float32, zeroed: bool = True
    ) -> np.ndarray:
        """An array counted under `category` until `free(label)`: zeroed, or left unfilled
        for a caller that overwrites it at once (one pass over memory fewer)."""
        count = shape if isinstance(shape, int) else math.prod(shape)
        self.hold(category, label, int(count) * np.dtype(dtype).itemsize)
        if self.dry:
            return placeholder(shape, dtype)
        return np.zeros(shape, dtype=dtype) if zeroed else np.empty(shape, dtype=dtype)

    def hold(self, category: str, label: str, nbytes: int) -> None:
        """Count `nbytes` of an array allocated elsewhere (e.g. activations) until `free(label)`."""
        if label in self.held:
            raise KeyError(f"ledger already holds {label!r}")
        if self.budget_bytes is not None and self.live_total + nbytes > self.budget_bytes:
            over = self.live_total + nbytes - self.budget_bytes
            raise MemoryBudgetError(
                f"rank {self.rank}: allocating {nbytes:,} bytes of {category} ({label}) would "
                f"exceed the memory budget of {self.budget_bytes:,} bytes by {over:,} bytes; "
                f"shard more (a higher ZeRO stage), use more ranks, or raise the budget"
            )
        self.held[label] = (category, nbytes)
        live = self.live[category] = self.live[category] + nbytes
        self.live_total += nbytes
        if live > self.peak[category]:
            self.peak[category] = live
        if self.live_total > self.peak_total:
            self.peak_total = self.live_total
        if self.timeline is not None:  # (the event's text only then: hold runs per layer)
            self.timeline.append((f"hold {label}", self.live_total))

    def free(self, label: str) -> None:
        category, nbytes = self.held.pop(label)
        self.live[category] -= nbytes
        self.live_total -= nbytes
        if self.timeline is not None:
            self.timeline.append((f"free {label}", self.live_total))

    def report(self) -> dict:
        """Live and peak bytes by category, for history.json and the plots."""
        return {"live": dict(self.live), "peak": dict(self.peak), "peak_total": self.peak_total}


class Activations:
    """What forward keeps for backward, and the gradient flowing back, counted by the ledger.

    Forward pushes each layer's cache. Backward pops them in reverse; `gradient(label, dx)`
    records each new gradient, and only then are the previous gradient and the popped cache
    freed, because until a layer's backward returns all three are alive.
    """

    def __init__(self, ledger: MemoryLedger, prefix: str = "") -> None:
        self.ledger = ledger
        self.prefix = prefix  # before every label: "m2 " when micro-batches overlap (pipeline.py)
        self.caches: list[tuple[str, object]] = []
        self.dying: list[str] = []  # labels to free at the next gradient
        self.grad: np.ndarray | None = None  # the gradient flowing back: the latest one

    def push(self, label: str, cache) -> None:
        label = self.prefix + label
        self.ledger.hold("activations", label, cache.nbytes)
        self.caches.append((label, cache))

    def drop(self) -> None:
        """Forget the cache just pushed (--recompute: backward computes it again)."""
        label, _ = self.caches.pop()
        self.ledger.free(label)

    def top(self):
        """The cache backward pops next, left in place."""
        return self.caches[-1][1]

    def pop(self):
        label, cache = self.caches.pop()
        self.dying.append(label)
        return cache

    def gradient(self, label: str, dx: np.ndarray | None) -> np.ndarray | None:
        """dx now exists (None: the embedding passes no gradient on), the gradient flowing
        back from here (`grad`, the only reference a caller needs to keep); free what it
        replaces."""
        label = self.prefix + label
        self.ledger.hold("activations", label, 0 if dx is None else dx.nbytes)
        for old in self.dying:
            self.ledger.free(old)
        self.dying = [label]
        self.grad = dx
        return dx

    def clear(self) -> None:
        """Free the last gradient: the step's activations are gone."""
        for old in self.dying:
            self.ledger.free(old)
        self.dying, self.grad = [], None
