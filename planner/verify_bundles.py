"""A compact plan's bundles and shared messages checked for every row at once, from its columns.

`plan_check._check_operation` checks a bundle one record at a time; `bundle_facts` makes the same checks on whole
columns: its sender a device and one receiving relay, on another host, one chunk; its region a non-empty box inside
the tensor; one holder and one needers list per part, at least one part; every part a non-empty box inside the region,
held by a device on the sending relay's host whose source shard holds it, needed by distinct devices on the receiving
relay's host (at least one), each with room for it in its destination shard; the sending relay a source device and the
receiving relay a destination device. It also counts each bundle's elements (for `carrier_rows`) and message tags
(`op_kinds.tags_used`: the cross-host message, one gather per run of consecutive parts a holder other than the sending
relay holds, one scatter per run of consecutive parts a needer other than the receiving relay needs).

`carrier_rows` is `carriers.carrier_fault` on columns, `same_sides` (of `task_sides`) `plan_check._check_shared_sides`.
A row these do not prove is left to the caller, which reads it as a record or declines the plan (the record path then
says what is wrong).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from xmesh_plan.schemas.op_kinds import OP_KINDS
from xmesh_plan.schemas.plan_check_arrays import OpColumns
from xmesh_plan.schemas.plan_compact import row_ranges

# the bundle kinds this module proves: one receiving relay, a sender, one chunk (a table row that differs is left to records)
_BUNDLES = {k for k, r in OP_KINDS.items() if r.pattern == "bundle" and r.has_src and r.min_dsts == r.max_dsts == 1 and not r.chunked}


@dataclass(frozen=True)
class BundleColumns:
    """Bundles' columns, CSR: per row, its parts (`part_offsets`) as boxes of the shared box table (`part_box`), its
    holders (`holder_offsets`, `holder`) and needers lists (`needer_offsets` per row into lists, `inner` per list into
    `needer`); the box table as (offsets of each box's pairs, the (start, stop) pairs)."""

    part_offsets: np.ndarray
    part_box: np.ndarray
    holder_offsets: np.ndarray
    holder: np.ndarray
    needer_offsets: np.ndarray
    inner: np.ndarray
    needer: np.ndarray
    table: tuple[np.ndarray, np.ndarray]
    ranked: dict = field(default_factory=dict, compare=False)  # rank -> `box_bounds` of every box of the table

    def bounds(self, boxes: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`box_bounds` of boxes of the table (each box of it worked out once per rank: parts share boxes)."""
        if rank not in self.ranked:
            self.ranked[rank] = box_bounds(self.table, np.arange(len(self.table[0]) - 1), rank)
        ok, lo, hi = self.ranked[rank]
        return ok[boxes], lo[boxes], hi[boxes]

    @classmethod
    def of(cls, ops: dict, table: tuple[np.ndarray, np.ndarray]) -> "BundleColumns":
        """From `read_compact_columns`' operations columns and box table."""
        return cls(ops["parts"]["offsets"], ops["parts"]["boxes"], ops["holders"]["offsets"], ops["holders"]["values"],
                   ops["needers"]["offsets"], ops["needers"]["inner"], ops["needers"]["values"], table)


@dataclass(frozen=True)
class BundleFacts:
    """Per row: a bundle `bundle_facts` proved, its parts' elements and its message tags (0 for other rows)."""

    proven: np.ndarray
    elements: np.ndarray
    tags: np.ndarray


def box_bounds(table: tuple[np.ndarray, np.ndarray], boxes: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(has `rank` dims, starts, stops) of boxes of the shared box table, starts and stops (boxes, rank); a box of
    another rank gets zeros."""
    offsets, pairs = table
    ok = (offsets[boxes + 1] - offsets[boxes]) == rank
    if not len(pairs):
        pairs = np.zeros((1, 2), np.int64)
        ok &= rank == 0
    at = np.where(ok[:, None], offsets[boxes][:, None] + np.arange(rank), 0)
    got = np.where(ok[:, None, None], pairs[at], 0)
    return ok, got[:, :, 0], got[:, :, 1]


class _Blocks:
    """One side's blocks of a tensor layout as dense arrays over device ids: who has one, and its box."""

    def __init__(self, blocks: dict, rank: int):
        devices = np.array(sorted(blocks), dtype=np.int64)
        size = int(devices.max()) + 1 if len(devices) and devices.min() >= 0 else 0
        self.has = np.zeros(size + 1, dtype=bool)
        lo, hi = np.zeros((size + 1, rank), np.int64), np.zeros((size + 1, rank), np.int64)
        for d in devices.tolist() if size else ():
            self.has[d] = True
            lo[d], hi[d] = [a for a, _ in blocks[d]], [b for _, b in blocks[d]]
        self.lo, self.hi = [lo[:, k].copy() for k in range(rank)], [hi[:, k].copy() for k in range(rank)]  # per dim

    def known(self, devices: np.ndarray) -> np.ndarray:
        """Per entry: the device has a block."""
        return self.has[np.where((devices >= 0) & (devices < len(self.has)), devices, len(self.has) - 1)]

    def holds(self, devices: np.ndarray, lo: list[np.ndarray], hi: list[np.ndarray]) -> np.ndarray:
        """Per entry: `devices[k]` has a block and the box [lo[k], hi[k]) (given dim by dim) lies inside it."""
        at = np.where((devices >= 0) & (devices < len(self.has)), devices, len(self.has) - 1)
        inside = self.has[at]
        for block_lo, block_hi, a, b in zip(self.lo, self.hi, lo, hi):  # 1-D gathers: faster than gathering rows
            inside &= (block_lo[at] <= a) & (b <= block_hi[at])
        return inside


CHUNK_PARTS = 1 << 18  # parts checked at a time: the arrays of a chunk stay a few tens of MiB


def _parts(columns: BundleColumns, rows: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(lengths per row, flat part positions, row of each part (a position in `rows`), its starts, its stops; a part
    of another rank than `rank` is given a stop below its start, so it is no box of the tensor)."""
    lengths, flat = row_ranges(columns.part_offsets, rows)
    ok, lo, hi = columns.bounds(columns.part_box[flat], rank)
    return lengths, flat, np.repeat(np.arange(len(rows)), lengths), lo, np.where(ok[:, None], hi, lo - 1)


def _needers(columns: BundleColumns, rows: np.ndarray, parts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(needers per part, the part of each needer (a position among the rows' `parts` parts), each needer)."""
    needs, at = row_ranges(columns.inner, row_ranges(columns.needer_offsets, rows)[1])
    return needs, np.repeat(np.arange(parts), needs), columns.needer[at]


def _chunks(rows: np.ndarray, parts: np.ndarray, size: int) -> list[np.ndarray]:
    """`rows` cut into consecutive pieces of about `size` parts (`parts`: each row's)."""
    ends = np.searchsorted(np.cumsum(parts[rows]), np.arange(size, int(parts[rows].sum()), size))
    return [piece for piece in np.split(rows, ends) if len(piece)]


def bundle_facts(ops: OpColumns, columns: BundleColumns, problems: list, cluster) -> BundleFacts:
    """What `_check_operation` proves of each bundle row, on arrays (see the module docstring)."""
    n = len(ops.kind)
    kind = np.array([k in _BUNDLES for k in ops.kinds] or [False])[ops.kind]
    count, parts = np.diff(ops.dst_offsets), np.diff(columns.part_offsets)
    ok = kind & ~ops.src_none & (count == 1) & (ops.chunks == 1) & (parts >= 1)
    ok &= (np.diff(columns.holder_offsets) == parts) & (np.diff(columns.needer_offsets) == parts)
    relay = ops.dsts[np.minimum(ops.dst_offsets[:-1], max(len(ops.dsts) - 1, 0))] if len(ops.dsts) else np.zeros(n, np.int64)
    ok &= (cluster.host_of(ops.src) != cluster.host_of(relay)) & (ops.src != relay)
    facts = BundleFacts(np.zeros(n, bool), np.zeros(n, np.int64), np.zeros(n, np.int64))
    tensor = np.where(ops.tensor_none, 0, ops.tensor)
    dims = np.diff(ops.region_offsets)
    layouts: dict[tuple, list[int]] = {}
    for t in np.unique(tensor[ok]).tolist():
        if 0 <= t < len(problems):
            p = problems[t]
            layouts.setdefault((tuple(p.shape), p.src, p.dst), []).append(t)
    for members in layouts.values():
        problem = problems[members[0]]
        blocks = (_Blocks(problem.blocks("src"), len(problem.shape)), _Blocks(problem.blocks("dst"), len(problem.shape)))
        size = max(1024, CHUNK_PARTS * 8 // cluster.devices_per_host)  # a chunk's table of needers per part stays small
        for rows in _chunks(np.flatnonzero(ok & np.isin(tensor, members) & (dims == len(problem.shape))), parts, size):
            _check_rows(ops, columns, problem, blocks, cluster, relay, rows, facts)
    return facts


def _check_rows(ops: OpColumns, columns: BundleColumns, problem, blocks: tuple["_Blocks", "_Blocks"], cluster, relay: np.ndarray,
                rows: np.ndarray, facts: BundleFacts) -> None:
    """`bundle_facts` of `rows`, bundles of one tensor layout (`problem`, its source and destination `blocks`)."""
    rank, host_of, per_host = len(problem.shape), cluster.host_of, cluster.devices_per_host
    shape = np.array(problem.shape, dtype=np.int64)
    region = ops.region[ops.region_offsets[rows][:, None] + np.arange(rank)]
    r_lo, r_hi = region[:, :, 0], region[:, :, 1]
    good = ((0 <= r_lo) & (r_lo < r_hi) & (r_hi <= shape)).all(axis=1) & blocks[0].known(ops.src[rows]) & blocks[1].known(relay[rows])
    lengths, flat, owner, lo, hi = _parts(columns, rows, rank)
    part_ok = ((0 <= lo) & (lo < hi) & (hi <= shape) & (r_lo[owner] <= lo) & (hi <= r_hi[owner])).all(axis=1)
    holder, sender, receiver = columns.holder[row_ranges(columns.holder_offsets, rows)[1]], ops.src[rows][owner], relay[rows][owner]
    lo_dims, hi_dims = [lo[:, d].copy() for d in range(rank)], [hi[:, d].copy() for d in range(rank)]
    part_ok &= (host_of(holder) == host_of(sender)) & blocks[0].holds(holder, lo_dims, hi_dims)
    needs, part_of, needer = _needers(columns, rows, len(flat))
    on_host = host_of(needer) == host_of(receiver[part_of])
    # each needer's place on the receiving relay's host, counted per part: distinct needers count 1 each
    key = part_of * per_host + np.where(on_host, needer - host_of(receiver[part_of]) * per_host, 0)
    seen = np.bincount(key[on_host], minlength=len(flat) * per_host)
    need_ok = on_host & (seen[key] == 1) & blocks[1].holds(needer, [c[part_of] for c in lo_dims], [c[part_of] for c in hi_dims])
    part_ok &= (needs >= 1) & (np.bincount(part_of, weights=~need_ok, minlength=len(flat)) == 0)
    good &= np.bincount(owner, weights=~part_ok, minlength=len(rows)) == 0
    facts.proven[rows[good]] = True
    summed = np.concatenate(([0], np.cumsum(np.prod(hi - lo, axis=1, dtype=np.int64))))  # exact, per row below
    facts.elements[rows] = summed[np.cumsum(lengths)] - summed[np.cumsum(lengths) - lengths]
    first = np.ones(len(flat), bool)  # the first part of its row
    first[1:] = owner[1:] != owner[:-1]
    gathers = (holder != sender) & (first | (np.roll(holder, 1) != holder))  # a run of parts one holder sends
    after = ~first[part_of] & on_host & (seen[np.maximum(key - per_host, 0)] > 0)  # the part before goes to it too
    scatters = (needer != receiver[part_of]) & ~after  # a run of parts the receiving relay sends one needer
    facts.tags[rows] = 1 + np.bincount(owner, weights=gathers, minlength=len(rows)).astype(np.int64) \
        + np.bincount(owner[part_of], weights=scatters, minlength=len(rows)).astype(np.int64)


def bundle_writes(columns: BundleColumns, rows: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """What proved bundles `rows` (of tensors of `rank` dims) write: per part, its row, starts and stops; per needer,
    its part (a position among those) and the device."""
    _, flat, owner, lo, hi = _parts(columns, rows, rank)
    _, part_of, needer = _needers(columns, rows, len(flat))
    return rows[owner], lo, hi, part_of, needer


def carrier_rows(ops: OpColumns, ids: np.ndarray, carrier: np.ndarray, carrier_none: np.ndarray, facts: BundleFacts,
                 itemsizes: list[int]) -> np.ndarray | None:
    """The row of the carrier of each row with one, where `carriers.carrier_fault` finds nothing (None otherwise):
    every bundle with a carrier is a proved bundle listed after its carrier, a proved bundle with no carrier of its
    own, right after a bundle of the same message, with its carrier's relays; the bundle before it carries a multiple
    of the largest element size. `ids` are unique."""
    carried = np.flatnonzero(~carrier_none)
    if not facts.proven[carried].all():
        return None
    wanted, order = carrier[carried], np.argsort(ids, kind="stable")
    at = order[np.clip(np.searchsorted(ids[order], wanted), 0, len(ids) - 1)]
    if not ((ids[at] == wanted) & (at < carried) & facts.proven[at] & carrier_none[at]).all():
        return None
    before = carried - 1
    relay = ops.dsts[ops.dst_offsets[:-1][np.concatenate((carried, at))]]  # proved bundles: one receiving relay each
    tensor = np.where(ops.tensor_none, 0, ops.tensor)[before]
    holds = ((np.where(carrier_none[before], ids[before], carrier[before]) == wanted).all()
             and (ops.src[carried] == ops.src[at]).all() and (relay[:len(carried)] == relay[len(carried):]).all()
             and (facts.elements[before] * np.array(itemsizes, dtype=np.int64)[tensor] % max(itemsizes) == 0).all())
    return at if holds else None


def task_sides(entries: list[tuple[int, ...]]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each task's host_order entries (`entries[e]`: the tasks of entry e, a distinct (host, NIC side) each), as
    (tasks listed, ascending; offsets; entries of each, ascending, once each)."""
    tasks = np.concatenate([np.array(t, dtype=np.int64) for t in entries] or [np.zeros(0, np.int64)])
    entry = np.repeat(np.arange(len(entries)), [len(t) for t in entries])
    order = np.lexsort((entry, tasks))
    tasks, entry = tasks[order], entry[order]
    once = np.ones(len(tasks), dtype=bool)
    once[1:] = (tasks[1:] != tasks[:-1]) | (entry[1:] != entry[:-1])
    tasks, entry = tasks[once], entry[once]
    listed, starts = np.unique(tasks, return_index=True)
    return listed, np.append(starts, len(tasks)), entry


def same_sides(sides: tuple[np.ndarray, np.ndarray, np.ndarray], a: np.ndarray, b: np.ndarray) -> bool:
    """`_check_shared_sides`: task a[k] is listed on the same NIC sides as task b[k], for every k."""
    listed, offsets, entry = sides

    def spans(tasks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        at = np.clip(np.searchsorted(listed, tasks), 0, max(len(listed) - 1, 0))
        has = (listed[at] == tasks) if len(listed) else np.zeros(len(tasks), bool)
        return np.where(has, offsets[at], 0), np.where(has, offsets[at + 1] - offsets[at], 0) if len(listed) else np.zeros(len(tasks), np.int64)

    (a_start, a_len), (b_start, b_len) = spans(a), spans(b)
    if not (a_len == b_len).all():
        return False
    firsts = np.cumsum(a_len) - a_len
    step = np.arange(int(a_len.sum())) - np.repeat(firsts, a_len)
    return bool((entry[np.repeat(a_start, a_len) + step] == entry[np.repeat(b_start, b_len) + step]).all())
