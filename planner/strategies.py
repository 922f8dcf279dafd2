"""Strategies for one unit task: the concrete operations each emits and its predicted duration.

Times follow the paper's model made concrete with the cluster (and match planner/simulate.py in host
order, a task alone, without `Cluster.cpu`; with it they price each hop inside a host at the copy rate,
and a broadcast's chunks also wait for a relay's two copies on its one core and for the cores its chain
shares, but not for other tasks' copies, which the simulator, and so the plan's predicted time, counts): a
message of b bytes over a link keeps it busy `overhead + b / bandwidth` and arrives one `latency`
later; cross-host links use the NIC bandwidth, links inside a host the intra-host bandwidth. A
task's resources are busy until its last message has left; that message's latency (`StrategyResult.tail_s`)
delays the task's end but keeps no link busy, so the schedule books the links as the simulator uses them. A
pipelined broadcast of K chunks down a chain of A hops with per-chunk times c_h (overhead plus the
chunk's bytes) takes `A * latency + sum(c_h) + (K - 1) * max(c_h)`: the paper's `t + A*t/K` shape
with a per-message overhead that every chunk pays, so K has an optimum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

import numpy as np

from xmesh_plan.schemas import Cluster
from xmesh_plan.schemas.geometry import Region, split_region
from xmesh_plan.schemas.plan_check import MAX_CHUNKS  # the plan format's limit, which readers enforce

from .scheduling import Resource

MIN_CHUNK_BYTES = 4096
CHAIN_CHUNK_BYTES = 16 * 2**20  # a chain forwarded between destination hosts goes in chunks of about this (`chain_chunks`)


@dataclass(frozen=True, slots=True)
class PlannedOp:
    """An operation before numbering: kind, devices, box, and its time offsets inside the task."""

    kind: str
    src: int | None
    dsts: tuple[int, ...]
    region: Region
    parts: tuple[Region, ...] = ()
    chunks: int = 1
    offset_s: float = 0.0
    holders: tuple[int, ...] = ()  # a bundle's (planner/coalesce.py)
    needers: tuple[tuple[int, ...], ...] = ()
    duration_s: float = 0.0
    tail_s: float = 0.0  # a bundle's: how much of its duration comes after its NIC sides are free (`coalesce.bundle_result`)

    def sent(self, src: int | None, dsts: tuple[int, ...], duration_s: float, tail_s: float) -> "PlannedOp":
        """This operation from `src` to `dsts`, lasting `duration_s` of which `tail_s` past its NIC sides: what
        `dataclasses.replace` gives, at half its cost (a compile remakes hundreds of thousands of bundles, `coalesce`)."""
        return PlannedOp(self.kind, src, dsts, self.region, self.parts, self.chunks, self.offset_s, self.holders, self.needers,
                         duration_s, tail_s)


@dataclass(frozen=True, slots=True)
class StrategyResult:
    """What a strategy does for one task from one sender: its operations, duration, resources held, and how much
    of the duration is its last message's latency (`tail_s`: the resources are free by then)."""

    ops: tuple[PlannedOp, ...]
    duration_s: float
    resources: frozenset[Resource]
    chunks: int = 1
    tail_s: float = 0.0


@dataclass(frozen=True, slots=True)
class TaskContext:
    """Inputs a strategy needs: the box, its bytes, the chosen sender, the receivers, the cluster."""

    region: Region
    nbytes: int
    sender: int
    receivers: tuple[int, ...]
    cluster: Cluster
    itemsize: int = field(default=1)
    sharing: int = 1  # unit tasks queued on this task's busiest receiving NIC side (`chunks_for` weighs its tail by it)
    rotation: int | None = None  # a chain forwarded between destination hosts (`host_split`): where its host order starts

    def host(self, device: int) -> int:
        return self.cluster.host_of(device)

    def receivers_by_host(self) -> dict[int, tuple[int, ...]]:
        """Receiver devices grouped by host; the sender's own host first, then the others by host id, or with a
        `rotation` r in cyclic order from the r-th of them (mod their number): chains of one set of hosts rotated
        alike take turns at receiving first-hand and forwarding (`host_split.rotations`).

        >>> from dataclasses import replace
        >>> ctx = TaskContext(((0, 4),), 8, 0, (9, 16, 17, 25), Cluster(devices_per_host=8), 2)
        >>> list(ctx.receivers_by_host()), list(replace(ctx, rotation=1).receivers_by_host())
        ([1, 2, 3], [2, 3, 1])
        """
        groups: dict[int, list[int]] = {}
        for d in sorted(self.receivers):
            groups.setdefault(self.host(d), []).append(d)
        own = self.host(self.sender)
        others = sorted(h for h in groups if h != own)
        if self.rotation is not None and others:
            r = self.rotation % len(others)
            others = others[r:] + others[:r]
        order = ([own] if own in groups else []) + others
        return {h: tuple(groups[h]) for h in order}

    def busy_s(self, nbytes: float, cross_host: bool) -> float:
        """How long one message keeps its link busy: the overhead and its bytes (it lands a latency later)."""
        _, overhead, bandwidth = hop_cost(self.cluster, cross_host)
        return overhead + nbytes / bandwidth

    def message_s(self, nbytes: float, cross_host: bool) -> float:
        """One message from its first byte to its arrival, alone on its link."""
        return hop_cost(self.cluster, cross_host)[0] + self.busy_s(nbytes, cross_host)


