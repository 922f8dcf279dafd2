"""A readable summary of a plan: tasks, bytes crossing hosts, per-host NIC load, time against the bound."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tabulate import tabulate

from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.carriers import fused, message_groups
from xmesh_plan.schemas.op_kinds import hops_pair_bytes, merged_route, pair_bytes, route
from xmesh_plan.schemas.plan_tensors import is_multi
from xmesh_plan.schemas.staging import footprints, staging_peaks

from .executor_order import executor_order, order_name
from .bounds import over_bound
from .simulate import lower, nic_assignment, run_flows, simulate_plan

MAX_TRACED_OPERATIONS = 60_000  # `nic_trace` simulates the plan again: about 25 CPU s at 55,000 bundle-heavy operations here


@dataclass
class HostLoad:
    """Bytes one host's NIC sends and receives across hosts under a plan."""

    send_bytes: int = 0
    recv_bytes: int = 0
    send_messages: int = 0
    recv_messages: int = 0


@dataclass
class PlanLoads:
    hosts: dict[int, HostLoad] = field(default_factory=dict)

    def add(self, src_host: int, dst_host: int, nbytes: int, messages: int = 0) -> None:
        if src_host != dst_host and (nbytes or messages):
            sender, receiver = self.hosts.setdefault(src_host, HostLoad()), self.hosts.setdefault(dst_host, HostLoad())
            sender.send_bytes += nbytes
            receiver.recv_bytes += nbytes
            sender.send_messages += messages
            receiver.recv_messages += messages

    def busiest_messages(self) -> tuple[int, str, int]:
        """(host, side, messages) of the NIC side that carries the most messages."""
        sides = [(h, side, getattr(load, f"{side}_messages")) for h, load in self.hosts.items() for side in ("send", "recv")]
        return max(sides, key=lambda item: (item[2], -item[0]), default=(0, "send", 0))

    @property
    def cross_host_bytes(self) -> int:
        return sum(h.recv_bytes for h in self.hosts.values())


def wire_route(group: list, itemsizes: list[int]) -> tuple:
    """(the operation a group of `message_groups` is on the wire, its messages): a shared message (`schemas.carriers`)
    as the one bundle it is, its intra-host messages one per pair of devices (`op_kinds.merged_route`, as the executor
    and the simulator send them); any other operation as it is (`op_kinds.route`)."""
    op = fused(group, itemsizes)
    return op, merged_route(op) if len(group) > 1 else route(op)


def _layout(op) -> tuple:
    """What an operation's messages depend on, its boxes by identity: a compact file's reader gives the operations of
    a model's repeated layers the same box objects (`schemas.plan_compact`), so their routes are computed once."""
    return op.kind, op.src, op.dsts, id(op.region), id(op.parts), op.chunks, id(op.holders), id(op.needers)


class _Wire:
    """`wire_route` and its bytes per pair of devices (`op_kinds.hops_pair_bytes`) of a plan's message groups, each
    distinct group once. Lives while the plan does (its keys are the ids of the plan's boxes)."""

    def __init__(self, plan: Plan):
        self.itemsizes = [p.itemsize for p in plan.problem.tensor_problems()]
        self.routes: dict[tuple, tuple] = {}
        self.pairs: dict[tuple, dict] = {}

    def key(self, group: list) -> tuple:
        if len(group) == 1:
            return _layout(group[0]), self.itemsizes[group[0].tensor or 0]
        return tuple((_layout(op), self.itemsizes[op.tensor or 0]) for op in group)

    def route(self, group: list) -> tuple:
        """(the group on the wire, its hops, its bytes per pair of devices): `wire_route`, the operation itself for a group of one."""
        key = self.key(group)
        known = self.routes.get(key)
        if known is None:
            op, hops = wire_route(group, self.itemsizes)
            known = self.routes[key] = (op, hops, hops_pair_bytes(hops, 1 if len(group) > 1 else self.itemsizes[op.tensor or 0]))
        return (group[0] if len(group) == 1 else known[0]), known[1], known[2]


