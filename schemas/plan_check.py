"""The one structural checker of plans, shared by `xmesh-plan verify` and the executor's lowering.

It checks what a plan must satisfy before anyone replays it: finite, non-negative times; unique ids;
operations listed in execution order; per-kind device membership (`op_kinds.OP_KINDS`); boxes inside the
tensor and inside the shards that hold or receive them; all-gather parts that tile their box; chunk
counts within limits; shared messages whose carrier comes first (`schemas.carriers`); every task with an
operation between hosts listed in host_order; and the staging a plan states (`schemas.staging`: each
peak what it recomputes to, none above the limit). Both sides call `check_plan`, so the same fault gets
the same message, and a plan one side refuses the other refuses too.
What needs a replay (who holds what when, nothing received twice, every shard complete) is checked
by the verifier and, per device, by the lowering, on top of this.
"""

from __future__ import annotations

import itertools
import math
from itertools import chain
import re
from typing import Sequence

import numpy as np

from .carriers import carrier_fault
from .geometry import Region, region_size
from .op_kinds import OP_KINDS, OpKindRule, members, reads, rule_of, tags_used, writes
from .plan import Operation, Plan, format_region, plan_schema_version
from .plan_check_arrays import proven_bundles, proven_operations, sorted_unique
from .plan_compact import DeviceOps
from .plan_tensors import mpi_transfer_order
from .problem import ReshardingProblem
from .staging import stated_staging_fault
from .transfer import TransferProblem

__all__ = ["MAX_CHUNKS", "MAX_TAGS", "PlanError", "TOLERANCE_S", "check_device_ops", "check_plan", "describe", "overlapping_pair", "tags_used", "uncovered", "uncovered_each"]

MAX_CHUNKS = 1024  # the most pipelined pieces a broadcast may have (the planner never picks more)
TOLERANCE_S = 1e-9  # slack for comparing times rounded to picoseconds
MAX_TAGS = 2**29  # message tags a plan may use: MPICH's TAG_UB + 1 (an MPI with a lower TAG_UB refuses more in prepare())
_SIDE = re.compile(r"(send|recv)(:(0|[1-9][0-9]*))?")


class PlanError(ValueError):
    """A plan that breaks the format's rules or does not deliver every byte; the message names the
    operation, device and box."""


def describe(op: Operation) -> str:
    """`operation 7 (task 3, broadcast)`: how every message about an operation begins (`tensor 2, ` added
    before the task in a multi-tensor plan)."""
    tensor = "" if op.tensor is None else f"tensor {op.tensor}, "
    return f"operation {op.id} ({tensor}task {op.task}, {op.kind})"


def _is_time(value: float | None) -> bool:
    return value is not None and math.isfinite(value) and value >= 0


def _check_numbers(plan: Plan) -> None:
    """Plan-level times are finite and non-negative; the prediction covers every operation and the bound."""
    latest = max((op.end_s for op in plan.operations), default=0.0)
    for name in ("predicted_seconds", "lower_bound_seconds"):
        value = getattr(plan, name)
        if name == "predicted_seconds" and value < latest - TOLERANCE_S:
            raise PlanError(f"predicted_seconds {value} is before the last operation ends ({latest}s)")
        if not _is_time(value):
            raise PlanError(f"{name} is {value}; it must be a finite number of seconds >= 0 (recompile the plan)")
    proven = plan.solver.proven_bound_seconds
    if proven is not None and not _is_time(proven):
        raise PlanError(f"solver.proven_bound_seconds is {proven}; it must be a finite number of seconds >= 0 or null")
    for task in plan.tasks:
        if not (_is_time(task.start_s) and _is_time(task.end_s)) or task.end_s + TOLERANCE_S < task.start_s:
            raise PlanError(f"task {task.id} runs @{task.start_s}-{task.end_s}s; times must be finite, >= 0, end after start")
    if plan.lower_bound_seconds > plan.predicted_seconds * (1 + 1e-9) + TOLERANCE_S:
        raise PlanError(f"lower_bound_seconds {plan.lower_bound_seconds} is above predicted_seconds {plan.predicted_seconds}; "
                        "no plan beats the physical bound, so one of them is wrong (recompile the plan)")
    _check_executor_prediction(plan)


