"""The whole-array replay (`planner.verify_arrays`) passes exactly the plans the operation-by-operation replay
passes, with the same cell and device counts, so `verify_plan`'s verdicts and messages stay the replay's."""

from __future__ import annotations

import random
from pathlib import Path

from pydantic import ValidationError

from xmesh_plan.planner.verify import PlanError, _replay, verify_plan
from xmesh_plan.planner.verify_arrays import replay_summary
from xmesh_plan.schemas import Plan, read_plan_file
from xmesh_plan.schemas.plan_check import check_plan
from xmesh_plan.schemas.plan_tensors import tensor_plans
from tests.support.cases import STRATEGIES, compiled, random_problem
from tests.support.mutations import as_lists, mutate

ROOT = Path(__file__).resolve().parents[1]


def _slow(single: Plan) -> tuple[int, set[int]] | None:
    try:
        replay = _replay(single)
    except PlanError:
        return None
    return sum(c.ready.size for c in replay.dst.values()), set(replay.dst)


def test_reference_plans_pass_with_the_same_counts():
    for path in sorted((ROOT / "plans").glob("*.plan.json")):
        for single in tensor_plans(read_plan_file(path)):
            assert replay_summary(single) == _slow(single) is not None, path.name


def test_mutants_that_pass_the_structural_checks_get_the_same_verdict():
    rng = random.Random(29)
    bases = [as_lists(compiled(random_problem(seed, max_devices=4 + seed % 5, exact=False), s).model_dump())
             for seed in range(8) for s in STRATEGIES]
    bases = [b for b in bases if b["operations"]]
    checked = failing = 0
    while checked < 300:
        raw = as_lists(rng.choice(bases))
        mutate(rng, raw)
        try:
            plan = Plan.model_validate(raw)
            check_plan(plan)
        except (ValidationError, PlanError):
            continue
        checked += 1
        slow = _slow(plan)
        failing += slow is None
        assert replay_summary(plan) == slow, plan.operations[:3]
    assert failing > 20  # the mutants reach the replay's faults (twice received, missing, late), not only passing plans


def test_late_allgather_parts_are_left_to_the_replay_for_its_message():
    """An all-gather moved ahead of the operations that deliver its members' parts: the array replay declines, and
    verify says what the operation-by-operation replay says."""
    reached = 0
    for seed in range(12):
        plan = compiled(random_problem(seed, max_devices=4 + seed % 5, exact=False), "global_allgather")
        for i, op in enumerate(plan.operations):
            if op.kind != "allgather" or i == 0:
                continue
            early = op.model_copy(update={"start_s": 0.0, "id": -1})
            late = plan.model_copy(update={"operations": (early, *plan.operations[:i], *plan.operations[i + 1:])})
            try:
                check_plan(late)
            except PlanError:
                continue
            if _slow(late) is not None:
                continue
            assert replay_summary(late) is None
            try:
                verify_plan(late)
            except PlanError as err:
                reached += "does not hold" in str(err)
            else:
                raise AssertionError("verify passed a plan whose all-gather runs before its parts arrive")
    assert reached


def test_operations_the_arrays_prove_pass_the_one_by_one_checks():
    """`schemas.plan_check_arrays` marks an operation proven only where `_check_operation` passes it; mutants hit
    every per-operation rule (devices outside the meshes, boxes outside shards, chunks, kinds, chains)."""
    from xmesh_plan.schemas.plan_check import MAX_CHUNKS, _check_operation, _Shards
    from xmesh_plan.schemas.plan_check_arrays import proven_operations

    rng = random.Random(30)
    bases = [as_lists(compiled(random_problem(seed, max_devices=4 + seed % 5, exact=False), s).model_dump())
             for seed in range(8) for s in STRATEGIES]
    bases = [b for b in bases if b["operations"]]
    proven_count = refused = 0
    for _ in range(400):
        raw = as_lists(rng.choice(bases))
        mutate(rng, raw)
        try:
            plan = Plan.model_validate(raw)
        except ValidationError:
            continue
        problems = plan.problem.tensor_problems()
        proven = proven_operations(plan.operations, problems, MAX_CHUNKS)
        for op, done in zip(plan.operations, proven.tolist()):
            try:
                _check_operation(op, _Shards(problems[0]))
                passes = True
            except PlanError:
                passes = False
            refused += not passes
            assert passes or not done, op
            proven_count += done
    assert proven_count > 1000 and refused > 50
