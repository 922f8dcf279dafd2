"""xmesh-plan's planner: pure functions from a resharding problem to a verified plan. No MPI, NCCL or CuPy here."""

__version__ = "0.1.0"
