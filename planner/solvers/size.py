"""`size`: balance bytes over sender hosts, ignore order (the paper's "load balance only").

Longest task first, each to the candidate sender whose send side carries the least load so far,
charging the time the task keeps it busy (Alpa's `loadbalance_size` charged the whole tile's size instead of
the slice's, which misjudges load when slices differ). Tasks are then dispatched in task-id order,
like `naive`, so the two differ only in the sender choice.
"""

from __future__ import annotations

from ..scheduling import Resource, Schedule, SchedulingTask, timetable


def _send_sides(resources: frozenset[Resource], sender_host: int) -> list[Resource]:
    return sorted(r for r in resources if r[0] == sender_host and r[1].startswith("send")) or [(sender_host, "send")]


def balance_senders(tasks: list[SchedulingTask]) -> dict[int, int]:
    """Option index per task: longest first to the least-loaded send side, ties to the lower index. Each option's send
    sides and each task's longest option are found once per distinct option (tasks of one kind of tensor share them)."""
    load: dict[Resource, float] = {}
    choice: dict[int, int] = {}
    longest: dict[int, float] = {}
    sides: dict[int, list[Resource]] = {}
    for task in tasks:
        if id(task.options) not in longest:
            longest[id(task.options)] = max(o.duration_s for o in task.options)
            for o in task.options:
                sides[id(o)] = _send_sides(o.resources, o.sender_host)
    for task in sorted(tasks, key=lambda t: (-longest[id(t.options)], t.id)):
        def cost(i: int) -> tuple[float, int]:
            option = task.options[i]
            return max(load.get(r, 0.0) for r in sides[id(option)]) + option.duration_s, i
        best = min(range(len(task.options)), key=cost) if len(task.options) > 1 else 0  # a sole option needs no costing
        choice[task.id] = best
        option = task.options[best]
        for r in sides[id(option)]:
            load[r] = load.get(r, 0.0) + option.busy_s
    return choice


def solve_size(tasks: list[SchedulingTask], *, seed: int = 0, time_limit_s: float = 1.0) -> Schedule:
    del seed, time_limit_s
    choice = balance_senders(tasks)
    order = [t.id for t in sorted(tasks, key=lambda t: t.id)]
    return Schedule(choice, timetable(tasks, choice, order), solver="size")