def _check_executor_prediction(plan: Plan) -> None:
    """A multi-tensor plan's time in the executor's order is a time no better than the bound; other plans carry none."""
    stated = plan.executor_prediction
    if stated is None:
        return
    if not isinstance(plan.problem, TransferProblem):
        raise PlanError("executor_prediction is only for multi-tensor plans (a single-tensor plan runs in device order, its "
                        "predicted_seconds' own); remove the field or recompile the plan")
    expected = mpi_transfer_order()
    if stated.order != expected:
        raise PlanError(f"executor_prediction.order is {stated.order!r}, but the executor runs this plan {expected!r} by default "
                        f"({'within its staging limit' if plan.staging is not None else 'it states no staging limit'}); "
                        "recompile the plan")
    if not _is_time(stated.predicted_seconds):
        raise PlanError(f"executor_prediction.predicted_seconds is {stated.predicted_seconds}; it must be a finite number of "
                        "seconds >= 0 (recompile the plan)")
    if plan.lower_bound_seconds > stated.predicted_seconds * (1 + 1e-9) + TOLERANCE_S:
        raise PlanError(f"lower_bound_seconds {plan.lower_bound_seconds} is above executor_prediction.predicted_seconds "
                        f"{stated.predicted_seconds}; no order beats the physical bound (recompile the plan)")


def _check_ids_and_order(plan: Plan) -> None:
    """Unique task and operation ids, operations naming existing tasks, listed by (start time, id)."""
    task_ids = set()
    for task in plan.tasks:
        if task.id in task_ids:
            raise PlanError(f"task id {task.id} appears twice; every unit task needs its own id")
        task_ids.add(task.id)
    _check_operation_order(plan.operations, task_ids)
    _check_host_order(plan, task_ids)


def _check_operation_order(operations, task_ids: set[int] | None, positions: Sequence[int] | None = None) -> None:
    """Unique operation ids, naming tasks in `task_ids` (None: not known here, not checked), finite times, listed by
    (start time, id); `positions`: each operation's position in the plan (default: its place in `operations`)."""
    if task_ids is None and _in_order(operations):
        return
    seen, before = set(), None
    for index, op in zip(positions or range(len(operations)), operations):
        if op.id in seen:
            raise PlanError(f"operation at position {index} reuses id {op.id}; every operation needs its own id")
        seen.add(op.id)
        if task_ids is not None and op.task not in task_ids and not (op.task == -1 and rule_of(op).taskless):
            raise PlanError(f"{describe(op)} names task {op.task}, which the plan does not have")
        if not (math.isfinite(op.start_s) and math.isfinite(op.end_s)):
            raise PlanError(f"{describe(op)} runs @{op.start_s}-{op.end_s}s; times must be finite numbers of seconds")
        if op.end_s + TOLERANCE_S < op.start_s:
            raise PlanError(f"{describe(op)} ends at {op.end_s}s before it starts at {op.start_s}s")
        if op.start_s < 0:
            raise PlanError(f"{describe(op)} starts at {op.start_s}s, before time 0")
        if before is not None and (op.start_s, op.id) < (before.start_s, before.id):  # the executor posts the list in this order
            why = (f"has a lower id than operation {before.id}, listed ahead of it at the same start {op.start_s}s"
                   if op.start_s == before.start_s else
                   f"starts at {op.start_s}s, before operation {before.id} listed ahead of it ({before.start_s}s)")
            raise PlanError(f"{describe(op)} at position {index} {why}; list operations in execution order (start time, then id)")
        before = op


def _in_order(operations) -> bool:
    """Whether `_check_operation_order` (tasks not checked) passes `operations`, tested on arrays; False sends the
    caller to the one-by-one loop, which names the first fault."""
    if not operations:
        return True
    ids = np.fromiter((op.id for op in operations), dtype=np.int64, count=len(operations))
    start = np.fromiter((op.start_s for op in operations), dtype=np.float64, count=len(operations))
    end = np.fromiter((op.end_s for op in operations), dtype=np.float64, count=len(operations))
    if len(sorted_unique(ids)) != len(ids) or not (np.isfinite(start).all() and np.isfinite(end).all()):
        return False
    if (end + TOLERANCE_S < start).any() or (start < 0).any():
        return False
    later = (start[1:] > start[:-1]) | ((start[1:] == start[:-1]) & (ids[1:] >= ids[:-1]))
    return bool(later.all())


