"""The compiled plan: the contract between planner (writes it) and executor (reads it).

A plan is small frozen records that round-trip through JSON exactly. Operations are listed in
execution order (predicted start time, then id); every rank replays the ones it takes part in.

Operation kinds, all on boxes in global tensor coordinates, are rows of `op_kinds.OP_KINDS` (what
each means, who takes part, the messages it sends):
- `copy`: a device that holds the box in its source shard copies it into its destination shard.
- `send`: `src` (a source-mesh device) sends the box to the single device in `dsts`.
- `broadcast`: `src` sends the box down the chain `dsts` in `chunks` pipelined pieces.
- `allgather`: every member in `dsts` already holds `parts[i]` in its destination shard; afterwards
  each holds all of `region` (the union of the parts), passed round the ring `dsts` in n-1 steps.
- `bundle` (`compile --coalesce`): `holders[i]`, on the host of `src`, holds `parts[i]`; `src` gathers
  the parts over the intra-host links, sends them to `dsts[0]` in one cross-host message, and that
  device scatters part i to every device in `needers[i]` on its host. `region` bounds the parts.
  Bundles of several tensors between the same two relays may share one cross-host message: each
  names the group's first bundle as its `carrier` (`schemas.carriers`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, model_validator

from .files import DataFileError, parse_data, read_text_file, write_atomic  # noqa: F401  (write_atomic: re-exported)
from .geometry import Region
from .limits import IntKey, StrictBool, StrictFloat, StrictInt, quoted, version_field
from .op_kinds import OP_KINDS, chunk_label, parties
from .problem import ReshardingProblem
from .transfer import TransferProblem
from .validation import describe_validation_error

SCHEMA_VERSION = 2
SCHEMA_VERSIONS = (1, 2)
"""Plans of schema 2 may hold what schema 1 cannot say: box layouts, fused destinations and conversions at the
sender (`plan_schema_version`).
A plan that needs none of them is written as schema 1, which schema 1 readers read; readers take both."""
OpKind = Literal[tuple(OP_KINDS)]  # type: ignore[valid-type]  # "copy", "send", "broadcast", "allgather", "bundle": the table's rows
StrategyName = Literal["broadcast", "send_recv", "local_allgather", "global_allgather", "bundle"]
_FROZEN = ConfigDict(frozen=True, extra="forbid")
BoxField = tuple[tuple[StrictInt, StrictInt], ...]  # a `geometry.Region` as a plan states it: integers only
TensorIndex = Annotated[StrictInt | None, Field(None, ge=0, exclude_if=lambda v: v is None,
                                          description="multi-tensor plans: index into problem.tensors (absent otherwise)")]


def _problem_kind(value: Any) -> str:
    """`many` for a transfer problem (it lists tensors), `one` for a single-tensor problem."""
    has_tensors = "tensors" in value if isinstance(value, dict) else isinstance(value, TransferProblem)
    return "many" if has_tensors else "one"


AnyProblem = Annotated[Union[Annotated[ReshardingProblem, Tag("one")], Annotated[TransferProblem, Tag("many")]],
                       Discriminator(_problem_kind)]


def format_region(region: Region) -> str:
    """`[0:512, 0:1024, 0:512]`, the numpy-style printed form of a box."""
    return "[" + ", ".join(f"{a}:{b}" for a, b in region) + "]"


class Operation(BaseModel):
    """One communication step; see the module docstring for what each kind means."""

    model_config = _FROZEN
    id: StrictInt
    task: StrictInt = Field(description="unit task this operation belongs to")
    tensor: TensorIndex
    kind: OpKind
    src: StrictInt | None = Field(None, description="sending device for copy/send/broadcast; None for allgather")
    dsts: tuple[StrictInt, ...] = Field(description="receiving devices; the chain order for a broadcast, the members for an allgather")
    region: BoxField
    parts: tuple[BoxField, ...] = Field((), description="allgather: the part each member contributes; bundle: the boxes it carries")
    chunks: StrictInt = Field(1, ge=1, description="pipelined pieces of a broadcast")
    holders: tuple[StrictInt, ...] = Field((), exclude_if=lambda v: not v, description="bundle only: the device holding each part")
    needers: tuple[tuple[StrictInt, ...], ...] = Field((), exclude_if=lambda v: not v,
                                                 description="bundle only: the devices needing each part")
    carrier: StrictInt | None = Field(None, ge=0, exclude_if=lambda v: v is None,
                                description="bundle only: the id of the bundle whose cross-host message also carries this "
                                            "one's parts (its group's first; schemas.carriers); absent when it sends its own")
    start_s: StrictFloat = 0.0
    end_s: StrictFloat = 0.0

    def __str__(self) -> str:
        tensor = f" tensor {self.tensor}" if self.tensor is not None else ""
        carried = f" in op {self.carrier}'s message" if self.carrier is not None else ""
        return (f"op {self.id:>4} task {self.task:>4}{tensor} {self.kind:<9} {parties(self)} {format_region(self.region)}"
                f"{chunk_label(self)}{carried} @{self.start_s:.6f}-{self.end_s:.6f}s")


class UnitTask(BaseModel):
    """One box of the tensor with the devices that hold it and the devices that need it, and its plan."""

    model_config = _FROZEN
    id: StrictInt
    tensor: TensorIndex
    region: BoxField
    nbytes: StrictInt
    senders: tuple[StrictInt, ...] = Field(description="source devices holding the box (candidates)")
    receivers: tuple[StrictInt, ...] = Field(description="destination devices that need the box and do not hold it")
    merged_cells: StrictInt = Field(1, description="how many cut-point cells were merged into this box")
    sender: StrictInt = Field(description="chosen sending device")
    sender_host: StrictInt
    receiver_hosts: tuple[StrictInt, ...]
    strategy: StrategyName
    chunks: StrictInt = 1
    start_s: StrictFloat = 0.0
    end_s: StrictFloat = 0.0

    def __str__(self) -> str:
        recv = ",".join(f"h{h}" for h in self.receiver_hosts)
        tensor = f" tensor {self.tensor}" if self.tensor is not None else ""
        return (f"task {self.id:>4}{tensor} {format_region(self.region)} {self.nbytes} B  h{self.sender_host}(d{self.sender}) -> {recv}"
                f"  {self.strategy} @{self.start_s:.6f}-{self.end_s:.6f}s")


class HostOrder(BaseModel):
    """The order in which one host's NIC side works through its unit tasks."""

    model_config = _FROZEN
    host: StrictInt
    side: str = Field(description="NIC side: send or recv (send:N / recv:N for NIC N of several)")
    tasks: tuple[StrictInt, ...]


