"""The fluid simulator's flow engine as it steps every moving flow at every event: an independent reference.

`planner.simulate.run_flows` keeps each moving flow's remaining work from the last time its rate changed and its
finish time in a heap; this one subtracts every moving flow's progress at every event. Both share out rates with
the same rule in the same order, so their times agree to rounding (tests/test_simulate_engine.py), and
bench/bench_simulate.py times one against the other.
"""

from __future__ import annotations

import heapq
from collections import deque

from xmesh_plan.planner.simulate import REL_EPS, Flow, ShareRule, TooCostly, lower, max_min_rates, op_times, window_waits


def run_flows(flows: list[Flow], capacity: dict[str, float], max_work: int | None = None,
              cost: list[int] | None = None, share: ShareRule | None = None) -> dict[int, tuple[float, float]]:
    """Event-driven fluid simulation; (start, arrival) per flow id. A flow with no bytes or links
    takes only its latency. Raises TooCostly once the run's work passes `max_work`: per event, the link sets of
    the moving flows linked to one that started or ended, and how many of them got a new rate, summed over the
    run; `cost`, when given, gets that sum appended. `share` gives
    the moving flows that share links with a flow that started or ended their rates (None: max-min fair)."""
    share = share or max_min_rates
    waiting = {f.id: len(f.after) + len(f.after_sent) for f in flows}
    on_arrival: dict[int, list[int]] = {}
    on_sent: dict[int, list[int]] = {}
    early: set[int] = set()  # flows that counted as left before their last byte did (`Flow.sent_below`)
    for f in flows:
        for parent in f.after:
            on_arrival.setdefault(parent, []).append(f.id)
        for parent in f.after_sent:
            on_sent.setdefault(parent, []).append(f.id)
    by_id = {f.id: f for f in flows}
    buffered = {f.id for f in flows if f.sent_below > 0 and f.id in on_sent}  # flows that may count as left early
    # events: (time, flow) of arrivals: a flow's last byte left `latency_s` earlier
    clock, events, moving, span = 0.0, [], {}, {}
    busy: dict[str, int] = {}  # queue -> the flow moving on it
    queued: dict[str, deque[int]] = {}  # queue -> ready flows behind it, first ready first
    on_link: dict[str, set[int]] = {}  # link -> the moving flows on it
    changed: set[int] = set()  # flows that started or finished moving since rates were last shared out

    def start_moving(fid: int) -> None:
        moving[fid] = by_id[fid].work
        changed.add(fid)
        for link in by_id[fid].links:
            on_link.setdefault(link, set()).add(fid)

    def stop_moving(fid: int) -> None:
        del moving[fid]
        changed.add(fid)
        for link in by_id[fid].links:
            on_link[link].discard(fid)

    def release(ready: list[int]) -> None:
        """Start every flow in `ready` whose last dependency just ended; a flow with nothing to move has
        left at once, which may start more (a work list, not recursion: such runs can be long)."""
        while ready:
            fid = ready.pop()
            waiting[fid] -= 1
            if waiting[fid]:
                continue
            queue = by_id[fid].queue
            if queue:
                if queue in busy:
                    queued.setdefault(queue, deque()).append(fid)
                    continue
                busy[queue] = fid
            span[fid] = (clock, None)
            if by_id[fid].work > 0 and by_id[fid].links:
                start_moving(fid)
                if fid in buffered and by_id[fid].sent_below >= by_id[fid].work:  # the buffer takes it all at once
                    ready.extend(left_early(fid))
            else:
                ready.extend(sent(fid))

    def left_early(fid: int) -> list[int]:
        """At most `sent_below` of it is left: what waits for it to have left may go (not what queues behind it)."""
        early.add(fid)
        return list(on_sent.get(fid, ()))

    def sent(fid: int) -> list[int]:
        """Its last byte left: it arrives a latency later; flows queued behind it may go."""
        heapq.heappush(events, (clock + by_id[fid].latency_s, fid))
        out = [] if fid in early else list(on_sent.get(fid, ()))
        queue = by_id[fid].queue
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
    done_below = {f.id: REL_EPS * max(1.0, f.work) for f in flows}  # what is left of a flow that has moved it all
    rates: dict[int, float] = {}
    work = 0
    while events or moving:
        if changed:  # an arrival that starts nothing leaves the moving flows, and so their rates, as they were
            affected = _sharing_links(changed, by_id, on_link)
            shared = share([by_id[i] for i in moving if i in affected], capacity)
            changed.clear()
            work += len({by_id[i].links for i in affected}) + sum(1 for i, r in shared.items() if rates.get(i) != r)
            rates.update(shared)
            if max_work is not None and work > max_work:
                raise TooCostly(f"the simulation took more than its budget of {max_work} units of work (groups shared out and flows re-rated)")
        next_move = min(((left / rates[i], i) for i, left in moving.items()), default=(float("inf"), -1))
        if buffered:
            next_move = min(next_move, min((((left - by_id[i].sent_below) / rates[i], i) for i, left in moving.items()
                                            if i in buffered and i not in early), default=next_move))
        next_event = events[0][0] if events else float("inf")
        step = min(next_move[0], next_event - clock)
        finished, emptied = [], []
        for i, left in moving.items():  # values change, keys do not: safe while iterating
            left -= rates[i] * step
            moving[i] = left
            if left <= done_below[i]:
                finished.append(i)
            elif i in buffered and i not in early and left - by_id[i].sent_below <= done_below[i]:
                emptied.append(i)
        clock += step
        for i in emptied:
            release(left_early(i))
        for i in finished:
            stop_moving(i)
            release(sent(i))
        while events and events[0][0] <= clock + REL_EPS * max(1.0, clock):
            _, i = heapq.heappop(events)
            span[i] = (span[i][0], clock)
            release(list(on_arrival.get(i, ())))
    if any(v for v in waiting.values()):
        raise ValueError("flow dependencies form a cycle; some flows never start")
    if cost is not None:
        cost.append(work)
    return {i: (s, e) for i, (s, e) in span.items()}


