"""One gloo rank of tests/test_redistribute.py: redistribute DTensors between meshes and check them.

Each destination shard is compared bit for bit with DTensor's own `distribute_tensor` of the same
full tensor on the destination mesh; gradients with what a single process computes. Fixed layouts,
then seeded random meshes (any subset of the ranks, 1-d or 2-d, so some moves leave ranks out) and
placements, synchronous and `async_op`. Prints `rank R: ok N` and `rank R: counts ...`.
`XMESH_WORKER_DEVICE=cuda` runs the same checks on CUDA tensors over NCCL, every rank on GPU 0 (a GPU check by
hand, with `NCCL_HOSTID` set per rank; the tests run gloo on the CPU).
"""

from __future__ import annotations

import os
import random
import sys

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from xmesh_plan.dtensor import problem_from_dtensor
from xmesh_plan.redistribute import _STATE, redistribute
from xmesh_plan.sides import FrontendError

WORLD = 4
DEVICE = os.environ.get("XMESH_WORKER_DEVICE", "cpu")

CASES = [  # shape, source ranks, placements, destination ranks, placements (4 ranks)
    ((7, 6), [0, 1], [Shard(0)], [2, 3], [Shard(1)]),  # disjoint meshes, uneven shards
    ((5, 4, 3), [[0, 1], [2, 3]], [Shard(0), Shard(2)], [1, 3], [Replicate()]),  # 2-d onto ranks it shares
    ((9,), [0, 1, 2, 3], [Shard(0)], [[0, 1], [2, 3]], [Shard(0), Replicate()]),  # same ranks, another layout
    ((6, 5), [[0, 1], [2, 3]], [Replicate(), Shard(1)], [[0, 2], [1, 3]], [Shard(1), Shard(0)]),
]


SAME_MESH = ((7, 6), [[0, 1], [2, 3]], [Shard(0), Shard(1)], [Replicate(), Shard(0)])  # DTensor's own redistribute can do it
SENTINEL = -7


