"""Load-balance-and-order solvers, one module each, chosen by name from `SOLVERS`.

Every solver takes the scheduling tasks and returns a `Schedule`: a sender option and a start time
per task, with no two tasks overlapping on a resource. All are deterministic for a given seed.
"""

from __future__ import annotations

from typing import Callable

from ..scheduling import Schedule, SchedulingTask, check_schedule
from .auto import solve_auto
from .cpsat import solve_cpsat
from .dfs import solve_dfs
from .greedy import greedy_least_loaded
from .list_backfill import solve_list_backfill
from .naive import solve_naive
from .randomized_greedy import solve_randomized_greedy
from .size import solve_size

SOLVERS: dict[str, Callable[..., Schedule]] = {
    "auto": solve_auto,
    "naive": solve_naive,
    "size": solve_size,
    "greedy": greedy_least_loaded,
    "randomized-greedy": solve_randomized_greedy,
    "dfs": solve_dfs,
    "list-backfill": solve_list_backfill,
    "cpsat": solve_cpsat,
}


def get_solver(name: str) -> Callable[..., Schedule]:
    """The solver registered under `name`; the error lists the valid names."""
    if name not in SOLVERS:
        raise ValueError(f"unknown solver {name!r}; choose one of: {', '.join(SOLVERS)}")
    return SOLVERS[name]


def solve(tasks: list[SchedulingTask], solver: str = "auto", *, seed: int = 0, time_limit_s: float = 10.0) -> Schedule:
    """Run a solver by name and check its answer (every task placed, no overlap on any resource)."""
    schedule = get_solver(solver)(tasks, seed=seed, time_limit_s=time_limit_s)
    check_schedule(tasks, schedule)
    return schedule
