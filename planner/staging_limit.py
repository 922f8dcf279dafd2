"""`compile --max-staging-mb`: no device needs more staging than a limit, in the executor's device order and posted
within a window of the limit (`executor/window.py`, where every operation staging at most the limit is what bounds it).

An operation stages on a device every box that is not one contiguous run of that device's shard
(`schemas.staging`). Where an operation would stage more than the limit on some device, it is cut
into operations over consecutive sub-boxes of at most the limit (slabs along the outermost dim that
needs cutting, in C order), each with the same devices, its share of the chunks and of the time; a
bundle's bucket is capped by the limit instead (`compile_plan`). In device order a run of operations
then also ends before it would stage more than the limit (`schemas.staging.device_runs`), so each
device's peak is at most the limit. In a multi-tensor problem each operation is cut in its own
tensor's elements, and device order runs every tensor's operations in one staging area per device,
so the limit holds across tensors too. A limit below one element (of the tensor with the largest
elements) cannot be met, and one so small that the plan would exceed `max_operations` operations is
refused: both errors name the smallest limit that works.

>>> split_box(((0, 4), (0, 6)), max_elements=12)
[((0, 2), (0, 6)), ((2, 4), (0, 6))]
>>> split_box(((0, 2), (0, 6)), max_elements=4)
[((0, 1), (0, 3)), ((0, 1), (3, 6)), ((1, 2), (0, 3)), ((1, 2), (3, 6))]
>>> mib_text(4), mib_text(3 * 2**20)
('0.000004', '3')
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from typing import Iterable, Sequence

from xmesh_plan.schemas import ReshardingProblem
from xmesh_plan.schemas.geometry import Region, region_shape, region_size
from xmesh_plan.schemas.op_kinds import chunk_bounds, rule_of
from xmesh_plan.schemas.plan_check import MAX_CHUNKS
from xmesh_plan.schemas.staging import aligned, shard_kinds, staged_on_members

from .problem_io import InputError
from .strategies import PlannedOp

MIB = 2**20
TimedOp = tuple[float, int, int | None, PlannedOp]  # (start, task, tensor index, operation), as `compile.assemble_joint` lists them


class StagingLimitError(InputError):
    """A staging limit that cannot be met; the message names `--max-staging-mb` and the smallest value that works."""


def mib_text(nbytes: int) -> str:
    """The shortest `--max-staging-mb` value (at most 6 decimals) that gives at least `nbytes` bytes."""
    value = math.ceil(nbytes / MIB * 10**6) / 10**6
    while int(value * MIB) < nbytes:
        value += 1e-6
    return f"{value:.6f}".rstrip("0").rstrip(".")


def _cut(shape: tuple[int, ...], max_elements: int) -> tuple[int, int]:
    """(dim, slab rows): cut along the outermost dim whose inner rows fit, single indices before it."""
    for d in range(len(shape)):
        inner = math.prod(shape[d + 1:])
        if inner <= max_elements:
            return d, max_elements // inner
    raise ValueError("max_elements must be at least 1")


def piece_count(region: Region, max_elements: int) -> int:
    """How many sub-boxes `split_box` cuts `region` into."""
    shape = region_shape(region)
    if math.prod(shape) <= max_elements:
        return 1
    d, rows = _cut(shape, max_elements)
    return math.prod(shape[:d]) * -(-shape[d] // rows)


def split_box(region: Region, max_elements: int) -> list[Region]:
    """`region` as consecutive sub-boxes (C order) of at most `max_elements` each: even slabs along the
    outermost dim whose inner rows fit, single indices along the dims before it."""
    shape = region_shape(region)
    if math.prod(shape) <= max_elements:
        return [region]
    d, rows = _cut(shape, max_elements)
    start = region[d][0]
    slabs = [(start + lo, start + hi) for lo, hi in chunk_bounds(shape[d], -(-shape[d] // rows))]
    outer = itertools.product(*(range(a, b) for a, b in region[:d]))
    return [tuple((i, i + 1) for i in index) + (slab,) + region[d + 1:] for index in outer for slab in slabs]


def _clipped(part: Region, box: Region) -> Region:
    """`part` inside `box`: their overlap, or an empty box at its corner when they do not meet."""
    out = []
    for (a, b), (c, d) in zip(part, box):
        lo = max(a, c)
        out.append((lo, max(lo, min(b, d))))
    return tuple(out)


def split_op(op: PlannedOp, pieces: Sequence[Region]) -> list[PlannedOp]:
    """`op` over each piece in turn: the same devices, its parts clipped, its chunks and time shared by size."""
    total, offset, out = region_size(op.region), op.offset_s, []
    for piece in pieces:
        share, elements = region_size(piece) / total, region_size(piece)
        chunks = min(MAX_CHUNKS, elements, max(1, math.ceil(op.chunks * share))) if rule_of(op).chunked else 1
        parts = tuple(_clipped(p, piece) for p in op.parts)
        out.append(replace(op, region=piece, parts=parts, chunks=chunks, offset_s=offset, duration_s=op.duration_s * share))
        offset += op.duration_s * share
    return out


Shards = tuple[dict[int, Region], dict[int, Region], int]  # a tensor's source and destination boxes by device, and its element size


def shards_of(problems: Sequence[ReshardingProblem]) -> list[Shards]:
    """Each tensor's `Shards`, read once for all its operations."""
    return [(p.blocks("src"), p.blocks("dst"), p.itemsize) for p in problems]


