"""Staging memory from the definitions, written apart from `schemas.staging`: what each operation stages on a
device by numpy's view of its boxes, the peaks that gives, and reuse of staging bytes a later step could overwrite."""

from __future__ import annotations

import numpy as np

from xmesh_plan.executor.lower import Action
from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.geometry import local_slices, region_shape, region_size
from xmesh_plan.schemas.op_kinds import members, route, rule_of
from xmesh_plan.schemas.staging import stage_budget


def _staged_by_numpy(region, block, itemsize: int) -> int:
    """Bytes of `region` unless its elements are consecutive in the C-ordered buffer holding `block` (numpy indices)."""
    if block is None or not region_size(region):
        return 0
    flat = np.arange(region_size(block)).reshape(region_shape(block))[local_slices(region, block)].ravel()
    return 0 if (np.diff(flat) == 1).all() else flat.size * itemsize


def brute_footprint(op, d: int, prob) -> tuple[frozenset, int]:
    """(peers, bytes staged) of one operation on device d, from numpy's view of the boxes: its own box of a
    chain, every part of a ring, a bundle's whole message on its relays and their own parts elsewhere."""
    src, dst, size = prob.blocks("src"), prob.blocks("dst"), prob.itemsize
    pattern = rule_of(op).pattern
    if pattern == "chain":
        staged = _staged_by_numpy(op.region, src.get(d) if d == op.src else dst.get(d), size)
    elif pattern == "ring":
        staged = sum(_staged_by_numpy(p, dst.get(d), size) for p in op.parts)
    elif pattern == "bundle":
        mine = [p for p, h, n in zip(op.parts, op.holders, op.needers) if d in (op.src, op.dsts[0]) or h == d or d in n]
        staged = sum(map(region_size, mine)) * size
    else:
        staged = 0
    talks = frozenset(h.dst if h.src == d else h.src for h in route(op) if h.src != h.dst and h.elements and d in (h.src, h.dst))
    return talks, staged


