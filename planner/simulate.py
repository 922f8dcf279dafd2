"""A network simulator that replays a plan's operations on the cluster model and times them.

Model (stated, so every plan and baseline is judged by the same rules):
- Links. Each host NIC has a send side and a receive side (`h2.send:0`, `h2.recv:0`), each with its
  own bandwidth (full duplex). A host with several NICs stripes every cross-host message over all
  of them in proportion to their bandwidth, unless the plan pins a task to one NIC (`send:N`); alike NICs,
  a power of two of them, with no task pinned, are one pooled side per host (`h2.send`, `pooled_nics`). Inside a host every device has an outgoing and an incoming port at the
  intra-host bandwidth (`d8.out`, `d8.in`); a local copy uses the device's copy engine (`d8.copy`).
- Flows. Every message of an operation's route (`schemas.op_kinds.route`) becomes a flow: a send is
  one flow; a broadcast of K chunks down a chain is K x hops flows, chunk k on hop h starting once
  chunk k has crossed hop h-1 and chunk k-1 has crossed hop h; a ring all-gather is (n-1) x n flows,
  each member forwarding what it received the step before; a bundle is its gathers, its one message
  across hosts and its scatters (`op_kinds.bundle_runs`). A shared message of several bundles
  (`schemas.carriers`) is timed as the one bundle it is on the wire, its intra-host messages one per
  pair of devices as the executor sends them (`carriers.group_runs`, `op_kinds.merged_route`): one
  flow per holder to the sending relay and per needer from the receiving relay, each carrying all of
  that device's pieces of the group. The relays' moves of pieces into and out of the message inside
  their staging are local copies at memory speed and are not flows. A flow moves its bytes (plus the
  cluster's per-message overhead, time its links are busy with the message itself), then its
  data arrives one per-message latency later. The latency is a delay, not work: a link carries
  the next message while the last one is still in flight (LogGP's L against its o), so messages
  back to back on one link, or the chunks of a pipelined broadcast, pay it once, not each.
- Sharing. Flows active on a link at the same time share it max-min fairly (progressive filling), or by
  the rule a caller passes (`simulate(share=...)`: the emulated cluster's TCP, `bench/netlab/first_come.py`);
  no link is ever oversubscribed.
- Order. How operations queue is the executing system's choice, so it is a parameter:
  `host-order` (ours): operations that use a NIC side run one after another in plan order, as the
  planner's per-host order says, and a bundle's gathers inside its sending host start once the operation
  `GATHER_AHEAD` before it on each of its NIC sides has its turn there (its data is there and the one before
  it has left): they overlap the messages before it, a few bundles ahead, not every bundle's gathers at once
  (a weight sync's MoE layer has tens of thousands); a bundle starts with its message across hosts (its
  gathers come before), so it starts no earlier than those before it on its sides; the receiving
  relay sends each needer its runs one at a time (one connection per pair of devices, across bundles in
  plan order); `device-order` (Alpa's, and the executor's `order="device"`,
  `executor.lower.in_device_order`): every device works through its own operations in plan order,
  consecutive ones with the same peers as one run, and an operation starts when all its devices are
  free: what each received in its run before has arrived and what it sent has left (its own part,
  not the whole operation's; a message under `SYNC_SEND_BYTES` is buffered and done once posted, as
  the MPI engine sends it and the torch engine's receipts end it; `simulate(send_buffer_bytes=)` ends a send as bare
  gloo does instead), so
  operations of different devices share a NIC concurrently;
  `posted`: every operation starts as soon as its data is there and all running transfers share
  the links: the executor with `order="posted"` (every send and receive of a reshard posted at once,
  TCP sharing the links; measured on the emulated cluster, docs/netlab.md).
  `window`: posted within a staging window per device (`window_waits`: each device's staged operations
  take ranges of a ring of the window's bytes in plan order, and an operation's messages to or from a
  device wait for the earlier operations whose ranges it overlaps there to have finished on that device:
  what it received arrived, what it sent left; also a send under `SYNC_SEND_BYTES`, which the MPI engine's posted
  Isend ends once posted: a later start there, never an earlier one). The executor's default,
  `order="device"`, is `device-order`. In both executor orders a device starts its part of an
  operation once its own data is there (an all-gather member does not wait for the others' parts),
  and the messages between two devices go one at a time (one connection), in the order they are ready.
- CPU (opt-in, `Cluster.cpu`; the emulated cluster, where every rank runs on the same few cores): a
  message inside a host is CPU work at both ends (per message, and per byte copied through shared
  memory), a local copy CPU work at its device; each rank uses at most one core, and every rank at work
  shares the machine's cores max-min fairly (links `d8.cpu` and `cpu`, in core microseconds per second).
An uncontended broadcast of K chunks down A hops costs `A L + sum(c_h) + (K-1) max(c_h)` with `c_h`
one chunk's time on hop h (overhead plus bytes) and L the latency, i.e. `t + (A-1) t/K` plus A
latencies and K overheads for A equal cross-host hops: the paper's `t + A t/K` counts one chunk more.
"""

from __future__ import annotations

import gc
import heapq
from collections import deque
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace

from xmesh_plan.schemas import Operation, Plan, ReshardingProblem
from xmesh_plan.schemas.op_kinds import Hop, members, reads, route, rule_of
from xmesh_plan.schemas.carriers import message_groups
from xmesh_plan.schemas.staging import SYNC_SEND_BYTES, device_runs, footprints, stage_budget, staging_align, window_layout
from xmesh_plan.schemas.transfer import TransferProblem

DISCIPLINES = ("host-order", "device-order", "posted", "window")
GATHER_AHEAD = 4  # host order: a bundle gathers while the operation this many before it on its NIC sides has its turn
# (a 2-layer DeepSeek-V3-like cut, whose relays gather at a device port's 2400 Gbit/s behind 8 x 400 Gbit/s NICs: 1.219x the
# bound gathering 1 ahead, 1.144x 2 ahead, 1.119x 4 ahead, with 4 MiB bundles)
REL_EPS = 1e-12
MAX_KEPT_SUMS = 1 << 16  # `shared_message`: bundles whose sums are kept at once (a compile's full DeepSeek-V3-like plan has 8,748
# distinct ones among its 426,880 shared bundles); also the sends' and broadcasts' routes kept at once (`_Lowering.route`)


@dataclass(frozen=True, slots=True)
class Flow:
    """`nbytes` over `links`, arriving `latency_s` after its last byte left; it starts once every flow
    in `after` has arrived and every flow in `after_sent` has left its links (a queue, not data).
    `overhead` is the per-message overhead as the bytes its links could have moved meanwhile. Flows
    with the same `queue` (one connection) move one at a time, in the order they became ready. A flow
    counts as left for `after_sent` once at most `sent_below` of its work is left to move (a transport
    that copies a send into a socket buffer ends it that early; the connection stays busy to the end)."""

    id: int
    op: int
    nbytes: float
    latency_s: float
    links: tuple[str, ...]
    after: tuple[int, ...] = ()
    after_sent: tuple[int, ...] = ()
    overhead: float = 0.0
    queue: str = ""
    sent_below: float = 0.0

    @property
    def work(self) -> float:
        return self.nbytes + self.overhead


@dataclass(frozen=True, slots=True)
class SimResult:
    """When each operation started and ended, and when the last one ended; `work` is what the run cost
    (the flows whose rates were shared out again, summed over every event), a machine-independent measure."""

    makespan_s: float
    op_start_s: dict[int, float]
    op_end_s: dict[int, float]
    flows: int
    work: int = 0


ShareRule = Callable[[list[Flow], dict[str, float]], dict[int, float]]  # moving flows, link capacities -> rate per flow id


class TooCostly(RuntimeError):
    """A simulation stopped at its work budget (`run_flows(max_work=...)`): counted in groups and flows, not seconds,
    so whether a plan gets timed does not change with machine load."""