def _parent_view(shape: tuple[int, ...], dtype: torch.dtype, columns: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(a parent full of SENTINEL, a view into it of `shape`): rows two down in a taller parent, or columns one right in
    a wider one (each row one run of memory), as an inference engine's parameter or a slice of a fused one."""
    if not shape:
        parent = torch.full((3,), SENTINEL, dtype=dtype, device=DEVICE)
        return parent, parent[1]
    if columns and len(shape) > 1:
        parent = torch.full(tuple(shape[:-1]) + (shape[-1] + 2,), SENTINEL, dtype=dtype, device=DEVICE)
        return parent, parent[..., 1:1 + shape[-1]]
    parent = torch.full((shape[0] + 3,) + tuple(shape[1:]), SENTINEL, dtype=dtype, device=DEVICE)
    return parent, parent[2:2 + shape[0]]


def _into(rank: int) -> None:
    """`into=`: each destination rank's shard lands in a view of its parent (the result's local tensor is that view),
    the parent's other elements untouched, equal to DTensor's own redistribute (same mesh) or distribute_tensor
    (across meshes, which DTensor refuses), and `full_tensor()` of the result equal to the whole tensor where the
    destination mesh holds every rank; synchronous and async_op. Then a tensor of the wrong shape on one rank, and
    into= with a gradient, fail every rank in one line."""
    cases = [(shape, src, sp, dst, dp) for shape, src, sp, dst, dp in CASES] + [(*SAME_MESH[:3], SAME_MESH[1], SAME_MESH[3])]
    for dtype in (torch.float32, torch.bfloat16):
        for k, (shape, src, src_placements, dst, dst_placements) in enumerate(cases):
            full = (torch.arange(torch.Size(shape).numel()).reshape(shape) * 7 % 101 - 50).to(DEVICE, dtype)
            src_mesh = DeviceMesh(DEVICE, src)
            dst_mesh = src_mesh if dst is src else DeviceMesh(DEVICE, dst)
            x = distribute_tensor(full, src_mesh, src_placements)
            own = x.redistribute(dst_mesh, dst_placements) if dst_mesh is src_mesh else distribute_tensor(full, dst_mesh, dst_placements)
            for async_op, columns in ((False, False), (True, True), (False, True)):
                holds = dst_mesh.get_coordinate() is not None
                parent, view = _parent_view(tuple(own.to_local().shape), dtype, columns) if holds else (None, None)
                y = redistribute(x, dst_mesh, dst_placements, async_op=async_op, into=view)
                wrong = []
                if holds:
                    local = y.to_local()
                    if async_op:  # waits here: the view is written by then
                        assert isinstance(local, AsyncCollectiveTensor)
                        local = local.wait()
                    if local.data_ptr() != view.data_ptr() or local.shape != view.shape:
                        wrong.append("the result's local tensor is not the view passed")
                    if not torch.equal(view, own.to_local()):
                        wrong.append("values differ from DTensor's")
                    rest = parent.clone()
                    rest[(slice(1, 2),) if not shape else (..., slice(1, 1 + shape[-1])) if columns and len(shape) > 1
                         else (slice(2, 2 + view.shape[0]),)] = SENTINEL
                    if not (rest == SENTINEL).all():
                        wrong.append("elements outside the view written")
                if dst_mesh.mesh.numel() == WORLD and not torch.equal(y.full_tensor(), full):
                    wrong.append("full_tensor() differs")
                if dst_mesh is src_mesh and holds and not torch.equal(y.to_local(), x.redistribute(dst_mesh, dst_placements).to_local()):
                    wrong.append("differs from DTensor's own redistribute")
                print(f"rank {rank}: into case {k} {str(dtype).removeprefix('torch.')} "
                      f"{'async' if async_op else 'sync'} {'columns' if columns else 'rows'}: {'ok' if not wrong else '; '.join(wrong)}",
                      flush=True)
    shape, src, src_placements, dst, dst_placements = CASES[2]  # every rank in both meshes
    full = torch.arange(9, dtype=torch.float32, device=DEVICE)
    x = distribute_tensor(full, DeviceMesh(DEVICE, src), src_placements)
    dst_mesh = DeviceMesh(DEVICE, dst)
    mine = tuple(distribute_tensor(full, dst_mesh, dst_placements).to_local().shape)
    for label, into, grad in (("wrong shape", torch.zeros((mine[0] + 1,) if rank == 1 else mine), False),
                              ("gradient", torch.zeros(mine), True)):
        try:
            redistribute(x.detach().requires_grad_(grad), dst_mesh, dst_placements, into=into)
            said = "accepted"
        except FrontendError as err:
            said = str(err)
        print(f"rank {rank}: into refused, {label}: {said}", flush=True)


def main() -> int:
    if DEVICE == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo")
    if sys.argv[1:] == ["into"]:
        _into(dist.get_rank())
        dist.destroy_process_group()
        return 0
    seed = int(sys.argv[1]) if len(sys.argv) > 1 else 0
    rank, checked = dist.get_rank(), 0
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        for shape, src, src_placements, dst, dst_placements in CASES:
            full = (torch.arange(torch.Size(shape).numel()).reshape(shape) * 7 % 101 - 50).to(DEVICE, dtype)
            src_mesh, dst_mesh = DeviceMesh(DEVICE, src), DeviceMesh(DEVICE, dst)
            x = distribute_tensor(full, src_mesh, src_placements)
            for _ in range(2):  # the second call reuses the cached plan and executor
                y = redistribute(x, dst_mesh, dst_placements)
                expected = distribute_tensor(full, dst_mesh, dst_placements)
                if dst_mesh.get_coordinate() is not None:
                    assert y.placements == tuple(dst_placements) and y.shape == full.shape
                    assert torch.equal(y.to_local(), expected.to_local()), (rank, shape, dtype, y.to_local(), expected.to_local())
                    checked += 1
    assert len(_STATE.executors) == 3 * len(CASES), len(_STATE.executors)  # one plan per (case, dtype): the repeat compiled nothing
    try:  # DTensor itself refuses to move between meshes
        x.redistribute(dst_mesh, dst_placements)
        refused = False
    except NotImplementedError as err:
        refused = "Cross device mesh" in str(err)
    assert refused
    checked += _gradient(rank, 3, False) + _gradient(rank, 0, True)
    print(f"rank {rank}: ok {checked}", flush=True)
    print(f"rank {rank}: counts {_random_layouts(rank, seed)}", flush=True)
    dist.destroy_process_group()
    return 0


def _gradient(rank: int, case: int, async_op: bool) -> int:
    """Sharded destination: each element is on one rank, so the summed loss is sum(full * weight) and its
    gradient with respect to the source is `weight`, laid out on the source mesh (both replicas of a
    replicated source get it, as DTensor's own backward gives them). Case 3 has every rank in the
    destination mesh; case 0 sends from ranks outside it, which backpropagate through their empty shard."""
    shape, src, src_placements, dst, dst_placements = CASES[case]
    full = torch.linspace(-1, 1, torch.Size(shape).numel()).reshape(shape).to(DEVICE)
    weight = torch.linspace(2, 3, full.numel()).reshape(shape).to(DEVICE)
    src_mesh, dst_mesh = DeviceMesh(DEVICE, src), DeviceMesh(DEVICE, dst)
    x = distribute_tensor(full, src_mesh, src_placements).requires_grad_()
    y = redistribute(x, dst_mesh, dst_placements, async_op=async_op)
    w = distribute_tensor(weight, dst_mesh, dst_placements).to_local()
    (y.to_local() * w).sum().backward()
    if src_mesh.get_coordinate() is None:
        return 0
    expected = distribute_tensor(weight, src_mesh, src_placements).to_local()
    assert torch.equal(x.grad.to_local(), expected), (rank, x.grad.to_local(), expected)
    return 1


def _random_mesh(rng: random.Random) -> list:
    ranks = rng.sample(range(WORLD), rng.randint(1, WORLD))
    if len(ranks) == 4 and rng.random() < 0.5:
        return [ranks[:2], ranks[2:]]
    return ranks


def _random_placements(rng: random.Random, mesh: list, ndim: int) -> list:
    mesh_dims = 2 if isinstance(mesh[0], list) else 1
    return [Replicate() if rng.random() < 0.3 else Shard(rng.randrange(ndim)) for _ in range(mesh_dims)]


def _dtensor_slice(full: torch.Tensor, mesh: DeviceMesh, placements: list) -> torch.Tensor:
    """This rank's shard by DTensor's own slicing rule (`compute_local_shape_and_global_offset`).

    Not `distribute_tensor`: on a mesh whose ranks are not in ascending order (e.g. [3, 1, 2]), torch
    2.13's `distribute_tensor` scatters in group-rank order and hands ranks another coordinate's data."""
    shape, offset = compute_local_shape_and_global_offset(full.shape, mesh, placements)
    if mesh.get_coordinate() is None:
        return full.new_empty(0)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))].clone()