def plan_loads(plan: Plan, wire: _Wire | None = None) -> PlanLoads:
    """Cross-host bytes per host: every message of every operation (`schemas.op_kinds.pair_bytes`), in its tensor's
    itemsize; the bundles of one shared message (`schemas.carriers`) as the one bundle they are on the wire. `wire`:
    the plan's routes, where the caller shares them (`_Wire`)."""
    host, wire = plan.problem.cluster.host_of, wire or _Wire(plan)
    loads = PlanLoads()
    adds: dict[tuple, list] = {}  # a distinct group's calls of `loads.add`, in order
    for group in message_groups(plan.operations):
        key = wire.key(group)
        calls = adds.get(key)
        if calls is None:
            _, hops, pairs = wire.route(group)
            calls = adds[key] = [(host(a), host(b), nbytes, 0) for (a, b), nbytes in pairs.items()] + \
                [(host(hop.src), host(hop.dst), 0, 1) for hop in hops if hop.elements]
        for call in calls:
            loads.add(*call)
    return loads


def message_cost_line(plan: Plan, loads: PlanLoads) -> str:
    """How much of the time is per-message cost: messages on the busiest NIC side x the per-message overhead
    (the time the side is busy with each message besides its bytes; latency overlaps other messages),
    next to the gap between the prediction and the byte bound (which counts bandwidth only)."""
    host, side, count = loads.busiest_messages()
    overhead = plan.problem.cluster.overhead_s
    cost, gap = count * overhead, plan.predicted_seconds - plan.lower_bound_seconds
    share = f"{cost / gap:.0%} of the {gap:.4f} s gap to the bound" if gap > 0 else "no gap to the bound"
    return (f"per-message cost: host {host} {side} carries {count} messages x {overhead * 1e6:g} us overhead = {cost:.4f} s "
            f"({share}){_striping(plan, cost)}")


def _striping(plan: Plan, cost: float) -> str:
    """Where every message is striped over a host's NICs (no task pinned to one: `simulate.nic_assignment`), each NIC
    is busy with every message's overhead: one NIC per message, balanced, would leave each 1/n of it."""
    n = len(plan.problem.cluster.nics)
    if n < 2 or cost <= 0 or any(":" in entry.side for entry in plan.host_order):
        return ""
    return (f"; striped over {n} NICs, each NIC pays every message's overhead: one NIC per message, balanced, would pay "
            f"{cost / n:.4f} s")


@dataclass(frozen=True)
class SideGap:
    """The predicted time on the busiest NIC side: `need` (its bytes over its rate) plus the four parts of the rest."""

    host: int
    side: str
    need: float
    before: float
    idle: float
    beyond: float
    after: float


def side_gap(plan: Plan, loads: PlanLoads) -> SideGap | None:
    """Where the time over the byte bound goes on the busiest NIC side (bytes over rate, the bound's side): before the
    first operation crossing it starts, idle between such operations, the time they hold it beyond their bytes' time
    (per-message overhead and latency, rates shared with other hops of theirs), and after the last one ends. The four
    add up to the predicted time minus that side's byte time; the operations' stored (simulated) times span them.
    None where nothing crosses hosts."""
    cluster, host_of = plan.problem.cluster, plan.problem.cluster.host_of
    rates = {"send": cluster.send_bytes_per_s, "recv": cluster.recv_bytes_per_s}
    sides = [(getattr(load, f"{side}_bytes") / rates[side], h, side) for h, load in loads.hosts.items() for side in rates]
    if not sides:
        return None
    named = re.match(r"host (\d+) (send|receive)", plan.solver.details.get("lower_bound_reason", ""))
    need, host, side = max(sides, key=lambda item: (item[0], -item[1]))
    if named:  # the side the bound names, where it is one of the busiest
        mine = int(named.group(1)), "send" if named.group(2) == "send" else "recv"
        need, host, side = next((item for item in sides if item[1:] == mine and item[0] >= need * (1 - 1e-12)), (need, host, side))
    spans = []
    crosses: dict[tuple, bool] = {}  # per distinct operation (`_layout`): whether a message of it crosses the side
    for group in message_groups(plan.operations):
        op = group[0]
        key = _layout(op)
        if key not in crosses:
            crosses[key] = any(hop.elements and (a := host_of(hop.src)) != (b := host_of(hop.dst)) and host == (a if side == "send" else b)
                               for hop in route(op))
        if crosses[key]:
            spans.append((op.start_s, op.end_s))
    spans.sort()
    busy, reach = 0.0, None
    for begin, end in spans:
        if reach is None or begin > reach:
            busy, reach = busy + end - begin, end
        elif end > reach:
            busy, reach = busy + end - reach, end
    first, last = spans[0][0], max(end for _, end in spans)
    idle, after = max(0.0, (last - first) - busy), max(0.0, plan.predicted_seconds - last)  # rounding aside
    return SideGap(host, side, need, first, idle, busy - need, after)