def max_min_rates(active: list[Flow], capacity: dict[str, float]) -> dict[int, float]:
    """Max-min fair rates by progressive filling: the tightest link's fair share is fixed first. Flows on the same
    links get one rate, so they are filled as groups (`group_rates`, the same arithmetic as flow by flow)."""
    members: dict[tuple[str, ...], dict[int, None]] = {}
    for f in active:
        members.setdefault(f.links, {})[f.id] = None
    rates = group_rates(list(members), members, capacity)
    return {f.id: rates[f.links] for f in active if f.links in rates}


def group_rates(groups: list[tuple[str, ...]], members: dict[tuple[str, ...], dict[int, None]],
                capacity: dict[str, float]) -> dict[tuple[str, ...], float]:
    """`max_min_rates` over groups of flows on the same links (a group's flows all get one rate), bit for bit: a
    link's share is what is left of it over the flows still on it, and a group's flows are taken off its other
    links one at a time, each subtracting the share (the same arithmetic as flow by flow, in the same order: every
    subtraction of a round is the same number). Costs the groups, and one subtraction per flow, not a dict per flow.

    A heap of (fair share, link) with stale entries skipped keeps each round logarithmic; users are
    insertion-ordered dicts so shares are subtracted in the same order every run (byte-identical plans).
    A link whose share changes gets one heap entry for its share after the round, not one per group
    the round took off it (the ones in between would be stale when popped)."""
    left: dict[str, float] = {}
    count: dict[str, int] = {}
    users: dict[str, dict[tuple[str, ...], int]] = {}  # link -> its groups still unrated, each with its number of flows
    for group in groups:
        n = len(members[group])
        for link in group:
            on = users.get(link)
            if on is None:
                users[link] = {group: n}
                left[link], count[link] = capacity[link], n
            else:
                on[group] = n
                count[link] += n
    heap = [(left[link] / count[link], link) for link in users]
    heapq.heapify(heap)
    pop, push = heapq.heappop, heapq.heappush
    rates: dict[tuple[str, ...], float] = {}
    while heap:
        share, link = pop(heap)
        on = users.get(link)
        if not on or share != left[link] / count[link]:
            continue  # stale entry: the link was finished or its share changed since it was pushed
        del users[link]
        touched: set[str] = set()  # the heap orders (share, link) entries alone: the order they are pushed in does not matter
        for group, n in on.items():
            rates[group] = share
            for other in group:
                sharing = users.get(other)
                if sharing is not None:
                    rest = left[other]
                    if n == 1:
                        rest -= share
                    else:
                        for _ in range(n):  # flow by flow, as `max_min_rates` rounds
                            rest -= share
                    left[other] = rest
                    count[other] -= n
                    del sharing[group]
                    if sharing:
                        touched.add(other)
                    else:
                        del users[other]
                        touched.discard(other)
        for other in touched:
            push(heap, (left[other] / count[other], other))
    return rates


def run_flows(flows: list[Flow], capacity: dict[str, float], max_work: int | None = None,
              cost: list[int] | None = None, share: ShareRule | None = None) -> dict[int, tuple[float, float]]:
    """Event-driven fluid simulation; (start, arrival) per flow id. Flows numbered 0, 1, 2, ... in list order (as `lower`
    makes them) run as they are (`_run`); others are renumbered so first (`_renumbered_run`). A flow with no bytes or links
    takes only its latency. Raises TooCostly once the run's work passes `max_work`: per event that starts or ends
    a flow, the groups of moving flows it shares rates out over (flows on the same links: `_sharing_groups`)
    and the flows whose rates change, summed over the run (what it costs, counted so that whether a plan is
    timed does not change with machine load); `cost`, when given, gets that sum appended. `share` gives the moving
    flows that share links with a flow that started or ended their rates (None: max-min fair).

    Work per event follows the flows whose rates change, not all that move: flows on the same links move as one
    group (max-min gives them one rate: `group_rates` fills groups, not flows); a flow keeps its remaining work as of
    the last time its rate changed (`_Moving`), its finish in a heap (stale entries skipped), and an event
    shares rates out again only over the groups linked to a flow that started or ended, and not at all where those
    groups and their flows per group are as when last shared out (`_Moving.rates_of`). When every message of a
    weight sync is posted at once, thousands of flows cross between two hosts' NICs: a few hundred groups.
    """
    if not _numbered_in_order(flows):
        return _renumbered_run(flows, capacity, max_work, cost, share)
    start, arrival = _run(flows, capacity, max_work, cost, share)
    return {f.id: (start[f.id], arrival[f.id]) for f in flows}


def _run(flows: list[Flow], capacity: dict[str, float], max_work: int | None = None, cost: list[int] | None = None,
         share: ShareRule | None = None) -> tuple[list[float], list[float]]:
    """`run_flows` of flows numbered 0, 1, 2, ... (in any list order), as (start, arrival) lists by flow id: every
    per-flow state here is a list by flow id, not a dict (memory and time per flow at 10^6-10^7 flows)."""
    fair, share = share is None, share or max_min_rates
    n = len(flows)
    by_id: list[Flow] = [None] * n  # ids are 0 .. n-1 in any list order
    for f in flows:
        by_id[f.id] = f
    waiting = [len(f.after) + len(f.after_sent) for f in by_id]
    on_arrival: list[list[int] | None] = [None] * n  # flow -> the flows waiting for it to arrive (None: none)
    on_sent: list[list[int] | None] = [None] * n  # ... for it to have left
    early: set[int] = set()  # flows that counted as left before their last byte did (`Flow.sent_below`)
    for f in flows:
        fid = f.id
        for parent in f.after:
            children = on_arrival[parent]
            if children is None:
                on_arrival[parent] = [fid]
            else:
                children.append(fid)
        for parent in f.after_sent:
            children = on_sent[parent]
            if children is None:
                on_sent[parent] = [fid]
            else:
                children.append(fid)
    buffered = {f.id for f in flows if f.sent_below > 0 and on_sent[f.id] is not None}  # flows that may count as left early
    clock, events = 0.0, []  # events: (time, flow) of arrivals: a flow's last byte left `latency_s` earlier
    start: list[float | None] = [None] * n
    arrival: list[float | None] = [None] * n
    moving = _Moving(by_id, buffered, early)
    busy: dict[str, int] = {}  # queue -> the flow moving on it
    queued: dict[str, deque[int]] = {}  # queue -> ready flows behind it, first ready first
    push = heapq.heappush

    def release(ready: list[int]) -> None:
        """Start every flow in `ready` whose last dependency just ended; a flow with nothing to move has
        left at once, which may start more (a work list, not recursion: such runs can be long)."""
        while ready:
            fid = ready.pop()
            waiting[fid] -= 1
            if waiting[fid]:
                continue
            f = by_id[fid]
            queue = f.queue
            if queue:
                if queue in busy:
                    queued.setdefault(queue, deque()).append(fid)
                    continue
                busy[queue] = fid
            start[fid] = clock
            work = f.nbytes + f.overhead  # `Flow.work`
            if work > 0 and f.links:
                moving.start(fid, clock)
                if fid in buffered and f.sent_below >= work:  # the buffer takes it all at once
                    ready.extend(left_early(fid))
            else:
                ready.extend(sent(fid))

    def left_early(fid: int) -> list[int]:
        """At most `sent_below` of it is left: what waits for it to have left may go (not what queues behind it).
        Its waiters are handed over, not copied: a flow leaves once (`sent` then hands over nothing)."""
        early.add(fid)
        out, on_sent[fid] = on_sent[fid] or [], None
        return out

    def sent(fid: int) -> list[int]:
        """Its last byte left: it arrives a latency later; flows queued behind it may go."""
        f = by_id[fid]
        push(events, (clock + f.latency_s, fid))
        out, on_sent[fid] = on_sent[fid] or [], None  # empty for a flow that left early (`left_early` took them)
        queue = f.queue
        if queue and busy.get(queue) == fid:
            del busy[queue]
            if queued.get(queue):  # the next on the connection goes first (release pops from the end)
                nxt = queued[queue].popleft()
                waiting[nxt] = 1
                out.append(nxt)
        return out

    free = [f.id for f in reversed(flows) if not waiting[f.id]]
    for fid in free:
        waiting[fid] = 1  # released below like a flow whose last dependency just ended
    release(free)
    work = 0
    pop = heapq.heappop
    while events or moving.active:
        if moving.touched:  # an arrival that starts nothing leaves the moving flows, and so their rates, as they were
            groups = _sharing_groups(moving.touched, moving.groups_on)
            moving.touched.clear()
            if fair:
                work += len(groups) + moving.set_group_rates(moving.rates_of(groups, capacity), clock)
            else:
                affected = sorted((i for g in groups for i in moving.members[g]), key=moving.seq.__getitem__)
                moving.fresh.clear()
                work += len(groups) + moving.set_rates(share([by_id[i] for i in affected], capacity), clock)
            if max_work is not None and work > max_work:
                raise TooCostly(f"the simulation took more than its budget of {max_work} units of work (groups shared out "
                                "and flows re-rated)")
        step = moving.next_time()
        if events and events[0][0] < step:
            step = events[0][0]
        if step > clock:
            clock += step - clock
        if moving.done and moving.done[0][0] <= clock:
            emptied, finished = moving.due(clock)
            for i in emptied:
                release(left_early(i))
            for i in finished:
                moving.stop(i)
                release(sent(i))
        while events and events[0][0] <= clock + REL_EPS * max(1.0, clock):
            _, i = pop(events)
            arrival[i] = clock
            waiters, on_arrival[i] = on_arrival[i], None  # a flow arrives once: its waiters are handed over, not copied
            if waiters:
                release(waiters)
    if any(waiting):
        raise ValueError("flow dependencies form a cycle; some flows never start")
    if cost is not None:
        cost.append(work)
    return start, arrival


