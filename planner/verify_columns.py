"""`xmesh-plan verify` of a compact plan (`*.plan.npz`) proved from its columns, without a record per operation.

Reading a plan of 10^6 operations as records (`schemas.plan.Operation`, validated one by one) costs most of what
verify spends on it. Here the proof is made on the file's columns (`plan_compact.read_compact_columns`): the records'
field rules (integers, known kinds and strategies, chunks >= 1, tensors and carriers >= 0), `schemas.plan_check`'s
rules as whole-array tests (ids, order, times, tensors, host order, tags; each copy, send and broadcast's devices
and boxes with `plan_check_arrays.proven_rows`; each bundle's relays, parts, holders and needers, and the shared
messages, with `verify_bundles`), and the replay of every tensor at once as cell counts
(`verify_arrays.painted_summary`). Only the operations the arrays do not prove (all-gathers) are read as records,
checked one by one by `plan_check`'s own functions and replayed from their records' writes and reads.

Only a plan all of that proves gets its report here; for anything else (a plan that states staging, seen in its header
before any column is read, or any doubt)
`verify_compact` answers None and the caller reads the plan as records and verifies it as any plan
(`verify.verify_plan`), so every verdict and every message is the record path's, and a plan this module passes is
one that path passes with the same report.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import get_args

import numpy as np
from pydantic import ValidationError

from xmesh_plan.schemas import files
from xmesh_plan.schemas.files import _existing_or_example
from xmesh_plan.schemas.op_kinds import OP_KINDS, reads, tags_used, writes
from xmesh_plan.schemas.plan import SCHEMA_VERSIONS, Operation, Plan, StrategyName
from xmesh_plan.schemas.plan_check import (MAX_CHUNKS, MAX_TAGS, TOLERANCE_S, _check_host_order, _check_nic_listing,
                                           _check_numbers, _check_operation, _check_schema_version, _Shards, PlanError)
from xmesh_plan.schemas.plan_check_arrays import OpColumns, member_of, proven_rows, sorted_unique
from xmesh_plan.schemas.plan_compact import (COLUMN_KINDS, CompactColumns, CompactPlanError, index_fault, is_compact, read_compact_columns,
                                             row_ranges)
from xmesh_plan.schemas.plan_io import _head
from xmesh_plan.schemas.plan_tensors import is_multi

from .verify_arrays import Boxes, Writes, painted_summary
from .verify_bundles import BundleColumns, BundleFacts, bundle_facts, bundle_writes, carrier_rows, same_sides, task_sides

__all__ = ["verify_compact"]

_TASK_FIELDS = {"id", "tensor", "strategy", "start_s", "end_s"}  # what the proof reads of the tasks (the rest is checked)


def _plan_head(columns: CompactColumns) -> Plan | None:
    """The plan less its tasks and operations (its host order kept), validated as a record plan's fields are."""
    if columns.fields.get("schema_version") not in SCHEMA_VERSIONS:
        return None
    try:
        return Plan.model_validate({**columns.fields, "tasks": [], "operations": [], "host_order": columns.host_order_rows()})
    except (ValidationError, CompactPlanError):
        return None


def _records_valid(ops: dict, tasks: dict) -> bool:
    """What validating each row as a record checks beyond integers and numbers: known kinds and strategies, chunks
    >= 1, tensor indices and carriers >= 0."""
    kinds, strategies = ops["kind"]["names"], tasks["strategy"]["names"]
    return (set(kinds) <= set(OP_KINDS) and set(strategies) <= set(get_args(StrategyName))
            and bool((ops["chunks"]["values"] >= 1).all()) and bool((ops["carrier"]["values"][~ops["carrier"]["none"]] >= 0).all())
            and all((t["tensor"]["values"][~t["tensor"]["none"]] >= 0).all() for t in (ops, tasks)))


def _op_columns(ops: dict) -> OpColumns:
    bare = np.logical_and.reduce([np.diff(ops[f]["offsets"]) == 0 for f in ("parts", "holders", "needers")])
    return OpColumns(ops["kind"]["values"], ops["kind"]["names"], ops["src"]["values"], ops["src"]["none"], ops["dsts"]["offsets"],
                     ops["dsts"]["values"], ops["region"]["offsets"], ops["region"]["values"], ops["chunks"]["values"],
                     ops["tensor"]["values"], ops["tensor"]["none"], bare)