def gap_line(plan: Plan, loads: PlanLoads) -> str:
    """`side_gap` as one line of `inspect`."""
    gap = side_gap(plan, loads)
    if gap is None:
        return "gap to the bound: nothing crosses hosts"
    return (f"gap to the bound on host {gap.host} {gap.side} ({gap.need:.4f} s of bytes): {gap.before:.4f} s before its first "
            f"operation, {gap.idle:.4f} s idle between them, {gap.beyond:.4f} s held beyond their bytes' time (overhead, "
            f"latency, shared rates), {gap.after:.4f} s after its last")


@dataclass(frozen=True, slots=True)
class RelayLoad:
    """A plan's bundles (`compile --coalesce`) and what their relays move inside hosts: bundles and the cross-host
    messages they share, their bytes across hosts, the bytes gathered into sending relays and scattered from receiving
    relays over the devices' ports, and the busiest relay port each way (device, bytes)."""

    bundles: int
    messages: int
    cross_bytes: int
    gathered: int
    scattered: int
    busiest_in: tuple[int, int]
    busiest_out: tuple[int, int]
    gathers: int = 0  # intra-host messages into sending relays (a shared message: one per holder, `carriers.group_runs`)
    scatters: int = 0  # ... out of receiving relays (a shared message: one per needer)
    busiest_messages: tuple[int, str, int] = (-1, "", 0)  # (device, "in" or "out", messages) of the relay port with the most
    # messages inside its host: a sending relay's port in (its gathers), a receiving relay's out (its scatters)
    shared: bool = False  # some bundles share one cross-host message


def relay_load(plan: Plan, wire: _Wire | None = None) -> RelayLoad | None:
    """`RelayLoad` from the plan's own operations; None where it has no bundle. `wire`: as for `plan_loads`."""
    host, wire = plan.problem.cluster.host_of, wire or _Wire(plan)
    bundles = messages = cross = gathered = scattered = gathers = scatters = 0
    port_in: dict[int, int] = {}
    port_out: dict[int, int] = {}
    port_messages: dict[tuple[int, str], int] = {}
    shared = False
    for group in message_groups(plan.operations):
        if group[0].kind != "bundle":
            continue
        op, hops, pairs = wire.route(group)
        bundles, messages, shared = bundles + len(group), messages + 1, shared or len(group) > 1
        for hop in hops:
            if hop.elements and host(hop.src) == host(hop.dst):
                port = (hop.dst, "in") if hop.dst == op.src else (hop.src, "out")
                port_messages[port] = port_messages.get(port, 0) + 1
                gathers, scatters = (gathers + 1, scatters) if hop.dst == op.src else (gathers, scatters + 1)
        for (a, b), nbytes in pairs.items():
            if host(a) != host(b):
                cross += nbytes
            elif b == op.src:  # a holder's runs into the sending relay
                gathered += nbytes
                port_in[b] = port_in.get(b, 0) + nbytes
            else:  # the receiving relay's runs out to its needers
                scattered += nbytes
                port_out[a] = port_out.get(a, 0) + nbytes
    if not bundles:
        return None
    top = lambda ports: max(ports.items(), key=lambda item: (item[1], -item[0]), default=(-1, 0))  # noqa: E731
    busiest = max(port_messages.items(), key=lambda item: (item[1], -item[0][0], item[0][1]), default=None)
    return RelayLoad(bundles, messages, cross, gathered, scattered, top(port_in), top(port_out), gathers, scatters,
                     (*busiest[0], busiest[1]) if busiest else (-1, "", 0), shared)