def _check_shared_sides(plan: Plan) -> None:
    """A bundle in a shared message (`schemas.carriers`) is listed on the NIC sides its carrier is: one message
    crosses one NIC, which the simulator reads off the carrier's task."""
    if not any(op.carrier is not None for op in plan.operations):
        return
    sides: dict[int, set[tuple[int, str]]] = {}
    for entry in plan.host_order:
        for task in entry.tasks:
            sides.setdefault(task, set()).add((entry.host, entry.side))
    task_of = {op.id: op.task for op in plan.operations}
    for op in plan.operations:
        if op.carrier is not None and sides.get(op.task, set()) != sides.get(task_of[op.carrier], set()):
            raise PlanError(f"{describe(op)}: its task {op.task} is in host_order on other NIC sides than task "
                            f"{task_of[op.carrier]} of its carrier, operation {op.carrier}; one message crosses one NIC, "
                            "so list both on the same sides")


def _check_nic_listing(plan: Plan) -> None:
    """Every task with an operation between hosts is in host_order: the simulator queues it on a NIC side by that
    listing, so a task missing from it (or an empty host_order) would be timed as if no NIC carried it."""
    listed = {t for entry in plan.host_order for t in entry.tasks}
    host_of = plan.problem.cluster.host_of
    for op in plan.operations:
        if op.task not in listed and len({host_of(d) for d in members(op)}) > 1:
            raise PlanError(f"{describe(op)} crosses hosts, but its task {op.task} is in no host_order entry; list it on "
                            "the NIC sides it uses (recompile the plan)")


def _check_host_order(plan: Plan, task_ids: set[int]) -> None:
    """Each (host, NIC side) once, on a host of the meshes, naming existing tasks."""
    nics, cluster = len(plan.problem.cluster.nics), plan.problem.cluster
    hosts = {cluster.host_of(d) for mesh in meshes(plan.problem) for d in mesh.devices}
    seen = set()
    for entry in plan.host_order:
        match = _SIDE.fullmatch(entry.side)
        if match is None or (match[3] is not None and int(match[3]) >= nics):
            raise PlanError(f"host_order of host {entry.host} has side {entry.side!r}; use send or recv, or send:N / recv:N "
                            f"for NIC N of the cluster's {nics}")
        if entry.host not in hosts:
            raise PlanError(f"host_order names host {entry.host}, which holds no device of either mesh")
        if (entry.host, entry.side) in seen:
            raise PlanError(f"host_order lists host {entry.host} side {entry.side} twice; give each NIC side one order")
        seen.add((entry.host, entry.side))
        unknown = [t for t in entry.tasks if t not in task_ids]
        if unknown:
            raise PlanError(f"host_order of host {entry.host} ({entry.side}) names task {unknown[0]}, which the plan does not have")


def _inside(box: Region, block: Region) -> bool:
    return all(b0 <= a <= b <= b1 for (a, b), (b0, b1) in zip(box, block))


def meshes(problem: ReshardingProblem | TransferProblem) -> tuple:
    """(source mesh, destination mesh) of either kind of problem."""
    if isinstance(problem, TransferProblem):
        return problem.src_mesh, problem.dst_mesh
    return problem.src.mesh, problem.dst.mesh


def _tensor_count(problem) -> int | None:
    """How many tensors a multi-tensor problem moves; None for a single-tensor one."""
    return len(problem.tensors) if isinstance(problem, TransferProblem) else None


def _check_tensor_index(what: str, item, count: int | None) -> None:
    """A task or operation names a tensor of a multi-tensor problem (`count` of them), and none of a single-tensor one."""
    if count is None and item.tensor is not None:
        raise PlanError(f"{what} {item.id} names tensor {item.tensor}, but the problem has one tensor; drop the field")
    if count is not None and (item.tensor is None or item.tensor >= count):
        raise PlanError(f"{what} {item.id} names tensor {item.tensor}; a multi-tensor plan gives every {what} "
                        f"a tensor index in 0..{count - 1}")


