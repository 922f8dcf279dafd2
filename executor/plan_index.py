"""What lowering reads of a whole plan, computed once per plan: which operations each device takes part in,
where each operation's tags start, and each tensor's shards.

`lower(plan, device)` walks only the operations in `by_device[device]`, so its cost grows with the
device's share of the plan, not the plan's size; the index itself is one pass over the plan, made on
first use and kept while the plan object lives (`plan_index`), so lowering every device of a plan (the
tests, a simulator) pays for it once.

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


_INDEXES: dict[int, PlanIndex] = {}


def plan_index(plan: Plan) -> PlanIndex:
    """The plan's index, made on first use and dropped when the plan object is collected."""
    key = id(plan)
    index = _INDEXES.get(key)
    if index is None:
        index = _INDEXES[key] = build_index(plan)
        weakref.finalize(plan, _INDEXES.pop, key, None)
    return index
