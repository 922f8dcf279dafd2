"""Coalesced messages (`compile --coalesce`): many small cells between two hosts become a few bundles.

A cell qualifies when it is small (at most `bucket_bytes / SMALL_FRACTION`), held on one host only,
needed on one other host only, and copied locally nowhere; a small cell needed on several hosts is
first cut into one cell per receiving host. Qualifying cells are grouped by (sending
host, receiving host), in cell order, into bundles of at most `bucket_bytes`. A bundle is one
operation (`schemas.op_kinds`, kind `bundle`): its holders send their parts to a relay over the
intra-host links, the relay sends all of them across in one message, and the receiving relay scatters
them; so a host pair exchanges a few large messages instead of thousands of small ones. Each bundle
is one scheduling task holding the two NIC sides while its cross-host message keeps them busy. Other cells are
planned as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain

from xmesh_plan.schemas import ReshardingProblem
from xmesh_plan.schemas.carriers import bundle_bytes
from xmesh_plan.schemas.geometry import Region, region_size
from xmesh_plan.schemas.op_kinds import bundle_runs

from .scheduling import Option, SchedulingTask
from .solvers.bound import schedule_lower_bound
from .strategies import PlannedOp, StrategyResult
from .unit_tasks import Cell, split_by_receiver_host

DEFAULT_BUCKET_BYTES = 4 * 2**20  # the least default bucket: a host of one 400 Gbit/s NIC moves about this in BUNDLE_SECONDS
BUNDLE_SECONDS = 80e-6  # hosts with faster NICs get a bucket their NICs take about this long to move (`default_bucket_bytes`)
SMALL_FRACTION = 8  # a cell above bucket_bytes / 8 already amortises the per-message cost; it is sent on its own


def default_bucket_bytes(message_bytes_per_s: float | None = None) -> int:
    """The default bucket on hosts whose messages move at `message_bytes_per_s` (`Cluster.message_bytes_per_s`; None:
    unknown): DEFAULT_BUCKET_BYTES, or what those NICs move in BUNDLE_SECONDS rounded up to a power of two MiB where
    that is more. Every message is striped over all of a host's NICs, so each NIC is busy with every message's
    overhead: a bundle, and a box sent alone (above an eighth of the bucket), must grow with the NICs to cost as
    little over its bytes (8 x 400 Gbit/s: 32 MiB; a Llama-3-70B-like 4-layer cut 1.115x the bound posted with 4 MiB,
    1.036x with 16 MiB).

    >>> default_bucket_bytes(50e9) // 2**20, default_bucket_bytes(400e9) // 2**20, default_bucket_bytes() // 2**20
    (4, 32, 4)
    """
    if message_bytes_per_s is None or message_bytes_per_s * BUNDLE_SECONDS <= DEFAULT_BUCKET_BYTES:
        return DEFAULT_BUCKET_BYTES
    return 2 ** math.ceil(math.log2(message_bytes_per_s * BUNDLE_SECONDS / 2**20)) * 2**20


@dataclass(frozen=True, slots=True)
class BundleCell:
    """The cells of one bundle, seen as one unit task: `region` bounds them, `parts` are their boxes.

    Read where a `Cell` is (`compile.assemble_joint`): same fields, `nbytes` the parts' total."""

    region: Region
    parts: tuple[Region, ...]
    holders: tuple[int, ...]
    needers: tuple[tuple[int, ...], ...]
    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    local_copies: tuple[int, ...] = ()
    merged_cells: int = 1

    def nbytes(self, itemsize: int) -> int:
        return sum(math.prod(b - a for a, b in part) for part in self.parts) * itemsize


def _hosts(devices: tuple[int, ...], problem: ReshardingProblem) -> set[int]:
    return {problem.cluster.host_of(d) for d in devices}


def qualifies(cell: Cell, problem: ReshardingProblem, bucket_bytes: int) -> bool:
    """Small, held on one host, needed on one other host, no local copy."""
    if not cell.receivers or not cell.senders or cell.local_copies:
        return False
    if cell.nbytes(problem.itemsize) * SMALL_FRACTION > bucket_bytes:
        return False
    send, recv = _hosts(cell.senders, problem), _hosts(cell.receivers, problem)
    return len(send) == 1 and len(recv) == 1 and send != recv


