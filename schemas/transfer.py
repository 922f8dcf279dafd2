"""A transfer problem: many named tensors moved together between two shared meshes on one cluster.

Each tensor has its own shape, dtype and source and destination specs; the meshes and the cluster
are shared, so all the tensors' unit tasks compete for the same NICs and are scheduled together.
`tensor_problem(i)` is tensor i alone as a `ReshardingProblem`, which is how per-tensor code
(cutting unit tasks, shard boxes, the verifier's replay, the executor's lowering) sees it.

>>> p = TransferProblem(tensors=(TensorTransfer(name="w", shape=(8, 4), src="S0 R", dst="R S1"),),
...                     src_mesh=DeviceMesh(shape=(2,), devices=(0, 1)), dst_mesh=DeviceMesh(shape=(1, 2), devices=(4, 5)))
>>> p.tensor_problem(0).dst.spec, p.names
(ShardingSpec.parse('R S1'), ('w',))
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .boxes import Boxes
from .dtypes import DTYPE_SIZES, canonical_dtype, check_dtype
from .limits import MAX_TENSOR_RANK, Length, check_int64_product, quoted
from .problem import Cluster, DeviceMesh, OptionalSpec, Placement, ReshardingProblem
from .validation import describe_validation_error

MAX_TENSORS = 100_000


class TensorTransfer(BaseModel):
    """One tensor of a transfer: its name, shape, dtype, and its layout on the source and destination mesh: a spec
    (`src`, `dst`) or each device's box (`src_boxes`, `dst_boxes`, `schemas.boxes`) where a spec cannot say it."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(min_length=1, description="unique within the problem, e.g. layers.0.self_attn.q_proj.weight")
    shape: tuple[Length, ...] = Field(min_length=1, max_length=MAX_TENSOR_RANK)
    dtype: str = "float32"
    src: OptionalSpec = Field(None, exclude_if=lambda v: v is None, description="source spec (or src_boxes)")
    dst: OptionalSpec = Field(None, exclude_if=lambda v: v is None, description="destination spec (or dst_boxes)")
    src_boxes: Boxes | None = Field(None, exclude_if=lambda v: v is None, description="each source device's box, instead of src")
    dst_boxes: Boxes | None = Field(None, exclude_if=lambda v: v is None, description="each destination device's box, instead of dst")

    @field_validator("dtype", mode="before")
    @classmethod
    def _canonical_dtype(cls, value: object) -> object:
        return canonical_dtype(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> "TensorTransfer":
        check_dtype(self.dtype)
        check_int64_product(self.shape, DTYPE_SIZES[self.dtype], "shape")
        return self

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


class TransferProblem(BaseModel):
    """Move every tensor in `tensors` from `src_mesh` to `dst_mesh` on `cluster`, in one plan."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = ""
    src_mesh: DeviceMesh
    dst_mesh: DeviceMesh
    cluster: Cluster = Cluster()
    tensors: tuple[TensorTransfer, ...] = Field(min_length=1, max_length=MAX_TENSORS)

    @model_validator(mode="after")
    def _check(self) -> "TransferProblem":
        seen: dict[str, int] = {}
        for i, tensor in enumerate(self.tensors):
            if tensor.name in seen:
                raise ValueError(f"tensors[{i}].name {tensor.name!r} is also tensors[{seen[tensor.name]}]'s; give every tensor its own name")
            seen[tensor.name] = i
            try:
                self.tensor_problem(i)
            except ValueError as err:
                raise ValueError(f"tensors[{i}] ({quoted(tensor.name)}): {_first_line(err)}") from None
        return self

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def _problems(self) -> dict[int, ReshardingProblem]:
        """Per-tensor problems made so far, kept with the fields they were made from: `model_copy(update=...)`
        copies this dict along, so a copy whose tensors, meshes or cluster differ must not reuse it."""
        made_from = (self.tensors, self.src_mesh, self.dst_mesh, self.cluster)
        kept = self.__dict__.get("_problem_cache")
        if kept is None or any(a is not b for a, b in zip(kept[0], made_from)):
            kept = (made_from, {})
            self.__dict__["_problem_cache"] = kept  # frozen model: a cache, not a field
        return kept[1]

    def tensor_problem(self, index: int) -> ReshardingProblem:
        """Tensor `index` alone, as a single-tensor problem on the shared meshes and cluster (made once)."""
        cache = self._problems
        if index not in cache:
            t = self.tensors[index]
            cache[index] = ReshardingProblem(name=t.name, shape=t.shape, dtype=t.dtype, cluster=self.cluster,
                                             src=_placement(self.src_mesh, t.src, t.src_boxes),
                                             dst=_placement(self.dst_mesh, t.dst, t.dst_boxes))
        return cache[index]

    def tensor_problems(self) -> list[ReshardingProblem]:
        return [self.tensor_problem(i) for i in range(len(self.tensors))]

    def index_of(self, name: str) -> int:
        """The position of the tensor called `name`; KeyError listing a few names otherwise."""
        for i, t in enumerate(self.tensors):
            if t.name == name:
                return i
        raise KeyError(f"no tensor named {name!r}; the problem has {', '.join(self.names[:3])}{', ...' if len(self.tensors) > 3 else ''}")


def _placement(mesh: DeviceMesh, spec, boxes) -> Placement:
    """The placement a tensor's spec or boxes give on a shared mesh (the one it leaves out stays unset)."""
    return Placement(mesh=mesh, **{k: v for k, v in (("spec", spec), ("boxes", boxes)) if v is not None})


def _first_line(err: ValueError) -> str:
    """A pydantic error as its one-line description, any other as its text."""
    return describe_validation_error(err) if isinstance(err, ValidationError) else str(err)


def tensor_problems(problem: ReshardingProblem | TransferProblem) -> list[ReshardingProblem]:
    """The single-tensor problems of any problem: itself for a `ReshardingProblem`."""
    return problem.tensor_problems() if isinstance(problem, TransferProblem) else [problem]
