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

Bundles of several tensors that share one cross-host message (`schemas.carriers`) are lowered each in
its own tensor's program, as whole bundles; the joint program then lays every operation's staging out
in one area, one after another (so a shared message's bundles are one range on both relays), sends
and receives that range once with the carrier's tag, and (device order) runs the group as one
operation. It does so in either order, so `TransferExecutor` replays such a plan through the joint
program posted too.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.carriers import group_key, has_carriers
from xmesh_plan.schemas.staging import aligned, stage_budget, staging_align

from .errors import PlanMismatchError
from .lower import Action, Bytes, RankProgram, Step, in_device_order, stage_ranges


@dataclass(frozen=True, slots=True)
class JointProgram:
    """One device's steps of every tensor in the joint plan's operation order, each step's `deps` indices
    into `steps`; `where[i]` is (tensor, index of that step in the tensor's own program). `stage_bytes`:
    the staging area the steps use (device order, or bundles sharing messages: one area shared by every
    tensor, `shared`; otherwise 0, each tensor keeps its own program's area)."""

    device: int
    steps: tuple[Step, ...]
    where: tuple[tuple[int, int], ...]
    order: str = "posted"
    stage_bytes: int = 0
    shared: bool = False  # every tensor's steps stage in one area of `stage_bytes` (device order, or bundles sharing messages)
    # the joint plan's operation ids in order, each bundle of a shared message but the carrier -> the carrier, and the staging
    # alignment: what an engine that merges the tensors' programs its own way needs (`nccl_plan.joint_nccl_program`)
    operations: tuple[int, ...] = ()
    carriers: tuple[tuple[int, int], ...] = ()
    align: int = 1

    def messages(self) -> int:
        return sum(s.action.is_message for s in self.steps)


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
    carried = has_carriers(plan.operations)
    align = staging_align(plan)
    key = {op.id: group_key(op) for op in plan.operations if op.carrier is not None}
    facts = {"operations": tuple(op.id for op in plan.operations), "carriers": tuple(sorted(key.items())), "align": align}
    if order != "device" and not carried:
        return JointProgram(device, steps, where, order, **facts)
    stage_bytes = 0
    if carried:  # one area, each operation's staging after the one before, so a shared message is one range
        steps, stage_bytes = _one_area(steps, where, align)
        steps, where = _share_messages(steps, where, key)
    if order != "device":
        return JointProgram(device, steps, where, order, stage_bytes, shared=True, **facts)
    ordered = in_device_order(RankProgram(device, steps, stage_bytes, None, None, align), stage_budget(plan), align, key)
    return JointProgram(device, ordered.steps, where, order, ordered.stage_bytes, shared=True, **facts)


def _one_area(steps: tuple[Step, ...], where: tuple[tuple[int, int], ...], align: int) -> tuple[tuple[Step, ...], int]:
    """The steps with every (tensor, operation)'s staging moved into one area, one after another in step order,
    each starting at a multiple of `align` (`schemas.staging.chained`); and the area's size."""
    spans = stage_ranges(steps, [(t, s.op) for s, (t, _) in zip(steps, where)])
    shift, at = {}, 0
    for k, (lo, hi) in spans.items():  # dicts keep the order of first appearance: step order
        if hi > lo:
            start = aligned(at, align)
            shift[k], at = lo - start, start + hi - lo
    moved = tuple(replace(s, data=Bytes("stage", s.data.start - shift[(t, s.op)], s.data.stop - shift[(t, s.op)]))
                  if s.data is not None and s.data.buffer == "stage" and (t, s.op) in shift else s
                  for s, (t, _) in zip(steps, where))
    return moved, at


def _share_messages(steps: tuple[Step, ...], where: tuple[tuple[int, int], ...], key: dict[int, int]
                    ) -> tuple[tuple[Step, ...], tuple[tuple[int, int], ...]]:
    """One cross-host send (and receive) per shared message (`schemas.carriers`), over the bytes of every bundle
    in it (laid out one after another by `_one_area`), with the carrier's tag: the receive where the first
    bundle's was (what waited for a dropped one waits for it), the send where the last bundle's was (after
    every gather it waits for), so every dependency still points backwards. The others are dropped."""
    crossing: dict[tuple[str, int], list[int]] = {}
    carriers = set(key.values())
    for i, s in enumerate(steps):
        if s.piece == "bundle" and (s.op in key or s.op in carriers):
            crossing.setdefault((s.action, key.get(s.op, s.op)), []).append(i)
    instead: dict[int, int] = {}  # dropped step -> the step that carries its bytes
    merged: dict[int, Step] = {}
    for (action, group), indices in crossing.items():
        if len(indices) < 2:
            continue
        first, last = steps[indices[0]], steps[indices[-1]]
        for a, b in zip(indices, indices[1:]):
            if steps[a].data.stop != steps[b].data.start:
                raise PlanMismatchError(f"{first.describe()}: the bundles of operation {group}'s message are not laid out "
                                        "one after another in staging; recompile the plan and check it with `xmesh-plan verify`")
        deps = sorted({d for i in indices for d in steps[i].deps} - set(indices))
        keep = indices[-1] if action is Action.SEND else indices[0]
        merged[keep] = replace(steps[keep], data=Bytes("stage", first.data.start, last.data.stop), deps=tuple(deps), tag=first.tag)
        instead |= {i: keep for i in indices if i != keep}
    if not instead:
        return steps, where
    kept = [i for i in range(len(steps)) if i not in instead]
    index = {old: new for new, old in enumerate(kept)}
    index |= {old: index[to] for old, to in instead.items()}
    out = tuple(replace(merged.get(i, steps[i]), index=index[i],
                        deps=tuple(sorted({index[d] for d in merged.get(i, steps[i]).deps}))) for i in kept)
    return out, tuple(where[i] for i in kept)


def tensor_programs(joint: JointProgram, programs: Sequence[RankProgram]) -> list[RankProgram]:
    """Each tensor's program with its steps' bytes where `joint` put them (device order, or bundles sharing
    messages: in the one staging area of `joint.stage_bytes`, which every tensor's engine then shares);
    dependencies stay the tensor's own. Otherwise (posted) each tensor keeps its own program."""
    if not joint.shared:
        return list(programs)
    steps = [list(p.steps) for p in programs]
    replayed = set(joint.where)
    for t, mine in enumerate(steps):  # a bundle's own cross-host message, dropped for the shared one, stages nothing
        for j, s in enumerate(mine):
            if (t, j) not in replayed and s.data is not None and s.data.buffer == "stage":
                mine[j] = replace(s, data=Bytes("stage", 0, 0))
    for s, (t, j) in zip(joint.steps, joint.where):  # a shared message's send also takes its carrier's tag
        steps[t][j] = replace(steps[t][j], data=s.data, tag=s.tag)
    return [replace(p, steps=tuple(mine), stage_bytes=joint.stage_bytes, order=joint.order) for p, mine in zip(programs, steps)]