def _check_tensor_indices(plan: Plan) -> None:
    """A multi-tensor plan names a tensor of its problem on every task and operation (its task's tensor);
    a single-tensor plan names none."""
    count = _tensor_count(plan.problem)
    tensor_of = {t.id: t.tensor for t in plan.tasks}
    for what, items in (("task", plan.tasks), ("operation", plan.operations)):
        for item in items:
            _check_tensor_index(what, item, count)
            if what == "operation" and item.task in tensor_of and tensor_of[item.task] != item.tensor:
                raise PlanError(f"{describe(item)} belongs to task {item.task} of tensor {tensor_of[item.task]}; "
                                "an operation moves its own task's tensor")


class _Shards:
    """Each device's source and destination block, to check that boxes lie inside the shards they touch."""

    def __init__(self, problem: ReshardingProblem):
        self.blocks = {"src": problem.blocks("src"), "dst": problem.blocks("dst")}
        self.shape = problem.shape
        self.host_of = problem.cluster.host_of

    def require(self, op: Operation, device: int, side: str, box: Region, role: str) -> None:
        """`device` must hold `box` in its `side` shard (role "sends") or have room for it there ("receives")."""
        mesh = "source" if side == "src" else "destination"
        block = self.blocks[side].get(device)
        if block is None:
            what = "is not in the source mesh, so it holds nothing to send" if role == "sends" else \
                f"receives {format_region(box)} but is not in the {mesh} mesh"
            raise PlanError(f"{describe(op)}: device {device} {what}")
        if not _inside(box, block):
            where = f"which it does not hold (its {mesh} shard is" if role == "sends" else f"outside its {mesh} shard ("
            raise PlanError(f"{describe(op)}: device {device} {role} {format_region(box)} {where} {format_region(block)})")

    def check_box(self, op: Operation, what: str, box: Region) -> None:
        if len(box) != len(self.shape) or any(not (0 <= a <= b <= n) for (a, b), n in zip(box, self.shape)):
            raise PlanError(f"{describe(op)}: {what} {format_region(box)} is not a box inside the tensor {list(self.shape)}")


def _check_members(op: Operation, rule: OpKindRule) -> None:
    """Sender and receivers as the kind requires (before anything reads them: a bundle's relays are its src and dsts[0])."""
    if rule.has_src != (op.src is not None):
        raise PlanError(f"{describe(op)}: src must be {'a device' if rule.has_src else 'null'}, got {op.src}")
    count = len(op.dsts)
    if count < rule.min_dsts or (rule.max_dsts is not None and count > rule.max_dsts):
        wanted = "has exactly one receiver" if rule.max_dsts == rule.min_dsts else f"needs at least {rule.min_dsts} devices in dsts"
        raise PlanError(f"{describe(op)}: a {op.kind} {wanted}, got {list(op.dsts)}")
    if len(set(op.dsts)) != count:
        raise PlanError(f"{describe(op)}: dsts {list(op.dsts)} names a device twice")
    if rule.pattern == "local":
        if op.dsts != (op.src,):
            raise PlanError(f"{describe(op)}: a {op.kind} must stay on device {op.src}, but names {list(op.dsts)}")
    elif op.src in op.dsts:
        raise PlanError(f"{describe(op)}: device {op.src} sends to itself; a device that holds the box needs a copy")


def _check_devices(op: Operation, shards: _Shards) -> None:
    """Each sender holding, and each receiver having room for, the box in its shard."""
    for device, side, box in reads(op):
        if side == "src":  # parts read from a destination shard are checked with the box (`_check_parts`)
            shards.require(op, device, "src", box, "sends")
    for device, box, _ in writes(op):
        shards.require(op, device, "dst", box, "receives")


