"""Every solver returns a valid schedule, deterministically; the exact ones reach the brute-force optimum."""

from __future__ import annotations

import ast
import itertools
import random
import signal
from pathlib import Path

import pytest

import xmesh_plan.planner.scheduling as scheduling_module
from xmesh_plan.planner.compile import compile_plan, task_options
from xmesh_plan.planner.scheduling import Option, Schedule, SchedulingTask, check_schedule, timetable
from xmesh_plan.planner.solvers import SOLVERS, solve
from xmesh_plan.planner.solvers.auto import solve_auto
from xmesh_plan.planner.solvers.bound import least_tail, schedule_lower_bound
from xmesh_plan.planner.solvers.cpsat import run_cpsat
from xmesh_plan.planner.solvers.list_backfill import solve_list_backfill
from xmesh_plan.planner.solvers.randomized_greedy import solve_randomized_greedy
from xmesh_plan.planner.solvers.size import solve_size
from xmesh_plan.planner.unit_tasks import decompose
from xmesh_plan.planner.verify import verify_plan
from xmesh_plan.schemas import DeviceMesh, Placement, ReshardingProblem

FAST = ["naive", "size", "greedy", "randomized-greedy", "dfs", "list-backfill"]


def random_tasks(n: int, seed: int, src_hosts: int = 3, dst_hosts: int = 3, tails: bool = False) -> list[SchedulingTask]:
    """Tasks with 1-2 candidate sender hosts and 1-2 receiver hosts, durations 0.1-0.5 s; with `tails`, each option's
    last 0.05-0.15 s is its last message's latency (its resources are free by then)."""
    rng = random.Random(seed)
    tasks = []
    for i in range(n):
        senders = sorted(rng.sample(range(src_hosts), rng.choice([1, 2])))
        receivers = rng.sample(range(src_hosts, src_hosts + dst_hosts), rng.choice([1, 2]))
        duration = rng.choice([0.1, 0.2, 0.3, 0.5])
        recv = {(h, "recv") for h in receivers}
        tasks.append(SchedulingTask(i, tuple(Option(h, 4 * h, duration + (tail := rng.choice([0.05, 0.15]) if tails else 0.0),
                                                    frozenset({(h, "send")} | recv), tail) for h in senders)))
    return tasks


def brute_force(tasks: list[SchedulingTask]) -> float:
    """The optimum: every sender choice, every dispatch order (an optimal schedule sorted by start is one)."""
    best = float("inf")
    for picks in itertools.product(*(range(len(t.options)) for t in tasks)):
        choice = {t.id: i for t, i in zip(tasks, picks)}
        for order in itertools.permutations([t.id for t in tasks]):
            start = timetable(tasks, choice, list(order))
            best = min(best, Schedule(choice, start, "brute").makespan(tasks))
    return best


def mesh(shape, first_host, per_host=4):
    return DeviceMesh(shape=shape, devices=tuple((first_host + h) * per_host + g for h in range(shape[0]) for g in range(shape[1])))


def problem(src_spec, dst_spec, src_mesh=(2, 4), dst_mesh=(2, 4), shape=(1024, 1024, 512)):
    return ReshardingProblem(shape=shape, dtype="int32", src=Placement(mesh=mesh(src_mesh, 0), spec=src_spec),
                             dst=Placement(mesh=mesh(dst_mesh, src_mesh[0]), spec=dst_spec))


def scheduling_tasks(p: ReshardingProblem) -> list[SchedulingTask]:
    return [o.scheduling for o in task_options(p, decompose(p), "broadcast")]


@pytest.mark.parametrize("name", FAST + ["cpsat", "auto"])
def test_every_solver_gives_a_valid_schedule_above_the_bound(name):
    for seed in range(3):
        tasks = random_tasks(12, seed)
        schedule = solve(tasks, name, seed=seed, time_limit_s=0.2)
        check_schedule(tasks, schedule)
        assert schedule.makespan(tasks) >= schedule_lower_bound(tasks) - 1e-9
        if schedule.proven_bound_s is not None:
            assert schedule.proven_bound_s <= schedule.makespan(tasks) + 1e-9


@pytest.mark.parametrize("name", FAST + ["cpsat", "auto"])
def test_solvers_are_deterministic(name):
    tasks = random_tasks(16, 7)
    first = solve(tasks, name, seed=3, time_limit_s=0.2)
    second = solve(tasks, name, seed=3, time_limit_s=0.2)
    assert (first.choice, first.start_s) == (second.choice, second.start_s)