def brute_force_peaks(plan: Plan, order: str = "device") -> dict[int, int]:
    """Each device's staging peak in `order`, from the definitions and written apart from `schemas.staging`: in
    plan order across tensors, the boxes a device holds while it takes part in an operation (its box of a
    chain, every part of a ring, a bundle's whole message on its relays and its own parts elsewhere),
    staged unless numpy finds them one run of its shard of that tensor, each at a multiple of the largest
    element. Posted order holds them all at once; device order cuts runs of the same peers (from the route's
    messages) before they pass the plan's limit. Posted with a limit, they go round a ring of the limit's bytes, back
    to byte 0 where the next would pass its end. Bundles sharing one message (`carrier`: listed after the
    bundle named) count as one operation on a device: their peers together, and what `_shared_staging` says."""
    problems = plan.problem.tensor_problems()
    align = max(p.itemsize for p in problems)
    per_device: dict[int, list[tuple[frozenset, int, int]]] = {}
    groups: list[list] = []
    for op in plan.operations:
        if op.carrier is not None and groups and groups[-1][0].id == op.carrier:
            groups[-1].append(op)
        else:
            groups.append([op])
    for group in groups:
        staged = _shared_staging(group, problems, align) if len(group) > 1 else None
        for op in group:
            for d in members(op):
                talks, n = brute_footprint(op, d, problems[op.tensor or 0])  # a single-tensor plan names no tensor
                items = per_device.setdefault(d, [])
                if staged is not None and op is not group[0] and items and items[-1][2] == group[0].id:
                    items[-1] = (items[-1][0] | talks, staged.get(d, 0), group[0].id)
                else:
                    items.append((talks, n if staged is None else staged.get(d, 0), group[0].id))
    budget, out = stage_budget(plan), {}
    for d, items in per_device.items():
        peak, peers, used = 0, frozenset(), 0
        for talks, n, _ in items:
            start = -(-used // align) * align if n else used
            if order == "posted" and budget is not None and n and start and start + n > budget:  # a ring of the budget
                start = 0
            if order == "device" and ((talks and peers and talks != peers) or (budget is not None and used and start + n > budget)):
                peers, used, start = talks, 0, 0
            peers = peers or talks
            used = start + n
            peak = max(peak, used)
        if peak:
            out[d] = peak
    return out


def _shared_staging(group, problems, align: int) -> dict[int, int]:
    """Device -> bytes one shared message of two or more bundles stages there, from its definition: each device's
    pieces in one area, member by member, each member's bytes from a multiple of `align`; the sending relay the
    whole message, then one area per other holder; the receiving relay the message, then one area per other needer;
    every area from a multiple of `align`; no area for a device whose pieces are consecutive pieces of the message at
    the same distances (the relay sends or receives it in the message itself)."""
    def up(n: int) -> int:
        return -(-n // align) * align

    src, relay = group[0].src, group[0].dsts[0]
    area: dict[tuple[str, int], int] = {}  # (gathers or scatters, device) -> its area's bytes
    seen: dict[tuple[str, int], list[tuple[int, int, int]]] = {}  # -> (piece index, byte in the message, byte in the area)
    message = index = 0
    for op in group:
        size = problems[op.tensor or 0].itemsize
        counted = set()
        for part, holder, need in zip(op.parts, op.holders, op.needers):
            n = region_size(part) * size
            for key in [("g", holder)] * (holder != src) + [("s", d) for d in need if d != relay]:
                start = area.get(key, 0) if key in counted else up(area.get(key, 0))  # a new member starts aligned
                seen.setdefault(key, []).append((index, message, start))
                area[key] = start + n
                counted.add(key)
            message += n
            index += 1

    def in_message(key) -> bool:  # consecutive pieces of the message at the same distances: no side area
        (i0, m0, a0), *_ = seen[key]
        return all(i == i0 + k and m - m0 == a - a0 for k, (i, m, a) in enumerate(seen[key]))

    out = {d: n for (_, d), n in area.items()}
    for relay_device, side in ((src, "g"), (relay, "s")):
        at = message
        for key, n in area.items():
            if key[0] == side and n and not in_message(key):
                at = up(at) + n
        out[relay_device] = at
    return out


def _ancestors(steps) -> list[int]:
    """Bitset of every step each step waits for, directly or not."""
    out = []
    for s in steps:
        bits = 0
        for d in s.deps:
            bits |= out[d] | (1 << d)
        out.append(bits)
    return out


_WRITES_STAGING = frozenset({Action.RECV, Action.PACK, Action.MOVE})  # into `data`; a send or unpack reads it


def _staging_uses(step) -> list[tuple[int, int, bool]]:
    """(start, stop, writes) of each staging range a step touches: its `data`, written by a receive, pack or move
    and read by a send or unpack, and a move's `origin`, read."""
    uses = []
    if step.data is not None and step.data.buffer == "stage":
        uses.append((step.data.start, step.data.stop, step.action in _WRITES_STAGING))
    if step.origin is not None and step.origin.buffer == "stage":
        uses.append((step.origin.start, step.origin.stop, False))
    return uses


def unsafe_reuse(program) -> list[str]:
    """Pairs of steps of different operations touching the same staging bytes, at least one of them writing, where
    the later one does not wait for the earlier: reused staging that could be overwritten while still in use. Two
    reads of the same bytes (a shared message's scatter sent from the message while its members unpack) are safe."""
    staged = [(s, uses) for s in program.steps if (uses := _staging_uses(s))]
    before = _ancestors(program.steps)
    bad = []
    for i, (a, a_uses) in enumerate(staged):
        for b, b_uses in staged[i + 1:]:
            if a.op != b.op and not before[b.index] >> a.index & 1 and any(
                    (aw or bw) and a0 < b1 and b0 < a1 for a0, a1, aw in a_uses for b0, b1, bw in b_uses):
                bad.append(f"device {program.device}: {b.describe()} does not wait for {a.describe()} on staging bytes both use")
    return bad
