"""Replay a compiled resharding plan every iteration: MPI on the CPU, NCCL through CuPy on GPUs,
torch.distributed over any process group (gloo, NCCL).

Imports `schemas` only, never the planner. Entry points: `ReshardingExecutor` (one tensor) and
`TransferExecutor` (a multi-tensor plan, name -> shard mapping in and out), the two faces of one
`Executor` (one program per device, one engine), and the demo
`mpiexec -disable-auto-cleanup -n N python -m xmesh_plan.executor.run PLAN --check`.
"""

if __name__ != "xmesh_plan.executor":  # this folder reached under its bare name, from the repository root
    raise ImportError(f"import xmesh_plan.executor, not {__name__}: the executor/ folder is installed as xmesh_plan.executor "
                      "(pip install -e .); under another name it would load a second copy of the package")

from .errors import BackendUnavailableError, ExecutorError, PeerTimeoutError, PlanMismatchError
from .engines import BACKENDS, ENGINES, TransportOptions
from .executor import Executor, ReshardingExecutor
from .ranks import device_of_rank, plan_devices
from .transfer_executor import TransferExecutor

__all__ = ["BACKENDS", "ENGINES", "BackendUnavailableError", "Executor", "ExecutorError", "PeerTimeoutError", "PlanMismatchError",
           "ReshardingExecutor", "TransferExecutor", "TransportOptions", "device_of_rank", "plan_devices"]
