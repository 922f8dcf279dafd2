"""Fused destinations: a destination tensor that is the concatenation of source tensors along one dim, then sharded.

An inference engine keeps `qkv_proj` = cat(q, k, v) on dim 0, `gate_up_proj` = cat(gate, up), an MoE layer's
`w13` = cat(w1, w3); the trainer holds the parts. A `FusedTensor` of a `TransferProblem` names its parts (source
tensors of the problem, in order, each whole or as a range `name[start:stop]` of the fused dim), the dim and its
own layout on the destination mesh (a spec over the fused shape, or each device's box). Ranges say the layouts
tensor-parallel engines keep: with TP = 2 each rank holds cat(q_r, k_r, v_r), which is the fused tensor
[q[0:8], k[0:2], v[0:2], q[8:16], k[2:4], v[2:4]] split in two. A range may be listed more than once: with
one KV head and TP = 2 both ranks hold all of k and v, [q[0:8], k, v, q[8:16], k, v] split in two.

Part k occupies [offset_k, offset_k + length_k) of the fused dim, so a device whose fused box is B receives
from part k the box B cut to that segment, shifted back by offset_k (and on by the range's start): a box of
the source tensor (possibly empty). Each source tensor is then moved as a tensor of its own whose destination
box on a device is what its parts need there (`TransferProblem.tensor_problem`), and the device's fused shard
is those boxes placed along the dim in order (`fused_pieces`): element x of the fused dim comes from element
x - offset_k + start_k of part k's tensor.

>>> f = FusedTensor(name="qkv", parts=("q", "k[0:2]", "v"), dim=0, dst="S0 R")
>>> f.refs()
[('q', None), ('k', (0, 2)), ('v', None)]
>>> f.offsets([4, 2, 2])
(0, 4, 6, 8)
>>> cut_to_part(((3, 6), (0, 2)), 0, 4, 6)
((0, 2), (0, 2))
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .boxes import Boxes, check_boxes
from .geometry import Layout, Region
from .limits import MAX_TENSOR_RANK, integer
from .problem import OptionalSpec
from .spec import SpecError


_RANGE = re.compile(r"(.+)\[([0-9]+):([0-9]+)\]")


class FusedTensor(BaseModel):
    """A destination tensor made of source tensors `parts` concatenated along `dim`, laid out by `dst` or `dst_boxes`."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    name: str = Field(min_length=1, description="the destination tensor's name, e.g. layers.0.self_attn.qkv_proj.weight")
    parts: tuple[str, ...] = Field(min_length=1, description="the source tensors concatenated, in order: a name, or "
                                                             "name[start:stop] for a range of it along dim")
    dim: integer(0, MAX_TENSOR_RANK - 1, "a tensor dim") = Field(description="the dim they are concatenated along")
    dst: OptionalSpec = Field(None, exclude_if=lambda v: v is None, description="the fused tensor's destination spec (or dst_boxes)")
    dst_boxes: Boxes | None = Field(None, exclude_if=lambda v: v is None,
                                    description="each destination device's box of the fused tensor, instead of dst")

    @model_validator(mode="after")
    def _one_layout(self) -> "FusedTensor":
        if (self.dst is None) == (self.dst_boxes is None):
            raise ValueError("give dst (a spec of the fused tensor, e.g. \"S0 R\") or dst_boxes, not both or neither")
        for k, (_, span) in enumerate(self.refs()):
            if span is not None and span[0] >= span[1]:
                raise ValueError(f"parts[{k}]: {self.parts[k]!r} is an empty range; give name[start:stop] with start < stop")
        return self

    def refs(self) -> list[tuple[str, tuple[int, int] | None]]:
        """Each part as (tensor name, (start, stop) along dim, or None for the whole tensor)."""
        return [part_ref(part) for part in self.parts]

    def lengths(self, shapes: dict[str, tuple[int, ...]]) -> list[int]:
        """How long each part is along the fused dim (a range's length, or its tensor's); `shapes`: tensor name -> shape."""
        return [shapes[name][self.dim] if span is None else span[1] - span[0] for name, span in self.refs()]

    def gaps(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, list[tuple[int, int]]]:
        """Each source tensor's ranges along dim that no part lists, where it has any: the parts of one tensor must
        cover it together (a range may repeat: replicated KV heads list k once per TP rank)."""
        out = {}
        for name in dict.fromkeys(name for name, _ in self.refs()):
            length, at, missing = shapes[name][self.dim], 0, []
            for start, stop in sorted((0, length) if span is None else span for part, span in self.refs() if part == name):
                if start > at:
                    missing.append((at, start))
                at = max(at, stop)
            if at < length:
                missing.append((at, length))
            if missing:
                out[name] = missing
        return out

    def shape(self, shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        """The fused shape: the parts' off the fused dim, their lengths summed on it."""
        first = tuple(shapes[self.refs()[0][0]])
        return first[:self.dim] + (sum(self.lengths(shapes)),) + first[self.dim + 1:]

    def blocks(self, shapes: dict[str, tuple[int, ...]], mesh) -> dict[int, Region]:
        """Destination device id -> its box of the fused tensor on `mesh` (from the spec or the boxes); ValueError
        naming dst or dst_boxes where the layout does not fit the fused shape."""
        shape = self.shape(shapes)
        if self.dst_boxes is not None:
            check_boxes(self.dst_boxes, shape, len(mesh.devices), "dst_boxes")
            return dict(zip(mesh.devices, self.dst_boxes))
        try:
            self.dst.check_fits(len(shape), mesh.shape, field="dst")
        except SpecError as err:
            raise ValueError(str(err)) from None
        layout = Layout(shape, tuple(mesh.shape), self.dst)
        return {d: layout.block(c) for d, c in zip(mesh.devices, mesh.coords())}

    def offsets(self, lengths: list[int]) -> tuple[int, ...]:
        """Where each part starts along the fused dim (parts of `lengths` there), and the fused length last."""
        out = [0]
        for length in lengths:
            out.append(out[-1] + length)
        return tuple(out)


def part_ref(part: str) -> tuple[str, tuple[int, int] | None]:
    """`q[0:8]` -> ("q", (0, 8)); `q` -> ("q", None)."""
    found = _RANGE.fullmatch(part)
    return (found.group(1), (int(found.group(2)), int(found.group(3)))) if found else (part, None)


def cut_to_part(box: Region, dim: int, start: int, stop: int) -> Region:
    """The part of fused box `box` in the segment [start, stop) of `dim`, in the part's coordinates (empty: 0:0 there)."""
    lo, hi = max(box[dim][0], start), min(box[dim][1], stop)
    along = (lo - start, hi - start) if lo < hi else (0, 0)
    return box[:dim] + (along,) + box[dim + 1:]


def fused_pieces(problem, j: int, device: int) -> list[tuple[str, Region, tuple[slice, ...]]]:
    """(tensor name, the box of that tensor, where it lies in `device`'s shard of fused tensor j) for each part the
    device's fused box touches, in order along the dim: the device's shard is exactly these pieces (`problem` is a
    `TransferProblem`)."""
    fused = problem.fused[j]
    refs, lengths = fused.refs(), problem.fused_lengths(j)
    offsets = fused.offsets(lengths)
    box = problem.fused_blocks(j)[device]
    dim = fused.dim
    out = []
    for k, (name, span) in enumerate(refs):
        piece = cut_to_part(box, dim, offsets[k], offsets[k + 1])
        if any(b <= a for a, b in piece):
            continue
        at = offsets[k] + piece[dim][0] - box[dim][0]
        where = tuple(slice(0, b - a) for a, b in box)
        where = where[:dim] + (slice(at, at + piece[dim][1] - piece[dim][0]),) + where[dim + 1:]
        start = 0 if span is None else span[0]
        out.append((name, piece[:dim] + ((piece[dim][0] + start, piece[dim][1] + start),) + piece[dim + 1:], where))
    return out


def fused_views(problem, j: int, device: int, shard) -> dict[str, object]:
    """Tensor name -> the view of `device`'s fused shard `shard` (an array of its fused box's shape) that the
    tensor's received box fills, where the tensor is one part there: an executor writing that tensor's destination
    box into it completes the fused shard with no copy after the transfer. A tensor that is several parts on the
    device (two ranges) has no single view: `assemble_fused` copies it."""
    pieces = fused_pieces(problem, j, device)
    names = [name for name, _, _ in pieces]
    return {name: shard[where] for name, _, where in pieces if names.count(name) == 1}


def assemble_fused(problem, j: int, device: int, received: dict[str, object], out) -> object:
    """`out` (an array of the device's fused box's shape) filled from the tensors' received destination shards
    `received` (tensor name -> array of that tensor's destination box on `device`); returns `out`."""
    for name, piece, where in fused_pieces(problem, j, device):
        own = problem.tensor_problem(problem.index_of(name)).blocks("dst")[device]
        out[where] = received[name][tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(piece, own))]
    return out
