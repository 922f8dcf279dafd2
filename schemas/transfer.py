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
from functools import lru_cache

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .boxes import Boxes, check_boxes
from .convert import check_conversion, fused_block_scales, scale_boxes, scale_name, scale_shape
from .fused import FusedTensor, fused_pieces
from .geometry import Layout, Region
from .spec import SpecError
from .dtypes import DTYPE_SIZES, canonical_dtype, check_dtype
from .limits import MAX_TENSOR_RANK, Length, check_int64_product, quoted
from .problem import Cluster, DeviceMesh, OptionalSpec, Placement, ReshardingProblem, _blocks
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
    dst_dtype: str | None = Field(None, exclude_if=lambda v: v is None,
                                  description="the destination's element type, converted at the sender (schemas.convert)")
    scale: Literal["tensor", "block"] | None = Field(None, exclude_if=lambda v: v is None,
                                                     description="an FP8 destination's scales: one per tensor or per 128x128 block")
    scale_of: str | None = Field(None, exclude_if=lambda v: v is None,
                                 description="this tensor holds the FP8 scales of the tensor of that name (schemas.convert)")

    @field_validator("dtype", "dst_dtype", mode="before")
    @classmethod
    def _canonical_dtype(cls, value: object) -> object:
        return canonical_dtype(value) if isinstance(value, str) else value

    @model_validator(mode="after")
    def _check(self) -> "TensorTransfer":
        check_dtype(self.dtype)
        check_int64_product(self.shape, DTYPE_SIZES[self.dtype], "shape")
        if self.dst_dtype is not None:
            check_dtype(self.dst_dtype)
        check_conversion(self.dtype, self.dst_dtype, self.scale, len(self.shape))
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
    fused: tuple[FusedTensor, ...] = Field((), exclude_if=lambda v: not v, max_length=MAX_TENSORS,
                                           description="destination tensors that concatenate source tensors (schemas.fused)")

    @model_validator(mode="after")
    def _check(self) -> "TransferProblem":
        seen: dict[str, int] = {}
        for i, tensor in enumerate(self.tensors):
            if tensor.name in seen:
                raise ValueError(f"tensors[{i}].name {tensor.name!r} is also tensors[{seen[tensor.name]}]'s; give every tensor its own name")
            seen[tensor.name] = i
        if self.fused:
            self._check_fused(seen)
        for i, tensor in enumerate(self.tensors):
            try:
                self.tensor_problem(i)
            except ValueError as err:
                raise ValueError(f"tensors[{i}] ({quoted(tensor.name)}): {_first_line(err)}") from None
        self._check_scales(seen)
        return self

    def _check_scales(self, index: dict[str, int]) -> None:
        """Each FP8 tensor with scales has its scale tensor (`schemas.convert.scale_tensor`), and each scale tensor
        is exactly the one its tensor needs."""
        for i, tensor in enumerate(self.tensors):
            where = f"tensors[{i}] ({quoted(tensor.name)})"
            if tensor.scale is not None:
                fused = self.fused_part(tensor.name)
                if fused is not None:
                    self._check_fused_scales(fused, f"{where}.scale")
                k = index.get(scale_name(tensor.name))
                if k is None or self.tensors[k].scale_of != tensor.name:
                    raise ValueError(f"{where}.scale: no tensor {scale_name(tensor.name)!r} with scale_of = {tensor.name!r} carries "
                                     "its scales; add the one schemas.convert.scale_tensor makes (problem files add it themselves)")
                try:
                    want = scale_tensor(tensor, self.tensor_problem(i), fused_part=fused is not None)
                except ValueError as err:
                    raise ValueError(f"{where}.scale: {err}") from None
                if self.tensors[k] != want:
                    raise ValueError(f"tensors[{k}] ({quoted(want.name)}): not the scale tensor {tensor.name!r} needs "
                                     f"({want.model_dump_json(exclude={'name', 'scale_of'})}); replace it with scale_tensor's")
            if tensor.scale_of is not None:
                owner = index.get(tensor.scale_of)
                if owner is None or self.tensors[owner].scale is None or tensor.name != scale_name(tensor.scale_of):
                    raise ValueError(f"{where}.scale_of: {tensor.scale_of!r} is not an FP8 tensor with scales of the problem "
                                     f"whose scales this could be (named {scale_name(str(tensor.scale_of))!r}); drop the tensor")

    def _check_fused_scales(self, j: int, where: str) -> None:
        """A fused tensor whose parts are FP8 with scales: block scales, the same on every part, and its scale
        tensors fused as `schemas.convert.fused_block_scales` says, under `<fused>.scale`."""
        fused = self.fused[j]
        parts = {name: next(t for t in self.tensors if t.name == name) for name, _ in fused.refs()}
        kinds = {(t.dst_dtype, t.scale) for t in parts.values()}
        if len(kinds) != 1 or next(iter(kinds))[1] != "block":
            raise ValueError(f"{where}: the parts of fused tensor {fused.name!r} convert as {sorted(kinds, key=str)}; a fused FP8 "
                             "tensor takes block scales, the same on every part (give dst_dtype and scale = \"block\" on the fused tensor)")
        try:
            want = fused_block_scales(fused, self._shapes(), self.dst_mesh)
        except ValueError as err:
            raise ValueError(f"{where}: fused tensor {fused.name!r} {err}") from None
        found = next((f for f in self.fused if f.name == want.name), None)
        if found != want:
            raise ValueError(f"{where}: fused tensor {fused.name!r} needs its scales fused as {want.name!r} "
                             f"({want.model_dump_json(exclude={'name'})}); add schemas.convert.fused_block_scales' (problem files add it)")

    def conversions(self) -> dict[str, str]:
        """Tensor name -> the conversion its senders apply, in words (tensors without one left out)."""
        return {t.name: conversion_text(t) for t in self.tensors if t.dst_dtype is not None or t.scale_of is not None}

    def _check_fused(self, index: dict[str, int]) -> None:
        """Each fused tensor's parts: tensors of the problem (ranges inside them, together covering each tensor), in no
        other fused tensor, with no destination layout of their own, of one dtype and one shape off the fused dim; its
        layout fits the fused shape."""
        group: dict[str, int] = {}
        for j, fused in enumerate(self.fused):
            where = f"fused[{j}] ({quoted(fused.name)})"
            if fused.name in index or any(f.name == fused.name for f in self.fused[:j]):
                raise ValueError(f"{where}.name: {fused.name!r} is also another tensor's name; give the fused tensor its own name")
            refs = fused.refs()
            for k, (part, span) in enumerate(refs):
                if part not in index:
                    raise ValueError(f"{where}.parts[{k}]: no tensor is called {part!r}; list source tensors of the problem")
                if group.get(part, j) != j:
                    raise ValueError(f"{where}.parts[{k}]: {part!r} is also a part of fused[{group[part]}]; a tensor goes into one fused tensor")
                group[part] = j
                tensor = self.tensors[index[part]]
                if tensor.dst is not None or tensor.dst_boxes is not None:
                    raise ValueError(f"{where}.parts[{k}]: tensor {part!r} gives its own destination layout; a part's comes "
                                     "from the fused tensor's, so drop its dst (or dst_boxes)")
                if fused.dim >= len(tensor.shape):
                    raise ValueError(f"{where}.dim: {fused.dim} but {part!r} has {len(tensor.shape)} dims; give a dim in 0..{len(tensor.shape) - 1}")
                if span is not None and span[1] > tensor.shape[fused.dim]:
                    raise ValueError(f"{where}.parts[{k}]: {fused.parts[k]!r} reaches past {part!r}'s length "
                                     f"{tensor.shape[fused.dim]} along dim {fused.dim}; give a range inside it")
            first = self.tensors[index[refs[0][0]]]
            for k, (part, _) in enumerate(refs[1:], 1):
                tensor = self.tensors[index[part]]
                if tensor.dtype != first.dtype:
                    raise ValueError(f"{where}.parts[{k}]: {part!r} is {tensor.dtype} but {first.name!r} is {first.dtype}; "
                                     "fuse tensors of one dtype")
                if len(tensor.shape) != len(first.shape) or any(a != b for d, (a, b) in enumerate(zip(tensor.shape, first.shape)) if d != fused.dim):
                    raise ValueError(f"{where}.parts[{k}]: {part!r} has shape {list(tensor.shape)} and {first.name!r} "
                                     f"{list(first.shape)}; parts may differ only along dim {fused.dim}")
            try:
                self.fused_blocks(j)
                for part in dict.fromkeys(p for p, _ in refs):
                    self._part_boxes(j, part)
            except ValueError as err:
                raise ValueError(f"{where}: {_first_line(err)}") from None
            for part, missing in fused.gaps(self._shapes()).items():
                rows = ", ".join(f"{a}:{b}" for a, b in missing)
                raise ValueError(f"{where}.parts: no part covers rows {rows} of {part!r} along dim {fused.dim}, so they reach no "
                                 f"device; list every range of {part!r} (a range may repeat, as replicated KV heads do)")

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        return {t.name: tuple(t.shape) for t in self.tensors}

    def fused_lengths(self, j: int) -> list[int]:
        """How long each part of fused tensor j is along its dim (a range's length, or its tensor's)."""
        return self.fused[j].lengths(self._shapes())

    def fused_shape(self, j: int) -> tuple[int, ...]:
        """Fused tensor j's shape: its parts' off the fused dim, their lengths summed on it."""
        return self.fused[j].shape(self._shapes())

    def fused_blocks(self, j: int) -> dict[int, Region]:
        """Destination device id -> its box of fused tensor j (from its spec or boxes, on the fused shape)."""
        return self.fused[j].blocks(self._shapes(), self.dst_mesh)

    def fused_part(self, name: str) -> int | None:
        """The index of the fused tensor the tensor called `name` is a part of, or None."""
        kept = self.__dict__.get("_fused_index")
        if kept is None or kept[0] is not self.fused:  # made once per `fused` (a model_copy may replace it)
            kept = (self.fused, {part: j for j, f in enumerate(self.fused) for part, _ in f.refs()})
            self.__dict__["_fused_index"] = kept
        return kept[1].get(name)

    def _part_boxes(self, j: int, name: str) -> tuple[Region, ...]:
        """Each destination device's box of tensor `name`, a part of fused tensor j: what its parts need on the
        device, one box (pieces of two ranges must be adjacent there); ValueError naming the device otherwise."""
        shape = next(t for t in self.tensors if t.name == name).shape
        dim = self.fused[j].dim
        out = []
        for device in self.dst_mesh.devices:
            pieces = sorted(piece for part, piece, _ in fused_pieces(self, j, device) if part == name)
            if not pieces:
                out.append(tuple((0, 0) if d == dim else (0, n) for d, n in enumerate(shape)))
                continue
            stop = pieces[0][dim][1]
            for piece in pieces[1:]:
                if piece[dim][0] > stop:
                    from .plan import format_region  # plan imports this module

                    raise ValueError(f"device {device} needs {format_region(pieces[0])} and {format_region(piece)} of {name!r}, "
                                     "two separate boxes; a device receives one box of each tensor: split the tensor in two")
                stop = max(stop, piece[dim][1])
            out.append(pieces[0][:dim] + ((pieces[0][dim][0], stop),) + pieces[0][dim + 1:])
        return tuple(out)

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
        return self._kept()[1]

    def _kept(self) -> tuple[tuple, dict[int, ReshardingProblem], dict[tuple, ReshardingProblem]]:
        """(the fields the caches were made from, per-tensor problems by index, a validated one per distinct layout)."""
        made_from = (self.tensors, self.src_mesh, self.dst_mesh, self.cluster, self.fused)
        kept = self.__dict__.get("_problem_cache")
        if kept is None or any(a is not b for a, b in zip(kept[0], made_from)):
            kept = (made_from, {}, {})
            self.__dict__["_problem_cache"] = kept  # frozen model: a cache, not a field
        return kept

    def tensor_problem(self, index: int) -> ReshardingProblem:
        """Tensor `index` alone, as a single-tensor problem on the shared meshes and cluster (made once). Tensors of one
        layout (a model's layers repeat a few) share one validated problem, copied under each one's name: validation
        does not read the name, and the boxes are keyed by identity (the tensors, kept with the cache, hold them)."""
        _, cache, by_layout = self._kept()
        if index not in cache:
            t = self.tensors[index]
            fused = self.fused_part(t.name)
            layout = None if fused is not None else (t.shape, t.dtype, t.dst_dtype, t.src, id(t.src_boxes), t.dst, id(t.dst_boxes))
            like = by_layout.get(layout)
            if like is not None:
                cache[index] = like.model_copy(update={"name": t.name})
                return cache[index]
            dst_boxes = t.dst_boxes if fused is None else self._part_boxes(fused, t.name)
            cache[index] = ReshardingProblem(name=t.name, shape=t.shape, dtype=t.dtype, dst_dtype=t.dst_dtype, cluster=self.cluster,
                                             src=_placement(self.src_mesh, t.src, t.src_boxes),
                                             dst=_placement(self.dst_mesh, t.dst, dst_boxes))
            if layout is not None:
                by_layout[layout] = cache[index]
        return cache[index]

    def tensor_problems(self) -> list[ReshardingProblem]:
        return [self.tensor_problem(i) for i in range(len(self.tensors))]

    def index_of(self, name: str) -> int:
        """The position of the tensor called `name`; KeyError listing a few names otherwise."""
        for i, t in enumerate(self.tensors):
            if t.name == name:
                return i
        raise KeyError(f"no tensor named {name!r}; the problem has {', '.join(self.names[:3])}{', ...' if len(self.tensors) > 3 else ''}")


