"""A pipeline-parallel training job as the schedulers see it, and the schedule file they write.

A `PipelineProblem` lists stages (each on its own device mesh, with per-micro-batch compute times)
and boundary tensors between any two stages (adjacent or not: a U-Net sends stage i's output to
the stage mirrored to it). Each boundary tensor is one resharding problem per direction: the
activation forward (src stage -> dst stage) and, unless `backward` is off, its gradient back.

A `PipelineSchedule` is what `xmesh-plan schedule` saves: the problem, the predicted cost of every
transfer, and one line of actions per stage. An `Action` is one step of a stage, in text `0F3`
(stage 0, forward, micro-batch 3); `B` is a whole backward, `I` its input-gradient part and `W` its
weight-gradient part; `0SEND_F[h0]3` starts sending activation h0 of micro-batch 3 and
`1RECV_B[h0]3` waits for its gradient. Actions live here because planner and executor share them.

>>> Action.from_str("1RECV_F[h0]3")
Action(stage=1, kind='RECV_F', micro_batch=3, tensor='h0')
>>> str(Action(0, "W", 2))
'0W2'
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from .dtypes import DTYPE_SIZES, canonical_dtype, check_dtype
from .limits import (INT64_MAX, MAX_MICRO_BATCHES, MAX_SECONDS, MAX_STAGES, MAX_TENSOR_RANK, Length, StrictBool, StrictInt,
                     check_int64_product, finite, integer)
from .problem import Cluster, DeviceMesh, Placement, ReshardingProblem, Spec
from .spec import SpecError

PIPELINE_SCHEMA_VERSION = 1
Direction = Literal["F", "B"]
TENSOR_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*\Z")
_FROZEN = ConfigDict(frozen=True, extra="forbid")
COMPUTE_KINDS = ("F", "B", "I", "W")
COMM_KINDS = ("SEND_F", "RECV_F", "SEND_B", "RECV_B")
KINDS = COMPUTE_KINDS + COMM_KINDS
_ACTION = re.compile(r"(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|F|B|I|W)(?:\[([A-Za-z_][A-Za-z0-9_.-]*)\])?(\d+)\Z")
EXAMPLES = "'0F3', '2I0', '0SEND_F[h0]3' or '1RECV_B[skip0]2'"


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """Stage `stage` does `kind` for `micro_batch`; communication kinds also name the tensor moved."""

    stage: int
    kind: str
    micro_batch: int
    tensor: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; use one of {', '.join(KINDS)}")
        if (self.kind in COMM_KINDS) != (self.tensor is not None):
            need = "names a tensor, e.g. 0SEND_F[h0]3" if self.kind in COMM_KINDS else "names no tensor, e.g. 0F3"
            raise ValueError(f"action kind {self.kind} {need}")
        if self.stage < 0 or self.micro_batch < 0:
            raise ValueError(f"action {self.kind} has a negative stage or micro-batch; both count from 0")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def direction(self) -> str:
        """'F' for forward activations, 'B' for gradients (communication kinds only)."""
        return self.kind[-1]

    @property
    def transfer(self) -> tuple[str, str, int]:
        """The transfer a communication action belongs to: (tensor, direction, micro-batch)."""
        return (self.tensor, self.direction, self.micro_batch)

    def __str__(self) -> str:
        tensor = f"[{self.tensor}]" if self.tensor is not None else ""
        return f"{self.stage}{self.kind}{tensor}{self.micro_batch}"

    @classmethod
    def from_str(cls, text: str) -> "Action":
        match = _ACTION.match(text.strip())
        if match is None:
            raise ValueError(f"bad action {text!r}; write <stage><kind>[<tensor>]<micro-batch>, e.g. {EXAMPLES}")
        stage, kind, tensor, micro_batch = match.groups()
        return cls(int(stage), kind, int(micro_batch), tensor)


def format_actions(actions: list[Action]) -> str:
    """One stage's list as one line of space-separated actions."""
    return " ".join(map(str, actions))


