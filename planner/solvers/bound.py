"""A true lower bound on any schedule's makespan, used for pruning, gaps and early stopping.

Three arguments, the largest wins. A resource every option of a task holds is busy with that task for
at least its least busy option's `busy_s`, so its mandatory load bounds the makespan, and the task that frees
it last still has its tail to go (at least the least `tail_s` of any option). Tasks that need some resource of a
kind (every option holds a send side, say) share the distinct resources of that kind their options name, so
their total over that count, plus that least tail, bounds it too. And no schedule ends before its longest task.
"""

from __future__ import annotations

from ..scheduling import Resource, SchedulingTask


def mandatory_resources(task: SchedulingTask) -> frozenset[Resource]:
    """Resources held by every option of the task (its receivers' sides, a sole sender's side)."""
    common = set(task.options[0].resources)
    for option in task.options[1:]:
        common &= option.resources
    return frozenset(common)


def shortest(task: SchedulingTask) -> float:
    return min(o.duration_s for o in task.options)


def least_busy(task: SchedulingTask) -> float:
    """The least time any option of the task holds its resources."""
    return min(o.busy_s for o in task.options)


def least_tail(tasks: list[SchedulingTask]) -> float:
    """The least tail of any option of any task: the last task to free a resource ends at least this much later."""
    return min(_per_options(tasks, lambda task: min(o.tail_s for o in task.options)), default=0.0)


def _kind(resource: Resource) -> str:
    return resource[1].split(":")[0]


def _per_options(tasks: list[SchedulingTask], fact):
    """`fact(task)` per task, computed once per distinct tuple of options: a compile's tensors of one kind share
    their tasks' options (`compile.renumbered`), so a model's layers ask the same question tens of times."""
    known: dict[int, object] = {}
    out = []
    for task in tasks:
        key = id(task.options)
        if key not in known:
            known[key] = fact(task)
        out.append(known[key])
    return out


def _pooled_facts(task: SchedulingTask) -> tuple[float, tuple[tuple[str, frozenset[Resource]], ...]]:
    """A task's least busy time, and each resource kind every option holds with the resources of that kind it names."""
    kinds = set.intersection(*({_kind(r) for r in o.resources} for o in task.options))
    return least_busy(task), tuple((kind, frozenset(r for o in task.options for r in o.resources if _kind(r) == kind))
                                 for kind in kinds)


def pooled_bound(tasks: list[SchedulingTask]) -> float:
    """Per resource kind: total least busy time of tasks that always need that kind, over its distinct resources."""
    load: dict[str, float] = {}
    pool: dict[str, set[Resource]] = {}
    for least, kinds in _per_options(tasks, _pooled_facts):
        for kind, named in kinds:
            load[kind] = load.get(kind, 0.0) + least
            pool.setdefault(kind, set()).update(named)
    return max((load[k] / len(pool[k]) for k in load), default=0.0)


def mandatory_loads(tasks: list[SchedulingTask]) -> dict[Resource, float]:
    """Per resource, the least busy time of the tasks every option of which holds it."""
    loads: dict[Resource, float] = {}
    for least, held in _per_options(tasks, lambda task: (least_busy(task), mandatory_resources(task))):
        for r in held:
            loads[r] = loads.get(r, 0.0) + least
    return loads


def schedule_lower_bound(tasks: list[SchedulingTask]) -> float:
    """No schedule of `tasks` finishes before this many seconds."""
    if not tasks:
        return 0.0
    busiest = max(mandatory_loads(tasks).values(), default=0.0)
    longest = max(_per_options(tasks, shortest), default=0.0)
    return max(max(busiest, pooled_bound(tasks)) + least_tail(tasks), longest)