def _split_small(cells: list[Cell], problem: ReshardingProblem, bucket_bytes: int) -> list[Cell]:
    """A small cell held on one host and needed on several others becomes one cell per receiving host,
    so each can ride in that host pair's bundle: a few more bytes leave its host (one copy per host,
    not a chain), many fewer messages cross the NICs (a weight sync's norms and small shards)."""
    out = []
    for cell in cells:
        out += split_by_receiver_host([cell], problem.cluster) if splits_small(cell, problem, bucket_bytes) else [cell]
    return out


def splits_small(cell: Cell, problem: ReshardingProblem, bucket_bytes: int) -> bool:
    """Whether `_split_small` cuts the cell by receiving host: small, held on one host, needed, copied locally nowhere."""
    return bool(cell.receivers and cell.senders and not cell.local_copies and len(_hosts(cell.senders, problem)) == 1
                and cell.nbytes(problem.itemsize) * SMALL_FRACTION <= bucket_bytes)


def coalesce_cells(cells: list[Cell], problem: ReshardingProblem, bucket_bytes: int) -> tuple[list[Cell], list[BundleCell]]:
    """(cells planned as before, bundles): qualifying cells grouped per host pair, in cell order, into
    bundles of at most `bucket_bytes`."""
    if bucket_bytes < problem.itemsize:
        raise ValueError(f"bucket_bytes {bucket_bytes} is below one element ({problem.itemsize} B); use --bucket-mb 4")
    rest, groups = [], {}
    for cell in _split_small(cells, problem, bucket_bytes):
        if qualifies(cell, problem, bucket_bytes):
            pair = (problem.cluster.host_of(cell.senders[0]), problem.cluster.host_of(cell.receivers[0]))
            groups.setdefault(pair, []).append(cell)
        else:
            rest.append(cell)
    bundles = []
    for pair in sorted(groups):
        batch, size = [], 0
        for cell in groups[pair]:
            nbytes = cell.nbytes(problem.itemsize)
            if batch and size + nbytes > bucket_bytes:
                bundles.append(_bundle(batch))
                batch, size = [], 0
            batch.append(cell)
            size += nbytes
        bundles.append(_bundle(batch))
    return rest, bundles


def _bundle(cells: list[Cell]) -> BundleCell:
    """Parts sorted by (holder, needers, box), so each holder's parts are one run (one gather message);
    relays rotate over the holders and needers, so no one device relays every bundle of its host."""
    rows = sorted((min(c.senders), c.receivers, c.region, c.merged_cells) for c in cells)
    holders = tuple(r[0] for r in rows)
    needers = tuple(r[1] for r in rows)
    parts = tuple(r[2] for r in rows)
    ndim = len(parts[0])
    region = tuple((min(p[d][0] for p in parts), max(p[d][1] for p in parts)) for d in range(ndim))
    senders = tuple(sorted(set(holders)))
    receivers = tuple(sorted({d for n in needers for d in n}))
    return BundleCell(region, parts, holders, needers, senders, receivers, (), sum(r[3] for r in rows))


def relays(bundle: BundleCell, index: int) -> tuple[int, int]:
    """(sending relay, receiving relay): a holder and a needer, rotated by the bundle's index."""
    return bundle.senders[index % len(bundle.senders)], bundle.receivers[index % len(bundle.receivers)]


def scatter_seconds(scattered_bytes: float, messages: int, latency_s: float, overhead_s: float,
                    intra_bytes_per_s: float) -> float:
    """How long the receiving relay's scatter takes once the message has arrived, with the NICs free: its port sends
    `scattered_bytes` (`scattered_elements`) to the needers in `messages` messages at the intra-host rate, each paying
    the per-message overhead, and the last arrives one latency later (as the simulator times it uncontended); none
    without a message. A shared message sends each needer one message (`carriers.group_runs`), a bundle alone one per
    run of consecutive parts (`op_kinds.bundle_runs`)."""
    if not messages:
        return 0.0
    return messages * overhead_s + scattered_bytes / intra_bytes_per_s + latency_s


