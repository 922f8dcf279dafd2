"""The verifier's replay for plans of 10^5-10^6 operations: every destination cell's writers counted at once.

`planner.verify` replays a single-tensor plan operation by operation, a few numpy calls each, and stops at the first
fault with its message. Here the same proof is made with whole-array interval arithmetic, for every tensor of a plan
at once. Each tensor's grid is cut at every box boundary of its problem and its operations (the operation-by-operation
replay's grid); a destination device's cells are those of the grid inside its block, and every (tensor, device)'s
cells are laid out one grid after another in one flat array. Each write (a receiver gets a box, less the part an
all-gather member already holds) is turned into the flat cells it covers (its boxes' cut positions found by one
sorted search per dim, keyed by tensor), and the cells are counted (`np.bincount`), once as writes (-1 for a part
taken back) and, where some operation reads a destination shard, once as the position of the operation that wrote
them. The cells enumerated are bounded by the grid's: a plan that writes more is refused before they are made.
The replay passes exactly when

- every destination cell is written exactly once (no cell twice, none missing: the count is 1 everywhere), and
- every cell an operation reads from a destination shard (an all-gather member's own part) was written by an
  operation listed before it that ended by its start (within `TOLERANCE_S`).

`replay_summary` answers (cells, devices) for such a plan and None otherwise; the caller then replays the plan
operation by operation, which finds the same fault and says it in its own words, so every verdict and message stays
the operation-by-operation replay's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.op_kinds import reads, writes
from xmesh_plan.schemas.plan_check import TOLERANCE_S
from xmesh_plan.schemas.plan_check_arrays import sorted_unique

_SHIFT = 32  # a cut is keyed (tensor << 32) + coordinate: one sorted array per dim holds every tensor's cuts


@dataclass(frozen=True)
class Boxes:
    """Boxes of the plan's tensors, one row each: its tensor and [lo, hi) per dim, padded to `rank` dims with [0, 1)
    (a tensor of fewer dims has one cell along the others). Every box of the plan's operations is among them, so
    each tensor's grid is cut where the operation-by-operation replay cuts it."""

    tensor: np.ndarray
    lo: np.ndarray  # (boxes, rank)
    hi: np.ndarray

    @classmethod
    def of(cls, tensors: list[int], boxes: list, rank: int) -> "Boxes":
        """From regions (tuples of (start, stop) per dim, any number of dims up to `rank`)."""
        lo, hi = np.zeros((len(boxes), rank), np.int64), np.ones((len(boxes), rank), np.int64)
        for k, box in enumerate(boxes):
            for d, (a, b) in enumerate(box):
                lo[k, d], hi[k, d] = a, b
        return cls(np.array(tensors, dtype=np.int64), lo, hi)

    @staticmethod
    def joined(parts: list["Boxes"]) -> "Boxes":
        return Boxes(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("tensor", "lo", "hi")))


@dataclass(frozen=True)
class Writes:
    """What lands in destination shards, one row per (receiver, box): the box (a row of `Boxes`), the device, weight 1,
    or -1 for the part an all-gather member already holds, and the position (in the plan's operation list) of the
    operation that writes it."""

    box: np.ndarray
    device: np.ndarray
    weight: np.ndarray
    writer: np.ndarray


def replay_summary(plan: Plan) -> tuple[int, set[int]] | None:
    """(destination cells, destination devices) of a single-tensor plan that `check_plan` passed, when its replay
    passes; None when it may not (the caller replays it operation by operation for the verdict and the message)."""
    boxes, box, device, weight, writer, dst_reads = [], [], [], [], [], []
    for i, op in enumerate(plan.operations):
        boxes.append(op.region)
        boxes.extend(op.parts)
        for d, written, own in writes(op):
            for piece, sign in [(written, 1)] + ([(own, -1)] if own is not None and all(a < b for a, b in own) else []):
                box.append(len(boxes)), boxes.append(piece), device.append(d), weight.append(sign), writer.append(i)
        for d, shard, read in reads(op):
            if shard == "dst" and all(a < b for a, b in read):
                dst_reads.append((i, d, len(boxes)))
                boxes.append(read)
    rank = len(plan.problem.shape)
    written = Writes(*(np.array(v, dtype=np.int64) for v in (box, device, weight, writer)))
    times = np.array([(op.start_s, op.end_s) for op in plan.operations], dtype=np.float64).reshape(-1, 2)
    return painted_summary([plan.problem], Boxes.of([0] * len(boxes), boxes, rank), written, dst_reads, times[:, 0], times[:, 1])


