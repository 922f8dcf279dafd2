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

MIN_MUTANTS = 1000  # schema-valid mutants per run (the issue asks for at least 1,000)
SUMMARY: list[str] = []  # printed at the end of the run by conftest's terminal summary


def _base_plans() -> list[Plan]:
    plans = []
    for seed in range(12):
        problem = random_problem(seed, max_devices=int(4 + seed % 5), exact=False)
        for strategy in STRATEGIES:
            plan = compiled(problem, strategy)
            if plan.operations:
                plans.append(plan)
    return plans


def _box_field(rng: random.Random, op: dict) -> tuple[list, int]:
    """A (mutable) box of the operation, the region or one of its parts, and a dim of it."""
    boxes = [op["region"]] + list(op["parts"])
    box = rng.choice(boxes)
    return box, rng.randrange(len(box)) if box else 0


def _device(rng: random.Random, plan: dict) -> int:
    devices = plan_devices(Plan.model_validate(plan))
    return rng.choice([*devices, -1, max(devices) + 1, max(devices) + 7, rng.choice(devices)])


def _mutate(rng: random.Random, plan: dict) -> str:
    """Apply one random mutation in place; return its name (for the summary)."""
    ops = plan["operations"]
    i = rng.randrange(len(ops))
    op = ops[i]
    kind = rng.choice(["device", "bound", "chunks", "kind", "order", "time", "drop", "duplicate", "chain", "plan-number", "part",
                       "host-order", "shape"])
    if kind == "device":
        if op["src"] is not None and rng.random() < 0.5:
            op["src"] = _device(rng, plan)
        elif op["dsts"]:
            op["dsts"][rng.randrange(len(op["dsts"]))] = _device(rng, plan)
    elif kind in ("bound", "part"):
        box, d = _box_field(rng, op) if kind == "bound" else (rng.choice(op["parts"] or [op["region"]]), 0)
        d = rng.randrange(len(box))
        lo, hi = box[d]
        box[d] = rng.choice([(lo - 1, hi), (lo + 1, hi), (lo, hi + 1), (lo, hi - 1), (hi, hi), (hi, lo), (0, hi), (lo, 10**6)])
    elif kind == "chunks":
        op["chunks"] = rng.choice([2, 3, op["chunks"] + 1, 1024, 1025, 10**9, 2**40, max(1, op["chunks"] - 1)])
    elif kind == "kind":
        op["kind"] = rng.choice(["copy", "send", "broadcast", "allgather"])
    elif kind == "order":
        j = rng.randrange(len(ops))
        ops[i], ops[j] = ops[j], ops[i]
    elif kind == "time":
        field = rng.choice(["start_s", "end_s"])
        op[field] = rng.choice([math.nan, math.inf, -math.inf, -1.0, op[field] * 0.5, op[field] + 1e-3, 0.0])
    elif kind == "drop":
        ops.pop(i)
    elif kind == "duplicate":
        twin = {**op, "dsts": list(op["dsts"]), "region": [list(b) for b in op["region"]], "parts": [[list(b) for b in p] for p in op["parts"]]}
        if rng.random() < 0.5:
            twin["id"] = max(o["id"] for o in ops) + 1
        ops.insert(i + 1, twin)
    elif kind == "host-order":
        entry = rng.choice(plan["host_order"] or [{"host": 0, "side": "send", "tasks": []}])
        what = rng.choice(["side", "host", "task", "twice"])
        if what == "side":
            entry["side"] = rng.choice(["send:", "send:00", "recv:1", "recv:9", "both", "recv", "send:0"])
        elif what == "host":
            entry["host"] = rng.choice([-1, 99, entry["host"] + 1])
        elif what == "task":
            entry["tasks"].append(rng.choice([-5, 10**6]))
        else:
            plan["host_order"].append({**entry, "tasks": list(entry["tasks"])})
    elif kind == "shape":
        shape = plan["problem"]["shape"]
        d = rng.randrange(len(shape))
        shape[d] = max(0, shape[d] + rng.choice([-1, 1, 7]))
    elif kind == "chain":
        op["dsts"] = [] if rng.random() < 0.5 else op["dsts"][:1]
    else:
        field = rng.choice(["predicted_seconds", "lower_bound_seconds"])
        plan[field] = rng.choice([math.nan, math.inf, -1.0, plan["predicted_seconds"] * 2, 0.0])
    return kind


def _as_lists(value):
    """model_dump gives tuples; mutations need lists (the JSON a user edits has lists too)."""
    if isinstance(value, (list, tuple)):
        return [_as_lists(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_lists(v) for k, v in value.items()}
    return value


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
    bases = [_as_lists(p.model_dump()) for p in _base_plans()]
    valid = schema_refused = rejected = 0
    disagreements = []
    kinds: dict[str, int] = {}
    while valid < MIN_MUTANTS:
        raw = _as_lists(rng.choice(bases))
        kind = _mutate(rng, raw)
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
    raw = _as_lists(plan.model_dump())
    raw["operations"][0][field] = value
    mutant = Plan.model_validate(raw)
    verdict, refusal = _verify_rejects(mutant), _lowering_refuses(mutant)
    assert verdict is not None and refusal is not None
    assert refusal.startswith(verdict)
