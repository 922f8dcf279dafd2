"""`randomized-greedy`: the paper's iterative pick of the largest set of tasks that can run together.

Each step shuffles the remaining tasks `rounds` times (seeded); one pass walks a shuffle and keeps
every task that has a sender option sharing no resource with the tasks already kept (options tried
least-loaded sender first). The pass covering the most resources wins the step (ties: more total
duration, then the earlier pass). Its tasks join the dispatch order, and start times come from the
append-only timetable, so a step does not wait for the previous step to finish everywhere.
The work is capped by `time_limit_s` through a count of task visits, never the wall clock.
"""

from __future__ import annotations

import random

from ..scheduling import Resource, Schedule, SchedulingTask, timetable

ROUNDS = 100
VISITS_PER_SECOND = 2_000_000  # task visits allowed per second of time limit (deterministic budget)


def _one_pass(order: list[SchedulingTask], load: dict[int, float]) -> tuple[int, float, list[tuple[int, int]]]:
    used: set[Resource] = set()
    picked, total = [], 0.0
    for task in order:
        for i in sorted(range(len(task.options)), key=lambda i: (load.get(task.options[i].sender_host, 0.0), i)):
            option = task.options[i]
            if used.isdisjoint(option.resources):
                used |= option.resources
                picked.append((task.id, i))
                total += option.duration_s
                break
    return len(used), total, picked


def solve_randomized_greedy(tasks: list[SchedulingTask], *, seed: int = 0, time_limit_s: float = 1.0) -> Schedule:
    rng = random.Random(seed)
    by_id = {t.id: t for t in tasks}
    remaining = sorted(by_id)
    rounds = max(1, min(ROUNDS, int(VISITS_PER_SECOND * time_limit_s / max(1, len(tasks)) ** 2)))
    load: dict[int, float] = {}
    choice: dict[int, int] = {}
    order: list[int] = []
    while remaining:
        best = None
        for r in range(rounds):
            shuffled = [by_id[i] for i in remaining]
            rng.shuffle(shuffled)
            covered, total, picked = _one_pass(shuffled, load)
            if best is None or (covered, total) > best[:2]:
                best = (covered, total, picked)
        for task_id, i in best[2]:
            choice[task_id] = i
            order.append(task_id)
            host = by_id[task_id].options[i].sender_host
            load[host] = load.get(host, 0.0) + by_id[task_id].options[i].busy_s
        taken = {task_id for task_id, _ in best[2]}
        remaining = [i for i in remaining if i not in taken]
    return Schedule(choice, timetable(tasks, choice, order), solver="randomized-greedy",
                    details={"rounds_per_step": str(rounds)})
