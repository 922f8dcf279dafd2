"""The NCCL calls one device makes, read off its lowered program: local copies and broadcasts on group communicators.

NCCL runs every call of a rank on one CUDA stream in plan order, so each operation becomes calls on
one communicator per distinct member set: a send is a broadcast in a group of two, a broadcast is
one call per planned chunk, an all-gather is one broadcast per non-empty part (uneven parts work).
A bundle is its route's messages, each a broadcast in a group of two over staging (`lower.StagedCall`:
the gathers, the cross-host message, the scatters), with packs and unpacks around them; a shared message's
bundles are one such unit, one message per pair of devices, the relays moving pieces inside staging.
Because every rank issues its calls in the same global order, no two ranks wait on each other in a
cycle. NCCL picks its own ring inside a group, so the plan's chain order is not enforced here.

A plan converting with per-tensor FP8 scales (`executor.conversions`) first takes each such tensor's amax over its
senders: one all-reduce (max) per set of senders, before any call of the plan, the sets in order of their first
tensor on every device (`AmaxMax`), so these calls too come in one global order.
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
class AmaxMax:
    """The max over `group` (the senders of `tensors`) of each tensor's amax: one all-reduce of float32, element k the
    amax of `tensors[k]`, for its per-tensor FP8 scale. `op` is -1 - its first tensor, the same on every member (its
    communicator's id travels with that tag, `NcclEngine._communicators`), negative: it comes before every operation."""

    op: int
    group: Group
    tensors: tuple[int, ...]

    def describe(self) -> str:
        return f"the amax all-reduce of per-tensor FP8 scales (tensors {list(self.tensors)}) in group {list(self.group)}"


@dataclass(frozen=True, slots=True)
class NcclProgram:
    device: int
    actions: tuple[AmaxMax | Copy | Bcast | StagedCall, ...]
    groups: tuple[Group, ...]
    stage_bytes: int


def communicator_groups(calls) -> tuple[Group, ...]:
    """The groups a device's calls (a lowered program's collectives, or NCCL calls) use, in order of first
    use: every member of a group takes part in each of its operations, so any two ranks meet their shared
    groups in the same order."""
    seen: dict[Group, None] = {}
    for call in calls:
        if len(getattr(call, "group", ())) > 1:  # local copies, and a bundle's packs and unpacks, have no group
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
    """The calls `program.device` makes for every tensor, in the program's order of operations, from its
    collectives. One CUDA stream runs them one after another (pack, broadcast, unpack), so staging is the largest
    staged box or shared message. The bundles of one shared message (`program.carriers`, left by
    `passes.share_messages`; listed one after another in the plan) are one unit, lowered together
    (`lower._lower_group`): one broadcast in a group of two per holder and per needer, the cross-host message, and
    the relays' moves between the message and their side areas (copies inside staging on the stream), in the
    steps' order. Every device walks units in plan order, and a unit's calls in that one order, so no two devices
    wait on each other in a cycle: a group's holders are all on the sending relay's host and its needers on the
    receiving relay's, another host (`plan_check`), so no device both gathers and is scattered to in one unit."""
    carrier_of = dict(program.carriers)
    blocks: list[list] = []  # each operation's collectives on this device, in order
    for call in program.collectives:
        if blocks and blocks[-1][-1].op == call.op:
            blocks[-1].append(call)
        else:
            blocks.append([call])
    actions: list[AmaxMax | Copy | Bcast | StagedCall] = list(amax_reductions(program))
    stage, k = 0, 0
    while k < len(blocks):
        unit = carrier_of.get(blocks[k][0].op, blocks[k][0].op)
        end = k + 1
        while end < len(blocks) and carrier_of.get(blocks[end][0].op, blocks[end][0].op) == unit:
            end += 1
        mine, need = nccl_actions([call for block in blocks[k:end] for call in block], program)
        actions += mine
        stage, k = max(stage, need), end
    return NcclProgram(program.device, tuple(actions), communicator_groups(actions), stage)


def amax_reductions(program: RankProgram) -> list[AmaxMax]:
    """The all-reduces of the per-tensor FP8 amaxes this device takes part in: one per set of senders (this device and
    a tensor's `Conversion.peers`, the same set on each of them), its tensors in tensor order, the sets in order of
    their first tensor, which every member sees alike."""
    groups: dict[Group, list[int]] = {}
    for t, shards in enumerate(program.tensors):
        conversion = shards.convert
        if conversion is not None and conversion.peers:
            groups.setdefault(tuple(sorted((program.device, *conversion.peers))), []).append(t)
    return [AmaxMax(-1 - ts[0], group, tuple(ts)) for group, ts in groups.items()]  # op: the same on every member


def nccl_actions(collectives, program: RankProgram) -> tuple[list[Copy | Bcast | StagedCall], int]:
    """The NCCL calls of lowered collectives (a run of `program.collectives`) and the staging they need: the
    largest staged box, or a bundle's staging on this device (one call after another)."""
    actions: list[Copy | Bcast | StagedCall] = []
    stage = 0
    for call in collectives:
        if isinstance(call, StagedCall):  # a bundle: packs, broadcasts in groups of two and unpacks over staging
            actions += _split(call)
            stage = max(stage, call.stop)
            continue
        if call.target is not None:
            actions.append(Copy(call.op, call.box, call.target))
            continue
        at = None
        if call.box.span is None:
            at, stage = 0, max(stage, call.box.nbytes)
        ranges = tuple(split_calls(call.chunks, program.tensors[call.tensor].itemsize))
        actions.append(Bcast(call.op, call.task, call.kind, program.device, call.group, call.root, call.box, ranges, at))
    return actions, stage


def _split(call: StagedCall) -> list[StagedCall]:
    """A staged broadcast cut to MAX_CALL_BYTES per call (`split_calls`); packs and unpacks as they are."""
    if call.action != "bcast":
        return [call]
    return [replace(call, start=lo, stop=hi) for lo, hi in split_calls([(call.start, call.stop)], 1)]
