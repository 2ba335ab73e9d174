"""The process mesh (fsdp_lesson/mesh.py) under real `mpiexec`: every rank's place in the
(pp, dp, cp, tp) grid is the C 3-D program's (cp between dp and tp), each communicator joins
the ranks it should, and the CLI's meshes (--tp, --pp, both) train single-rank training's
model; what they refuse."""

import json
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from mpi_helpers import assert_prints_the_c_programs, assert_same_as_single, mpiexec  # noqa: E402

from fsdp_lesson.comm import Comm  # noqa: E402
from fsdp_lesson.config import ConfigError, ModelConfig, TrainConfig  # noqa: E402
from fsdp_lesson.data import Dataset  # noqa: E402
from fsdp_lesson.mesh import Mesh  # noqa: E402
from fsdp_lesson.train import run  # noqa: E402

# for every (tp, pp, cp), each rank's rank along each dimension (and along dp and cp flattened,
# the strategy's) and the world ranks there, on rank 0
MESHES = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (2, 2, 1), (4, 1, 1), (1, 4, 1), (1, 1, 2), (2, 1, 2)]
MESHES += [(1, 2, 2), (1, 1, 4)]
PLACES = f"""
import json
import numpy as np
from fsdp_lesson.comm import Comm
from fsdp_lesson.mesh import Mesh
world = Comm.world()
places = {{}}
for tp, pp, cp in {MESHES}:
    mesh = Mesh.of(world, tp, pp, cp)
    place = {{}}
    for dim, comm in [*mesh.comms.items(), ("dp_cp", mesh.state_mesh().data())]:
        members = np.zeros(comm.size)
        comm.allgather(np.array([float(world.rank)]), members)
        place[dim] = [comm.rank, [int(m) for m in members]]
    places[f"{{tp}},{{pp}},{{cp}}"] = place
everyone = world.allgather_objects(places)  # one line from rank 0: prints never interleave
if world.rank == 0:
    print(json.dumps(everyone))
"""


def along(rank: int, sizes: dict[str, int], dims: tuple[str, ...]) -> list:
    """Where world rank `rank` sits along dims (row-major over the grid, tp fastest, then cp,
    dp and pp), and the world ranks that differ from it only there, in their order."""
    shape = tuple(sizes.values())
    coords = dict(zip(sizes, np.unravel_index(rank, shape), strict=True))
    members = []
    for i in range(int(np.prod([sizes[d] for d in dims]))):
        mine = dict(coords) | dict(
            zip(dims, np.unravel_index(i, [sizes[d] for d in dims]), strict=True)
        )
        members.append(int(np.ravel_multi_index([mine[d] for d in sizes], shape)))
    return [members.index(rank), members]


