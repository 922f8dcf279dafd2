"""What every engine's replay of a lowered program shares; the engines add only their transport.

An engine replays a `RankProgram` every iteration: a step starts once every step it waits for has
finished (`Dependencies`), a message is posted and tested by the transport (MPI requests, torch
works, NCCL calls), a local step (copy, pack, unpack) runs at once. What is the same for every
engine lives here, once:

- the dependency counts of the steps, restored as each step launches (`Dependencies`);
- the refusal of an engine that stopped after an error (`refuse_broken`, `abandoned`);
- the back-off wait: test, and sleep a little longer each time nothing moved, until a deadline
  passes without progress (`backoff_wait`);
- the failure message naming what the rank waited on and what to do (`failure`);
- this process's engines and what abandoned reshards still use (`PROCESS`).
"""

from __future__ import annotations

import time
import weakref
from typing import Sequence

from .errors import ExecutorError, PeerTimeoutError
from .lower import Step

SHOWN_PENDING = 3  # pending transfers a failure message names


def stopped(why: str) -> ExecutorError:
    """The error for a call on an engine that stopped after an error (or was closed)."""
    return ExecutorError(f"this executor stopped after an error ({why}); close() it, then create and prepare a new one")


def refuse_broken(broken: str | None) -> None:
    """Raise `stopped` when the engine is broken (`broken`: why, None while usable)."""
    if broken:
        raise stopped(broken)


def abandoned(why: str) -> ExecutorError:
    """The error test() or wait() raises once a reshard in flight was given up without an error of its own."""
    return ExecutorError(f"this reshard was abandoned ({why}); close() the executor and make a new one")


def failure(device: int, rank: int, why: str, waiting: Sequence[str], more: int = 0, blocked: int = 0,
            error: type = PeerTimeoutError) -> ExecutorError:
    """The one-line error of a reshard that failed on this rank: why, the transfers it waited on (`waiting`, the first
    few described; `more` beyond those), the steps never started (`blocked`), and what to check."""
    shown = "; ".join(waiting[:SHOWN_PENDING])
    more += max(len(waiting) - SHOWN_PENDING, 0)
    return error(f"device {device} (rank {rank}): {why}; waiting on {shown or 'nothing posted'}"
                 f"{f' and {more} more transfers' if more > 0 else ''}{f', {blocked} steps not started' if blocked else ''}; "
                 "check that every rank is alive and runs the same plan, or raise timeout_s if transfers are just slow")


class Dependencies:
    """The steps' dependency counts for one iteration after another: `dependents[i]` lists the steps that wait for
    step i, `remaining[i]` how many of its waits are still open (restored to `initial[i]` when it launches, so an
    iteration allocates nothing), `local[i]` whether it runs at once when launched (no message)."""

    __slots__ = ("dependents", "initial", "remaining", "local")

    def __init__(self, steps: Sequence[Step]):
        self.dependents: list[list[int]] = [[] for _ in steps]
        for s in steps:
            for d in s.deps:
                self.dependents[d].append(s.index)
        self.initial = [len(s.deps) for s in steps]
        self.remaining = self.initial.copy()
        self.local = [not s.action.is_message for s in steps]


def backoff_wait(engine) -> None:
    """Call `engine.test()` until it returns True, sleeping `engine.idle(nap)` between calls, the nap doubling from
    `engine.poll_s[0]` up to `poll_s[1]` while nothing moves and starting over when `engine.last_progress` moves; past
    `engine.timeout_s` without progress, `engine.timed_out()` (which raises). An engine whose `test()` itself makes
    progress (`engine.test_progresses`: MPI) is tested again at once after progress; one progressed by another
    thread or a GPU stream idles between tests, so the waiting thread does not take the interpreter from it. Methods
    are called straight on the engine, so a wait allocates no bound method."""
    low, high = engine.poll_s
    nap = low
    progresses = engine.test_progresses
    while True:
        before = engine.last_progress
        if engine.test():
            return
        if engine.last_progress != before:
            nap = low
            if progresses:
                continue
        if time.monotonic() - engine.last_progress > engine.timeout_s:
            engine.timed_out()
        engine.idle(nap)
        nap = min(nap * 2, high)


class ProcessEngines:
    """This process's set-up engines that a waiting engine may drive, and what abandoned reshards still use.

    Invariants: `live` holds weak references only, and a reference leaves it when its engine is collected;
    `kept` only grows until exit: requests, works and the buffers and shards they point at, which a transport
    may still read or write after a failure (freeing a persistent MPI request still active crashes MPICH at
    exit; gloo cannot cancel a posted receive), so they are never deallocated while it may use them."""

    def __init__(self) -> None:
        self.live: list[weakref.ref] = []
        self.kept: list = []

    def register(self, engine) -> None:
        """Track `engine` (until it is collected) so that others' waits can drive it."""
        self.live.append(weakref.ref(engine, self.live.remove))

    def keep(self, thing) -> None:
        """Keep `thing` referenced until exit (see the class docstring)."""
        self.kept.append(thing)

    def drive_others(self, engine, owner: object) -> None:
        """Let every other engine started by the thread `owner` make progress (a relay this rank owes in another
        reshard may be what a peer of `engine` waits for)."""
        for ref in self.live:
            other = ref()
            if other is not None and other is not engine and other.owner is owner and other.pending and not other.broken:
                other.drive()


PROCESS = ProcessEngines()
