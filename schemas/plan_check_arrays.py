"""The per-operation structural checks of `schemas.plan_check` for many operations at once, where they are simple.

A copy, send or broadcast (the kinds whose pattern is `local` or `chain`, no parts) passes `_check_operation`
exactly when its box lies inside the tensor and is not empty, its chunk count fits its kind and its box, its
devices are as the kind needs, the sender holds the box in its source shard and every receiver has room for it in
its destination shard. `proven_operations` tests all of that with whole-array interval arithmetic and marks the
operations it proves. A bundle passes exactly when its box and counts are as its kind needs and each part lies in
the box, with its holder on the sending relay's host holding it and its needers distinct, on the receiving relay's
host, with room for it: `proven_bundles` tests the distinct bundles that are left, every part of them at once (a rank
of a large MoE plan has 10^5 parts). `check_plan` checks the others (all-gathers, and any operation the arrays do not
prove) one by one, in list order, so the first fault and its message stay the one-by-one checker's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from itertools import chain

import numpy as np

from .op_kinds import OP_KINDS
from .plan_compact import row_ranges
from .problem import ReshardingProblem

_SIMPLE = {kind for kind, rule in OP_KINDS.items() if rule.pattern in ("local", "chain") and not rule.has_parts}


def sorted_unique(values: np.ndarray) -> np.ndarray:
    """`np.unique` of integers, by counting where their range is at most a few times their number (a plan's ids
    and box bounds), else by a sort and a mask (numpy 2's `np.unique` hashes, ten times slower on 10^6 integers)."""
    values = np.asarray(values, dtype=np.int64)
    if not values.size:
        return values
    lo, hi = int(values.min()), int(values.max())
    if hi - lo > 4 * values.size + 1024:
        ordered = np.sort(values)
        return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))]
    return np.flatnonzero(np.bincount(values - lo, minlength=hi - lo + 1)) + lo


def member_of(values: np.ndarray, table: np.ndarray) -> np.ndarray:
    """`np.isin(values, table)` for integers, through a mask over the table's range where that is small."""
    values, table = np.asarray(values, dtype=np.int64), np.asarray(table, dtype=np.int64)
    if not table.size or not values.size:
        return np.zeros(values.shape, dtype=bool)
    lo, hi = int(table.min()), int(table.max())
    if hi - lo > 4 * (values.size + table.size) + 1024:
        return np.isin(values, table)
    mask = np.zeros(hi - lo + 1, dtype=bool)
    mask[table - lo] = True
    inside = (values >= lo) & (values <= hi)
    return inside & mask[np.where(inside, values - lo, 0)]


def _block_table(blocks: dict[int, tuple], ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted device ids, their blocks as an (n, ndim, 2) array)."""
    devices = np.array(sorted(blocks), dtype=np.int64)
    boxes = np.array([blocks[d] for d in devices.tolist()], dtype=np.int64).reshape(len(devices), ndim, 2)
    return devices, boxes


def _inside_blocks(devices: np.ndarray, boxes: np.ndarray, table: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Per row: `devices[k]` has a block in `table` and `boxes[k]` lies inside it."""
    ids, blocks = table
    if not len(ids):
        return np.zeros(len(devices), dtype=bool)
    at = np.clip(np.searchsorted(ids, devices), 0, len(ids) - 1)
    known = ids[at] == devices
    block = blocks[at]
    inside = ((block[:, :, 0] <= boxes[:, :, 0]) & (boxes[:, :, 1] <= block[:, :, 1])).all(axis=1)
    return known & inside


