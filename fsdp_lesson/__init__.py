"""fsdp_lesson: data parallelism and ZeRO stages 1-3 built from scratch with numpy and mpi4py."""

import os

# The lesson's matrices are tiny (a few hundred wide at most): BLAS threads only add overhead
# and fight the MPI ranks for the cores. This must happen before numpy loads; a value the
# user set wins.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
