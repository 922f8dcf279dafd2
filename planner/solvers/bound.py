"""A true lower bound on any schedule's makespan, used for pruning, gaps and early stopping.

Two arguments, the larger wins. A resource every option of a task holds must carry that task for
at least its shortest option's duration, so its mandatory load bounds the makespan. And tasks that
need some resource of a kind (every option holds a send side, say) share the distinct resources of
that kind their options name, so their total over that count bounds it too.
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
    """A task's shortest duration, and each resource kind every option holds with the resources of that kind it names."""
    kinds = set.intersection(*({_kind(r) for r in o.resources} for o in task.options))
    return shortest(task), tuple((kind, frozenset(r for o in task.options for r in o.resources if _kind(r) == kind))
                                 for kind in kinds)


def pooled_bound(tasks: list[SchedulingTask]) -> float:
    """Per resource kind: total shortest duration of tasks that always need that kind, over its distinct resources."""
    load: dict[str, float] = {}
    pool: dict[str, set[Resource]] = {}
    for least, kinds in _per_options(tasks, _pooled_facts):
        for kind, named in kinds:
            load[kind] = load.get(kind, 0.0) + least
            pool.setdefault(kind, set()).update(named)
    return max((load[k] / len(pool[k]) for k in load), default=0.0)


def mandatory_loads(tasks: list[SchedulingTask]) -> dict[Resource, float]:
    loads: dict[Resource, float] = {}
    for least, held in _per_options(tasks, lambda task: (shortest(task), mandatory_resources(task))):
        for r in held:
            loads[r] = loads.get(r, 0.0) + least
    return loads


def schedule_lower_bound(tasks: list[SchedulingTask]) -> float:
    """No schedule of `tasks` finishes before this many seconds."""
    busiest = max(mandatory_loads(tasks).values(), default=0.0)
    longest = max(_per_options(tasks, shortest), default=0.0)
    return max(busiest, longest, pooled_bound(tasks))
