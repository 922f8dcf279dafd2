"""`redistribute(dtensor, dst_mesh, dst_placements)`: move a DTensor to another mesh, which DTensor refuses.

    y = redistribute(x, dst_mesh, [Shard(1)])     # every rank of the default group calls it

The plan is compiled once per (shape, dtype, meshes, placements, cluster) and kept with its prepared
executor (the torch engine on the default process group), so later calls only move bytes. It is
differentiable: the gradient goes back through the reverse plan (destination -> source), which is
DTensor's own rule for replicated gradients (each replica's gradient is taken to be the same).
Every rank of the default group must be in the source mesh, the destination mesh or both, since
rank r plays device r of the plan, and every rank must call it (and its backward) alike.

Known limit: DTensor gives a rank outside a mesh a 1-d empty local tensor, and its own `to_local()`
backward fails on it for `Shard(d)` with d > 0; gradients are tested with every rank in the
destination mesh (tests/redistribute_worker.py). Gloo process groups only (the torch engine's limit).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from xmesh_plan.executor import ReshardingExecutor
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.schemas import Cluster

from .dtensor import problem_from_dtensor
from .sides import FrontendError

_CACHE: dict[tuple, ReshardingExecutor] = {}


def _mesh_key(mesh) -> tuple:
    return tuple(mesh.mesh.shape), tuple(int(r) for r in mesh.mesh.flatten().tolist())


def _executor(shape, dtype, src_mesh, src_placements, dst_mesh, dst_placements, cluster: Cluster | None) -> ReshardingExecutor:
    """The prepared executor for this move, compiled and prepared on first use (collective on every rank)."""
    key = (tuple(shape), str(dtype), _mesh_key(src_mesh), tuple(map(str, src_placements)), _mesh_key(dst_mesh),
           tuple(map(str, dst_placements)), cluster)
    if key not in _CACHE:
        world = dist.get_world_size()
        ranks = set(_mesh_key(src_mesh)[1]) | set(_mesh_key(dst_mesh)[1])
        if ranks != set(range(world)):
            raise FrontendError(f"redistribute: the two meshes hold ranks {sorted(ranks)} but the default group has {world}; "
                                "every rank must be in the source or destination mesh (rank r plays device r of the plan)")
        problem = problem_from_dtensor(shape, dtype, src_mesh, src_placements, dst_mesh, dst_placements, cluster)
        _CACHE[key] = ReshardingExecutor(compile_plan(problem), None, backend="torch").prepare()
    return _CACHE[key]


def _move(local: torch.Tensor | None, shape, dtype, src, src_placements, dst, dst_placements, cluster) -> torch.Tensor | None:
    """This rank's destination shard (a fresh tensor) from its source shard (None where it holds none)."""
    executor = _executor(shape, dtype, src, src_placements, dst, dst_placements, cluster)
    out = executor.run(None if local is None else local.contiguous())
    return None if out is None else out.clone()  # run() returns the executor's own buffer, reused next call


def _local(tensor: DTensor) -> torch.Tensor | None:
    """The local shard, or None on a rank outside the tensor's mesh."""
    return None if tensor.device_mesh.get_coordinate() is None else tensor.to_local()


def _wrap(local: torch.Tensor | None, mesh, placements, shape, like: torch.Tensor) -> DTensor:
    if local is None:  # this rank is not in the mesh: DTensor's convention is an empty local tensor
        local = like.new_empty((0,) * len(shape))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: DTensor, dst_mesh, dst_placements, cluster):
        src_mesh, src_placements = tensor.device_mesh, tuple(tensor.placements)
        ctx.save = (tensor.shape, tensor.dtype, src_mesh, src_placements, dst_mesh, dst_placements, cluster)
        local = _move(_local(tensor), tensor.shape, tensor.dtype, src_mesh, src_placements, dst_mesh, dst_placements, cluster)
        return _wrap(local, dst_mesh, dst_placements, tensor.shape, tensor.to_local())

    @staticmethod
    def backward(ctx, grad: DTensor):
        shape, dtype, src_mesh, src_placements, dst_mesh, dst_placements, cluster = ctx.save
        grad = grad.redistribute(dst_mesh, dst_placements) if tuple(grad.placements) != tuple(dst_placements) else grad
        local = _move(_local(grad), shape, dtype, dst_mesh, dst_placements, src_mesh, src_placements, cluster)
        return _wrap(local, src_mesh, src_placements, shape, grad.to_local()), None, None, None


def redistribute(tensor: DTensor, dst_mesh, dst_placements: Sequence[object], *, cluster: Cluster | None = None) -> DTensor:
    """`tensor` laid out on `dst_mesh` with `dst_placements`; collective over every rank of the default group."""
    if not isinstance(tensor, DTensor):
        raise FrontendError(f"redistribute: tensor is a {type(tensor).__name__}; pass a DTensor (torch.distributed.tensor)")
    return _Redistribute.apply(tensor, dst_mesh, tuple(dst_placements), cluster)
