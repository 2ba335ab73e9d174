"""fsdp_lesson: data parallelism and ZeRO stages 1-3 built from scratch with numpy and mpi4py."""
