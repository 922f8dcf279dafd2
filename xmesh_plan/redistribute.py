"""`redistribute(dtensor, dst_mesh, dst_placements)`: move a DTensor to another mesh, which DTensor refuses.

    y = redistribute(x, dst_mesh, [Shard(1)])                  # every rank calls it, as with any DTensor op
    y = redistribute(x, dst_mesh, [Shard(1)], async_op=True)   # returns at once; waits when y's data is first used
    y = redistribute(x, dst_mesh, [Shard(1)], into=param)      # this rank's shard written into `param`, in place
    clear_cache()                                              # every rank: drop cached plans, executors, groups
    set_cache_size(32)                                         # every rank: keep the 32 most recently used layouts

The plan is compiled once per (shape, dtype, meshes, placements, cluster) and kept with its prepared
executor (the torch engine), keyed by a fingerprint of that layout (128 bits of its SHA-256), so later
calls only move bytes; the `CACHE_SIZE` most recently used are kept (16; `set_cache_size(n)` on every
rank keeps n), and a layout the cache holds is never compiled again. Every rank of the default group calls it, as every DTensor operation; the executor runs
over the default group when the two meshes hold every rank, else over a group of just their ranks
(made once); a rank in neither mesh moves nothing. By default device d sits on host
d // LOCAL_WORLD_SIZE, as torchrun numbers ranks; pass `cluster` to describe other hosts or links.

Arguments are checked on every rank before any process group or collective, so a bad one raises
the same line everywhere. Then, before any byte moves, the ranks of both meshes compare one small
row each (`_agree`, one small all-reduce per call): the layout they were called with, their local
shard's shape, whether they will run the backward, whether their executor is prepared, whether the
tensor passed as `into` fits. A disagreement fails on every rank of both meshes.

`into`: on a rank of the destination mesh, a tensor of its local shard's shape, dtype and device (a view
into a larger one is fine, a slice of a fused parameter) that the move writes in place
(`TransferExecutor`'s `into`, docs/executor.md): the result's local tensor is that tensor, and no
buffer of the cached executor is handed out or copied. It is written outside autograd, so it is refused
when the move would run a backward.

It is differentiable: the gradient goes back through the reverse plan (destination -> source), which
is DTensor's own rule for replicated gradients (each replica's gradient is taken to be the same).
Every rank of both meshes must run the backward too (a rank outside the destination mesh gets an
empty local tensor with the tensor's number of dims, so `y.to_local()` backpropagates there).
Gloo on CPU tensors; NCCL on CUDA tensors is the same code (run on one H200: docs/frontends.md).
"""

from __future__ import annotations

import atexit
import hashlib
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PythonCallbackWork, _register_work
from torch.distributed._functional_collectives import AsyncCollectiveTensor, wait_tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

from xmesh_plan.executor import ExecutorError, ReshardingExecutor
from xmesh_plan.executor.executor import DEFAULT_POLL_S
from xmesh_plan.executor.worlds import TorchWorld, poll_until
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.schemas import Cluster, ReshardingProblem

from .dtensor import problem_from_dtensor
from .sides import FrontendError

CACHE_SIZE = 16  # prepared executors kept, least recently used dropped first (each holds a thread and its buffers); set_cache_size
PROBLEM_CACHE_SIZE = 256  # checked problems kept, so a repeated call checks its arguments by one dict look-up
AGREE_TIMEOUT_S = 60.0  # how long a rank waits for the others to reach the same call