def _check_bundle(op: Operation, rule: OpKindRule, shards: _Shards) -> None:
    """A bundle's parts: each non-empty inside `region`, with a holder on the sending relay's host and at
    least one needer on the receiving relay's host, on two different hosts; the sending relay a source device and the
    receiving relay a destination device (in a shared message, `schemas.carriers`, they need hold nothing of this tensor)."""
    if rule.pattern != "bundle":
        if op.holders or op.needers:
            raise PlanError(f"{describe(op)}: only a bundle has holders and needers; drop them")
        return
    if not op.parts or len(op.holders) != len(op.parts) or len(op.needers) != len(op.parts):
        raise PlanError(f"{describe(op)}: a bundle needs one holder and one needers list per part, "
                        f"got {len(op.parts)} parts, {len(op.holders)} holders, {len(op.needers)} needers")
    host_of, relay = shards.host_of, op.dsts[0]
    if host_of(op.src) == host_of(relay):
        raise PlanError(f"{describe(op)}: relays d{op.src} and d{relay} are on one host; a bundle crosses hosts, use sends inside one")
    for part, holder, needers in zip(op.parts, op.holders, op.needers):
        shards.check_box(op, "part", part)
        if not region_size(part) or not _inside(part, op.region):
            raise PlanError(f"{describe(op)}: part {format_region(part)} is empty or outside {format_region(op.region)}")
        if host_of(holder) != host_of(op.src):
            raise PlanError(f"{describe(op)}: holder d{holder} of part {format_region(part)} is not on the host of relay d{op.src}")
        if not needers or len(set(needers)) != len(needers) or any(host_of(d) != host_of(relay) for d in needers):
            raise PlanError(f"{describe(op)}: needers {list(needers)} of part {format_region(part)} must be distinct devices "
                            f"on the host of relay d{relay}, at least one")
    if op.src not in shards.blocks["src"] or relay not in shards.blocks["dst"]:
        raise PlanError(f"{describe(op)}: relays d{op.src} and d{relay} must be a source and a destination device "
                        "(they stage the bundle; holding or needing a part of it is not required)")


def _check_parts(op: Operation, rule: OpKindRule, shards: _Shards) -> None:
    """All-gather parts: one per member, inside the box, tiling it exactly (no gap, no overlap)."""
    if rule.pattern == "bundle":
        return
    if not rule.has_parts:
        if op.parts:
            raise PlanError(f"{describe(op)}: only {_kinds_that('has_parts')} has parts; drop them")
        return
    if len(op.parts) != len(op.dsts):
        raise PlanError(f"{describe(op)}: {len(op.dsts)} members but {len(op.parts)} parts")
    for device, part in zip(op.dsts, op.parts):
        shards.check_box(op, "part", part)
        if region_size(part) and not _inside(part, op.region):
            raise PlanError(f"{describe(op)}: part {format_region(part)} of device {device} lies outside {format_region(op.region)}")
    filled = [p for p in op.parts if region_size(p)]
    twice = overlapping_pair(filled)
    if twice is not None:
        raise PlanError(f"{describe(op)}: parts {format_region(filled[twice[0]])} and {format_region(filled[twice[1]])} "
                        "overlap; each element needs one contributor")
    if sum(map(region_size, filled)) != region_size(op.region):  # disjoint parts inside the box: equal volume is a tiling
        raise PlanError(f"{describe(op)}: no member contributes {format_region(uncovered(op.region, filled))}")


def _kinds_that(fact: str) -> str:
    """`an allgather`: the kinds whose rule has `fact`, for messages."""
    kinds = [k for k, rule in OP_KINDS.items() if getattr(rule, fact)]
    return ("an " if kinds[0][0] in "aeiou" else "a ") + " or ".join(kinds)


def overlapping_pair(boxes: list[Region]) -> tuple[int, int] | None:
    """Indices (i < j) of the first two non-empty boxes that share an element, or None (one numpy test).

    >>> overlapping_pair([((0, 2),), ((2, 4),), ((1, 3),)])
    (0, 2)
    """
    if len(boxes) < 2:
        return None
    bounds = np.array(boxes, dtype=np.int64)  # (box, dim, start/stop)
    lo, hi = bounds[:, :, 0], bounds[:, :, 1]
    meet = ((lo[:, None, :] < hi[None, :, :]) & (lo[None, :, :] < hi[:, None, :])).all(axis=2)
    np.fill_diagonal(meet, False)
    pairs = np.argwhere(np.triu(meet))
    return (int(pairs[0][0]), int(pairs[0][1])) if len(pairs) else None