def _random_layouts(rank: int, seed: int, count: int = 24) -> str:
    """Seeded random moves (the same on every rank); layouts DTensor splits unlike our ceil rule must be refused."""
    rng = random.Random(seed)
    moved = refused = left_out = async_checked = 0
    for case in range(count):
        shape = tuple(rng.randint(1, 9) for _ in range(rng.randint(1, 3)))
        src, dst = _random_mesh(rng), _random_mesh(rng)
        src_placements, dst_placements = _random_placements(rng, src, len(shape)), _random_placements(rng, dst, len(shape))
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.int64])
        use_async = rng.random() < 0.5
        src_mesh, dst_mesh = DeviceMesh(DEVICE, src), DeviceMesh(DEVICE, dst)
        try:
            problem_from_dtensor(shape, dtype, src, src_placements, dst, dst_placements)
        except FrontendError:
            refused += 1
            continue
        full = (torch.arange(torch.Size(shape).numel()).reshape(shape) * 13 % 97 - 40).to(DEVICE, dtype)
        x = DTensor.from_local(_dtensor_slice(full, src_mesh, src_placements), src_mesh, src_placements, run_check=False,
                               shape=full.shape, stride=full.stride())
        y = redistribute(x, dst_mesh, dst_placements, async_op=use_async)
        expected = _dtensor_slice(full, dst_mesh, dst_placements)
        involved = set(torch.tensor(src).flatten().tolist()) | set(torch.tensor(dst).flatten().tolist())
        left_out += len(involved) < WORLD
        if dst_mesh.get_coordinate() is not None:
            assert y.placements == tuple(dst_placements) and y.shape == full.shape
            assert isinstance(y._local_tensor, AsyncCollectiveTensor) == use_async  # waited for on first use
            assert torch.equal(y.to_local(), expected), (rank, case, shape, src, src_placements, dst, dst_placements)
            async_checked += use_async
        elif rank in involved:
            assert y.to_local().shape == (0,) * len(shape)
        moved += 1
    assert moved >= count // 2, (moved, refused)
    return f"moved={moved} refused={refused} left_out={left_out} async={async_checked} groups={len(_STATE.groups)}"


if __name__ == "__main__":
    sys.exit(main())