class _State:
    """This rank's state of `redistribute()`: prepared executors, pending moves, process groups, checked problems.

    Invariants: every executor in `executors` was prepared by every rank of its group, but a rank may have
    dropped one its peers keep (`_agree` then makes them all prepare it again); `pending` holds at most one
    unfinished asynchronous move per rank set, and a move over a rank set starts only after the one pending
    over it has finished here (both use the same group, so their tags would clash); `groups` is made by every
    rank in the same order (torch's `new_group` rule) and dropped by `clear_cache()` or with the default group
    they were made under (`same_world`); everything is this rank's alone (no method here is a collective)."""

    def __init__(self) -> None:
        self.executors: OrderedDict[tuple[int, int], ReshardingExecutor] = OrderedDict()  # by layout fingerprint, least recently used first
        self.pending: dict[tuple[int, ...], tuple[ReshardingExecutor, Callable[[], object]]] = {}  # by the ranks of the move
        self.groups: dict[tuple[int, ...], object] = {}  # process groups of the ranks of two meshes that do not hold every rank
        self.problems: OrderedDict[tuple, tuple[ReshardingProblem, tuple[int, int]]] = OrderedDict()  # checked problem, key hash
        self.world = None  # a weak reference to the default group the groups and executors above were made under

    def same_world(self) -> None:
        """Forget the groups and executors of a default group that was destroyed (every rank sees the same new one)."""
        world = dist.group.WORLD
        if self.world is None or self.world() is not world:
            if self.world is not None:
                self.forget()
                self.groups.clear()  # destroyed with the old default group
            self.world = weakref.ref(world)

    def group(self, ranks: tuple[int, ...]):
        """The process group the executor runs over: the default one, or one of exactly `ranks`.

        Made once, by every rank (torch's `new_group` rule). Groups made by their members only
        (`use_local_synchronization`) are named after how many groups each rank has seen, which differs
        between ranks once meshes of other rank sets exist, and then never connect."""
        if set(ranks) == set(range(dist.get_world_size())):
            return None
        if ranks not in self.groups:
            self.groups[ranks] = dist.new_group(list(ranks))
        return self.groups[ranks]

    def problem(self, key: tuple, problem_args: tuple) -> tuple[ReshardingProblem, tuple[int, int]]:
        """The checked problem of a move and a hash of its key (what ranks compare); FrontendError on a bad layout."""
        if key in self.problems:
            self.problems.move_to_end(key)
            return self.problems[key]
        problem = problem_from_dtensor(*problem_args)
        digest = np.frombuffer(hashlib.sha256(repr(key).encode()).digest()[:16], dtype=np.int64)
        self.problems[key] = problem, (int(digest[0]), int(digest[1]))
        while len(self.problems) > PROBLEM_CACHE_SIZE:
            self.problems.popitem(last=False)
        return self.problems[key]

    def used(self, key: tuple[int, int]) -> ReshardingExecutor:
        """The cached executor of `key`, now the most recently used."""
        self.executors.move_to_end(key)
        return self.executors[key]

    def remember(self, key: tuple[int, int], executor: ReshardingExecutor) -> None:
        """Cache `executor`, closing the least recently used ones beyond CACHE_SIZE (after their pending move)."""
        self.executors[key] = executor
        self.trim()

    def trim(self) -> None:
        """Close the least recently used executors beyond CACHE_SIZE (after their pending move)."""
        while len(self.executors) > CACHE_SIZE:
            self.close(self.executors.popitem(last=False)[1])

    def drop(self, key: tuple[int, int]) -> None:
        """Close and forget the executor of `key` (after its pending move)."""
        self.close(self.executors.pop(key))

    def close(self, executor: ReshardingExecutor) -> None:
        for ranks, (pending, _) in list(self.pending.items()):
            if pending is executor:
                self.finish_pending(ranks)
        executor.close()

    def finish_pending(self, ranks: tuple[int, ...]) -> None:
        """Wait for the last asynchronous move over `ranks` if its result was never used (no-op once waited).

        A failure stays with that move's result and its executor (the next call of that move reports it)."""
        pending = self.pending.pop(ranks, None)
        if pending is not None:
            try:
                pending[1]()
            except Exception:
                pass

    def finish_all_pending(self) -> None:
        for ranks in list(self.pending):
            self.finish_pending(ranks)

    def forget(self) -> None:
        """Finish pending moves and close every executor, on this rank only (no collective)."""
        self.finish_all_pending()
        while self.executors:
            self.executors.popitem(last=False)[1].close()
        self.problems.clear()


_STATE = _State()


def _ranks(mesh) -> tuple[int, ...]:
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())


def _mesh_key(mesh) -> tuple:
    return tuple(mesh.mesh.shape), _ranks(mesh)


