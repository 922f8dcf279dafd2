"""Bundles that share one cross-host message: pieces of several tensors packed into one message.

A bundle (`op_kinds`, kind `bundle`) moves boxes of one tensor between two relays. Bundles of other
tensors between the same two relays can ride in the same message: each names the group's first
bundle as its `carrier`, the group's bundles are listed one after another right after it, and every
one of them has the carrier's relays (`src`, `dsts`). Each bundle stays a whole bundle of its own
tensor (its holders gather to the sending relay, the receiving relay scatters), so the verifier and
the executor's per-tensor lowering see it as before; the message is shared, and so are the
messages inside each host: the executor lowers the group together (`executor.lower._lower_group`), one
message per pair of devices (`group_runs`), the relays staging the message and a side area per peer
(`group_staging`), and the simulator times the group as one bundle (`fused`).
Every bundle of a group but the last carries a multiple of `align` bytes (the plan's largest element
size), so each one's staging starts where the executor's views need it with no padding in between.

>>> from xmesh_plan.schemas.plan import Operation
>>> a = Operation(id=0, task=0, tensor=0, kind="bundle", src=0, dsts=(4,), region=((0, 2),), parts=(((0, 2),),), holders=(0,), needers=((4,),))
>>> b = Operation(id=1, task=1, tensor=1, kind="bundle", src=0, dsts=(4,), region=((0, 3),), parts=(((0, 3),),), holders=(1,), needers=((5,),), carrier=0)
>>> [[op.id for op in g] for g in message_groups([a, b])]
[[0, 1]]
>>> f = fused([a, b], [4, 2])
>>> f.parts, f.holders, f.needers, f.region
((((0, 8),), ((8, 14),)), (0, 1), ((4,), (5,)), ((0, 14),))
"""

from __future__ import annotations

from typing import Sequence

from .geometry import region_size
from .staging import aligned, chained
from .op_kinds import OpLike
from .plan import Operation


def group_key(op: Operation) -> int:
    """The id of the operation whose cross-host message `op` travels in (its own id when it has no carrier)."""
    return op.id if op.carrier is None else op.carrier


def has_carriers(operations: Sequence[Operation]) -> bool:
    return any(op.carrier is not None for op in operations)


def message_groups(operations: Sequence[Operation]) -> list[list[Operation]]:
    """The operations in list order, those sharing one message together (a group is listed contiguously)."""
    out: list[list[Operation]] = []
    for op in operations:
        if out and op.carrier is not None and group_key(out[-1][0]) == op.carrier:
            out[-1].append(op)
        else:
            out.append([op])
    return out


Piece = tuple[int, int]
"""(member, part): part `part` of the group's `member`-th bundle."""
DeviceRun = tuple[int, tuple[Piece, ...]]
"""(device, pieces): one intra-host message of a shared message, the pieces in group order."""


def group_runs(group: Sequence[Operation | OpLike]) -> tuple[tuple[DeviceRun, ...], tuple[DeviceRun, ...]]:
    """(gathers, scatters) of a shared message of two or more bundles, one intra-host message per pair of devices:
    each holder other than the sending relay sends every part it holds, member after member and in part order,
    in one message (holders in order of first part); the receiving relay sends each other needer every part it
    needs in one message (needers in order of first need). A device's pieces are in general not one run of the
    cross-host message, so the relays stage them apart (the executor moves them in or out of the message inside
    staging). The messages a group of many small bundles needs fall from one per bundle and device to one per device.

    >>> from xmesh_plan.schemas.plan import Operation
    >>> a = Operation(id=0, task=0, tensor=0, kind="bundle", src=0, dsts=(4,), region=((0, 2),), parts=(((0, 1),), ((1, 2),)), holders=(1, 2), needers=((5,), (4, 6)))
    >>> b = Operation(id=1, task=1, tensor=1, kind="bundle", src=0, dsts=(4,), region=((0, 3),), parts=(((0, 3),),), holders=(1,), needers=((5, 6),), carrier=0)
    >>> group_runs([a, b])
    (((1, ((0, 0), (1, 0))), (2, ((0, 1),))), ((5, ((0, 0), (1, 0))), (6, ((0, 1), (1, 0)))))
    """
    src, relay = group[0].src, group[0].dsts[0]
    gathers: dict[int, list[Piece]] = {}
    scatters: dict[int, list[Piece]] = {}
    for m, op in enumerate(group):
        for i, (holder, need) in enumerate(zip(op.holders, op.needers)):
            if holder != src:
                gathers.setdefault(holder, []).append((m, i))
            for d in need:
                if d != relay:
                    scatters.setdefault(d, []).append((m, i))
    return (tuple((h, tuple(pieces)) for h, pieces in gathers.items()),
            tuple((d, tuple(pieces)) for d, pieces in scatters.items()))


def piece_layout(pieces: Sequence[Piece], sizes: Sequence[Sequence[int]], align: int) -> tuple[tuple[int, ...], int]:
    """(each piece's first byte, the bytes in all) of a staging area holding `pieces` (given member by member, in part
    order within a member, as `group_runs` lists them): each member's chunk starts at a multiple of `align`, its parts
    one after another (`sizes[m][i]`: the bytes of part i of member m). A relay's message area is every piece of the
    group (each member's bytes a multiple of `align` but the last, `carrier_fault`, so the members lie one after
    another); a holder's or needer's area, and the relays' side areas, are that device's pieces.

    >>> piece_layout(((0, 0), (0, 2), (1, 0)), ((6, 2, 4), (8,)), 8)
    ((0, 6, 16), 24)
    """
    offsets, at, member = [], 0, -1
    for m, i in pieces:
        if m != member:
            at, member = aligned(at, align), m
        offsets.append(at)
        at += sizes[m][i]
    return tuple(offsets), at


