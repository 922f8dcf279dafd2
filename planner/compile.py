"""problem -> unit tasks -> strategy per sender option -> schedule -> plan: the planner's one entry point."""

from __future__ import annotations

import dataclasses
import functools
import gc
from dataclasses import dataclass
from typing import Callable

from xmesh_plan.schemas import ExecutorPrediction, HostOrder, Plan, ReshardingProblem, SolverInfo
from xmesh_plan.schemas.carriers import message_groups
from xmesh_plan.schemas.staging import stated_staging
from xmesh_plan.schemas.transfer import TransferProblem

from . import __version__
from .bounds import joint_lower_bound
from .coalesce import (BundleCell, bundle_task, coalesce_cells, retimed_on_nics, share_messages, shared_bound,
                       shared_messages_inside, splits_small)
from .compile_defaults import CompileOptions
from .plan_rows import OperationRow, PlanRows, TaskRow, plan_rows
from .executor_order import executor_order, executor_order_seconds, posted_budget, unsimulated_budget
from .host_split import chained_kinds, rotations, source_send, sources_receive
from .scheduling import Option, Schedule, SchedulingTask
from xmesh_plan.schemas.op_kinds import rule_of, tags_used, wire_pairs

from .simulate import TooCostly, nic_assignment, renumbered_only, simulated
from .solvers import solve
from .staging_limit import busiest_posted, limit_staging
from .strategies import STRATEGIES, PlannedOp, StrategyResult, TaskContext, get_strategy
from .unit_tasks import Cell, check_kinds_task_count, check_scheduled_task_count, decompose, split_by_receiver_host

DIGITS = 12  # times are rounded to picoseconds so plans print and compare stably
NIC_SIDES = ("send", "recv")  # the resources a plan's host order lists; device ports are not queued
MAX_SIMULATED_MESSAGES = 250_000  # messages (`simulated_messages`) a listing may have to be simulated in host order: beyond, the
# schedule's own timetable times its operations, decided before any flow is made. A compile simulates host order at least once (the
# listing settle, `settle_listing`), then the executor's order, at about 35-110 CPU us a message a run here: the Llama-3-70B-like
# plan (197,600 messages) 6.9 + 6.2 s, a 16-layer DeepSeek-V3-like cut (112,640) 11.2 + 9.2 s, the full DeepSeek-V3-like plan (390,400)
# 43.1 + 42.3 s. So at most about 55 CPU s of simulation for plans whose other work is small (the 70B: 15 CPU s in all); the full
# DeepSeek-V3-like and Kimi-K2-like plans (390,400 and 315,632 messages) keep the schedule's times for their operations and are
# simulated once, in the executor's order alone (`executor_budget`, `executor_order.MAX_EXECUTOR_MESSAGES`)
MAX_SIMULATION_WORK = 25_000_000  # work one simulation of a listing may take (`simulate.run_flows`: groups shared out and flows re-rated,
# counted, so every machine decides alike); beyond, the schedule's timetable stands in. A backstop for listings under MAX_SIMULATED_MESSAGES,
# which pass it only at more than 100 units a message: the full DeepSeek-V3-like plan (390,400 messages) takes 1.21 M in host order
# (3.1 a message), 2.05 M posted (5.3)
DETAILED_STAGES = 10_000  # operations from which a compile names the steps of timing and assembling (`on_stage`)
MAX_RELISTINGS = 8  # re-simulations until the listing is the order of its own predicted starts


def _quiet(stage: str) -> None:
    del stage


@dataclass(frozen=True, slots=True)
class TaskOptions:
    """A cell with its receivers, and for each candidate sender host the best strategy from there."""

    cell: Cell
    results: tuple[tuple[str, StrategyResult], ...]
    scheduling: SchedulingTask


def _sender_per_host(cell: Cell, problem: ReshardingProblem) -> dict[int, int]:
    """The lowest-numbered holding device on each candidate host."""
    out: dict[int, int] = {}
    for d in sorted(cell.senders):
        out.setdefault(problem.cluster.host_of(d), d)
    return out


