"""Every tensor of a multi-tensor plan as one program per device, so device order spans tensors.

`TransferExecutor` lowers each tensor's plan on its own (`lower`, tags numbered after the tensors before
it), which is what its buffers and requests are made from. In device order a device must also take part
in one operation at a time across tensors, in the joint plan's order, so `join_programs` merges this
device's steps of every tensor, operation by operation in the joint plan's order, and applies
`lower.in_device_order`'s gates to the result. An engine's joint form (`engines.EngineEntry.join`) replays
the merged steps with each tensor's own engine's buffers and requests, found through `where`; so each
tensor stages as its own program lays staging out (the sum over its operations, as posted), not in
one area re-used run after run as a single tensor's device order does. (Multi-tensor plans state no
staging limit: `--max-staging-mb` is for single-tensor problems.)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from xmesh_plan.schemas import Plan

from .lower import RankProgram, Step, in_device_order


@dataclass(frozen=True, slots=True)
class JointProgram:
    """One device's steps of every tensor in the joint plan's operation order, each step's `deps` indices
    into `steps`; `where[i]` is (tensor, index of that step in the tensor's own program)."""

    device: int
    steps: tuple[Step, ...]
    where: tuple[tuple[int, int], ...]
    order: str = "posted"

    def messages(self) -> int:
        return sum(s.action in ("send", "recv") for s in self.steps)


def join_programs(programs: Sequence[RankProgram], plan: Plan, order: str = "device") -> JointProgram:
    """Merge one device's per-tensor programs (`programs[t]` lowered from tensor t's plan) in `plan`'s
    operation order; with `order="device"`, gated as `in_device_order` gates one tensor's program.

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
    if order == "device":  # only the gates: each step keeps its tensor's bytes (in_device_order re-bases staging per run)
        gated = in_device_order(RankProgram(device, steps, 0, None, None, 1)).steps
        steps = tuple(replace(s, deps=g.deps) for s, g in zip(steps, gated))
    return JointProgram(device, steps, where, order)
