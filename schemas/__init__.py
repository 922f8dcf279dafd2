"""The contract between planner and executor: problem inputs and the compiled plan (pydantic v2)."""

if __name__ != "xmesh_plan.schemas":  # this folder reached under its bare name, from the repository root
    raise ImportError(f"import xmesh_plan.schemas, not {__name__}: the schemas/ folder is installed as xmesh_plan.schemas "
                      "(pip install -e .); under another name it would load a second copy of the package")

from .dtypes import DTYPE_SIZES
from .geometry import Layout, Region, intersect, local_slices, region_shape, region_size, shard_interval, split_region
from .plan import SCHEMA_VERSION, ExecutorPrediction, HostOrder, Operation, Plan, SolverInfo, Staging, UnitTask, PlanFileError, format_region, load_plan, read_plan_file, write_atomic
from .problem import Cluster, Cpu, DeviceMesh, Nic, Placement, ReshardingProblem
from .spec import DimSharding, ShardingSpec, SpecError

__all__ = [
    "DTYPE_SIZES", "Layout", "Region", "intersect", "local_slices", "region_shape", "region_size", "shard_interval",
    "split_region", "SCHEMA_VERSION", "ExecutorPrediction", "HostOrder", "Operation", "Plan", "SolverInfo", "Staging", "UnitTask", "format_region",
    "PlanFileError", "load_plan", "read_plan_file", "write_atomic", "Cluster", "Cpu", "DeviceMesh", "Nic", "Placement", "ReshardingProblem",
    "DimSharding", "ShardingSpec", "SpecError",
]