def _sharing_links(changed: set[int], by_id: dict[int, Flow], on_link: dict[str, set[int]]) -> set[int]:
    """The moving flows linked, through links they share, to a link of a flow in `changed`: the only ones
    whose max-min rates can differ from before. Flows of other groups keep theirs: progressive filling
    on a group that shares no link with the rest does the same arithmetic in the same order alone as
    with them, so reusing their rates changes no bit."""
    affected: set[int] = set()
    seen: set[str] = set()
    stack = [link for i in changed for link in by_id[i].links]
    while stack:
        link = stack.pop()
        if link in seen:
            continue
        seen.add(link)
        for fid in on_link.get(link, ()):
            if fid not in affected:
                affected.add(fid)
                stack.extend(by_id[fid].links)
    return affected


def reference_simulate(operations, problem, discipline: str = "host-order", nic_of_task=None, max_work=None,
                       run_numbers=None, share: ShareRule | None = None, send_buffer_bytes=None, window_bytes=None):
    """`planner.simulate.simulate` with this module's `run_flows`: the same lowering and times, the reference engine."""
    window = window_waits(operations, problem, window_bytes) if window_bytes is not None else None
    lowering, riders = lower(operations, problem, discipline, nic_of_task, run_numbers, send_buffer_bytes, window)
    cost: list[int] = []
    spans = run_flows(lowering.flows, lowering.capacity, max_work, cost, share)
    started, arrived = ([spans[i][k] for i in range(len(lowering.flows))] for k in (0, 1))  # by flow id, as `lower` numbers them
    return op_times(operations, lowering, riders, started, arrived, cost[0])


def water_filling(active: list[Flow], capacity: dict[str, float]) -> dict[int, float]:
    """Max-min fair rates the plain way, flow by flow, without heaps or groups: while flows are left, the link whose
    capacity left over its unfixed flows is least fixes them all at that share (`simulate.max_min_rates`' rule)."""
    left = {link: capacity[link] for f in active for link in f.links}
    unfixed = {f.id: f.links for f in active if f.links}
    rates: dict[int, float] = {}
    while unfixed:
        def share(link: str) -> float:
            return left[link] / sum(1 for links in unfixed.values() if link in links)
        tightest = min((link for links in unfixed.values() for link in links), key=lambda link: (share(link), link))
        rate = share(tightest)
        for fid in [i for i, links in unfixed.items() if tightest in links]:
            rates[fid] = rate
            for link in unfixed.pop(fid):
                left[link] -= rate
    return rates