def default_cluster() -> Cluster:
    """Our default links, with as many devices per host as torchrun started on this one (LOCAL_WORLD_SIZE)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return Cluster(devices_per_host=int(local)) if local.isdigit() and int(local) > 0 else Cluster()


class _Move:
    """One direction of one redistribution: where it goes, and the executor that moves this rank's bytes.

    A 0-dim tensor (a scalar) moves as a tensor of shape (1,), which only Replicate() can lay out."""

    def __init__(self, shape, dtype, src, src_placements, dst, dst_placements, cluster: Cluster, device: torch.device):
        self.shape, self.dtype, self.dst, self.dst_placements = torch.Size(shape), dtype, dst, tuple(dst_placements)
        self.src, self.src_placements, self.cluster, self.device = src, tuple(src_placements), cluster, device
        self.ranks = tuple(sorted(set(_ranks(src)) | set(_ranks(dst))))
        self.key = (tuple(shape), str(dtype), _mesh_key(src), tuple(map(str, src_placements)), _mesh_key(dst),
                    tuple(map(str, dst_placements)), cluster)
        planned = tuple(shape) or (1,)
        self.problem, self.fingerprint = _STATE.problem(self.key, (planned, dtype, src, self.src_placements, dst,
                                                             self.dst_placements, cluster))

    def reverse(self) -> "_Move":
        return _Move(self.shape, self.dtype, self.dst, self.dst_placements, self.src, self.src_placements, self.cluster,
                     self.device)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        """The shape of `rank`'s source shard under the source placements (the plan's box)."""
        box = self.problem.blocks("src")[rank]
        return tuple(stop - start for start, stop in box) if self.shape else ()

    def run(self, local: torch.Tensor | None, *, async_op: bool = False, wants_grad: bool = False,
            into: torch.Tensor | None = None) -> DTensor:
        """This rank's part of the move: the destination DTensor (its local shard waited for lazily with `async_op`),
        written into `into` where given."""
        _STATE.same_world()
        group = _STATE.group(self.ranks)
        if dist.get_rank() not in self.ranks:
            if into is not None:
                raise FrontendError(f"redistribute: into= on rank {dist.get_rank()}, which is in neither mesh and gets no "
                                    "destination shard; pass into=None there")
            return self._wrap(None, wants_grad)
        _STATE.finish_pending(self.ranks)
        executor = _agree(self, group, local, wants_grad, into)
        local = None if local is None else local.detach()  # the engines write views of it outside autograd (grad is ours)
        src = None if local is None else local.reshape(1) if local.dim() == 0 else local.contiguous()
        target = None if into is None else into.reshape(1) if into.dim() == 0 else into  # a view: written in place
        if not async_op:
            try:
                out = executor.run(src, into=target)
                if target is None and out is not None:
                    out = out.clone()  # run() returns a buffer reused next call
            finally:
                if not executor.engine.broken:
                    executor.engine.unbind()  # the cache must not keep the caller's shard alive
            return self._wrap(into if into is not None else None if out is None else self._to_user(out), wants_grad)
        executor.start(src, into=target)
        shape = executor.program.dst_shape
        out = into if into is not None else self._placeholder() if shape is None else \
            torch.empty(self._user_shape(shape), dtype=self.dtype, device=self.device)
        _register_work(out, PythonCallbackWork(_Finisher(executor, out, shape is not None and into is None)))
        _STATE.pending[self.ranks] = executor, lambda: wait_tensor(out)  # a rank that only sends may never touch its result
        return self._wrap(AsyncCollectiveTensor(out), wants_grad)

    def _user_shape(self, shape) -> tuple[int, ...]:
        """A destination shard's shape as the caller sees it (a scalar travels as shape (1,))."""
        return tuple(shape) if self.shape else ()

    def _to_user(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.shape else out.reshape(())

    def _placeholder(self) -> torch.Tensor:
        """What a rank outside the destination mesh holds: no elements, the tensor's number of dims (DTensor's own 1-d
        placeholder breaks its `to_local()` backward for Shard(d > 0)); a zero for a scalar, for the same reason."""
        if not self.shape:
            return torch.zeros((), dtype=self.dtype, device=self.device)
        return torch.empty((0,) * len(self.shape), dtype=self.dtype, device=self.device)

    def _wrap(self, local: torch.Tensor | None, requires_grad: bool) -> DTensor:
        """The destination DTensor around `local` (the placeholder on a rank outside the mesh)."""
        local = self._placeholder() if local is None else local
        meta = TensorMeta(self.shape, torch.empty(self.shape, device="meta").stride(), self.dtype)
        return DTensor(local, DTensorSpec(self.dst, self.dst_placements, tensor_meta=meta), requires_grad=requires_grad)


def _agree(move: _Move, group, local: torch.Tensor | None, wants_grad: bool, into=None) -> ReshardingExecutor:
    """The prepared executor, once every rank of the move agrees to run it; else the same error on every rank.

    Each rank has a row: the hash of the layout it was called with, whether it will run the backward, whether
    its local shard fits the plan, whether its executor is prepared, whether that one broke, what is wrong with
    the tensor it passed as `into` (`_INTO_TROUBLE`; 0: nothing, or none passed). A 2-number
    all-reduce tells every rank whether all rows agree and are fine (the usual case: run); if not, all
    ranks all-gather the rows to name the ranks in one error, or, when only some ranks lack the executor
    (a rank may have dropped it), all prepare it again."""
    rank = dist.get_rank()
    executor = _STATE.executors.get(move.fingerprint)
    fits = local is None or (tuple(local.shape) == move.local_shape(rank) and local.dtype == move.dtype)
    broken = executor is not None and bool(executor.engine.broken)
    row = np.array([*move.fingerprint, wants_grad, fits, executor is not None, broken, _into_trouble(move, rank, into, wants_grad)],
                   dtype=np.int64)
    if _all_fine(group, row):
        return _STATE.used(move.fingerprint)
    every = TorchWorld(group).allgather(row, AGREE_TIMEOUT_S, DEFAULT_POLL_S, "redistribute() on every rank of both meshes")
    ranks = np.array(move.ranks)
    _check_rows(move, ranks, every)
    if every[:, 5].any():
        raise ExecutorError(f"redistribute: this move failed earlier on {_list(ranks[every[:, 5] == 1])} (that error says "
                            "why); call xmesh_plan.redistribute.clear_cache() on every rank before moving again")
    if executor is not None and every[:, 4].all():
        return _STATE.used(move.fingerprint)
    if executor is not None:
        _STATE.drop(move.fingerprint)
    prepared = ReshardingExecutor(compile_plan(move.problem), group, backend="torch", timeout_s=AGREE_TIMEOUT_S).prepare()
    _STATE.remember(move.fingerprint, prepared)
    return prepared


def _all_fine(group, row: np.ndarray) -> bool:
    """Whether every rank's row has the same layout hash (30 bits of it) and gradient flag, a fitting shard and a
    prepared, unbroken executor: one MAX all-reduce of 2 int64 (gloo's fast path for fewer numbers than ranks).

    Each rank sends x << 3 | trouble and (2**31 - 1 - x) << 3 | trouble: the maxima give max(x) and min(x),
    equal only when every x is, and a nonzero low part when any rank has trouble."""
    same = (int(row[0]) & (2**30 - 1)) << 1 | int(row[2])
    trouble = int(not row[3] or row[6] != 0) | int(not row[4]) << 1 | int(row[5]) << 2
    both = torch.tensor([same << 3 | trouble, (2**31 - 1 - same) << 3 | trouble], dtype=torch.int64,
                        device=TorchWorld(group).tensor_device())
    work = dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group, async_op=True)
    poll_until(work.is_completed, AGREE_TIMEOUT_S, DEFAULT_POLL_S, "redistribute() on every rank of both meshes")
    work.wait()
    high, low = (int(v) for v in both.tolist())
    return high >> 3 == 2**31 - 1 - (low >> 3) and not (high | low) & 7