def bundle_tail(op: PlannedOp, itemsize: int, latency_s: float, overhead_s: float, intra_bytes_per_s: float) -> float:
    """A bundle's tail: its cross-host message's latency, then its receiving relay's scatter (`scatter_seconds`)."""
    return latency_s + scatter_seconds(scattered_elements(op, op.dsts[0]) * itemsize, len(bundle_runs(op)[1]), latency_s,
                                       overhead_s, intra_bytes_per_s)


def scattered_elements(bundle: "BundleCell | PlannedOp", relay: int) -> int:
    """Elements the receiving relay sends on inside its host: each part once per needer other than itself."""
    return sum(math.prod(b - a for a, b in part) * sum(1 for d in needers if d != relay)
               for part, needers in zip(bundle.parts, bundle.needers))


def bundle_result(bundle: BundleCell, index: int, problem: ReshardingProblem) -> tuple[StrategyResult, Option]:
    """The bundle's one operation and its scheduling option: the NIC sides busy for the cross-host message's overhead
    and bytes; its latency and then the receiving relay's scatter (`bundle_tail`) delay the bundle's end, not the
    NICs (`simulate`: they carry the next message meanwhile)."""
    cluster = problem.cluster
    src, dst = relays(bundle, index)
    nbytes = bundle.nbytes(problem.itemsize)
    op = PlannedOp("bundle", src, (dst,), bundle.region, parts=bundle.parts, holders=bundle.holders, needers=bundle.needers)
    tail = bundle_tail(op, problem.itemsize, cluster.latency_s, cluster.overhead_s, cluster.intra_bytes_per_s)
    seconds = cluster.overhead_s + nbytes / cluster.message_bytes_per_s + tail
    op = op.sent(op.src, op.dsts, seconds, tail)
    sh, rh = cluster.host_of(src), cluster.host_of(dst)
    resources = frozenset({(sh, "send"), (rh, "recv")})
    return StrategyResult((op,), seconds, resources, tail_s=tail), Option(sh, src, seconds, resources, tail)


def bundle_task(bundle: BundleCell, index: int, problem: ReshardingProblem, task_id: int) -> tuple[StrategyResult, SchedulingTask]:
    """`bundle_result` as a scheduling task with one option (its relays are fixed)."""
    result, option = bundle_result(bundle, index, problem)
    return result, SchedulingTask(task_id, (option,))


TimedOp = tuple[float, int, int | None, PlannedOp]
"""(start, task, tensor, operation): an operation as `compile.assemble_joint` lists it before numbering."""