def _check_operation(op: Operation, shards: _Shards) -> None:
    rule = rule_of(op)
    shards.check_box(op, "region", op.region)
    if not region_size(op.region):
        raise PlanError(f"{describe(op)}: region {format_region(op.region)} is empty; drop operations that move nothing")
    elements = region_size(op.region)
    if not rule.chunked and op.chunks != 1:
        raise PlanError(f"{describe(op)}: chunks is {op.chunks}; only {_kinds_that('chunked')} is cut into chunks, so use 1")
    if op.chunks > min(MAX_CHUNKS, elements):
        raise PlanError(f"{describe(op)}: chunks {op.chunks} is above {min(MAX_CHUNKS, elements)}, the most for a box of "
                        f"{elements} elements (at most {MAX_CHUNKS}, and at most one element per chunk)")
    _check_members(op, rule)
    _check_bundle(op, rule, shards)
    _check_devices(op, shards)
    _check_parts(op, rule, shards)


def _check_operations(operations, problems: list[ReshardingProblem]) -> None:
    """Each operation's structure (`_check_operation`), sends, broadcasts and copies proven all at once first. An
    operation whose devices, boxes and counts are those of one already passed, on a tensor of the same shape and
    layouts, passes too (what `_check_operation` reads is the same): a model's layers repeat their operations. Of the
    distinct others, the bundles are proven with arrays over their parts (`plan_check_arrays.proven_bundles`); the
    rest are checked one by one in list order, so the first fault and its message stay the one-by-one checker's."""
    layouts: dict[tuple, int] = {}  # (shape, source and destination placement, cluster) -> a number for it
    layout_of: dict[int | None, int] = {}  # tensor -> its layout's number
    shards: dict[int, _Shards] = {}  # layout -> its shards (what `_Shards` reads is the layout's), made on first use
    passed: set[tuple] = set()
    passed_objects: set[tuple] = set()  # `passed` by the identity of the fields' objects, which `operations` keeps alive
    distinct: list[tuple[Operation, int]] = []  # each distinct operation not proven, with its layout, in list order
    proven = proven_operations(operations, problems, MAX_CHUNKS)
    for op, done in zip(operations, proven.tolist()):
        if done:
            continue
        layout = layout_of.get(op.tensor)
        if layout is None:
            problem = problems[op.tensor or 0]
            layout = layout_of[op.tensor] = layouts.setdefault((tuple(problem.shape), problem.src, problem.dst, problem.cluster),
                                                                len(layouts))
        same = (layout, op.kind, op.src, id(op.dsts), id(op.region), id(op.parts), op.chunks, id(op.holders), id(op.needers))
        if same in passed_objects:  # the very objects of an operation already passed (a file's reader shares a layout's)
            continue
        passed_objects.add(same)
        key = (layout, op.kind, op.src, op.dsts, op.region, op.parts, op.chunks, op.holders, op.needers)
        if key not in passed:
            passed.add(key)
            distinct.append((op, layout))
    bundles = proven_bundles([op for op, _ in distinct], [layout for _, layout in distinct], problems, MAX_CHUNKS)
    for (op, layout), done in zip(distinct, bundles.tolist()):
        if not done:
            if layout not in shards:
                shards[layout] = _Shards(problems[op.tensor or 0])
            _check_operation(op, shards[layout])


def check_plan(plan: Plan) -> None:
    """Raise PlanError naming the first structural fault of `plan` (see the module docstring)."""
    _check_schema_version(plan)
    _check_ids_and_order(plan)
    _check_numbers(plan)
    _check_tensor_indices(plan)
    problems = plan.problem.tensor_problems()
    _check_operations(plan.operations, problems)
    fault = carrier_fault(plan.operations, [p.itemsize for p in problems], max(p.itemsize for p in problems))
    if fault is not None:
        raise PlanError(fault)
    _check_shared_sides(plan)
    _check_nic_listing(plan)
    fault = stated_staging_fault(plan)
    if fault is not None:
        raise PlanError(fault)
    _check_tag_count(sum(map(tags_used, plan.operations)))


def _check_tag_count(tags: int) -> None:
    if tags > MAX_TAGS:  # every message has its own tag; reusing one could match the wrong message
        raise PlanError(f"the plan needs {tags} message tags, more than the {MAX_TAGS} a plan may use; "
                        "split the tensor into smaller transfers")