_INTO_TROUBLE = {  # what a rank's `into` row entry says, and the fix
    1: "is not a tensor of its destination shard's shape, dtype and device; pass one that is (a view is fine)",
    2: "is given on a rank outside the destination mesh, which gets no destination shard; pass into=None there",
    3: "is given for a move that runs a backward (the tensor requires grad), and into= is written outside autograd; "
       "call it under torch.no_grad() or on a tensor that does not require grad",
}


def _into_trouble(move: _Move, rank: int, into, wants_grad: bool) -> int:
    """What is wrong with the tensor a rank passed as `into` (an `_INTO_TROUBLE` key), or 0."""
    if into is None:
        return 0
    box = move.problem.blocks("dst").get(rank)
    if box is None:
        return 2
    if wants_grad:
        return 3
    shape = tuple(b - a for a, b in box) if move.shape else ()
    fits = isinstance(into, torch.Tensor) and tuple(into.shape) == shape and into.dtype == move.dtype and into.device == move.device
    return 0 if fits else 1


def _check_rows(move: _Move, ranks: np.ndarray, every: np.ndarray) -> None:
    """Raise, identically on every rank, when the ranks were called with other layouts, wrong shards or gradients."""
    prints = [tuple(r[:2]) for r in every]
    if len(set(prints)) > 1:
        common = max(set(prints), key=prints.count)
        other = [r for r, p in zip(ranks, prints) if p != common]
        raise FrontendError(f"redistribute: {_list(other)} called it with another shape, dtype, mesh, placements or cluster "
                            f"than the other ranks of both meshes; call it with the same arguments on every rank")
    unfit = ranks[every[:, 3] == 0]
    if len(unfit):
        wrong = int(unfit[0])
        raise FrontendError(
            f"redistribute: the local shard of {_list(unfit)} does not match the DTensor's spec (rank {wrong} must hold "
            f"shape {move.local_shape(wrong)} {str(move.dtype).removeprefix('torch.')} of the global {tuple(move.shape)} under "
            f"{list(move.src_placements)}); make it with distribute_tensor, or DTensor.from_local with the right shape= and stride=")
    for code, why in _INTO_TROUBLE.items():
        wrong = ranks[every[:, 6] == code]
        if len(wrong):
            shapes = "; ".join(f"rank {int(r)} holds {tuple(b - a for a, b in move.problem.blocks('dst')[int(r)])}"
                               for r in wrong[:4] if int(r) in move.problem.blocks("dst"))
            raise FrontendError(f"redistribute: into= on {_list(wrong)} {why}{f' ({shapes})' if code == 1 and shapes else ''}")
    grads = every[:, 2]
    if grads.any() and not grads.all():
        raise FrontendError(
            f"redistribute: requires_grad (with grad mode on) is True on {_list(ranks[grads == 1])} but False on "
            f"{_list(ranks[grads == 0])}; the backward runs on every rank of both meshes, so call requires_grad_() "
            "on the tensor on every rank or on none")


