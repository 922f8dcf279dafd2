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
        return f"ok: {self.operations} operations replayed, {self.devices_checked} destination devices hold exactly their shards ({self.cells} cells)"


class _Grid:
    """Cut points per dim, and box -> numpy index of the cells it covers."""

    def __init__(self, shape: tuple[int, ...], boxes: list[Region]):
        self.cuts = [np.unique(np.array([0, n] + [b[d][i] for b in boxes for i in (0, 1)], dtype=np.int64)) for d, n in enumerate(shape)]
        self.shape = tuple(max(len(c) - 1, 0) for c in self.cuts)

    def index(self, box: Region) -> tuple[slice, ...]:
        return tuple(slice(int(np.searchsorted(c, lo)), int(np.searchsorted(c, hi))) for c, (lo, hi) in zip(self.cuts, box))


def _boxes(plan: Plan) -> list[Region]:
    out = list(plan.problem.blocks("src").values()) + list(plan.problem.blocks("dst").values())
    for op in plan.operations:
        out.append(op.region)
        out.extend(op.parts)
    return out


def _describe(grid: _Grid, mask: np.ndarray) -> str:
    """The box of the first offending cell, in global coordinates."""
    first = np.argwhere(mask)[0]
    return format_region(tuple((int(c[i]), int(c[i + 1])) for c, i in zip(grid.cuts, first)))


def _check_boxes(plan: Plan) -> None:
    """Every region and part must have one [start, stop) per tensor dim with 0 <= start <= stop <= length."""
    shape = plan.problem.shape
    for op in plan.operations:
        for what, box in [("region", op.region)] + [("part", p) for p in op.parts]:
            if len(box) != len(shape) or any(not (0 <= a <= b <= n) for (a, b), n in zip(box, shape)):
                raise PlanError(f"operation {op.id} (task {op.task}, {op.kind}): {what} {format_region(box)} "
                                f"is not a box inside the tensor {list(shape)}")


def verify_plan(plan: Plan) -> VerifyReport:
    """Raise PlanError at the first violation; return a short report when the plan is correct."""
    problem = plan.problem
    _check_boxes(plan)
    src_blocks, dst_blocks = problem.blocks("src"), problem.blocks("dst")
    grid = _Grid(tuple(problem.shape), _boxes(plan))
    never = np.inf
    source_ready = {d: np.full(grid.shape, never) for d in src_blocks}
    for d, box in src_blocks.items():
        source_ready[d][grid.index(box)] = 0.0
    dest_ready = {d: np.full(grid.shape, never) for d in dst_blocks}
    required = {d: np.zeros(grid.shape, dtype=bool) for d in dst_blocks}
    for d, box in dst_blocks.items():
        required[d][grid.index(box)] = True

    def fail(op, message: str) -> None:
        raise PlanError(f"operation {op.id} (task {op.task}, {op.kind}): {message}")

    def check_source(op, device: int, box: Region, table: dict[int, np.ndarray], what: str) -> None:
        if device not in table:
            fail(op, f"device {device} is not in the {what} mesh, so it holds nothing to send")
        ready = table[device][grid.index(box)]
        late = ready > op.start_s + TOLERANCE_S
        if late.any():
            sub = np.zeros(grid.shape, dtype=bool)
            sub[grid.index(box)] = late
            fail(op, f"device {device} sends {_describe(grid, sub)} which it does not hold at {op.start_s:.6f}s")

    def deliver(op, device: int, box: Region) -> None:
        if device not in dest_ready:
            fail(op, f"device {device} receives {format_region(box)} but is not in the destination mesh")
        idx = grid.index(box)
        extra = ~required[device][idx]
        twice = np.isfinite(dest_ready[device][idx])
        for mask, what in ((extra, "outside its destination shard"), (twice, "a second time")):
            if mask.any():
                sub = np.zeros(grid.shape, dtype=bool)
                sub[idx] = mask
                fail(op, f"device {device} receives {_describe(grid, sub)} {what}")
        dest_ready[device][idx] = op.end_s

    for op in sorted(plan.operations, key=lambda o: (o.start_s, o.id)):
        if op.end_s + TOLERANCE_S < op.start_s:
            fail(op, f"ends at {op.end_s}s before it starts at {op.start_s}s")
        if op.kind in ("copy", "send", "broadcast"):
            check_source(op, op.src, op.region, source_ready, "source")
            if op.kind == "copy" and op.dsts != (op.src,):
                fail(op, f"a copy must stay on device {op.src}, but names {list(op.dsts)}")
            if op.kind == "send" and len(op.dsts) != 1:
                fail(op, f"a send has exactly one receiver, got {list(op.dsts)}")
            for d in op.dsts:
                deliver(op, d, op.region)
        elif op.kind == "allgather":
            if len(op.parts) != len(op.dsts):
                fail(op, f"{len(op.dsts)} members but {len(op.parts)} parts")
            for d, part in zip(op.dsts, op.parts):
                if any(a < r0 or b > r1 for (a, b), (r0, r1) in zip(part, op.region)) and any(a < b for a, b in part):
                    fail(op, f"part {format_region(part)} of device {d} lies outside {format_region(op.region)}")
                check_source(op, d, part, dest_ready, "destination")
            covered = np.zeros(grid.shape, dtype=bool)
            for part in op.parts:
                covered[grid.index(part)] = True
            missing = ~covered[grid.index(op.region)]
            if missing.any():
                sub = np.zeros(grid.shape, dtype=bool)
                sub[grid.index(op.region)] = missing
                fail(op, f"no member contributes {_describe(grid, sub)}")
            for d, part in zip(op.dsts, op.parts):
                keep = dest_ready[d].copy()
                dest_ready[d][grid.index(part)] = np.inf  # a member's own part is not received again
                deliver(op, d, op.region)
                own = grid.index(part)
                dest_ready[d][own] = keep[own]
        else:
            fail(op, f"unknown operation kind {op.kind!r}")

    for d in sorted(dst_blocks):
        missing = required[d] & ~np.isfinite(dest_ready[d])
        if missing.any():
            raise PlanError(f"destination device {d} never receives {_describe(grid, missing)} of its shard {format_region(dst_blocks[d])}")
    return VerifyReport(len(plan.operations), len(dst_blocks), int(np.prod(grid.shape)))
