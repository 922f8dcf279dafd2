"""How the testbed's TCP shares a host's link among short messages: first come, first served.

A step trace (`bench.netlab.steptrace`, case 4; docs/netlab.md) shows three 0.5 MiB messages that one host's ranks started
within a few ms finish one after another (13.4, 18.3, 23.5 ms), not together at 26 ms as max-min fair
sharing has it. A message that starts while another from the same host is moving joins the back of
that one's queue in the shaped link and grows its window over round trips the queue lengthens, so a
message of a few window-doublings' worth is served after the one already moving; a long one catches up
and shares. `FirstCome` is that rule as a `planner.simulate.ShareRule`; the testbed's device-order
model uses it for messages of at most `predict.TESTBED_SHORT_MS` at their send side's rate.
"""

from __future__ import annotations

import itertools

from xmesh_plan.planner.simulate import Flow


class FirstCome:
    """Rates where the NIC sides in `sides` ("send", or "send" and "recv") serve their messages oldest first, the
    messages of at most `small` bytes only, or of at most `short_s` seconds at their send side's rate (None: all);
    the others, and CPU links, share what is left max-min fairly. An instance lives for one simulation: it
    remembers when each flow first asked for a rate, which is when it started."""

    def __init__(self, sides: tuple[str, ...], small: float | None = None, short_s: float | None = None):
        self.sides, self.small, self.short_s = sides, small, short_s
        self.first_seen: dict[int, tuple[int, int]] = {}
        self.calls = itertools.count()

    def queued_on(self, f: Flow, capacity: dict[str, float]) -> list[str]:
        """The NIC sides on which `f` waits its turn."""
        if self.small is not None and f.nbytes > self.small:
            return []
        sides = [link for link in f.links if link.startswith("h") and link.split(".")[1].split(":")[0] in self.sides]
        if self.short_s is not None and any(f.nbytes > self.short_s * capacity[link] for link in sides):
            return []
        return sides

    def __call__(self, active: list[Flow], capacity: dict[str, float]) -> dict[int, float]:
        call = next(self.calls)
        for f in active:
            self.first_seen.setdefault(f.id, (call, f.id))
        order = sorted(active, key=lambda f: self.first_seen[f.id])
        left = {link: capacity[link] for f in active for link in f.links}
        waits = {f.id: self.queued_on(f, capacity) for f in active}
        line: dict[str, list[int]] = {}
        for f in order:
            for link in waits[f.id]:
                line.setdefault(link, []).append(f.id)
        rate = {f.id: 0.0 for f in active}
        frozen: set[int] = set()
        while True:  # raise every flow at the head of all its lines together until a link fills; freeze that link's flows
            heads = [f for f in order if f.id not in frozen
                     and all(next(i for i in line[link] if i not in frozen) == f.id for link in waits[f.id])]
            if not heads:
                break
            users: dict[str, int] = {}
            for f in heads:
                for link in f.links:
                    users[link] = users.get(link, 0) + 1
            step = min(left[link] / n for link, n in users.items())
            full = set()
            for link, n in users.items():
                left[link] -= step * n
                if left[link] <= 1e-9 * capacity[link]:
                    full.add(link)
            for f in heads:
                rate[f.id] += step
            frozen |= {f.id for f in active if any(link in full for link in f.links)}
        return {i: max(r, 1e-9) for i, r in rate.items()}  # a flow the water-filling left at 0 still ends, if late
