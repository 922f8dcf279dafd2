"""Alpa's two send/recv approaches as operation lists, so the simulator prices them like our plans.

- `alpa-send-recv`: every destination device receives each slice it needs by one send/recv from a
  source device holding it; the sender is the least-loaded holder so far (Alpa's `normal` load
  balance: bytes accumulate per device, ties to the lowest id). Issued destination device by
  destination device, slice by slice, as Alpa's loop does.
- `alpa-allgather`: for each destination host, a slice is split over the host's devices that need
  it, each part sent from the least-loaded holder, then all-gathered inside the host (Alpa rewrites
  the spec only over devices of one host); all sends first, then the all-gathers.
Both run in `device-order` in the simulator: each device does its own operations in turn, and
operations of different devices share a NIC. Alpa asserts even shards; we price uneven ones anyway.
"""

from __future__ import annotations

from typing import Callable

from xmesh_plan.schemas import Operation, ReshardingProblem, split_region

from .unit_tasks import DEFAULT_MAX_TASKS, Cell, check_joint_task_count, decompose

BASELINES: dict[str, Callable[[ReshardingProblem], list[Operation]]] = {}


def _least_loaded(holders: tuple[int, ...], load: dict[int, int]) -> int:
    return min(holders, key=lambda d: (load.get(d, 0), d))


def _size(region) -> int:
    out = 1
    for a, b in region:
        out *= b - a
    return out


def alpa_send_recv(problem: ReshardingProblem) -> list[Operation]:
    cells = [c for c in decompose(problem, max_tasks=None) if c.receivers]  # baseline_seconds checked the size
    load: dict[int, int] = {}
    ops: list[Operation] = []
    for dst in problem.dst.mesh.devices:
        for task, cell in enumerate(cells):
            if dst in cell.receivers:
                src = _least_loaded(cell.senders, load)
                load[src] = load.get(src, 0) + cell.nbytes(problem.itemsize)
                ops.append(Operation(id=len(ops), task=task, kind="send", src=src, dsts=(dst,), region=cell.region))
    return ops + _copies(problem, len(ops))


def _groups(problem: ReshardingProblem, cell: Cell) -> list[tuple[int, ...]]:
    by_host: dict[int, list[int]] = {}
    for d in cell.receivers:
        by_host.setdefault(problem.cluster.host_of(d), []).append(d)
    return [tuple(sorted(v)) for _, v in sorted(by_host.items())]


def alpa_allgather(problem: ReshardingProblem) -> list[Operation]:
    cells = [c for c in decompose(problem, max_tasks=None) if c.receivers]
    load: dict[int, int] = {}
    sends: list[Operation] = []
    gathers: list[tuple[int, tuple[int, ...], tuple]] = []
    for task, cell in enumerate(cells):
        for group_index, members in enumerate(_groups(problem, cell)):
            group_task = task * 1024 + group_index
            parts = split_region(cell.region, len(members))
            parts += [tuple((a, a) for a, _ in cell.region)] * (len(members) - len(parts))
            for d, part in zip(members, parts):
                if _size(part):
                    src = _least_loaded(cell.senders, load)
                    load[src] = load.get(src, 0) + _size(part) * problem.itemsize
                    sends.append(Operation(id=len(sends), task=group_task, kind="send", src=src, dsts=(d,), region=part))
            if len(members) > 1:
                gathers.append((group_task, members, tuple(parts), cell.region))
    ops = sends + [Operation(id=len(sends) + i, task=t, kind="allgather", src=None, dsts=m, region=r, parts=p)
                   for i, (t, m, p, r) in enumerate(gathers)]
    return ops + _copies(problem, len(ops))


def _copies(problem: ReshardingProblem, first_id: int) -> list[Operation]:
    """Devices that hold part of their destination shard copy it locally, as in our plans."""
    out = []
    for cell in decompose(problem, max_tasks=None):
        for d in cell.local_copies:
            out.append(Operation(id=first_id + len(out), task=-1, kind="copy", src=d, dsts=(d,), region=cell.region))
    return out


BASELINES["alpa-send-recv"] = alpa_send_recv
BASELINES["alpa-allgather"] = alpa_allgather


def baseline_operations(problem, name: str) -> list[Operation]:
    """Alpa's operations for every tensor of a problem, tensor after tensor as its loop goes (task ids kept
    apart per tensor); a single-tensor problem's own."""
    singles = problem.tensor_problems()
    if len(singles) == 1 and singles[0] is problem:
        return BASELINES[name](problem)
    ops: list[Operation] = []
    for k, single in enumerate(singles):
        for op in BASELINES[name](single):
            task = op.task if op.task < 0 else op.task + (k << 32)
            ops.append(op.model_copy(update={"id": len(ops), "task": task, "tensor": k}))
    return ops


def baseline_seconds(problem, name: str, max_tasks: int | None = DEFAULT_MAX_TASKS) -> float:
    """Simulated time of Alpa's approach `name` (device order) on a problem of one or many tensors; the
    error lists the valid names. Refuses (TooManyTasksError) a problem that could cut into more than
    `max_tasks` unit tasks."""
    from .simulate import simulate

    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of: {', '.join(BASELINES)}")
    check_joint_task_count(problem.tensor_problems(), max_tasks)
    return simulate(baseline_operations(problem, name), problem, "device-order").makespan_s