def share_messages(timed_ops: list[TimedOp], itemsizes: list[int], bucket_bytes: int, host_of,
                   latency_s: float = 0.0, overhead_s: float = 0.0, intra_bytes_per_s: float | None = None,
                   limit_bytes: int | None = None) -> list[list[TimedOp]]:
    """The operations in order, bundles of any tensors between the same two hosts grouped into shared
    messages of at most `bucket_bytes` (`schemas.carriers`): each bundle, in list order, joins the open
    group of its host pair when the total, with the most alignment padding a holder could add, stays within
    the bucket and the group's last bundle so far
    carries a multiple of the largest element size; it takes the group's relays and start. Every other
    operation is a group of one. A weight sync's many small tensors then cross each host pair in a few
    messages instead of one or more per tensor. Every bundle of a shared message lasts as long as the message:
    its bundles' durations less the latency and overhead that all but one of them no longer pay, across hosts and in
    the receiving relay's scatter (`_lasting_as_one`: one message per needer). With a staging
    limit (`limit_bytes`) a group also stays within what its relays could stage, whichever devices become its relays
    (`carriers.group_staging`: the message, and side areas holding at most every part once per needer)."""
    align = max(itemsizes)
    relay_bound: dict[tuple[int, int], int] = {}  # host pair -> the open group's bound on its relays' staging
    groups: list[list[TimedOp]] = []
    open_group: dict[tuple[int, int], tuple[int, int]] = {}  # host pair -> (index in groups, bytes so far)
    sizes: dict[tuple[int, int], int] = {}  # (id of a bundle, its itemsize) -> its bytes: tensors of one kind share their bundles
    relayed: dict[tuple[int, int | None, tuple[int, ...]], PlannedOp] = {}  # (id of a bundle, a group's relays) -> the bundle sent from them, made once
    for item in timed_ops:
        at, task, tensor, op = item
        if op.kind != "bundle":
            groups.append([item])
            continue
        itemsize = itemsizes[tensor or 0]
        nbytes = sizes.get((id(op), itemsize))
        if nbytes is None:
            nbytes = sizes[(id(op), itemsize)] = bundle_bytes(op, itemsize)
        pair = (host_of(op.src), host_of(op.dsts[0]))
        index, total = open_group.get(pair, (-1, 0))
        # a holder stages its parts of each bundle at a multiple of `align` (schemas.staging.chained): count that
        # padding too, so no device of the group stages more than the bucket (the staging limit, when one is set)
        relays = 0
        if limit_bytes is not None:  # side areas: each part once per needer at most, each piece padded to `align` at most
            part_bytes = [region_size(p) * itemsize for p in op.parts]
            relays = sum(n * len(need) + 2 * (align - 1) * (1 + len(need)) for n, need in zip(part_bytes, op.needers))
        within = index < 0 or limit_bytes is None or total + nbytes + relay_bound[pair] + relays <= limit_bytes
        if index >= 0 and within and total + nbytes + len(groups[index]) * (align - 1) <= bucket_bytes:
            head = groups[index][0]
            key = (id(op), head[3].src, head[3].dsts)
            if key not in relayed:
                relayed[key] = op.sent(head[3].src, head[3].dsts, op.duration_s, op.tail_s)
            groups[index].append((head[0], task, tensor, relayed[key]))
            total += nbytes
            relay_bound[pair] = relay_bound.get(pair, 0) + relays
        else:
            groups.append([item])
            index, total = len(groups) - 1, nbytes
            relay_bound[pair] = relays
        open_group[pair] = (index, total) if nbytes % align == 0 else (-1, 0)  # a ragged bundle ends its group
    groups = _balanced_relays(groups, itemsizes, None if intra_bytes_per_s is None else (latency_s, overhead_s, intra_bytes_per_s))
    scatters: dict[int, int] = {}  # id of a bundle (as sent from its message's relays: a model's layers share them) -> its scatters
    return [_lasting_as_one(group, latency_s, overhead_s, scatters) if len(group) > 1 else group for group in groups]


def _balanced_relays(groups: list[list[TimedOp]], itemsizes: list[int], timing: tuple[float, float, float] | None = None) -> list[list[TimedOp]]:
    """Each cross-host message of bundles (shared or not) from the relays that least load a device port, in list
    order: the sending relay is the holder whose in-port, with what it has gathered so far, takes in the least (all
    of the message's parts but its own), the receiving relay the needer whose out-port scatters the least likewise.
    A relay moves its message's parts through one device port, slower than the host's NICs together (8 x 400 Gbit/s
    against 2400 Gbit/s), so messages that follow one another on a host must not pile onto one relay: a bundle's own
    relays rotate within its tensor only, and a shared message would take its first bundle's (on a 2-layer
    DeepSeek-V3-like cut one device scattered 5.6 times the mean; a 4-layer cut: 1.0567x -> 1.0497x the bound in
    host order, 1.0492x -> 1.0439x posted). Given `timing` (latency, overhead, intra-host bytes/s), every bundle's tail is its
    message's receiving relay's (`_relayed`), made once per bundle object and relays (a model's layers share them)."""
    port_in: dict[int, int] = {}
    port_out: dict[int, int] = {}
    made: dict[tuple[int, int, int, int], PlannedOp] = {}  # (id of a bundle, itemsize, relays) -> it sent between them
    loads: dict[tuple[int, int], tuple[int, dict[int, int], dict[int, int]]] = {}  # (id of a bundle, itemsize) -> `_port_loads`
    out = []
    for group in groups:
        if group[0][3].kind != "bundle":
            out.append(group)
            continue
        held: dict[int, int] = {}
        wanted: dict[int, int] = {}
        total = 0
        for _, _, tensor, o in group:
            size = itemsizes[tensor or 0]
            known = loads.get((id(o), size))
            if known is None:
                known = loads[(id(o), size)] = _port_loads(o, size)
            total += known[0]
            for d, nbytes in known[1].items():
                held[d] = held.get(d, 0) + nbytes
            for d, nbytes in known[2].items():
                wanted[d] = wanted.get(d, 0) + nbytes
        needed = sum(wanted.values())
        src = min(held, key=lambda d: (port_in.get(d, 0) + total - held[d], d))
        dst = min(wanted, key=lambda d: (port_out.get(d, 0) + needed - wanted[d], d))
        port_in[src] = port_in.get(src, 0) + total - held[src]
        port_out[dst] = port_out.get(dst, 0) + needed - wanted[dst]
        sent = []
        for at, task, tensor, o in group:
            key = (id(o), itemsizes[tensor or 0], src, dst)
            if key not in made:
                made[key] = _relayed(o, src, dst, key[1], timing)
            sent.append((at, task, tensor, made[key]))
        out.append(sent)
    return out


