"""Staging memory: how many bytes each device needs to hold boxes that are not one run of its shard.

A box that is one contiguous run of a shard is sent from, or received into, the shard itself; any
other box goes through the device's staging area (packed before it is sent, received there and
unpacked; a broadcast relay forwards from there; a bundle always stages). `staged_bytes` says how
much one operation stages on one device, and `staging_peaks` how large each device's staging area
must be, which is what the executor's lowering allocates (`executor.lower`; tests check they agree):

- `posted`: every operation is in flight at once, so a device needs the sum over its operations.
- `posted` within a plan's budget (`--max-staging-mb`): an operation goes once its staging fits in a ring of the
  budget's bytes (`window_layout`), so a device needs at most the budget.
- `device`: a device takes part in one run of operations at a time, in plan order (`device_runs`:
  consecutive operations with the same peers run together, and with a budget a run also ends before
  it would stage more than the budget), so a run's staging is free again once the run is done and
  a device needs the largest run. A multi-tensor plan's device order spans its tensors: one staging
  area per device, shared by every tensor, each operation's bytes starting at a multiple of the
  largest element size among the tensors (`staging_align`), so every tensor's view of it is aligned.

>>> from xmesh_plan.schemas.plan import Operation
>>> op = Operation(id=0, task=0, kind="send", src=0, dsts=(1,), region=((0, 2), (0, 2)))
>>> staged_bytes(op, 0, ((0, 4), (0, 4)), None, 4), staged_bytes(op, 1, None, ((0, 2), (0, 2)), 4)
(16, 0)
>>> device_runs([(frozenset({1}), 16), (frozenset({1}), 16), (frozenset({2}), 8)], budget=None)
[0, 0, 1]
>>> device_runs([(frozenset({1}), 16), (frozenset({1}), 16), (frozenset({2}), 8)], budget=16)
[0, 1, 2]
>>> device_layout([(frozenset({1}), 2), (frozenset({1}), 8)], budget=None, align=8)  # (run, start) of each
[(0, 0), (0, 8)]
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from .geometry import Region, region_shape, region_size
from .op_kinds import OpLike, bundle_runs, members, rule_of, supported

if TYPE_CHECKING:
    from .plan import Plan, Staging

ORDERS = ("posted", "device")  # the executor's orders (`executor.lower.ORDERS` is this tuple)
SYNC_SEND_BYTES = 256 * 1024
"""In device order the MPI engine sends a message this large synchronously (it ends once it is being
received); a smaller one is buffered and ends once posted, so its device goes on at once (the simulator
models both)."""
Footprint = tuple[frozenset[int], int]
"""What one operation asks of one device: the peers it exchanges messages with, and the bytes it stages."""


def contiguous_span(region: Region, block: Region, itemsize: int) -> tuple[int, int] | None:
    """Byte range of `region` inside a C-ordered buffer holding `block`, or None when it is not one run.

    >>> contiguous_span(((1, 2), (0, 4)), ((0, 3), (0, 4)), 4)
    (16, 32)
    >>> contiguous_span(((0, 2), (0, 2)), ((0, 3), (0, 4)), 4) is None
    True
    """
    sub, full = region_shape(region), region_shape(block)
    k = 0
    while k < len(sub) and sub[k] == 1:
        k += 1
    if any(sub[j] != full[j] for j in range(k + 1, len(sub))):
        return None
    offset, stride = 0, 1
    for (r0, _), (b0, b1) in reversed(list(zip(region, block))):
        offset += (r0 - b0) * stride
        stride *= b1 - b0
    return offset * itemsize, (offset + math.prod(sub)) * itemsize


def _unless_run(region: Region, block: Region | None, itemsize: int) -> int:
    """The bytes of `region` when it must be staged (not one run of the shard holding `block`), else 0."""
    if block is None or not region_size(region) or contiguous_span(region, block, itemsize) is not None:
        return 0
    return region_size(region) * itemsize


def _local_staged(op: OpLike, device: int, src: Region | None, dst: Region | None, itemsize: int) -> int:
    return 0


def _chain_staged(op: OpLike, device: int, src: Region | None, dst: Region | None, itemsize: int) -> int:
    """The sender packs its box, every device down the chain receives the box (and forwards it) from where it lands."""
    if device == op.src:
        return _unless_run(op.region, src, itemsize)
    return _unless_run(op.region, dst, itemsize) if device in op.dsts else 0


def _ring_staged(op: OpLike, device: int, src: Region | None, dst: Region | None, itemsize: int) -> int:
    """A member sends its own part and receives every other part: each that is not one run of its shard is staged."""
    return sum(_unless_run(part, dst, itemsize) for part in op.parts) if device in op.dsts else 0


def _bundle_staged(op: OpLike, device: int, src: Region | None, dst: Region | None, itemsize: int) -> int:
    """Both relays stage the whole message; a holder stages the runs it gathers to the sender, a needer the runs scattered to it."""
    sizes = [region_size(p) for p in op.parts]
    if device in (op.src, op.dsts[0]):
        return sum(sizes) * itemsize
    gathers, scatters = bundle_runs(op)
    return itemsize * sum(sizes[i] for d, run in gathers + scatters if d == device for i in run)


def staged_bytes(op: OpLike, device: int, src_block: Region | None, dst_block: Region | None, itemsize: int) -> int:
    """Bytes `op` stages on `device`, whose source and destination shards hold `src_block` and `dst_block` (None: no shard)."""
    return _PATTERNS[rule_of(op).pattern].staged(op, device, src_block, dst_block, itemsize)


def staged_on_members(op: OpLike, src_blocks: dict[int, Region], dst_blocks: dict[int, Region], itemsize: int) -> list[tuple[int, int]]:
    """(device, `staged_bytes` there) for each of `op`'s members in order, the shards given as device -> box per side.
    A bundle's part sizes are counted once for all its devices, not once per device (a MoE plan's bundles carry many
    parts to many devices, and every staging figure of a plan asks this of every operation)."""
    if rule_of(op).pattern != "bundle":
        return [(d, staged_bytes(op, d, src_blocks.get(d), dst_blocks.get(d), itemsize)) for d in members(op)]
    sizes = [region_size(p) for p in op.parts]
    relays = (op.src, op.dsts[0])
    gathers, scatters = bundle_runs(op)
    runs: dict[int, int] = {}
    for d, run in gathers + scatters:
        runs[d] = runs.get(d, 0) + sum(sizes[i] for i in run)
    whole = sum(sizes)
    return [(d, itemsize * (whole if d in relays else runs.get(d, 0))) for d in members(op)]


def shard_kinds(shards: Sequence[tuple[dict[int, Region], dict[int, Region], int]]) -> list[int]:
    """For each tensor's (source boxes, destination boxes, element size) by device, the index of the first tensor with
    the same: tensors of one kind stage alike."""
    kinds: dict[tuple, int] = {}
    return [kinds.setdefault((size, tuple(src.items()), tuple(dst.items())), len(kinds)) for src, dst, size in shards]


def peers(op: OpLike, device: int) -> frozenset[int]:
    """The devices `device` sends to or receives from in `op` (the non-empty messages of `op_kinds.route`)."""
    return _PATTERNS[rule_of(op).pattern].peers(op, device)


def _chain_peers(op: OpLike, device: int) -> frozenset[int]:
    chain = (op.src, *op.dsts)
    i = chain.index(device)
    return frozenset(chain[j] for j in (i - 1, i + 1) if 0 <= j < len(chain))


def _ring_peers(op: OpLike, device: int) -> frozenset[int]:
    """Member i sends to i+1 when it has a part to send at some step (its own, or one it forwards), and
    receives from i-1 when any other part is non-empty."""
    ring, n = op.dsts, len(op.dsts)
    i = ring.index(device)
    filled = [region_size(p) > 0 for p in op.parts]
    sends = filled[i] or any(filled[(i - 1 - s) % n] for s in range(n - 2))
    receives = any(filled[j] for j in range(n) if j != i)
    return frozenset(([ring[(i + 1) % n]] if sends else []) + ([ring[i - 1]] if receives else []))


def _bundle_peers(op: OpLike, device: int) -> frozenset[int]:
    """The sender hears from every other holder and talks to the receiving relay, which scatters to every other needer."""
    gathers, scatters = bundle_runs(op)
    relay = op.dsts[0]
    if device == op.src:
        return frozenset({h for h, _ in gathers} | {relay})
    if device == relay:
        return frozenset({op.src} | {d for d, _ in scatters})
    return frozenset({op.src} if device in op.holders else {relay})


@dataclass(frozen=True, slots=True)
class _PatternStaging:
    staged: Callable[[OpLike, int, Region | None, Region | None, int], int]
    peers: Callable[[OpLike, int], frozenset[int]]


_PATTERNS = supported("schemas.staging", {
    "local": _PatternStaging(_local_staged, lambda op, device: frozenset()),
    "chain": _PatternStaging(_chain_staged, _chain_peers),
    "ring": _PatternStaging(_ring_staged, _ring_peers),
    "bundle": _PatternStaging(_bundle_staged, _bundle_peers),
})


def aligned(offset: int, align: int) -> int:
    """`offset` rounded up to a multiple of `align`.

    >>> aligned(10, 8), aligned(16, 8), aligned(3, 1)
    (16, 16, 3)
    """
    return -(-offset // align) * align


def device_layout(footprints: Sequence[Footprint], budget: int | None, align: int = 1) -> list[tuple[int, int]]:
    """(run number, first staging byte within the run) of each of a device's operations, in plan order, in
    device order: a run goes on while the peers stay the same and, with a `budget`, while its staging stays
    within the budget (an operation that stages more than the budget on its own is a run of its own). An
    operation with no peers (a local copy) joins the run it falls in, so a copy between a send and a receive
    with one peer does not make the receive wait for the send. Within a run operations stage one after
    another, each starting at a multiple of `align` (bytes of padding count against the budget)."""
    out, run, run_peers, run_bytes = [], -1, frozenset(), 0
    for op_peers, nbytes in footprints:
        start = aligned(run_bytes, align) if nbytes else run_bytes
        if run < 0 or (op_peers and run_peers and op_peers != run_peers) or (budget is not None and run_bytes and start + nbytes > budget):
            run, run_peers, start = run + 1, op_peers, 0
        elif op_peers and not run_peers:  # a run of local copies takes its first message's peers
            run_peers = op_peers
        run_bytes = start + nbytes
        out.append((run, start))
    return out


def device_runs(footprints: Sequence[Footprint], budget: int | None, align: int = 1) -> list[int]:
    """The run number of each of a device's operations (in plan order) in device order (`device_layout`)."""
    return [run for run, _ in device_layout(footprints, budget, align)]