class StagedOps:
    """`staged_on_members` of a compile's operations by tensor index, each distinct (operation, kind of tensor) counted
    once: tensors with the same shards and element size share their operation objects (`compile.renumbered`), so a
    model's repeated layers are counted once, not once a layer."""

    def __init__(self, problems: Sequence[ReshardingProblem]):
        self.shards = shards_of(problems)
        self.kind = shard_kinds(self.shards)
        self.memo: dict[tuple[int, int], tuple[PlannedOp, list[tuple[int, int]]]] = {}  # holds each op, so its id stays its own

    def __call__(self, op: PlannedOp, tensor: int | None) -> list[tuple[int, int]]:
        t = tensor or 0
        key = self.key(op, t)
        known = self.memo.get(key)
        if known is None:
            known = self.memo[key] = (op, staged_on_members(op, *self.shards[t]))
        return known[1]

    def key(self, op: PlannedOp, tensor: int) -> tuple:
        """What `op`'s staging depends on, for the memo: a bundle's relays and its parts, holders and needers by
        identity (`PlannedOp.sent` keeps them, so a message's bundles remade with new times or relays still share
        them), any other operation by identity; with the kind of `tensor`."""
        if op.kind == "bundle":
            return (id(op.parts), id(op.holders), id(op.needers), op.src, op.dsts[0], self.kind[tensor])
        return (id(op), self.kind[tensor])


def posted_staging(timed_ops: list[TimedOp], problems: Sequence[ReshardingProblem]) -> dict[int, int]:
    """Device -> the bytes it stages with every operation in flight at once (posted), each operation's bytes rounded up
    to the largest element size among `problems`, with the side areas a bundle's relays stage when it shares a message
    (`_side_areas`): at least what the executor's posted order allocates there (`schemas.staging.staging_peaks`, which
    lays shared messages' boxes out one after another at that alignment)."""
    align = max(p.itemsize for p in problems)
    staged = StagedOps(problems)
    counts: dict[tuple, int] = {}  # `StagedOps.key` -> how many operations stage so (a model's layers repeat them)
    first: dict[tuple, tuple[PlannedOp, int]] = {}  # ... and one of them with its tensor
    for _, _, tensor, op in timed_ops:
        t = tensor or 0
        key = staged.key(op, t)
        if key in counts:
            counts[key] += 1
        else:
            counts[key], first[key] = 1, (op, t)
    total: dict[int, int] = {}
    for key, count in counts.items():
        op, t = first[key]
        for d, nbytes in staged(op, t):
            if nbytes:
                total[d] = total.get(d, 0) + count * aligned(nbytes, align)
        if op.kind == "bundle":  # the bundle's relays and parts are in its key, and tensors of one kind share an itemsize
            for d, nbytes in _side_areas(op, problems[t].itemsize, align):
                total[d] = total.get(d, 0) + count * nbytes
    return total


def _side_areas(op: PlannedOp, itemsize: int, align: int) -> list[tuple[int, int]]:
    """(relay, bytes) of the side areas a bundle's relays stage when it shares a message (`carriers.group_staging`):
    the sending relay each other holder's parts, the receiving relay each other needer's, each area aligned."""
    held: dict[int, int] = {}
    needed: dict[int, int] = {}
    for part, holder, needers in zip(op.parts, op.holders, op.needers):
        nbytes = region_size(part) * itemsize
        if holder != op.src:
            held[holder] = held.get(holder, 0) + nbytes
        for d in needers:
            if d != op.dsts[0]:
                needed[d] = needed.get(d, 0) + nbytes
    return [(op.src, sum(aligned(n, align) for n in held.values())), (op.dsts[0], sum(aligned(n, align) for n in needed.values()))]


