"""xmesh-plan's planner: pure functions from a resharding problem to a verified plan. No MPI, NCCL or CuPy here."""

if __name__ != "xmesh_plan.planner":  # this folder reached under its bare name, from the repository root
    raise ImportError(f"import xmesh_plan.planner, not {__name__}: the planner/ folder is installed as xmesh_plan.planner "
                      "(pip install -e .); under another name it would load a second copy of the package")

__version__ = "0.1.0"
