"""`cpsat`: the exact model, solved by OR-Tools CP-SAT within a deterministic time limit.

One interval per task, one optional interval per candidate sender with a presence literal (exactly
one present) as long as the option keeps its resources busy, one `NoOverlap` per resource over the intervals
that hold it, minimise the makespan (each task's end: its start plus its whole duration, tail included).
Durations become integer ticks rounded down, so the solver's bound is a true bound on the real
problem; the answer is then re-timed with exact durations in the solver's start order, so it is
feasible as given. Determinism: a fixed worker count, a fixed random seed, and
`max_deterministic_time` instead of a wall-clock limit; with the same inputs the same schedule comes
back on any machine load (`interleave_search` makes the multi-worker search deterministic).

Measured on this 2-core machine (random 64-task instances, 4+4 hosts, 1-2 senders, 1-2 receivers):
a deterministic second costs 5-10 wall seconds here; hinting with the `list-backfill` schedule was
neutral to slightly better (1.0011 vs 1.0017 of the bound at 1 worker, both optimal at 2), while
capping the horizon at the heuristic's makespan made CP-SAT 3-4x slower to find anything, so
`auto` hints but does not cap the horizon.
"""

from __future__ import annotations

from dataclasses import dataclass

from ortools.sat.python import cp_model

from ..scheduling import Schedule, SchedulingTask, timetable
from .bound import schedule_lower_bound
from .list_backfill import solve_list_backfill

TICKS_PER_LONGEST_TASK = 10_000
NUM_WORKERS = 2


def _tick(tasks: list[SchedulingTask]) -> float:
    longest = max(o.duration_s for t in tasks for o in t.options)
    return longest / TICKS_PER_LONGEST_TASK if longest > 0 else 1.0


def _build(tasks: list[SchedulingTask], tick: float, horizon: int):
    model = cp_model.CpModel()
    start, presence, per_resource = {}, {}, {}
    end_all = model.new_int_var(0, horizon, "makespan")
    for t in tasks:
        start[t.id] = model.new_int_var(0, horizon, f"start[{t.id}]")
        literals = []
        for i, option in enumerate(t.options):
            busy, length = int(option.busy_s / tick), int(option.duration_s / tick)
            lit = model.new_bool_var(f"use[{t.id},{i}]") if len(t.options) > 1 else model.new_constant(1)
            interval = model.new_optional_fixed_size_interval_var(start[t.id], busy, lit, f"run[{t.id},{i}]")
            for r in sorted(option.resources):  # a frozenset's order follows string hashing, which differs per process
                per_resource.setdefault(r, []).append(interval)
            model.add(end_all >= start[t.id] + length).only_enforce_if(lit)
            presence[t.id, i] = lit
            literals.append(lit)
        model.add_exactly_one(literals)
    for intervals in per_resource.values():
        if len(intervals) > 1:
            model.add_no_overlap(intervals)
    model.minimize(end_all)
    return model, start, presence


def _add_hint(model, start, presence, tasks, hint: Schedule, tick: float) -> None:
    for t in tasks:
        model.add_hint(start[t.id], int(hint.start_s[t.id] / tick))
        for i in range(len(t.options)):
            if len(t.options) > 1:
                model.add_hint(presence[t.id, i], int(hint.choice[t.id] == i))


@dataclass(frozen=True, slots=True)
class CpsatOutcome:
    """What one CP-SAT run gave: a schedule (None if none was found in time), the proven bound, the status."""

    schedule: Schedule | None
    proven_bound_s: float
    status: str


def run_cpsat(tasks: list[SchedulingTask], *, seed: int = 0, time_limit_s: float = 1.0,
              hint: Schedule | None = None, upper_bound_s: float | None = None) -> CpsatOutcome:
    """Solve within `time_limit_s` deterministic seconds.

    `upper_bound_s` (a known schedule's makespan) shrinks the horizon; `hint` seeds the search.
    """
    if not tasks:
        return CpsatOutcome(Schedule({}, {}, solver="cpsat", proven_bound_s=0.0), 0.0, "OPTIMAL")
    tick = _tick(tasks)
    horizon_s = upper_bound_s if upper_bound_s is not None else sum(max(o.duration_s for o in t.options) for t in tasks)
    model, start, presence = _build(tasks, tick, int(horizon_s / tick) + 1)
    if hint is not None:
        _add_hint(model, start, presence, tasks, hint, tick)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = NUM_WORKERS
    solver.parameters.random_seed = seed
    solver.parameters.max_deterministic_time = time_limit_s
    solver.parameters.interleave_search = True  # deterministic search whatever the worker count
    solver.parameters.catch_sigint_signal = False  # else CP-SAT leaves SIGINT at its default: Ctrl-C would kill without cleanup
    status = solver.solve(model)
    bound = max(solver.best_objective_bound * tick, schedule_lower_bound(tasks))
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return CpsatOutcome(None, bound, solver.status_name(status))
    choice = {t.id: next(i for i in range(len(t.options)) if solver.boolean_value(presence[t.id, i])) for t in tasks}
    order = sorted((solver.value(start[t.id]), t.id) for t in tasks)
    starts = timetable(tasks, choice, [task_id for _, task_id in order])
    schedule = Schedule(choice, starts, solver="cpsat", proven_bound_s=bound)
    makespan = schedule.makespan(tasks)
    bound = min(bound, makespan)
    details = {"status": solver.status_name(status), "deterministic_time_limit": f"{time_limit_s:g}",
               "workers": str(NUM_WORKERS), "hint": str(hint is not None).lower(),
               "gap_to_proven_bound": f"{(makespan / bound - 1) if bound > 0 else 0.0:.6f}"}
    schedule = Schedule(choice, starts, solver="cpsat", proven_bound_s=bound, details=details)
    return CpsatOutcome(schedule, bound, solver.status_name(status))


def solve_cpsat(tasks: list[SchedulingTask], *, seed: int = 0, time_limit_s: float = 1.0) -> Schedule:
    """CP-SAT alone; if it finds nothing in time, the `list-backfill` schedule with CP-SAT's bound."""
    outcome = run_cpsat(tasks, seed=seed, time_limit_s=time_limit_s)
    if outcome.schedule is not None:
        return outcome.schedule
    fallback = solve_list_backfill(tasks)
    details = {"status": outcome.status, "fallback": "list-backfill", "deterministic_time_limit": f"{time_limit_s:g}"}
    return Schedule(fallback.choice, fallback.start_s, solver="cpsat", proven_bound_s=outcome.proven_bound_s, details=details)