def timed_by_line(plan: Plan) -> list[str]:
    """For a plan its schedule times (too many messages to simulate in host order), what that timetable counts and what
    it does not: each NIC side busy with a message's overhead and bytes, a shared message once, latencies and a relay's
    scatter after it as delays; not the relays' gathers inside the sending host, nor rates shared between messages; and
    where the simulator timed the executor's order all the same (`compile.executor_budget`), that it did."""
    timed_by = plan.solver.details.get("timed_by", "simulator")
    if timed_by.startswith("simulator"):
        return []
    schedule, _, executor = timed_by.partition("; ")
    also = f"; {executor} (the executor's prediction above)" if executor else ""
    return [f"timed by the {schedule}: each NIC side busy for its messages' overhead and bytes (a shared message once), "
            "latencies and relays' scatters as delays after them; not timed: relays' gathers inside the sending host, "
            f"rates shared between messages{also}"]


def relay_line(plan: Plan, wire: _Wire | None = None) -> list[str]:
    """`relay_load` as a line of `inspect`: a bundle crosses hosts at the host's NICs together but is gathered into
    and scattered from one device each side, through that device's port, so where the port is slower than the NICs
    a relay's gathers take longer than its message, and bundles back to back leave the NIC side waiting for them."""
    load = relay_load(plan, wire)
    if load is None:
        return []
    cluster = plan.problem.cluster
    port, nics = cluster.intra_bytes_per_s, cluster.message_bytes_per_s
    (d_in, b_in), (d_out, b_out) = load.busiest_in, load.busiest_out
    device, side, count = load.busiest_messages
    most = (f"; most messages at one relay port: device {device} {'takes in' if side == 'in' else 'sends out'} {count}, {count} x "
            f"{cluster.overhead_s * 1e6:g} us overhead = {count * cluster.overhead_s:.4f} s") if count else ""
    return [f"bundles: {load.bundles} in {load.messages} cross-host messages, {_bytes(load.cross_bytes)} across hosts; their relays "
            f"gather {_bytes(load.gathered)} in {load.gathers} messages and scatter {_bytes(load.scattered)} in {load.scatters}"
            + (" (a shared message: one per holder and per needer)" if load.shared else "") + " inside hosts through one device port "
            f"each ({cluster.intra_host_gbps:g} Gbit/s, {port / nics:.2f}x the host's NICs together: a message's gathers take "
            f"{nics / port:.2f}x its time across)" + _busiest_ports(d_in, b_in, d_out, b_out, port) + most]


def _busiest_ports(d_in: int, b_in: int, d_out: int, b_out: int, port: float) -> str:
    """The relay ports that take in and send out most, each where one moves anything (a relay that holds and needs
    every part of its bundles moves nothing inside its host)."""
    ports = ([f"device {d_in} takes in {_bytes(b_in)} ({b_in / port:.4f} s)"] if b_in else []) + \
        ([f"device {d_out} sends out {_bytes(b_out)} ({b_out / port:.4f} s)"] if b_out else [])
    return f"; busiest relay ports: {', '.join(ports)}" if ports else ""


