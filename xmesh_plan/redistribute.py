"""`redistribute(dtensor, dst_mesh, dst_placements)`: move a DTensor to another mesh, which DTensor refuses.

    y = redistribute(x, dst_mesh, [Shard(1)])                  # every rank calls it, as with any DTensor op
    y = redistribute(x, dst_mesh, [Shard(1)], async_op=True)   # returns at once; waits when y's data is first used

The plan is compiled once per (shape, dtype, meshes, placements, cluster) and kept with its prepared
executor (the torch engine), so later calls only move bytes. Every rank of the default group calls it,
as every DTensor operation; the executor runs over the default group when the two meshes hold every
rank, else over a group of just their ranks (made once); a rank in neither mesh moves nothing. By default device d sits on host
d // LOCAL_WORLD_SIZE, as torchrun numbers ranks; pass `cluster` to describe other hosts or links.

It is differentiable: the gradient goes back through the reverse plan (destination -> source), which
is DTensor's own rule for replicated gradients (each replica's gradient is taken to be the same).
Every rank of both meshes must run the backward too (a rank outside the destination mesh gets an
empty local tensor with the tensor's number of dims, so `y.to_local()` backpropagates there).
Gloo on CPU tensors; NCCL on CUDA tensors is the same code but has never run (this project has no GPU).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PythonCallbackWork, _register_work
from torch.distributed._functional_collectives import AsyncCollectiveTensor, wait_tensor
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from xmesh_plan.executor import ReshardingExecutor
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.schemas import Cluster

from .dtensor import problem_from_dtensor
from .sides import FrontendError

_CACHE: dict[tuple, ReshardingExecutor] = {}  # one prepared executor per move, on the ranks of its meshes
_PENDING: dict[tuple, Callable[[], object]] = {}  # asynchronous moves not waited for yet, by move
_GROUPS: dict[tuple[int, ...], object] = {}  # process groups of the ranks of two meshes that do not hold every rank


def _ranks(mesh) -> tuple[int, ...]:
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())


def _mesh_key(mesh) -> tuple:
    return tuple(mesh.mesh.shape), _ranks(mesh)


def default_cluster() -> Cluster:
    """Our default links, with as many devices per host as torchrun started on this one (LOCAL_WORLD_SIZE)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return Cluster(devices_per_host=int(local)) if local.isdigit() and int(local) > 0 else Cluster()


def _group(ranks: tuple[int, ...]):
    """The process group the executor runs over: the default one, or one of exactly `ranks`.

    Made once, by every rank (torch's `new_group` rule). Groups made by their members only
    (`use_local_synchronization`) are named after how many groups each rank has seen, which differs
    between ranks once meshes of other rank sets exist, and then never connect."""
    if set(ranks) == set(range(dist.get_world_size())):
        return None
    if ranks not in _GROUPS:
        _GROUPS[ranks] = dist.new_group(list(ranks))
    return _GROUPS[ranks]


def _executor(key: tuple, problem_args: tuple, group) -> ReshardingExecutor:
    """The prepared executor for this move, compiled and prepared on first use (collective over the group)."""
    if key not in _CACHE:
        plan = compile_plan(problem_from_dtensor(*problem_args))
        _CACHE[key] = ReshardingExecutor(plan, group, backend="torch").prepare()
    return _CACHE[key]


