"""`dfs`: depth-first search over which task goes next and from which sender, with a true bound.

A node is a partial dispatch order: every placed task started as soon as its resources were free
(append-only). Children extend it by one (task, sender) pair, earliest finish first; tasks with the
same options are interchangeable, so only the first of each kind is branched on. A branch is cut
when its bound reaches the best makespan found: the later of the current makespan and, per
resource, its free time plus the mandatory busy time still to come (Alpa's DFS cut on a greedy
estimate, which is not a bound, and failed when time ran out). The search starts from the
`list-backfill` schedule and stops after a node budget set by `time_limit_s`, so it always returns; above
MAX_SEARCH_TASKS tasks it returns that schedule unsearched.
"""

from __future__ import annotations

from ..scheduling import Resource, Schedule, SchedulingTask
from .bound import least_busy, mandatory_resources, schedule_lower_bound, shortest
from .list_backfill import solve_list_backfill

NODES_PER_SECOND = 40_000  # search nodes per second of time limit (deterministic budget)
MAX_SEARCH_TASKS = 500  # the search goes one call deeper per placed task: above this, Python's recursion limit is near
EPS = 1e-12


class _Search:
    def __init__(self, tasks: list[SchedulingTask], budget: int, incumbent: Schedule):
        self.tasks = sorted(tasks, key=lambda t: (-shortest(t), t.id))
        self.kind = {t.id: tuple(t.options) for t in self.tasks}
        self.mandatory = {t.id: mandatory_resources(t) for t in self.tasks}
        self.left: dict[Resource, float] = {}
        for t in self.tasks:
            for r in self.mandatory[t.id]:
                self.left[r] = self.left.get(r, 0.0) + least_busy(t)
        self.free: dict[Resource, float] = {}
        self.budget, self.nodes = budget, 0
        self.best, self.best_plan = incumbent.makespan(tasks), None
        self.floor = schedule_lower_bound(tasks)
        self.path: list[tuple[int, int, float]] = []

    def bound(self, makespan: float) -> float:
        return max([makespan] + [self.free.get(r, 0.0) + load for r, load in self.left.items()])

    def run(self, remaining: list[SchedulingTask], makespan: float) -> None:
        if self.nodes >= self.budget or self.best <= self.floor + EPS:
            return
        self.nodes += 1
        if not remaining:
            if makespan < self.best - EPS:
                self.best, self.best_plan = makespan, list(self.path)
            return
        if self.bound(makespan) >= self.best - EPS:
            return
        for end, index, i, begin in self._children(remaining):
            task = remaining[index]
            option = task.options[i]
            saved = {r: self.free.get(r, 0.0) for r in option.resources}
            for r in option.resources:
                self.free[r] = begin + option.busy_s
            for r in self.mandatory[task.id]:
                self.left[r] -= least_busy(task)
            self.path.append((task.id, i, begin))
            self.run(remaining[:index] + remaining[index + 1:], max(makespan, end))
            self.path.pop()
            for r in self.mandatory[task.id]:
                self.left[r] += least_busy(task)
            self.free.update(saved)

    def _children(self, remaining: list[SchedulingTask]) -> list[tuple[float, int, int, float]]:
        seen, out = set(), []
        for index, task in enumerate(remaining):
            if self.kind[task.id] in seen:
                continue
            seen.add(self.kind[task.id])
            for i, option in enumerate(task.options):
                begin = max((self.free.get(r, 0.0) for r in option.resources), default=0.0)
                out.append((begin + option.duration_s, index, i, begin))
        return sorted(out)


def solve_dfs(tasks: list[SchedulingTask], *, seed: int = 0, time_limit_s: float = 1.0) -> Schedule:
    del seed
    incumbent = solve_list_backfill(tasks)
    if len(tasks) > MAX_SEARCH_TASKS:
        return Schedule(incumbent.choice, incumbent.start_s, solver="dfs", proven_bound_s=schedule_lower_bound(tasks),
                        details={"nodes": "0", "complete": "false", "found_by": "list-backfill",
                                 "skipped": f"more than {MAX_SEARCH_TASKS} tasks"})
    search = _Search(tasks, max(1, int(NODES_PER_SECOND * time_limit_s)), incumbent)
    search.run(list(search.tasks), 0.0)
    complete = search.nodes < search.budget  # the search ran out of branches, so the best is optimal
    details = {"nodes": str(search.nodes), "complete": str(complete).lower()}
    proven = search.best if complete else search.floor
    if search.best_plan is None:
        return Schedule(incumbent.choice, incumbent.start_s, solver="dfs", proven_bound_s=proven,
                        details=details | {"found_by": "list-backfill"})
    choice = {task_id: i for task_id, i, _ in search.best_plan}
    start = {task_id: begin for task_id, _, begin in search.best_plan}
    return Schedule(choice, start, solver="dfs", proven_bound_s=proven, details=details)
