"""xmesh-plan's public front ends: a PyTorch DTensor or JAX layout pair -> a `ReshardingProblem` to plan.

`problem_from_dtensor` needs torch and `problem_from_shardings` needs jax; each is imported only when
first used, so `import xmesh_plan` works with either framework alone.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .sides import FrontendError

_LAZY = {"problem_from_dtensor": ".dtensor", "problem_from_shardings": ".jax_sharding"}

__all__ = ["FrontendError", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'xmesh_plan' has no attribute {name!r}")
    return getattr(import_module(_LAZY[name], __name__), name)