def _numbered_in_order(flows: list[Flow]) -> bool:
    """Whether flows are numbered 0, 1, 2, ... in list order and wait only for flows of the list."""
    n = len(flows)
    seen = [False] * n
    for f in flows:
        if not 0 <= f.id < n or seen[f.id] or any(not 0 <= p < n for p in f.after) or any(not 0 <= p < n for p in f.after_sent):
            return False
        seen[f.id] = True
    return True


def _renumbered_run(flows: list[Flow], capacity: dict[str, float], max_work: int | None, cost: list[int] | None,
                    share: ShareRule | None) -> dict[int, tuple[float, float]]:
    """`run_flows` of flows numbered otherwise than 0, 1, 2, ... in list order: renumbered so, run, and answered by
    their own ids (a dependency on a flow not in the list is refused, as it could never start)."""
    number = {fid: i for i, fid in enumerate(sorted({f.id for f in flows}))}  # by rank: ties still break by id
    if len(number) < len(flows):
        raise ValueError("two flows have one id; give each flow its own")
    missing = next((p for f in flows for p in (*f.after, *f.after_sent) if p not in number), None)
    if missing is not None:
        raise ValueError(f"a flow waits for flow {missing}, which is not in the list; some flows never start")
    inner = [replace(f, id=number[f.id], after=tuple(number[p] for p in f.after),
                     after_sent=tuple(number[p] for p in f.after_sent)) for f in flows]  # list order kept
    spans = run_flows(inner, capacity, max_work, cost, share)
    return {f.id: spans[number[f.id]] for f in flows}


class _Moving:
    """The flows moving bytes, in groups on the same links (`members`; max-min gives a group one rate): each one's
    rate, and its work left as of `since` (settled only when its rate changes, so an event costs the flows it
    re-rates, not all that move); finish times in heaps with stale entries skipped. A flow has moved its work once
    at most `REL_EPS` of it (at least that many bytes) is left, so flows that finish together by the arithmetic
    finish in one event, in the order they started. Per-flow state is in lists by flow id (a flow starts once)."""

    def __init__(self, by_id: list[Flow], buffered: set[int], early: set[int]):
        self.by_id, self.buffered, self.early = by_id, buffered, early
        n = len(by_id)
        self.active = 0  # how many flows move
        self.seq: list[int] = [0] * n  # flow -> when it started, as a count (rates are shared out in this order)
        self.count = 0
        self.members: dict[tuple[str, ...], dict[int, None]] = {}  # links -> the moving flows on exactly them, first started first
        self.groups_on: dict[str, dict[tuple[str, ...], None]] = {}  # link -> the groups on it
        self.group_rate: dict[tuple[str, ...], float] = {}  # max-min: a group's rate as last shared out
        self.kept: dict[tuple[str, ...], tuple[dict, dict]] = {}  # group -> (flows per group, rates) of the groups it was last
        # shared out with (`rates_of`)
        self.fresh: dict[tuple[str, ...], list[int]] = {}  # group -> its flows started since rates were last shared out
        self.touched: dict[str, None] = {}  # links of flows that started or stopped since rates were last shared out
        self.left: list[float] = [0.0] * n  # work left as of `since`, while it moves
        self.since: list[float] = [0.0] * n
        self.tol: list[float] = [0.0] * n  # what may be left of its work when it counts as moved (REL_EPS of it, at least that many bytes)
        self.rate: list[float | None] = [None] * n  # None: not yet rated, or stopped
        self.version: list[int] = [-1] * n  # bumped at each new rate; -1 once stopped (its heap entries are stale)
        self.done: list[tuple[float, int, int, int, bool, float]] = []  # (when it is within REL_EPS of having moved all / down to its
        # buffer, seq, flow, version, buffer?, when it has moved all / down to its buffer): one heap for both times (`next_time`)

    def start(self, fid: int, clock: float) -> None:
        f = self.by_id[fid]
        links = f.links
        self.seq[fid] = self.count
        self.count += 1
        self.active += 1
        work = self.left[fid] = f.nbytes + f.overhead  # `Flow.work`
        self.since[fid], self.tol[fid] = clock, REL_EPS * max(1.0, work)
        self.version[fid] = 0
        group = self.members.get(links)
        if group is None:
            group = self.members[links] = {}
            for link in links:
                self.groups_on.setdefault(link, {})[links] = None
        group[fid] = None
        fresh = self.fresh.get(links)
        if fresh is None:
            self.fresh[links] = [fid]
        else:
            fresh.append(fid)
        touched = self.touched
        for link in links:
            touched[link] = None

    def stop(self, fid: int) -> None:
        self.active -= 1
        self.rate[fid], self.version[fid], self.left[fid], self.since[fid] = None, -1, 0.0, 0.0
        links = self.by_id[fid].links
        group = self.members[links]
        del group[fid]
        if not group:
            del self.members[links]
            self.group_rate.pop(links, None)
            for link in links:
                del self.groups_on[link][links]
        touched = self.touched
        for link in links:
            touched[link] = None

    def rates_of(self, groups: list[tuple[str, ...]], capacity: dict[str, float]) -> dict[tuple[str, ...], float]:
        """`group_rates` of `groups` (what `_sharing_groups` found linked to the flows that started or ended). Where the
        same groups, with the same numbers of flows each, were last shared out together, the rates then are its answer
        bit for bit (it reads nothing else but the capacities, and their order does not change it: every subtraction
        of a round is the same number), so they are taken again: a flow that leaves a connection as the next one on it
        starts, between the same hosts, leaves every count as it was. Counted as work all the same (`run_flows`)."""
        members, kept = self.members, self.kept
        last = kept.get(groups[0]) if groups else None
        if last is not None and len(last[0]) == len(groups) and all(kept.get(g) is last for g in groups) \
                and all(len(members[g]) == last[0][g] for g in groups):
            return last[1]
        rates = group_rates(groups, members, capacity)
        state = ({g: len(members[g]) for g in groups}, rates)
        for g in groups:
            kept[g] = state
        return rates

    def set_group_rates(self, rates: dict[tuple[str, ...], float], clock: float) -> int:
        """Max-min rates by group from `clock` on: every flow of a group whose rate changed, and the flows that
        started since, get it (`rerate`); how many flows that re-rated."""
        changed, fresh, group_rate, members = 0, self.fresh, self.group_rate, self.members
        for group, r in rates.items():
            if group_rate.get(group) != r:
                group_rate[group] = r
                changed += self.rerate(members[group], r, clock)
            elif group in fresh:
                changed += self.rerate(fresh[group], r, clock)
        fresh.clear()
        return changed

    def set_rates(self, rates: dict[int, float], clock: float) -> int:
        """New rates by flow from `clock` on (`rerate`); how many changed."""
        return sum(self.rerate((fid,), r, clock) for fid, r in rates.items())

    def rerate(self, fids, r: float, clock: float) -> int:
        """Rate `r` from `clock` on for `fids`: a flow whose rate changed has its work left settled and new finish
        times; how many changed."""
        changed = 0
        rate, left, since, version, seq, tols = self.rate, self.left, self.since, self.version, self.seq, self.tol
        by_id, buffered, early, done = self.by_id, self.buffered, self.early, self.done
        push = heapq.heappush
        for fid in fids:
            old = rate[fid]
            if old == r:
                continue
            changed += 1
            if old is not None:
                left[fid] -= old * (clock - since[fid])
                since[fid] = clock
            rate[fid] = r
            v = version[fid] = version[fid] + 1
            rest, at, s, tol = left[fid], since[fid], seq[fid], tols[fid]
            push(done, (at + (rest - tol) / r, s, fid, v, False, at + rest / r))
            if buffered and fid in buffered and fid not in early:
                below = by_id[fid].sent_below
                push(done, (at + (rest - below - tol) / r, s, fid, v, True, at + (rest - below) / r))
        return changed

    def next_time(self) -> float:
        """When the next moving flow has moved all its work (or down to its buffer): the least such time of a live heap
        entry. Entries are ordered by the time within REL_EPS of it, never later than it (the same arithmetic on less
        work, rounded alike), so only entries whose earlier time is below the best found so far can hold a smaller one:
        the heap's tree is searched down from its (live) top, pruned at the first entry not below it."""
        heap, version, early = self.done, self.version, self.early
        while heap:
            _, _, fid, v, buffer, _ = heap[0]
            if version[fid] == v and not (buffer and fid in early):
                break
            heapq.heappop(heap)  # stale: its rate changed, it ended, or it is already down to its buffer
        else:
            return float("inf")
        best, n, stack = heap[0][5], len(heap), [1, 2]
        while stack:
            i = stack.pop()
            if i >= n:
                continue
            soon, _, fid, v, buffer, at = heap[i]
            if soon >= best:
                continue  # neither it nor any entry below it finishes before `best`
            if at < best and version[fid] == v and not (buffer and fid in early):
                best = at
            stack += (2 * i + 1, 2 * i + 2)
        return best

    def due(self, clock: float) -> tuple[list[int], list[int]]:
        """(flows down to their buffer, flows that have moved all) at `clock`, each in the order they started:
        those within REL_EPS of their work of it (among them those whose time is up)."""
        hits: dict[int, bool] = {}
        heap, version, early, pop = self.done, self.version, self.early, heapq.heappop
        while heap and heap[0][0] <= clock:
            _, _, fid, v, buffer, _ = pop(heap)
            if version[fid] == v and not (buffer and fid in early):
                hits[fid] = hits.get(fid, False) or not buffer
        if len(hits) == 1:
            ((fid, whole),) = hits.items()
            return ([], [fid]) if whole else ([fid], [])
        seq = self.seq.__getitem__
        return (sorted((i for i, whole in hits.items() if not whole), key=seq),
                sorted((i for i, whole in hits.items() if whole), key=seq))


