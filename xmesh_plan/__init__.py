"""xmesh-plan: `xmesh_plan.planner`, `xmesh_plan.executor`, `xmesh_plan.schemas`, and the public front ends.

The front ends turn a PyTorch DTensor or JAX layout pair into a `ReshardingProblem` to plan, and
`WeightSync` moves a trainer's state dict into an inference engine's tensors
(`xmesh_plan.transfer_group.transfer_group` joins separate launches). `problem_from_dtensor` and
`WeightSync` need torch and `problem_from_shardings` needs jax; each is imported only when first used,
so `import xmesh_plan` works with either framework alone, and importing the executor
(`xmesh_plan.executor`) does not load the planner through this package.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

_LAZY = {"FrontendError": ".sides", "problem_from_dtensor": ".dtensor", "problem_from_shardings": ".jax_sharding",
         "WeightSync": ".weight_sync"}

__all__ = [*_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'xmesh_plan' has no attribute {name!r}")
    return getattr(import_module(_LAZY[name], __name__), name)