def parse_actions(line: str, stage: int | None = None) -> list[Action]:
    """Inverse of `format_actions`; with `stage`, every action must belong to it."""
    actions = [Action.from_str(token) for token in line.split()]
    for action in actions:
        if stage is not None and action.stage != stage:
            raise ValueError(f"action {action} is in the line of stage {stage}; each line holds one stage's actions")
    return actions


class Stage(BaseModel):
    """One pipeline stage: its mesh and its compute time per micro-batch, backward split in two parts."""

    model_config = _FROZEN
    name: str = ""
    mesh: DeviceMesh
    forward_s: finite(0, MAX_SECONDS, description="forward compute of one micro-batch, seconds")
    backward_input_s: finite(0, MAX_SECONDS, description="backward part that computes input gradients, seconds")
    backward_weight_s: finite(0, MAX_SECONDS, description="backward part that computes weight gradients, seconds") = 0.0
    activation_bytes: integer(0, INT64_MAX, "a byte count") = Field(0, description="memory one in-flight micro-batch keeps on this stage")

    @property
    def backward_s(self) -> float:
        return self.backward_input_s + self.backward_weight_s


class BoundaryTensor(BaseModel):
    """A tensor that stage `src_stage` produces and stage `dst_stage` consumes, for every micro-batch."""

    model_config = _FROZEN
    name: str = Field(description="letters, digits, _ . - ; used in action text such as 1RECV_F[h0]3")
    src_stage: integer(0, MAX_STAGES - 1, "a stage index")
    dst_stage: integer(0, MAX_STAGES - 1, "a stage index")
    shape: tuple[Length, ...] = Field(min_length=1, max_length=MAX_TENSOR_RANK, description="shape of one micro-batch's tensor")
    dtype: str = "float16"
    src_spec: Spec
    dst_spec: Spec
    backward: StrictBool = Field(True, description="its gradient flows back from dst_stage to src_stage")

    @field_validator("dtype", mode="before")
    @classmethod
    def _canonical_dtype(cls, value: object) -> object:
        return canonical_dtype(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> "BoundaryTensor":
        if not TENSOR_NAME.match(self.name):
            raise ValueError(f"tensor name {self.name!r} may use only letters, digits, '_', '.', '-' and must start with a letter, e.g. 'h0'")
        if self.src_stage >= self.dst_stage:
            raise ValueError(f"tensor {self.name!r}: src_stage {self.src_stage} must be below dst_stage {self.dst_stage}; "
                             "activations flow to later stages (gradients flow back on their own)")
        check_dtype(self.dtype)
        check_int64_product(self.shape, DTYPE_SIZES[self.dtype], f"tensor {self.name!r} shape")
        return self

    @property
    def nbytes(self) -> int:
        size = DTYPE_SIZES[self.dtype]
        for n in self.shape:
            size *= n
        return size


class PipelineProblem(BaseModel):
    """Stages, boundary tensors, micro-batch count and the cluster: everything a schedule depends on."""

    model_config = _FROZEN
    name: str = ""
    stages: tuple[Stage, ...] = Field(min_length=1, max_length=MAX_STAGES)
    tensors: tuple[BoundaryTensor, ...] = ()
    micro_batches: integer(1, MAX_MICRO_BATCHES, "a micro-batch count")
    cluster: Cluster = Cluster()

    @model_validator(mode="after")
    def _check(self) -> "PipelineProblem":
        self._check_meshes_disjoint()
        names = [t.name for t in self.tensors]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"tensor name {repeated[0]!r} appears more than once; give every boundary tensor its own name")
        for index, tensor in enumerate(self.tensors):
            self._check_tensor(index, tensor)
        return self

    def _check_meshes_disjoint(self) -> None:
        owner: dict[int, int] = {}
        for index, stage in enumerate(self.stages):
            for device in stage.mesh.devices:
                if device in owner:
                    raise ValueError(f"device {device} is in the meshes of stages {owner[device]} and {index}; "
                                     "give each stage its own devices (cross-mesh resharding needs disjoint meshes)")
                owner[device] = index

    def _check_tensor(self, index: int, tensor: BoundaryTensor) -> None:
        if tensor.dst_stage >= len(self.stages):
            raise ValueError(f"tensors[{index}] ({tensor.name!r}) has dst_stage {tensor.dst_stage} but there are "
                             f"{len(self.stages)} stages (0..{len(self.stages) - 1})")
        for side in ("src", "dst"):
            mesh = self.stages[getattr(tensor, f"{side}_stage")].mesh
            try:
                getattr(tensor, f"{side}_spec").check_fits(len(tensor.shape), mesh.shape, field=f"tensors[{index}].{side}_spec")
            except SpecError as err:
                raise ValueError(str(err)) from None

    def tensor(self, name: str) -> BoundaryTensor:
        for tensor in self.tensors:
            if tensor.name == name:
                return tensor
        raise KeyError(f"no boundary tensor named {name!r}; known: {', '.join(t.name for t in self.tensors) or 'none'}")

    def transfers(self) -> list[tuple[str, Direction]]:
        """Every (tensor, direction) that moves once per micro-batch, forward ones first."""
        forward = [(t.name, "F") for t in self.tensors]
        return forward + [(t.name, "B") for t in self.tensors if t.backward]

    def resharding_problem(self, name: str, direction: Direction) -> ReshardingProblem:
        """The single-tensor problem one transfer solves; a gradient goes dst -> src with the specs swapped."""
        tensor = self.tensor(name)
        src = Placement(mesh=self.stages[tensor.src_stage].mesh, spec=tensor.src_spec)
        dst = Placement(mesh=self.stages[tensor.dst_stage].mesh, spec=tensor.dst_spec)
        if direction == "B":
            src, dst = dst, src
        label = f"{self.name + '.' if self.name else ''}{name}{'.grad' if direction == 'B' else ''}"
        return ReshardingProblem(name=label, shape=tensor.shape, dtype=tensor.dtype, src=src, dst=dst, cluster=self.cluster)

    @classmethod
    def from_json(cls, text: str) -> "PipelineProblem":
        return cls.model_validate_json(text)


