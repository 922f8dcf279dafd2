"""`naive`: every task from its lowest-numbered candidate sender host, dispatched in task-id order.

This is Alpa's `no_loadbalance`: no balancing and an arbitrary global order, the ablation's floor.
"""

from __future__ import annotations

from ..scheduling import Schedule, SchedulingTask, timetable


def solve_naive(tasks: list[SchedulingTask], *, seed: int = 0, time_limit_s: float = 1.0) -> Schedule:
    del seed, time_limit_s
    choice = {t.id: min(range(len(t.options)), key=lambda i: (t.options[i].sender_host, i)) for t in tasks}
    order = [t.id for t in sorted(tasks, key=lambda t: t.id)]
    return Schedule(choice, timetable(tasks, choice, order), solver="naive")
