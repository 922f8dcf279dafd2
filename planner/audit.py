"""Recompute a plan's numbers instead of trusting them: the lower bound from its problem, the
operation times with the method `compile` used, and a multi-tensor plan's time in the executor's
default order (`executor_order`), so `xmesh-plan check` gates on figures it derived.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from xmesh_plan.schemas import Plan

from .bounds import joint_lower_bound
from .compile import DIGITS, MAX_SIMULATION_WORK, settle_listing, simulated_messages, too_many_messages
from .executor_order import executor_order_seconds, posted_budget
from .simulate import TooCostly, nic_assignment, simulate, staging_runs
from .unit_tasks import decompose

REL_TOLERANCE = 1e-9


@dataclass(frozen=True, slots=True)
class Audit:
    """The recomputed lower bound and predicted time, and a multi-tensor plan's time in the executor's default
    order (posted; None for other plans and plans too large to time); `mismatch` says which stored figure disagrees.
    `unsimulated`: why the stored times were not re-simulated (None when they were); `simulated_seconds`: the host-order
    simulation of a plan that states the schedule's times, simulated because the caller asked (`simulate_anyway`)."""

    lower_bound_seconds: float
    predicted_seconds: float
    retimed: bool  # False when the plan was timed by the schedule model (too large to simulate, or its listing never settles)
    mismatch: str | None
    executor_seconds: float | None = None
    unsimulated: str | None = None
    simulated_seconds: float | None = None


def _differ(stored: float, derived: float) -> bool:
    return not math.isclose(stored, derived, rel_tol=REL_TOLERANCE, abs_tol=1e-12)


def audit_plan(plan: Plan, simulate_anyway: bool = False) -> Audit:
    """Recompute the bound and every operation's times as `compile` did; call it on a verified plan.

    Whether the plan is simulated is decided as compile decides (`compile.too_many_messages` on the same count, then
    the same work budget), whatever `solver.details.timed_by` claims (a plan simulated under other limits included);
    `unsimulated` says why not. One that claims the schedule's times is believed only when its listing does not settle
    (see `compile.settle_listing`), as in compile. `simulate_anyway`: simulate past both limits (memory grows with the
    messages: about 2.5 GiB a million); a plan that states the schedule's times then gets its simulated time beside them
    (`simulated_seconds`) and its time in the executor's order, not compared operation by operation."""
    problem = plan.problem
    tensors = [(decompose(p, max_tasks=None), p.itemsize) for p in problem.tensor_problems()]  # the plan holds these tasks already
    bound = joint_lower_bound(tensors, problem.cluster).seconds
    mismatch = None
    if _differ(plan.lower_bound_seconds, round(bound, DIGITS)):
        mismatch = f"stored lower bound {plan.lower_bound_seconds} s disagrees with {bound:.12g} s recomputed from the problem"
    messages = simulated_messages(plan.operations)
    if too_many_messages(messages) and not simulate_anyway:
        return Audit(bound, plan.predicted_seconds, False, mismatch,
                     unsimulated=f"{messages:,} messages, {too_many_messages(messages)} (compile.MAX_SIMULATED_MESSAGES)")
    nics = nic_assignment(plan.host_order)
    by_schedule = plan.solver.details.get("timed_by", "").startswith("schedule")
    try:  # past compile's work budget compile kept the schedule's times, and so does this
        result = simulate(plan.operations, problem, "host-order", nics, max_work=None if simulate_anyway else MAX_SIMULATION_WORK)
        if simulate_anyway and by_schedule:
            executed = executor_order_seconds(plan.operations, problem, plan.host_order, None, plan.staging is not None, staging_runs(plan))
            return Audit(bound, plan.predicted_seconds, False, mismatch, None if executed is None else round(executed, DIGITS),
                         simulated_seconds=round(result.makespan_s, DIGITS))
        late = next((op for op in plan.operations if _differ(op.start_s, round(result.op_start_s[op.id], DIGITS))
                     or _differ(op.end_s, round(result.op_end_s[op.id], DIGITS))), None)
        if late is not None and by_schedule and settle_listing(plan.operations, problem, nics, MAX_SIMULATION_WORK) is None:
            return Audit(bound, plan.predicted_seconds, False, mismatch,
                         unsimulated="its listing does not settle in host order (compile.settle_listing), as when compiled")
    except TooCostly:
        return Audit(bound, plan.predicted_seconds, False, mismatch, unsimulated=f"its simulation takes more than "
                     f"{MAX_SIMULATION_WORK:,} units of work (compile.MAX_SIMULATION_WORK)")
    if mismatch is None and late is not None:
        start, end = round(result.op_start_s[late.id], DIGITS), round(result.op_end_s[late.id], DIGITS)
        mismatch = (f"operation {late.id} is stored @{late.start_s}-{late.end_s}s but the simulator times it "
                    f"@{start:.12g}-{end:.12g}s")
    predicted = round(result.makespan_s, DIGITS)
    if mismatch is None and _differ(plan.predicted_seconds, predicted):
        mismatch = f"stored predicted time {plan.predicted_seconds} s disagrees with {predicted:.12g} s from the simulator"
    stated = plan.executor_prediction  # a stated time is re-derived whatever it costs; otherwise where compile would time it (or asked)
    executed = executor_order_seconds(plan.operations, problem, plan.host_order, None if stated or simulate_anyway else posted_budget(result.work),
                                      plan.staging is not None, staging_runs(plan))
    executed = None if executed is None else round(executed, DIGITS)
    if mismatch is None and stated is not None and (executed is None or _differ(stated.predicted_seconds, executed)):
        mismatch = (f"stored executor_prediction ({stated.order}) {stated.predicted_seconds} s disagrees with "
                    f"{'no time' if executed is None else f'{executed:.12g} s'} from the simulator")
    if mismatch is not None and "overhead_us" not in problem.cluster.model_fields_set:
        mismatch += ("; the plan has no cluster.overhead_us, so it was compiled before the network model charged latency "
                     "as a delay and a per-message overhead as link time (fb54710)")
    return Audit(bound, predicted, True, mismatch, executed)