def _sharing_groups(touched: dict[str, None], groups_on: dict[str, dict[tuple[str, ...], None]]) -> list[tuple[str, ...]]:
    """The groups of moving flows linked, through links they share, to a link in `touched` (of a flow that started
    or ended): the only ones whose max-min rates can differ from before. Groups apart keep theirs: progressive
    filling on groups that share no link with the rest does the same arithmetic in the same order alone as with
    them, so reusing their rates changes no bit."""
    affected: dict[tuple[str, ...], None] = {}
    seen: set[str] = set()
    stack = list(touched)
    while stack:
        link = stack.pop()
        if link in seen:
            continue
        seen.add(link)
        for group in groups_on.get(link, ()):
            if group not in affected:
                affected[group] = None
                stack.extend(group)
    return list(affected)


def pooled_nics(cluster) -> bool:
    """Whether a message striped over every NIC of a host can be simulated as one flow on the host's pooled sides
    (`h3.send`, `h3.recv` at the NICs' summed bandwidth): the NICs are alike and their count a power of two. Each
    stripe then carries exactly 1/n of the message (and overhead) at exactly 1/n of the rates, n scaling every
    number by a power of two, which rounds the same: the times are the striped simulation's bit for bit, with n
    times fewer flows to share rates out over (a host of 8 NICs). Only where no task is pinned to one NIC."""
    n = len(cluster.nics)
    return n > 1 and n & (n - 1) == 0 and len(set(cluster.nics)) == 1


@dataclass(frozen=True, slots=True)
class SharedMessage:
    """A shared message of several bundles (`schemas.carriers`) as the simulator lowers it: its carrier's id, task
    and relays, its messages (`hops`: `op_kinds.merged_route` of the one bundle it is on the wire, in bytes) and the
    devices it involves (`op_kinds.members` of that bundle)."""

    id: int
    task: int
    src: int
    dsts: tuple[int, ...]
    hops: tuple[Hop, ...]
    devices: tuple[int, ...]
    kind = "bundle"  # what `op_kinds.rule_of` reads


def shared_message(group, itemsizes, sums: dict[tuple, tuple] | None = None) -> SharedMessage:
    """A group of bundles sharing one message as the simulator times it: the route `op_kinds.merged_route` gives the
    group fused into one bundle of bytes (`schemas.carriers.fused`), hop for hop, made without fusing it: each holder
    but the sending relay sends all its parts' bytes in one message (holders in order of first part), the message
    carries all, the receiving relay sends each other needer all its parts' bytes (needers in order of first need).

    Each bundle's bytes per holder and per needer are summed once per bundle; `sums` keeps them (up to MAX_KEPT_SUMS)
    by the identity of the bundle's parts, holders and needers, from the second bundle with those tuples on (the objects
    are kept with them, so an id is not reused while kept): a compile's bundles of tensors of one kind share those
    tuples, and so a model's layers share the sums."""
    first = group[0]
    src, relay = first.src, first.dsts[0]
    gathers: dict[int, int] = {}
    scatters: dict[int, int] = {}
    total = 0
    for op in group:
        size = itemsizes[op.tensor or 0]
        key = (id(op.parts), id(op.holders), id(op.needers), src, relay, size)
        known = None if sums is None else sums.get(key)
        if known is None or known[0] is not op.parts or known[1] is not op.holders or known[2] is not op.needers:
            known = (op.parts, op.holders, op.needers, *_bundle_sums(op.parts, op.holders, op.needers, src, relay, size))
            if sums is not None:
                if len(sums) >= MAX_KEPT_SUMS:
                    sums.clear()
                sums[key] = known if key in sums else None  # kept from the second bundle with these tuples on: a JSON
                # plan file's reader shares none; a compact file's shares a layout's tuples (`schemas.plan_compact._rows`)
        _, _, _, own_gathers, own_scatters, nbytes = known
        for h, n in own_gathers:
            gathers[h] = gathers.get(h, 0) + n
        for d, n in own_scatters:
            scatters[d] = scatters.get(d, 0) + n
        total += nbytes
    hops = [Hop(h, src, k, k, n, 1, (), True) for k, (h, n) in enumerate(gathers.items())]
    cross = len(hops)
    hops.append(Hop(src, relay, 0, cross, total, 1, tuple(range(cross)), True))
    hops += [Hop(relay, d, j, cross + 1 + j, n, 1, (cross,), False) for j, (d, n) in enumerate(scatters.items())]
    devices = tuple(dict.fromkeys((src, *gathers, relay, *scatters)))
    return SharedMessage(first.id, first.task, src, first.dsts, tuple(hops), devices)