def _best_strategy(ctx: TaskContext, strategy: str) -> tuple[str, StrategyResult]:
    names = list(STRATEGIES) if strategy == "auto" else [strategy]
    results = [(name, get_strategy(name)(ctx)) for name in names]
    return min(results, key=lambda item: (item[1].duration_s, names.index(item[0])))


def receiving_load(cells_of: list[list[Cell]], cluster) -> dict[int, int]:
    """Host -> how many cells (of every tensor) have a receiver there: the tasks its receive side queues. A list
    given for several tensors (one kind, `_kinds`) is counted once and taken as many times."""
    times: dict[int, list] = {}
    for cells in cells_of:
        times.setdefault(id(cells), [cells, 0])[1] += 1
    load: dict[int, int] = {}
    for cells, count in times.values():
        for cell in cells:
            for host in {cluster.host_of(d) for d in cell.receivers}:
                load[host] = load.get(host, 0) + count
    return load


def task_options(problem: ReshardingProblem, cells: list[Cell], strategy: str, first_id: int = 0,
                 load: dict[int, int] | None = None, turns: list[int | None] | None = None) -> list[TaskOptions]:
    """Every cell that crosses devices, with one scheduling option per candidate sender host; scheduling
    tasks are numbered from `first_id` (each tensor of a transfer after the ones before it). `load`
    (`receiving_load`, all tensors together; these cells' own when None) sets each task's `sharing`; `turns`
    (one per cell, `host_split.rotations`) make the cells chains forwarded between destination hosts."""
    if strategy != "auto":
        get_strategy(strategy)
    load = receiving_load([cells], problem.cluster) if load is None else load
    out = []
    for cell, rotation in zip(cells, turns or [None] * len(cells)):
        if not cell.receivers:
            continue
        if not cell.senders:
            raise ValueError(f"no source device holds {cell.region}; the source spec must cover the whole tensor")
        results, options = [], []
        for host, device in sorted(_sender_per_host(cell, problem).items()):
            sharing = max((load.get(problem.cluster.host_of(d), 1) for d in cell.receivers), default=1)
            ctx = TaskContext(cell.region, cell.nbytes(problem.itemsize), device, cell.receivers, problem.cluster, problem.itemsize, sharing,
                              rotation)
            name, result = _best_strategy(ctx, strategy)
            results.append((name, result))
            options.append(Option(host, device, result.duration_s, result.resources, result.tail_s))
        out.append(TaskOptions(cell, tuple(results), SchedulingTask(first_id + len(out), tuple(options))))
    return out


def _copy_ops(cell: Cell, problem: ReshardingProblem) -> list[tuple[float, PlannedOp]]:
    """Local copies for destination devices that already hold the cell, from time 0 (no network involved)."""
    if not cell.local_copies:
        return []
    seconds = cell.nbytes(problem.itemsize) / problem.cluster.intra_bytes_per_s
    return [(0.0, PlannedOp("copy", d, (d,), cell.region, duration_s=seconds)) for d in cell.local_copies]


@dataclass(frozen=True, slots=True)
class TensorWork:
    """One tensor's share of a compile: its index in a transfer (None: the plan has one tensor), its
    single-tensor problem, its cells and its scheduling tasks."""

    index: int | None
    problem: ReshardingProblem
    cells: list[Cell]
    options: list[TaskOptions]


def assemble(problem: ReshardingProblem, cells: list[Cell], options: list[TaskOptions], schedule: Schedule,
             strategy: str, seed: int) -> Plan:
    """Number tasks and operations, time them from the schedule, and build the plan record."""
    return assemble_joint(problem, [TensorWork(None, problem, cells, options)], schedule, strategy, seed)


def assemble_joint(problem: ReshardingProblem | TransferProblem, works: list[TensorWork], schedule: Schedule,
                   strategy: str, seed: int, max_staging_bytes: int | None = None, max_operations: int | None = None,
                   share_bytes: int | None = None) -> Plan:
    """`assemble_rows` as the plan's records."""
    return assemble_rows(problem, works, schedule, strategy, seed, max_staging_bytes, max_operations, share_bytes).to_plan()