def window_layout(sizes: Sequence[int], budget: int, align: int = 1) -> list[tuple[int, tuple[int, ...]]]:
    """(first staging byte, the earlier operations it waits for) of each of a device's operations (their staged bytes
    `sizes`, in plan order) posted within a staging window of `budget` bytes: staging is a ring of `budget` bytes, each
    operation's range after the one before (at a multiple of `align`), back at byte 0 when it would run past the end.
    An operation waits for the last earlier operation to stage in each of its bytes to finish on this device; that one
    waited for the one before it there, so no two operations that may be unfinished at once share a byte. An
    operation larger than the budget starts at 0 and waits for every byte's last user: it runs alone. One that stages
    nothing waits for nothing (waits are indices into `sizes`).

    Deadlock-free: an operation waits only for earlier ones of the device (and for its data, from earlier ones), and
    every device takes the plan's one order, so the earliest unfinished operation of the plan waits for nothing.

    >>> window_layout([4, 4, 0, 4, 2, 8], budget=8)
    [(0, ()), (4, ()), (0, ()), (0, (0,)), (4, (1,)), (0, (1, 3, 4))]
    """
    out: list[tuple[int, tuple[int, ...]]] = []
    starts: list[int] = []  # the ring's owned ranges, by first byte: each byte's last operation to stage there
    owners: list[tuple[int, int]] = []  # (end, operation) of each range in `starts`
    at = 0  # where the next range starts
    for k, nbytes in enumerate(sizes):
        if not nbytes:
            out.append((0, ()))
            continue
        start = aligned(at, align)
        if start and start + nbytes > budget:
            start = 0
        end = start + nbytes
        i = max(bisect.bisect_right(starts, start) - 1, 0)
        if i < len(starts) and owners[i][0] <= start:
            i += 1  # the range before ends before this one starts
        j = i
        while j < len(starts) and starts[j] < end:
            j += 1
        waits = tuple(sorted({owners[m][1] for m in range(i, j)}))
        ranges = [(start, end, k)]
        if i < j and starts[i] < start:  # what is left of a range this one starts inside
            ranges.insert(0, (starts[i], start, owners[i][1]))
        if i < j and owners[j - 1][0] > end:  # ... and of one it ends inside
            ranges.append((end, owners[j - 1][0], owners[j - 1][1]))
        starts[i:j] = [lo for lo, _, _ in ranges]
        owners[i:j] = [(hi, op) for _, hi, op in ranges]
        out.append((start, waits))
        at = end
    return out