def busiest_posted(timed_ops: list[TimedOp], problems: Sequence[ReshardingProblem]) -> tuple[int, int] | None:
    """(device, bytes) of the device that stages most posted (`posted_staging`; the lowest id among equals), None where
    nothing is staged: what `xmesh-plan compile` reports of a plan given no limit."""
    total = posted_staging(timed_ops, problems)
    return max(sorted(total.items()), key=lambda item: item[1], default=None)


def _count(staging: Iterable[tuple[int, int, PlannedOp]], limit: int) -> int:
    """Operations after cutting every one that stages more than `limit`."""
    return sum(piece_count(op.region, limit // itemsize) if nbytes > limit else 1 for nbytes, itemsize, op in staging)


def smallest_limit(staging: list[tuple[int, int, PlannedOp]], itemsize: int, max_operations: int | None) -> int:
    """The smallest limit in bytes (at least `itemsize`, the largest element) that cuts into at most
    `max_operations` operations; each operation is cut in its own element size."""
    lo, hi = itemsize, max([nbytes for nbytes, _, _ in staging] + [itemsize])
    if max_operations is None:
        return itemsize
    while lo < hi:
        mid = (lo + hi) // 2
        if _count(staging, mid) <= max_operations:
            hi = mid
        else:
            lo = mid + 1
    return lo


def limit_staging(timed_ops: list[TimedOp], problems: Sequence[ReshardingProblem], limit_bytes: int,
                  max_operations: int | None) -> list[TimedOp]:
    """Every operation that would stage more than `limit_bytes` on a device, cut into operations that stage
    at most that (see the module docstring); StagingLimitError when the limit cannot be met. `problems[t]`
    is tensor t's problem (the one problem of a single-tensor plan, whose operations have tensor None)."""
    staged = StagedOps(problems)
    staging = [(max((n for _, n in staged(op, tensor)), default=0), problems[tensor or 0].itemsize, op)
               for _, _, tensor, op in timed_ops]
    if any(op.kind == "bundle" and nbytes > limit_bytes for nbytes, _, op in staging):
        raise ValueError("a bundle stages more than the staging limit; cap the bucket by it (compile_plan does)")
    widest = max(problems, key=lambda p: p.itemsize)  # the first tensor with the largest elements
    itemsize = widest.itemsize
    uncut = len(staging)  # no limit cuts the plan into fewer operations than it has uncut
    fits = max_operations is None or uncut <= max_operations
    if limit_bytes < itemsize:
        smallest = smallest_limit(staging, itemsize, max_operations) if fits else itemsize
        within = (f" (for at most --max-tasks {max_operations} operations)" if smallest > itemsize else "") if fits else \
            f" with --max-tasks {_count(staging, smallest)} (uncut, the plan has {uncut} operations, more than --max-tasks {max_operations})"
        tensor = f", tensor {widest.name!r}" if len(problems) > 1 else ""
        raise StagingLimitError(f"--max-staging-mb: {limit_bytes} B is below one {widest.dtype} element ({itemsize} B{tensor}), the "
                                f"smallest piece a staged box can be cut into; the smallest value that works is --max-staging-mb "
                                f"{mib_text(smallest)}{within}")
    count = _count(staging, limit_bytes)
    if max_operations is not None and count > max_operations:
        fix = f"the smallest value that works is --max-staging-mb {mib_text(smallest_limit(staging, itemsize, max_operations))} " \
            f"(or pass --max-tasks {count})" if fits else \
            f"no --max-staging-mb brings it within (uncut, the plan has {uncut} operations); pass --max-tasks {count}"
        raise StagingLimitError(f"--max-staging-mb: {limit_bytes} B would cut the plan into {count} operations, more than --max-tasks "
                                f"{max_operations}; {fix}")
    out: list[TimedOp] = []
    for (at, task, tensor, op), (nbytes, size, _) in zip(timed_ops, staging):
        if nbytes <= limit_bytes:
            out.append((at, task, tensor, op))
            continue
        for piece in split_op(op, split_box(op.region, limit_bytes // size)):
            out.append((at + piece.offset_s - op.offset_s, task, tensor, piece))
    return out