def _bundle_sums(parts, holders, needers, src: int, relay: int, size: int
                 ) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, int], ...], int]:
    """A bundle's bytes per holder but `src` (in order of first part), per needer but `relay` (in order of first need),
    and in all, with `size` bytes an element."""
    gathers: dict[int, int] = {}
    scatters: dict[int, int] = {}
    total = 0
    for part, h, need in zip(parts, holders, needers):
        n = size
        for lo, hi in part:
            n *= hi - lo
        total += n
        if h != src:
            gathers[h] = gathers.get(h, 0) + n
        for d in need:
            if d != relay:
                scatters[d] = scatters.get(d, 0) + n
    return tuple(gathers.items()), tuple(scatters.items()), total


class _Lowering:
    """Turns operations into flows, with data dependencies and the discipline's queueing."""

    def __init__(self, problem: ReshardingProblem | TransferProblem, discipline: str, nic_of_task: dict[int, int] | None,
                 run_numbers: dict[int, list[int]] | None = None, send_buffer_bytes: float | None = None,
                 window: dict[int, dict[int, tuple[int, ...]]] | None = None):
        if discipline not in DISCIPLINES:
            raise ValueError(f"unknown discipline {discipline!r}; choose one of: {', '.join(DISCIPLINES)}")
        if (discipline == "window") != (window is not None):
            raise ValueError("the window discipline takes `window` (`window_waits`), and only it does")
        self.cluster, self.discipline = problem.cluster, discipline
        self.per_host, self.cpu = self.cluster.devices_per_host, self.cluster.cpu
        self.latency_s, self.overhead_s = self.cluster.latency_s, self.cluster.overhead_s
        self.itemsizes = [p.itemsize for p in problem.tensor_problems()]  # by an operation's tensor (None: the only one)
        self.nic_of_task = nic_of_task or {}
        self.flows: list[Flow] = []
        self.capacity: dict[str, float] = {}
        self.delivered: dict[tuple[int, int], list[int]] = {}  # (task, device) -> flows that brought it data
        self.last_on: dict[str, list[int]] = {}  # host order: NIC side -> terminal flows of the previous operation there
        self.turn: dict[str, deque] = {}  # host order: NIC side -> what each of the last GATHER_AHEAD operations there waits
        # for to have it: (its data to have arrived, the one before it there to have left); `bundle_turn`
        self.waited: dict[str, list[int]] = {}  # host order, while an operation is added: NIC side -> what it waits for to have left there
        self.scattered: dict[tuple[int, int], list[int]] = {}  # host order: (relay, needer) -> the last bundle scatter between them
        self.gathers: set[int] = set()  # flows of bundles' gathers: before the bundle's start (`op_times`)
        self.connections: dict[int, list[tuple[int, int]]] = {}  # host order: operation -> the (relay, needer) pairs its scatters queue on
        self.ready: dict[int, list[int]] = {}  # operation -> the flows that bring the data it sends from destination shards
        self.runs: dict[int, tuple] = {}  # device order: device -> (peers, arrivals and sends it waits for, its run's last flows per pair)
        self.run_numbers = run_numbers  # device order with a staging budget: device -> the run of each of its operations (`staging_runs`)
        self.taken: dict[int, int] = {}  # ... and how many of them were added so far
        self.posted_when: dict[int, tuple[list[int], list[int]]] = {}  # device order: buffered send -> what its sender waited for to post it
        self.sums: dict[tuple, tuple] = {}  # `shared_message`'s per-bundle sums, by the ids of the bundle's boxes and devices
        self.queues: dict[tuple[int, int, int], str] = {}  # `queue`: (from, to, stripe) -> its connection's name
        self.chains: dict[tuple, tuple[Hop, ...]] = {}  # `route`: a send's or broadcast's messages by its kind, chain, box and chunks
        self.send_buffer = send_buffer_bytes if discipline == "device-order" else None  # `simulate(send_buffer_bytes=)`
        self.gated: set[str] | None = None  # host order, while an operation is added: the NIC sides its flows were gated on (`gate`)
        self.lane_cache: dict[tuple[int, int, int | None], list[tuple[tuple[str, ...], float, float, float]]] = {}  # `lanes`
        self.pooled = pooled_nics(self.cluster) and not self.nic_of_task  # `lanes`: one lane for every NIC of a host
        self.last_ids: dict[int, tuple[int, ...]] = {}  # `same`: the last dependencies of each length a flow was given
        self.window = window  # window: group head -> device -> the earlier heads it waits for there (`window_waits`)
        self.window_done: dict[tuple[int, int], tuple[list[int], list[int]]] = {}  # window: (head, device) -> its flows
        # into the device and out of it, where it stages (later operations wait for them)

    def hop(self, op: Operation, a: int, b: int, nbytes: float, after: list[int], after_sent: list[int] = ()) -> list[int]:
        """One message from device a to device b; returns its flow ids (one per NIC it is striped over).
        Each stripe also carries the per-message overhead, as bytes at its slower side's speed (`lanes`)."""
        ha, hb = a // self.per_host, b // self.per_host  # `Cluster.host_of`
        if ha == hb and self.cpu is not None:
            return self.cpu_hop(op, a, b, nbytes, after, after_sent)
        latency = 0.0 if a == b else self.latency_s
        queued = a != b and self.discipline != "host-order"  # executor orders: one connection per pair
        after, waits = self.same(_ids(after)), _ids(after_sent)
        flows, out = self.flows, []
        for k, (links, weight, _, overhead) in enumerate(self.lanes(op, a, b, ha, hb)):
            share = nbytes if weight == 1.0 else nbytes * weight  # x * 1.0 is x: one float fewer per flow
            buffer = self.send_buffer * share / nbytes if self.send_buffer and a != b and nbytes > 0 else 0.0
            after_sent = self.same(waits if self.gated is None else _ids(self.gate(links, waits)))
            out.append(len(flows))
            flows.append(Flow(len(flows), op.id, share, latency, links, after, after_sent,
                              overhead if nbytes > 0 else 0.0, self.queue(a, b, k) if queued else "", buffer))
        return out

    def queue(self, a: int, b: int, k: int) -> str:
        """The connection from device a to b (stripe k) as a flow's `queue`: one string per connection, shared by its flows."""
        key = (a, b, k)
        name = self.queues.get(key)
        if name is None:
            name = self.queues[key] = f"{a}>{b}:{k}"
        return name

    def same(self, ids: tuple[int, ...]) -> tuple[int, ...]:
        """`ids`, as the last flow's dependencies when equal (one tuple for the many flows of a bundle waiting alike)."""
        last = self.last_ids
        if ids == last.get(len(ids)):
            return last[len(ids)]
        last[len(ids)] = ids
        return ids

    def lanes(self, op: Operation, a: int, b: int, ha: int, hb: int) -> list[tuple[tuple[str, ...], float, float, float]]:
        """The lanes a message from a to b takes: (its links, sorted; its share of the message; its slower side's
        bandwidth; the per-message overhead as the bytes that side moves meanwhile), one per NIC it is striped over;
        made once per pair of ends (and NIC), which also enters their links' capacities."""
        nic = self.nic_of_task.get(op.task) if ha != hb else None
        key = (a, b, nic) if ha == hb else (-1 - ha, -1 - hb, nic)  # cross-host: the hosts decide, not the devices
        known = self.lane_cache.get(key)
        if known is not None:
            return known
        if a == b:
            lanes = [{f"d{a}.copy": self.cluster.intra_bytes_per_s}]
        elif ha == hb:
            lanes = [{f"d{a}.out": self.cluster.intra_bytes_per_s, f"d{b}.in": self.cluster.intra_bytes_per_s}]
        elif self.pooled:  # every stripe would move as the others do: one flow stands for all, bit for bit (`pooled_nics`)
            n, first = len(self.cluster.nics), self.cluster.nics[0]
            lanes = [{f"h{ha}.send": n * (first.send_gbps * 1e9 / 8), f"h{hb}.recv": n * (first.recv_gbps * 1e9 / 8)}]
        else:
            nics = [nic] if nic is not None else range(len(self.cluster.nics))
            lanes = [{f"h{ha}.send:{n}": self.cluster.nics[n].send_gbps * 1e9 / 8,
                      f"h{hb}.recv:{n}": self.cluster.nics[n].recv_gbps * 1e9 / 8} for n in nics]
        for links in lanes:
            self.capacity |= links
        overhead = 0.0 if a == b else self.overhead_s
        known = self.lane_cache[key] = [(tuple(sorted(links)), self._weight(links, lanes), min(links.values()),
                                         overhead * min(links.values())) for links in lanes]
        return known

    def cpu_hop(self, op: Operation, a: int, b: int, nbytes: float, after: list[int], after_sent: list[int] = ()) -> list[int]:
        """A message inside a host, or a local copy, with the CPU modelled (`Cluster.cpu`): CPU work, in core
        microseconds, at each end at once (one flow per end, as stripes: it has arrived when both are done),
        each end on its rank's core (`d8.cpu`, at most one core) and on the machine's pool (`cpu`, `cores`)."""
        cpu = self.cluster.cpu
        ends = (a,) if a == b else (a, b)
        work = nbytes / cpu.copy_bytes_per_us + (cpu.message_us if a != b else 0.0) if nbytes > 0 else 0.0
        queue = f"{a}>{b}" if a != b and self.discipline != "host-order" else ""
        buffer = self.send_buffer / cpu.copy_bytes_per_us if self.send_buffer and a != b else 0.0  # in core microseconds
        out = []
        for k, device in enumerate(ends):
            links = {"cpu": cpu.cores * 1e6, f"d{device}.cpu": 1e6}
            self.capacity |= links
            links = tuple(sorted(links))
            flow = Flow(len(self.flows), op.id, work, 0.0, links, _ids(after),
                        _ids(after_sent if self.gated is None else self.gate(links, after_sent)), 0.0, f"{queue}:{k}" if queue else "", buffer)
            self.flows.append(flow)
            out.append(flow.id)
        return out

    @staticmethod
    def _weight(links: dict[str, float], lanes: list[dict[str, float]]) -> float:
        """A striped message is split over NICs in proportion to each lane's slower side."""
        total = sum(min(lane.values()) for lane in lanes)
        return min(links.values()) / total

    def add(self, op: Operation) -> None:
        ready = self.data_ready(op)
        if ready:
            self.ready[op.id] = ready
        if self.discipline == "posted":
            self.emit(op, [])
            return
        if self.discipline == "device-order":
            self.add_in_device_order(op)
            return
        if self.discipline == "window":
            self.add_in_window(op)
            return
        first = len(self.flows)
        self.gated, self.waited = set(), {}
        terminal, _ = self.emit(op, ready)
        self.gated = None
        mine = range(first, len(self.flows))
        for key in sorted({link for i in mine for link in self.flows[i].links if link.startswith("h")}):
            self.last_on[key] = [i for i in terminal if key in self.flows[i].links] or terminal
            self.turn.setdefault(key, deque(maxlen=GATHER_AHEAD)).append((ready, self.waited.get(key, [])))

    def finish(self) -> None:
        """Drop what only adding operations needs (what each task delivered where, each NIC side's last operations,
        device runs, ...): a run needs the flows, and `op_times` and `renumbered_only` what they read."""
        for state in (self.delivered, self.last_on, self.turn, self.scattered, self.runs, self.posted_when, self.lane_cache,
                      self.sums, self.chains, self.queues, self.window_done):
            state.clear()

    def add_in_device_order(self, op: Operation) -> None:
        """As the executor's device order (`executor.lower.in_device_order`): a device's operations with
        the same peers as the one before run together (a local copy joins the run it is in); the first of a new run, and every operation in
        it, waits for the device's own messages of the run before (not the whole operation's: a broadcast
        chain's head is free long before its tail): those it received to have arrived, those it sent to
        have left its links (a send completes once the transport holds its bytes, not when they arrive)."""
        peers = self.peers_of(op)
        barrier: dict[int, tuple[list[int], list[int]]] = {}
        for d in sorted(op.devices if isinstance(op, SharedMessage) else members(op)):
            mine = peers.get(d, frozenset())
            run = self.runs.get(d)
            if self.run_numbers is not None:  # the executor's runs, which a staging budget also ends (`schemas.staging.device_layout`)
                k = self.taken.get(d, 0)
                self.taken[d] = k + 1
                number = self.run_numbers[d][k]
                new_run = run is None or number != run[4]
            else:
                number, new_run = 0, run is None or (mine and run[0] and run[0] != mine)  # a local copy (no peers) joins the run it is in
            if new_run:
                pairs = run[3] if run is not None else {}
                arrived = {i for (a, b), ids in pairs.items() if b == d for i in ids}
                left: set[int] = set()
                for i in (i for (a, b), ids in pairs.items() if a == d for i in ids):
                    if i in self.posted_when:  # a buffered send ended when it was posted: wait for what that waited for
                        arrived.update(self.posted_when[i][0])
                        left.update(self.posted_when[i][1])
                    else:
                        left.add(i)
                run = self.runs[d] = (mine, sorted(arrived), sorted(left), {}, number)
            elif mine and not run[0]:
                run = self.runs[d] = (mine, *run[1:])
            barrier[d] = (run[1], run[2])
        _, last = self.emit(op, [], barrier)
        for (a, b), ids in last.items():  # the run's latest messages per pair of devices (its barrier when it ends)
            for d in {a, b}:
                self.runs[d][3][(a, b)] = ids

    def add_in_window(self, op: Operation) -> None:
        """Posted within each device's staging window (`window_waits`): the operation's messages to or from a device
        wait for the earlier operations it waits for there, each to have finished on that device (what it received
        there arrived, what it sent from there left)."""
        waits = self.window.get(op.id, {})
        done = self.window_done
        barrier: dict[int, tuple[list[int], list[int]]] = {}
        for d, earlier in waits.items():
            arrived, left = [], []
            for j in earlier:
                into, out = done[(j, d)]
                arrived += into
                left += out
            if arrived or left:
                barrier[d] = (arrived, left)
        _, last = self.emit(op, [], barrier)
        for d in waits:
            done[(op.id, d)] = ([i for (a, b), ids in last.items() if b == d and a != d for i in ids],
                                [i for (a, b), ids in last.items() if a == d and b != d for i in ids])

    def peers_of(self, op: Operation) -> dict[int, frozenset[int]]:
        """Device -> the devices it exchanges messages with in `op` (what decides a run in device order)."""
        out: dict[int, set[int]] = {}
        for hop in self.route(op):
            if hop.src != hop.dst and hop.elements:
                out.setdefault(hop.src, set()).add(hop.dst)
                out.setdefault(hop.dst, set()).add(hop.src)
        return {d: frozenset(p) for d, p in out.items()}

    def route(self, op: Operation | SharedMessage) -> tuple[Hop, ...]:
        """An operation's messages (`op_kinds.route`); a shared message's as `shared_message` made them. A send's or
        broadcast's are made once per (kind, chain, box, chunks) and shared (the layers of a model repeat them)."""
        if isinstance(op, SharedMessage):
            return op.hops
        if rule_of(op).pattern != "chain":
            return route(op)
        key = (op.kind, op.src, op.dsts, op.region, op.chunks)
        hops = self.chains.get(key)
        if hops is None:
            if len(self.chains) >= MAX_KEPT_SUMS:
                self.chains.clear()
            hops = self.chains[key] = route(op)
        return hops

    def gate(self, links: tuple[str, ...], after_sent: list[int] | tuple[int, ...]) -> list[int] | tuple[int, ...]:
        """Host order: the operation's first flow on each NIC side also waits for the previous operation's
        messages there to have left that side (not to have arrived: the NIC is free once they are out)."""
        extra = []
        for link in links:
            if link.startswith("h") and link not in self.gated:
                self.gated.add(link)
                extra += self.last_on.get(link, [])
                self.waited[link] = self.last_on.get(link, [])
        return [*after_sent, *extra] if extra else after_sent

    def bundle_turn(self, op: Operation) -> tuple[list[int], list[int]] | None:
        """Host order: what a bundle's gathers wait for, (to have arrived, to have left): the turn of the operation
        `GATHER_AHEAD` before it on each NIC side its message takes (`turn`; nothing while fewer went there); None for
        other operations and other orders."""
        if self.gated is None or rule_of(op).pattern != "bundle":
            return None
        a, b = op.src, op.dsts[0]
        ha, hb = a // self.per_host, b // self.per_host
        sides = sorted({link for links, *_ in self.lanes(op, a, b, ha, hb) for link in links if link.startswith("h")})
        turns = [self.turn[link][0] for link in sides if len(self.turn.get(link, ())) == GATHER_AHEAD]
        return [i for arrived, _ in turns for i in arrived], [i for _, left in turns for i in left]

    def data_ready(self, op: Operation) -> list[int]:
        """What an operation that sends out of destination shards waits for: what earlier operations of its task delivered there."""
        return [i for ids in self.data_by_device(op).values() for i in ids]

    def data_by_device(self, op: Operation) -> dict[int, list[int]]:
        """`data_ready` by the device whose destination shard the operation sends from (an all-gather's members); a
        shared message's bundles read source shards only."""
        if isinstance(op, SharedMessage) or not rule_of(op).has_parts:  # only an all-gather's members read destination shards
            return {}
        return {d: self.delivered.get((op.task, d), []) for d, shard, _ in reads(op) if shard == "dst"}

    def emit(self, op: Operation, waits: list[int], barrier: dict[int, tuple[list[int], list[int]]] | None = None
             ) -> tuple[list[int], dict[tuple[int, int], list[int]]]:
        """Flows of one operation, one per message of its route (several when striped); returns its
        terminal flows and the same by pair of devices: (src, dst) -> its last message's flows. Its
        gated hops wait for `waits` to arrive (host order: the operation's data, all of it). In the
        executor's orders a device starts as soon as its own data is there: a hop with no earlier hop
        of the route waits for what was delivered to its sender; in device order every message of a
        device waits for its `barrier`: device -> (messages to have arrived, to have left)."""
        flows: list[list[int]] = []
        last: dict[tuple[int, int], list[int]] = {}
        itemsize = 1 if isinstance(op, SharedMessage) else self.itemsizes[op.tensor or 0]
        own_data = self.data_by_device(op) if self.discipline != "host-order" else {}
        turn = self.bundle_turn(op)
        for hop in self.route(op):
            after = [i for k in hop.after for i in flows[k]]
            queued = [i for k in hop.queued_after for i in flows[k]]
            if turn and hop.dst == op.src != hop.src:  # a bundle's gather: behind its NIC turn (host order)
                after += turn[0]
                queued += turn[1]
            scatter = turn is not None and hop.src == op.dsts[0] != hop.dst and hop.after
            if scatter:  # a bundle's scatter: after the one before between the same two devices (host order)
                queued += self.scattered.get((hop.src, hop.dst), [])
            if hop.gated:
                after += waits
                if not hop.after:
                    after += own_data.get(hop.src, [])
            posting = (list(after), []) if barrier is not None else None  # device order: what the sender waits for to post
            # this message (its data and its own barrier)
            for d in (hop.src, hop.dst) if barrier and hop.src != hop.dst else ():  # a local copy waits for no barrier
                arrived, left = barrier.get(d, ((), ()))
                after += arrived
                queued += left
                if d == hop.src:
                    posting = (posting[0] + list(arrived), list(left))
            nbytes = hop.nbytes(itemsize)
            flows.append(self.hop(op, hop.src, hop.dst, nbytes, after, queued))
            if turn is not None and hop.dst == op.src != hop.src:
                self.gathers.update(flows[-1])
            if scatter:
                self.scattered[(hop.src, hop.dst)] = flows[-1]
                self.connections.setdefault(op.id, []).append((hop.src, hop.dst))
            if self.discipline == "device-order" and self.send_buffer is None and hop.src != hop.dst and nbytes < SYNC_SEND_BYTES:
                for i in flows[-1]:  # buffered: the send ends once posted, and its device goes on (executor.mpi_engine)
                    self.posted_when[i] = posting
            last[(hop.src, hop.dst)] = flows[-1]
        out = [i for ids in last.values() for i in ids]
        for d in op.dsts:
            self.delivered.setdefault((op.task, d), []).extend(out)
        return out, last