@dataclass(frozen=True, slots=True)
class NicTrace:
    """The bound's NIC side flow by flow, as the simulator moves it in host order (`side_gap` reads operation spans,
    which for a bundle also cover its gathers and scatters inside hosts): before its first message, its bytes' time,
    the per-message overhead, the rest of the time a message is on it (latency, rates shared), idle between messages
    while the next one waits for its data (a bundle's gathers, an earlier hop) or for its sender's side, after its last.
    The parts add up to the predicted time."""

    host: int
    side: str
    before: float
    need: float
    overhead: float
    shared: float
    waiting_data: float
    waiting_sender: float
    after: float


def nic_trace(plan: Plan, loads: PlanLoads) -> NicTrace | None:
    """`NicTrace` of the side `side_gap` takes; None where nothing crosses hosts or the plan's times are the schedule's."""
    gap = side_gap(plan, loads)
    if gap is None or not plan.solver.details.get("timed_by", "simulator").startswith("simulator"):
        return None
    lowering, _ = lower(plan.operations, plan.problem, "host-order", nic_assignment(plan.host_order))
    spans = run_flows(lowering.flows, lowering.capacity)
    link = f"h{gap.host}.{gap.side}"
    mine = [f for f in lowering.flows if any(x == link or x.startswith(link + ":") for x in f.links)]
    if not mine:
        return None
    left = {f.id: spans[f.id][1] - f.latency_s for f in lowering.flows}
    side_rate = sum(v for k, v in lowering.capacity.items() if k == link or k.startswith(link + ":"))  # stripes: all NICs
    need = sum(f.nbytes for f in mine) / side_rate
    overhead = sum(f.overhead for f in mine) / side_rate
    busy, reach, data, sender = 0.0, None, 0.0, 0.0
    for start, end, f in sorted((spans[f.id][0], left[f.id], f) for f in mine):
        if reach is not None and start > reach:  # idle: what the next message waited for last
            waits = [(spans[i][1], False) for i in f.after]  # its data arrived; or a message left a sender's NIC side:
            waits += [(left[i], any(".send" in x for x in lowering.flows[i].links)) for i in f.after_sent]
            if waits and max(waits)[1]:
                sender += start - reach
            else:
                data += start - reach
        if reach is None or start > reach:
            busy, reach = busy + end - start, end
        elif end > reach:
            busy, reach = busy + end - reach, end
    first = min(spans[f.id][0] for f in mine)
    return NicTrace(gap.host, gap.side, first, need, overhead, max(0.0, busy - need - overhead), data, sender,
                    max(0.0, plan.predicted_seconds - reach))


def nic_trace_line(plan: Plan, loads: PlanLoads) -> str:
    """`nic_trace` as one line of `inspect` (plans of at most MAX_TRACED_OPERATIONS operations)."""
    if len(plan.operations) > MAX_TRACED_OPERATIONS:
        return f"flows on the bound's side: not traced (more than {MAX_TRACED_OPERATIONS:,} operations)"
    trace = nic_trace(plan, loads)
    if trace is None:
        return "flows on the bound's side: not traced (nothing crosses hosts, or the schedule's timetable times the plan)"
    return (f"flows on host {trace.host} {trace.side}: {trace.before:.4f} s before the first, {trace.need:.4f} s of bytes, "
            f"{trace.overhead:.4f} s per-message overhead, {trace.shared:.4f} s more on it (latency, shared rates), idle "
            f"{trace.waiting_data:.4f} s waiting for the next one's data (a bundle's gathers) and {trace.waiting_sender:.4f} s "
            f"for its sender's side, {trace.after:.4f} s after the last")


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3f} GiB"