def window_peak(sizes: Sequence[int], budget: int, align: int = 1) -> int:
    """The staging a device needs posted within a window of `budget` bytes (`window_layout`): at most the larger of the
    budget and its largest operation's staging."""
    return max((start + n for (start, _), n in zip(window_layout(sizes, budget, align), sizes) if n), default=0)


def run_peak(footprints: Sequence[Footprint], budget: int | None, align: int = 1) -> int:
    """The largest staging of one run, padding included: what a device needs in device order."""
    return max((start + nbytes for (_, start), (_, nbytes) in zip(device_layout(footprints, budget, align), footprints)
                if nbytes), default=0)


def stage_budget(plan: "Plan") -> int | None:
    """The staging budget a plan was compiled with (`compile --max-staging-mb`), or None."""
    return plan.staging.limit_bytes if plan.staging is not None else None


def staging_align(plan: "Plan") -> int:
    """Where each operation's staging starts in device order, in bytes: the largest element size among the
    plan's tensors (its one element size for a single-tensor plan, where every staged box is a multiple of it)."""
    return max(p.itemsize for p in plan.problem.tensor_problems())


def chained(sizes: Sequence[int], align: int) -> int:
    """Bytes of staging `sizes` take laid out one after another, each non-empty one at a multiple of `align`
    (how the executor's joint program lays out the bundles of one shared message, `schemas.carriers`).

    >>> chained([6, 0, 8], 4)
    16
    """
    at = 0
    for n in sizes:
        if n:
            at = aligned(at, align) + n
    return at


