"""Plan files in either format: JSON (`Plan.to_json`, readable, for small plans) or compact (`schemas.plan_compact`,
numpy columns with a per-device index, for plans of up to millions of operations). Readers tell them apart by the
file's first bytes; writers pick by the output's name (`*.npz` is compact) unless told.

>>> format_for("x.plan.npz"), format_for("x.plan.json")
('compact', 'json')
"""

from __future__ import annotations

import os
import stat
from operator import itemgetter
from typing import Any, BinaryIO, Callable, get_args

from pydantic import TypeAdapter, ValidationError

from . import files
from .files import DataFileError, _existing_or_example, parse_data, read_text_file, write_atomic
from .limits import quoted
from .op_kinds import first_tags as number_tags
from .plan import SCHEMA_VERSIONS, AnyProblem, HostOrder, Operation, Plan, Staging, UnitTask, PlanFileError, plan_from_data, read_plan_file
from .plan_compact import (CompactPlanError, DeviceOps, _op_devices, compact_bytes, is_compact, read_compact_data, read_device_data,
                           shared_ids)
from .validation import describe_validation_error

__all__ = ["FORMATS", "DeviceOps", "file_format", "format_for", "plan_file_bytes", "read_plan_data", "read_plan_head", "read_plan_ops",
           "write_plan_file"]

FORMATS: dict[str, tuple[Callable[[Plan], bytes], str]] = {
    "json": (lambda plan: plan.to_json().encode(), "MAX_FILE_BYTES"),
    "compact": (compact_bytes, "MAX_COMPACT_FILE_BYTES"),
}
"""format name -> (the plan's bytes in it, the `schemas.files` limit on what its readers take)."""
_FIX = "pass a plan written by `xmesh-plan compile -o NAME.plan.npz` (or copy it again)"


def format_for(path: str | os.PathLike) -> str:
    """`compact` for a name ending in `.npz`, else `json`."""
    return "compact" if os.fspath(path).endswith(".npz") else "json"


def plan_file_bytes(plan: Plan, fmt: str) -> bytes:
    """The plan's file in format `fmt`; DataFileError where its readers would refuse the size."""
    encode, limit_name = FORMATS[fmt]
    limit = getattr(files, limit_name)
    try:
        data = encode(plan)
    except CompactPlanError as err:
        raise DataFileError(f"the plan cannot be written compact: {err}") from None
    if len(data) > limit:
        bigger = "; write it compact instead (-o NAME.plan.npz)" if fmt == "json" else "; split the problem into smaller transfers"
        raise DataFileError(f"the plan would be {len(data) / 2**20:,.0f} MiB as {fmt}, above the {limit // 2**20:,} MiB its readers take, "
                            f"so it was not written{bigger}")
    return data


def write_plan_file(path: str | os.PathLike, plan: Plan, fmt: str | None = None) -> None:
    """Write `plan` to `path` (`files.write_atomic`) in `fmt`, by default the one its name says (`format_for`)."""
    write_atomic(path, plan_file_bytes(plan, fmt or format_for(path)))


def _head(path: str | os.PathLike) -> bytes:
    """The first bytes of a regular file; nothing for a pipe or device (read once, as text: `verify <(cat plan.json)`)."""
    try:
        path = _existing_or_example(path)
        if not stat.S_ISREG(os.stat(path).st_mode):
            return b""
        with open(path, "rb") as handle:
            return handle.read(4)
    except OSError:
        return b""  # read_text_file names the problem


def read_plan_data(path: str | os.PathLike) -> Any:
    """A plan file's content as plain data (what its JSON states), either format; PlanFileError otherwise."""
    if is_compact(_head(path)):
        try:  # records made a chunk at a time: a million operations never sit in memory as dicts and records both
            return _compact(path, read_compact_data, _RECORDS)
        except ValidationError:  # as plain data instead, so the plan's validation names the field as for a JSON plan
            return _compact(path, read_compact_data)
    try:
        return parse_data(read_text_file(path, "plan"), path)
    except DataFileError as err:
        raise PlanFileError(f"{err}; pass a plan written by `xmesh-plan compile`") from None


def _compact(path: str | os.PathLike, read: Callable, *args: Any, handle: BinaryIO | None = None) -> Any:
    """`read(path, *args)` on a compact file within the size limit (`read(handle, *args)` on the file `handle`, open
    from `path`, where given); every failure a one-line PlanFileError."""
    path = path if handle is not None else _existing_or_example(path)
    size = os.fstat(handle.fileno()).st_size if handle is not None else os.path.getsize(path)
    if size > files.MAX_COMPACT_FILE_BYTES:
        raise PlanFileError(f"{quoted(path)}: more than {files.MAX_COMPACT_FILE_BYTES // 2**20:,} MiB, the most a compact plan may be; "
                            "split the problem into smaller transfers")
    try:
        return read(path if handle is None else handle, *args)
    except (CompactPlanError, OSError) as err:
        raise PlanFileError(f"{quoted(path)}: not a readable compact plan ({err}); {_FIX}") from None


_PROBLEM = TypeAdapter(AnyProblem)
_RECORDS = {"operations": lambda rows, integral: _operations(rows, integral),
            "tasks": lambda rows, integral: _tasks(rows, integral),
            "host_order": lambda rows, integral: map(HostOrder.model_validate, rows)}
"""table -> the records of a chunk of a compact file's rows (`read_compact_data`): operations as they are read, so that
the boxes and devices a model's repeated layers share stay one object each (`_operations`)."""


_OP_KINDS = frozenset(get_args(Operation.model_fields["kind"].annotation))
_OP_MINIMA = tuple((name, g.ge) for name, f in Operation.model_fields.items() for g in f.metadata if hasattr(g, "ge"))
_OP_FIELDS = frozenset(Operation.model_fields)


