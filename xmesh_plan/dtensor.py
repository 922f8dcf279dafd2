"""PyTorch DTensor front end: a `DeviceMesh` and `Shard`/`Replicate` placements per side -> a `ReshardingProblem`.

Device ids are the mesh's global ranks. Mesh dims sharding one tensor dim become one multi-axis `S`,
earlier mesh dim major, as DTensor nests its splits. DTensor splits like `torch.chunk` (ceil, as we
do) but one mesh dim after another, so a tensor dim split over several mesh dims unevenly can land
differently from our single ceil split; such layouts are refused rather than planned with wrong boxes.

>>> from torch.distributed.tensor import Replicate, Shard
>>> problem = problem_from_dtensor((8, 6), "bfloat16", [[0, 1], [2, 3]], [Shard(0), Shard(0)],
...                                [4, 5, 6], [Replicate()])
>>> str(problem.src.spec), problem.src.mesh.devices, str(problem.dst.spec)
('S01 R', (0, 1, 2, 3), 'R R')
"""

from __future__ import annotations

from collections.abc import Sequence

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
    _check_same_split(shape, side, field)
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
    """The tensor dim a placement shards (None for Replicate); Partial and strided shards are refused."""
    if isinstance(placement, _StridedShard):
        raise FrontendError(f"{field}: strided shard {placement} (from nested sharding such as FSDP+TP) is not supported; {_FIX}")
    if isinstance(placement, Partial):
        raise FrontendError(f"{field}: {placement} holds partial values, not slices of the tensor; {_FIX}")
    if isinstance(placement, Replicate):
        return None
    if not isinstance(placement, Shard):
        raise FrontendError(f"{field}: {placement!r} is not a placement xmesh-plan knows; use Shard(d) or Replicate()")
    if not -ndim <= placement.dim < ndim:
        raise FrontendError(f"{field}: {placement} names tensor dim {placement.dim} but the tensor has {ndim} dims; use a dim in 0..{ndim - 1}")
    return placement.dim % ndim


def _check_same_split(shape: tuple[int, ...], side: Side, field: str) -> None:
    """Refuse a tensor dim whose DTensor shards (one mesh dim after another) differ from our one ceil split.

    A tensor with no elements has only empty boxes, however it is split, so nothing can differ.
    """
    if 0 in shape:
        return
    for dim, axes in enumerate(side.dim_axes):
        counts = [side.mesh_shape[a] for a in axes]
        theirs, ours = nested_chunks(shape[dim], counts), ceil_chunks(shape[dim], counts)
        if theirs != ours:
            raise FrontendError(
                f"{field}: DTensor splits tensor dim {dim} (length {shape[dim]}) over mesh dims {', '.join(map(str, axes))} "
                f"into sizes {_sizes(theirs)}, which differs from the ceil split {_sizes(ours)} xmesh-plan plans with; "
                f"make dim {dim} a multiple of {np.prod(counts)} or shard it over one mesh dim")


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


def _sizes(pieces: list[tuple[int, int] | None]) -> str:
    return ",".join(str(p[1] - p[0]) if p else "0" for p in pieces)
