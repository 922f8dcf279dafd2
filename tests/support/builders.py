"""Shared builders: a problem from shorthand, the paper's reference cases, and a fast compile.

Tests that only need *a* correct plan compile with the `greedy` solver: it exists in every version
of the solver registry and answers in milliseconds, so the suite stays fast whatever the default
solver is. Nothing here hard-codes a predicted time.
"""

from __future__ import annotations

from typing import Any

from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.planner.reference_cases import reference_problems


FAST_SOLVER = "greedy"
STRATEGY_NAMES = ("broadcast", "send_recv", "local_allgather", "global_allgather", "auto")


def make_problem(shape, src_mesh, src_spec, dst_mesh, dst_spec, dtype: str = "float32", **extra: Any):
    """A problem from CLI-like shorthand; `extra` goes into the raw dict (cluster, name, ...)."""
    raw = {"shape": list(shape), "dtype": dtype, "src": {"mesh": src_mesh, "spec": src_spec},
           "dst": {"mesh": dst_mesh, "spec": dst_spec}, **extra}
    return build_problem(raw)


def reference_problem(name: str):
    raw = dict(reference_problems())[name]
    return build_problem(raw)


def compile_fast(problem, strategy: str = "broadcast", **kwargs: Any):
    return compile_plan(problem, strategy=strategy, solver=kwargs.pop("solver", FAST_SOLVER), **kwargs)