def _ids(flows: list[int] | tuple[int, ...]) -> tuple[int, ...]:
    """Flow ids as a flow's dependencies keep them: each once, ascending."""
    if not flows:
        return ()
    return (flows[0],) if len(flows) == 1 else tuple(sorted(set(flows)))


def simulate(operations: list[Operation] | tuple[Operation, ...], problem: ReshardingProblem | TransferProblem,
             discipline: str = "host-order", nic_of_task: dict[int, int] | None = None, max_work: int | None = None,
             run_numbers: dict[int, list[int]] | None = None, share: ShareRule | None = None,
             send_buffer_bytes: float | None = None, window_bytes: int | None = None) -> SimResult:
    """Time `operations` (taken in list order) on the problem's cluster under the queueing `discipline`;
    TooCostly past `max_work` (see `run_flows`). `run_numbers` (device order, a plan with a staging budget:
    `staging_runs`): each device's run of each of its operations, where the budget ends runs the peers alone would not.
    `share`: how links share bandwidth (`run_flows`; None: max-min fair); a rule that remembers flows must be fresh per call.
    `send_buffer_bytes` (device order): when a send ends for its device's next run. None: as the MPI engine (and the
    torch engine, with its receipts), a message under `SYNC_SEND_BYTES` once posted, a larger one once its last byte has
    left; a number: once it moves (gloo's send waits until the receiver has posted its receive) with at most that many
    of its bytes left to go, as bare gloo ends a send when the socket's buffer has taken the rest. One buffer per message: a send queued behind another
    on its connection starts to count down only when that one's last byte has left. `window_bytes`: the `window`
    discipline's staging window per device (`window_waits`), which it needs."""
    if send_buffer_bytes is not None and not 0 < send_buffer_bytes < float("inf"):
        raise ValueError(f"send_buffer_bytes={send_buffer_bytes!r}: give a positive number of bytes, or None for the MPI engine's sends")
    if (discipline == "window") != (window_bytes is not None):
        raise ValueError("window_bytes: give the staging window in bytes with discipline='window', and only with it")
    window = window_waits(operations, problem, window_bytes) if window_bytes is not None else None
    return simulated(operations, problem, discipline, nic_of_task, max_work, run_numbers, share, send_buffer_bytes, window)[0]