def assemble_rows(problem: ReshardingProblem | TransferProblem, works: list[TensorWork], schedule: Schedule,
                  strategy: str, seed: int, max_staging_bytes: int | None = None, max_operations: int | None = None,
                  share_bytes: int | None = None, on_stage: Callable[[str], None] = _quiet,
                  on_posted_staging: Callable[[int, int], None] | None = None) -> PlanRows:
    """`assemble` for every tensor of a problem at once: tasks of all tensors share the NICs and one timeline; the plan
    as rows (`plan_rows`: its tasks and operations as named tuples, not records).
    `max_staging_bytes`: operations that would stage more on a device are cut (`staging_limit.limit_staging`,
    each in its own tensor's elements, at most `max_operations` in all) and the plan states each device's
    peak in device order (across tensors: one staging area per device). `share_bytes`: bundles between the same
    two hosts share cross-host messages of at most that many bytes (`coalesce.share_messages`). `on_stage` hears
    each step of a plan of at least DETAILED_STAGES operations. `on_posted_staging`, with no `max_staging_bytes`, hears
    the device that stages most posted and its bytes (`staging_limit.busiest_posted`), where anything is staged."""
    tasks, timed_ops, per_resource, timing = [], [], {}, {}
    cluster = problem.cluster
    nic_sides: dict[int, frozenset] = {}  # id of an option -> the NIC sides it holds: tensors of one kind share their options
    facts: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}  # (id of a cell, itemsize) -> its bytes and receiving
    for work in works:  # hosts: tensors of one kind share their cells (`renumbered`)
        single = work.problem
        for item in work.options:
            t = item.scheduling
            option = t.options[schedule.choice[t.id]]
            name, result = item.results[schedule.choice[t.id]]
            start = schedule.start_s[t.id]
            cell = item.cell
            known = facts.get((id(cell), single.itemsize))
            if known is None:
                known = facts[(id(cell), single.itemsize)] = (cell.nbytes(single.itemsize),
                                                              tuple(sorted({cluster.host_of(d) for d in cell.receivers})))
            tasks.append(TaskRow(
                t.id, work.index, cell.region, known[0], cell.senders, cell.receivers, cell.merged_cells,
                option.sender, option.sender_host, known[1], name, result.chunks, round(start, DIGITS),
                round(start + option.duration_s, DIGITS)))
            timed_ops += [(start + op.offset_s, t.id, work.index, op) for op in result.ops]
            timed_ops += [(at, t.id, work.index, op) for at, op in _copy_ops(cell, single)]
            sides = nic_sides.get(id(option))
            if sides is None:
                sides = nic_sides[id(option)] = frozenset(r for r in option.resources if r[1].partition(":")[0] in NIC_SIDES)
            timing[t.id] = (start, option.busy_s, option.tail_s, sides, option.resources)
            for host, side in sides:
                per_resource.setdefault((host, side), []).append((start, t.id))
        for cell in (c for c in work.cells if not c.receivers and c.local_copies):
            timed_ops += [(at, -1, work.index, op) for at, op in _copy_ops(cell, single)]
    if max_staging_bytes is not None:
        timed_ops = limit_staging(timed_ops, [w.problem for w in works], max_staging_bytes, max_operations)
    timed_ops.sort(key=lambda item: (item[0], item[1] if item[1] >= 0 else len(tasks), item[2] or 0, item[3].kind,
                                     item[3].src or 0, item[3].dsts))
    proven = schedule.proven_bound_s
    if share_bytes is None:
        groups = [[item] for item in timed_ops]
    else:  # shared messages timed as their NIC sides take them (`coalesce.retimed_on_nics`)
        groups, moved = retimed_on_nics(share_messages(timed_ops, [w.problem.itemsize for w in works], share_bytes,
                                                       cluster.host_of, cluster.latency_s, cluster.overhead_s,
                                                       cluster.intra_bytes_per_s, max_staging_bytes),
                                        timing, cluster.host_of)
        scheduled = [o.scheduling for w in works for o in w.options]
        proven = shared_bound(proven, groups, scheduled, cluster.host_of)
        if proven != schedule.proven_bound_s and "gap_to_proven_bound" in schedule.details:  # the gap to the bound stated
            gap = schedule.makespan(scheduled) / proven - 1 if proven > 0 else 0.0
            schedule = dataclasses.replace(schedule, details={**schedule.details, "gap_to_proven_bound": f"{gap:.6f}"})
        per_resource = {key: [(moved.get(t, at), t) for at, t in v] for key, v in per_resource.items()}
    del timed_ops, timing
    if max_staging_bytes is None and on_posted_staging is not None:  # counted on the relays the messages go from
        busiest = busiest_posted([item for group in groups for item in group], [w.problem for w in works])
        if busiest is not None:
            on_posted_staging(*busiest)
    operations, riders = [], {}  # riders: task of a bundle -> (its message's start, relay) (`coalesce.share_messages`)
    for group in groups:
        head = len(operations)
        for k, (at, task, tensor, op) in enumerate(group):
            operations.append(OperationRow(
                len(operations), task, tensor, op.kind, op.src, op.dsts, op.region, op.parts, op.chunks, op.holders,
                op.needers, head if k else None, round(at, DIGITS), round(at + op.duration_s, DIGITS)))
            if op.kind == "bundle" and share_bytes is not None:
                riders[task] = (at, op.src)
    del groups
    operations = tuple(operations)
    if riders:  # a bundle goes when its message goes, from the message's relay
        tasks = [t._replace(sender=riders[t.id][1]) if t.id in riders and riders[t.id][1] != t.sender else t for t in tasks]
        per_resource = {key: [(riders[t][0] if t in riders else at, t) for at, t in v] for key, v in per_resource.items()}
    host_order = tuple(HostOrder(host=h, side=s, tasks=tuple(t for _, t in sorted(v))) for (h, s), v in sorted(per_resource.items()))
    stage = on_stage if len(operations) >= DETAILED_STAGES else _quiet
    messages = simulated_messages(operations)
    stage(f"simulating {len(operations):,} operations in host order" if not too_many_messages(messages) else
          f"timing {len(operations):,} operations by the schedule ({messages:,} messages: too many to simulate in host order)")
    operations, timed_by, work = _simulated(operations, problem, nic_assignment(host_order), messages)
    limited = max_staging_bytes is not None
    budget = executor_budget(problem, work, messages)
    stage("bounding")
    tasks = _retimed_tasks(tasks, operations)
    bound = joint_lower_bound([(w.cells, w.problem.itemsize) for w in works], cluster)
    predicted = max((op.end_s for op in operations), default=0.0)
    details = dict(sorted(schedule.details.items())) | {"lower_bound_reason": bound.reason, "timed_by": timed_by}
    rows = plan_rows(
        tasks, operations, host_order, generator=f"xmesh-plan {__version__}", problem=problem, strategy=strategy,
        solver=SolverInfo(name=schedule.solver, seed=seed, proven_bound_seconds=proven, details=details),
        merged_slices=any(c.merged_cells > 1 for w in works for c in w.cells),
        predicted_seconds=round(predicted, DIGITS), lower_bound_seconds=round(bound.seconds, DIGITS))
    order = executor_order() + (" within the staging limit" if limited else "")
    if limited:  # the peaks in device order; posted, the executor keeps within the limit (`executor.window`), timed so
        rows = rows.with_fields(staging=stated_staging(rows, max_staging_bytes))
    if budget is not None:
        stage(f"simulating {messages:,} messages in the executor's order ({order})")
    executed = None if budget is None else executor_order_seconds(operations, problem, host_order, budget, max_staging_bytes)
    if work is None and executed is not None:  # the schedule's times, and the executor's prediction from the simulator
        details = rows.solver.details | {"timed_by": f"{timed_by}; {order}, the executor's order, by the simulator"}
        rows = rows.with_fields(solver=rows.solver.model_copy(update={"details": details}))
    return rows if executed is None else rows.with_fields(executor_prediction=ExecutorPrediction(
        order=executor_order(), predicted_seconds=round(executed, DIGITS)))