def _ids_order_numbers(head: Plan, ops: dict, tasks: dict, op_columns: OpColumns) -> bool:
    """`check_plan`'s ids, order, times and host order (`_check_ids_and_order`, `_check_numbers`), on arrays."""
    task_ids, op_ids = tasks["id"]["values"], ops["id"]["values"]
    start, end = ops["start_s"]["values"], ops["end_s"]["values"]
    task = ops["task"]["values"]
    taskless = op_columns.rule("taskless", False)
    t_start, t_end = tasks["start_s"]["values"], tasks["end_s"]["values"]
    ok = len(sorted_unique(task_ids)) == len(task_ids) and len(sorted_unique(op_ids)) == len(op_ids)
    ok = ok and bool((member_of(task, task_ids) | ((task == -1) & taskless)).all())
    ok = ok and bool((np.isfinite(start) & np.isfinite(end) & (end + TOLERANCE_S >= start) & (start >= 0)).all())
    ok = ok and not ((start[1:] < start[:-1]) | ((start[1:] == start[:-1]) & (op_ids[1:] < op_ids[:-1]))).any()
    ok = ok and bool((np.isfinite(t_start) & np.isfinite(t_end) & (t_start >= 0) & (t_end >= 0) & (t_end + TOLERANCE_S >= t_start)).all())
    ok = ok and (not len(end) or head.predicted_seconds >= end.max() - TOLERANCE_S)
    if not ok:
        return False
    try:
        _check_host_order(head, set(task_ids.tolist()))
        _check_numbers(head)  # the plan's own figures (its tables' times are checked above)
    except PlanError:
        return False
    return True


def _tensors(head: Plan, ops: dict, tasks: dict) -> bool:
    """`_check_tensor_indices`: a single-tensor plan names no tensor; a multi-tensor one names one in range on every
    task and operation, an operation its task's."""
    if not is_multi(head):
        return bool(ops["tensor"]["none"].all() and tasks["tensor"]["none"].all())
    count = len(head.problem.tensors)
    if any(t["tensor"]["none"].any() or (t["tensor"]["values"] >= count).any() for t in (ops, tasks)):
        return False
    ids, order = tasks["id"]["values"], np.argsort(tasks["id"]["values"], kind="stable")
    at = np.clip(np.searchsorted(ids[order], ops["task"]["values"]), 0, max(len(ids) - 1, 0))
    if not len(ids):
        return True
    known = ids[order][at] == ops["task"]["values"]
    return bool((~known | (tasks["tensor"]["values"][order][at] == ops["tensor"]["values"])).all())


def _records(columns: CompactColumns, rows: np.ndarray) -> list[Operation] | None:
    """The operations at `rows` as validated records (None where one is not)."""
    if not len(rows):
        return []
    try:
        return [Operation.model_validate(op) for op in columns.operation_rows(rows)]
    except (ValidationError, CompactPlanError):
        return None


def _records_check(head: Plan, records: list[Operation]) -> bool:
    """`check_plan`'s one-by-one checks of the operations the arrays did not prove (`records`, none of them carried:
    `carrier_rows` proves every carried bundle from the columns)."""
    problems = head.problem.tensor_problems()
    shards: dict = {}
    try:
        for op in records:
            if op.tensor not in shards:
                shards[op.tensor] = _Shards(problems[op.tensor or 0])
            _check_operation(op, shards[op.tensor])
        _check_nic_listing(head.model_copy(update={"operations": tuple(records)}))
    except PlanError:
        return False
    return True


def _shared_messages(head: Plan, ops: dict, op_columns: OpColumns, facts: BundleFacts) -> bool:
    """`carrier_fault` and `_check_shared_sides` on the columns: each carried bundle's task is listed on its carrier's
    task's NIC sides."""
    none = ops["carrier"]["none"]
    heads = carrier_rows(op_columns, ops["id"]["values"], ops["carrier"]["values"], none, facts,
                         [p.itemsize for p in head.problem.tensor_problems()])
    task = ops["task"]["values"]
    return heads is not None and same_sides(task_sides([o.tasks for o in head.host_order]), task[~none], task[heads])


def _nic_listing_and_tags(head: Plan, ops: dict, op_columns: OpColumns, proven: np.ndarray, tags: np.ndarray) -> bool:
    """`_check_nic_listing` for the proven rows (an operation between hosts has its task in host_order: a copy, send
    or broadcast whose devices are on two hosts, every proved bundle) and the plan's message tags (`tags`: each row's)."""
    host_of = head.problem.cluster.host_of
    owner = op_columns.dst_owner
    crosses = np.bincount(owner[host_of(op_columns.dsts) != host_of(op_columns.src[owner])], minlength=len(op_columns.kind)) > 0
    crosses |= op_columns.rule("pattern", "") == "bundle"  # relays on two hosts (`bundle_facts`)
    listed = np.concatenate([np.array(o.tasks, dtype=np.int64) for o in head.host_order] or [np.zeros(0, np.int64)])
    if not member_of(ops["task"]["values"][crosses & proven], listed).all():
        return False
    return int(tags.sum()) <= MAX_TAGS


