"""Lower a plan to the NCCL calls one device makes: local copies and broadcasts on group communicators.

NCCL runs every call of a rank on one CUDA stream in plan order, so each operation becomes calls on
one communicator per distinct member set: a send is a broadcast in a group of two, a broadcast is
one call per planned chunk, an all-gather is one broadcast per non-empty part (uneven parts work).
Because every rank issues its calls in the same global order, no two ranks wait on each other in a
cycle. NCCL picks its own ring inside a group, so the plan's chain order is not enforced here.
"""

from __future__ import annotations

from dataclasses import dataclass

from schemas import Operation, Plan

from .lower import Box, chunk_ranges, is_empty, make_box

MAX_CALL_BYTES = 1 << 30
"""Largest byte count of one NCCL call: CuPy before v13 declares `bcast(..., int count, ...)`, so a
call over 2**31 - 1 bytes would overflow there; longer chunks become several calls (same on every rank)."""

Group = tuple[int, ...]
"""Sorted device ids of a communicator; a device's NCCL rank in it is its index."""


@dataclass(frozen=True, slots=True)
class Copy:
    """Copy `source` (in the source shard) to `target` (in the destination shard) on the same GPU."""

    op: int
    source: Box
    target: Box


@dataclass(frozen=True, slots=True)
class Bcast:
    """Broadcast `box` from `root` to the rest of `group`, one call per byte range in `chunks`.

    `box` lies in this device's source shard when it is the root of a send or broadcast, else in its
    destination shard. A box that is not one contiguous run travels through staging at `stage`.
    """

    op: int
    task: int
    kind: str
    device: int
    group: Group
    root: int
    box: Box
    chunks: tuple[tuple[int, int], ...]
    stage: int | None

    @property
    def is_root(self) -> bool:
        return self.root == self.device

    def describe(self) -> str:
        return f"op {self.op} (task {self.task}, {self.kind}) in group {list(self.group)} from device {self.root}"


@dataclass(frozen=True, slots=True)
class NcclProgram:
    device: int
    actions: tuple[Copy | Bcast, ...]
    groups: tuple[Group, ...]
    stage_bytes: int


def group_of(op: Operation) -> Group | None:
    """The member set an operation runs on; None for a local copy."""
    if op.kind == "copy":
        return None
    members = op.dsts if op.kind == "allgather" else (op.src, *op.dsts)
    return tuple(sorted(members))


def communicator_groups(plan: Plan) -> tuple[Group, ...]:
    """Every distinct group in order of first use; all ranks create communicators in this order."""
    seen: dict[Group, None] = {}
    for op in plan.operations:
        group = group_of(op)
        if group is not None and len(group) > 1:
            seen.setdefault(group, None)
    return tuple(seen)


def split_calls(ranges, itemsize: int, limit: int | None = None) -> list[tuple[int, int]]:
    """Cut byte ranges into pieces of at most `limit` bytes (MAX_CALL_BYTES), on element boundaries.

    >>> split_calls([(0, 10), (10, 12)], 2, limit=4)
    [(0, 4), (4, 8), (8, 10), (10, 12)]
    """
    limit = MAX_CALL_BYTES if limit is None else limit
    step = max(itemsize, limit - limit % itemsize)
    return [(a, min(a + step, hi)) for lo, hi in ranges for a in range(lo, hi, step)]


def nccl_program(plan: Plan, device: int) -> NcclProgram:
    """The calls `device` makes, in plan order (run `lower()` first: it validates the plan)."""
    problem = plan.problem
    src_blocks, dst_blocks, size = problem.blocks("src"), problem.blocks("dst"), problem.itemsize
    actions: list[Copy | Bcast] = []
    stage = 0

    def bcast(op: Operation, root: int, box: Box, chunks: int) -> None:
        nonlocal stage
        if len(group_of(op)) < 2:  # nobody to send to: the bytes are already where they belong
            return
        ranges = tuple(split_calls(chunk_ranges(box.nbytes, chunks, size), size))
        at = None
        if box.span is None:
            at, stage = stage, stage + box.nbytes
        actions.append(Bcast(op.id, op.task, op.kind, device, group_of(op), root, box, ranges, at))

    for op in plan.operations:
        if op.kind == "copy":
            if op.src == device:
                actions.append(Copy(op.id, make_box("src", op.region, src_blocks[device], size),
                                    make_box("dst", op.region, dst_blocks[device], size)))
        elif op.kind in ("send", "broadcast"):
            if device == op.src:
                bcast(op, op.src, make_box("src", op.region, src_blocks[device], size), op.chunks)
            elif device in op.dsts:
                bcast(op, op.src, make_box("dst", op.region, dst_blocks[device], size), op.chunks)
        elif device in op.dsts:
            for member, part in zip(op.dsts, op.parts):
                if not is_empty(part):
                    bcast(op, member, make_box("dst", part, dst_blocks[device], size), 1)
    return NcclProgram(device, tuple(actions), communicator_groups(plan), stage)

