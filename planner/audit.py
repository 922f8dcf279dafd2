"""Recompute a plan's numbers instead of trusting them: the lower bound from its problem, the
operation times with the method `compile` used, and a multi-tensor plan's time in the executor's
default order (`executor_order`), so `xmesh-plan check` gates on figures it derived.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.staging import stage_budget

from .bounds import joint_lower_bound
from .compile import DIGITS, MAX_SIMULATION_WORK, executor_budget, settle_listing, simulated_messages, too_many_messages
from .executor_order import executor_order_seconds, order_name
from .simulate import TooCostly, nic_assignment, simulate
from .unit_tasks import decompose

REL_TOLERANCE = 1e-9


@dataclass(frozen=True, slots=True)
class Audit:
    """The recomputed lower bound and predicted time, and a multi-tensor plan's time in the executor's default
    order (posted; None for other plans and plans too large to time); `mismatch` says which stored figure disagrees;
    `unsimulated` why the stored host-order times were not re-simulated (None when they were)."""

    lower_bound_seconds: float
    predicted_seconds: float
    retimed: bool  # False when the plan was timed by the schedule model (too large to simulate, or its listing never settles)
    mismatch: str | None
    executor_seconds: float | None = None
    unsimulated: str | None = None


def _executor_seconds(plan: Plan, max_work: int | None) -> float | None:
    """The plan's time in the executor's default order (`executor_order_seconds`), rounded as compile states it."""
    executed = executor_order_seconds(plan.operations, plan.problem, plan.host_order, max_work, stage_budget(plan))
    return None if executed is None else round(executed, DIGITS)


def _differ(stored: float, derived: float) -> bool:
    return not math.isclose(stored, derived, rel_tol=REL_TOLERANCE, abs_tol=1e-12)


def _stated_mismatch(plan: Plan, executed: float | None) -> str | None:
    """How the time the plan states in the executor's order (`executor_prediction`) disagrees with `executed` (None:
    none could be had), or None where it agrees or the plan states none."""
    stated = plan.executor_prediction
    if stated is None or (executed is not None and not _differ(stated.predicted_seconds, executed)):
        return None
    return (f"stored executor_prediction ({order_name(plan, stated.order)}) {stated.predicted_seconds} s disagrees with "
            f"{'no time' if executed is None else f'{executed:.12g} s'} from the simulator")


def audit_plan(plan: Plan, any_size: bool = False) -> Audit:
    """Recompute the bound and every operation's times as `compile` did; call it on a verified plan.

    Whether it is re-simulated is decided as compile decides (`compile.too_many_messages` on the same message count,
    then the same work budget), whatever `solver.details.timed_by` claims (a plan simulated when compiled under other
    limits included); `unsimulated` says why not. One that claims the schedule's times is believed only when its
    listing does not settle (see `compile.settle_listing`), as in compile. A multi-tensor plan's time in the executor's
    default order is re-derived where compile times it (`compile.executor_budget`: after its host-order simulation, or
    once alone for a listing too long to simulate in host order, up to `executor_order.MAX_EXECUTOR_MESSAGES`); past
    compile's limits a time the plan states is shown as stored, not checked. `any_size` (`check --simulate`): re-derived
    whatever it costs there too (more than `executor_order.MAX_EXECUTOR_MESSAGES` messages, a simulation past its work
    budget) and held to the stated time; its host-order times are checked as without it."""
    problem = plan.problem
    tensors = [(decompose(p, max_tasks=None), p.itemsize) for p in problem.tensor_problems()]  # the plan holds these tasks already
    bound = joint_lower_bound(tensors, problem.cluster).seconds
    mismatch = None
    if _differ(plan.lower_bound_seconds, round(bound, DIGITS)):
        mismatch = f"stored lower bound {plan.lower_bound_seconds} s disagrees with {bound:.12g} s recomputed from the problem"

    stated = plan.executor_prediction  # re-derived where compile would time it (whatever it costs with `any_size`)
    messages = simulated_messages(plan.operations)

    def kept(why: str) -> Audit:
        """The stored times believed, as compile kept them; timed in the executor's order where compile times it
        (`compile.executor_budget`: a listing too long to simulate in host order, within its limits) or with `any_size`
        (whatever it costs), and held to a time the plan states."""
        timed = any_size or executor_budget(problem, None, messages) is not None
        executed = _executor_seconds(plan, None if stated or any_size else executor_budget(problem, None, messages)) if timed else None
        wrong = mismatch or (None if executed is None else _stated_mismatch(plan, executed))
        return Audit(bound, plan.predicted_seconds, False, wrong, executed, why)

    if too_many_messages(messages):
        return kept(f"{messages:,} messages, {too_many_messages(messages)} (compile.MAX_SIMULATED_MESSAGES)")
    nics = nic_assignment(plan.host_order)
    try:  # past compile's work budget compile kept the schedule's times, and so does this
        result = simulate(plan.operations, problem, "host-order", nics, max_work=MAX_SIMULATION_WORK)
        late = next((op for op in plan.operations if _differ(op.start_s, round(result.op_start_s[op.id], DIGITS))
                     or _differ(op.end_s, round(result.op_end_s[op.id], DIGITS))), None)
        if late is not None and plan.solver.details.get("timed_by", "").startswith("schedule") \
                and settle_listing(plan.operations, problem, nics, MAX_SIMULATION_WORK) is None:
            return kept("its listing does not settle in host order (compile.settle_listing), as when compiled")
    except TooCostly:
        return kept(f"its simulation takes more than {MAX_SIMULATION_WORK:,} units of work (compile.MAX_SIMULATION_WORK)")
    if mismatch is None and late is not None:
        start, end = round(result.op_start_s[late.id], DIGITS), round(result.op_end_s[late.id], DIGITS)
        mismatch = (f"operation {late.id} is stored @{late.start_s}-{late.end_s}s but the simulator times it "
                    f"@{start:.12g}-{end:.12g}s")
    predicted = round(result.makespan_s, DIGITS)
    if mismatch is None and _differ(plan.predicted_seconds, predicted):
        mismatch = f"stored predicted time {plan.predicted_seconds} s disagrees with {predicted:.12g} s from the simulator"
    executed = _executor_seconds(plan, None if stated or any_size else executor_budget(problem, result.work, messages))
    mismatch = mismatch or _stated_mismatch(plan, executed)
    if mismatch is not None and "overhead_us" not in problem.cluster.model_fields_set:
        mismatch += ("; the plan has no cluster.overhead_us, so it was compiled before the network model charged latency "
                     "as a delay and a per-message overhead as link time (fb54710)")
    return Audit(bound, predicted, True, mismatch, executed)
