"""The load-balance-and-order problem every solver answers, and the schedule it returns.

Each unit task has one option per candidate sender host; an option has a duration and the set of
resources (a host's NIC send side or receive side, a device's intra-host out or in port) it holds while they are
busy: from its start until its last message has left, `busy_s`; its last message's latency (`tail_s`) delays the
task's end, not its resources, as in the network (`simulate`: a link carries the next message while one is in
flight). A solver picks one option per task and an order on every resource; a task starts as soon as all its
resources are free. Tasks that share a resource never overlap while busy (the paper's Eq. 3, per resource).
"""

from __future__ import annotations

from dataclasses import dataclass, field

Resource = tuple[int, str]
"""(host, side): side 'send' or 'recv' for the host's NIC sides ('send:<nic>', 'recv:<nic>' per NIC), or
'out:<device>' / 'in:<device>' for a device's intra-host ports (see `planner.strategies.hop_resources`)."""


@dataclass(frozen=True, slots=True)
class Option:
    """Run the task from `sender_host` (device `sender`) for `duration_s`, holding `resources` for all of it but its
    last `tail_s` (the latency of its last message: in flight, it keeps no link busy)."""

    sender_host: int
    sender: int
    duration_s: float
    resources: frozenset[Resource]
    tail_s: float = 0.0

    @property
    def busy_s(self) -> float:
        """How long the option holds its resources from its start."""
        return self.duration_s - self.tail_s

    def __str__(self) -> str:
        return f"h{self.sender_host}:{self.duration_s:.6f}s"


@dataclass(frozen=True, slots=True)
class SchedulingTask:
    """A unit task as solvers see it: an id and its alternative sender options."""

    id: int
    options: tuple[Option, ...]

    def __post_init__(self) -> None:
        if not self.options:
            raise ValueError(f"unit task {self.id} has no sender option; every task needs at least one source device")


@dataclass(frozen=True, slots=True)
class Schedule:
    """A solver's answer: option index and start time per task id, plus who made it."""

    choice: dict[int, int]
    start_s: dict[int, float]
    solver: str
    proven_bound_s: float | None = None
    details: dict[str, str] = field(default_factory=dict)

    def end_s(self, task: SchedulingTask) -> float:
        return self.start_s[task.id] + task.options[self.choice[task.id]].duration_s

    def makespan(self, tasks: list[SchedulingTask]) -> float:
        return max((self.end_s(t) for t in tasks), default=0.0)


def timetable(tasks: list[SchedulingTask], choice: dict[int, int], order: list[int]) -> dict[int, float]:
    """Start times when tasks are dispatched in `order`, each at the earliest time all its resources are free
    (append-only: a task never goes before one dispatched earlier on the same resource); a task frees them
    `busy_s` after its start."""
    by_id = {t.id: t for t in tasks}
    free: dict[Resource, float] = {}
    start: dict[int, float] = {}
    for task_id in order:
        option = by_id[task_id].options[choice[task_id]]
        begin = max((free.get(r, 0.0) for r in option.resources), default=0.0)
        start[task_id] = begin
        for r in option.resources:
            free[r] = begin + option.busy_s
    return start


def check_schedule(tasks: list[SchedulingTask], schedule: Schedule, tolerance: float = 1e-9) -> None:
    """Raise ValueError if a task lacks a choice or two tasks are busy on a shared resource at once."""
    intervals: dict[Resource, list[tuple[float, float, int]]] = {}
    for task in tasks:
        if task.id not in schedule.choice or task.id not in schedule.start_s:
            raise ValueError(f"schedule from {schedule.solver} has no entry for task {task.id}")
        option = task.options[schedule.choice[task.id]]
        begin = schedule.start_s[task.id]
        for r in option.resources:
            intervals.setdefault(r, []).append((begin, begin + option.busy_s, task.id))
    for resource, spans in intervals.items():
        spans.sort()
        for (s0, e0, a), (s1, _, b) in zip(spans, spans[1:]):
            if s1 < e0 - tolerance:
                raise ValueError(f"tasks {a} and {b} overlap on host {resource[0]} {resource[1]} ({s1:.6f}s < {e0:.6f}s)")
