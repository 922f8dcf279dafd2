"""`list-backfill`: list scheduling that places each task in the earliest gap that fits it.

Tasks are taken in a priority order; each goes to the candidate sender that lets it finish first,
at the earliest time all its resources are free for as long as it keeps them busy, even before tasks placed
earlier (backfilling). Unlike an append-only greedy, a short task no longer waits behind a long one
that happens to be placed first. Two priority orders are tried and the shorter schedule kept:
longest first, and most constrained (fewest senders, most resources) first.
"""

from __future__ import annotations

from typing import Callable

from ..scheduling import Schedule, SchedulingTask
from .calendar import Calendar, booked_together

Priority = Callable[[SchedulingTask], tuple]


def longest_first(task: SchedulingTask) -> tuple:
    return (-max(o.duration_s for o in task.options), task.id)


def most_constrained_first(task: SchedulingTask) -> tuple:
    return (len(task.options), -len(task.options[0].resources), -max(o.duration_s for o in task.options), task.id)


def backfill(tasks: list[SchedulingTask], priority: Priority = longest_first, preset: dict[int, int] | None = None) -> Schedule:
    """Place tasks in `priority` order into the earliest gaps; `preset` fixes some tasks' sender choice."""
    calendar = Calendar()
    classes = booked_together(o.resources for t in tasks for o in t.options)
    choice: dict[int, int] = {}
    start: dict[int, float] = {}
    for task in sorted(tasks, key=priority):
        indices = [preset[task.id]] if preset and task.id in preset else range(len(task.options))
        best = None
        for i in indices:
            option = task.options[i]
            begin = calendar.earliest_start(classes[option.resources], option.busy_s)
            key = (begin + option.duration_s, i)
            if best is None or key < best[0]:
                best = (key, i, begin)
        _, i, begin = best
        choice[task.id], start[task.id] = i, begin
        calendar.book(classes[task.options[i].resources], begin, task.options[i].busy_s)
    return Schedule(choice, start, solver="list-backfill")


def solve_list_backfill(tasks: list[SchedulingTask], *, seed: int = 0, time_limit_s: float = 1.0) -> Schedule:
    del seed, time_limit_s
    candidates = [backfill(tasks, p) for p in (longest_first, most_constrained_first)]
    return min(candidates, key=lambda s: s.makespan(tasks))