def footprints(plan: "Plan") -> dict[int, list[Footprint]]:
    """Device -> (peers, staged bytes) of each operation it takes part in, in plan order, across tensors
    (each operation staged in its own tensor's shards); the bundles of one shared message
    (`schemas.carriers`) count as one operation, staging what the executor lays out for it (`carriers.group_staging`:
    each holder's and needer's pieces, the relays' message and side areas)."""
    from .carriers import group_staging, message_groups

    shards = [(p.blocks("src"), p.blocks("dst"), p.itemsize) for p in plan.problem.tensor_problems()]
    kind = shard_kinds(shards)
    memo: dict[tuple, tuple] = {}  # operations made of the same box objects (a compile's repeated layers) on one kind of shards: once
    align = staging_align(plan)
    out: dict[int, list[Footprint]] = {}

    def key_of(op) -> tuple:
        return (op.kind, op.src, op.dsts, id(op.region), id(op.parts), id(op.holders), id(op.needers), kind[op.tensor or 0])

    def each(op, key: tuple) -> list[tuple[int, Footprint]]:
        known = memo.get(key)
        if known is None:  # holds the boxes, so their ids stay theirs
            known = memo[key] = ((op.region, op.parts, op.holders, op.needers),
                                 [(d, (peers(op, d), n)) for d, n in staged_on_members(op, *shards[op.tensor or 0])])
        return known[1]

    groups: dict[tuple, list[tuple[int, Footprint]]] = {}  # a shared message made of the same bundles (a repeated layer's): once
    for group in message_groups(plan.operations):
        if len(group) == 1:  # one operation: its footprints as they are (shared with the same operation elsewhere)
            for device, footprint in each(group[0], key_of(group[0])):
                out.setdefault(device, []).append(footprint)
            continue
        keys = tuple(map(key_of, group))
        known = groups.get(keys)
        if known is None:
            mine: dict[int, set[int]] = {}
            for op, key in zip(group, keys):
                for device, (near, _) in each(op, key):
                    mine.setdefault(device, set()).update(near)
            staged = group_staging(group, [[region_size(p) * shards[op.tensor or 0][2] for p in op.parts] for op in group], align)
            known = groups[keys] = [(device, (frozenset(talks), staged.get(device, 0))) for device, talks in mine.items()]
        for device, footprint in known:
            out.setdefault(device, []).append(footprint)
    return out


