"""`xmesh-plan verify` of a compact plan (`*.plan.npz`) proved from its columns, without a record per operation.

Reading a plan of 10^6 operations as records (`schemas.plan.Operation`, validated one by one) costs most of what
verify spends on it. Here the proof is made on the file's columns (`plan_compact.read_compact_columns`): the records'
field rules (integers, known kinds and strategies, chunks >= 1, tensors and carriers >= 0), `schemas.plan_check`'s
rules as whole-array tests (ids, order, times, tensors, host order, tags; each copy, send and broadcast's devices
and boxes with `plan_check_arrays.proven_rows`), and the replay as difference arrays (`verify_arrays.painted_summary`).
Only the operations the arrays do not prove (all-gathers, bundles, bundles sharing a message) are read as records,
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
from xmesh_plan.schemas.carriers import carrier_fault
from xmesh_plan.schemas.op_kinds import OP_KINDS, reads, tags_used, writes
from xmesh_plan.schemas.plan import SCHEMA_VERSIONS, Operation, Plan, StrategyName
from xmesh_plan.schemas.plan_check import (MAX_CHUNKS, MAX_TAGS, TOLERANCE_S, _check_host_order, _check_nic_listing,
                                           _check_numbers, _check_operation, _check_schema_version, _check_shared_sides,
                                           _Shards, PlanError)
from xmesh_plan.schemas.plan_check_arrays import OpColumns, member_of, proven_rows, sorted_unique
from xmesh_plan.schemas.plan_compact import (COLUMN_KINDS, CompactColumns, CompactPlanError, index_fault, is_compact, read_compact_columns,
                                             row_ranges)
from xmesh_plan.schemas.plan_io import _head
from xmesh_plan.schemas.plan_tensors import is_multi

from .verify_arrays import Writes, painted_summary

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


def _records_check(head: Plan, records: list[Operation], rows: np.ndarray, carried: np.ndarray) -> bool:
    """`check_plan`'s one-by-one checks of the operations the arrays did not prove (`rows`, as `records`), and of the
    shared messages (`carried`: the rows with a carrier). `carrier_fault` looks at a bundle with a carrier, the
    operation listed before it and its carrier: all of them must be among the records, so the records' order
    says what the plan's does (a carrier that is not a record is refused by it as by the whole plan)."""
    problems = head.problem.tensor_problems()
    shards: dict = {}
    if not np.isin(np.concatenate((carried, carried - 1)), rows).all():
        return False
    part = head.model_copy(update={"operations": tuple(records)})  # the records alone, in plan order
    try:
        for op in records:
            if op.tensor not in shards:
                shards[op.tensor] = _Shards(problems[op.tensor or 0])
            _check_operation(op, shards[op.tensor])
        if carrier_fault(records, [p.itemsize for p in problems], max(p.itemsize for p in problems)) is not None:
            return False
        _check_shared_sides(part)
        _check_nic_listing(part)
    except PlanError:
        return False
    return True


def _nic_listing_and_tags(head: Plan, ops: dict, op_columns: OpColumns, proven: np.ndarray, tags: np.ndarray) -> bool:
    """`_check_nic_listing` for the proven rows (an operation between hosts has its task in host_order) and the
    plan's message tags (`tags`: each row's)."""
    host_of = head.problem.cluster.host_of
    owner = op_columns.dst_owner
    crosses = np.bincount(owner[host_of(op_columns.dsts) != host_of(op_columns.src[owner])], minlength=len(op_columns.kind)) > 0
    listed = np.concatenate([np.array(o.tasks, dtype=np.int64) for o in head.host_order] or [np.zeros(0, np.int64)])
    if not member_of(ops["task"]["values"][crosses & proven], listed).all():
        return False
    return int(tags.sum()) <= MAX_TAGS


def _index_holds(columns: CompactColumns, op_columns: OpColumns, tags: np.ndarray) -> bool:
    """The file's per-device index and first tags are what its operations table gives (`plan_compact.index_fault`;
    `tags`: each row's): a file where they differ goes to the record path, which refuses it naming the member."""
    tensors = np.where(op_columns.tensor_none, 0, op_columns.tensor)
    return index_fault(columns.members, len(tags), tags.tolist(), tensors.tolist()) is None


def _joined(simple_rows: np.ndarray, listed: list) -> np.ndarray:
    """The column rows, then the records' values (`listed`) in the same shape: one int64 array."""
    return np.concatenate((simple_rows.astype(np.int64).reshape(-1, *simple_rows.shape[1:]),
                           np.array(listed, dtype=np.int64).reshape(-1, *simple_rows.shape[1:])))


def _replay(head: Plan, op_columns: OpColumns, times: tuple[np.ndarray, np.ndarray], records: dict[int, Operation],
            on_count: Callable[[int, int], None]) -> tuple[int, set[int]] | None:
    """Each tensor's writes painted on its destination cells (`painted_summary`): a proven copy, send or broadcast's
    from the columns (it reads no destination shard), the others' from their records (`records`, by row)."""
    problems = head.problem.tensor_problems()
    tensor = np.where(op_columns.tensor_none, 0, op_columns.tensor)
    cells, devices = 0, set()
    for index, problem in enumerate(problems):
        on_count(index, len(problems))
        rows = np.flatnonzero(tensor == index)
        ndim = len(problem.shape)
        region = op_columns.region[op_columns.region_offsets[rows][:, None] + np.arange(ndim)] if len(rows) else np.zeros((0, ndim, 2), np.int64)
        simple = np.array([r not in records for r in rows.tolist()], dtype=bool) if records else np.ones(len(rows), dtype=bool)
        lengths, flat = row_ranges(op_columns.dst_offsets, rows[simple])
        position = np.repeat(np.flatnonzero(simple), lengths)
        parts, device, box, weight, writer, dst_reads = [], [], [], [], [], []  # the records', as lists: one array each below
        for k in np.flatnonzero(~simple).tolist():
            op = records[int(rows[k])]
            parts.extend(op.parts)
            for d, written, own in writes(op):
                pieces = [(written, 1)] + ([(own, -1)] if own is not None and all(a < b for a, b in own) else [])
                for piece, sign in pieces:
                    device.append(d), box.append(piece), weight.append(sign), writer.append(k)
            dst_reads.extend((k, d, read) for d, shard, read in reads(op) if shard == "dst" and all(a < b for a, b in read))
        written = Writes(_joined(op_columns.dsts[flat], device), _joined(region[position], box),
                         _joined(np.ones(len(flat), np.int64), weight), _joined(position, writer))
        summary = painted_summary(problem, _joined(region, parts), written, dst_reads, times[0][rows], times[1][rows])
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
    proven = proven_rows(op_columns, head.problem.tensor_problems(), MAX_CHUNKS)
    others = np.flatnonzero(~proven)
    records = _records(columns, others)
    carried = np.flatnonzero(~ops["carrier"]["none"])
    if records is None or not _records_check(head, records, others, carried):
        return None
    tags = op_columns.tag_counts(proven)
    tags[others] = [tags_used(op) for op in records]
    if not _nic_listing_and_tags(head, ops, op_columns, proven, tags):
        return None
    if not _index_holds(columns, op_columns, tags):
        return None
    names = head.problem.tensor_problems()
    on_stage(f"replaying {len(names):,} tensor{'s' if len(names) != 1 else ''}")
    summary = _replay(head, op_columns, (ops["start_s"]["values"], ops["end_s"]["values"]), dict(zip(others.tolist(), records)), on_count)
    if summary is None:
        return None
    return head, len(op_columns.kind), summary[0], summary[1]