def _index_holds(columns: CompactColumns, op_columns: OpColumns, tags: np.ndarray) -> bool:
    """The file's per-device index and first tags are what its operations table gives (`plan_compact.index_fault`;
    `tags`: each row's): a file where they differ goes to the record path, which refuses it naming the member."""
    tensors = np.where(op_columns.tensor_none, 0, op_columns.tensor)
    return index_fault(columns.members, len(tags), tags.tolist(), tensors.tolist()) is None


REPLAY_WRITES = 1 << 20  # writes replayed at a time (tensors together, a tensor whole): about 300 MiB of arrays


def _write_counts(op_columns: OpColumns, bundles: BundleColumns, proven: np.ndarray, facts: BundleFacts) -> np.ndarray:
    """Per row: how many (receiver, box) writes the replay paints for it (a record's counted as one)."""
    per_bundle = bundles.inner[bundles.needer_offsets[1:]] - bundles.inner[bundles.needer_offsets[:-1]]
    return np.where(proven, np.diff(op_columns.dst_offsets), np.where(facts.proven, per_bundle, 1))


def _regions(op_columns: OpColumns, rows: np.ndarray, rank: int) -> Boxes | None:
    """The regions of `rows`, padded to `rank` dims (None where one has more)."""
    dims = np.diff(op_columns.region_offsets)[rows]
    lo, hi = np.zeros((len(rows), rank), np.int64), np.ones((len(rows), rank), np.int64)
    if len(rows) and dims.max() > rank:
        return None
    for r in np.unique(dims).tolist():
        at = np.flatnonzero(dims == r)
        pairs = op_columns.region[op_columns.region_offsets[rows[at]][:, None] + np.arange(r)]
        lo[at, :r], hi[at, :r] = pairs[:, :, 0], pairs[:, :, 1]
    return Boxes(np.where(op_columns.tensor_none, 0, op_columns.tensor)[rows], lo, hi)


def _record_writes(records: dict[int, Operation], base: int, rank: int) -> tuple[Boxes, list[np.ndarray], list]:
    """The records' boxes (their parts, what they write and read; numbered from `base`), their writes (box, device,
    weight, writer) and their reads from destination shards (position, device, box)."""
    boxes, box, device, weight, writer, dst_reads = [], [], [], [], [], []
    for row, op in records.items():
        boxes.extend((op.tensor or 0, part) for part in op.parts)
        for d, written, own in writes(op):
            for piece, sign in [(written, 1)] + ([(own, -1)] if own is not None and all(a < b for a, b in own) else []):
                box.append(base + len(boxes)), boxes.append((op.tensor or 0, piece)), device.append(d), weight.append(sign), writer.append(row)
        for d, shard, read in reads(op):
            if shard == "dst" and all(a < b for a, b in read):
                dst_reads.append((row, d, base + len(boxes)))
                boxes.append((op.tensor or 0, read))
    return (Boxes.of([t for t, _ in boxes], [b for _, b in boxes], rank), [np.array(v, dtype=np.int64) for v in (box, device, weight, writer)],
            dst_reads)


def _replay_tensors(problems: list, first: int, op_columns: OpColumns, bundles: BundleColumns, rows: np.ndarray,
                    proven: np.ndarray, facts: BundleFacts, records: dict[int, Operation],
                    times: tuple[np.ndarray, np.ndarray]) -> tuple[int, set[int]] | None:
    """`painted_summary` of the tensors `problems` (tensors `first`, `first` + 1, ...; their rows `rows`): a proven
    copy, send or broadcast writes its region to every receiver (it reads no destination shard), a proved bundle
    each part to each of its needers (`bundle_writes`), the others what their records (`records`, by row) say."""
    rank = max(len(p.shape) for p in problems)
    regions = _regions(op_columns, rows, rank)
    if regions is None:
        return None
    simple = np.flatnonzero(proven[rows])
    lengths, flat = row_ranges(op_columns.dst_offsets, rows[simple])
    boxes, box, device, writer = [regions], [np.repeat(simple, lengths)], [op_columns.dsts[flat]], [rows[np.repeat(simple, lengths)]]
    dims = np.diff(op_columns.region_offsets)[rows]
    for r in np.unique(dims[facts.proven[rows]]).tolist():
        owner, lo, hi, part_of, needer = bundle_writes(bundles, rows[facts.proven[rows] & (dims == r)], r)
        box.append(sum(len(b.tensor) for b in boxes) + part_of), device.append(needer), writer.append(owner[part_of])
        boxes.append(Boxes(np.where(op_columns.tensor_none, 0, op_columns.tensor)[owner],
                           np.pad(lo, ((0, 0), (0, rank - r))), np.pad(hi, ((0, 0), (0, rank - r)), constant_values=1)))
    mine = {row: op for row, op in records.items() if 0 <= (op.tensor or 0) - first < len(problems)}
    record_boxes, ints, dst_reads = _record_writes(mine, sum(len(b.tensor) for b in boxes), rank)
    every = Boxes.joined([*boxes, record_boxes])
    weight = np.concatenate([np.ones(sum(map(len, box)), np.int64), ints[2]])
    written = Writes(np.concatenate([*box, ints[0]]), np.concatenate([*device, ints[1]]), weight, np.concatenate([*writer, ints[3]]))
    return painted_summary(problems, Boxes(every.tensor - first, every.lo, every.hi), written, dst_reads, times[0], times[1])


