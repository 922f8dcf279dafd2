"""Five baselines as operation lists, so the simulator prices them like our plans: Alpa's two
send/recv approaches and three that RL frameworks use to sync weights from trainer to inference ranks.

- `alpa-send-recv`: every destination device receives each slice it needs by one send/recv from a
  source device holding it; the sender is the least-loaded holder so far (Alpa's `normal` load
  balance: bytes accumulate per device, ties to the lowest id). Issued destination device by
  destination device, slice by slice, as Alpa's loop does.
- `alpa-allgather`: for each destination host, a slice is split over the host's devices that need
  it, each part sent from the least-loaded holder, then all-gathered inside the host (Alpa rewrites
  the spec only over devices of one host); all sends first, then the all-gathers.
- `rank0-gather-broadcast` (verl / NeMo-RL style: full parameters on trainer rank 0, then an NCCL
  broadcast to every inference rank): one send per distinct source block into the source mesh's
  first device (from a replica on its host when there is one), one at a time as that device takes
  them; then it broadcasts the whole tensor down every destination device, host by host (a chunked
  chain, as NCCL pipelines a broadcast), and each destination device keeps its own slice (a local
  step, not priced). A destination device that is the root copies its shard locally.
- `checkpoint-engine-broadcast` (checkpoint-engine's broadcast mode): every source rank packs the blocks it holds
  (the first replica) into buckets and broadcasts each down a chunked chain of every destination device, host by
  host; each destination device keeps its part. Buckets change how many messages go, not the bytes on any link, so
  a block is one broadcast here. Every destination device receives the whole model.
- `per-rank-broadcast`: every source rank broadcasts each block it holds (the first replica, when
  blocks are replicated) down a chunked chain of the destination devices that need any part of it,
  host by host; all ranks at once, each needer taking the broadcasts it is in one after another.
  A rank that is also a destination device copies its own part locally.
Broadcast chains put the sender's own host first, then hosts by id, devices by id; their chunk count
is the one our `broadcast` strategy picks for the same chain alone, so they pipeline as well as ours.
Every destination device of the last three receives whole blocks, more than its shard, so their lists
are for the simulator only (the plan format rejects writes outside a destination shard).
All five run in `device-order` in the simulator: each device does its own operations in turn, and
operations of different devices share a NIC; a multi-tensor problem runs tensor after tensor, as
frameworks loop over parameters. Alpa asserts even shards; we price uneven ones anyway.
"""

from __future__ import annotations

from typing import Callable

from xmesh_plan.schemas import Operation, ReshardingProblem, split_region
from xmesh_plan.schemas.geometry import Region, intersect, region_size

from .strategies import TaskContext, pipelined_seconds
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


def _source_blocks(problem: ReshardingProblem) -> list[tuple[Region, tuple[int, ...]]]:
    """Each distinct non-empty source block with the devices holding it (replicas), in source-mesh order.
    A layout's blocks form a grid, so two blocks are equal or disjoint."""
    holders: dict[Region, list[int]] = {}
    for device, block in problem.blocks("src").items():
        if region_size(block):
            holders.setdefault(block, []).append(device)
    return [(block, tuple(devices)) for block, devices in holders.items()]


def _chain_broadcast(problem: ReshardingProblem, op_id: int, task: int, sender: int, receivers, region: Region) -> Operation:
    """A chunked broadcast of `region` from `sender` down `receivers`, host by host (the sender's host
    first), with the chunk count our `broadcast` strategy would pick for that chain alone."""
    host = problem.cluster.host_of
    chain = tuple(sorted(receivers, key=lambda d: (host(d) != host(sender), host(d), d)))
    hosts = [host(sender)] + [host(d) for d in chain]
    nbytes = region_size(region) * problem.itemsize
    context = TaskContext(region, nbytes, sender, chain, problem.cluster, problem.itemsize)
    _, chunks = pipelined_seconds(nbytes, [a != b for a, b in zip(hosts, hosts[1:])], context)
    return Operation(id=op_id, task=task, kind="broadcast", src=sender, dsts=chain, region=region, chunks=chunks)


def _own_copy(op_id: int, device: int, region: Region | None) -> list[Operation]:
    """A device that is also a destination copies `region` locally (none when it is empty)."""
    return [] if region is None else [Operation(id=op_id, task=-1, kind="copy", src=device, dsts=(device,), region=region)]


def rank0_gather_broadcast(problem: ReshardingProblem) -> list[Operation]:
    """Gather every source block into the source mesh's first device, then broadcast the whole tensor (module docstring)."""
    root = problem.src.mesh.devices[0]
    host = problem.cluster.host_of
    ops: list[Operation] = []
    for block, holders in _source_blocks(problem):
        if root not in holders:
            sender = min(holders, key=lambda d: host(d) != host(root))  # a replica on the root's host, else the first
            ops.append(Operation(id=len(ops), task=len(ops), kind="send", src=sender, dsts=(root,), region=block))
    receivers = [d for d in problem.dst.mesh.devices if d != root]
    if receivers:
        whole = tuple((0, n) for n in problem.shape)
        ops.append(_chain_broadcast(problem, len(ops), len(ops), root, receivers, whole))
    own = problem.blocks("dst").get(root)
    return ops + _own_copy(len(ops), root, own if own and region_size(own) else None)


def per_rank_broadcast(problem: ReshardingProblem, everyone: bool = False) -> list[Operation]:
    """Every source block broadcast by its first holder down the destination devices needing any of it, or down
    every destination device (`everyone`: checkpoint-engine's broadcast) (module docstring)."""
    wanted = problem.blocks("dst")
    ops: list[Operation] = []
    copies: list[tuple[int, Region | None]] = []
    for task, (block, holders) in enumerate(_source_blocks(problem)):
        sender = holders[0]
        needers = [d for d, box in wanted.items() if d != sender and (everyone or intersect(block, box))]
        if needers:
            ops.append(_chain_broadcast(problem, len(ops), task, sender, needers, block))
        if sender in wanted:
            copies.append((sender, intersect(block, wanted[sender])))
    for device, region in copies:
        ops += _own_copy(len(ops), device, region)
    return ops


BASELINES["alpa-send-recv"] = alpa_send_recv
BASELINES["alpa-allgather"] = alpa_allgather
BASELINES["rank0-gather-broadcast"] = rank0_gather_broadcast
BASELINES["per-rank-broadcast"] = per_rank_broadcast
BASELINES["checkpoint-engine-broadcast"] = lambda problem: per_rank_broadcast(problem, everyone=True)


def baseline_operations(problem, name: str) -> list[Operation]:
    """Baseline `name`'s operations for every tensor of a problem, tensor after tensor as Alpa's and the
    frameworks' loops go (task ids kept apart per tensor); a single-tensor problem's own. The error lists the valid names."""
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of: {', '.join(BASELINES)}")
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
    """Simulated time of baseline `name` (device order) on a problem of one or many tensors; the
    error lists the valid names. Refuses (TooManyTasksError) a problem that could cut into more than
    `max_tasks` unit tasks."""
    from .simulate import simulate

    if name not in BASELINES:  # before the task count, so a misspelt name fails first
        raise ValueError(f"unknown baseline {name!r}; choose one of: {', '.join(BASELINES)}")
    check_joint_task_count(problem.tensor_problems(), max_tasks)
    return simulate(baseline_operations(problem, name), problem, "device-order").makespan_s
