"""Recompute a plan's numbers instead of trusting them: the lower bound from its problem, and the
operation times with the method `compile` used, so `xmesh-plan check` gates on figures it derived.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from schemas import Plan

from .bounds import lower_bound
from .compile import DIGITS
from .simulate import simulate_plan
from .unit_tasks import decompose

REL_TOLERANCE = 1e-9


@dataclass(frozen=True, slots=True)
class Audit:
    """The recomputed lower bound and predicted time; `mismatch` says which stored figure disagrees."""

    lower_bound_seconds: float
    predicted_seconds: float
    retimed: bool  # False when the plan was timed by the schedule model, which is not re-run here
    mismatch: str | None


def _differ(stored: float, derived: float) -> bool:
    return not math.isclose(stored, derived, rel_tol=REL_TOLERANCE, abs_tol=1e-12)


def audit_plan(plan: Plan) -> Audit:
    """Recompute the bound and (for simulator-timed plans) every operation's times; call on a verified plan."""
    bound = lower_bound(decompose(plan.problem), plan.problem.cluster, plan.problem.itemsize).seconds
    mismatch = None
    if _differ(plan.lower_bound_seconds, round(bound, DIGITS)):
        mismatch = f"stored lower bound {plan.lower_bound_seconds} s disagrees with {bound:.12g} s recomputed from the problem"
    timed_by = plan.solver.details.get("timed_by", "")
    if not timed_by.startswith("simulator"):
        return Audit(bound, plan.predicted_seconds, False, mismatch)
    result = simulate_plan(plan)
    for op in plan.operations:
        start, end = round(result.op_start_s[op.id], DIGITS), round(result.op_end_s[op.id], DIGITS)
        if mismatch is None and (_differ(op.start_s, start) or _differ(op.end_s, end)):
            mismatch = (f"operation {op.id} is stored @{op.start_s}-{op.end_s}s but the simulator times it "
                        f"@{start:.12g}-{end:.12g}s")
    predicted = round(result.makespan_s, DIGITS)
    if mismatch is None and _differ(plan.predicted_seconds, predicted):
        mismatch = f"stored predicted time {plan.predicted_seconds} s disagrees with {predicted:.12g} s from the simulator"
    return Audit(bound, predicted, True, mismatch)
