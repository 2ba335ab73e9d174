"""The process mesh: N ranks as a (pp, dp, tp) grid, one communicator along each dimension.

    world rank r  ->  tp rank  r % T            (consecutive ranks: the fastest links)
                      dp rank  (r // T) % D
                      pp rank  r // (T * D)     (D = N / (T * P), the data-parallel size)

The same layout as the C program's 3-D sibling, so that rank r holds the same piece in both.
Tensor parallelism talks every layer, so its ranks are neighbours (on one host when hosts hold
T or more ranks); pipeline stages talk least, once per micro-batch, so they are farthest apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from .comm import Comm
from .config import ConfigError


@dataclass
class Mesh:
    """This rank's place in the grid and a Comm along each dimension (size 1: no MPI)."""

    world: Comm
    tp: Comm  # the T ranks that split each layer's weights (tensor parallelism)
    dp: Comm  # the D ranks that hold the same pieces and split the batch (the strategy's)
    pp: Comm  # the P ranks that hold consecutive stages of layers (pipeline parallelism)

    @classmethod
    def of(cls, world: Comm, tp: int = 1, pp: int = 1) -> Mesh:
        """Split world into the grid; every rank of world must call this with the same sizes."""
        n = world.size
        if tp < 1 or pp < 1 or n % (tp * pp):
            raise ConfigError(
                f"--tp {tp} --pp {pp} need a multiple of {tp * pp} ranks, but this run has {n}:"
                f" start {tp * pp * max(1, n // (tp * pp))} ranks, or choose --tp and --pp whose"
                f" product divides {n}"
            )
        dp = n // (tp * pp)
        r = world.rank
        tp_rank, dp_rank, pp_rank = r % tp, (r // tp) % dp, r // (tp * dp)

        def along(size: int, color: int, key: int, name: str) -> Comm:
            if size == n:
                return world  # the only dimension: the world itself, named as before
            if size == 1:
                return Comm(None, world.collectives, world.timeout)
            return world.split(color, key, name)

        return cls(
            world=world,
            tp=along(tp, pp_rank * dp + dp_rank, tp_rank, "tp"),
            dp=along(dp, pp_rank * tp + tp_rank, dp_rank, "dp"),
            pp=along(pp, dp_rank * tp + tp_rank, pp_rank, "pp"),
        )

    @property
    def shape(self) -> tuple[int, int, int]:
        """(P, D, T): stages, data-parallel replicas, tensor-parallel pieces."""
        return self.pp.size, self.dp.size, self.tp.size