@dataclass(frozen=True)
class OpColumns:
    """Operations as flat columns (one row each, list order): what `proven_rows` reads. Lists are CSR: `dst_offsets`
    into `dsts`, `region_offsets` into `region` ((start, stop) pairs, one per dim)."""

    kind: np.ndarray  # code into `kinds`
    kinds: list[str]
    src: np.ndarray
    src_none: np.ndarray
    dst_offsets: np.ndarray
    dsts: np.ndarray
    region_offsets: np.ndarray
    region: np.ndarray
    chunks: np.ndarray
    tensor: np.ndarray
    tensor_none: np.ndarray
    bare: np.ndarray  # no parts, holders or needers

    @cached_property
    def dst_owner(self) -> np.ndarray:
        """The row each entry of `dsts` belongs to."""
        return np.repeat(np.arange(len(self.kind)), np.diff(self.dst_offsets))

    def rule(self, fact: str, default) -> np.ndarray:
        """Per row: its kind's `OpKindRule.<fact>` (`default` for a kind the table lacks)."""
        return np.array([getattr(OP_KINDS[k], fact) if k in OP_KINDS else default for k in self.kinds] or [default])[self.kind]

    def tag_counts(self, proven: np.ndarray) -> np.ndarray:
        """Per row: the message tags a `proven` row owns (`op_kinds.tags_used`: its chunks, none for a local copy), 0 for the others."""
        return np.where(proven & (self.rule("pattern", "") != "local"), self.chunks, 0).astype(np.int64)

    @classmethod
    def of(cls, operations) -> "OpColumns":
        """The columns of plan records (`schemas.plan.Operation`)."""
        kinds = sorted({op.kind for op in operations})
        code = {k: i for i, k in enumerate(kinds)}

        def ints(values) -> np.ndarray:
            return np.array(list(values), dtype=np.int64)

        def offsets(lengths) -> np.ndarray:
            return np.concatenate(([0], np.cumsum(ints(lengths)))).astype(np.int64)

        return cls(ints(code[op.kind] for op in operations), kinds, ints(op.src or 0 for op in operations),
                   np.array([op.src is None for op in operations], dtype=bool), offsets(len(op.dsts) for op in operations),
                   ints(d for op in operations for d in op.dsts), offsets(len(op.region) for op in operations),
                   ints(x for op in operations for pair in op.region for x in pair).reshape(-1, 2),
                   ints(op.chunks for op in operations), ints(op.tensor or 0 for op in operations),
                   np.array([op.tensor is None for op in operations], dtype=bool),
                   np.array([not (op.parts or op.holders or op.needers) for op in operations], dtype=bool))


def proven_operations(operations, problems: list[ReshardingProblem], max_chunks: int) -> np.ndarray:
    """Per operation (list order): True where it is a copy, send or broadcast that `_check_operation` passes (the
    columns are made of those kinds' operations only: no other is proven here)."""
    picked = [k for k, op in enumerate(operations) if op.kind in _SIMPLE]
    proven = np.zeros(len(operations), dtype=bool)
    if picked:
        proven[picked] = proven_rows(OpColumns.of([operations[k] for k in picked]), problems, max_chunks)
    return proven


def proven_rows(ops: OpColumns, problems: list[ReshardingProblem], max_chunks: int) -> np.ndarray:
    """Per row of `ops`: True where it is a copy, send or broadcast that `_check_operation` passes."""
    n = len(ops.kind)
    if not n:
        return np.zeros(0, dtype=bool)
    simple = np.array([k in _SIMPLE for k in ops.kinds] or [False])[ops.kind]
    count = np.diff(ops.dst_offsets)
    lo_count, hi_count = ops.rule("min_dsts", 0), ops.rule("max_dsts", None)
    unlimited = np.array([h is None for h in hi_count.tolist()], dtype=bool)
    hi = np.where(unlimited, np.iinfo(np.int64).max, np.where(unlimited, 0, hi_count).astype(np.int64))
    owner = ops.dst_owner
    order = np.lexsort((ops.dsts, owner))
    twice = (owner[order][1:] == owner[order][:-1]) & (ops.dsts[order][1:] == ops.dsts[order][:-1])
    distinct = np.bincount(owner[order][1:][twice], minlength=n) == 0
    src_in_dsts = np.bincount(owner[ops.dsts == ops.src[owner]], minlength=n) > 0
    first = ops.dsts[np.minimum(ops.dst_offsets[:-1], max(len(ops.dsts) - 1, 0))] if len(ops.dsts) else np.zeros(n, np.int64)
    local = ops.rule("pattern", "") == "local"
    members_ok = (lo_count <= count) & (count <= hi) & distinct
    members_ok &= np.where(local, (count == 1) & (first == ops.src), ~src_in_dsts)
    chunked = ops.rule("chunked", False).astype(bool)
    ok = simple & ~ops.src_none & ops.bare & members_ok & (chunked | (ops.chunks == 1))
    dims = np.diff(ops.region_offsets)
    proven = np.zeros(n, dtype=bool)
    tensor_of = np.where(ops.tensor_none, -1, ops.tensor)
    layouts: dict[tuple, list[int]] = {}  # tensors of one shape and placements: their rows are proven together
    for tensor in sorted_unique(tensor_of[ok]).tolist():
        if tensor == -1 or 0 <= tensor < len(problems):
            problem = problems[max(tensor, 0)]
            layouts.setdefault((tuple(problem.shape), problem.src, problem.dst), []).append(tensor)
    for tensors in layouts.values():
        problem = problems[max(tensors[0], 0)]
        ndim = len(problem.shape)
        mine = ok & member_of(tensor_of, np.array(tensors, dtype=np.int64)) & (dims == ndim)
        picked = np.flatnonzero(mine)
        if not len(picked):
            continue
        region = ops.region[ops.region_offsets[picked][:, None] + np.arange(ndim)]
        shape = np.array(problem.shape, dtype=np.int64)
        lo, hi = region[:, :, 0], region[:, :, 1]
        good = ((0 <= lo) & (lo < hi) & (hi <= shape)).all(axis=1)
        elements = np.prod(np.where(good[:, None], hi - lo, 1), axis=1, dtype=np.int64)
        good &= ops.chunks[picked] <= np.minimum(max_chunks, elements)
        good &= _inside_blocks(ops.src[picked], region, _block_table(problem.blocks("src"), ndim))
        counts, flat = row_ranges(ops.dst_offsets, picked)
        dsts = ops.dsts[flat]
        rows = np.repeat(np.arange(len(picked)), counts)
        room = _inside_blocks(dsts, region[rows], _block_table(problem.blocks("dst"), ndim))
        good &= np.bincount(rows, weights=~room, minlength=len(picked)) == 0
        proven[picked[good]] = True
    return proven