@pytest.mark.parametrize("seed", range(6))
def test_exact_solvers_reach_the_brute_force_optimum(seed):
    tasks = random_tasks(5, 100 + seed, src_hosts=2, dst_hosts=2)
    optimum = brute_force(tasks)
    for name in ("dfs", "cpsat", "auto"):
        assert solve(tasks, name, time_limit_s=1.0).makespan(tasks) == pytest.approx(optimum, rel=1e-3), name


def test_heuristics_never_beat_the_brute_force_optimum():
    tasks = random_tasks(5, 42, src_hosts=2, dst_hosts=2)
    optimum = brute_force(tasks)
    for name in FAST:
        assert solve(tasks, name).makespan(tasks) >= optimum - 1e-9


@pytest.mark.parametrize("seed", range(4))
def test_auto_is_never_worse_than_the_heuristics_it_ran(seed):
    tasks = random_tasks(30, seed)
    auto = solve_auto(tasks, seed=seed, time_limit_s=0.3)
    heuristics = [solve_list_backfill(tasks), solve_size(tasks), solve_randomized_greedy(tasks, seed=seed, time_limit_s=0.1)]
    assert auto.makespan(tasks) <= min(h.makespan(tasks) for h in heuristics) + 1e-12
    assert float(auto.details["gap_to_proven_bound"]) >= 0
    assert auto.details["winner"] in SOLVERS


@pytest.mark.parametrize("name", FAST + ["cpsat", "auto"])
def test_solvers_overlap_tails_but_never_busy_time(name):
    """A task holds its resources for `busy_s`; its tail (its last message's latency) may overlap the next task on the
    same side. Every solver's schedule is valid under that rule and no shorter than the bound, which counts the tail."""
    for seed in range(3):
        tasks = random_tasks(12, seed, tails=True)
        schedule = solve(tasks, name, seed=seed, time_limit_s=0.2)
        check_schedule(tasks, schedule)
        assert schedule.makespan(tasks) >= schedule_lower_bound(tasks) - 1e-9


def test_timetable_frees_a_side_when_the_last_byte_left():
    """Two tasks on one send side, each busy 2 s then 1 s in flight: the second starts at 2 s, not at 3 s, and the
    schedule ends at 5 s; check_schedule refuses a start inside the first one's busy time."""
    option = Option(0, 0, 3.0, frozenset({(0, "send")}), 1.0)
    tasks = [SchedulingTask(0, (option,)), SchedulingTask(1, (option,))]
    assert option.busy_s == 2.0
    start = timetable(tasks, {0: 0, 1: 0}, [0, 1])
    assert start == {0: 0.0, 1: 2.0}
    schedule = Schedule({0: 0, 1: 0}, start, "test")
    assert schedule.makespan(tasks) == 5.0
    check_schedule(tasks, schedule)
    with pytest.raises(ValueError, match="overlap on host 0 send"):
        check_schedule(tasks, Schedule({0: 0, 1: 0}, {0: 0.0, 1: 1.5}, "test"))
    assert schedule_lower_bound(tasks) == 5.0  # 4 s busy on the side, then the last one's second in flight


@pytest.mark.parametrize("seed", range(6))
def test_bound_with_tails_is_below_the_brute_force_optimum(seed):
    tasks = random_tasks(5, seed, src_hosts=2, dst_hosts=2, tails=True)
    optimum = brute_force(tasks)
    assert schedule_lower_bound(tasks) <= optimum + 1e-9
    outcome = run_cpsat(tasks, time_limit_s=1.0)
    assert outcome.proven_bound_s <= optimum + 1e-9 <= outcome.schedule.makespan(tasks) + 2e-9


def test_cpsat_bound_is_a_true_lower_bound_and_it_finds_a_solution():
    tasks = random_tasks(5, 5, src_hosts=2, dst_hosts=2)
    outcome = run_cpsat(tasks, time_limit_s=1.0)
    assert outcome.schedule is not None
    assert outcome.proven_bound_s <= brute_force(tasks) + 1e-9 <= outcome.schedule.makespan(tasks) + 2e-9


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the kernel's signal dispositions from /proc (Linux)")
def test_cpsat_leaves_ctrl_c_to_the_caller():
    """CP-SAT catches SIGINT while it solves and, unless told not to, leaves it at the default afterwards, so a later
    Ctrl-C killed the process without its cleanup (the emulated cluster's namespaces stayed). The kernel's view, read
    from /proc, keeps Python's handler (installed here: a shell without job control starts pytest with SIGINT ignored)."""
    def caught() -> bool:
        mask = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("SigCgt:"))
        return bool(int(mask.split()[1], 16) >> 1 & 1)  # bit 1: signal 2, SIGINT

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert caught()
        assert run_cpsat(random_tasks(5, 5, src_hosts=2, dst_hosts=2), time_limit_s=1.0).schedule is not None
        assert caught()
    finally:
        signal.signal(signal.SIGINT, previous)


