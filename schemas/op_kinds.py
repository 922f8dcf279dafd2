"""One table of facts per operation kind, read by every consumer of plans instead of a switch of its own.

`OP_KINDS[kind]` says which devices take part, which shard each one reads and what it writes, the
messages on the wire (`route`: a local copy, a chain or a ring), the message tags an operation owns,
its NCCL group and how it prints. The plan checker, the verifier, the simulator, `inspect`, the
executor's lowering and NCCL calls and the demo's byte count all read it, so a new kind is one row
here; a new wire pattern also needs a handler in each consumer that registers through `supported`,
which fails at import, naming the consumer, when one is missing.

>>> from xmesh_plan.schemas.plan import Operation
>>> op = Operation(id=0, task=0, kind="broadcast", src=0, dsts=(1, 2), region=((0, 8),), chunks=2)
>>> [(h.src, h.dst, h.tag, h.after, h.queued_after) for h in route(op)]
[(0, 1, 0, (), ()), (1, 2, 0, (0,), ()), (0, 1, 1, (), (0,)), (1, 2, 1, (2,), (1,))]
>>> pair_bytes(op, itemsize=4)
{(0, 1): 32, (1, 2): 32}
>>> gather = Operation(id=1, task=0, kind="allgather", dsts=(3, 4, 5), region=((0, 6),), parts=(((0, 2),), ((2, 4),), ((4, 6),)))
>>> [(h.src, h.dst, h.piece) for h in route(gather)][:3], tags_used(gather), parties(gather)
([(3, 4, 0), (4, 5, 1), (5, 3, 2)], 2, 'among d3,d4,d5')
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from fractions import Fraction
from typing import Callable, Literal, Mapping, Protocol, TypeVar

from .geometry import Region, region_size

Shard = Literal["src", "dst"]
Pattern = Literal["local", "chain", "ring", "bundle"]


class OpLike(Protocol):
    """What the table reads of an operation: a plan's `Operation` or the planner's `PlannedOp`."""

    kind: str
    src: int | None
    dsts: tuple[int, ...]
    region: Region
    parts: tuple[Region, ...]
    chunks: int
    holders: tuple[int, ...]
    needers: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True)
class OpKindRule:
    """The facts of one operation kind that are not read off the operation itself."""

    pattern: Pattern  # local: src copies into its own destination shard; chain: src -> dsts[0] -> dsts[1] -> ...; ring: dsts[i] -> dsts[i+1];
    # bundle: holders -> src (gather inside the sending host), src -> dsts[0] (one cross-host message), dsts[0] -> needers (scatter)
    has_src: bool  # `src` is a device (else null)
    min_dsts: int
    max_dsts: int | None  # None: no limit
    chunked: bool  # `chunks` may exceed 1 (each chunk is one message per hop, pipelined)
    has_parts: bool  # one part per member, read from its destination shard
    taskless: bool = False  # may belong to no unit task (task -1): a device copying between its own shards
    meaning: str = ""  # what the kind does, in one line (docs/format.md has the same table)


OP_KINDS: dict[str, OpKindRule] = {
    "copy": OpKindRule("local", has_src=True, min_dsts=1, max_dsts=1, chunked=False, has_parts=False, taskless=True,
                       meaning="a device that holds the box in its source shard copies it into its destination shard"),
    "send": OpKindRule("chain", has_src=True, min_dsts=1, max_dsts=1, chunked=False, has_parts=False,
                       meaning="src sends the box to the single device in dsts"),
    "broadcast": OpKindRule("chain", has_src=True, min_dsts=1, max_dsts=None, chunked=True, has_parts=False,
                            meaning="src sends the box down the chain dsts in `chunks` pipelined pieces"),
    "allgather": OpKindRule("ring", has_src=False, min_dsts=2, max_dsts=None, chunked=False, has_parts=True,
                            meaning="member dsts[i] holds parts[i]; in n-1 ring steps each member passes the part it got last to the next"),
    "bundle": OpKindRule("bundle", has_src=True, min_dsts=1, max_dsts=1, chunked=False, has_parts=False,
                         meaning="holders[i] (on src's host) hold parts[i] in their source shards; src gathers them, sends them "
                                 "to dsts[0] in one message, which scatters part i to every device in needers[i] (on its host)"),
}


@dataclass(frozen=True, slots=True)
class Hop:
    """One message of an operation (a local copy when src == dst): piece `piece` (a broadcast chunk, an
    all-gather part) with tag `tag` of the operation's block. It moves `elements / divisor` elements:
    the model spreads a broadcast's box evenly over its chunks (on the wire `chunk_bounds` cuts on
    element boundaries; every pair carries the whole box either way). It may start once the hops at
    positions `after` of the same route have arrived (its data), and the hops at `queued_after` have
    left (messages on one pair go in order); a `gated` hop also waits for what the operation waits for."""

    src: int
    dst: int
    piece: int
    tag: int
    elements: int
    divisor: int
    after: tuple[int, ...]
    gated: bool
    queued_after: tuple[int, ...] = ()

    def nbytes(self, itemsize: int) -> float:
        return self.elements * itemsize / self.divisor


def rule_of(op: OpLike) -> OpKindRule:
    try:
        return OP_KINDS[op.kind]
    except KeyError:
        raise ValueError(f"operation kind {op.kind!r} is unknown; use one of {', '.join(OP_KINDS)}") from None


def members(op: OpLike) -> tuple[int, ...]:
    """Every device an operation involves, once each: the sender, then `dsts` in order (a bundle's
    holders after its sender, its needers after its receiving relay)."""
    if rule_of(op).pattern == "bundle":
        return tuple(dict.fromkeys((op.src, *op.holders, op.dsts[0], *(d for n in op.needers for d in n))))
    head = (op.src,) if op.src is not None and op.src not in op.dsts else ()
    return head + tuple(op.dsts)


def nccl_group(op: OpLike) -> tuple[int, ...]:
    """The communicator an operation runs on: its members, sorted (a device's NCCL rank is its index)."""
    return tuple(sorted(members(op)))


def reads(op: OpLike) -> tuple[tuple[int, Shard, Region], ...]:
    """(device, shard, box) of everything an operation sends out of a shard: the sender's source
    shard, or each member's own part of its destination shard (which it must hold when the operation starts)."""
    if rule_of(op).has_parts:
        return tuple((d, "dst", part) for d, part in zip(op.dsts, op.parts))
    if rule_of(op).pattern == "bundle":
        return tuple((h, "src", part) for h, part in zip(op.holders, op.parts))
    return ((op.src, "src", op.region),)


def writes(op: OpLike) -> tuple[tuple[int, Region, Region | None], ...]:
    """(device, box, own) of what lands in destination shards: every receiver gets the box, less `own`
    (the part an all-gather member already holds)."""
    if rule_of(op).has_parts:
        return tuple((d, op.region, part) for d, part in zip(op.dsts, op.parts))
    if rule_of(op).pattern == "bundle":
        return tuple((d, part, None) for part, needers in zip(op.parts, op.needers) for d in needers)
    return tuple((d, op.region, None) for d in op.dsts)


def _local_route(op: OpLike) -> tuple[Hop, ...]:
    return (Hop(op.src, op.src, 0, 0, region_size(op.region), 1, (), True),)


def _chain_route(op: OpLike) -> tuple[Hop, ...]:
    """Chunk k crosses hop h after chunk k arrived over hop h-1 and chunk k-1 left on hop h; only the first waits for the operation."""
    chain, elements, k_total = (op.src, *op.dsts), region_size(op.region), op.chunks
    hops_per_chunk = len(op.dsts)
    out = []
    for k in range(k_total):
        for h in range(hops_per_chunk):
            at = len(out)
            out.append(Hop(chain[h], chain[h + 1], k, k, elements, k_total, (at - 1,) if h else (), k == 0 and h == 0,
                           (at - hops_per_chunk,) if k else ()))
    return tuple(out)


def _ring_route(op: OpLike) -> tuple[Hop, ...]:
    """Step s: member i sends part (i - s) mod n, which it got at step s-1 (its own at step 0), to member i+1."""
    ring, n = op.dsts, len(op.dsts)
    sizes = [region_size(p) for p in op.parts]
    return tuple(Hop(ring[i], ring[(i + 1) % n], (i - s) % n, s, sizes[(i - s) % n], 1,
                     ((s - 1) * n + (i - 1) % n,) if s else (), True)
                 for s in range(n - 1) for i in range(n))


Run = tuple[int, tuple[int, ...]]
"""(device, consecutive part indices): one intra-host message of a bundle."""


def bundle_runs(op: OpLike) -> tuple[tuple[Run, ...], tuple[Run, ...]]:
    """(gathers, scatters) of a bundle: each holder other than src sends every maximal run of consecutive
    parts it holds to src in one message; dsts[0] sends each needer other than itself every maximal run
    of consecutive parts it needs in one message (needers in order of first need). The cross-host
    message carries the parts in index order, so each run is one contiguous piece of it.

    >>> from xmesh_plan.schemas.plan import Operation
    >>> op = Operation(id=0, task=0, kind="bundle", src=0, dsts=(4,), region=((0, 4),), parts=(((0, 1),), ((1, 2),), ((2, 3),), ((3, 4),)),
    ...                holders=(0, 1, 1, 0), needers=((5,), (5,), (4, 6), (5,)))
    >>> bundle_runs(op)
    (((1, (1, 2)),), ((5, (0, 1)), (5, (3,)), (6, (2,))))
    """
    return _bundle_runs(op.src, op.dsts[0], tuple(op.holders), tuple(map(tuple, op.needers)))


@lru_cache(maxsize=1 << 12)
def _bundle_runs(src: int, relay: int, holders: tuple[int, ...], needs: tuple[tuple[int, ...], ...]) -> tuple[tuple[Run, ...], tuple[Run, ...]]:
    """`bundle_runs` of a bundle's relays, holders and needers: once per distinct bundle (a model's layers repeat them,
    and the lowering, the staging model and the simulator each ask)."""
    gathers: list[Run] = []
    for i, h in enumerate(holders):
        if h == src:
            continue
        if gathers and gathers[-1][0] == h and gathers[-1][1][-1] == i - 1:
            gathers[-1] = (h, gathers[-1][1] + (i,))
        else:
            gathers.append((h, (i,)))
    order = list(dict.fromkeys(d for needers in needs for d in needers if d != relay))
    scatters: list[Run] = []
    for d in order:
        for i, needers in enumerate(needs):
            if d not in needers:
                continue
            if scatters and scatters[-1][0] == d and scatters[-1][1][-1] == i - 1:
                scatters[-1] = (d, scatters[-1][1] + (i,))
            else:
                scatters.append((d, (i,)))
    return tuple(gathers), tuple(scatters)


def merged_runs(op: OpLike) -> tuple[tuple[Run, ...], tuple[Run, ...]]:
    """(gathers, scatters) of a bundle whose intra-host messages go one per pair of devices: each holder other than
    src sends every part it holds in one message (holders in order of first part); dsts[0] sends each needer other
    than itself every part it needs in one message (needers in order of first need). What a shared message of several
    bundles sends (`schemas.carriers.group_runs`), read off the one bundle it is on the wire (`carriers.fused`).

    >>> from xmesh_plan.schemas.plan import Operation
    >>> op = Operation(id=0, task=0, kind="bundle", src=0, dsts=(4,), region=((0, 4),), parts=(((0, 1),), ((1, 2),), ((2, 3),), ((3, 4),)),
    ...                holders=(0, 1, 2, 1), needers=((5,), (6,), (4, 6), (5,)))
    >>> merged_runs(op)
    (((1, (1, 3)), (2, (2,))), ((5, (0, 3)), (6, (1, 2))))
    """
    return runs_by_device(op.src, op.dsts[0], tuple(op.holders), tuple(map(tuple, op.needers)))


@lru_cache(maxsize=1 << 12)
def runs_by_device(src: int, relay: int, holders: tuple[int, ...], needs: tuple[tuple[int, ...], ...]) -> tuple[tuple[Run, ...], tuple[Run, ...]]:
    """`merged_runs` from the parts' holders and needers: every part of one device in one run, devices in order of
    first part (first need); also what `schemas.carriers.group_runs` reads a shared message's pieces off."""
    gathers: dict[int, list[int]] = {}
    scatters: dict[int, list[int]] = {}
    for i, (h, needers) in enumerate(zip(holders, needs)):
        if h != src:
            gathers.setdefault(h, []).append(i)
        for d in needers:
            if d != relay:
                scatters.setdefault(d, []).append(i)
    return tuple((h, tuple(run)) for h, run in gathers.items()), tuple((d, tuple(run)) for d, run in scatters.items())


def merged_route(op: OpLike) -> tuple[Hop, ...]:
    """`route` of a bundle whose intra-host messages go one per pair of devices (`merged_runs`): a shared message."""
    return _runs_route(op, *merged_runs(op))


def _bundle_route(op: OpLike) -> tuple[Hop, ...]:
    """Gathers (no waiting inside the operation), the cross-host message after all of them, then the
    scatters after it; every message has its own tag (a needer may get several runs from one relay)."""
    return _runs_route(op, *bundle_runs(op))


def _runs_route(op: OpLike, gathers: tuple[Run, ...], scatters: tuple[Run, ...]) -> tuple[Hop, ...]:
    """A bundle's route with the given gather and scatter runs (`bundle_runs` or `merged_runs`)."""
    sizes = [region_size(p) for p in op.parts]
    out = [Hop(h, op.src, k, k, sum(sizes[i] for i in run), 1, (), True) for k, (h, run) in enumerate(gathers)]
    cross = len(out)
    out.append(Hop(op.src, op.dsts[0], 0, cross, sum(sizes), 1, tuple(range(cross)), True))
    out += [Hop(op.dsts[0], d, j, cross + 1 + j, sum(sizes[i] for i in run), 1, (cross,), False)
            for j, (d, run) in enumerate(scatters)]
    return tuple(out)


def _bundle_pairs(op: OpLike) -> tuple[tuple[int, int], ...]:
    return tuple(dict.fromkeys((h.src, h.dst) for h in _bundle_route(op)))


def _chain_pairs(op: OpLike) -> tuple[tuple[int, int], ...]:
    chain = (op.src, *op.dsts)
    return tuple(zip(chain, chain[1:]))


def _ring_pairs(op: OpLike) -> tuple[tuple[int, int], ...]:
    ring = op.dsts
    return tuple((a, ring[(i + 1) % len(ring)]) for i, a in enumerate(ring))


@dataclass(frozen=True, slots=True)
class _PatternFacts:
    route: Callable[[OpLike], tuple[Hop, ...]]
    pairs: Callable[[OpLike], tuple[tuple[int, int], ...]]  # distinct (from, to) on the wire, in route order
    tags: Callable[[OpLike], int]


_PATTERNS: dict[str, _PatternFacts] = {
    "local": _PatternFacts(_local_route, lambda op: (), lambda op: 0),
    "chain": _PatternFacts(_chain_route, _chain_pairs, lambda op: op.chunks),
    "ring": _PatternFacts(_ring_route, _ring_pairs, lambda op: len(op.dsts) - 1),
    "bundle": _PatternFacts(_bundle_route, _bundle_pairs, lambda op: 1 + sum(map(len, bundle_runs(op)))),  # its route's messages, counted
}


def chunk_bounds(elements: int, chunks: int) -> list[tuple[int, int]]:
    """Element ranges (of the box in C order) of a chunked operation's chunks on the wire: even cuts,
    every one non-empty when chunks <= elements (as `check_plan` requires).

    >>> chunk_bounds(4, 3)
    [(0, 1), (1, 2), (2, 4)]
    """
    return [(k * elements // chunks, (k + 1) * elements // chunks) for k in range(chunks)]


def _facts(op: OpLike) -> _PatternFacts:
    """The pattern facts of an operation's kind (two dict lookups: the planner and the lowering call this per operation)."""
    return _PATTERNS[rule_of(op).pattern]


def route(op: OpLike) -> tuple[Hop, ...]:
    """Every message of an operation in the order the model emits them (see `Hop`)."""
    return _facts(op).route(op)


def wire_pairs(op: OpLike) -> tuple[tuple[int, int], ...]:
    """The distinct (from device, to device) pairs an operation's messages cross, without building its route."""
    return _facts(op).pairs(op)


def tags_used(op: OpLike) -> int:
    """How many message tags an operation owns: one per broadcast chunk (a send is one chunk), one per
    all-gather ring step, one per message of a bundle, none for a copy. Tags count up through the plan, so no two messages between
    one pair share a tag."""
    return _facts(op).tags(op)


def first_tags(operations) -> tuple[list[int], int]:
    """(each operation's first message tag, the plan's number of tags). Tags are numbered tensor by tensor: tensor
    k's operations own the tags after those of tensors 0..k-1, each operation a block of `tags_used` in plan order,
    so a tensor's messages, taken alone, come in tag order. The executor's lowering and the compact plan's index
    both number by this one function, so a rank reading only its part numbers its messages as its peers do."""
    return number_tags([tags_used(op) for op in operations], [op.tensor or 0 for op in operations])


def number_tags(counts: list[int], tensors: list[int]) -> tuple[list[int], int]:
    """`first_tags` of operations that own `counts` tags each, of tensors `tensors` (0 for none, each 0 or more), in
    plan order. Counted per tensor named, so a huge tensor index costs nothing."""
    used: dict[int, int] = {}
    for t, n in zip(tensors, counts):
        used[t] = used.get(t, 0) + n
    start, total = {}, 0
    for t in sorted(used):
        start[t], total = total, total + used[t]
    first = []
    for t, n in zip(tensors, counts):
        first.append(start[t])
        start[t] += n
    return first, total


def pair_bytes(op: OpLike, itemsize: int) -> dict[tuple[int, int], int]:
    """Bytes an operation moves between each pair of distinct devices (exact; local copies left out)."""
    return hops_pair_bytes(route(op), itemsize)


def hops_pair_bytes(hops: tuple[Hop, ...], itemsize: int) -> dict[tuple[int, int], int]:
    """`pair_bytes` of a route already built (a caller that also walks the hops builds it once)."""
    elements: dict[tuple[int, int, int], int] = {}  # (from, to, divisor) -> elements
    for hop in hops:
        if hop.src != hop.dst and hop.elements:
            key = (hop.src, hop.dst, hop.divisor)
            elements[key] = elements.get(key, 0) + hop.elements
    total: dict[tuple[int, int], Fraction] = {}
    for (a, b, divisor), count in elements.items():
        total[(a, b)] = total.get((a, b), Fraction(0)) + Fraction(count * itemsize, divisor)
    return {key: int(value) for key, value in total.items()}


def messages(op: OpLike) -> int:
    """Messages an operation puts on the wire: its hops between distinct devices that carry bytes."""
    return sum(h.src != h.dst and h.elements > 0 for h in route(op))


def parties(op: OpLike) -> str:
    """`d0 -> d1,d2` or `among d3,d4`: who talks to whom, as an operation's text form prints it."""
    who = f"d{op.src} -> " if rule_of(op).has_src else "among "
    return who + ",".join(f"d{d}" for d in op.dsts)


def chunk_label(op: OpLike) -> str:
    """` K=4` for a kind cut into chunks, ` 64 parts` for a bundle, else empty: the end of an operation's text form."""
    if rule_of(op).pattern == "bundle":
        return f" {len(op.parts)} parts"
    return f" K={op.chunks}" if rule_of(op).chunked else ""


Handler = TypeVar("Handler")
_CONSUMERS: list[tuple[str, Mapping, str]] = []  # every registered (consumer, handlers, by), appended at its import


def supported(consumer: str, handlers: Mapping[str, Handler], by: Literal["pattern", "kind"] = "pattern") -> Mapping[str, Handler]:
    """`handlers` after checking it covers every pattern (or kind) in the table; a consumer calls this at
    import so an operation kind it cannot handle fails there, naming the consumer and the fix."""
    _require(consumer, handlers, by)
    _CONSUMERS.append((consumer, handlers, by))
    return handlers


def check_support() -> None:
    """Every consumer registered so far (and this module's own routes) handles every row of the table."""
    _require("schemas.op_kinds routes", _PATTERNS, "pattern")
    for consumer, handlers, by in _CONSUMERS:
        _require(consumer, handlers, by)


def _require(consumer: str, handlers: Mapping, by: str) -> None:
    needed = {rule.pattern for rule in OP_KINDS.values()} if by == "pattern" else set(OP_KINDS)
    missing = sorted(needed - set(handlers))
    if missing:
        raise NotImplementedError(f"{consumer} has no handler for operation {by} {missing[0]!r} of schemas/op_kinds.py; "
                                  f"add one to its table (it handles {', '.join(sorted(handlers))})")


check_support()