def _valid_as_read(rows: list[dict], named: str = "kind", names: frozenset = _OP_KINDS,
                   minima: tuple = _OP_MINIMA) -> bool:
    """What validating each row of `rows`, read from a compact file whose integers are integers (`stores_integers`),
    checks: its `named` field is one of `names` and its bounded fields (`minima`: `ge`) are within bounds where given;
    a field at a time. Operations by default; tasks with their strategies (`_tasks`)."""
    if not set(map(itemgetter(named), rows)) <= names:
        return False
    for name, least in minima:
        given = [value for value in map(itemgetter(name), rows) if value is not None]
        if given and min(given) < least:
            return False
    return True


def _trusted(model, fields: frozenset, row: dict):
    """The record `model.model_validate(row)` makes, for `row` a row of a compact file `_valid_as_read` passes (its
    values already the record's types: ints, floats, tuples): what `BaseModel.model_construct` sets, without its loop
    over the fields (a rank reads tens of thousands of operations)."""
    record = model.__new__(model)
    object.__setattr__(record, "__dict__", row)
    object.__setattr__(record, "__pydantic_fields_set__", set(fields))
    object.__setattr__(record, "__pydantic_extra__", None)
    object.__setattr__(record, "__pydantic_private__", None)
    return record


def _trusted_operation(op: dict) -> Operation:
    """`_trusted` for an operation."""
    return _trusted(Operation, _OP_FIELDS, op)


def _operations(ops: list[dict], integral: bool) -> tuple[Operation, ...]:
    """The rows `ops` of a compact file as records: checked all at once where the file stores integers as integers
    (`integral`) and every row passes `_valid_as_read`, else validated one by one (whose first error is the message)."""
    if integral and _valid_as_read(ops):
        return tuple(map(_trusted_operation, ops))
    return tuple(Operation.model_validate(op) for op in ops)


_TASK_STRATEGIES = frozenset(get_args(UnitTask.model_fields["strategy"].annotation))
_TASK_MINIMA = tuple((name, g.ge) for name, f in UnitTask.model_fields.items() for g in f.metadata if hasattr(g, "ge"))
_TASK_FIELDS = frozenset(UnitTask.model_fields)


def _tasks(rows: list[dict], integral: bool) -> list[UnitTask]:
    """The rows of a compact file's task table as records, as `_operations` makes operations: as read (their boxes and
    devices shared between a model's repeated layers) where the file stores integers as integers and every row's
    strategy is known and its bounded fields within bounds, else validated one by one."""
    if integral and _valid_as_read(rows, "strategy", _TASK_STRATEGIES, _TASK_MINIMA):
        return [_trusted(UnitTask, _TASK_FIELDS, row) for row in rows]
    return [UnitTask.model_validate(row) for row in rows]


def file_format(path: str | os.PathLike) -> str:
    """`compact` or `json`: the format a plan file is in, by its first bytes (`read_plan_data` reads either)."""
    return "compact" if is_compact(_head(path)) else "json"


def read_plan_head(path: str | os.PathLike, handle: BinaryIO | None = None) -> DeviceOps:
    """`read_plan_ops` with no operations: the plan's schema version, problem, tag count and staging (of a compact
    file, its header and the tag count are read, nothing of its tables)."""
    return read_plan_ops(path, None, handle)


def read_plan_ops(path: str | os.PathLike, device: int | None, handle: BinaryIO | None = None,
                  head: DeviceOps | None = None) -> DeviceOps:
    """The problem and the operations `device` takes part in (execution order, with their rows in the plan and their
    first message tags, `DeviceOps`), read from a compact file through its index (only those operations' rows are read), or from a JSON plan (all of it
    parsed, then filtered). PlanFileError naming the file and the fix otherwise. Unlike `read_plan_file`, the
    operations are validated one by one but not checked against each other (`schemas.plan_check` needs them all).
    `handle`: the compact file `path` names, open for binary reading; it is read instead of the path (another file
    renamed over the path since it was opened is not read). `head`: what `read_plan_head` read of that same `handle`;
    its problem and staging are taken instead of being validated again."""
    if handle is None and not is_compact(_head(path)):
        plan = read_plan_file(path)
        rows = tuple(i for i, op in enumerate(plan.operations) if device in _op_devices(op))
        first, tags = number_tags(plan.operations)
        operations = tuple(plan.operations[i] for i in rows)
        every = plan.operations
        shared = shared_ids(operations, rows, lambda after: [every[r].carrier if r < len(every) else None for r in after])
        return DeviceOps(plan.schema_version, plan.problem, operations, rows, tuple(first[i] for i in rows), tags, plan.staging,
                         shared)
    given = head is not None and handle is not None  # the problem and staging `head` read of `handle`
    fields, ops, rows, first_tags, tags, integral, carrier_after = _compact(path, read_device_data, device, not given, handle=handle)
    version = fields.get("schema_version")
    if version not in SCHEMA_VERSIONS:
        plan_from_data(fields, path)  # the one-line message a whole-plan read gives
    try:
        if given:
            problem, staging = head.problem, head.staging
        else:
            problem = _PROBLEM.validate_python(fields.get("problem"))
            staging = None if fields.get("staging") is None else Staging.model_validate(fields["staging"])
        operations = _operations(ops, integral)
        rows = tuple(rows.tolist())
        try:
            shared = shared_ids(operations, rows, carrier_after)
        except (CompactPlanError, OSError) as err:
            raise PlanFileError(f"{quoted(path)}: not a readable compact plan ({err}); {_FIX}") from None
    except ValidationError as err:
        raise PlanFileError(f"{quoted(path)}: {describe_validation_error(err)}") from None
    return DeviceOps(version, problem, operations, rows, tuple(first_tags), tags, staging, shared)