def _port_loads(op: PlannedOp, itemsize: int) -> tuple[int, dict[int, int], dict[int, int]]:
    """A bundle's bytes, and per device the bytes it holds and the bytes it needs: what `_balanced_relays` weighs,
    found once per bundle object and element size (a model's layers share their bundles)."""
    held: dict[int, int] = {}
    wanted: dict[int, int] = {}
    total = 0
    for part, holder, needers in zip(op.parts, op.holders, op.needers):
        nbytes = math.prod(b - a for a, b in part) * itemsize
        total += nbytes
        held[holder] = held.get(holder, 0) + nbytes
        for d in needers:
            wanted[d] = wanted.get(d, 0) + nbytes
    return total, held, wanted


def _relayed(op: PlannedOp, src: int, dst: int, itemsize: int, timing: tuple[float, float, float] | None) -> PlannedOp:
    """A bundle sent between the relays `src` and `dst`; given (latency, overhead, intra-host bytes/s), its tail is
    the latency and then `dst`'s scatter (`bundle_tail`), as `bundle_result` states it for the bundle's own relays."""
    moved = op if (op.src, op.dsts) == (src, (dst,)) else op.sent(src, (dst,), op.duration_s, op.tail_s)
    if timing is None:
        return moved
    tail = bundle_tail(moved, itemsize, *timing)
    if moved.tail_s == tail:
        return moved
    return moved.sent(moved.src, moved.dsts, op.duration_s - op.tail_s + tail, tail)


def _lasting_as_one(group: list[TimedOp], latency_s: float, overhead_s: float, scatters: dict[int, int]) -> list[TimedOp]:
    """A shared message's bundles, each lasting the whole message: one latency and overhead across hosts, every
    bundle's bytes and scatter (the receiving relay scatters them all), the scatter's messages as the executor sends
    them: one per needer (`carriers.group_runs`) where each bundle alone sent one per run (`op_kinds.bundle_runs`),
    and one latency after the last of them. `scatters`: the scatter messages of each bundle alone, by id, filled as
    they are counted (the caller keeps the bundles alive)."""
    fewer = len(group) - 1
    ops = [op for _, _, _, op in group]
    for op in ops:
        if id(op) not in scatters:
            scatters[id(op)] = len(bundle_runs(op)[1])
    alone = [scatters[id(op)] for op in ops]
    shared = shared_messages_inside(ops)[1]
    seconds = sum(op.duration_s for op in ops) - fewer * (latency_s + overhead_s)
    tail = sum(op.tail_s for op in ops) - fewer * latency_s
    saved = (sum(alone) - shared) * overhead_s + (sum(1 for n in alone if n) - (1 if shared else 0)) * latency_s
    seconds, tail = seconds - saved, tail - saved
    return [(at, task, tensor, op.sent(op.src, op.dsts, seconds, tail)) for at, task, tensor, op in group]


def shared_messages_inside(group) -> tuple[int, int]:
    """(gathers, scatters): how many intra-host messages a shared message of two or more bundles sends, one per holder
    other than the sending relay and one per needer other than the receiving relay: the lengths of
    `carriers.group_runs`, counted without listing its pieces (a compile counts every group's, a model's MoE layers
    have bundles of hundreds of parts)."""
    src, relay = group[0].src, group[0].dsts[0]
    holders = set(chain.from_iterable(op.holders for op in group))
    needers = set(chain.from_iterable(chain.from_iterable(op.needers for op in group)))
    return len(holders) - (src in holders), len(needers) - (relay in needers)


