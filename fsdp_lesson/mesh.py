"""The process mesh: N ranks as a grid with named dimensions, one communicator along each.

    DIMS = ("pp", "dp", "cp", "tp")   slowest- to fastest-changing rank: world rank r is
                                      tp rank r % T, cp rank (r // T) % C,
                                      dp rank (r // (T * C)) % D, pp rank r // (T * C * D)

D = N / (T * C * P) is the data-parallel size. Without cp the same layout as the C program's
3-D sibling, so that rank r holds the same piece in both. Tensor parallelism talks every layer,
so its ranks are neighbours (on one host when hosts hold T or more ranks); context parallelism
passes K/V blocks every attention, next; pipeline stages talk least, once per micro-batch, so
they are farthest apart. A new dimension (experts' ep) is one more name in DIMS: every part that
reads the mesh (placement.py's norm and replica check, checkpoints, the vote on an fp16
overflow) goes over `dims`, never over a fixed list. PyTorch's DeviceMesh is the same object
(`init_device_mesh("cuda", (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))`).

Context parallelism splits each sequence, not the state: the strategy's gradients are partial
over cp as over dp, so the strategy averages and shards over dp and cp as one dimension,
`dp_cp` (`flatten`; torchtitan's dp_shard_cp), D * C ranks.
"""

from __future__ import annotations

import math

from .comm import Comm
from .config import ConfigError

DIMS = ("pp", "dp", "cp", "tp")  # slowest to fastest


class Mesh:
    """This rank's place in the grid (`coords`), the grid's `sizes`, and a Comm along each
    dimension (size 1: no MPI); `world` spans them all."""

    def __init__(self, world: Comm, comms: dict[str, Comm]) -> None:
        self.world, self.comms = world, comms
        self.dims = tuple(comms)
        self.sizes = {dim: comm.size for dim, comm in comms.items()}
        self.coords = {dim: comm.rank for dim, comm in comms.items()}

    @classmethod
    def of(cls, world: Comm, tp: int = 1, pp: int = 1, cp: int = 1) -> Mesh:
        """Split world into the grid; every rank of world must call this with the same sizes.
        dp takes the ranks the other dimensions leave."""
        n, others = world.size, tp * pp * cp
        if min(tp, pp, cp) < 1 or n % others:
            raise ConfigError(
                f"--tp {tp} --pp {pp} --cp {cp} need a multiple of {others} ranks, but this run"
                f" has {n}: start {others * max(1, n // others)} ranks, or choose --tp, --pp and"
                f" --cp whose product divides {n}"
            )
        sizes = {"pp": pp, "dp": n // others, "cp": cp, "tp": tp}
        coords, rest = {}, world.rank
        for dim in reversed(DIMS):  # the fastest first
            rest, coords[dim] = divmod(rest, sizes[dim])
        comms = {dim: along(world, sizes, coords, (dim,), dim) for dim in DIMS}
        return cls(world, comms)

    def flatten(self, dims: tuple[str, ...], name: str) -> Mesh:
        """This mesh with adjacent dimensions `dims` seen as one, `name` (DeviceMesh's
        `mesh[dims]._flatten(name)`): its Comm spans their ranks, row-major as the world's."""
        merged = along(self.world, self.sizes, self.coords, dims, name)
        comms = {}
        for dim, comm in self.comms.items():
            if dim == dims[0]:
                comms[name] = merged
            elif dim not in dims:
                comms[dim] = comm
        return Mesh(self.world, comms)

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

    def state_mesh(self) -> Mesh:
        """The mesh a strategy places its state on. cp splits each sequence, not the state: it
        is folded into dp (dp_cp, D * C ranks, over which the strategy averages and shards, as
        torchtitan's dp_shard_cp does), or left out when it is one rank."""
        if self.sizes.get("cp", 1) == 1:
            return Mesh(self.world, {dim: comm for dim, comm in self.comms.items() if dim != "cp"})
        return self.flatten(("dp", "cp"), "dp_cp")

    def data(self) -> Comm:
        """The ranks that split the batch and over which a strategy runs: dp, or dp and cp
        flattened (dp_cp) when context parallelism splits each sequence as well."""
        return self.comms["dp_cp" if "dp_cp" in self.comms else "dp"]

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
    def cp(self) -> Comm:
        return self.comms["cp"]

    @property
    def shape(self) -> tuple[int, ...]:
        """The size along each dimension, in DIMS' order: (P, D, C, T)."""
        return tuple(self.sizes[dim] for dim in self.dims)

    def stage_ranks(self) -> tuple[int, int]:
        """(W, i): the ranks that hold this rank's pipeline stage (every dimension but pp), and
        this rank's place among them (row-major over the dimensions, the fastest last)."""
        inner = [d for d in self.dims if d != "pp"]
        place = 0
        for d in inner:
            place = place * self.sizes[d] + self.coords[d]
        return math.prod(self.sizes[d] for d in inner), place


def along(world: Comm, sizes: dict, coords: dict, dims: tuple[str, ...], name: str) -> Comm:
    """The Comm of the ranks that differ only along `dims` (the world when they are all of
    it; no MPI when they are one rank), ranked row-major over dims as the world is."""
    size = math.prod(sizes[d] for d in dims)
    if size == world.size:
        return world  # the only dimension: the world itself, named as before
    if size == 1:
        return Comm(None, world.collectives, world.timeout)
    color = key = 0
    for d in DIMS:  # ranks share a Comm when they agree on every other dimension
        if d in dims:
            key = key * sizes[d] + coords[d]
        else:
            color = color * sizes[d] + coords[d]
    return world.split(color, key, name)