def executor_budget(problem: ReshardingProblem | TransferProblem, work: int | None, messages: int) -> int | None:
    """The most work the simulation of a listing of `messages` messages (`simulated_messages`) in the executor's order
    may take, given its host-order simulation's `work` (None: not simulated), or None where compile states no time in
    that order: a single-tensor plan; a listing simulated in host order: `executor_order.posted_budget` of its work; one
    too long to simulate in host order (`too_many_messages`): `executor_order.unsimulated_budget`, so the executor's
    prediction still comes from the simulator, one simulation; one whose host-order simulation passed its work budget
    or did not settle: none (the executor's order costs as much)."""
    if not isinstance(problem, TransferProblem):
        return None
    if work is not None:
        return posted_budget(work)
    return unsimulated_budget(messages) if too_many_messages(messages) else None


def settle_listing(operations: tuple[OperationRow, ...], problem: ReshardingProblem | TransferProblem, nic_of_task: dict[int, int],
                   max_work: int | None = None):
    """(listing, simulated times) where the listing is the order of its own predicted starts, or None.

    The simulator queues operations on each NIC side in list order, and listing them by predicted start
    can change that order (an all-gather's intra-host flows start before its NIC turn), so the listing
    is re-simulated until it stops changing (at most MAX_RELISTINGS times; 1-3 on random problems). A new listing
    that keeps every NIC side's and every task's order lowers to the same flows renumbered, which time the same
    (`simulate.renumbered_only`): it has settled on the times just simulated, without simulating it again.
    TooCostly where one simulation takes more than `max_work` units of work (`simulate.run_flows`)."""
    listing = operations
    for rounds in range(1, MAX_RELISTINGS + 1):
        result, lowering = simulated(listing, problem, "host-order", nic_of_task, max_work)
        position = {op.id: i for i, op in enumerate(listing)}
        order = sorted(listing, key=lambda op: (round(result.op_start_s[op.id], DIGITS), position[op.id]))
        if order == list(listing):
            return listing, result
        if rounds < MAX_RELISTINGS and renumbered_only(listing, order, lowering):
            return tuple(order), result
        listing = tuple(order)
    return None


