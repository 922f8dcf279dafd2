"""`greedy`: longest task first, each to the sender option that finishes earliest, append-only.

The fastest solver (one pass, no backfilling): the test suite's default when any correct plan will do.
"""

from __future__ import annotations

from ..scheduling import Resource, Schedule, SchedulingTask


def greedy_least_loaded(tasks: list[SchedulingTask], *, seed: int = 0, time_limit_s: float = 1.0) -> Schedule:
    """Longest task first, each to the option that finishes earliest given what is already placed (append-only)."""
    del seed, time_limit_s
    free: dict[Resource, float] = {}
    choice: dict[int, int] = {}
    start: dict[int, float] = {}
    order = sorted(tasks, key=lambda t: (-max(o.duration_s for o in t.options), t.id))
    for task in order:
        best = None
        for index, option in enumerate(task.options):
            begin = max((free.get(r, 0.0) for r in option.resources), default=0.0)
            key = (begin + option.duration_s, index)
            if best is None or key < best[0]:
                best = (key, index, begin)
        _, index, begin = best
        choice[task.id], start[task.id] = index, begin
        for r in task.options[index].resources:
            free[r] = begin + task.options[index].busy_s
    return Schedule(choice, start, solver="greedy")
