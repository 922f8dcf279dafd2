"""`in_window`: a posted program whose staging stays within the plan's staging limit (`compile --max-staging-mb`).

Posted, every operation is in flight at once and so is every staged box: the full DeepSeek-V3-like plan stages 48.69
GiB on its busiest device. Device order (`lower.in_device_order`) bounds staging but takes part in one run of
operations at a time, 1.13-1.32x the byte bound on the frontier cuts (bench/bench_staging_window.py). Within a
window, every operation is still posted as soon as its staging is free: each device's staged operations take ranges of
a ring of `budget` bytes in plan order (`schemas.staging.window_layout`), and an operation's messages and packs wait
for the earlier operations whose ranges it overlaps to have finished on this device. The simulator's `window`
discipline times it (`planner.simulate.window_waits`).

Deadlock-free: an operation waits only for earlier operations of the plan (on this device, and for its data), and every
rank takes the plan's one order, so the plan's earliest unfinished operation waits for nothing on any of its devices
and finishes; by induction every operation does. Every message has its own tag (`lower`), so receives posted in
another order than their sends still match.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from xmesh_plan.schemas.staging import window_layout

from .lower import RankProgram, Step, stage_ranges


def in_window(program: RankProgram, budget: int, align: int | None = None, key: Mapping[int, int] | None = None) -> RankProgram:
    """The same steps, each operation's staging moved to its range of a ring of `budget` bytes (a multiple of `align`,
    default the program's; `window_layout`), and its messages and packs waiting for the last steps of the earlier
    operations it overlaps there; `stage_bytes` becomes the ring's peak (at most the budget, or the largest operation
    where one stages more). `key` (op -> op) makes the bundles of one shared message one operation (`schemas.carriers`)."""
    keys, spans, layout = _ring(program, budget, align, key)
    ops = list(spans)
    shift = {op: lo - start for op, (lo, _), (start, _) in zip(ops, spans.values(), layout)}
    peak = max((start + hi - lo for (lo, hi), (start, _) in zip(spans.values(), layout) if hi > lo), default=0)
    own: dict[int, list[int]] = {}  # op -> its steps
    for s, k in zip(program.steps, keys):
        own.setdefault(k, []).append(s.index)
    last: dict[int, tuple[int, ...]] = {}  # op -> its steps no step of its own waits for: once they are done, all are
    waits = {op: earlier for op, (_, earlier) in zip(ops, layout)}
    steps: list[Step] = []
    for s, k in zip(program.steps, keys):
        deps = s.deps
        earlier = waits[k]
        if earlier and s.action.reads_staging_first:
            deps = tuple(sorted(set(deps).union(*(_last_steps(ops[j], own, last, program.steps, keys) for j in earlier))))
        if shift[k] and s.data is not None and s.data.buffer == "stage":
            steps.append(s.shifted(s.index, deps, shift[k]))
        else:
            steps.append(s if deps is s.deps else s.at(s.index, deps, s.data))
    return replace(program, steps=tuple(steps), stage_bytes=peak)


def staging_waits(program: RankProgram, budget: int, align: int | None = None,
                  key: Mapping[int, int] | None = None) -> dict[int, tuple[int, ...]]:
    """Each operation that stages something (`key` as in `in_window`) -> the earlier operations whose ranges of the ring
    it overlaps: what `in_window` makes it wait for (the simulator's `planner.simulate.window_waits` on one device)."""
    _, spans, layout = _ring(program, budget, align, key)
    ops = list(spans)
    return {op: tuple(ops[j] for j in earlier) for op, (lo, hi), (_, earlier) in zip(ops, spans.values(), layout) if hi > lo}


def _ring(program: RankProgram, budget: int, align: int | None, key: Mapping[int, int] | None):
    """Each step's operation (by `key`), each operation's staging range in the program, and its place in the ring
    (`window_layout`)."""
    key = key or {}
    keys = [key.get(s.op, s.op) for s in program.steps]
    spans = stage_ranges(program.steps, keys)
    return keys, spans, window_layout([hi - lo for lo, hi in spans.values()], budget, align or program.align)


def _last_steps(op: int, own: dict[int, list[int]], memo: dict[int, tuple[int, ...]], steps, keys) -> tuple[int, ...]:
    """The steps of `op` that no other step of `op` waits for (memoized in `memo`)."""
    found = memo.get(op)
    if found is None:
        mine = own[op]
        waited = {d for i in mine for d in steps[i].deps if keys[d] == op}
        found = memo[op] = tuple(i for i in mine if i not in waited)
    return found