def simulated_messages(operations) -> int:
    """How many messages a listing's operations make for the simulator, counted without making them: a bundle's
    gathers, its message across hosts and its scatters (`op_kinds.tags_used`); each chunk of a broadcast on every hop
    of its chain, each ring step of an all-gather on every pair of its ring (tags times wire pairs); a local copy as
    one; a message bundles share once, with one message per holder and per needer inside the hosts
    (`coalesce.shared_messages_inside`): about what the simulator's flows number (one per message, one per
    NIC a message is striped over where NICs are not pooled) and so its memory, known before it makes any."""
    return sum(_messages_of(group[0]) if len(group) == 1 else 1 + sum(shared_messages_inside(group))
               for group in message_groups(operations))


def _messages_of(op) -> int:
    tags = tags_used(op)
    if not tags:
        return 1
    return tags if rule_of(op).pattern == "bundle" else tags * len(wire_pairs(op))


def too_many_messages(messages: int) -> str | None:
    """Why `compile` (and `check`, deciding alike) leave a listing of `messages` messages (`simulated_messages`) to the
    schedule's timetable without making a flow; None when it is simulated."""
    return f"more than {MAX_SIMULATED_MESSAGES:,} messages to simulate" if messages > MAX_SIMULATED_MESSAGES else None


def _simulated(operations: tuple[OperationRow, ...], problem: ReshardingProblem | TransferProblem,
               nic_of_task: dict[int, int], messages: int) -> tuple[tuple[OperationRow, ...], str, int | None]:
    """Operation times from the network simulator (host order), listed and numbered by predicted start,
    so what is stored is what `check` recomputes; the schedule's own times when that cannot be had (among them
    more than MAX_SIMULATED_MESSAGES `messages`). Also the simulation's work (`SimResult.work`; None when not simulated)."""
    if too_many_messages(messages):
        return operations, f"schedule ({too_many_messages(messages)})", None
    try:
        settled = settle_listing(operations, problem, nic_of_task, MAX_SIMULATION_WORK)
    except TooCostly:  # deterministic: counted in groups and flows, not seconds, so `check` decides the same
        return operations, f"schedule (a simulation takes more than {MAX_SIMULATION_WORK:,} units of work)", None
    if settled is None:
        return operations, "schedule (the simulated listing did not settle)", None
    listing, result = settled
    renumbered = {op.id: i for i, op in enumerate(listing)}
    retimed = tuple(op._replace(id=i, start_s=round(result.op_start_s[op.id], DIGITS), end_s=round(result.op_end_s[op.id], DIGITS),
                                carrier=None if op.carrier is None else renumbered[op.carrier])
                    for i, op in enumerate(listing))
    return retimed, "simulator (host-order)", result.work


