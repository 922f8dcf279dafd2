"""`xmesh-plan verify` of a compact plan (`*.plan.npz`) proved from its columns, without a record per operation.

Reading a plan of 10^6 operations as records (`schemas.plan.Operation`, validated one by one) costs most of what
verify spends on it. Where every operation is a copy, send or broadcast, sharing no message (`carrier`), and the
plan states no staging, the whole proof is made on the file's columns (`plan_compact.read_compact_columns`): the
records' field rules (integers, known kinds and strategies, chunks >= 1, tensors >= 0), `schemas.plan_check`'s
rules as whole-array tests (ids, order, times, tensors, host order, each operation's devices and boxes with
`plan_check_arrays.proven_rows`, tags), and the replay as difference arrays (`verify_arrays.painted_summary`).

Only a plan all of that proves gets its report here; for anything else `verify_compact` answers None and the
caller reads the plan as records and verifies it as any plan (`verify.verify_plan`), so every verdict and every
message is the record path's, and a plan this module passes is one that path passes with the same report.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import get_args

import numpy as np
from pydantic import ValidationError

from xmesh_plan.schemas import files
from xmesh_plan.schemas.files import _existing_or_example
from xmesh_plan.schemas.op_kinds import OP_KINDS
from xmesh_plan.schemas.plan import SCHEMA_VERSIONS, Plan, StrategyName
from xmesh_plan.schemas.plan_check import (MAX_CHUNKS, MAX_TAGS, TOLERANCE_S, _check_host_order, _check_numbers,
                                           _check_schema_version, PlanError)
from xmesh_plan.schemas.plan_check_arrays import OpColumns, member_of, proven_rows, sorted_unique
from xmesh_plan.schemas.plan_compact import COLUMN_KINDS, CompactColumns, CompactPlanError, is_compact, read_compact_columns
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
    >= 1, tensor indices >= 0; and, for this proof, no shared messages and no all-gathers or bundles."""
    kinds, strategies = ops["kind"]["names"], tasks["strategy"]["names"]
    return (set(kinds) <= set(OP_KINDS) and set(strategies) <= set(get_args(StrategyName))
            and (ops["chunks"]["values"] >= 1).all() and ops["carrier"]["none"].all()
            and all((t["tensor"]["values"][~t["tensor"]["none"]] >= 0).all() for t in (ops, tasks))
            and all(int(ops[f]["offsets"][-1]) == 0 for f in ("parts", "holders", "needers")))


def _op_columns(ops: dict) -> OpColumns:
    return OpColumns(ops["kind"]["values"], ops["kind"]["names"], ops["src"]["values"], ops["src"]["none"], ops["dsts"]["offsets"],
                     ops["dsts"]["values"], ops["region"]["offsets"], ops["region"]["values"], ops["chunks"]["values"],
                     ops["tensor"]["values"], ops["tensor"]["none"], np.ones(len(ops["kind"]["values"]), dtype=bool))


def _ids_order_numbers(head: Plan, ops: dict, tasks: dict, op_columns: OpColumns) -> bool:
    """`check_plan`'s ids, order, times and host order (`_check_ids_and_order`, `_check_numbers`), on arrays."""
    task_ids, op_ids = tasks["id"]["values"], ops["id"]["values"]
    start, end = ops["start_s"]["values"], ops["end_s"]["values"]
    task = ops["task"]["values"]
    taskless = np.array([OP_KINDS[k].taskless for k in op_columns.kinds] or [False])[op_columns.kind]
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


def _nic_listing_and_tags(head: Plan, ops: dict, op_columns: OpColumns) -> bool:
    """`_check_nic_listing` (an operation between hosts has its task in host_order) and the plan's message tags."""
    host_of = head.problem.cluster.host_of
    owner = np.repeat(np.arange(len(op_columns.kind)), np.diff(op_columns.dst_offsets))
    crosses = np.bincount(owner[host_of(op_columns.dsts) != host_of(op_columns.src[owner])], minlength=len(op_columns.kind)) > 0
    listed = np.concatenate([np.array(o.tasks, dtype=np.int64) for o in head.host_order] or [np.zeros(0, np.int64)])
    if not member_of(ops["task"]["values"][crosses], listed).all():
        return False
    local = np.array([OP_KINDS[k].pattern == "local" for k in op_columns.kinds] or [False])[op_columns.kind]
    return int(op_columns.chunks[~local].sum()) <= MAX_TAGS


def _replay(head: Plan, op_columns: OpColumns, on_count: Callable[[int, int], None]) -> tuple[int, set[int]] | None:
    """Each tensor's writes painted on its destination cells (`painted_summary`); no copy, send or broadcast reads a
    destination shard, so nothing is read before it lands."""
    problems = head.problem.tensor_problems()
    tensor = np.where(op_columns.tensor_none, 0, op_columns.tensor)
    count = np.diff(op_columns.dst_offsets)
    cells, devices = 0, set()
    for index, problem in enumerate(problems):
        on_count(index, len(problems))
        rows = np.flatnonzero(tensor == index)
        ndim = len(problem.shape)
        region = op_columns.region[op_columns.region_offsets[rows][:, None] + np.arange(ndim)] if len(rows) else np.zeros((0, ndim, 2), np.int64)
        n = count[rows]
        at = op_columns.dst_offsets[rows]
        flat = np.repeat(at - (np.cumsum(n) - n), n) + np.arange(int(n.sum()))
        position = np.repeat(np.arange(len(rows)), n)
        written = Writes(op_columns.dsts[flat], region[position], np.ones(len(flat), dtype=np.int64), position)
        summary = painted_summary(problem, region, written, [], np.zeros(len(rows)), np.zeros(len(rows)))
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
        on_stage("reading columns")
        columns = read_compact_columns(path, {"operations": set(COLUMN_KINDS["operations"]), "tasks": _TASK_FIELDS})
    except (CompactPlanError, OSError):
        return None
    ops, tasks = columns.tables["operations"], columns.tables["tasks"]
    if not _records_valid(ops, tasks):
        return None
    head = _plan_head(columns)
    if head is None or head.staging is not None:
        return None
    try:
        _check_schema_version(head)
    except PlanError:
        return None
    op_columns = _op_columns(ops)
    on_stage(f"checking {len(op_columns.kind):,} operations")
    if not (_ids_order_numbers(head, ops, tasks, op_columns) and _tensors(head, ops, tasks)):
        return None
    if not (proven_rows(op_columns, head.problem.tensor_problems(), MAX_CHUNKS).all() and _nic_listing_and_tags(head, ops, op_columns)):
        return None
    names = head.problem.tensor_problems()
    on_stage(f"replaying {len(names):,} tensor{'s' if len(names) != 1 else ''}")
    summary = _replay(head, op_columns, on_count)
    if summary is None:
        return None
    return head, len(op_columns.kind), summary[0], summary[1]
