"""What lowering reads of a whole plan, computed once per plan: which operations each device takes part in,
where each operation's tags start, and each tensor's shards.

`lower(plan, device)` walks only the operations in `by_device[device]` (`device_ops`), so its cost grows
with the device's share of the plan, not the plan's size. The index is made with the plan's check
(`check_plan`, the same rules and messages as `xmesh-plan verify`) on first use and kept while the plan
object lives (`plan_index`), so lowering every device of a plan (the tests, a simulator), or lowering and
then running its passes, checks and indexes the plan once; a plan the check refuses keeps its refusal.

Tags are numbered tensor by tensor: tensor k's operations own the tags after those of tensors 0..k-1,
each operation a block of `op_kinds.tags_used` in plan order, so no two messages of one plan share a tag
and a tensor's messages, taken alone, come in tag order.

>>> from xmesh_plan.schemas.plan import Operation
>>> ops = [Operation(id=0, task=0, kind="send", src=0, dsts=(1,), region=((0, 2),)),
...        Operation(id=1, task=1, kind="copy", src=2, dsts=(2,), region=((2, 4),))]
>>> devices_of(ops)
{0: (0,), 1: (0,), 2: (1,)}
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Sequence

from xmesh_plan.schemas import Operation, Plan
from xmesh_plan.schemas.geometry import Region
from xmesh_plan.schemas.op_kinds import first_tags, members
from xmesh_plan.schemas.plan_check import PlanError, check_plan
from xmesh_plan.schemas.plan_compact import DeviceOps, shared_ids

from .errors import PlanMismatchError


@dataclass(frozen=True)
class PlanIndex:
    """`by_device[d]`: positions in `plan.operations` of the operations device d takes part in, in plan
    order; `first_tag[k]`: the first tag of operation k; `tags`: how many tags the plan uses; `blocks[t]`:
    tensor t's (source, destination) device -> box maps."""

    by_device: dict[int, tuple[int, ...]]
    first_tag: tuple[int, ...]
    tags: int
    blocks: tuple[tuple[dict[int, Region], dict[int, Region]], ...]


def devices_of(operations: Sequence[Operation]) -> dict[int, tuple[int, ...]]:
    """Device -> the positions of the operations it takes part in (`op_kinds.members`), in list order."""
    out: dict[int, list[int]] = {}
    for k, op in enumerate(operations):
        for d in members(op):
            out.setdefault(d, []).append(k)
    return {d: tuple(ks) for d, ks in out.items()}


def build_index(plan: Plan) -> PlanIndex:
    problems = plan.problem.tensor_problems()
    first, tags = first_tags(plan.operations)
    return PlanIndex(devices_of(plan.operations), tuple(first), tags,
                     tuple((p.blocks("src"), p.blocks("dst")) for p in problems))


_INDEXES: dict[int, PlanIndex | str] = {}  # id(plan) -> its index, or the check's refusal


def plan_index(plan: Plan) -> PlanIndex:
    """The index of a plan `check_plan` accepts, made (with the check) on first use and dropped when the plan
    object is collected; PlanMismatchError with the checker's refusal and what to do otherwise (plans are frozen,
    so the outcome holds while the object lives)."""
    key = id(plan)
    index = _INDEXES.get(key)
    if index is None:
        try:  # the same structural rules and messages as `xmesh-plan verify`
            check_plan(plan)
            index = build_index(plan)
        except PlanError as err:
            index = refusal_advice(str(err))
        _INDEXES[key] = index
        weakref.finalize(plan, _INDEXES.pop, key, None)
    if isinstance(index, str):
        raise PlanMismatchError(index)
    return index


def device_ops(plan: Plan, device: int) -> DeviceOps:
    """What `device` needs of a checked `plan` to lower its part (`plan_index`): the operations it takes part in,
    their rows, first tags, the plan's tags and staging; the same value `schemas.plan_io.read_plan_ops` reads
    from a file, at the cost of the device's share."""
    index = plan_index(plan)
    rows = index.by_device.get(device, ())
    operations, first = plan.operations, index.first_tag
    mine = tuple(operations[k] for k in rows)
    shared = shared_ids(mine, rows, lambda after: [operations[r].carrier if r < len(operations) else None for r in after])
    return DeviceOps(plan.schema_version, plan.problem, mine, rows, tuple(first[k] for k in rows), index.tags, plan.staging, shared)


def refusal_advice(message: str) -> str:
    """The checker's or the lowering's one-line refusal with what to do, said once (the checker's may end in part of it)."""
    message = message.removesuffix("; recompile the plan").removesuffix(" (recompile the plan)")
    return f"{message}; recompile the plan and check it with `xmesh-plan verify`"