def _retimed_tasks(tasks: list[TaskRow], operations: tuple[OperationRow, ...]) -> list[TaskRow]:
    """A task spans its operations."""
    spans: dict[int, list[float]] = {}
    for op in operations:
        span = spans.get(op.task)
        if span is None:
            spans[op.task] = [op.start_s, op.end_s]
        else:
            if op.start_s < span[0]:
                span[0] = op.start_s
            if op.end_s > span[1]:
                span[1] = op.end_s
    out = []
    for t in tasks:
        span = spans.get(t.id)
        out.append(t if span is None or (span[0] == t.start_s and span[1] == t.end_s) else t._replace(start_s=span[0], end_s=span[1]))
    return out


def _kinds(singles: list[ReshardingProblem]) -> list[tuple]:
    """Per tensor, what its unit tasks, strategies and per-host loads depend on: shape, dtypes and element size on
    the wire, both placements (meshes and specs or boxes) and the cluster. A model's layers repeat a few kinds of tensor tens of times,
    and two tensors of one kind have the same cells, bundles and options up to their task numbers (`renumbered`)."""
    known: dict[int, tuple] = {}  # a transfer's tensors share one cluster and two meshes: each is keyed once
    def key(obj) -> tuple:
        if id(obj) not in known:
            known[id(obj)] = (obj, repr(obj))
        return known[id(obj)][1]
    return [(s.shape, s.dtype, s.dst_dtype, s.itemsize, s.src.layout_key(), s.dst.layout_key(), key(s.src.mesh), key(s.dst.mesh),
             key(s.cluster)) for s in singles]


def _chained(singles: list[ReshardingProblem], kinds: list[tuple], planned: dict[tuple, list[Cell]],
             problem: ReshardingProblem | TransferProblem, coalesce: bool, bucket_bytes: int) -> set[tuple]:
    """The kinds whose boxes are not split by receiving host (`host_split.chained_kinds`): each kind's source sends
    split and chained (small cells `coalesce` splits counted split), against the byte bound of every tensor's cells."""
    cluster = problem.cluster
    single_of = {kind: single for single, kind in zip(singles, kinds)}

    def sends(kind: tuple, split) -> dict[int, float]:
        single = single_of[kind]
        return source_send(planned[kind], lambda cell: cell.nbytes(single.itemsize), cluster, split)

    def chained_send(kind: tuple) -> dict[int, float]:
        return sends(kind, (lambda cell: splits_small(cell, single_of[kind], bucket_bytes)) if coalesce else (lambda cell: False))

    bound = joint_lower_bound([(planned[kind], s.itemsize) for s, kind in zip(singles, kinds)], cluster)
    split = {kind: sends(kind, lambda cell: True) for kind in single_of}
    return chained_kinds(kinds, split, chained_send, bound.seconds * cluster.send_bytes_per_s)


def renumbered(options: list[TaskOptions], first_id: int) -> list[TaskOptions]:
    """`options` (numbered from 0) as another tensor of the same kind's, numbered from `first_id`."""
    return [TaskOptions(o.cell, o.results, SchedulingTask(first_id + o.scheduling.id, o.scheduling.options)) for o in options]


