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

from itertools import chain
from typing import Sequence

from .geometry import region_size
from .staging import aligned, chained
from .op_kinds import OpLike, runs_by_device
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
    pieces = [(m, i) for m, op in enumerate(group) for i in range(len(op.parts))]
    gathers, scatters = runs_by_device(group[0].src, group[0].dsts[0], tuple(chain.from_iterable(op.holders for op in group)),
                                       tuple(map(tuple, chain.from_iterable(op.needers for op in group))))
    at = pieces.__getitem__
    return (tuple((h, tuple(map(at, run))) for h, run in gathers), tuple((d, tuple(map(at, run))) for d, run in scatters))


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


def in_message(pieces: Sequence[Piece], local: Sequence[int], place: dict[Piece, int], order: dict[Piece, int]) -> int | None:
    """The message byte where a peer's area lies when it is one range of the message with the same layout, else None:
    its pieces (`local`: their bytes in its own area, `piece_layout`) are consecutive pieces of the message (`order`:
    each piece's index in the message; nothing of another device in between) at the same distances (`place`: each
    piece's byte in the message). A relay then sends or receives that peer's message straight from or into the
    message, with no side area and no move: a needer needing every piece (destinations replicated over a host), a
    holder of every part but the sending relay's, a peer of one member's consecutive parts."""
    first, start = order[pieces[0]], place[pieces[0]]
    if all(order[p] == first + k and place[p] - start == lo for k, (p, lo) in enumerate(zip(pieces, local))):
        return start
    return None


def relay_areas(runs: Sequence[DeviceRun], sizes: Sequence[Sequence[int]], align: int, every: Sequence[Piece] | None = None,
                message_layout: tuple[tuple[int, ...], int] | None = None
                ) -> tuple[tuple[int, int], tuple[tuple[tuple[int, ...], int, int | None], ...]]:
    """A relay's staging for a shared message: ((the message's bytes, all it stages), per peer of `runs` (its
    holders on the sending relay, its needers on the receiving one): (the pieces' bytes in the peer's area, the area's
    bytes, where it lies in the message when `in_message`, else None)). The message comes first, then a side area
    per peer not in the message (each from a multiple of `align`, `schemas.staging.chained`), what the relay receives
    a holder's pieces into before moving them into the message, or moves a needer's pieces into before sending them.
    `sizes[m][i]`: the bytes of part i of member m. `every` and `message_layout`: every piece of the group and its
    `piece_layout`, where the caller has them."""
    if every is None or message_layout is None:
        every = tuple((m, i) for m, part_sizes in enumerate(sizes) for i in range(len(part_sizes)))
        message_layout = piece_layout(every, sizes, align)
    where, message = message_layout
    place, order = dict(zip(every, where)), {p: k for k, p in enumerate(every)}
    areas = []
    for _, pieces in runs:
        local, nbytes = piece_layout(pieces, sizes, align)
        areas.append((local, nbytes, in_message(pieces, local, place, order)))
    return (message, chained([message, *(n for _, n, inside in areas if inside is None)], align)), tuple(areas)


def group_staging(group: Sequence[Operation | OpLike], sizes: Sequence[Sequence[int]], align: int) -> dict[int, int]:
    """Device -> the bytes a shared message of two or more bundles stages on it, as the executor lays them out
    (`executor.lower`): each holder and needer its pieces' area (`piece_layout`); each relay the message and its side
    areas (`relay_areas`: one per peer whose pieces are not one range of the message laid out alike). Each area
    starts at a multiple of `align`. `sizes[m][i]`: the bytes of part i of member m."""
    gathers, scatters = group_runs(group)
    out: dict[int, int] = {}
    for relay, runs in ((group[0].src, gathers), (group[0].dsts[0], scatters)):
        (_, staged), areas = relay_areas(runs, sizes, align)
        out[relay] = staged
        for (device, _), (_, nbytes, _) in zip(runs, areas):
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