def _bytes(nbytes: float) -> str:
    """`512 B`, `3.0 KiB`, `1.5 MiB`, `2.000 GiB`: a size small tensors still show."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3f} {unit}" if unit == "GiB" else f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def _what(plan: Plan) -> str:
    """The line saying what moves where: the tensor and its specs, or the tensor count and the meshes."""
    p = plan.problem
    if is_multi(plan):
        src, dst, cluster = p.src_mesh, p.dst_mesh, p.cluster
        return (f"{len(p.tensors)} tensors ({_bytes(p.nbytes)}): mesh {src.label} on hosts {','.join(map(str, src.hosts(cluster)))} "
                f"-> mesh {dst.label} on hosts {','.join(map(str, dst.hosts(cluster)))}")
    return (f"tensor {'x'.join(map(str, p.shape))} {p.dtype} ({_gib(p.nbytes)}): mesh {p.src.mesh.label} [{p.src.label}] on hosts "
            f"{','.join(map(str, p.src.mesh.hosts(p.cluster)))} -> mesh {p.dst.mesh.label} [{p.dst.label}] on hosts "
            f"{','.join(map(str, p.dst.mesh.hosts(p.cluster)))}")


def indented(rows, headers, colalign) -> list[str]:
    """`rows` under `headers` as aligned plain-text lines (tabulate), each indented by two spaces."""
    return ["  " + line for line in tabulate(rows, headers=headers, tablefmt="plain", colalign=colalign,
                                              disable_numparse=True).splitlines()]


def tensor_rows(plan: Plan) -> list[str]:
    """One row per tensor of a multi-tensor plan: specs, tasks, operations, bytes crossing hosts, when it is done."""
    p = plan.problem
    tasks, ops, done = [0] * len(p.tensors), [0] * len(p.tensors), [0.0] * len(p.tensors)
    for t in plan.tasks:
        tasks[t.tensor] += 1
    for op in plan.operations:
        ops[op.tensor] += 1
        done[op.tensor] = max(done[op.tensor], op.end_s)
    crossing = [0] * len(p.tensors)
    host, itemsizes = p.cluster.host_of, [t.itemsize for t in p.tensor_problems()]
    across: dict[tuple, int] = {}  # per distinct operation (`_layout`) and element size: its bytes between hosts
    for op in plan.operations:
        key = _layout(op), itemsizes[op.tensor]
        if key not in across:
            across[key] = sum(n for (a, b), n in pair_bytes(op, itemsizes[op.tensor]).items() if host(a) != host(b))
        crossing[op.tensor] += across[key]
    table = [(t.name, "x".join(map(str, t.shape)), t.dtype + (f" -> {t.dst_dtype}" if t.dst_dtype else ""),
              f"{t.src or 'boxes'} -> {_dst_label(p, t)}", tasks[i], ops[i], _bytes(crossing[i]),
              f"{done[i]:.4f}s") for i, t in enumerate(p.tensors)]
    rows = indented(table, ("tensor", "shape", "dtype", "src -> dst spec", "tasks", "ops", "cross-host", "done at"),
                    colalign=("left",) + ("right",) * 7)
    return rows


def _dst_label(problem, tensor) -> str:
    """A tensor's destination layout in the listing: its spec, `boxes`, or `in <fused tensor>` for a fused part."""
    fused = problem.fused_part(tensor.name)
    return f"in {problem.fused[fused].name}" if fused is not None else str(tensor.dst or "boxes")


ORDER_MEANINGS = {  # queueing discipline -> who executes that way
    "host-order": "each NIC side in the plan's order (the plan's claim)",
    "device-order": "each device in one operation at a time (the executor's default order, NCCL, Alpa)",
    "posted": "every operation at once, links shared (the executor with order='posted')",
}
MULTI_TENSOR_ORDER_MEANINGS = ORDER_MEANINGS | {  # TransferExecutor's defaults differ (executor.transfer_executor.default_order)
    "device-order": "each device in one operation at a time (the torch engine's default for this plan, Alpa)",
    "posted": "every operation at once, links shared (the executor's default for this plan on MPI)",
}
LIMITED_ORDER_MEANINGS = {  # a plan that states a staging limit runs posted within it (`executor.window`)
    "host-order": ORDER_MEANINGS["host-order"],
    "window": "posted within the limit's window per device (the MPI engine's default for this plan)",
    "device-order": "each device in one operation at a time (the torch and NCCL engines' default for this plan)",
    "posted": "every staged box at once (the MPI engine keeps this plan within its limit: window)",
}
SINGLE_LIMITED_ORDER_MEANINGS = ORDER_MEANINGS | {  # a one-tensor plan stating a limit: device order, or posted in its window
    "window": "posted within the limit's window per device (the executor with order='posted' for this plan)",
    "posted": "every staged box at once (the executor with order='posted' keeps this plan within its limit: window)",
}