def _bundle_options(bundles: list[BundleCell], problem: ReshardingProblem, first_id: int) -> list[TaskOptions]:
    """One scheduling task per bundle, numbered from `first_id` after the tensor's other tasks."""
    out = []
    for k, bundle in enumerate(bundles):
        result, task = bundle_task(bundle, k, problem, first_id + k)
        out.append(TaskOptions(bundle, (("bundle", result),), task))
    return out


def _without_cyclic_gc(fn):
    """Run `fn` with Python's cyclic garbage collector paused (it runs again afterwards): a compile
    allocates hundreds of thousands of small objects and few cycles, and the collector's passes over
    them took a third of the (64,8) -> (64,8) compile (BENCHMARKS.md, "Scaling")."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        was_on = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_on:
                gc.enable()
    return run


def compile_plan(problem: ReshardingProblem | TransferProblem, options: CompileOptions | None = None, *,
                 on_stage: Callable[[str], None] = _quiet, **settings) -> Plan:
    """`compile_rows` as the plan's records (`PlanRows.to_plan`)."""
    rows = compile_rows(problem, options, on_stage=on_stage, **settings)
    if len(rows.operations) >= DETAILED_STAGES:
        on_stage(f"making records of {len(rows.tasks):,} tasks and {len(rows.operations):,} operations")
    return _without_cyclic_gc(rows.to_plan)()


