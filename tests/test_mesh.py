"""The process mesh (fsdp_lesson/mesh.py) under real `mpiexec -n 4`: every rank's place in the
(pp, dp, tp) grid is the C 3-D program's, and each communicator joins the ranks it should."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from mpi_helpers import mpiexec  # noqa: E402

from fsdp_lesson.comm import Comm  # noqa: E402
from fsdp_lesson.config import ConfigError  # noqa: E402
from fsdp_lesson.mesh import Mesh  # noqa: E402

# each rank prints, for every (tp, pp), its rank along each dimension and the world ranks there
PLACES = """
import json
import numpy as np
from fsdp_lesson.comm import Comm
from fsdp_lesson.mesh import Mesh
world = Comm.world()
places = {}
for tp, pp in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)]:
    mesh = Mesh.of(world, tp, pp)
    place = {}
    for dim in ("tp", "dp", "pp"):
        comm = getattr(mesh, dim)
        members = np.zeros(comm.size)
        comm.allgather(np.array([float(world.rank)]), members)
        place[dim] = [comm.rank, [int(m) for m in members]]
    places[f"{tp},{pp}"] = place
print(json.dumps([world.rank, places]))
"""


@pytest.mark.mpi
def test_every_rank_sits_where_the_c_program_puts_it():
    result = mpiexec(4, "-c", PLACES, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(result.stdout.splitlines()) == 4
    for line in result.stdout.splitlines():
        r, places = json.loads(line)
        for key, place in places.items():
            tp, pp = map(int, key.split(","))
            dp = 4 // (tp * pp)
            stage = r // (tp * dp) * tp * dp  # the first world rank of r's stage
            expected = {  # tp fastest, then dp, then pp; each group in its own rank order
                "tp": [r % tp, [r - r % tp + i for i in range(tp)]],
                "dp": [
                    (r // tp) % dp,
                    [stage + i * tp + r % tp for i in range(dp)],
                ],
                "pp": [r // (tp * dp), [i * tp * dp + r % (tp * dp) for i in range(pp)]],
            }
            assert place == expected, f"rank {r}, tp {tp}, pp {pp}"


def test_one_rank_is_a_mesh_of_ones():
    mesh = Mesh.of(Comm())
    assert mesh.shape == (1, 1, 1)
    assert mesh.tp is mesh.dp is mesh.pp is mesh.world


def test_a_mesh_that_does_not_divide_the_ranks_is_refused():
    with pytest.raises(ConfigError, match="--tp 2 --pp 1 need a multiple of 2 ranks"):
        Mesh.of(Comm(), tp=2)
