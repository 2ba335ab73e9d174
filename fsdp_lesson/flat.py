"""FlatParam: one layer's parameters laid out as one flat vector, padded and cut into N shards.

    [ W (in*out) | b (out) | 0 0 (padding) ]     length padded = N * shard_size
      rank 0 owns [0, S), rank 1 owns [S, 2S), ...

The layout is all a FlatParam holds; buffers are allocated by whoever owns them (a strategy,
through the memory ledger). The padding is zero and never reaches the math: `views` looks
only at the first `numel` elements.
"""

from __future__ import annotations

import numpy as np

Params = dict[str, np.ndarray]  # one layer's parameters (or gradients) by name


class FlatParam:
    """The flat, padded layout of one layer's parameters over `world_size` shards."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], world_size: int = 1) -> None:
        self.shapes = dict(shapes)
        self.sizes = {name: int(np.prod(shape)) for name, shape in self.shapes.items()}
        self.numel = sum(self.sizes.values())
        self.world_size = world_size
        self.shard_size = -(-self.numel // world_size)  # ceil(numel / N)
        self.padded_numel = self.shard_size * world_size
        self.padding = self.padded_numel - self.numel
        self.spans = []  # (name, start, stop, shape) of each parameter in the flat vector
        offset = 0
        for name, shape in self.shapes.items():
            self.spans.append((name, offset, offset + self.sizes[name], shape))
            offset += self.sizes[name]

    def views(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        """Each parameter as a shaped view into a full flat buffer (no copy)."""
        return {name: flat[start:stop].reshape(shape) for name, start, stop, shape in self.spans}

    def flatten(self, arrays: dict[str, np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
        """Copy shaped parameters into a full flat buffer (new if out is None), padding zeroed."""
        if out is None:
            out = np.empty(self.padded_numel, dtype=np.float32)
        for name, view in self.views(out).items():
            view[...] = arrays[name]
        out[self.numel :] = 0
        return out

    def copy_shard(self, arrays: dict[str, np.ndarray], rank: int, out: np.ndarray) -> np.ndarray:
        """Copy rank's shard of the flat vector straight from shaped arrays: no full vector.

        `arrays` may hold only some of the parameters (one layer of a unit, as initialisation
        draws them): those parts of the shard are written, the rest is left as it is, and the
        padding is zeroed.
        """
        start, stop = self.shard_range(rank)
        out[max(self.numel - start, 0) :] = 0  # the padding in this shard
        for name, first, end, _ in self.spans:
            lo, hi = max(start, first), min(stop, end)  # the overlap with this array
            if lo < hi and name in arrays:
                out[lo - start : hi - start] = arrays[name].reshape(-1)[lo - first : hi - first]
        return out

    def padded(self, vector: np.ndarray) -> np.ndarray:
        """A layer's whole vector (padded or not) as a new padded float32 vector."""
        out = np.zeros(self.padded_numel, dtype=np.float32)
        out[: self.numel] = vector[: self.numel]
        return out

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The [start, stop) elements of the padded vector that `rank` owns."""
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def owned_shard(self, flat: np.ndarray, rank: int) -> np.ndarray:
        """The view of a full flat buffer that `rank` owns."""
        start, stop = self.shard_range(rank)
        return flat[start:stop]
