"""Prove a plan correct by replaying it symbolically on a grid of cells.

The grid is cut at every box boundary that appears in the problem or the plan, so every operation
covers whole cells. For each device we track when each cell became available (source shards at time
0). Replaying operations in start-time order, we check that every sender held what it sent when the
operation started, that no device receives a cell twice or outside its destination shard, and at the
end that every destination device holds exactly its shard. Numpy index arithmetic, no element loops.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from schemas import Plan
from schemas.geometry import Region
from schemas.plan import format_region

TOLERANCE_S = 1e-9


class PlanError(Exception):
    """A plan that does not deliver every byte correctly; the message names the operation, device and box."""


@dataclass(frozen=True, slots=True)
class VerifyReport:
    operations: int
    devices_checked: int
    cells: int

    def __str__(self) -> str:
        return f"ok: {self.operations} operations replayed, {self.devices_checked} destination devices hold exactly their shards ({self.cells} destination cells)"


class _Cells:
    """The cells of one device's block on one side: a time per cell when it became available (inf: never)."""

    def __init__(self, cuts: list[np.ndarray], block: Region, initial: float):
        self.block = block
        self.cuts = [c[(c >= lo) & (c <= hi)] for c, (lo, hi) in zip(cuts, block)]
        self.ready = np.full(tuple(max(len(c) - 1, 0) for c in self.cuts), initial)

    def covers(self, box: Region) -> bool:
        return _empty(box) or all(lo <= a and b <= hi for (a, b), (lo, hi) in zip(box, self.block))

    def index(self, box: Region) -> tuple[slice, ...]:
        return tuple(slice(int(np.searchsorted(c, a)), int(np.searchsorted(c, b))) for c, (a, b) in zip(self.cuts, box))

    def describe(self, idx: tuple[slice, ...], mask: np.ndarray) -> str:
        """The box, in global coordinates, of the first cell under `idx` where `mask` is set."""
        first = np.argwhere(mask)[0] + np.array([s.start for s in idx])
        return format_region(tuple((int(c[i]), int(c[i + 1])) for c, i in zip(self.cuts, first)))


def _empty(box: Region) -> bool:
    return any(a >= b for a, b in box)


def _cuts(plan: Plan) -> list[np.ndarray]:
    """Every box boundary in the problem and the plan, per dim, so each box covers whole cells."""
    boxes = list(plan.problem.blocks("src").values()) + list(plan.problem.blocks("dst").values())
    for op in plan.operations:
        boxes.append(op.region)
        boxes.extend(op.parts)
    return [np.unique(np.array([0, n] + [b[d][i] for b in boxes for i in (0, 1)], dtype=np.int64))
            for d, n in enumerate(plan.problem.shape)]


def _check_records(plan: Plan) -> None:
    """Operation ids are unique and operations name existing tasks; times are not negative."""
    task_ids, seen = {t.id for t in plan.tasks}, set()
    for index, op in enumerate(plan.operations):
        if op.id in seen:
            raise PlanError(f"operation at position {index} reuses id {op.id}; every operation needs its own id")
        seen.add(op.id)
        if op.task not in task_ids and not (op.task == -1 and op.kind == "copy"):
            raise PlanError(f"operation {op.id} ({op.kind}) names task {op.task}, which the plan does not have")
        if op.start_s < 0:
            raise PlanError(f"operation {op.id} (task {op.task}, {op.kind}) starts at {op.start_s}s, before time 0")
    for index, (before, op) in enumerate(zip(plan.operations, plan.operations[1:]), start=1):
        if (op.start_s, op.id) < (before.start_s, before.id):  # the executor replays the list in this order
            raise PlanError(f"operation {op.id} at position {index} starts at {op.start_s}s, before operation {before.id} "
                            f"listed ahead of it ({before.start_s}s); list operations in execution order (start time, then id)")
    latest = max((op.end_s for op in plan.operations), default=0.0)
    if plan.predicted_seconds < latest - TOLERANCE_S:
        raise PlanError(f"predicted_seconds {plan.predicted_seconds} is before the last operation ends ({latest}s)")
    if plan.lower_bound_seconds < 0:
        raise PlanError(f"lower_bound_seconds {plan.lower_bound_seconds} is negative")


def _check_boxes(plan: Plan) -> None:
    """Every region and part must have one [start, stop) per tensor dim with 0 <= start <= stop <= length."""
    shape = plan.problem.shape
    for op in plan.operations:
        for what, box in [("region", op.region)] + [("part", p) for p in op.parts]:
            if len(box) != len(shape) or any(not (0 <= a <= b <= n) for (a, b), n in zip(box, shape)):
                raise PlanError(f"operation {op.id} (task {op.task}, {op.kind}): {what} {format_region(box)} "
                                f"is not a box inside the tensor {list(shape)}")


