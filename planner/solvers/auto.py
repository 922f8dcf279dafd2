"""`auto` (the default): fast heuristics first, CP-SAT only when they leave a gap, keep the best.

The heuristics (`list-backfill`, `size`, `randomized-greedy`, and `dfs` on small instances) run
first. If the best of them already meets the lower bound it is optimal and we stop. Otherwise CP-SAT
runs with a deterministic budget that grows with the task count (capped by `time_limit_s`), hinted
with the best heuristic schedule, and the shortest schedule wins; ties go to the
earlier entry of `PREFERENCE`. The plan records the winner, every candidate's makespan, the proven
bound and the gap; never a wall-clock time, so plans stay byte-identical.
"""

from __future__ import annotations

from ..scheduling import Schedule, SchedulingTask
from .bound import schedule_lower_bound
from .cpsat import run_cpsat
from .dfs import solve_dfs
from .list_backfill import solve_list_backfill
from .randomized_greedy import solve_randomized_greedy
from .size import solve_size

EPS = 1e-9
DFS_MAX_TASKS = 24
GREEDY_MAX_TASKS = 2000
PREFERENCE = ("list-backfill", "dfs", "randomized-greedy", "size", "cpsat")


CPSAT_MAX_TASKS = 4000  # above this, building and searching the model costs minutes here for a few percent


def cpsat_budget(num_tasks: int, time_limit_s: float) -> float:
    """Deterministic seconds for CP-SAT: 0.05 plus 1 per 10000 tasks, at most the time limit.

    On this shared 2-core machine one deterministic second took 5-30 wall seconds, so the budget is
    kept small; the heuristics already give the answer whenever they meet the bound."""
    return min(time_limit_s, 0.05 + num_tasks / 10000)


def _heuristics(tasks: list[SchedulingTask], seed: int, time_limit_s: float) -> list[Schedule]:
    out = [solve_list_backfill(tasks), solve_size(tasks)]
    if len(tasks) <= GREEDY_MAX_TASKS:
        out.append(solve_randomized_greedy(tasks, seed=seed, time_limit_s=min(time_limit_s, 0.1)))
    if len(tasks) <= DFS_MAX_TASKS:
        out.append(solve_dfs(tasks, time_limit_s=min(time_limit_s, 0.2)))
    return out


def _fmt(seconds: float) -> str:
    return f"{seconds:.9f}"


def solve_auto(tasks: list[SchedulingTask], *, seed: int = 0, time_limit_s: float = 10.0) -> Schedule:
    floor = schedule_lower_bound(tasks)
    candidates = _heuristics(tasks, seed, time_limit_s)
    spans: dict[int, float] = {}  # id of a candidate -> its makespan, found once (a pass over every task)

    def makespan(s: Schedule) -> float:
        if id(s) not in spans:
            spans[id(s)] = s.makespan(tasks)
        return spans[id(s)]

    best = min(candidates, key=lambda s: (makespan(s), PREFERENCE.index(s.solver)))
    proven, details = floor, {}
    if len(tasks) > CPSAT_MAX_TASKS:
        details["cpsat_status"] = f"skipped: more than {CPSAT_MAX_TASKS} tasks"
    elif makespan(best) > floor * (1 + EPS) + EPS:
        budget = cpsat_budget(len(tasks), time_limit_s)
        outcome = run_cpsat(tasks, seed=seed, time_limit_s=budget, hint=best)
        proven = max(proven, outcome.proven_bound_s)
        details |= {"cpsat_status": outcome.status, "cpsat_deterministic_limit": f"{budget:g}"}
        if outcome.schedule is not None:
            candidates.append(outcome.schedule)
        best = min(candidates, key=lambda s: (makespan(s), PREFERENCE.index(s.solver)))
    else:
        details["cpsat_status"] = "skipped: a heuristic met the lower bound"
    makespan_s = makespan(best)
    proven = min(proven, makespan_s)
    details |= {
        "winner": best.solver,
        "candidates": " ".join(f"{s.solver}={_fmt(makespan(s))}" for s in candidates),
        "gap_to_proven_bound": f"{(makespan_s / proven - 1) if proven > 0 else 0.0:.6f}",
        "solve_time": "not recorded in plans (byte-identical); see `xmesh-plan compile` output",
    }
    return Schedule(best.choice, best.start_s, solver="auto", proven_bound_s=proven, details=details)