class _Move:
    """One direction of one redistribution: where it goes, and the executor that moves this rank's bytes."""

    def __init__(self, shape, dtype, src, src_placements, dst, dst_placements, cluster: Cluster, device: torch.device):
        self.shape, self.dtype, self.dst, self.dst_placements = torch.Size(shape), dtype, dst, tuple(dst_placements)
        self.device = device
        self.ranks = tuple(sorted(set(_ranks(src)) | set(_ranks(dst))))
        self.key = (tuple(shape), str(dtype), _mesh_key(src), tuple(map(str, src_placements)), _mesh_key(dst),
                    tuple(map(str, dst_placements)), cluster)
        self.problem_args = (tuple(shape), dtype, src, tuple(src_placements), dst, self.dst_placements, cluster)

    def reverse(self, src, src_placements) -> "_Move":
        return _Move(self.shape, self.dtype, self.dst, self.dst_placements, src, src_placements, self.problem_args[-1], self.device)

    def run(self, local: torch.Tensor | None, *, async_op: bool = False, requires_grad: bool = False) -> DTensor:
        """This rank's part of the move: the destination DTensor (its local shard waited for lazily with `async_op`)."""
        group = _group(self.ranks)
        if dist.get_rank() not in self.ranks:
            return self._wrap(None, requires_grad)
        executor = _executor(self.key, self.problem_args, group)
        if not async_op:
            _finish_pending(self.key)
            out = executor.run(None if local is None else local.contiguous())
            return self._wrap(None if out is None else out.clone(), requires_grad)  # run() returns a buffer reused next call
        _finish_pending(self.key)
        executor.start(None if local is None else local.contiguous())
        shape = executor.program.dst_shape
        out = torch.empty((0,) * len(self.shape) if shape is None else shape, dtype=self.dtype, device=self.device)
        finish = _Finisher(executor, out if shape is not None else None)
        if shape is None:  # nothing to use here: the sends finish on the engine's thread, collected on the next run
            _PENDING[self.key] = finish
        else:
            _register_work(out, PythonCallbackWork(finish))
            _PENDING[self.key] = lambda: wait_tensor(out)
        return self._wrap(AsyncCollectiveTensor(out), requires_grad)

    def _wrap(self, local: torch.Tensor | None, requires_grad: bool) -> DTensor:
        """The destination DTensor around `local`; a rank outside the mesh holds an empty tensor of the same number of dims
        (DTensor's own 1-d placeholder breaks its `to_local()` backward for Shard(d > 0))."""
        if local is None:
            local = torch.empty((0,) * len(self.shape), dtype=self.dtype, device=self.device)
        meta = TensorMeta(self.shape, torch.empty(self.shape, device="meta").stride(), self.dtype)
        return DTensor(local, DTensorSpec(self.dst, self.dst_placements, tensor_meta=meta), requires_grad=requires_grad)


class _Finisher:
    """Waits for one asynchronous move and copies its result out, once: when the result is first used, or before
    the same move starts again (a rank that only sends may never touch its empty result)."""

    def __init__(self, executor: ReshardingExecutor, out: torch.Tensor | None):
        self.executor, self.out = executor, out

    def __call__(self, _timeout=None) -> bool:
        if self.executor is not None:
            executor, self.executor = self.executor, None
            result = executor.wait()
            if self.out is not None:
                self.out.copy_(result)
        return True


def _finish_pending(key: tuple) -> None:
    """Wait for the last asynchronous run of this move if its result was never used (no-op once waited)."""
    finish = _PENDING.pop(key, None)
    if finish is not None:
        finish()


def _local(tensor: DTensor) -> torch.Tensor | None:
    """The local shard, or None on a rank outside the tensor's mesh."""
    return None if tensor.device_mesh.get_coordinate() is None else tensor.to_local()


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: DTensor, move: _Move, async_op: bool):
        ctx.move, ctx.src, ctx.src_placements = move, tensor.device_mesh, tuple(tensor.placements)
        return move.run(_local(tensor), async_op=async_op, requires_grad=tensor.requires_grad)

    @staticmethod
    def backward(ctx, grad: DTensor):
        move = ctx.move
        if tuple(grad.placements) != move.dst_placements:
            grad = grad.redistribute(move.dst, move.dst_placements)
        return ctx.move.reverse(ctx.src, ctx.src_placements).run(_local(grad)), None, None


def redistribute(tensor: DTensor, dst_mesh, dst_placements: Sequence[object], *, cluster: Cluster | None = None,
                 async_op: bool = False) -> DTensor:
    """`tensor` laid out on `dst_mesh` with `dst_placements`; every rank of the default group calls it.

    With `async_op=True` it returns once this rank's messages are posted; the local shard is an
    `AsyncCollectiveTensor` that waits when first used (as DTensor's own `async_op`), or when the same
    move runs again. Do not modify the source shard until then.
    """
    if not isinstance(tensor, DTensor):
        raise FrontendError(f"redistribute: tensor is a {type(tensor).__name__}; pass a DTensor (torch.distributed.tensor)")
    if not isinstance(async_op, bool):
        raise FrontendError(f"redistribute: async_op is a {type(async_op).__name__}; pass True or False")
    move = _Move(tensor.shape, tensor.dtype, tensor.device_mesh, tuple(tensor.placements), dst_mesh, tuple(dst_placements),
                 cluster or default_cluster(), tensor.to_local().device)
    return _Redistribute.apply(tensor, move, async_op)