def check_device_ops(ops: DeviceOps) -> None:
    """Raise PlanError naming the first fault `check_plan` finds in one device's operations on their own (a rank
    that read only its part of a plan file, `schemas.plan_io.read_plan_ops`): the schema version, tensor indices,
    ids and execution order among them, each operation's structure (members, chunks, parts, bundles, boxes inside
    the tensor and the shards that hold or receive them) and the plan's tag count. What needs the whole plan (tasks
    and host order, times against the prediction, shared messages, the staging a plan states) is left to
    `xmesh-plan verify` of the file; what needs a replay of the device's part is the lowering's."""
    _check_schema_version(ops)
    count = _tensor_count(ops.problem)
    for op in ops.operations:
        _check_tensor_index("operation", op, count)
    _check_operation_order(ops.operations, None, ops.rows)
    _check_operations(ops.operations, ops.problem.tensor_problems())
    _check_tag_count(ops.tags)


def _check_schema_version(plan: Plan | DeviceOps) -> None:
    """A plan states at least the schema its problem needs (boxes, fused destinations and conversions are schema 2)."""
    needed = plan_schema_version(plan.problem)
    if plan.schema_version < needed:
        raise PlanError(f"schema_version {plan.schema_version}, but the problem lists boxes, fused destinations or conversions, which "
                        f"need schema {needed}; write schema_version {needed}")


BATCH_CELLS = 1 << 20  # grid cells `uncovered_each` counts at once (int64s: 8 MiB); more blocks are taken in parts
BATCH_BOXES = 1 << 15  # boxes `uncovered_each` takes at once (its arrays of them: a few MiB); more are taken in parts


def uncovered_each(blocks: Sequence[Region], written: Sequence[Sequence[Region]]) -> list[Region | None]:
    """`uncovered(blocks[k], written[k])` for every k, the blocks of one number of dims counted together: each block on
    its own grid (cut where its edges and its boxes' bounds are, as `uncovered` cuts it), the grids padded to one shape,
    so a rank checks its thousand destination shards with a few array operations instead of a few each. The same
    box as `uncovered` names (the first uncovered cell in C order).

    >>> uncovered_each([((0, 4),), ((0, 4), (0, 2))], [[((0, 2),), ((2, 4),)], [((0, 4), (0, 1))]])
    [None, ((0, 4), (1, 2))]
    """
    out: list[Region | None] = [None] * len(blocks)
    by_dims: dict[int, list[int]] = {}
    for k, block in enumerate(blocks):
        if region_size(block):
            by_dims.setdefault(len(block), []).append(k)
    for ks in by_dims.values():
        _uncovered_batch(blocks, written, ks, out)
    return out