def test_case3_reaches_the_edge_colouring_optimum():
    """R S0 R -> S0 R R: each sender host feeds both receiver hosts; ordering lets both send at once. Naive's order
    keeps a side busy 1.5 times as long; the last message's latency shows once either way (a side is free once a
    message has left, `Option.tail_s`)."""
    tasks = scheduling_tasks(problem("R S0 R", "S0 R R"))
    bound, tail = schedule_lower_bound(tasks), least_tail(tasks)
    assert tail > 0
    assert solve(tasks, "naive").makespan(tasks) == pytest.approx(1.5 * (bound - tail) + tail, rel=1e-6)
    for name in ("randomized-greedy", "dfs", "list-backfill", "cpsat", "auto"):
        assert solve(tasks, name).makespan(tasks) == pytest.approx(bound, rel=1e-9), name


def test_case4_64_tasks_auto_meets_the_bound():
    tasks = scheduling_tasks(problem("R S01 R", "S01 R R"))
    assert len(tasks) == 64
    assert solve(tasks, "auto").makespan(tasks) == pytest.approx(schedule_lower_bound(tasks), rel=1e-9)


def test_size_balances_senders_where_naive_does_not():
    """R R R -> S0 R R: both receiver hosts' slices are on both sender hosts; naive sends all from host 0. Size keeps
    each send side busy half as long; the last message's latency shows once in both (`Option.tail_s`)."""
    tasks = scheduling_tasks(problem("R R R", "S0 R R"))
    tail = least_tail(tasks)
    naive = solve(tasks, "naive").makespan(tasks)
    assert solve(tasks, "size").makespan(tasks) == pytest.approx((naive - tail) / 2 + tail, rel=1e-6)


def test_unknown_solver_lists_the_valid_names():
    with pytest.raises(ValueError, match="list-backfill"):
        solve(random_tasks(2, 0), "magic")


