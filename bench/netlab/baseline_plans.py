"""Alpa's two approaches (`planner.baselines`) as runnable plans, so the testbed measures them like ours.

A baseline is an operation list; a plan also needs one unit task per task id its operations name,
and operations listed in execution order. Times come from the simulator's `device-order` replay
(how `xmesh-plan compare` prices baselines); `host_order` lists each task on the NIC sides of the hosts
its operations cross, in the order that replay starts them (Alpa keeps no order of its own, and a plan
lists every task that crosses hosts there). The result passes `verify_plan`, so the executor's lowering accepts it. Only Alpa's two can
run: the RL frameworks' baselines broadcast whole blocks, more than a destination shard holds, which
the plan format rejects, so they stay simulator-only (`xmesh-plan compare`, bench/bench_weight_sync.py).
"""

from __future__ import annotations

from xmesh_plan.planner.baselines import BASELINES
from xmesh_plan.planner.bounds import lower_bound
from xmesh_plan.planner.simulate import simulate
from xmesh_plan.planner.unit_tasks import decompose
from xmesh_plan.schemas import HostOrder, Operation, Plan, ReshardingProblem, SolverInfo, UnitTask
from xmesh_plan.schemas.geometry import region_size
from xmesh_plan.schemas.op_kinds import members, reads, rule_of

STRATEGY_OF = {"alpa-send-recv": "send_recv", "alpa-allgather": "local_allgather"}


def _task(task_id: int, ops: list[Operation], problem: ReshardingProblem, strategy: str) -> UnitTask:
    """A unit task covering the box its operations move (the box an operation's parts tile, when there
    is one), sent by the devices that read it from their source shards."""
    main = next((op for op in ops if rule_of(op).has_parts), ops[0])
    senders = tuple(sorted({d for op in ops for d, shard, _ in reads(op) if shard == "src"}))
    receivers = tuple(sorted({d for op in ops for d in op.dsts}))
    host = problem.cluster.host_of
    return UnitTask(id=task_id, region=main.region, nbytes=region_size(main.region) * problem.itemsize,
                    senders=senders, receivers=receivers, sender=senders[0], sender_host=host(senders[0]),
                    receiver_hosts=tuple(sorted({host(d) for d in receivers})), strategy=strategy,
                    start_s=min(op.start_s for op in ops), end_s=max(op.end_s for op in ops))


def _host_order(ops: list[Operation], problem: ReshardingProblem) -> tuple[HostOrder, ...]:
    """Each task on the send and receive side of every host its operations cross, first started first."""
    host = problem.cluster.host_of
    listed: dict[tuple[int, str], list[int]] = {}
    for op in ops:  # in execution order
        hosts = {host(d) for d in members(op)}
        if op.task < 0 or len(hosts) < 2:
            continue
        for h in hosts:
            for side in ("send", "recv"):
                tasks = listed.setdefault((h, side), [])
                if op.task not in tasks:
                    tasks.append(op.task)
    return tuple(HostOrder(host=h, side=side, tasks=tuple(tasks)) for (h, side), tasks in sorted(listed.items()))


def baseline_plan(problem: ReshardingProblem, name: str) -> Plan:
    """Alpa's approach `name` on `problem` as a plan; the error lists the valid names."""
    if name not in STRATEGY_OF:
        why = "is simulator-only (it writes outside destination shards)" if name in BASELINES else "is unknown"
        raise ValueError(f"baseline {name!r} {why}; a runnable one is one of: {', '.join(STRATEGY_OF)}")
    ops = BASELINES[name](problem)
    sim = simulate(ops, problem, "device-order")
    ops = sorted((op.model_copy(update={"start_s": sim.op_start_s[op.id], "end_s": sim.op_end_s[op.id]}) for op in ops),
                 key=lambda op: (op.start_s, op.id))
    by_task: dict[int, list[Operation]] = {}
    for op in ops:
        if op.task >= 0:
            by_task.setdefault(op.task, []).append(op)
    tasks = tuple(_task(t, by_task[t], problem, STRATEGY_OF[name]) for t in sorted(by_task))
    bound = lower_bound(decompose(problem), problem.cluster, problem.itemsize).seconds
    return Plan(generator="bench.netlab baseline", problem=problem, strategy=name, solver=SolverInfo(name=name),
                merged_slices=False, tasks=tasks, operations=tuple(ops), host_order=_host_order(ops, problem),
                predicted_seconds=sim.makespan_s, lower_bound_seconds=min(bound, sim.makespan_s))