@pytest.mark.mpi
def test_every_rank_sits_where_the_c_program_puts_it():
    """Without cp, the C 3-D program's places; cp sits between dp and tp."""
    result = mpiexec(4, "-c", PLACES, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    everyone = json.loads(result.stdout)
    assert len(everyone) == 4
    for r, places in enumerate(everyone):
        for key, place in places.items():
            tp, pp, cp = map(int, key.split(","))
            sizes = {"pp": pp, "dp": 4 // (tp * pp * cp), "cp": cp, "tp": tp}
            expected = {dim: along(r, sizes, (dim,)) for dim in sizes}
            expected["dp_cp"] = along(r, sizes, ("dp", "cp"))
            assert place == expected, f"rank {r}, tp {tp}, pp {pp}, cp {cp}"


def test_one_rank_is_a_mesh_of_ones():
    mesh = Mesh.of(Comm())
    assert mesh.shape == (1, 1, 1, 1)
    assert mesh.tp is mesh.dp is mesh.pp is mesh.cp is mesh.world
    assert mesh.state_mesh().dims == ("pp", "dp", "tp")  # cp of one rank places nothing


def test_a_mesh_that_does_not_divide_the_ranks_is_refused():
    with pytest.raises(ConfigError, match="--tp 2 --pp 1 --cp 1 need a multiple of 2 ranks"):
        Mesh.of(Comm(), tp=2)


# --- the CLI on meshes: what the "done when" names, against single-rank training -----

MESH_RUNS = [  # (ranks, flags): each must train single-rank training's model within 1e-5
    (4, ["--tp", "2", "--strategy", "zero3"]),
    (4, ["--pp", "2", "--micro-batches", "4", "--strategy", "dp", "--schedule", "gpipe"]),
    (4, ["--pp", "2", "--micro-batches", "4", "--strategy", "dp", "--schedule", "1f1b"]),
    (8, ["--tp", "2", "--pp", "2", "--strategy", "zero2", "--micro-batches", "2"]),
    (4, ["--pp", "2", "--micro-batches", "2", "--strategy", "zero3", "--recompute"]),
    (4, ["--pp", "2", "--micro-batches", "2", "--strategy", "zero2", "--accum", "2"]),
    (4, ["--tp", "2", "--pp", "2", "--micro-batches", "2", "--precision", "fp16"]),
    (4, ["--pp", "2", "--micro-batches", "2", "--strategy", "zero3", "--precision", "bf16"]),
    (4, ["--tp", "2", "--strategy", "zero3", "--clip-grad-norm", "0.1"]),
    (8, ["--tp", "2", "--pp", "2", "--strategy", "zero1", "--clip-grad-norm", "0.1"]),
]
SHORT = ["--steps", "20", "--batch", "24", "--eval-batches", "5", "--samples", "3"]
SAME_MODEL = ("accum", "precision", "clip_grad_norm")  # what single-rank training must share


@cache
def single_run(accum: int = 1, precision: str = "fp32", clip: float | None = None):
    config = TrainConfig(steps=20, batch=24, eval_batches=5, samples=3, accum=accum)
    config = TrainConfig(**(config.to_dict() | dict(precision=precision, clip_grad_norm=clip)))
    return run(ModelConfig(), config, data=Dataset.load())


@pytest.mark.mpi
@pytest.mark.parametrize("n, flags", MESH_RUNS, ids=[" ".join(f) for _, f in MESH_RUNS])
def test_a_mesh_trains_single_rank_trainings_model(n, flags, tmp_path):
    result = mpiexec(n, "-m", "fsdp_lesson", "train", *flags, *SHORT, "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "history.json").read_text())
    saved = np.load(tmp_path / "params.npz")
    params = {}
    for key in saved.files:
        layer, name = key.split(".")
        params.setdefault(layer, {})[name] = saved[key]
    shared = {key: record["train_config"][key] for key in SAME_MODEL}
    history, strategy = single_run(*shared.values())
    whole = strategy.full_params()
    assert {(layer, k) for layer in whole for k in whole[layer]} == {
        (layer, k) for layer in params for k in params[layer]
    }, "params.npz holds every whole layer"
    assert record["skipped_steps"] == history.skipped_steps  # fp16: skipped together
    if shared["precision"] != "fp32":  # 16 bits round at every hop: test_levers' tolerance
        relative = np.abs(np.array(record["losses"]) - history.losses) / history.losses
        assert relative.max() <= 2**-8, f"loss differs by {relative.max():.1e} (relative)"
        return
    assert_same_as_single(" ".join(flags), record | {"params": params}, history, whole)
    assert abs(record["val_loss"] - history.val_loss) <= 1e-5
    if shared["clip_grad_norm"] is not None:  # and the clipping mattered
        unclipped, _ = single_run(shared["accum"], shared["precision"])
        assert np.abs(history.losses - unclipped.losses).max() > 1e-3, "clipping changed nothing"
    kinds = set(record["traffic"][0])
    if "--tp" in flags:
        assert "allreduce (tp)" in kinds or "allreduce" in kinds
    if "--pp" in flags:
        assert any(kind.startswith("send") for kind in kinds), kinds


@pytest.mark.mpi
def test_c_compat_pp_prints_the_c_programs_losses():
    """train_pp.c (3 stages, one batch at a time) computes single-rank training's model:
    --c-compat --pp 3 on 3 ranks prints its losses, validation loss and samples."""
    assert_prints_the_c_programs(3, ["--pp", "3"], "pp")


@pytest.mark.mpi
def test_c_compat_3d_prints_the_c_programs_losses():
    """train_3d.c --tp 2 --dp 2 (12 ranks: tp inside FSDP inside 3 stages) takes train_tp.c's
    means and keeps train_fsdp.c's local biases: --c-compat --tp 2 --pp 3 --strategy zero3 on
    12 ranks prints its losses, validation loss and samples (its last rank's tokens)."""
    assert_prints_the_c_programs(12, ["--tp", "2", "--pp", "3", "--strategy", "zero3"], "3d")


DRIFT = """
import json
from fsdp_lesson.comm import Comm
from fsdp_lesson.config import ModelConfig, TrainConfig
from fsdp_lesson.train import ReplicaMismatch, check_replicas, run
world = Comm.world()
config = TrainConfig(tp=2, steps=2, batch=8, eval_batches=0, samples=0, timeout=20)
history, strategy = run(ModelConfig(), config, comm=world)
check_replicas(strategy)  # a healthy run passes
if world.rank == 1:  # the embedding drifts on one tensor-parallel rank
    strategy.local_state()["emb.params"].array[0] += 1
try:
    check_replicas(strategy)
    found = "no mismatch found"
except ReplicaMismatch as err:
    found = str(err)
everyone = world.allgather_objects(found)  # one print, from rank 0: lines never interleave
if world.rank == 0:
    print(json.dumps(everyone))
"""


@pytest.mark.mpi
def test_a_replicated_layer_that_drifts_between_tensor_parallel_ranks_is_caught():
    result = mpiexec(2, "-c", DRIFT, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout) == ["replicated state differs between ranks: emb.W (tp)"] * 2


OVERFLOW = """
import json
import numpy as np
from fsdp_lesson.comm import Comm
from fsdp_lesson.memory import MemoryLedger
from fsdp_lesson.precision import Precision
world = Comm.world()
precision = Precision("fp16", MemoryLedger())
grads = [np.array([np.inf if world.rank == 1 else 1.0], np.float16)]  # stage 1 overflows alone
skipped = precision.overflowed(world, grads)  # voted over the whole mesh: every rank skips
everyone = world.allgather_objects([skipped, precision.scaler.scale])
if world.rank == 0:
    print(json.dumps(everyone))
"""


@pytest.mark.mpi
def test_an_overflow_on_one_stage_skips_the_step_on_every_stage():
    """fp16 with --pp or --tp: every rank skips the step and halves the scale together."""
    result = mpiexec(2, "-c", OVERFLOW, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout) == [[True, 2.0**15]] * 2