def _replay(head: Plan, op_columns: OpColumns, bundles: BundleColumns, times: tuple[np.ndarray, np.ndarray], proven: np.ndarray,
            facts: BundleFacts, records: dict[int, Operation], on_count: Callable[[int, int], None]) -> tuple[int, set[int]] | None:
    """Every tensor's writes painted on its destination cells, tensors of about `REPLAY_WRITES` writes together
    (`_replay_tensors`)."""
    problems = head.problem.tensor_problems()
    tensor = np.where(op_columns.tensor_none, 0, op_columns.tensor)
    per_tensor = np.bincount(tensor, weights=_write_counts(op_columns, bundles, proven, facts), minlength=len(problems))
    cuts = np.searchsorted(np.cumsum(per_tensor), np.arange(REPLAY_WRITES, per_tensor.sum(), REPLAY_WRITES), side="right")
    cells, devices = 0, set()
    for start, stop in zip([0, *cuts.tolist()], [*cuts.tolist(), len(problems)]):
        if start >= stop:
            continue
        on_count(start, len(problems))
        rows = np.flatnonzero((tensor >= start) & (tensor < stop))
        summary = _replay_tensors(problems[start:stop], start, op_columns, bundles, rows, proven, facts, records, times)
        if summary is None:
            return None
        cells += summary[0]
        devices |= summary[1]
    on_count(len(problems), len(problems))
    return cells, devices


def verify_compact(path: str | os.PathLike, on_stage: Callable[[str], None],
                   on_count: Callable[[int, int], None]) -> tuple[Plan, int, int, set[int]] | None:
    """(the plan less its tasks and operations, operations, destination cells, destination devices) of the compact
    plan in `path` where its columns prove it (see the module docstring); None for any other file or plan."""
    if not is_compact(_head(path)):
        return None
    path = _existing_or_example(path)
    try:
        if os.path.getsize(path) > files.MAX_COMPACT_FILE_BYTES:
            return None
        on_stage("reading columns")  # none of a plan that states staging: the record path checks what it states
        columns = read_compact_columns(path, {"operations": set(COLUMN_KINDS["operations"]), "tasks": _TASK_FIELDS},
                                       lambda fields: fields.get("staging") is None)
    except (CompactPlanError, OSError):
        return None
    if columns is None:
        return None
    ops, tasks = columns.tables["operations"], columns.tables["tasks"]
    if not _records_valid(ops, tasks):
        return None
    head = _plan_head(columns)
    if head is None:
        return None
    try:
        _check_schema_version(head)
    except PlanError:
        return None
    op_columns = _op_columns(ops)
    on_stage(f"checking {len(op_columns.kind):,} operations")
    if not (_ids_order_numbers(head, ops, tasks, op_columns) and _tensors(head, ops, tasks)):
        return None
    problems = head.problem.tensor_problems()
    proven = proven_rows(op_columns, problems, MAX_CHUNKS)
    bundles = BundleColumns.of(ops, columns.box_table())
    facts = bundle_facts(op_columns, bundles, problems, head.problem.cluster)
    others = np.flatnonzero(~(proven | facts.proven))
    records = _records(columns, others)
    if records is None or not _records_check(head, records) or not _shared_messages(head, ops, op_columns, facts):
        return None
    tags = op_columns.tag_counts(proven) + np.where(facts.proven, facts.tags, 0)
    tags[others] = [tags_used(op) for op in records]
    if not _nic_listing_and_tags(head, ops, op_columns, proven | facts.proven, tags):
        return None
    if not _index_holds(columns, op_columns, tags):
        return None
    on_stage(f"replaying {len(problems):,} tensor{'s' if len(problems) != 1 else ''}")
    summary = _replay(head, op_columns, bundles, (ops["start_s"]["values"], ops["end_s"]["values"]), proven, facts,
                      dict(zip(others.tolist(), records)), on_count)
    if summary is None:
        return None
    return head, len(op_columns.kind), summary[0], summary[1]
