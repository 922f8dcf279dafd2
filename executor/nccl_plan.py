"""The NCCL calls one device makes, read off its lowered program: local copies and broadcasts on group communicators.

NCCL runs every call of a rank on one CUDA stream in plan order, so each operation becomes calls on
one communicator per distinct member set: a send is a broadcast in a group of two, a broadcast is
one call per planned chunk, an all-gather is one broadcast per non-empty part (uneven parts work).
A bundle is its route's messages, each a broadcast in a group of two over staging (`lower.StagedCall`:
the gathers, the cross-host message, the scatters), with packs and unpacks around them.
Because every rank issues its calls in the same global order, no two ranks wait on each other in a
cycle. NCCL picks its own ring inside a group, so the plan's chain order is not enforced here.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .lower import Box, RankProgram, StagedCall

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
    destination shard. A box that is not one contiguous run travels through staging at `stage` (always
    0: the stream runs one call after another, so every call reuses the same staging bytes).
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
    actions: tuple[Copy | Bcast | StagedCall, ...]
    groups: tuple[Group, ...]
    stage_bytes: int


def communicator_groups(program: RankProgram) -> tuple[Group, ...]:
    """The groups this device is in, in order of first use: every member of a group takes part in each
    of its operations, so any two ranks meet their shared groups in the same order."""
    seen: dict[Group, None] = {}
    for call in program.collectives:
        if len(call.group) > 1:  # a bundle's packs and unpacks have no group
            seen.setdefault(call.group, None)
    return tuple(seen)


def split_calls(ranges, itemsize: int, limit: int | None = None) -> list[tuple[int, int]]:
    """Cut byte ranges into pieces of at most `limit` bytes (MAX_CALL_BYTES), on element boundaries.

    >>> split_calls([(0, 10), (10, 12)], 2, limit=4)
    [(0, 4), (4, 8), (8, 10), (10, 12)]
    """
    limit = MAX_CALL_BYTES if limit is None else limit
    step = max(itemsize, limit - limit % itemsize)
    return [(a, min(a + step, hi)) for lo, hi in ranges for a in range(lo, hi, step)]


def nccl_program(program: RankProgram) -> NcclProgram:
    """The calls `program.device` makes, in plan order, from the lowered program's collectives. One CUDA
    stream runs them one after another (pack, broadcast, unpack), so staging is the largest staged box,
    never more than the program's own staging in either order."""
    actions: list[Copy | Bcast | StagedCall] = []
    stage = 0  # the largest staged box, or a bundle's staging on this device
    for call in program.collectives:
        if isinstance(call, StagedCall):  # a bundle: packs, broadcasts in groups of two and unpacks over staging
            if call.action == "bcast":
                for lo, hi in split_calls([(call.start, call.stop)], 1):
                    actions.append(replace(call, start=lo, stop=hi))
            else:
                actions.append(call)
            stage = max(stage, call.stop)
            continue
        if call.target is not None:
            actions.append(Copy(call.op, call.box, call.target))
            continue
        at = None
        if call.box.span is None:
            at, stage = 0, max(stage, call.box.nbytes)
        ranges = tuple(split_calls(call.chunks, program.itemsize))
        actions.append(Bcast(call.op, call.task, call.kind, program.device, call.group, call.root, call.box, ranges, at))
    return NcclProgram(program.device, tuple(actions), communicator_groups(program), stage)