def proven_bundles(operations, layouts_of: list[int], problems: list[ReshardingProblem], max_chunks: int) -> np.ndarray:
    """Per operation: True where it is a bundle that `_check_operation` passes, tested with arrays over every part at
    once (its box inside the tensor and not empty, one chunk, one receiving relay other than the sender on another
    host, the relays a source and a destination device; each part inside the box and not empty, its holder on the
    sending relay's host holding it in its source shard, its needers distinct, at least one, on the receiving relay's
    host with room for it in their destination shards). The others (and any bundle this does not prove) are left to
    the one-by-one check, which names the first fault. `layouts_of[k]`: a number for operation k's tensor's shape,
    placements and cluster (`plan_check._check_operations`'), the same for tensors whose shards are the same."""
    rule = OP_KINDS["bundle"]
    out = np.zeros(len(operations), dtype=bool)
    layouts: dict[int, tuple] = {}  # layout -> (shape, devices per host, source blocks, destination blocks, layout)
    by_dims: dict[int, list[int]] = {}  # candidates (positions in `operations`) by their tensor's number of dims
    for k, op in enumerate(operations):
        if op.kind != "bundle" or op.src is None or not op.parts or not len(op.holders) == len(op.needers) == len(op.parts):
            continue
        if not rule.min_dsts <= len(op.dsts) <= (rule.max_dsts or len(op.dsts)) or len(set(op.dsts)) != len(op.dsts) \
                or op.src in op.dsts or (op.chunks != 1 and not rule.chunked):
            continue
        tensor, layout = op.tensor or 0, layouts_of[k]
        if layout not in layouts:
            if not 0 <= tensor < len(problems):
                continue
            problem = problems[tensor]
            layouts[layout] = (tuple(problem.shape), problem.cluster.devices_per_host, problem.blocks("src"), problem.blocks("dst"), layout)
        shape, per_host, src_blocks, dst_blocks, _ = layouts[layout]
        relay = op.dsts[0]
        if len(op.region) != len(shape) or not all(0 <= a < b <= n for (a, b), n in zip(op.region, shape)):
            continue
        if op.chunks > min(max_chunks, math.prod(b - a for a, b in op.region)) or op.src // per_host == relay // per_host:
            continue
        if op.src in src_blocks and relay in dst_blocks and set(map(len, op.parts)) == {len(shape)}:
            by_dims.setdefault(len(shape), []).append(k)
    for ndim, picked in by_dims.items():
        out[picked] = _parts_hold([operations[k] for k in picked], [layouts[layouts_of[k]] for k in picked], ndim)
    return out


