"""Which kinds of tensor a compile splits by receiving host, and how the others' chains go through the hosts.

Split by receiving host (`unit_tasks.split_by_receiver_host`), a box needed on n hosts leaves its source host n
times; a chain (one broadcast through the receiving hosts, `strategies.broadcast`) sends it once and the
destination hosts forward it. Splitting lets each host's share be scheduled on its own, and is the default for a
multi-tensor problem, where destinations are mostly sharded (a host needs its own part) and the byte bound is a
destination host's receive. Where the sources are fewer than the destinations and each box is needed on several of
them (a 48-GPU MoE sync: 2 source hosts, 2 inference instances of 2 hosts), the split makes a source host send
about twice the bound. This module decides, for a multi-tensor problem compiled split (`compile.compile_rows`; a
single tensor compiled with `split_hosts` is split throughout, as asked), which kinds of tensor stay whole.

The criterion (`chained_kinds`), from the per-host loads the planner has before it costs anything: each source
host's send if every kind is split (`source_send`) against the byte bound (`bounds.joint_lower_bound`). Where no
source host would send more than the bound, every kind is split. Otherwise kinds are chained, the one that saves the
most source bytes (over all its tensors) first, until no source host sends more than HEADROOM of the bound (or
nothing is left to chain); a kind is chained only where it lowers a source host that is still above that. A source
at the bound leaves the chains no slack to fill and drain: the 48-GPU MoE sync, chained until within the bound (4
kinds of 17), runs 1.105x the bound in host order and 1.084x posted, chained until within 0.9 of it 1.101x and
1.077x (5 kinds; its sources still send 0.969x the bound, as the other kinds' boxes are small). Small boxes that
`coalesce` splits to ride a host pair's bundle are counted split either way, so chaining a kind of only those saves
nothing.

Chaining is left out (every kind split) where a host both holds and receives boxes (`sources_receive`: overlapping
meshes), as a source host that also forwards chains sends more than the criterion counts: two 64 MiB tensors from
hosts 0-1 to four replicas on hosts 0-3 run 1.71x the bound in host order chained, 1.54x split (under
`--max-staging-mb`, in device order, 2.00x and 1.73x). With disjoint meshes chains stay under a staging limit: the
48-GPU MoE sync with `--max-staging-mb 1024` runs 1.215x the bound in device order chained (split, with no limit,
2.12x).

A chained box goes down one pipelined chain in chunks of about `strategies.CHAIN_CHUNK_BYTES` (`chain_chunks`), so
a host forwards while it receives. Its chain's host order is rotated (`rotations`): boxes with one set of receiving
hosts take turns at which of those hosts receives first-hand, so every one of them forwards a share, and no one
host forwards every box.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence

from xmesh_plan.schemas import Cluster

from .unit_tasks import Cell

EPS = 1e-9  # relative: a send within the bound this close is within it
HEADROOM = 0.9  # once chaining starts, kinds are chained until no source host sends more than this much of the bound


def source_send(cells: Sequence[Cell], nbytes: Callable[[Cell], int], cluster: Cluster, split: Callable[[Cell], bool]
                ) -> dict[int, float]:
    """Host -> the bytes it sends of these cells: a cell needed on hosts that do not hold it leaves once per such host
    where `split(cell)`, once otherwise; a cell held on several hosts counts an equal share on each (the scheduler
    picks one of them).

    >>> from xmesh_plan.schemas import Cluster
    >>> cell = Cell(((0, 8),), (0,), (8, 16, 17), ())
    >>> source_send([cell], lambda c: 8, Cluster(devices_per_host=8), lambda c: True)
    {0: 16.0}
    """
    out: dict[int, float] = {}
    for cell in cells:
        holding = {cluster.host_of(d) for d in cell.senders}
        needing = {cluster.host_of(d) for d in cell.receivers} - holding
        if not needing or not holding:
            continue
        share = nbytes(cell) * (len(needing) if split(cell) else 1) / len(holding)
        for host in holding:
            out[host] = out.get(host, 0.0) + share
    return out


def sources_receive(cells_of: Iterable[Sequence[Cell]], cluster: Cluster) -> bool:
    """Whether some host holds boxes of these cells and receives boxes of them too (the meshes share a host).

    >>> from xmesh_plan.schemas import Cluster
    >>> sources_receive([[Cell(((0, 8),), (0,), (8, 16), ())]], Cluster(devices_per_host=8))
    False
    >>> sources_receive([[Cell(((0, 8),), (0,), (8,), ()), Cell(((8, 16),), (9,), (1,), ())]], Cluster(devices_per_host=8))
    True
    """
    holding: set[int] = set()
    receiving: set[int] = set()
    for cells in cells_of:
        for cell in cells:
            holding.update(cluster.host_of(d) for d in cell.senders)
            receiving.update(cluster.host_of(d) for d in cell.receivers)
    return not holding.isdisjoint(receiving)


def chained_kinds(kinds: Sequence[Hashable], split: dict[Hashable, dict[int, float]],
                  chained_send: Callable[[Hashable], dict[int, float]], budget_bytes: float) -> set[Hashable]:
    """The kinds of tensor whose boxes go down one chain through their receiving hosts instead of being split by host.
    `kinds` names each tensor's kind (repeated per tensor); `split[kind]`: one tensor's source sends split
    (`source_send`), `chained_send(kind)` chained (asked only when some kind is to be chained); `budget_bytes`: what a
    source host may send (the byte bound times its send rate). None where no source host's send, every kind split, is
    above the budget; otherwise kinds in order of the source bytes chaining them saves (all tensors of the kind; ties:
    the first seen), each one that lowers a source host still above HEADROOM of the budget, until none is.

    >>> split = {"experts": {0: 400.0}, "norm": {0: 20.0}, "attn": {1: 60.0}}
    >>> once = {"experts": {0: 200.0}, "norm": {0: 10.0}, "attn": {1: 30.0}}.get
    >>> sorted(chained_kinds(["experts", "norm", "attn"], split, once, 500.0))  # host 0 sends 420 split: within 500
    []
    >>> sorted(chained_kinds(["experts", "experts", "norm", "attn"], split, once, 500.0))  # 820: the experts bring it to 420
    ['experts']
    >>> sorted(chained_kinds(["experts", "experts", "norm", "attn"], split, once, 400.0))  # 420: the norm too; host 1 is within
    ['experts', 'norm']
    """
    count: dict[Hashable, int] = {}
    for kind in kinds:
        count[kind] = count.get(kind, 0) + 1
    total: dict[int, float] = {}
    for kind in count:
        for h, b in split[kind].items():
            total[h] = total.get(h, 0.0) + b * count[kind]
    limit = budget_bytes * (1 + EPS)
    chained: set[Hashable] = set()
    if max(total.values(), default=0.0) <= limit:
        return chained
    limit *= HEADROOM
    saving: dict[Hashable, dict[int, float]] = {}
    for kind in count:
        once = chained_send(kind)
        saving[kind] = {h: (b - once.get(h, 0.0)) * count[kind] for h, b in split[kind].items()}
    for kind in sorted(count, key=lambda k: -sum(saving[k].values())):  # stable: ties keep the first seen
        over = {h for h, b in total.items() if b > limit}
        if not over:
            break
        if not any(saving[kind].get(h, 0.0) > 0 for h in over):
            continue
        chained.add(kind)
        for h, b in saving[kind].items():
            total[h] -= b
    return chained


def rotations(cells: Sequence[Cell], cluster: Cluster) -> list[int | None]:
    """Per cell, where its chain's host order starts (`strategies.TaskContext.rotation`); None for a cell needed on
    fewer than two hosts that do not hold it (nothing to rotate). The cells needed on one set of n such hosts are cut,
    in order, into n runs of as equal counts as can be, and run j starts at the set's j-th host: each host receives
    about 1/n of the boxes first-hand and forwards them.

    Runs, not turns: in host order each NIC side carries its operations one after another, so chains of two hosts
    that alternate direction each wait for the previous one's last hop (the 48-GPU MoE sync: 1.39x the bound in host
    order, against 1.10x in runs); posted, both spread the forwarding alike (1.081x, 1.077x).

    >>> from xmesh_plan.schemas import Cluster
    >>> pair, three = (16, 24), (8, 16, 24)
    >>> cells = [Cell(((k, k + 1),), (0,), pair if k < 4 else three, ()) for k in range(7)] + [Cell(((7, 8),), (0,), (8,), ())]
    >>> rotations(cells, Cluster(devices_per_host=8))
    [0, 0, 1, 1, 0, 1, 2, None]
    """
    def hosts(cell: Cell) -> tuple[int, ...]:
        holding = {cluster.host_of(d) for d in cell.senders}
        return tuple(sorted({cluster.host_of(d) for d in cell.receivers} - holding))

    sets = [hosts(cell) for cell in cells]
    count: dict[tuple[int, ...], int] = {}
    for s in sets:
        count[s] = count.get(s, 0) + 1
    seen: dict[tuple[int, ...], int] = {}
    out: list[int | None] = []
    for s in sets:
        if len(s) < 2:
            out.append(None)
            continue
        k = seen.get(s, 0)
        seen[s] = k + 1
        out.append(k * len(s) // count[s])
    return out