class SolverInfo(BaseModel):
    """Which scheduler made the order, with its seed and quality; no wall-clock values (plans stay byte-identical)."""

    model_config = _FROZEN
    name: str
    seed: StrictInt = 0
    proven_bound_seconds: StrictFloat | None = None
    details: dict[str, str] = Field(default_factory=dict)


class Staging(BaseModel):
    """The staging memory a plan was compiled for (`compile --max-staging-mb`; the field is absent otherwise):
    the per-device limit and each device's peak in the executor's device order (`schemas.staging`)."""

    model_config = _FROZEN
    order: Literal["device"] = Field("device", description="the executor order the peaks are for")
    limit_bytes: StrictInt = Field(ge=1, description="the most bytes of staging any device may need (--max-staging-mb)")
    peak_bytes: dict[IntKey, StrictInt] = Field(description="device -> bytes of staging it allocates in `order`; devices left out stage nothing")


class ExecutorPrediction(BaseModel):
    """The plan timed by the simulator in the order the executor runs it by default, where that is not the
    plan's own host order: a multi-tensor plan, which `TransferExecutor` runs posted on MPI (every message
    at once, links shared; within a window of the limit per device where the plan states a staging limit,
    `executor.window`). Absent on other plans; `predicted_seconds` (the plan's) stays the host-order time
    its operations are stamped with. `xmesh-plan check` recomputes it."""

    model_config = _FROZEN
    order: Literal["posted", "device"] = Field("posted", description="the executor order timed (executor.transfer_executor.default_order): "
                                               "posted, within the staging limit where the plan states one; 'device' is read so that "
                                               "verify, check and the executor can refuse it with advice to recompile")
    predicted_seconds: StrictFloat = Field(description="the simulator's time for the plan run in `order`")


