"""`xmesh-plan verify` rejects a plan exactly when the executor's lowering refuses it on some rank.

Valid plans of seeded random problems (every strategy, uneven shards, meshes that share devices and
hosts) are mutated at random: a device, a box bound, a chunk count, an operation's kind, the order,
a time set to NaN/inf/negative, an operation dropped or duplicated, a chain emptied, a plan-level
number. Each mutant goes through the plan schema as a file would (JSON-shaped dict -> Plan), then
through `verify_plan` and through `lower` for every device of the plan, in-process (no MPI). The two
sides must agree, and neither may fail in any other way than its own one-line error.
"""

from __future__ import annotations

import math
import random

import pytest
from pydantic import ValidationError

from xmesh_plan.executor.errors import PlanMismatchError
from xmesh_plan.executor.lower import lower
from xmesh_plan.executor.ranks import plan_devices
from xmesh_plan.planner.verify import PlanError, verify_plan
from xmesh_plan.schemas import Plan
from tests.support.cases import STRATEGIES, compiled, random_problem
from tests.support.mutations import SUMMARY, as_lists, mutate

MIN_MUTANTS = 1000  # schema-valid mutants per run (the issue asks for at least 1,000)


def _base_plans() -> list[Plan]:
    plans = []
    for seed in range(12):
        problem = random_problem(seed, max_devices=int(4 + seed % 5), exact=False)
        for strategy in STRATEGIES:
            plan = compiled(problem, strategy)
            if plan.operations:
                plans.append(plan)
    return plans


def _lowering_refuses(plan: Plan) -> str | None:
    """The first rank's refusal, or None when every rank lowers the plan."""
    for device in plan_devices(plan):
        try:
            lower(plan, device)
        except PlanMismatchError as err:
            return str(err)
    return None


def _verify_rejects(plan: Plan) -> str | None:
    try:
        verify_plan(plan)
    except PlanError as err:
        return str(err)
    return None


def test_verify_and_the_executor_agree_on_random_mutants():
    rng = random.Random(20261123)
    bases = [as_lists(p.model_dump()) for p in _base_plans()]
    valid = schema_refused = rejected = 0
    disagreements = []
    kinds: dict[str, int] = {}
    while valid < MIN_MUTANTS:
        raw = as_lists(rng.choice(bases))
        kind = mutate(rng, raw)
        if not raw["operations"]:
            continue
        try:
            mutant = Plan.model_validate(raw)
        except ValidationError:
            schema_refused += 1  # both sides read plans through the same schema, so both refuse it
            continue
        valid += 1
        kinds[kind] = kinds.get(kind, 0) + 1
        verdict, refusal = _verify_rejects(mutant), _lowering_refuses(mutant)
        rejected += verdict is not None
        if (verdict is None) != (refusal is None):
            disagreements.append(f"{kind}: verify {'rejects: ' + verdict if verdict else 'passes'}; "
                                 f"lowering {'refuses: ' + refusal if refusal else 'accepts'}")
    SUMMARY.append(f"plan mutants: {valid} schema-valid ({rejected} rejected by verify and refused by the executor's "
                   f"lowering, {valid - rejected - len(disagreements)} accepted by both, {len(disagreements)} disagreements), "
                   f"{schema_refused} refused by the schema; by mutation: "
                   + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    assert not disagreements, "\n".join(disagreements[:10])
    assert rejected > valid // 2  # most mutations break a plan; a checker that accepts everything fails here


@pytest.mark.parametrize("field,value", [("start_s", math.nan), ("end_s", math.inf), ("start_s", -1.0)])
def test_a_bad_operation_time_gets_the_same_message_on_both_sides(field, value):
    plan = compiled(random_problem(3, max_devices=6, exact=False), "broadcast")
    raw = as_lists(plan.model_dump())
    raw["operations"][0][field] = value
    mutant = Plan.model_validate(raw)
    verdict, refusal = _verify_rejects(mutant), _lowering_refuses(mutant)
    assert verdict is not None and refusal is not None
    assert refusal.startswith(verdict)