def _layouts(problems: list) -> tuple[list[tuple], np.ndarray]:
    """(each distinct (shape, source and destination placement) once, the one of each tensor)."""
    keys: dict[tuple, int] = {}
    of = [keys.setdefault((tuple(p.shape), p.src, p.dst), len(keys)) for p in problems]
    return list(keys), np.array(of, dtype=np.int64)


def _block_rows(problems: list, side: str, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(tensor, device, lo, hi) of every device's block of every tensor on `side`, padded to `rank` dims, tensors in
    order and each tensor's devices ascending (made once per layout and repeated for its tensors)."""
    layouts, of = _layouts(problems)
    tables = []
    for index in range(len(layouts)):
        blocks = problems[int(np.flatnonzero(of == index)[0])].blocks(side)
        devices = sorted(blocks)
        table = Boxes.of([0] * len(devices), [blocks[d] for d in devices], rank)
        tables.append((np.array(devices, dtype=np.int64), table.lo, table.hi))
    counts = np.array([len(tables[k][0]) for k in of.tolist()], dtype=np.int64)
    pick = [tables[k] for k in of.tolist()]
    empty = np.zeros((0, rank), np.int64)
    return (np.repeat(np.arange(len(problems)), counts), np.concatenate([t[0] for t in pick] or [np.zeros(0, np.int64)]),
            np.concatenate([t[1] for t in pick] or [empty]), np.concatenate([t[2] for t in pick] or [empty]))


def _cuts(problems: list, boxes: Boxes, rank: int) -> list[np.ndarray] | None:
    """Per dim, every tensor's cuts keyed (tensor << 32) + coordinate, sorted: the ends of the tensor, of each
    device's blocks and of the boxes. None where a coordinate does not fit the key (the caller declines)."""
    shapes = np.ones((len(problems), rank), np.int64)
    for t, p in enumerate(problems):
        shapes[t, :len(p.shape)] = p.shape
    every = np.arange(len(problems))
    tensors, points = [every, every, boxes.tensor, boxes.tensor], [np.zeros_like(shapes), shapes, boxes.lo, boxes.hi]
    for side in ("src", "dst"):
        t, _, lo, hi = _block_rows(problems, side, rank)
        tensors += [t, t]
        points += [lo, hi]
    coordinates = np.concatenate(points)
    if coordinates.size and (coordinates.min() < 0 or coordinates.max() >= 2**_SHIFT):
        return None
    keys = np.concatenate(tensors) << _SHIFT
    return [sorted_unique(keys + coordinates[:, d]) for d in range(rank)]


def _at(cuts: list[np.ndarray], tensor: np.ndarray, points: np.ndarray) -> list[np.ndarray]:
    """Per dim, the position of each point (a cut of its tensor) in its tensor's cuts, counted from the first tensor's."""
    keyed = tensor << _SHIFT
    return [np.searchsorted(c, keyed + points[:, d]) for d, c in enumerate(cuts)]


def _cells(grid: "_Grids", pair: np.ndarray, lo: list[np.ndarray], hi: list[np.ndarray], limit: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(the cells of each box in the flat array of every grid, box after box; how many each box has) of the boxes
    [lo, hi) (per dim, positions in their tensor's cuts) on the grids `pair`; None where a box is empty, leaves its
    grid, or the cells are more than `limit` in all. Dim by dim on 1-D arrays (gathers of rows are slower)."""
    corner, sizes, extents = grid.origin[pair].copy(), np.ones(len(pair), np.int64), []
    for d in range(len(lo)):
        if not ((grid.first[d][pair] <= lo[d]) & (lo[d] < hi[d]) & (hi[d] <= grid.last[d][pair])).all():
            return None
        extents.append(hi[d] - lo[d])
        sizes *= extents[-1]
        corner += lo[d] * grid.strides[d][pair]
    total = int(sizes.sum())
    if total > limit:
        return None
    if total == len(sizes):  # one cell each: a bundle's parts, mostly
        return corner, sizes
    box = np.repeat(np.arange(len(sizes)), sizes)
    step = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(sizes) - sizes, sizes)  # the cell's place in its box
    cell = corner[box]
    for d in range(len(lo) - 1, -1, -1):  # the last dim varies fastest
        size = extents[d][box]
        cell += step % size * grid.strides[d][pair][box]
        step //= size
    return cell, sizes


def painted_summary(problems: list, boxes: Boxes, written: Writes, dst_reads: list, starts: np.ndarray,
                    ends: np.ndarray) -> tuple[int, set[int]] | None:
    """`replay_summary` for every tensor of a plan at once, from arrays: its tensors' problems (`problems`), every box
    of their operations (`boxes`, for the grids), what they write (`written`: boxes of `boxes`), what they read from
    destination shards ((position, device, box of `boxes`)) and the operations' start and end times, by position."""
    rank = boxes.lo.shape[1]
    cuts = _cuts(problems, boxes, rank)
    if cuts is None:
        return None
    tensor, device, lo, hi = _block_rows(problems, "dst", rank)
    grid = _Grids.of(tensor, device, _at(cuts, tensor, lo), _at(cuts, tensor, hi))
    pair = grid.pair(boxes.tensor[written.box], written.device)
    if pair is None:
        return None
    at = [c[written.box] for c in _at(cuts, boxes.tensor, boxes.lo)], [c[written.box] for c in _at(cuts, boxes.tensor, boxes.hi)]
    taken = written.weight < 0  # cells taken back (all-gather members' own parts): as many more may be written
    landed = _cells(grid, pair, *at, grid.cells + 2 * grid.cells * int(taken.any()))
    if landed is None:
        return None
    cells, counts = landed
    if taken.any() and int(counts.sum()) > grid.cells + 2 * int(counts[taken].sum()):  # more: some cell is written twice
        return None
    painted = np.bincount(cells, weights=np.repeat(written.weight, counts) if taken.any() else None, minlength=grid.cells)
    if not (painted == 1).all():
        return None
    if dst_reads:
        who = np.rint(np.bincount(cells, weights=np.repeat(written.weight * (written.writer + 1), counts), minlength=grid.cells)).astype(np.int64) - 1
        if not _reads_hold(dst_reads, boxes, cuts, grid, who, starts, ends):
            return None
    return grid.cells, set(device.tolist())


@dataclass(frozen=True)
class _Grids:
    """Each (tensor, destination device)'s grid, sorted by tensor, then device; per dim its first and last cut (positions
    in the tensor's cuts) and its stride in the flat array of every grid's cells, grid after grid, row major; where
    its cell 0 would be, counted from its first cuts (`origin`); the cells of all."""

    tensor: np.ndarray
    device: np.ndarray
    first: list[np.ndarray]
    last: list[np.ndarray]
    strides: list[np.ndarray]
    origin: np.ndarray
    cells: int

    @classmethod
    def of(cls, tensor: np.ndarray, device: np.ndarray, first: list[np.ndarray], last: list[np.ndarray]) -> "_Grids":
        shape = [b - a for a, b in zip(first, last)]
        sizes = np.prod(np.stack(shape, axis=1), axis=1, dtype=np.int64) if shape else np.ones(len(tensor), np.int64)
        strides = [np.ones(len(tensor), np.int64) for _ in shape]
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        origin = np.cumsum(sizes) - sizes - sum((f * s for f, s in zip(first, strides)), np.zeros(len(tensor), np.int64))
        return cls(tensor, device, first, last, strides, origin, int(sizes.sum()))

    def pair(self, tensor: np.ndarray, device: np.ndarray) -> np.ndarray | None:
        """The grid of each (tensor, device); None where a device is no destination of its tensor."""
        if not len(tensor):
            return np.zeros(0, np.int64)
        if not len(self.tensor) or tensor.min() < 0 or tensor.max() > self.tensor.max():
            return None
        # keys (tensor, the device's rank among all devices), ascending as the grids are: sized by the grids, not the ids
        ids = np.unique(self.device)
        rank = np.searchsorted(ids, device)
        if not (ids[np.minimum(rank, len(ids) - 1)] == device).all():
            return None
        keys = self.tensor * len(ids) + np.searchsorted(ids, self.device)
        wanted = tensor * len(ids) + rank
        at = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
        return at if (keys[at] == wanted).all() else None


def _reads_hold(dst_reads: list, boxes: Boxes, cuts: list[np.ndarray], grid: _Grids, who: np.ndarray,
                starts: np.ndarray, ends: np.ndarray) -> bool:
    """Every read (position, device, box) finds each of its cells written (`who`: the writer of each cell) by an
    earlier operation that ended by its start."""
    reader = np.array([i for i, _, _ in dst_reads], dtype=np.int64)
    rows = np.array([b for _, _, b in dst_reads], dtype=np.int64)
    pair = grid.pair(boxes.tensor[rows], np.array([d for _, d, _ in dst_reads], dtype=np.int64))
    if pair is None:
        return False
    read = _cells(grid, pair, _at(cuts, boxes.tensor[rows], boxes.lo[rows]), _at(cuts, boxes.tensor[rows], boxes.hi[rows]), len(who) * len(rows))
    if read is None:
        return False
    held, i = who[read[0]], np.repeat(reader, read[1])
    return bool(((held >= 0) & (held < i)).all() and (ends[np.maximum(held, 0)] <= starts[i] + TOLERANCE_S).all())
