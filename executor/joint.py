"""Every tensor of a multi-tensor plan as one program per device, so device order spans tensors.

`TransferExecutor` lowers each tensor's plan on its own (`lower`, tags numbered after the tensors before
it), which is what its buffers and requests are made from. In device order a device must also take part
in one operation at a time across tensors, in the joint plan's order, so `join_programs` merges this
device's steps of every tensor, operation by operation in the joint plan's order, and applies
`lower.in_device_order` to the result: its gates, and one staging area for every tensor, re-used run
after run as a single tensor's device order re-uses its own (each operation's bytes at a multiple of
the largest element size among the tensors, `schemas.staging.staging_align`; runs end before the plan's
stated limit, `--max-staging-mb`). `tensor_programs` gives each tensor's program those re-based bytes,
so each tensor's engine makes its requests and views over the one shared area (`setup(stage=...)`), and
an engine's joint form (`engines.EngineEntry.join`) replays the merged steps with them, found through `where`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.staging import stage_budget, staging_align

from .lower import RankProgram, Step, in_device_order


@dataclass(frozen=True, slots=True)
class JointProgram:
    """One device's steps of every tensor in the joint plan's operation order, each step's `deps` indices
    into `steps`; `where[i]` is (tensor, index of that step in the tensor's own program). `stage_bytes`:
    the staging area the steps use (device order: one area shared by every tensor; posted: 0, each
    tensor keeps its own program's area)."""

    device: int
    steps: tuple[Step, ...]
    where: tuple[tuple[int, int], ...]
    order: str = "posted"
    stage_bytes: int = 0

    def messages(self) -> int:
        return sum(s.action in ("send", "recv") for s in self.steps)


def join_programs(programs: Sequence[RankProgram], plan: Plan, order: str = "device") -> JointProgram:
    """Merge one device's per-tensor programs (`programs[t]` lowered from tensor t's plan) in `plan`'s
    operation order; with `order="device"`, gated and laid out in one staging area as `in_device_order`
    does for one tensor's program (with `plan`'s staging budget and alignment).

    Each tensor's plan keeps the joint plan's operation ids and order, and lowering adds an operation's
    steps together, so the merge moves whole operations and every dependency still points backwards."""
    position = {op.id: k for k, op in enumerate(plan.operations)}
    blocks = []  # (position of the operation, tensor, indices of its steps in that tensor's program)
    for t, program in enumerate(programs):
        for s in program.steps:
            if blocks and blocks[-1][1] == t and program.steps[blocks[-1][2][-1]].op == s.op:
                blocks[-1][2].append(s.index)
            else:
                blocks.append((position[s.op], t, [s.index]))
    blocks.sort(key=lambda block: block[0])
    where = tuple((t, j) for _, t, indices in blocks for j in indices)
    new_index = {key: i for i, key in enumerate(where)}
    steps = tuple(replace(programs[t].steps[j], index=i, deps=tuple(sorted(new_index[(t, d)] for d in programs[t].steps[j].deps)))
                  for i, (t, j) in enumerate(where))
    device = programs[0].device
    if order != "device":
        return JointProgram(device, steps, where, order)
    align = staging_align(plan)
    ordered = in_device_order(RankProgram(device, steps, 0, None, None, align), stage_budget(plan), align)
    return JointProgram(device, ordered.steps, where, order, ordered.stage_bytes)


def tensor_programs(joint: JointProgram, programs: Sequence[RankProgram]) -> list[RankProgram]:
    """Each tensor's program with its steps' bytes where `joint` put them (device order: in the one staging
    area of `joint.stage_bytes`, which every tensor's engine then shares); dependencies stay the tensor's own.
    Posted, each tensor keeps its own program."""
    if joint.order != "device":
        return list(programs)
    steps = [list(p.steps) for p in programs]
    for s, (t, j) in zip(joint.steps, joint.where):
        steps[t][j] = replace(steps[t][j], data=s.data)
    return [replace(p, steps=tuple(mine), stage_bytes=joint.stage_bytes, order=joint.order) for p, mine in zip(programs, steps)]