def simulated(operations: list[Operation] | tuple[Operation, ...], problem: ReshardingProblem | TransferProblem,
              discipline: str = "host-order", nic_of_task: dict[int, int] | None = None, max_work: int | None = None,
              run_numbers: dict[int, list[int]] | None = None, share: ShareRule | None = None,
              send_buffer_bytes: float | None = None, window: dict[int, dict[int, tuple[int, ...]]] | None = None
              ) -> tuple[SimResult, _Lowering]:
    """`simulate`, and the flows it timed (for `renumbered_only`); `window`: `window_waits`."""
    with _no_cycle_collection():
        lowering, riders = lower(operations, problem, discipline, nic_of_task, run_numbers, send_buffer_bytes, window)
        cost: list[int] = []
        started, arrived = _run(lowering.flows, lowering.capacity, max_work, cost, share)  # `lower` numbers flows in order
        return op_times(operations, lowering, riders, started, arrived, cost[0]), lowering


def renumbered_only(before: list[Operation] | tuple[Operation, ...], after: list[Operation] | tuple[Operation, ...],
                    lowering: _Lowering) -> bool:
    """Whether listing `after` (the same operations as `before`, whose host-order flows are `lowering`) lowers to the
    same flows, only numbered differently: the same shared messages, every NIC side taking its operations in the same
    order (each waits for the one before there; a bundle's gathers for its turn), every pair of devices bundles scatter
    between too, and every task (an operation waits for what its task's earlier ones delivered). Then host order times
    `after` exactly as `before`, bit for bit: a flow's number decides only in which order things that happen at one
    instant are taken, and progressive filling gives the same rates whatever order the
    flows come in (each round subtracts one share, the same, from every link it touches; links are taken by share and
    name). With the default sharing rule and no connection queues only, which host order is."""
    if lowering.discipline != "host-order":
        raise ValueError(f"renumbered_only compares host-order listings, not {lowering.discipline!r}")
    groups = [tuple(op.id for op in group) for group in message_groups(before)]
    if sorted(groups) != sorted(tuple(op.id for op in group) for group in message_groups(after)):
        return False
    task = {op.id: op.task for op in before}
    keys: dict[int, list] = {group[0]: [("task", task[group[0]])] for group in groups}  # a message's head (its flows'
    for f in lowering.flows:  # `op`) -> the task and NIC sides it queues on (an operation without flows waits on its task)
        keys[f.op].extend(link for link in f.links if link.startswith("h") and link not in keys[f.op])
    for head, pairs in lowering.connections.items():
        keys[head].extend(dict.fromkeys(pairs))

    def queues(listing) -> dict:
        out: dict = {}
        for op in listing:
            for key in keys.get(op.id, ()):
                out.setdefault(key, []).append(op.id)
        return out

    return queues(before) == queues(after)