def test_scheduling_imports_no_solver():
    """The solvers import `planner.scheduling`'s types, so it must not import them back (no cycle)."""
    tree = ast.parse(Path(scheduling_module.__file__).read_text())
    imported = [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    imported += [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    assert not [name for name in imported if "solvers" in name], imported


def test_compile_defaults_to_auto_and_the_plan_verifies():
    plan = compile_plan(problem("R S0 R", "R R S0"))
    assert plan.solver.name == "auto"
    assert plan.predicted_seconds <= 1.05 * plan.lower_bound_seconds
    verify_plan(plan)
    assert compile_plan(problem("R S0 R", "R R S0")).to_json() == plan.to_json()


def test_cpsat_plans_do_not_depend_on_the_process_string_hashing(tmp_path):
    """CP-SAT's model was built by walking each option's resources, a frozenset of (host, side) whose order
    follows Python's string hashing, different in every process: the same problem then gave different plans
    from one run to the next (the default solver runs CP-SAT among others). Three processes with three hash
    seeds must write one plan."""
    import json
    import os
    import subprocess
    import sys

    problem = {"name": "r10", "src_mesh": {"shape": [4, 1], "first_host": 0}, "dst_mesh": {"shape": [2, 1], "first_host": 4},
               "cluster": {"devices_per_host": 1},
               "tensors": [{"name": "t0", "shape": [3, 1], "dtype": "float16", "src": "S0 S1", "dst": "S0 R"},
                           {"name": "t1", "shape": [13, 7], "dtype": "int32", "src": "S0 R", "dst": "S1 R"},
                           {"name": "t2", "shape": [64, 13], "dtype": "int8", "src": "S0 S1", "dst": "S0 S1"},
                           {"name": "t3", "shape": [17, 2], "dtype": "int32", "src": "S0 R", "dst": "S1 R"},
                           {"name": "t4", "shape": [7, 64], "dtype": "int32", "src": "S0 S1", "dst": "S1 R"}]}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(problem))
    plans = set()
    for seed in ("1", "2", "3"):
        result = subprocess.run([sys.executable, "-m", "xmesh_plan.planner.cli", "compile", str(path),
                                 "--bucket-mb", "0.001", "-o", "-"], capture_output=True, text=True, timeout=240,
                                env={**os.environ, "PYTHONHASHSEED": seed})
        assert result.returncode == 0, result.stderr[-2000:]
        plans.add(result.stdout)
    assert len(plans) == 1


def test_dfs_returns_its_starting_schedule_above_the_tasks_it_can_search():
    """The search recurses once per placed task: on more tasks than MAX_SEARCH_TASKS it returns the list-backfill
    schedule it starts from, valid and not claimed complete, instead of exhausting Python's recursion limit."""
    from xmesh_plan.planner.solvers.dfs import MAX_SEARCH_TASKS

    tasks = random_tasks(MAX_SEARCH_TASKS * 2 + 200, 3, src_hosts=2, dst_hosts=5)
    schedule = solve(tasks, "dfs", time_limit_s=0.5)
    check_schedule(tasks, schedule)
    assert schedule.details["complete"] == "false" and schedule.makespan(tasks) >= schedule.proven_bound_s


def test_booked_together_keeps_one_resource_per_class():
    """Resources named by exactly the same sets are one class, answered by its first resource; a resource named by
    other sets too stays its own class."""
    from xmesh_plan.planner.solvers.calendar import booked_together

    a = frozenset({(0, "send"), (1, "recv"), (1, "out:4"), (1, "in:5")})
    b = frozenset({(2, "send"), (1, "recv"), (1, "out:4"), (1, "in:5")})
    c = frozenset({(0, "send"), (1, "recv")})
    classes = booked_together([a, b, c, a])
    assert classes == {a: ((0, "send"), (1, "in:5"), (1, "recv")), b: ((1, "in:5"), (1, "recv"), (2, "send")),
                       c: ((0, "send"), (1, "recv"))}


def _ask_every_resource_each_round(self, resources, duration, not_before=0.0):
    """`Calendar.earliest_start` as a plain fixed point: every resource asked in every round until a round moves nothing."""
    from bisect import bisect_right

    from xmesh_plan.planner.solvers.calendar import EPS

    t, moved = not_before, True
    while moved:
        moved = False
        for r in resources:
            ends = self._ends.get(r)
            if ends:
                i = bisect_right(ends, t + EPS)
                if i < len(ends) and self._starts[r][i] < t + duration - EPS:
                    t, moved = ends[i], True
    return t


@pytest.mark.parametrize("seed", range(8))
def test_backfill_by_classes_places_tasks_as_asking_every_resource(seed):
    """One calendar per class of resources booked together gives every task the choice and start that asking each of
    its resources gives (broadcasts holding a chain of ports inside the receiving host, bundles its NIC side only;
    tasks repeat as a model's layers do). Durations come from a continuum, as a model's do: where intervals of two
    resources end within EPS of each other, the order the resources are asked in picks one of the two ends, for a
    calendar per resource asked in hash order as well."""
    from xmesh_plan.planner.solvers import list_backfill
    from xmesh_plan.planner.solvers.calendar import Calendar, booked_together
    from xmesh_plan.planner.solvers.list_backfill import backfill, longest_first, most_constrained_first

    rng = random.Random(seed)
    tasks = []
    for i in range(160):
        if i >= 80:  # the first 80 again, as a model's next layers
            tasks.append(SchedulingTask(i, tasks[i - 80].options))
            continue
        dst = rng.choice([3, 4])
        ports = {(dst, f"out:{4 * dst + k}") for k in range(3)} | {(dst, f"in:{4 * dst + k + 1}") for k in range(3)}
        senders = sorted(rng.sample(range(3), rng.choice([1, 2, 3])))
        duration = rng.uniform(0.1, 0.5)
        held = ports if rng.random() < 0.5 else set()
        tasks.append(SchedulingTask(i, tuple(Option(h, 4 * h, duration + 0.05, frozenset({(h, "send"), (dst, "recv")} | held), 0.05)
                                             for h in senders)))
    for priority in (longest_first, most_constrained_first):
        schedule = backfill(tasks, priority)
        check_schedule(tasks, schedule)
        with pytest.MonkeyPatch.context() as patch:  # the reference: a calendar per resource, every one asked each round
            patch.setattr(list_backfill, "booked_together", lambda sets: {s: tuple(sorted(s)) for s in sets})
            patch.setattr(Calendar, "earliest_start", _ask_every_resource_each_round)
            reference = backfill(tasks, priority)
        assert (schedule.choice, schedule.start_s) == (reference.choice, reference.start_s)
    classes = booked_together(o.resources for t in tasks for o in t.options)
    assert max(map(len, classes)) == 8 and max(map(len, classes.values())) == 3  # send side, receive side, the six ports