def hop_cost(cluster: Cluster, cross_host: bool) -> tuple[float, float, float]:
    """(latency s, overhead s, bytes/s) of one message between two devices, as `simulate` prices it alone:
    across hosts over the NIC; inside a host over the intra-host link, or, where the cluster models its
    shared CPU (`Cluster.cpu`), as CPU work: `message_us` plus the bytes at the copy rate, no latency, each end on
    a core of its own unless the machine has fewer than 2 (`_end_share`)."""
    if cross_host:
        return cluster.latency_s, cluster.overhead_s, cluster.message_bytes_per_s
    if cluster.cpu is not None:
        share = _end_share(cluster)
        return 0.0, cluster.cpu.message_us * 1e-6 / share, cluster.cpu.copy_bytes_per_us * 1e6 * share
    return cluster.latency_s, cluster.overhead_s, cluster.intra_bytes_per_s


Hop = tuple[int, int]
"""One message's (from device, to device)."""


def hop_resources(hops: list[Hop], host_of: Callable[[int], int]) -> frozenset[Resource]:
    """What a task's messages occupy, as the simulator models the links (full duplex throughout).

    A cross-host hop holds the sending host's NIC send side and the receiving host's NIC receive
    side; a hop inside a host holds the sending device's outgoing port (`out:<device>`) and the
    receiving device's incoming port (`in:<device>`). So a host that sends and receives at once, or a
    device that forwards on one port while it receives on the other, is not serialised.

    >>> sorted(hop_resources([(0, 1), (1, 4)], lambda d: d // 4))
    [(0, 'in:1'), (0, 'out:0'), (0, 'send'), (1, 'recv')]
    """
    out: set[Resource] = set()
    for a, b in hops:
        ha, hb = host_of(a), host_of(b)
        out |= {(ha, "send"), (hb, "recv")} if ha != hb else {(ha, f"out:{a}"), (ha, f"in:{b}")}
    return frozenset(out)


def _ring_hops(members: tuple[int, ...]) -> list[Hop]:
    """The ring all-gather's links: each member to the next, the last back to the first.

    The strategies list their operations' links themselves (send, chain, ring) instead of asking
    `schemas.op_kinds.wire_pairs` per operation: a private fast path, about 10% of strategy time
    (BENCHMARKS.md); tests/test_op_kinds.py checks every strategy's links against the table."""
    return [(a, members[(i + 1) % len(members)]) for i, a in enumerate(members)] if len(members) > 1 else []


def pipelined_seconds(nbytes: int, hop_cross: list[bool], ctx: TaskContext) -> tuple[float, int]:
    """(time, K) for a chunked broadcast down hops (True = cross-host), K chosen from 1..MAX_CHUNKS; a chain forwarded
    between destination hosts (`TaskContext.rotation` set, two or more hops across hosts) in chunks of about
    CHAIN_CHUNK_BYTES (`chain_chunks`)."""
    if ctx.rotation is not None and sum(hop_cross) >= 2:
        return _chunked_seconds(nbytes, tuple(hop_cross), ctx.cluster, chain_chunks(nbytes))
    return _pipelined_seconds(nbytes, tuple(hop_cross), ctx.cluster, max(1, ctx.sharing))