def order_meanings(plan: Plan) -> dict[str, str]:
    """The disciplines `inspect --orders` times for `plan` (`simulate.DISCIPLINES`), each with who runs the plan so."""
    if plan.staging is not None:
        return LIMITED_ORDER_MEANINGS if is_multi(plan) else SINGLE_LIMITED_ORDER_MEANINGS
    return MULTI_TENSOR_ORDER_MEANINGS if is_multi(plan) else ORDER_MEANINGS


def order_lines(plan: Plan) -> list[str]:
    """The plan timed by the simulator under each queueing discipline, next to the byte lower bound."""
    lines = ["predicted under each queueing (simulator):"]
    for discipline, meaning in order_meanings(plan).items():
        seconds = simulate_plan(plan, discipline).makespan_s
        lines.append(f"  {discipline:<13} {seconds:.4f} s  {_over(seconds, plan.lower_bound_seconds)} bound   {meaning}")
    return lines


def _over(seconds: float, bound: float) -> str:
    return f"{over_bound(seconds, bound):.3f}x"


def executor_line(plan: Plan) -> list[str]:
    """A multi-tensor plan's stated time in the executor's default order (posted), against the bound; none
    for a single-tensor plan (its default device order is what its host order is scheduled for)."""
    if not is_multi(plan):
        return []
    stated = plan.executor_prediction
    if stated is None:
        return [f"predicted {order_name(plan, executor_order())} (the executor's default order for this plan): not stated; "
                "`xmesh-plan check --simulate` times it (`inspect --orders`: under every order)"]
    return [f"predicted {order_name(plan, stated.order)} (the executor's default order for this plan): {stated.predicted_seconds:.4f} s, "
            f"{_over(stated.predicted_seconds, plan.lower_bound_seconds)} the bound"]


def executor_summary(plan: Plan) -> str:
    """` in host order, 0.3262 s posted (the executor's default order, 1.016x the bound)` for a plan that states
    its time in the executor's order, else empty: what `compile` prints after the predicted time (host order named as
    the schedule's timetable where that timed the operations)."""
    stated = plan.executor_prediction
    if stated is None:
        return ""
    timetable = " (the schedule's timetable)" if plan.solver.details.get("timed_by", "").startswith("schedule") else ""
    return (f" in host order{timetable}, {stated.predicted_seconds:.4f} s {order_name(plan, stated.order)} (the executor's default order, "
            f"{_over(stated.predicted_seconds, plan.lower_bound_seconds)} the bound)")


def shared_summary(plan: Plan) -> str:
    """` (84 bundles in 4 shared cross-host messages)` for a plan whose bundles share messages (`schemas.carriers`), else empty."""
    groups = [g for g in message_groups(plan.operations) if len(g) > 1]
    if not groups:
        return ""
    return f" ({sum(map(len, groups))} bundles in {len(groups)} shared cross-host messages)"


def _peak(peaks: dict[int, int]) -> str:
    """`512.0 MiB (device 9; 8 devices stage)` or `none`: the largest per-device staging."""
    if not peaks:
        return "none"
    device, top = max(peaks.items(), key=lambda item: (item[1], -item[0]))
    return f"{_bytes(top)} (device {device}; {len(peaks)} device{'s' if len(peaks) > 1 else ''} stage)"


