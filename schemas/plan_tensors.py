"""A multi-tensor plan seen one tensor at a time.

A plan of a `TransferProblem` schedules every tensor's unit tasks together; each task and operation
names its tensor (`tensor`, an index into `problem.tensors`). `tensor_plans` splits such a plan into
one single-tensor plan per tensor: the tensor's own tasks and operations, with their ids, times and
order kept, the host order cut down to its tasks. Tensors never share bytes, so a joint plan is
correct exactly when each of these is; the verifier replays them and the staging peaks are counted on them
(the executor lowers the whole plan at once, `executor.lower`). A
bundle riding in another tensor's bundle's message (`schemas.carriers`) is a whole bundle of its own
tensor there (its `carrier` dropped): sharing the message changes what crosses, not what arrives.
A single-tensor plan splits into itself.
"""

from __future__ import annotations

from .plan import HostOrder, Plan
from .transfer import TransferProblem


def is_multi(plan: Plan) -> bool:
    """Whether the plan moves a `TransferProblem` (many named tensors)."""
    return isinstance(plan.problem, TransferProblem)


def mpi_transfer_order() -> str:
    """The order the MPI executor runs a multi-tensor plan in by default: posted, every message at once, or, where the
    plan states a staging limit, as soon as its staging fits in a window of the limit's bytes per device
    (`executor.window`). The executor's `default_order`, the planner's stated time and the plan check all read it from here."""
    return "posted"


def tensor_names(plan: Plan) -> tuple[str, ...]:
    """The tensors' names in index order; a single-tensor plan's one tensor is its problem's name."""
    return plan.problem.names if is_multi(plan) else (plan.problem.name,)


def tensor_plans(plan: Plan) -> list[Plan]:
    """One single-tensor plan per tensor, in index order (see the module docstring); [plan] for a single tensor.

    Callers check first (`plan_check.check_plan`) that every tensor index is in range."""
    if not is_multi(plan):
        return [plan]
    count = len(plan.problem.tensors)
    tasks = [[] for _ in range(count)]
    operations = [[] for _ in range(count)]
    for task in plan.tasks:
        tasks[task.tensor].append(task.model_copy(update={"tensor": None}))
    for op in plan.operations:
        operations[op.tensor].append(op.model_copy(update={"tensor": None, "carrier": None}))
    return [_one(plan, i, tasks[i], operations[i]) for i in range(count)]


def _one(plan: Plan, index: int, tasks: list, operations: list) -> Plan:
    mine = {t.id for t in tasks}
    order = tuple(HostOrder(host=o.host, side=o.side, tasks=kept) for o in plan.host_order
                  if (kept := tuple(t for t in o.tasks if t in mine)))
    return Plan.model_construct(
        schema_version=plan.schema_version, generator=plan.generator, problem=plan.problem.tensor_problem(index),
        strategy=plan.strategy, solver=plan.solver, merged_slices=plan.merged_slices, tasks=tuple(tasks),
        operations=tuple(operations), host_order=order, predicted_seconds=plan.predicted_seconds,
        lower_bound_seconds=min(plan.lower_bound_seconds, plan.predicted_seconds))