@_without_cyclic_gc
def compile_rows(problem: ReshardingProblem | TransferProblem, options: CompileOptions | None = None, *,
                 on_stage: Callable[[str], None] = _quiet, on_posted_staging: Callable[[int, int], None] | None = None,
                 **settings) -> PlanRows:
    """Compile a plan, as rows (`plan_rows.PlanRows`: `to_plan()` makes its records, and it is written compact as it
    is); same inputs give a byte-identical plan. `options` (`compile_defaults.CompileOptions`), or
    its fields as keywords (`compile_plan(p, solver="greedy")`, on top of `options` when both are given), say how;
    `on_stage` hears each step's name (for progress). Settings left None take the problem's kind's default in one
    place (`CompileOptions.resolved`: split by host and coalesced, bundles of several tensors sharing messages,
    for a `TransferProblem`; none of it for a single tensor).

    A problem whose distinct kinds of tensor cut into more than `max_tasks` boxes (as many per box as it has receiving
    hosts when split by host) is refused before anything is cut, one that would schedule more than `max_tasks` unit
    tasks (all tensors together, small boxes as their bundles) once they are cut, before anything is costed
    (TooManyTasksError; `unit_tasks` says why these counts). A `TransferProblem`'s tensors
    are cut one by one and scheduled together. `split_hosts`: one unit task per receiving host
    (`unit_tasks.split_by_receiver_host`; recorded in `solver.details`), except, in a multi-tensor problem, for the kinds
    whose split would make a source host send more than the byte bound: their boxes go down one chain through their
    receiving hosts (`host_split`). `coalesce`: small cells between two hosts
    travel in bundles of at most `bucket_bytes` (`planner/coalesce.py`; a bundle holds boxes of one tensor).
    `cross_tensor`: bundles of several tensors between two hosts share one message up to the bucket
    (`coalesce.share_messages`, `schemas.carriers`). `max_staging_bytes`: no device stages more in device order
    (`planner/staging_limit.py`; a transfer's tensors share one staging area per device); the plan states the limit
    and each device's peak (`Plan.staging`), and more than `max_tasks` operations are refused; none or 0: no limit
    (`on_posted_staging` then hears the device that stages most posted, `assemble_rows`). A multi-tensor plan
    also states its time run in the executor's default order for it (`executor_order`)."""
    if options is not None and not isinstance(options, CompileOptions):
        raise TypeError(f"options is a {type(options).__name__}; pass a CompileOptions, or settings by keyword "
                        "(compile_plan(problem, strategy=..., solver=...))")
    options = dataclasses.replace(options or CompileOptions(), **settings).for_problem(problem)
    multi = isinstance(problem, TransferProblem)
    strategy, solver, seed, max_tasks = options.strategy, options.solver, options.seed, options.max_tasks
    split_hosts, coalesce, bucket_bytes = options.split_hosts, options.coalesce, options.bucket_bytes
    max_staging_bytes, cross_tensor = options.max_staging_bytes or None, options.cross_tensor  # 0: no limit
    on_stage("cutting unit tasks")
    singles = problem.tensor_problems()
    if coalesce and max_staging_bytes is not None and max_staging_bytes < max(s.itemsize for s in singles):
        coalesce = False  # a limit below one element: limit_staging refuses it, naming the smallest limit that works
    kinds_cut = check_kinds_task_count(singles, max_tasks, split_hosts, options.merge)
    indices = range(len(singles)) if multi else [None]
    kinds = _kinds(singles)  # tensors of one kind cut, split, coalesce and cost alike: each kind is planned once
    planned: dict[tuple, list[Cell]] = {}
    for single, kind in zip(singles, kinds):
        if kind not in planned:
            planned[kind] = decompose(single, merge=options.merge, max_tasks=None)
    cells = [planned[kind] for kind in kinds]
    on_stage(f"costing {sum(map(len, cells))} cells ({len(planned)} kinds of tensor)")
    may_chain = split_hosts and multi and not sources_receive(planned.values(), problem.cluster)
    chained = _chained(singles, kinds, planned, problem, coalesce, bucket_bytes) if may_chain else set()
    cut: dict[tuple, tuple[list[Cell], list[BundleCell]]] = {}
    for single, kind in zip(singles, kinds):  # the bound and copies come from the cells as cut
        if kind not in cut:
            tasks_of = split_by_receiver_host(planned[kind], problem.cluster) if split_hosts and kind not in chained else planned[kind]
            cut[kind] = coalesce_cells(tasks_of, single, bucket_bytes) if coalesce else (tasks_of, [])
    scheduled = {kind: sum(1 for c in cut[kind][0] if c.receivers) + len(cut[kind][1]) for kind in cut}
    check_scheduled_task_count(sum(scheduled[kind] for kind in kinds), kinds_cut, len(singles), max_tasks, split_hosts, coalesce)
    load = receiving_load([cut[kind][0] for kind in kinds], problem.cluster)
    costed: dict[tuple, list[TaskOptions]] = {}  # kind -> its tasks' options, numbered from 0
    works, first = [], 0
    for index, single, kind in zip(indices, singles, kinds):
        mine, (tasks_of, bundles) = planned[kind], cut[kind]
        if kind not in costed:
            turns = rotations(tasks_of, problem.cluster) if kind in chained else None
            costed[kind] = task_options(single, tasks_of, strategy, load=load, turns=turns)
            costed[kind] += _bundle_options(bundles, single, len(costed[kind]))
        works.append(TensorWork(index, single, mine, renumbered(costed[kind], first)))
        first += len(costed[kind])
    tasks = [o.scheduling for w in works for o in w.options]
    on_stage(f"scheduling {len(tasks)} tasks with {solver}")
    schedule = solve(tasks, solver, seed=seed, time_limit_s=options.time_limit_s)
    on_stage("timing operations and assembling the plan")
    if split_hosts:  # recorded only when on, so plans compiled without it are unchanged
        split = "one unit task per receiving host" + (f"; {len(chained)} of {len(planned)} kinds of tensor chained through their "
                                                      "receiving hosts instead (host_split)" if chained else "")
        schedule = dataclasses.replace(schedule, details={**schedule.details, "split_hosts": split})
    if coalesce:
        schedule = dataclasses.replace(schedule, details={**schedule.details, "coalesce": f"bundles of at most {bucket_bytes} B"})
    if cross_tensor:
        schedule = dataclasses.replace(schedule, details={**schedule.details, "cross_tensor": f"bundles share messages of at most {bucket_bytes} B"})
    return assemble_rows(problem, works, schedule, strategy, seed, max_staging_bytes, max_tasks,
                         share_bytes=bucket_bytes if cross_tensor else None, on_stage=on_stage,
                         on_posted_staging=on_posted_staging)