def _list(ranks) -> str:
    ranks = [int(r) for r in ranks]
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"


class _Finisher:
    """Waits for one asynchronous move and copies its result out, once: when the result is first used, or before
    the next move over the same ranks starts. A failure is kept and raised again on every later use."""

    def __init__(self, executor: ReshardingExecutor, out: torch.Tensor, receives: bool):
        self.executor, self.out, self.receives, self.error = executor, out, receives, None

    def __call__(self, _timeout=None) -> bool:
        if self.executor is not None:
            executor, self.executor = self.executor, None
            try:
                result = executor.wait()
                if self.receives:
                    self.out.copy_(result.reshape(self.out.shape))
            except BaseException as err:
                self.error = err
            if not executor.engine.broken:
                executor.engine.unbind()  # the cache must not keep the caller's shard alive
        if self.error is not None:
            _register_work(self.out, PythonCallbackWork(self))  # wait_tensor popped this work: the next use raises too
            raise self.error
        return True


@atexit.register
def _finish_all_pending() -> None:
    """At exit, finish the moves nobody waited for: a rank that only sends may still be sending, and its peers wait."""
    _STATE.finish_all_pending()


def clear_cache() -> None:
    """Finish pending asynchronous moves, close every cached executor and forget plans and process groups.

    Call it on every rank, as every redistribute (it frees the buffers of moves you will not make again).
    After `destroy_process_group()` and a new `init_process_group()` the next redistribute does this itself."""
    if dist.is_initialized():
        _STATE.same_world()  # the groups of a destroyed default group are gone already
    _STATE.forget()
    groups = list(_STATE.groups.values())
    _STATE.groups.clear()
    if groups and dist.is_initialized():  # no rank destroys a group a peer may still be finishing a move over
        TorchWorld(None).allgather(np.zeros(1, np.int64), AGREE_TIMEOUT_S, DEFAULT_POLL_S, "clear_cache() on every rank")
        for group in groups:
            dist.destroy_process_group(group)


def set_cache_size(size: int) -> None:
    """Keep the `size` most recently used layouts' plans and prepared executors (16 by default); call it on every rank.

    A layout the cache holds is never compiled again: cycling through 20 layouts with `set_cache_size(20)`
    compiles each once, where the default 16 compiles every call. Each kept executor holds a progress thread
    and its destination and staging buffers; shrinking closes the least recently used beyond `size` at once."""
    global CACHE_SIZE, PROBLEM_CACHE_SIZE
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise FrontendError(f"set_cache_size: size={size!r}; give a whole number of layouts to keep, at least 1 (16 by default)")
    CACHE_SIZE, PROBLEM_CACHE_SIZE = size, max(PROBLEM_CACHE_SIZE, size)
    _STATE.trim()