def scale_tensor(tensor: TensorTransfer, single: ReshardingProblem, fused_part: bool = False) -> TensorTransfer:
    """The tensor of the plan that carries FP8 `tensor`'s scales, from its layouts (`single`: it alone as a problem,
    e.g. `single_problem`); add it to the problem's tensors (problem files add it themselves). A fused tensor's part's
    has no destination layout of its own: it is a part of the fused scales (`convert.fused_block_scales`)."""
    shape = scale_shape(tuple(tensor.shape), tensor.scale)
    sides = {f"{side}_boxes": _scale_boxes(tuple(tensor.shape), tensor.scale, getattr(single, side), side)
             for side in ("src", "dst")[:1 if fused_part else 2]}
    return TensorTransfer(name=scale_name(tensor.name), shape=shape, dtype="float32", scale_of=tensor.name, **sides)


@lru_cache(maxsize=1024)
def _scale_boxes(shape: tuple[int, ...], scale: str, placement: Placement, side: str) -> tuple[Region, ...]:
    """`convert.scale_boxes` of a tensor of `shape` laid out as `placement` on `side`: once per distinct layout (a model's
    layers repeat a few, and a problem checks every scale tensor against the one its tensor needs)."""
    return scale_boxes(shape, scale, _blocks(shape, placement), placement.mesh.devices, side)