class Plan(BaseModel):
    """A compiled, verifiable resharding plan."""

    model_config = _FROZEN
    schema_version: version_field(*SCHEMA_VERSIONS) = SCHEMA_VERSION
    generator: str
    problem: AnyProblem
    strategy: str = Field(description="strategy requested at compile time ('auto' picks per task)")
    solver: SolverInfo
    merged_slices: StrictBool = Field(description="adjacent cells with identical senders and receivers were merged into one task")
    tasks: tuple[UnitTask, ...]
    operations: tuple[Operation, ...]
    host_order: tuple[HostOrder, ...]
    predicted_seconds: StrictFloat
    lower_bound_seconds: StrictFloat
    staging: Staging | None = Field(None, exclude_if=lambda v: v is None,
                                    description="compiled with a staging limit: the limit and each device's peak (absent otherwise)")
    executor_prediction: ExecutorPrediction | None = Field(
        None, exclude_if=lambda v: v is None,
        description="multi-tensor plans: the time in the executor's default order, posted (absent otherwise)")

    @model_validator(mode="before")
    @classmethod
    def _version_of_problem(cls, data: Any) -> Any:
        """A plan made without a stated schema_version gets the lowest its problem needs (`plan_schema_version`)."""
        if isinstance(data, dict) and "schema_version" not in data and isinstance(data.get("problem"), BaseModel):
            return {**data, "schema_version": plan_schema_version(data["problem"])}
        return data

    @property
    def efficiency(self) -> float:
        """Lower bound over predicted time: 1.0 means the plan reaches the physical limit."""
        if self.predicted_seconds <= 0:
            return 1.0
        return self.lower_bound_seconds / self.predicted_seconds

    def to_json(self) -> str:
        """Deterministic JSON text: fields in schema order, fixed indentation, trailing newline."""
        return self.model_dump_json(indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.model_validate_json(text)


def plan_schema_version(problem: ReshardingProblem | TransferProblem) -> int:
    """2 where the problem lists boxes, fused destinations or conversions (schema 1 readers cannot say them), else 1."""
    if isinstance(problem, TransferProblem):
        uses = bool(problem.fused) or any(t.src_boxes is not None or t.dst_boxes is not None or t.dst_dtype is not None
                                          or t.scale_of is not None for t in problem.tensors)
    else:
        uses = problem.has_boxes or problem.dst_dtype is not None
    return 2 if uses else 1


def load_plan(path: str | os.PathLike) -> Plan:
    return Plan.from_json(Path(path).read_text())


class PlanFileError(ValueError):
    """A plan file that cannot be used, as one line naming the file, the field and the fix."""


def read_plan_file(path: str | os.PathLike) -> Plan:
    """`load_plan` for files a user names, JSON or compact (`schemas.plan_compact`, told apart by their first
    bytes, not their name): anything wrong becomes a one-line PlanFileError."""
    from .plan_io import read_plan_data  # plan_io imports this module

    return plan_from_data(read_plan_data(path), path)


def plan_from_data(raw: Any, path: str | os.PathLike) -> Plan:
    """The plan a file's parsed data states; PlanFileError naming the file and the fix otherwise."""
    version = raw.get("schema_version") if isinstance(raw, dict) else None
    if version is None and isinstance(raw, dict) and {"src", "dst"} <= set(raw):
        raise PlanFileError(f"{quoted(path)}: this is a problem file, not a plan; compile it first: xmesh-plan compile {quoted(path)} -o plan.json")
    if version is None:
        raise PlanFileError(f"{quoted(path)}: not a plan (no schema_version field); pass a plan written by `xmesh-plan compile`")
    if version not in SCHEMA_VERSIONS:
        raise PlanFileError(f"{quoted(path)}: schema_version {version!r} is not supported (this reads schemas "
                            f"{', '.join(map(str, SCHEMA_VERSIONS))}); "
                            "recompile the plan with this xmesh-plan")
    try:
        return Plan.model_validate(raw)
    except ValidationError as err:
        raise PlanFileError(f"{quoted(path)}: {describe_validation_error(err)}") from None
