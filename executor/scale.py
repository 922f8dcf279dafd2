"""Shrink a plan's tensor by integer factors per dim so a demo fits a small machine.

Every box boundary of the plan (operations, parts, tasks, shards) is divided by the factor of its
dim, so a factor must divide all of them; the scaled problem's shards are then recomputed and must
equal the divided ones (uneven ceil-division splits can forbid some factors). Chunk counts stay.

>>> smallest_prime_factor(12), smallest_prime_factor(7)
(2, 7)
"""

from __future__ import annotations

import math
from typing import Any

from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.carriers import split_ragged
from xmesh_plan.schemas.geometry import Region
from xmesh_plan.schemas.plan_tensors import is_multi, tensor_plans
from xmesh_plan.schemas.staging import with_stated_staging

from .errors import PlanMismatchError


def refuse_conversion(plan: Plan) -> None:
    """PlanMismatchError, the same on every rank, for a plan that converts at the sender: the demos fill shards of the
    source dtype and check destinations against that pattern, which a conversion does not keep."""
    converting = next((p for p in plan.problem.tensor_problems() if p.dst_dtype not in (None, p.dtype)), None) if is_multi(plan) \
        else plan.problem if plan.problem.dst_dtype not in (None, plan.problem.dtype) else None
    if converting is not None:
        raise PlanMismatchError(f"the plan converts {converting.dtype} to {converting.dst_dtype} at the sender, and this command "
                                "fills and checks shards of the source dtype; run it with TransferExecutor or WeightSync "
                                "(docs/executor.md, \"Conversion at the sender\")", same_on_every_rank=True)


def smallest_prime_factor(n: int) -> int:
    return next((p for p in range(2, math.isqrt(n) + 1) if n % p == 0), n)


def _boundaries(plan: Plan) -> list[list[int]]:
    """Every coordinate that appears in the plan, per dim."""
    problem = plan.problem
    boxes: list[Region] = list(problem.blocks("src").values()) + list(problem.blocks("dst").values())
    boxes += [op.region for op in plan.operations] + [p for op in plan.operations for p in op.parts]
    boxes += [t.region for t in plan.tasks]
    return [[n] + [c for box in boxes for c in box[d]] for d, n in enumerate(problem.shape)]


def allowed_factors(plan: Plan) -> tuple[int, ...]:
    """Per dim, the greatest common divisor of all its coordinates: the largest factor it can be divided by."""
    return tuple(math.gcd(*coords) or 1 for coords in _boundaries(plan))


def factors_for(plan: Plan, max_bytes: int) -> tuple[int, ...]:
    """Factors that bring the tensor to at most `max_bytes` if possible, halving the longest divisible dim first."""
    room = list(allowed_factors(plan))
    factors = [1] * len(room)
    shape = list(plan.problem.shape)
    while math.prod(shape) * plan.problem.itemsize > max_bytes:
        dims = [d for d in range(len(shape)) if room[d] > 1]
        if not dims:
            break
        d = max(dims, key=lambda k: (shape[k], -k))
        p = smallest_prime_factor(room[d])
        room[d] //= p
        factors[d] *= p
        shape[d] //= p
    return tuple(factors)


def _divide(value: Any, factors: tuple[int, ...]) -> Any:
    return [[a // f, b // f] for (a, b), f in zip(value, factors)]


def scale_plan(plan: Plan, factors: tuple[int, ...]) -> Plan:
    """The same plan on a tensor whose dim d is `factors[d]` times shorter; refuses factors that change the shards."""
    if len(factors) != len(plan.problem.shape) or any(f < 1 for f in factors):
        raise PlanMismatchError(f"scale factors {factors} need one positive integer per tensor dim ({len(plan.problem.shape)})")
    allowed = allowed_factors(plan)
    bad = [d for d, (f, a) in enumerate(zip(factors, allowed)) if a % f]
    if bad:
        raise PlanMismatchError(f"scale factor {factors[bad[0]]} does not divide every box boundary of dim {bad[0]}; "
                                f"use a divisor of {allowed[bad[0]]}")
    data = plan.model_dump(mode="json")
    data["problem"]["shape"] = [n // f for n, f in zip(plan.problem.shape, factors)]
    for op in data["operations"]:
        op["region"] = _divide(op["region"], factors)
        op["parts"] = [_divide(p, factors) for p in op["parts"]]
    for task in data["tasks"]:
        task["region"] = _divide(task["region"], factors)
        task["nbytes"] = math.prod(b - a for a, b in task["region"]) * plan.problem.itemsize
    scaled = Plan.model_validate(data)
    for side in ("src", "dst"):
        want = {d: tuple(map(tuple, _divide(box, factors))) for d, box in plan.problem.blocks(side).items()}
        if scaled.problem.blocks(side) != want:
            raise PlanMismatchError(f"scaling by {factors} changes how the {side} spec splits the tensor (uneven shards); "
                                    "pick smaller factors")
    if scaled.staging is not None:  # every staged box shrinks by the same factor: so does the limit, and the peaks are restated
        scaled = with_stated_staging(scaled, max(1, -(-scaled.staging.limit_bytes // math.prod(factors))))
    return scaled


def factors_per_tensor(plan: Plan, max_bytes: int) -> list[tuple[int, ...]]:
    """`factors_for` for each tensor of a plan, its share of `max_bytes` in proportion to its size."""
    singles = tensor_plans(plan)
    total = sum(p.problem.nbytes for p in singles) or 1
    return [factors_for(p, max(1, max_bytes * p.problem.nbytes // total)) for p in singles]


def scale_tensors(plan: Plan, factors: list[tuple[int, ...]]) -> Plan:
    """`scale_plan` for every tensor of a plan (factors per tensor, in tensor order); the joint order stays."""
    if not is_multi(plan):
        return scale_plan(plan, factors[0])
    singles = [scale_plan(p, f) for p, f in zip(tensor_plans(plan), factors)]
    ops = {op.id: op for single in singles for op in single.operations}
    tasks = {t.id: t for single in singles for t in single.tasks}
    data = plan.model_dump(mode="json")
    for entry, single in zip(data["problem"]["tensors"], singles):
        entry["shape"] = list(single.problem.shape)
    for op in data["operations"]:
        op["region"], op["parts"] = ops[op["id"]].region, ops[op["id"]].parts
    for task in data["tasks"]:
        task["region"], task["nbytes"] = tasks[task["id"]].region, tasks[task["id"]].nbytes
    scaled = Plan.model_validate(data)
    itemsizes = [p.itemsize for p in scaled.problem.tensor_problems()]  # a shared message's bundles may no longer align
    scaled = scaled.model_copy(update={"operations": split_ragged(scaled.operations, itemsizes, max(itemsizes))})
    if scaled.staging is not None:  # each tensor's staged boxes shrink by its own factor: the limit by the least, the peaks restated
        least = min(math.prod(f) for f in factors)
        scaled = with_stated_staging(scaled, max(1, -(-scaled.staging.limit_bytes // least)))
    return scaled