class TransferCost(BaseModel):
    """Predicted time of one transfer and the NIC sides it keeps busy (`h3:send`, `h4:recv`)."""

    model_config = _FROZEN
    tensor: str
    direction: Direction
    seconds: finite(0, MAX_SECONDS * MAX_MICRO_BATCHES)
    nics: tuple[str, ...] = ()


class PipelineSchedule(BaseModel):
    """A saved schedule: the problem, transfer costs, and one line of action text per stage.

    `overlap` off means every send holds its stage until the transfer ends (no compute overlaps it).
    """

    model_config = _FROZEN
    schema_version: Literal[1] = PIPELINE_SCHEMA_VERSION
    generator: str = "xmesh-plan"
    schedule: str = Field(description="schedule name, e.g. 1f1b or eager-1f1b-wd")
    overlap: StrictBool = True
    weight_delay: tuple[StrictInt, ...] = Field((), description="per stage: compute actions each weight-gradient part was moved behind")
    pipeline: PipelineProblem
    costs: tuple[TransferCost, ...]
    stages: tuple[str, ...] = Field(description="per stage, its actions in order, space separated")

    @model_validator(mode="after")
    def _check(self) -> "PipelineSchedule":
        if len(self.stages) != len(self.pipeline.stages):
            raise ValueError(f"schedule has {len(self.stages)} action lines but the pipeline has {len(self.pipeline.stages)} stages; "
                             "give one line per stage")
        missing = sorted(set(self.pipeline.transfers()) - {(c.tensor, c.direction) for c in self.costs})
        if missing:
            raise ValueError(f"costs lack transfer {missing[0][0]}/{missing[0][1]}; list one cost per tensor and direction")
        return self

    def cost(self, tensor: str, direction: Direction) -> TransferCost:
        for cost in self.costs:
            if cost.tensor == tensor and cost.direction == direction:
                return cost
        raise KeyError(f"no cost for transfer {tensor}/{direction}")

    def to_json(self) -> str:
        """Deterministic JSON text (sorted keys, fixed indentation, trailing newline)."""
        return json.dumps(self.model_dump(mode="json"), indent=1, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> "PipelineSchedule":
        return cls.model_validate_json(text)
