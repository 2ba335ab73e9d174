"""The process mesh: N ranks as a grid with named dimensions, one communicator along each.

    DIMS = ("pp", "dp", "tp")      slowest- to fastest-changing rank: world rank r is
                                   tp rank  r % T,  dp rank  (r // T) % D,  pp rank  r // (T * D)

D = N / (T * P) is the data-parallel size. The same layout as the C program's 3-D sibling, so
that rank r holds the same piece in both. Tensor parallelism talks every layer, so its ranks are
neighbours (on one host when hosts hold T or more ranks); pipeline stages talk least, once per
micro-batch, so they are farthest apart. A new dimension (context parallelism's cp, experts'
ep) is one more name in DIMS: every part that reads the mesh (placement.py's norm and replica
check, checkpoints, the vote on an fp16 overflow) goes over `dims`, never over a fixed list.
PyTorch's DeviceMesh is the same object (`init_device_mesh("cuda", (pp, dp, tp),
mesh_dim_names=("pp", "dp", "tp"))`).
"""

from __future__ import annotations

import math

from .comm import Comm
from .config import ConfigError

DIMS = ("pp", "dp", "tp")  # slowest to fastest


class Mesh:
    """This rank's place in the grid (`coords`), the grid's `sizes`, and a Comm along each
    dimension (size 1: no MPI); `world` spans them all."""

    def __init__(self, world: Comm, comms: dict[str, Comm]) -> None:
        self.world, self.comms = world, comms
        self.dims = tuple(comms)
        self.sizes = {dim: comm.size for dim, comm in comms.items()}
        self.coords = {dim: comm.rank for dim, comm in comms.items()}

    @classmethod
    def of(cls, world: Comm, tp: int = 1, pp: int = 1) -> Mesh:
        """Split world into the grid; every rank of world must call this with the same sizes.
        dp takes the ranks the other dimensions leave."""
        n = world.size
        if tp < 1 or pp < 1 or n % (tp * pp):
            raise ConfigError(
                f"--tp {tp} --pp {pp} need a multiple of {tp * pp} ranks, but this run has {n}:"
                f" start {tp * pp * max(1, n // (tp * pp))} ranks, or choose --tp and --pp whose"
                f" product divides {n}"
            )
        sizes = {"pp": pp, "dp": n // (tp * pp), "tp": tp}
        coords, rest = {}, world.rank
        for dim in reversed(DIMS):  # the fastest first
            rest, coords[dim] = divmod(rest, sizes[dim])
        comms = {}
        for dim in DIMS:  # ranks that differ only along dim share a Comm: color = the others
            others = [d for d in DIMS if d != dim]
            color = 0
            for d in others:
                color = color * sizes[d] + coords[d]
            if sizes[dim] == n:
                comms[dim] = world  # the only dimension: the world itself, named as before
            elif sizes[dim] == 1:
                comms[dim] = Comm(None, world.collectives, world.timeout)
            else:
                comms[dim] = world.split(color, coords[dim], dim)
        return cls(world, comms)

    @classmethod
    def alone(cls, dp: Comm) -> Mesh:
        """The mesh of a strategy given ranks that only split the batch (a notebook's Comm)."""
        one = Comm(None, dp.collectives, dp.timeout)
        return cls(dp, {dim: dp if dim == "dp" else one for dim in DIMS})

    def split_dp(self, replicate: Comm, shard: Comm) -> Mesh:
        """This mesh with dp cut in two (HSDP, zero3's --replicate): R groups that replicate,
        each of N/R ranks that shard (torchtitan's dp_replicate x dp_shard)."""
        comms = {}
        for dim, comm in self.comms.items():
            comms |= {"dp_replicate": replicate, "dp_shard": shard} if dim == "dp" else {dim: comm}
        return Mesh(self.world, comms)

    def comm(self, dim: str) -> Comm:
        return self.comms[dim]

    @property
    def tp(self) -> Comm:
        return self.comms["tp"]

    @property
    def dp(self) -> Comm:
        return self.comms["dp"]

    @property
    def pp(self) -> Comm:
        return self.comms["pp"]

    @property
    def shape(self) -> tuple[int, ...]:
        """The size along each dimension, in DIMS' order: (P, D, T)."""
        return tuple(self.sizes[dim] for dim in self.dims)

    def stage_ranks(self) -> tuple[int, int]:
        """(W, i): the ranks that hold this rank's pipeline stage (every dimension but pp), and
        this rank's place among them (row-major over the dimensions, the fastest last)."""
        inner = [d for d in self.dims if d != "pp"]
        place = 0
        for d in inner:
            place = place * self.sizes[d] + self.coords[d]
        return math.prod(self.sizes[d] for d in inner), place
