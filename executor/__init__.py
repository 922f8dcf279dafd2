"""Replay a compiled resharding plan every iteration: MPI on the CPU, NCCL through CuPy on GPUs,
torch.distributed over any process group (gloo, NCCL).

Imports `schemas` only, never the planner. Entry points: `ReshardingExecutor` and the demo
`mpiexec -disable-auto-cleanup -n N python -m xmesh_plan.executor.run PLAN --check`.
"""

from .errors import BackendUnavailableError, ExecutorError, PeerTimeoutError, PlanMismatchError
from .engines import BACKENDS, ENGINES
from .executor import ReshardingExecutor
from .ranks import device_of_rank, plan_devices

__all__ = ["BACKENDS", "ENGINES", "BackendUnavailableError", "ExecutorError", "PeerTimeoutError", "PlanMismatchError",
           "ReshardingExecutor", "device_of_rank", "plan_devices"]