def staging_lines(plan: Plan) -> list[str]:
    """The largest staging area on one device in each executor order (`schemas.staging`; posted within a stated limit's
    window), and the plan's stated limit."""
    within = " within the limit" if plan.staging is not None else ""
    prints = footprints(plan)  # both orders read them
    shown = "; ".join(f"{order} order{within if order == 'posted' else ''} {_peak(staging_peaks(plan, order, prints))}"
                      for order in ("device", "posted"))
    lines = [f"staging per device (boxes that are not one run of a shard): {shown}"]
    if plan.staging is not None:
        stated = plan.staging
        lines.append(f"stated staging: limit {_bytes(stated.limit_bytes)} per device (--max-staging-mb {stated.limit_bytes / 2**20:g}), "
                     f"peak {_peak(stated.peak_bytes)} in {stated.order} order; the executor refuses an order that needs more")
    return lines


def staging_summary(plan: Plan) -> str:
    """`; staging at most 64.0 MiB per device (device order)` for a plan that states its staging, else empty."""
    if plan.staging is None:
        return ""
    top = max(plan.staging.peak_bytes.values(), default=0)
    posted = ", the limit posted (the MPI engine's default order)" if is_multi(plan) else ""  # `executor.window`
    return f"; staging at most {_bytes(top)} per device ({plan.staging.order} order, limit {_bytes(plan.staging.limit_bytes)}){posted}"


def summarize(plan: Plan, show_tasks: bool = False, show_ops: bool = False, show_orders: bool = False) -> str:
    p = plan.problem
    wire = _Wire(plan)  # routes computed once for the loads and the relays
    loads = plan_loads(plan, wire)
    cluster = p.cluster
    lines = [
        f"plan {p.name or '(unnamed)'}: schema {plan.schema_version}, {plan.generator}",
        _what(plan),
        f"cluster: {cluster.devices_per_host} devices/host, {len(cluster.nics)} NIC(s) of {cluster.nics[0].send_gbps:g}/{cluster.nics[0].recv_gbps:g} Gbit/s "
        f"send/recv, intra-host {cluster.intra_host_gbps:g} Gbit/s, latency {cluster.latency_us:g} us, overhead {cluster.overhead_us:g} us per message"
        + ("" if cluster.cpu is None else f"; CPU shared by every rank: {cluster.cpu.cores:g} cores, copies {cluster.cpu.copy_gbps:g} "
           f"Gbit/s per core, {cluster.cpu.message_us:g} us per message inside a host"),
        f"strategy {plan.strategy}, solver {plan.solver.name} (seed {plan.solver.seed})",
        f"unit tasks: {len(plan.tasks)} ({'adjacent identical cells merged' if plan.merged_slices else 'no merging'}), "
        f"operations: {len(plan.operations)}{shared_summary(plan)}",
        f"bytes crossing hosts: {_gib(loads.cross_host_bytes)}",
        "per-host NIC load:",
    ]
    lines += indented([(h, _gib(load.send_bytes), _gib(load.recv_bytes), f"{load.send_bytes / cluster.send_bytes_per_s:.4f}s",
                        f"{load.recv_bytes / cluster.recv_bytes_per_s:.4f}s") for h, load in sorted(loads.hosts.items())],
                      ("host", "send", "recv", "send time", "recv time"), colalign=("right",) * 5)
    reason = plan.solver.details.get("lower_bound_reason", "")
    lines.append(f"predicted: {plan.predicted_seconds:.4f} s   lower bound: {plan.lower_bound_seconds:.4f} s"
                 f"{f' ({reason})' if reason else ''}   efficiency (bound/predicted): {plan.efficiency:.1%}")
    lines += executor_line(plan)
    lines += timed_by_line(plan)
    lines.append(message_cost_line(plan, loads))
    lines.append(gap_line(plan, loads))
    lines.append(nic_trace_line(plan, loads))
    lines += relay_line(plan, wire)
    lines += staging_lines(plan)
    if show_orders:
        lines += order_lines(plan)
    if is_multi(plan):
        lines += ["per tensor (cross-host: bytes of its messages between hosts):"] + tensor_rows(plan)
    if show_tasks:
        lines += ["tasks:"] + [f"  {t}" for t in plan.tasks]
    if show_ops:
        lines += ["operations:"] + [f"  {op}" for op in plan.operations]
    return "\n".join(lines)
