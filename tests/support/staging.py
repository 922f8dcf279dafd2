"""Staging memory from the definitions, written apart from `schemas.staging`: what each operation stages on a
device by numpy's view of its boxes, the peaks that gives, and reuse of staging bytes a later step could overwrite."""

from __future__ import annotations

import numpy as np

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


def brute_force_peaks(plan: Plan, order: str) -> dict[int, int]:
    """The staging peaks from the definitions, written apart from `schemas.staging`: the boxes each device
    holds while it takes part (its own box of a chain, every part of a ring, a bundle's whole message on
    its relays and their own parts elsewhere), staged unless numpy finds them one run; peers from the
    route's messages; runs of equal peers cut before they pass the plan's budget."""
    prob, budget = plan.problem, stage_budget(plan)
    per_device: dict[int, list[tuple[frozenset, int]]] = {}
    for op in plan.operations:
        for d in members(op):
            per_device.setdefault(d, []).append(brute_footprint(op, d, prob))
    out = {}
    for d, items in per_device.items():
        if order == "posted":
            peak = sum(n for _, n in items)
        else:
            runs, peers, total = [], frozenset(), 0
            for talks, n in items:  # a local copy (no peers) stays in the run it falls in
                if (talks and peers and talks != peers) or (budget is not None and total and total + n > budget):
                    runs.append(total)
                    peers, total = talks, 0
                peers = peers or talks
                total += n
            peak = max(runs + [total])
        if peak:
            out[d] = peak
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


def unsafe_reuse(program) -> list[str]:
    """Pairs of steps of different operations touching the same staging bytes where the later one does not wait
    for the earlier: reused staging that could be overwritten while still in use."""
    staged = [s for s in program.steps if s.data is not None and s.data.buffer == "stage"]
    before = _ancestors(program.steps)
    bad = []
    for i, a in enumerate(staged):
        for b in staged[i + 1:]:
            if a.op != b.op and a.data.start < b.data.stop and b.data.start < a.data.stop and not before[b.index] >> a.index & 1:
                bad.append(f"device {program.device}: {b.describe()} may overwrite staging of {a.describe()}")
    return bad
