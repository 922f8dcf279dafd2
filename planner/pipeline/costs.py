"""Predicted time and NIC use of every transfer in a pipeline, from the resharding planner.

Each boundary tensor, in each direction, is one resharding problem; its compiled plan gives the
predicted seconds and which host NIC sides it keeps busy. The simulator treats those NIC sides
as resources, so two transfers through the same NIC side do not overlap.
"""

from __future__ import annotations

from typing import Callable

from xmesh_plan.schemas.pipeline import PipelineProblem, TransferCost
from xmesh_plan.schemas.plan import Plan
from xmesh_plan.schemas.problem import ReshardingProblem

PlanFn = Callable[[ReshardingProblem], Plan]


def nics_of_plan(plan: Plan) -> tuple[str, ...]:
    """NIC sides the plan keeps busy, from its per-host order (forwarding hosts of a broadcast chain
    included; several NICs of a host count as one side): `h0:send`, `h1:recv`, sorted."""
    return tuple(sorted({f"h{order.host}:{order.side.split(':')[0]}" for order in plan.host_order}))


def default_plan_fn(strategy: str = "broadcast", solver: str = "auto", seed: int = 0, max_tasks: int | None = None) -> PlanFn:
    """compile_plan with fixed arguments (imported here so the schedule code stays planner-agnostic); `max_tasks`
    None keeps compile_plan's default limit."""
    from xmesh_plan.planner.compile import compile_plan

    limit = {} if max_tasks is None else {"max_tasks": max_tasks}
    return lambda problem: compile_plan(problem, strategy=strategy, solver=solver, seed=seed, **limit)


def transfer_costs(problem: PipelineProblem, plan_fn: PlanFn | None = None) -> tuple[TransferCost, ...]:
    """One cost per (tensor, direction), in `problem.transfers()` order."""
    plan_fn = plan_fn or default_plan_fn()
    out = []
    for name, direction in problem.transfers():
        plan = plan_fn(problem.resharding_problem(name, direction))
        out.append(TransferCost(tensor=name, direction=direction, seconds=plan.predicted_seconds, nics=nics_of_plan(plan)))
    return tuple(out)


def signal_costs(costs: tuple[TransferCost, ...]) -> tuple[TransferCost, ...]:
    """The 'signal send/recv' bound: every transfer keeps its dependency but costs nothing."""
    return tuple(c.model_copy(update={"seconds": 0.0, "nics": ()}) for c in costs)
