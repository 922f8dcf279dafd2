"""PyTorch DTensor front end: a `DeviceMesh` and `Shard`/`Replicate` placements per side -> a `ReshardingProblem`.

Device ids are the mesh's global ranks. Mesh dims sharding one tensor dim become one multi-axis `S`,
earlier mesh dim major, as DTensor nests its splits. Where the spec cannot say DTensor's layout, each
rank's box is listed instead (`schemas.boxes`): DTensor splits like `torch.chunk` (ceil, as we do) but
one mesh dim after another, so a dim split over several mesh dims unevenly lands differently from one
ceil split (`[Shard(0), Shard(0)]` of length 9 on a 2x2 mesh); and strided shards (`_StridedShard`,
FSDP over TP) split each of the earlier split's chunks. Boxes follow DTensor's own rule, mesh dim by
mesh dim, as `compute_local_shape_and_global_offset` does; a rank whose indices are not one
contiguous range per dim (a strided shard that interleaves) is refused.

>>> from torch.distributed.tensor import Replicate, Shard
>>> problem = problem_from_dtensor((8, 6), "bfloat16", [[0, 1], [2, 3]], [Shard(0), Shard(0)],
...                                [4, 5, 6], [Replicate()])
>>> str(problem.src.spec), problem.src.mesh.devices, str(problem.dst.spec)
('S01 R', (0, 1, 2, 3), 'R R')
>>> problem_from_dtensor((9,), "float32", [[0, 1], [2, 3]], [Shard(0), Shard(0)], [4], [Replicate()]).src.boxes
(((0, 3),), ((3, 5),), ((5, 7),), ((7, 9),))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from itertools import product

import numpy as np
import torch
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from xmesh_plan.schemas import Cluster, ReshardingProblem
from xmesh_plan.schemas.geometry import shard_interval

from .sides import FrontendError, Side, build_problem, global_shape

_FIX = "redistribute it on the source mesh first (e.g. to Replicate() or Shard(d)), then plan the move"


def problem_from_dtensor(shape: Sequence[int], dtype: object, src_mesh: object, src_placements: Sequence[object],
                         dst_mesh: object, dst_placements: Sequence[object], cluster: Cluster | None = None) -> ReshardingProblem:
    """The problem of moving a DTensor of global `shape` and `dtype` between two (mesh, placements) layouts.

    A mesh is a torch `DeviceMesh` or, to plan without a process group, its global ranks as a nested
    list, array or tensor. Placements are `Shard(d)` or `Replicate()`, one per mesh dim.
    """
    shape = global_shape(shape)
    sides = [_side(shape, mesh, placements, name)
             for mesh, placements, name in ((src_mesh, src_placements, "src"), (dst_mesh, dst_placements, "dst"))]
    return build_problem(shape, dtype, sides[0], sides[1], cluster)


def _side(shape: tuple[int, ...], mesh: object, placements: Sequence[object], name: str) -> Side:
    ranks = _mesh_ranks(mesh, f"{name}_mesh")
    field = f"{name}_placements"
    if not isinstance(placements, Sequence) or isinstance(placements, str):  # Shard(0) alone, not [Shard(0)]
        raise FrontendError(f"{field}: {placements!r} is not a list of placements; give one per mesh dim, e.g. [{placements!r}]")
    placements = list(placements)
    if len(placements) != ranks.ndim:
        raise FrontendError(f"{field}: {len(placements)} placements for a {ranks.ndim}-d mesh; give one per mesh dim")
    dim_axes: list[list[int]] = [[] for _ in shape]
    for mesh_dim, placement in enumerate(placements):
        tensor_dim = _shard_dim(placement, len(shape), f"{field}[{mesh_dim}]")
        if tensor_dim is not None:
            dim_axes[tensor_dim].append(mesh_dim)
    side = Side(tuple(ranks.shape), tuple(int(r) for r in ranks.flat), tuple(tuple(a) for a in dim_axes))
    if any(isinstance(p, _StridedShard) for p in placements) or not _same_split(shape, side):
        split = [(p.dim % len(shape), p.split_factor if isinstance(p, _StridedShard) else None)
                 if isinstance(p, (Shard, _StridedShard)) else None for p in placements]
        boxes = tuple(_box(shape, side.mesh_shape, coord, split, rank, field)
                      for coord, rank in zip(product(*(range(n) for n in side.mesh_shape)), side.devices))
        side = replace(side, boxes=boxes)
    return side


def _mesh_ranks(mesh: object, field: str) -> np.ndarray:
    """The global ranks of a DeviceMesh (or of a plain nested list, array or tensor of ranks) as an int array."""
    raw = mesh.mesh if isinstance(mesh, TorchDeviceMesh) else mesh
    if isinstance(raw, torch.Tensor):
        raw = raw.tolist()
    try:
        ranks = np.asarray(raw)
    except ValueError:
        ranks = np.asarray([], dtype=object)
    if ranks.ndim == 0 or ranks.size == 0 or ranks.dtype.kind not in "iu":
        shown = repr(mesh) if isinstance(mesh, (str, int, float)) else f"a {type(mesh).__name__}"  # one line, whatever it holds
        raise FrontendError(f"{field}: {shown} is not a DeviceMesh or a nested list of integer global ranks; "
                            "pass e.g. init_device_mesh('cpu', (2, 4)) or [[0, 1], [2, 3]]")
    return ranks


def _shard_dim(placement: object, ndim: int, field: str) -> int | None:
    """The tensor dim a placement shards (None for Replicate); Partial is refused."""
    if isinstance(placement, Partial):
        raise FrontendError(f"{field}: {placement} holds partial values, not slices of the tensor; {_FIX}")
    if isinstance(placement, Replicate):
        return None
    if not isinstance(placement, (Shard, _StridedShard)):
        raise FrontendError(f"{field}: {placement!r} is not a placement xmesh-plan knows; use Shard(d), _StridedShard(d, k) or Replicate()")
    if not -ndim <= placement.dim < ndim:
        raise FrontendError(f"{field}: {placement} names tensor dim {placement.dim} but the tensor has {ndim} dims; use a dim in 0..{ndim - 1}")
    return placement.dim % ndim


def _same_split(shape: tuple[int, ...], side: Side) -> bool:
    """Whether DTensor's shards (one mesh dim after another) equal our one ceil split of every dim.

    A tensor with no elements has only empty boxes, however it is split, so nothing can differ.
    """
    return 0 in shape or all(nested_chunks(shape[dim], counts) == ceil_chunks(shape[dim], counts)
                             for dim, counts in enumerate([side.mesh_shape[a] for a in axes] for axes in side.dim_axes))


Runs = list[tuple[int, int]]  # global index ranges, in the order the local shard lists them


def _box(shape: tuple[int, ...], mesh_shape: tuple[int, ...], coord: tuple[int, ...],
         split: list[tuple[int, int | None] | None], rank: int, field: str) -> tuple[tuple[int, int], ...]:
    """The box DTensor gives the rank at `coord`: each mesh dim in turn cuts its tensor dim's current local range
    (`split[m]`: (tensor dim, strided split factor or None), None for Replicate); FrontendError where the result is
    not one range per dim (unless the tensor has no elements). An empty dim is (length, length), as DTensor places an
    empty shard at the end."""
    runs: list[Runs] = [[(0, n)] if n else [] for n in shape]
    for mesh_dim, how in enumerate(split):
        if how is not None:
            dim, factor = how
            runs[dim] = _cut(runs[dim], mesh_shape[mesh_dim], coord[mesh_dim], factor)
    out = []
    for dim, dim_runs in enumerate(runs):
        if len(dim_runs) > 1 and 0 not in shape:  # a tensor with no elements: every box is empty, any will do
            raise FrontendError(
                f"{field}: DTensor gives rank {rank} the indices {', '.join(f'{a}:{b}' for a, b in dim_runs[:4])}"
                f"{', ...' if len(dim_runs) > 4 else ''} of tensor dim {dim}, not one contiguous range; xmesh-plan moves one "
                f"box per device: {_FIX}")
        out.append((dim_runs[0][0], dim_runs[-1][1]) if dim_runs else (shape[dim], shape[dim]))
    return tuple(out)


def _cut(runs: Runs, count: int, index: int, factor: int | None) -> Runs:
    """Shard `index` of `count` of the local range `runs`: one ceil split (Shard), or (_StridedShard of split factor
    `factor`) the same split of each of the `factor` ceil chunks of the range, concatenated."""
    length = sum(b - a for a, b in runs)
    if factor is None:
        return _take(runs, *shard_interval(length, count, index))
    out: Runs = []
    for chunk in range(factor):
        lo, hi = shard_interval(length, factor, chunk)
        start, stop = shard_interval(hi - lo, count, index)
        out += _take(runs, lo + start, lo + stop)
    return _merged(out)


def _take(runs: Runs, lo: int, hi: int) -> Runs:
    """Positions [lo, hi) of the concatenation of `runs`, as global ranges."""
    out, at = [], 0
    for a, b in runs:
        s, e = max(lo, at), min(hi, at + b - a)
        if s < e:
            out.append((a + s - at, a + e - at))
        at += b - a
    return _merged(out)


def _merged(runs: Runs) -> Runs:
    out: Runs = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def nested_chunks(length: int, counts: Sequence[int]) -> list[tuple[int, int] | None]:
    """DTensor's shards of one dim split over mesh dims of `counts` in turn (torch.chunk each time); None = empty.

    >>> nested_chunks(5, [2, 2])
    [(0, 2), (2, 3), (3, 4), (4, 5)]
    """
    pieces = [(0, length)]
    for count in counts:
        pieces = [(start + lo, start + hi) for start, stop in pieces
                  for lo, hi in (shard_interval(stop - start, count, k) for k in range(count))]
    return [piece if piece[1] > piece[0] else None for piece in pieces]


def ceil_chunks(length: int, counts: Sequence[int]) -> list[tuple[int, int] | None]:
    """Our shards of one dim split into prod(counts) pieces by ceil division; None = empty.

    >>> ceil_chunks(5, [2, 2])
    [(0, 2), (2, 4), (4, 5), None]
    """
    total = int(np.prod(counts))
    pieces = [shard_interval(length, total, k) for k in range(total)]
    return [piece if piece[1] > piece[0] else None for piece in pieces]