def shared_bound(proven_s: float | None, groups: list[list[TimedOp]], tasks: list[SchedulingTask], host_of) -> float | None:
    """The proven bound a plan of shared messages (`share_messages`) states: the solver's `proven_s`, which counts
    one overhead (and one scatter) per bundle, or where less, the bound (`solvers.bound.schedule_lower_bound`) of
    the tasks as the messages pay them: every task that is no bundle as scheduled, every cross-host message of
    bundles one task (its NIC sides, busy for its one overhead and all of its bundles' bytes, its tail as
    `_lasting_as_one` states it). A shared message pays less than its bundles did, so the solver's bound alone could
    lie above the plan's own time; the lesser of two is a bound of what the plan sends."""
    if proven_s is None:
        return None
    bundled: set[int] = set()
    messages: list[SchedulingTask] = []
    for group in groups:
        _, task, _, op = group[0]
        if op.kind != "bundle":
            continue
        bundled.update(t for _, t, _, _ in group)
        sides = frozenset({(host_of(op.src), "send"), (host_of(op.dsts[0]), "recv")})
        messages.append(SchedulingTask(task, (Option(host_of(op.src), op.src, op.duration_s, sides, op.tail_s),)))
    if not messages:
        return proven_s
    return min(proven_s, schedule_lower_bound([t for t in tasks if t.id not in bundled] + messages))


TaskTiming = tuple[float, float, float, frozenset, frozenset]
"""A scheduled task's (start, busy seconds, tail seconds, NIC sides it holds, every resource it holds: NIC sides and
device ports): what `retimed_on_nics` replays."""


def retimed_on_nics(groups: list[list[TimedOp]], timing: dict[int, TaskTiming], host_of) -> tuple[list[list[TimedOp]], dict[int, float]]:
    """The shared messages' listing (`share_messages`) timed as the NIC sides take it, and each task's new start.

    The schedule placed every bundle on its own; a shared message carries its group's bundles at once, from its
    head's start, so the schedule's times overlap on the NIC sides where the riders' bytes went ahead. Replayed in
    list order (the simulator's host order: each side takes its operations one after another), every message
    starts once its NIC sides are free and keeps them busy for its overhead and bytes (a shared message: all of
    its bundles', one overhead); its latency delays its end only. A task that is no bundle waits for, and holds,
    its device ports as well (a task inside one host: its device ports only), as the schedule's model (and so
    `shared_bound`) counts them: the timetable is one of that model's, never earlier than its bound. A task's other
    operations move with it; local copies keep their times. Listed again by start, each message's bundles together."""
    free: dict[tuple, float] = {}
    moved: dict[int, float] = {}  # task -> its start as replayed
    out: list[tuple[float, int, list[TimedOp]]] = []
    for k, group in enumerate(groups):
        at, task, tensor, op = group[0]
        known = timing.get(task)
        if op.kind == "copy" or known is None or not known[4]:
            out.append((at, k, group))
            continue
        start, busy, tail, sides, held = known
        if op.kind == "bundle":
            sides = frozenset({(host_of(op.src), "send"), (host_of(op.dsts[0]), "recv")})
            busy = op.duration_s - op.tail_s  # the whole shared message's (`_lasting_as_one`)
            begin = max((free.get(s, 0.0) for s in sides), default=0.0)
            for s in sides:
                free[s] = begin + busy
            for _, rider, _, _ in group:
                moved[rider] = begin
            out.append((begin, k, [(begin, t, n, o) for _, t, n, o in group]))
            continue
        if task not in moved:
            moved[task] = max((free.get(r, 0.0) for r in held), default=0.0)
            for r in held:
                free[r] = moved[task] + busy
        shift = moved[task] - start
        out.append((at + shift, k, [(at + shift, task, tensor, op)]))
    out.sort(key=lambda item: (item[0], item[1]))
    return [group for _, _, group in out], moved