def _local(tensor: DTensor) -> torch.Tensor | None:
    """The local shard, or None on a rank outside the tensor's mesh."""
    return None if tensor.device_mesh.get_coordinate() is None else tensor.to_local()


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: DTensor, move: _Move, async_op: bool, wants_grad: bool, into):
        ctx.move = move
        return move.run(_local(tensor), async_op=async_op, wants_grad=wants_grad, into=into)

    @staticmethod
    def backward(ctx, grad: DTensor):
        move = ctx.move
        if tuple(grad.placements) != move.dst_placements:
            grad = grad.redistribute(move.dst, move.dst_placements)
        return move.reverse().run(_local(grad)), None, None, None, None


def _check_args(tensor, dst_mesh, dst_placements, cluster, async_op) -> None:
    """Refuse what the plan cannot even be asked for; the same on every rank, before any group or collective."""
    if not isinstance(tensor, DTensor):
        raise FrontendError(f"redistribute: tensor is a {type(tensor).__name__}; pass a DTensor (torch.distributed.tensor)")
    if not isinstance(dst_mesh, DeviceMesh):
        raise FrontendError(f"redistribute: dst_mesh is a {type(dst_mesh).__name__}; pass a DeviceMesh, "
                            "e.g. DeviceMesh('cpu', [2, 3]) or init_device_mesh('cpu', (2, 2))")
    if dst_mesh.device_type != tensor.device_mesh.device_type:
        raise FrontendError(f"redistribute: dst_mesh is a {dst_mesh.device_type!r} mesh but the tensor is on a "
                            f"{tensor.device_mesh.device_type!r} one; make dst_mesh with device type {tensor.device_mesh.device_type!r}")
    if not isinstance(dst_placements, (list, tuple)):
        raise FrontendError(f"redistribute: dst_placements is a {type(dst_placements).__name__}; pass a list with one "
                            f"placement per mesh dim, e.g. [Shard(0)] or [Replicate(), Shard(1)]")
    if cluster is not None and not isinstance(cluster, Cluster):
        raise FrontendError(f"redistribute: cluster is a {type(cluster).__name__}; pass an xmesh_plan.schemas.Cluster or None")
    if not isinstance(async_op, bool):
        raise FrontendError(f"redistribute: async_op is a {type(async_op).__name__}; pass True or False")
    if tensor.dim() == 0:
        for field, placements in (("src_placements", tensor.placements), ("dst_placements", dst_placements)):
            for i, placement in enumerate(placements):
                if isinstance(placement, Shard):
                    raise FrontendError(f"{field}[{i}]: {placement} on a 0-dim tensor (a scalar), which has no dim to "
                                        "split; use Replicate() (or reshape it to (1,) first)")


def redistribute(tensor: DTensor, dst_mesh: DeviceMesh, dst_placements: Sequence[object], *,
                 cluster: Cluster | None = None, async_op: bool = False, into: torch.Tensor | None = None) -> DTensor:
    """`tensor` laid out on `dst_mesh` with `dst_placements`; every rank of the default group calls it.

    With `async_op=True` it returns once this rank's messages are posted; the local shard is an
    `AsyncCollectiveTensor` that waits when first used or `.wait()`ed (as DTensor's own `async_op`), or
    when the next move over the same ranks starts. On every rank, even one that only sends, do not
    modify the source shard until then. A failure raises on every use of the result.

    `into`: this rank's destination shard is written in place into that tensor (of the local shard's shape,
    dtype and device; a view is fine), which becomes the result's local tensor; None on a rank outside the
    destination mesh. A tensor that does not fit, or `into` with a move that runs a backward, fails every rank.
    """
    _check_args(tensor, dst_mesh, dst_placements, cluster, async_op)
    move = _Move(tensor.shape, tensor.dtype, tensor.device_mesh, tuple(tensor.placements), dst_mesh, tuple(dst_placements),
                 cluster or default_cluster(), tensor.to_local().device)
    wants_grad = torch.is_grad_enabled() and tensor.requires_grad
    return _Redistribute.apply(tensor, move, async_op, wants_grad, into)