class _Replay:
    """Symbolic state of every device's source and destination shard while operations replay."""

    def __init__(self, plan: Plan):
        cuts = _cuts(plan)
        self.src = {d: _Cells(cuts, b, 0.0) for d, b in plan.problem.blocks("src").items()}
        self.dst = {d: _Cells(cuts, b, np.inf) for d, b in plan.problem.blocks("dst").items()}
        self.op = None

    def fail(self, message: str) -> None:
        op = self.op
        raise PlanError(f"operation {op.id} (task {op.task}, {op.kind}): {message}")

    def check_holds(self, device: int, box: Region, side: str) -> None:
        """`device` must hold all of `box` in its `side` shard by the operation's start."""
        table = self.src if side == "source" else self.dst
        if _empty(box):
            return
        if device not in table:
            self.fail(f"device {device} is not in the {side} mesh, so it holds nothing to send")
        cells = table[device]
        if not cells.covers(box):
            self.fail(f"device {device} sends {format_region(box)} which it does not hold (its {side} shard is {format_region(cells.block)})")
        idx = cells.index(box)
        late = cells.ready[idx] > self.op.start_s + TOLERANCE_S
        if late.any():
            self.fail(f"device {device} sends {cells.describe(idx, late)} which it does not hold at {self.op.start_s:.6f}s")

    def deliver(self, device: int, box: Region, skip: Region | None = None) -> None:
        """`device` receives `box` (less `skip`, its own all-gather part) into its destination shard."""
        if _empty(box):
            return
        if device not in self.dst:
            self.fail(f"device {device} receives {format_region(box)} but is not in the destination mesh")
        cells = self.dst[device]
        if not cells.covers(box):
            self.fail(f"device {device} receives {format_region(box)} outside its destination shard {format_region(cells.block)}")
        idx = cells.index(box)
        incoming = np.ones(cells.ready[idx].shape, dtype=bool)
        if skip is not None and not _empty(skip):
            own = tuple(slice(s.start - i.start, s.stop - i.start) for s, i in zip(cells.index(skip), idx))
            incoming[own] = False
        twice = incoming & np.isfinite(cells.ready[idx])
        if twice.any():
            self.fail(f"device {device} receives {cells.describe(idx, twice)} a second time")
        cells.ready[idx] = np.where(incoming, self.op.end_s, cells.ready[idx])

    def run(self, op) -> None:
        self.op = op
        if op.end_s + TOLERANCE_S < op.start_s:
            self.fail(f"ends at {op.end_s}s before it starts at {op.start_s}s")
        if op.kind in ("copy", "send", "broadcast"):
            self.check_holds(op.src, op.region, "source")
            if op.kind == "copy" and op.dsts != (op.src,):
                self.fail(f"a copy must stay on device {op.src}, but names {list(op.dsts)}")
            if op.kind == "send" and len(op.dsts) != 1:
                self.fail(f"a send has exactly one receiver, got {list(op.dsts)}")
            for d in op.dsts:
                self.deliver(d, op.region)
        elif op.kind == "allgather":
            self.allgather(op)
        else:
            self.fail(f"unknown operation kind {op.kind!r}")

    def allgather(self, op) -> None:
        if len(op.parts) != len(op.dsts):
            self.fail(f"{len(op.dsts)} members but {len(op.parts)} parts")
        whole = _Cells([np.array(sorted({a for p in op.parts for a in p[d]} | set(op.region[d]))) for d in range(len(op.region))], op.region, 0.0)
        covered = np.zeros(whole.ready.shape, dtype=bool)
        for d, part in zip(op.dsts, op.parts):
            if not whole.covers(part):
                self.fail(f"part {format_region(part)} of device {d} lies outside {format_region(op.region)}")
            self.check_holds(d, part, "destination")
            covered[whole.index(part)] = True
        if not covered.all():
            self.fail(f"no member contributes {whole.describe(tuple(slice(0, n) for n in covered.shape), ~covered)}")
        for d, part in zip(op.dsts, op.parts):
            self.deliver(d, op.region, skip=part)

    def finish(self) -> None:
        for d in sorted(self.dst):
            cells = self.dst[d]
            missing = ~np.isfinite(cells.ready)
            if missing.any():
                everything = tuple(slice(0, n) for n in missing.shape)
                raise PlanError(f"destination device {d} never receives {cells.describe(everything, missing)} of its shard {format_region(cells.block)}")


def verify_plan(plan: Plan) -> VerifyReport:
    """Raise PlanError at the first violation; return a short report when the plan is correct."""
    _check_records(plan)
    _check_boxes(plan)
    replay = _Replay(plan)
    for op in plan.operations:  # in execution order, checked above
        replay.run(op)
    replay.finish()
    cells = sum(c.ready.size for c in replay.dst.values())
    return VerifyReport(len(plan.operations), len(replay.dst), cells)