def chain_chunks(nbytes: int) -> int:
    """The chunks of a chain forwarded between destination hosts: about CHAIN_CHUNK_BYTES each (at least
    MIN_CHUNK_BYTES, at most MAX_CHUNKS of them). Fixed, not `_pipelined_seconds`' optimum, which trades a crowded
    task's fill for fewer overheads and picks one chunk: a host then forwards a box only once it has all of it, and
    a chain rotated against its neighbours waits a whole box at each hop (`host_split`).

    >>> chain_chunks(2**20), chain_chunks(100 * 2**20), chain_chunks(2**40)
    (1, 6, 1024)
    """
    return int(max(1, min(round(nbytes / CHAIN_CHUNK_BYTES), MAX_CHUNKS, nbytes // MIN_CHUNK_BYTES)))


@lru_cache(maxsize=4096)
def _chunked_seconds(nbytes: int, hop_cross: tuple[bool, ...], cluster: Cluster, chunks: int) -> tuple[float, int]:
    """(time, `chunks`) of a broadcast of `chunks` chunks down the hops, as `_pipelined_seconds` prices any K."""
    latency, fill, widest = _chunk_costs(nbytes, hop_cross, cluster, np.array([chunks], dtype=np.float64))
    return float(latency + fill[0] + chunks * widest[0]), chunks


@lru_cache(maxsize=4096)
def _pipelined_seconds(nbytes: int, hop_cross: tuple[bool, ...], cluster: Cluster, sharing: int = 1) -> tuple[float, int]:
    """The time is `A*latency + fill + K*c_max`, where `c_max` is the slowest stage per chunk (a hop, or with
    the CPU modelled a relay's or the cores' copies: `_cpu_per_chunk`) and `fill` (the rest of one chunk's way) is
    the pipeline's fill and drain. K minimises `fill / sharing + K*c_max`: among `sharing` tasks queued
    on one NIC side only the last one's drain shows (each runs while the next fills), while every
    chunk's overhead keeps the side busy, so a lone task gets the fastest K and a crowded one fewer chunks."""
    if not hop_cross:
        return 0.0, 1
    k_max = int(max(1, min(MAX_CHUNKS, nbytes // MIN_CHUNK_BYTES)))
    ks = np.arange(1, k_max + 1, dtype=np.float64)
    latency, fill, widest = _chunk_costs(nbytes, hop_cross, cluster, ks)
    best = int(np.argmin(fill / sharing + ks * widest))
    return float(latency + fill[best] + ks[best] * widest[best]), int(ks[best])


def _chunk_costs(nbytes: int, hop_cross: tuple[bool, ...], cluster: Cluster, ks: np.ndarray
                 ) -> tuple[np.floating, np.ndarray, np.ndarray]:
    """(the hops' latencies, fill per K, slowest stage per chunk per K) of a broadcast of `nbytes` in each of `ks` chunks
    down the hops: a chunk's time on a hop is its overhead plus its bytes, the slowest stage the widest hop or the CPU's
    copies (`_cpu_per_chunk`), and the fill the rest of one chunk's way (K chunks take at least K times the slowest)."""
    latency, overhead, bw = np.array([hop_cost(cluster, c) for c in hop_cross]).T
    per_chunk = overhead[None, :] + (nbytes / ks)[:, None] / bw[None, :]
    widest = np.maximum(per_chunk.max(axis=1), _cpu_per_chunk(per_chunk, hop_cross, cluster))
    fill = np.maximum(per_chunk.sum(axis=1) - widest, 0.0)
    return latency.sum(), fill, widest


def _cpu_per_chunk(per_chunk: np.ndarray, hop_cross: tuple[bool, ...], cluster: Cluster) -> np.ndarray:
    """Per K, the CPU's time per chunk in the pipeline's steady state (`Cluster.cpu`; zeros without it): a hop
    inside a host is copy work at both of its ends, so a relay between two such hops copies twice per chunk on its
    one core, and all of the chain's copies share the machine's `cores` (as `simulate` prices them)."""
    inside = ~np.array(hop_cross)
    if cluster.cpu is None or not inside.any():
        return np.zeros(per_chunk.shape[0])
    copies = np.where(inside[None, :], per_chunk, 0.0) * _end_share(cluster)  # one end's work, in seconds of one core
    relay = (copies[:, 1:] + copies[:, :-1]).max(axis=1) if len(hop_cross) > 1 else np.zeros(per_chunk.shape[0])
    return np.maximum(relay, 2 * copies.sum(axis=1) / cluster.cpu.cores)


def _end_share(cluster: Cluster) -> float:
    """The share of a core each end of a message inside a host gets when it runs alone: the two ends share the
    machine's `cores`, at most one core each (as `simulate.cpu_hop` prices them)."""
    return min(1.0, cluster.cpu.cores / 2)


def broadcast(ctx: TaskContext) -> StrategyResult:
    """One chunked broadcast from the sender down a chain: its own host's receivers, then host by host."""
    chain = [d for group in ctx.receivers_by_host().values() for d in group]
    hosts = [ctx.host(ctx.sender)] + [ctx.host(d) for d in chain]
    hop_cross = [a != b for a, b in zip(hosts, hosts[1:])]
    seconds, chunks = pipelined_seconds(ctx.nbytes, hop_cross, ctx)
    op = PlannedOp("broadcast", ctx.sender, tuple(chain), ctx.region, chunks=chunks, duration_s=seconds)
    hops = list(zip([ctx.sender] + chain, chain))
    tail = hop_cost(ctx.cluster, hop_cross[-1])[0] if hop_cross else 0.0  # the last chunk on the last hop, in flight
    return StrategyResult((op,), seconds, hop_resources(hops, ctx.host), chunks, tail)


def send_recv(ctx: TaskContext) -> StrategyResult:
    """The sender sends the whole box to every receiver, one after another (Alpa's default): each send
    follows the previous one's last byte, so only the last one's latency shows."""
    ops, clock, end = [], 0.0, 0.0
    for group in ctx.receivers_by_host().values():
        for d in group:
            cross = ctx.host(d) != ctx.host(ctx.sender)
            ops.append(PlannedOp("send", ctx.sender, (d,), ctx.region, offset_s=clock, duration_s=ctx.message_s(ctx.nbytes, cross)))
            clock += ctx.busy_s(ctx.nbytes, cross)
            end = max(end, ops[-1].offset_s + ops[-1].duration_s)
    return StrategyResult(tuple(ops), end, hop_resources([(ctx.sender, op.dsts[0]) for op in ops], ctx.host),
                          tail_s=end - clock)


def _scatter_then_gather(ctx: TaskContext, groups: list[tuple[int, ...]]) -> StrategyResult:
    """Send one part of the box to each member of each group (back to back, as `send_recv`), then all-gather
    inside every group (ring: each step forwards what the last one delivered, so every step pays a latency)."""
    ops, clock, end, gathers = [], 0.0, 0.0, []
    for members in groups:
        parts = _pad_parts(tuple(split_region(ctx.region, len(members))), members, ctx.region)
        for d, part in zip(members, parts):
            if _size(part):
                cross = ctx.host(d) != ctx.host(ctx.sender)
                nbytes = _size(part) * ctx.itemsize
                ops.append(PlannedOp("send", ctx.sender, (d,), part, offset_s=clock, duration_s=ctx.message_s(nbytes, cross)))
                clock += ctx.busy_s(nbytes, cross)
                end = max(end, ops[-1].offset_s + ops[-1].duration_s)
        if len(members) > 1:
            gathers.append((members, parts))
    scattered, busy = end, clock
    for members, parts in gathers:
        largest = max(_size(p) for p in parts) * ctx.itemsize
        cross = len({ctx.host(d) for d in members}) > 1
        seconds = (len(members) - 1) * ctx.message_s(largest, cross)
        ops.append(PlannedOp("allgather", None, members, ctx.region, parts=parts, offset_s=scattered, duration_s=seconds))
        end = max(end, scattered + seconds)
        busy = max(busy, scattered + seconds - hop_cost(ctx.cluster, cross)[0])  # its last step's latency keeps no link busy
    hops = [(ctx.sender, op.dsts[0]) for op in ops if op.kind == "send"] + [h for g in groups for h in _ring_hops(g)]
    return StrategyResult(tuple(ops), end, hop_resources(hops, ctx.host), tail_s=end - busy)


def _pad_parts(parts: tuple[Region, ...], members: tuple[int, ...], region: Region) -> tuple[Region, ...]:
    """Members beyond the number of non-empty parts contribute an empty box at the region's start."""
    empty = tuple((a, a) for a, _ in region)
    return parts + (empty,) * (len(members) - len(parts))


def _size(region: Region) -> int:
    out = 1
    for a, b in region:
        out *= b - a
    return out


def local_allgather(ctx: TaskContext) -> StrategyResult:
    """Send 1/B of the box to each of a host's B receivers, then all-gather inside that host."""
    return _scatter_then_gather(ctx, list(ctx.receivers_by_host().values()))


def global_allgather(ctx: TaskContext) -> StrategyResult:
    """Send 1/N of the box to each of all N receivers, then one all-gather across all of them."""
    chain = tuple(d for group in ctx.receivers_by_host().values() for d in group)
    return _scatter_then_gather(ctx, [chain])


STRATEGIES: dict[str, Callable[[TaskContext], StrategyResult]] = {
    "broadcast": broadcast,
    "send_recv": send_recv,
    "local_allgather": local_allgather,
    "global_allgather": global_allgather,
}


def get_strategy(name: str) -> Callable[[TaskContext], StrategyResult]:
    if name not in STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; choose one of: {', '.join(STRATEGIES)}, auto")
    return STRATEGIES[name]
