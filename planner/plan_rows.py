"""A compiled plan as light rows: what a compile assembles, before (or instead of) the plan's pydantic records.

A DeepSeek-V3-like weight sync has about 670,000 unit tasks and as many operations; as `UnitTask` and `Operation`
records they take about 1.9 KB and 3.2 KB each (3.4 GB together, and seconds of validation), as the named tuples
here a tenth of that, sharing their boxes and device tuples with the planner's cells and strategies. Every reader of
operations in the planner (`schemas.op_kinds`, the simulator, `schemas.carriers`, the compact writer) reads them by
attribute, so rows and records go through the same code and give the same numbers. `PlanRows.to_plan()` makes the
plan's records (what `compile_plan` returns: the same plan, byte for byte, in either file format); `PlanRows` is written
compact straight from its rows (`schemas.plan_compact.compact_arrays` reads it as it reads a `Plan`).
"""

from __future__ import annotations

from collections import namedtuple
from dataclasses import dataclass
from typing import Any

from xmesh_plan.schemas import HostOrder, Operation, Plan, UnitTask
from xmesh_plan.schemas.plan_compact import TABLES


def _rows_of(record: type) -> type:
    """A named tuple type with `record`'s fields in its order, made from it (so the two cannot drift apart), whose
    `model_copy(update=...)` gives the row with those fields changed (as the record's does: `schemas.carriers.fused`
    calls it) and `record()` the validated record."""
    base = namedtuple(f"{record.__name__}Row", tuple(record.model_fields))

    def model_copy(self, *, update: dict[str, Any]):
        return self._replace(**update)

    def as_record(self):
        return record(**self._asdict())

    return type(base.__name__, (base,), {"__slots__": (), "model_copy": model_copy, "record": as_record,
                                         "__doc__": f"A `{record.__name__}`'s fields, in its order, as a named tuple."})


OperationRow = _rows_of(Operation)
TaskRow = _rows_of(UnitTask)
# pydantic's older names for model_dump / model_dump_json / model_copy: on the shell they would state no tables.
_READS_TABLES = frozenset({"dict", "json", "copy"})


@dataclass(frozen=True)
class PlanRows:
    """A plan as its fields less the tables (`shell`: the `Plan` with no tasks, operations or host order) and the
    tables as rows. Reads like the plan it stands for: `rows.predicted_seconds`, `rows.solver`, ... are the shell's,
    `model_dump` (what the compact writer takes the header from) is the shell's with the tables left out; the shell's other
    `model_*` names (`model_copy`, `model_dump_json`, ...) are refused, as the shell would answer them with no tables."""

    shell: Plan
    tasks: tuple[TaskRow, ...]
    operations: tuple[OperationRow, ...]
    host_order: tuple[HostOrder, ...]

    def __getattr__(self, name: str) -> Any:  # only for names that are not fields of this class
        if name.startswith("__"):
            raise AttributeError(name)
        if name.startswith("model_") or name in _READS_TABLES:  # the shell's answer would leave the rows out
            raise AttributeError(f"PlanRows.{name} would read a plan with no tasks or operations: call .to_plan() first "
                                 f"and use the plan's {name}")
        return getattr(self.shell, name)

    def model_dump(self, **kwargs) -> dict:
        excluded = set(kwargs.pop("exclude", ()) or ())
        if not set(TABLES) <= excluded:
            raise ValueError("PlanRows.model_dump states the plan less its tables: exclude tasks, operations and host_order")
        return self.shell.model_dump(exclude=excluded, **kwargs)

    def with_fields(self, **update: Any) -> "PlanRows":
        """The same rows under a plan with `update`'s fields changed (`Plan.model_copy`)."""
        return PlanRows(self.shell.model_copy(update=update), self.tasks, self.operations, self.host_order)

    def to_plan(self) -> Plan:
        """The plan's records: every row validated as its `UnitTask` or `Operation`."""
        return self.shell.model_copy(update={"tasks": tuple(t.record() for t in self.tasks),
                                             "operations": tuple(op.record() for op in self.operations),
                                             "host_order": self.host_order})

    def to_json(self) -> str:
        return self.to_plan().to_json()


def plan_rows(tasks, operations, host_order, **fields) -> PlanRows:
    """`PlanRows` of a plan with `fields` (everything but its tables, as `Plan` takes them)."""
    return PlanRows(Plan(tasks=(), operations=(), host_order=(), **fields), tuple(tasks), tuple(operations), tuple(host_order))