def staging_peaks(plan: "Plan", order: str = "device", prints: dict[int, list[Footprint]] | None = None) -> dict[int, int]:
    """Device -> the bytes of staging the executor allocates on it for `plan` in `order` (devices that
    stage nothing left out). Device order uses the plan's own budget (`stage_budget`) and, across the
    tensors of a multi-tensor plan, one area per device (`staging_align`); so does posted where the plan states a
    budget, within a window of it (`window_peak`). Otherwise posted, each tensor of a
    multi-tensor plan has its own staging area: the peak is the sum over tensors; where bundles share
    messages (`schemas.carriers`) one area holds every operation's staging, one after another (`chained`).
    `prints`: the plan's `footprints`, where the caller has them (both orders read them)."""
    if order not in ORDERS:
        raise ValueError(f"order {order!r} is unknown; use one of: {', '.join(ORDERS)}")
    from .carriers import has_carriers
    from .plan_tensors import is_multi, tensor_plans

    budget, align = stage_budget(plan), staging_align(plan)
    if order == "posted" and budget is not None:  # within a window of the limit (`executor.window`), one area for every tensor
        return {device: value for device, f in sorted((prints or footprints(plan)).items())
                if (value := window_peak([n for _, n in f], budget, align))}
    if is_multi(plan) and order == "posted" and has_carriers(plan.operations):
        return {device: value for device, f in sorted((prints or footprints(plan)).items()) if (value := chained([n for _, n in f], align))}
    if is_multi(plan) and order == "posted":
        total: dict[int, int] = {}
        for single in tensor_plans(plan):
            for device, nbytes in staging_peaks(single, "posted").items():
                total[device] = total.get(device, 0) + nbytes
        return dict(sorted(total.items()))
    if order == "device":
        return _device_peaks(plan, budget, align, prints)
    return {device: value for device, f in sorted((prints or footprints(plan)).items()) if (value := sum(n for _, n in f))}


def _device_peaks(plan: "Plan", budget: int | None, align: int, prints: dict[int, list[Footprint]] | None = None) -> dict[int, int]:
    """Device -> its staging in device order under `budget` (devices that stage nothing left out)."""
    return {device: value for device, f in sorted((prints or footprints(plan)).items()) if (value := run_peak(f, budget, align))}


def stated_staging(plan: "Plan", limit_bytes: int) -> "Staging":
    """The staging `plan` states when made for `limit_bytes`: the limit and each device's peak in device order under
    it. Reads `plan` by attribute only (its problem and operations), so a compile states it from its rows
    (`planner.plan_rows`) without making their records."""
    from .plan import Staging

    return Staging(limit_bytes=limit_bytes, peak_bytes=_device_peaks(plan, limit_bytes, staging_align(plan)))


def with_stated_staging(plan: "Plan", limit_bytes: int) -> "Plan":
    """`plan` stating the staging limit it was made for and each device's peak in device order under it."""
    return plan.model_copy(update={"staging": stated_staging(plan, limit_bytes)})


def stated_staging_fault(plan: "Plan") -> str | None:
    """Why the staging a plan states (`Plan.staging`) is wrong, or None when it is right or absent: every
    device's peak must be what `staging_peaks` computes, and none above the limit."""
    stated = plan.staging
    if stated is None:
        return None
    peaks = staging_peaks(plan, stated.order)
    for device in sorted(set(peaks) | set(stated.peak_bytes)):
        want, said = peaks.get(device, 0), stated.peak_bytes.get(device, 0)
        if want != said:  # a plan compiled before the lowering it states staging for (shared messages' relays)
            return (f"staging.peak_bytes states {said} B for device {device}, but the plan needs {want} B there in "
                    f"{stated.order} order (a plan compiled with --max-staging-mb by an older xmesh-plan states the "
                    "staging of its own executor's lowering); recompile the plan")
        if want > stated.limit_bytes:
            return (f"device {device} needs {want} B of staging in {stated.order} order, above the plan's limit "
                    f"staging.limit_bytes {stated.limit_bytes} B; recompile the plan with `xmesh-plan compile --max-staging-mb`")
    return None
