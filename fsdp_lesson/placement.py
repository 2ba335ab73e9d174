"""Placements: where each array of state lives on the mesh, in PyTorch DTensor's words.

    Shard(dim)    the ranks along a mesh dimension each hold one piece of the array, cut along
                  `dim` (padded with zeros to a multiple of their number)
    Replicate()   every rank along the dimension holds the whole array, the same bits

Every array a strategy keeps has one placement per mesh dimension (mesh.py): along tp, the
layer's own (tensor.py: a column layer's W is Shard(1), a row layer's bias Replicate());
along dp, the sharding table's (sharding.py: zero3's parameters Shard(0) of the flat vector);
along pp, OnStage: each stage holds its own layers. What every rank must compute from the whole
model is then one generic function of (arrays, placements, mesh), whatever the mesh:

    cut_piece, join_pieces    this rank's piece of a whole array, and the whole from the pieces
    replicas                  how many ranks hold the same bits of an array (count it once)
    global_squares            sum of squares over the whole model (clipping's norm)
    differing_replicas        the arrays whose replicas are not bit-identical (a sharding bug)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .comm import Comm, same_everywhere
from .optim import squares


@dataclass(frozen=True)
class Shard:
    """Split along `dim` over the ranks of a mesh dimension (DTensor's Shard(dim))."""

    dim: int = 0

    def __str__(self) -> str:
        return f"Shard({self.dim})"


@dataclass(frozen=True)
class Replicate:
    """Whole and identical on every rank of a mesh dimension (DTensor's Replicate())."""

    def __str__(self) -> str:
        return "Replicate()"


@dataclass(frozen=True)
class OnStage:
    """Held by pipeline stage `index` alone, the whole array: a stage owns its layers (PyTorch's
    pipelining gives each stage its own module; DTensor places nothing along pp)."""

    index: int

    def __str__(self) -> str:
        return f"stage {self.index}"


Placement = Shard | Replicate | OnStage


def piece_range(width: int, size: int, rank: int) -> tuple[int, int, int]:
    """(start, stop, piece width): rank's part of [0, width) padded to a multiple of size."""
    piece = -(-width // size)
    start = min(rank * piece, width)
    return start, min(start + piece, width), piece


def piece_shape(shape: tuple[int, ...], placement: Placement, size: int) -> tuple[int, ...]:
    """The shape each of `size` ranks holds of an array of `shape` placed so."""
    if not isinstance(placement, Shard):
        return shape
    d = placement.dim
    return (*shape[:d], -(-shape[d] // size), *shape[d + 1 :])


def cut_piece(whole: np.ndarray, placement: Placement, size: int, rank: int) -> np.ndarray:
    """Rank's piece of `whole` (a new array; a Shard's padding zero): DTensor's distribute."""
    if not isinstance(placement, Shard):
        return whole.copy()
    d = placement.dim
    start, stop, _ = piece_range(whole.shape[d], size, rank)
    piece = np.zeros(piece_shape(whole.shape, placement, size), whole.dtype)
    index = (slice(None),) * d
    piece[(*index, slice(0, stop - start))] = whole[(*index, slice(start, stop))]
    return piece


def join_pieces(
    piece: np.ndarray, placement: Placement, comm: Comm, whole_shape: tuple[int, ...]
) -> np.ndarray:
    """The whole array from every rank's piece (an allgather over comm for a Shard, the
    padding cut off; a Replicate is whole already): DTensor's full_tensor."""
    if not isinstance(placement, Shard):
        return piece
    flat = np.empty(comm.size * piece.size, piece.dtype)
    gathered = comm.allgather(np.ascontiguousarray(piece).reshape(-1), flat)
    pieces = gathered.reshape(comm.size, *piece.shape)  # rank r's piece at [r]
    whole = np.concatenate(list(pieces), axis=placement.dim)
    return whole[(slice(None),) * placement.dim + (slice(0, whole_shape[placement.dim]),)]


def replicas(placements: dict[str, Placement], sizes: dict[str, int]) -> int:
    """How many ranks hold the same bits: the product of the Replicate dimensions' sizes."""
    return int(np.prod([sizes[dim] for dim, p in placements.items() if isinstance(p, Replicate)]))


@dataclass(frozen=True)
class Region:
    """Elements [start, stop) of a local array: one parameter ("fc1.W") or the part of it this
    rank holds, and its placement along each mesh dimension."""

    start: int
    stop: int
    placements: dict[str, Placement]
    name: str


def global_squares(regions: list[tuple[np.ndarray, list[Region]]], mesh) -> float:
    """Σ x² over the whole model, the same on every rank: each rank's regions, each counted
    1 / (ranks that hold the same bits), summed over the whole mesh (one allreduce)."""
    sizes, total = mesh.sizes, 0.0
    for array, parts in regions:
        for part in parts:
            total += squares(array[part.start : part.stop]) / replicas(part.placements, sizes)
    return mesh.world.mean_scalar(total) * mesh.world.size


def differing_replicas(arrays: list[tuple[str, np.ndarray, list[Region]]], mesh) -> list[str]:
    """The regions of (what, array, regions) that are not bit-identical on every rank they are
    Replicate over, named by parameter, what ("" for parameters, " m" for Adam's m) and
    dimension: "fc2.b (dp)", "emb.W m (tp)". A collective along each dimension: the ranks of
    one Comm hold the same regions, so they agree on what to compare."""
    differ = []
    for dim in mesh.dims:
        comm = mesh.comm(dim)
        if comm.size == 1:
            continue
        for what, array, parts in arrays:
            for part in parts:
                if isinstance(part.placements[dim], Replicate):
                    if not same_everywhere(comm, array[part.start : part.stop]):
                        differ.append(f"{part.name}{what} ({dim})")
    return differ
