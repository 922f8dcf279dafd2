"""The verifier's replay for plans of 10^5-10^6 operations: every destination cell's writers counted at once.

`planner.verify` replays a single-tensor plan operation by operation, a few numpy calls each, and stops at the first
fault with its message. Here the same proof is made with whole-array interval arithmetic: each write (a receiver
gets a box, less the part an all-gather member already holds) is painted onto its device's cell grid through a
difference array (+1 at one corner of the box, -1 at the next, ..., then a running sum along every axis), once as
a count and once as the index of the operation that wrote it. The replay passes exactly when

- every destination cell is written exactly once (no cell twice, none missing: the count is 1 everywhere), and
- every cell an operation reads from a destination shard (an all-gather member's own part) was written by an
  operation listed before it that ended by its start (within `TOLERANCE_S`).

`replay_summary` answers (cells, devices) for such a plan and None otherwise; the caller then replays the plan
operation by operation, which finds the same fault and says it in its own words, so every verdict and message stays
the operation-by-operation replay's.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.op_kinds import reads, writes
from xmesh_plan.schemas.plan_check import TOLERANCE_S
from xmesh_plan.schemas.plan_check_arrays import sorted_unique


def _boxes(boxes: list, ndim: int) -> np.ndarray:
    """Boxes as an (n, ndim, 2) int64 array of [start, stop) per dim."""
    return np.array(boxes, dtype=np.int64).reshape(len(boxes), ndim, 2)


def _cuts(problem, ndim: int, boxes: np.ndarray) -> list[np.ndarray]:
    """Every box boundary of the problem and the plan per dim (the operation-by-operation replay's grid)."""
    blocks = list(problem.blocks("src").values()) + list(problem.blocks("dst").values())
    fixed = _boxes(blocks, ndim) if blocks else np.zeros((0, ndim, 2), dtype=np.int64)
    return [sorted_unique(np.concatenate(([0, n], fixed[:, d, :].ravel(), boxes[:, d, :].ravel()))) for d, n in enumerate(problem.shape)]


def _paint(grid: tuple[int, ...], lo: np.ndarray, hi: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Sum of `weights[k]` over the cells of box k ([lo[k], hi[k]) in cell indices), for every cell of `grid`."""
    ndim = len(grid)
    padded = tuple(g + 1 for g in grid)
    total = np.zeros(int(np.prod(padded, dtype=np.int64)), dtype=np.int64)
    for corner in itertools.product((0, 1), repeat=ndim):
        at = tuple(np.where(c, hi[:, d], lo[:, d]) for d, c in enumerate(corner))
        sign = -1 if sum(corner) % 2 else 1
        total += np.bincount(np.ravel_multi_index(at, padded), weights=sign * weights, minlength=total.size).round().astype(np.int64)
    painted = total.reshape(padded)
    for axis in range(ndim):
        painted = np.cumsum(painted, axis=axis)
    return painted[tuple(slice(0, g) for g in grid)]


def replay_summary(plan: Plan) -> tuple[int, set[int]] | None:
    """(destination cells, destination devices) of a single-tensor plan that `check_plan` passed, when its replay
    passes; None when it may not (the caller replays it operation by operation for the verdict and the message)."""
    ndim = len(plan.problem.shape)
    device, box, weight, writer, cut_boxes, dst_reads = [], [], [], [], [], []
    for i, op in enumerate(plan.operations):
        cut_boxes.append(op.region)
        cut_boxes.extend(op.parts)
        for d, written, own in writes(op):
            device.append(d), box.append(written), weight.append(1), writer.append(i)
            if own is not None and all(a < b for a, b in own):
                device.append(d), box.append(own), weight.append(-1), writer.append(i)
        dst_reads.extend((i, d, read) for d, shard, read in reads(op) if shard == "dst" and all(a < b for a, b in read))
    times = np.array([(op.start_s, op.end_s) for op in plan.operations], dtype=np.float64).reshape(-1, 2)
    return painted_summary(plan.problem, _boxes(cut_boxes, ndim), Writes(np.array(device, dtype=np.int64), _boxes(box, ndim),
                                                                          np.array(weight, dtype=np.int64), np.array(writer, dtype=np.int64)),
                           dst_reads, times[:, 0], times[:, 1])


@dataclass(frozen=True)
class Writes:
    """What lands in destination shards, one row per (receiver, box): weight 1, or -1 for the part an all-gather
    member already holds, and the position (in the tensor's operation list) of the operation that writes it."""

    device: np.ndarray
    box: np.ndarray  # (rows, ndim, 2)
    weight: np.ndarray
    writer: np.ndarray


def painted_summary(problem, cut_boxes: np.ndarray, written: Writes, dst_reads: list, starts: np.ndarray,
                    ends: np.ndarray) -> tuple[int, set[int]] | None:
    """`replay_summary` for one tensor's `problem` from arrays: every box of its operations (`cut_boxes`, for the
    grid), what they write, what they read from destination shards ((position, device, box)) and their times."""
    ndim = len(problem.shape)
    cuts = _cuts(problem, ndim, cut_boxes)
    blocks = problem.blocks("dst")
    device, boxes, weight, writer = written.device, written.box, written.weight, written.writer
    if not set(sorted_unique(device).tolist()) <= set(blocks):
        return None
    writers: dict[int, tuple[list[np.ndarray], np.ndarray]] = {}
    cells = 0
    for d, block in blocks.items():
        local = [c[(c >= lo) & (c <= hi)] for c, (lo, hi) in zip(cuts, block)]
        grid = tuple(max(len(c) - 1, 0) for c in local)
        cells += int(np.prod(grid, dtype=np.int64))
        mine = np.flatnonzero(device == d)
        if 0 in grid:
            if len(mine):
                return None
            continue
        lo = np.stack([np.searchsorted(local[k], boxes[mine, k, 0]) for k in range(ndim)], axis=1) if len(mine) else np.zeros((0, ndim), np.int64)
        hi = np.stack([np.searchsorted(local[k], boxes[mine, k, 1]) for k in range(ndim)], axis=1) if len(mine) else np.zeros((0, ndim), np.int64)
        if not (_paint(grid, lo, hi, weight[mine].astype(np.float64)) == 1).all():
            return None
        if dst_reads:
            writers[d] = (local, _paint(grid, lo, hi, (weight[mine] * (writer[mine] + 1)).astype(np.float64)) - 1)
    for i, d, read in dst_reads:
        local, who = writers.get(d, (None, None))
        if who is None:
            return None
        held = who[tuple(slice(int(np.searchsorted(c, a)), int(np.searchsorted(c, b))) for c, (a, b) in zip(local, read))]
        if (held >= i).any() or (held < 0).any() or (ends[held] > starts[i] + TOLERANCE_S).any():
            return None
    return cells, set(blocks)