def group_staging(group: Sequence[Operation | OpLike], sizes: Sequence[Sequence[int]], align: int) -> dict[int, int]:
    """Device -> the bytes a shared message of two or more bundles stages on it, as the executor lays them out
    (`executor.lower`): each holder and needer its pieces' area (`piece_layout`); the sending relay the message, then
    a side area per holder (what it receives before moving the pieces into the message); the receiving relay the
    message, then a side area per needer (what it moves the pieces into before sending them). Each area starts at a
    multiple of `align`. `sizes[m][i]`: the bytes of part i of member m."""
    gathers, scatters = group_runs(group)
    every = tuple((m, i) for m, op in enumerate(group) for i in range(len(op.parts)))
    message = piece_layout(every, sizes, align)[1]
    out: dict[int, int] = {}
    for relay, runs in ((group[0].src, gathers), (group[0].dsts[0], scatters)):
        areas = [piece_layout(pieces, sizes, align)[1] for _, pieces in runs]
        out[relay] = chained([message, *areas], align)
        for (device, _), nbytes in zip(runs, areas):
            out[device] = out.get(device, 0) + nbytes
    return out


def bundle_bytes(op: "Operation | OpLike", itemsize: int) -> int:
    """The bytes a bundle's cross-host message carries for it: all of its parts."""
    return sum(map(region_size, op.parts)) * itemsize


def fused(group: Sequence[Operation], itemsizes: Sequence[int]) -> Operation:
    """A group as the one bundle it is on the wire, in bytes (a 1-D tensor of uint8): each member's parts
    one after another, with their holders and needers, under the carrier's id, task and relays; a group
    of one is returned as it is. `itemsizes[t]` is tensor t's element size. For the simulator and the
    staging footprint, which see only sizes, devices and messages."""
    if len(group) == 1:
        return group[0]
    parts, holders, needers, at = [], [], [], 0
    for op in group:
        size = itemsizes[op.tensor or 0]
        for part, holder, need in zip(op.parts, op.holders, op.needers):
            n = region_size(part) * size
            parts.append(((at, at + n),))
            holders.append(holder)
            needers.append(need)
            at += n
    first = group[0]
    return first.model_copy(update={"tensor": None, "region": ((0, at),), "parts": tuple(parts), "holders": tuple(holders),
                                    "needers": tuple(needers), "carrier": None})


def carrier_fault(operations: Sequence[Operation], itemsizes: Sequence[int], align: int) -> str | None:
    """Why the plan's shared messages are malformed (see the module docstring), or None."""
    position = {op.id: k for k, op in enumerate(operations)}
    for k, op in enumerate(operations):
        if op.carrier is None:
            continue
        what = f"operation {op.id} (carrier {op.carrier})"
        if op.kind != "bundle":
            return f"{what}: only a bundle rides in another bundle's message; drop carrier"
        if op.carrier not in position:
            return f"{what}: no operation {op.carrier} in the plan; name the group's first bundle"
        if position[op.carrier] >= k:  # operations[k - 1] below would wrap to the last one for k = 0
            return f"{what}: its carrier must be listed before it (the group's first bundle, then the others right after it)"
        head = operations[position[op.carrier]]
        if head.kind != "bundle" or head.carrier is not None:
            return f"{what}: operation {op.carrier} must be a bundle that sends its own message (no carrier of its own)"
        before = operations[k - 1]
        if group_key(before) != op.carrier:
            return f"{what}: the bundles of one message must be listed right after operation {op.carrier}, one after another"
        if (op.src, op.dsts) != (head.src, head.dsts):
            return (f"{what}: relays d{op.src} -> d{op.dsts[0]} differ from its carrier's d{head.src} -> d{head.dsts[0]}; "
                    "a shared message has one sending and one receiving relay")
        if bundle_bytes(before, itemsizes[before.tensor or 0]) % align:
            return (f"operation {before.id}: carries {bundle_bytes(before, itemsizes[before.tensor or 0])} B, not a multiple of "
                    f"{align} B (the largest element size), and another bundle follows it in one message; recompile the plan")
    return None


def split_ragged(operations: Sequence[Operation], itemsizes: Sequence[int], align: int) -> tuple[Operation, ...]:
    """The operations with every group cut after a bundle that does not carry a multiple of `align` bytes (the
    next one then sends its own message and carries the rest): what a shrunk plan needs (`executor.scale`),
    whose boxes may no longer keep the rule."""
    out: list[Operation] = []
    for group in message_groups(operations):
        head = group[0].id
        for k, op in enumerate(group):
            if k and bundle_bytes(group[k - 1], itemsizes[group[k - 1].tensor or 0]) % align:
                head = op.id
            carrier = None if op.id == head else head
            out.append(op if op.carrier == carrier else op.model_copy(update={"carrier": carrier}))
    return tuple(out)