def single_problem(tensor: TensorTransfer, src_mesh: DeviceMesh, dst_mesh: DeviceMesh, cluster: Cluster) -> ReshardingProblem:
    """A tensor with its own layouts alone as a problem (a fused part's destination layout comes from its problem)."""
    return ReshardingProblem(name=tensor.name, shape=tensor.shape, dtype=tensor.dtype, dst_dtype=tensor.dst_dtype, cluster=cluster,
                             src=_placement(src_mesh, tensor.src, tensor.src_boxes),
                             dst=_placement(dst_mesh, tensor.dst, tensor.dst_boxes))


def conversion_text(tensor: TensorTransfer) -> str:
    """`bfloat16 -> float8_e4m3fn, block scales in w.scale`, `float32 -> float16`, or `float32 scales of w`."""
    if tensor.scale_of is not None:
        return f"float32 scales of {tensor.scale_of!r}, computed by its senders"
    scales = "" if tensor.scale is None else f", {tensor.scale} scales in {scale_name(tensor.name)!r}"
    return f"{tensor.dtype} -> {tensor.dst_dtype}{scales}"


def _placement(mesh: DeviceMesh, spec, boxes) -> Placement:
    """The placement a tensor's spec or boxes give on a shared mesh (the one it leaves out stays unset)."""
    return Placement(mesh=mesh, **{k: v for k, v in (("spec", spec), ("boxes", boxes)) if v is not None})


def _first_line(err: ValueError) -> str:
    """A pydantic error as its one-line description, any other as its text."""
    return describe_validation_error(err) if isinstance(err, ValidationError) else str(err)


def tensor_problems(problem: ReshardingProblem | TransferProblem) -> list[ReshardingProblem]:
    """The single-tensor problems of any problem: itself for a `ReshardingProblem`."""
    return problem.tensor_problems() if isinstance(problem, TransferProblem) else [problem]