def _uncovered_batch(blocks: Sequence[Region], written: Sequence[Sequence[Region]], ks: list[int], out: list) -> None:
    """`uncovered_each` of the non-empty blocks `ks` (one number of dims), into `out[k]`."""
    ndim, count = len(blocks[ks[0]]), len(ks)
    sizes = [len(written[k]) for k in ks]
    if count > 1 and sum(sizes) > BATCH_BOXES:
        half = count // 2
        _uncovered_batch(blocks, written, ks[:half], out)
        _uncovered_batch(blocks, written, ks[half:], out)
        return
    edges = np.array([blocks[k] for k in ks], dtype=np.int64).reshape(count, ndim, 2)
    owner = np.repeat(np.arange(count), sizes)
    flat = chain.from_iterable(chain.from_iterable(chain.from_iterable(written[k] for k in ks)))  # faster than np.array of tuples
    boxes = np.fromiter(flat, dtype=np.int64, count=sum(sizes) * ndim * 2).reshape(-1, ndim, 2)
    boxes = np.clip(boxes, edges[owner][:, :, :1], edges[owner][:, :, 1:])  # clipped to the block
    ar = np.arange(count)
    cuts, firsts, ncuts, first_index, last_index = [], [], [], [], []
    low = min(int(edges.min()), int(boxes.min(initial=0)))
    span = max(int(edges.max()), int(boxes.max(initial=0))) - low + 1
    for d in range(ndim):  # each block's cuts in dim d: its edges and its boxes' bounds, sorted, each once
        values = np.concatenate((edges[:, d, 0], edges[:, d, 1], boxes[:, d, 0], boxes[:, d, 1])) - low
        keys = sorted_unique(np.concatenate((ar, ar, owner, owner)) * span + values)
        first = np.searchsorted(keys // span, ar)
        cuts.append(keys)
        firsts.append(first)
        ncuts.append(np.diff(np.append(first, len(keys))))
        first_index.append(np.searchsorted(keys, owner * span + boxes[:, d, 0] - low) - first[owner])
        last_index.append(np.searchsorted(keys, owner * span + boxes[:, d, 1] - low) - first[owner])
    shape = tuple(int(n.max()) for n in ncuts)
    if count > 1 and count * math.prod(shape) > BATCH_CELLS:
        half = count // 2
        _uncovered_batch(blocks, written, ks[:half], out)
        _uncovered_batch(blocks, written, ks[half:], out)
        return
    keep = (boxes[:, :, 0] < boxes[:, :, 1]).all(axis=1)
    where, weights = [], []
    for corner in itertools.product((0, 1), repeat=ndim):  # boxes over each cell, as corner differences summed up
        index = (owner[keep],) + tuple((last_index if up else first_index)[d][keep] for d, up in enumerate(corner))
        where.append(np.ravel_multi_index(index, (count,) + shape))
        weights.append(np.full(int(keep.sum()), (-1) ** sum(corner), dtype=np.int64))
    total = count * math.prod(shape)
    grid = np.bincount(np.concatenate(where), np.concatenate(weights), minlength=total) if where[0].size else np.zeros(total)
    grid = grid.reshape((count,) + shape)
    for axis in range(1, ndim + 1):
        grid = np.cumsum(grid, axis=axis)
    cells = np.ones(grid.shape, dtype=bool)  # a block's cells: below its last cut in every dim
    for d in range(ndim):
        cells &= (np.arange(shape[d]) < (ncuts[d] - 1)[:, None]).reshape((count,) + (1,) * d + (shape[d],) + (1,) * (ndim - d - 1))
    missing = np.argwhere((grid == 0) & cells)
    if not len(missing):
        return
    blocks_missing, at = np.unique(missing[:, 0], return_index=True)
    for b, row in zip(blocks_missing.tolist(), missing[at].tolist()):
        out[ks[b]] = tuple((int(cuts[d][firsts[d][b] + j]) - b * span + low, int(cuts[d][firsts[d][b] + j + 1]) - b * span + low)
                           for d, j in enumerate(row[1:]))


def uncovered(block: Region, written: list[Region]) -> Region | None:
    """A box of `block` that no region in `written` touches, or None when they cover it all.

    >>> uncovered(((0, 4),), [((0, 2),), ((2, 4),)]) is None
    True
    >>> uncovered(((0, 4), (0, 2)), [((0, 4), (0, 1))])
    ((0, 4), (1, 2))
    """
    if not region_size(block):
        return None
    ndim = len(block)
    edges = np.array(block, dtype=np.int64)
    boxes = np.clip(np.array(written, dtype=np.int64).reshape(-1, ndim, 2), edges[:, :1], edges[:, 1:])  # clipped to the block
    cuts = [np.unique(np.concatenate((edges[d], boxes[:, d].ravel()))) for d in range(ndim)]  # the cells: between cuts
    boxes = boxes[(boxes[:, :, 0] < boxes[:, :, 1]).all(axis=1)]
    first = [np.searchsorted(cuts[d], boxes[:, d, 0]) for d in range(ndim)]
    last = [np.searchsorted(cuts[d], boxes[:, d, 1]) for d in range(ndim)]
    count = np.zeros([len(c) for c in cuts], dtype=np.int64)  # boxes over each cell, as corner differences summed up
    for corner in itertools.product((0, 1), repeat=ndim):
        np.add.at(count, tuple(last[d] if up else first[d] for d, up in enumerate(corner)), (-1) ** sum(corner))
    for axis in range(ndim):
        count = np.cumsum(count, axis=axis)
    missing = np.argwhere(count[(slice(-1),) * ndim] == 0)
    if not len(missing):
        return None
    return tuple((int(cuts[d][k]), int(cuts[d][k + 1])) for d, k in enumerate(missing[0]))