def _parts_hold(ops: list, layouts: list[tuple], ndim: int) -> np.ndarray:
    """`proven_bundles`' tests of each part of `ops` (bundles of tensors of `ndim` dims, already through its per-bundle
    tests; `layouts[k]`: op k's tensor's (shape, devices per host, source and destination blocks, layout number)), all
    parts at once; per bundle, whether every part passes."""
    counts = np.fromiter((len(op.parts) for op in ops), dtype=np.int64, count=len(ops))
    total = int(counts.sum())
    row = np.repeat(np.arange(len(ops)), counts)  # each part's bundle
    try:  # a number past int64 leaves the whole batch to the one-by-one check, which names it
        parts = np.fromiter(chain.from_iterable(chain.from_iterable(chain.from_iterable(op.parts for op in ops))), dtype=np.int64,
                            count=total * ndim * 2).reshape(total, ndim, 2)
        holders = np.fromiter(chain.from_iterable(op.holders for op in ops), dtype=np.int64, count=total)
        sizes = np.fromiter(chain.from_iterable(map(len, op.needers) for op in ops), dtype=np.int64, count=total)
        needers = np.fromiter(chain.from_iterable(chain.from_iterable(op.needers for op in ops)), dtype=np.int64, count=int(sizes.sum()))
    except (ValueError, TypeError, OverflowError):
        return np.zeros(len(ops), dtype=bool)
    region = np.array([op.region for op in ops], dtype=np.int64).reshape(len(ops), ndim, 2)[row]
    lo, hi = parts[:, :, 0], parts[:, :, 1]
    good = ((region[:, :, 0] <= lo) & (lo < hi) & (hi <= region[:, :, 1])).all(axis=1)  # inside the box (so the tensor), not empty
    per_host = np.array([layout[1] for layout in layouts], dtype=np.int64)[row]
    src = np.array([op.src for op in ops], dtype=np.int64)[row]
    relay = np.array([op.dsts[0] for op in ops], dtype=np.int64)[row]
    devices = max((max(blocks, default=0) for layout in layouts for blocks in (layout[2], layout[3])), default=0)
    known = (holders >= 0) & (holders <= devices)  # a number outside every block is no device of the layouts (and
    good &= known  # would read another layout's table below, or overflow its key)
    holders = np.where(known, holders, 0)
    named = (needers >= 0) & (needers <= devices)
    needers = np.where(named, needers, 0)
    src_table, src_of = _block_tables(layouts, 2, ndim, devices)
    dst_table, dst_of = _block_tables(layouts, 3, ndim, devices)
    good &= holders // per_host == src // per_host
    good &= _inside_blocks(src_of[row] * src_table[2] + holders, parts, src_table[:2])
    good &= sizes > 0
    owner = np.repeat(np.arange(total), sizes)  # each needer's part
    order = np.lexsort((needers, owner))
    twice = (owner[order][1:] == owner[order][:-1]) & (needers[order][1:] == needers[order][:-1])
    fine = named & (needers // per_host[owner] == relay[owner] // per_host[owner]) \
        & _inside_blocks(dst_of[row][owner] * dst_table[2] + needers, parts[owner], dst_table[:2])
    good &= np.bincount(owner, weights=~fine, minlength=total) == 0
    good &= np.bincount(owner[order][1:][twice], minlength=total) == 0
    return np.bincount(row, weights=~good, minlength=len(ops)) == 0


def _block_tables(layouts: list[tuple], side: int, ndim: int, devices: int) -> tuple[tuple[np.ndarray, np.ndarray, int], np.ndarray]:
    """((keys, their blocks, span), per entry of `layouts` the number of its layout) for looking up (layout, device)
    pairs, devices 0..`devices` (and those of the layouts' blocks), with `_inside_blocks` at key number * span + device:
    each layout's blocks (`layouts[k][side]`: device -> block) once."""
    numbers: dict[int, int] = {}
    distinct = []
    for layout in layouts:
        if layout[4] not in numbers:
            numbers[layout[4]] = len(distinct)
            distinct.append(layout[side])
    span = max(devices, max((max(b, default=0) for b in distinct), default=0)) + 1
    keys = np.array([n * span + d for n, b in enumerate(distinct) for d in sorted(b)], dtype=np.int64)
    table = np.array([b[d] for b in distinct for d in sorted(b)], dtype=np.int64).reshape(len(keys), ndim, 2)
    return (keys, table, span), np.array([numbers[layout[4]] for layout in layouts], dtype=np.int64)