@contextmanager
def _no_cycle_collection():
    """Python's cycle collector paused: a simulation makes millions of small objects, none in a cycle, and the
    collector would rescan them all every few thousand (a fifth of the time at 10^5 operations)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def lower(operations: list[Operation] | tuple[Operation, ...], problem: ReshardingProblem | TransferProblem,
          discipline: str = "host-order", nic_of_task: dict[int, int] | None = None,
          run_numbers: dict[int, list[int]] | None = None, send_buffer_bytes: float | None = None,
          window: dict[int, dict[int, tuple[int, ...]]] | None = None) -> tuple[_Lowering, dict[int, int]]:
    """`operations` as flows (`simulate`'s first half), and each bundle riding in another's message -> its carrier."""
    lowering = _Lowering(problem, discipline, nic_of_task, run_numbers, send_buffer_bytes, window)
    riders: dict[int, int] = {}  # a bundle riding in another's message -> its carrier (timed as the carrier)
    for group in message_groups(operations):
        if len(group) > 1:
            riders |= {op.id: group[0].id for op in group[1:]}
            lowering.add(shared_message(group, lowering.itemsizes, lowering.sums))
        else:
            lowering.add(group[0])
    lowering.finish()
    return lowering, riders


def op_times(operations: list[Operation] | tuple[Operation, ...], lowering: _Lowering, riders: dict[int, int],
             started: list[float], arrived: list[float], work: int) -> SimResult:
    """Each operation's start and end from its flows' (`simulate`'s second half; flows' start and arrival by id)."""
    start: dict[int, float] = {}
    end: dict[int, float] = {}
    gathers = lowering.gathers
    for f in lowering.flows:  # a bundle starts with its message across hosts: its gathers come before (host order)
        fid, op = f.id, f.op
        s, e = started[fid], arrived[fid]
        if fid not in gathers:
            start[op] = min(start.get(op, s), s)
        end[op] = max(end.get(op, e), e)
    for op_id, ready in lowering.ready.items():  # it starts once all its data is there (as the verifier checks),
        start[op_id] = max(start.get(op_id, 0.0), max(arrived[i] for i in ready))  # though a member may send earlier
    for rider, carrier in riders.items():
        start[rider], end[rider] = start[carrier], end[carrier]
    for op in operations:  # an operation without flows (an empty box) takes no time
        start.setdefault(op.id, 0.0)
        end.setdefault(op.id, start[op.id])
    return SimResult(max(end.values(), default=0.0), start, end, len(lowering.flows), work)


def nic_assignment(host_order) -> dict[int, int]:
    """Task -> NIC index, read from a plan's per-host order (`send:1` means NIC 1)."""
    return {task: int(o.side.split(":")[1]) for o in host_order if ":" in o.side for task in o.tasks}


def staging_runs(plan: Plan) -> dict[int, list[int]] | None:
    """Device -> the run of each operation it takes part in (a shared message's bundles once), in the executor's
    device order under the staging budget the plan states (`schemas.staging.device_runs`); None without one,
    where runs change only with the peers, which the simulator follows itself."""
    if plan.staging is None:
        return None
    budget, align = stage_budget(plan), staging_align(plan)
    return {device: device_runs(f, budget, align) for device, f in footprints(plan).items()}


def window_waits(operations: list[Operation] | tuple[Operation, ...], problem: ReshardingProblem | TransferProblem,
                 window_bytes: int) -> dict[int, dict[int, tuple[int, ...]]]:
    """Posted within a staging window of `window_bytes` per device: for each operation (a shared message's bundles as
    their first, `schemas.carriers`), device -> the earlier operations it waits for there (`schemas.staging.window_layout`
    of the device's staged bytes, `footprints`, in the executor's lowering, one area shared by every tensor); a device
    that stages something in it has an entry, with no operations where it waits for none."""
    from types import SimpleNamespace

    from xmesh_plan.schemas.op_kinds import members as members_of

    if window_bytes <= 0:
        raise ValueError(f"window_bytes={window_bytes!r}: give the staging window in bytes, above 0")
    view = SimpleNamespace(problem=problem, operations=tuple(operations))
    feet, align = footprints(view), staging_align(view)
    heads: dict[int, list[int]] = {}  # device -> the operations (group heads) of its footprints, in order
    for group in message_groups(view.operations):
        devices = dict.fromkeys(d for op in group for d in members_of(op)) if len(group) > 1 else members_of(group[0])
        for d in devices:
            heads.setdefault(d, []).append(group[0].id)
    out: dict[int, dict[int, tuple[int, ...]]] = {}
    for d, f in feet.items():
        mine = heads[d]
        if len(mine) != len(f):
            raise AssertionError(f"device {d}: {len(f)} footprints for {len(mine)} operations")
        sizes = [n for _, n in f]
        for head, n, (_, waits) in zip(mine, sizes, window_layout(sizes, window_bytes, align)):
            if n:
                out.setdefault(head, {})[d] = tuple(mine[j] for j in waits)
    return out


def simulate_plan(plan: Plan, discipline: str = "host-order") -> SimResult:
    """Time a compiled plan; plans from this planner run in host order (device order keeps its staging budget's runs;
    `window` is posted within the plan's stated staging limit, as the MPI engine runs it, and needs that limit)."""
    runs = staging_runs(plan) if discipline == "device-order" else None
    window_bytes = None
    if discipline == "window":
        window_bytes = stage_budget(plan)
        if window_bytes is None:
            raise ValueError("discipline='window' times a plan within its staging limit, and this plan states none "
                             "(compile it with --max-staging-mb, or time it 'posted')")
    return simulate(plan.operations, plan.problem, discipline, nic_assignment(plan.host_order), run_numbers=runs,
                    window_bytes=window_bytes)
