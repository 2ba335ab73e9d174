"""Placements (DTensor's Shard and Replicate) and the mesh: the generic functions every rank's
whole-model computation runs through (the MPI meshes are tested in test_mesh.py)."""

from types import SimpleNamespace

import numpy as np
import pytest

from fsdp_lesson.comm import Comm
from fsdp_lesson.config import ModelConfig
from fsdp_lesson.memory import MemoryLedger
from fsdp_lesson.mesh import DIMS, Mesh
from fsdp_lesson.model import MLP
from fsdp_lesson.optim import make_optimizer
from fsdp_lesson.placement import (
    OnStage,
    Region,
    Replicate,
    Shard,
    cut_piece,
    global_squares,
    piece_shape,
    replicas,
)
from fsdp_lesson.rng import make_rng
from fsdp_lesson.strategies import make_strategy
from fsdp_lesson.strategies.base import placement_table, state_regions
from fsdp_lesson.tensor import megatron


@pytest.mark.parametrize("dim", [0, 1])
def test_the_pieces_of_a_shard_tile_the_whole_with_zero_padding(dim):
    whole = np.arange(5 * 7, dtype=np.float32).reshape(5, 7)
    pieces = [cut_piece(whole, Shard(dim), 3, r) for r in range(3)]
    assert all(p.shape == piece_shape(whole.shape, Shard(dim), 3) for p in pieces)
    joined = np.concatenate(pieces, axis=dim)
    np.testing.assert_array_equal(
        joined[(slice(None),) * dim + (slice(0, whole.shape[dim]),)], whole
    )
    assert not joined[(slice(None),) * dim + (slice(whole.shape[dim], None),)].any()  # padding


def test_a_replicated_piece_is_a_copy_of_the_whole():
    whole = np.ones(4, np.float32)
    piece = cut_piece(whole, Replicate(), 2, 1)
    assert piece is not whole and np.array_equal(piece, whole)


def test_replicas_multiply_the_replicated_dimensions_only():
    sizes = {"pp": 3, "dp": 4, "tp": 2}
    assert replicas({"pp": OnStage(0), "dp": Shard(0), "tp": Replicate()}, sizes) == 2
    assert replicas({"pp": OnStage(1), "dp": Replicate(), "tp": Replicate()}, sizes) == 8
    assert replicas({"pp": OnStage(2), "dp": Shard(0), "tp": Shard(1)}, sizes) == 1


def test_a_comm_alone_is_a_mesh_of_data_parallel_ranks():
    mesh = Mesh.alone(Comm())
    assert mesh.dims == DIMS and mesh.shape == (1, 1, 1, 1) and mesh.dp.size == 1
    assert mesh.stage_ranks() == (1, 0)
    state = mesh.state_mesh()  # the strategy's: cp (here one rank) places no state
    assert state.dims == ("pp", "dp", "tp")
    split = state.split_dp(Comm(), Comm())
    assert split.dims == ("pp", "dp_replicate", "dp_shard", "tp") and split.world is mesh.world


def test_the_global_norm_counts_a_replicated_region_once():
    """On one rank every size is 1: the sum of squares of every region, nothing counted twice."""
    a = np.array([3.0, 4.0, 12.0], np.float32)
    halves = [Region(0, 2, {"dp": Shard(0)}, "x.W"), Region(2, 3, {"dp": Replicate()}, "x.b")]
    assert global_squares([(a, halves)], Mesh.alone(Comm())) == pytest.approx(169.0)


def test_every_state_array_is_placed_parameter_by_parameter():
    """zero3 on one rank: each unit's shard lies in regions named by parameter, with the
    placements of every mesh dimension; the table a notebook prints adds up to the ledger's
    parameter and optimizer bytes."""
    ledger = MemoryLedger()
    strategy = make_strategy(
        "zero3", MLP(ModelConfig()), make_optimizer("adam", 0.1), Comm(), ledger
    )
    strategy.init_params(make_rng(42))
    entry = strategy.local_state()["fc1.params"]
    regions = state_regions(strategy, "fc1", entry.array, entry.sharded)
    assert [r.name for r in regions] == ["fc1.W", "fc1.b"]
    assert regions[0].placements == {"pp": OnStage(0), "dp": Shard(0), "tp": Replicate()}
    rows = placement_table(strategy)
    held = ledger.report()["peak"]
    assert sum(size for *_, size in rows) <= held["params"] + held["optimizer"]
    assert ("fc1.b m", "pp stage 0, dp Shard(0), tp Replicate()", 256) in rows


def test_a_split_layer_declares_its_placements_and_cuts_by_them():
    """Megatron's pairs over tp = 2 (seen from rank 1): a column layer shards W by columns and
    b, a row layer W by rows and replicates b; the layer's piece is placement.cut_piece's."""
    tp = SimpleNamespace(size=2, rank=1)
    fc1, fc2 = MLP(ModelConfig(), megatron(tp)).layers[1:4:2]
    assert fc1.placements == {"W": Shard(1), "b": Shard(0)} and fc1.pieces == ("W", "b")
    assert fc2.placement("b") == Replicate() and fc2.pieces == ("W",)
    whole = MLP(ModelConfig()).init_params(make_rng(1))["fc2"]
    piece = fc2.piece(whole)
    np.testing.assert_array_equal(piece["W"], cut_piece(whole["W"], Shard(0), 2, 1))
    np.testing.assert_array_equal(piece["b"], whole["b"])
