"""One gloo rank of tests/test_redistribute.py: redistribute DTensors between meshes and check them.

Each destination shard is compared bit for bit with DTensor's own `distribute_tensor` of the same
full tensor on the destination mesh; gradients with what a single process computes. Prints `rank R: ok N`.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from xmesh_plan.redistribute import _CACHE, redistribute

CASES = [  # shape, source ranks, placements, destination ranks, placements (4 ranks)
    ((7, 6), [0, 1], [Shard(0)], [2, 3], [Shard(1)]),  # disjoint meshes, uneven shards
    ((5, 4, 3), [[0, 1], [2, 3]], [Shard(0), Shard(2)], [1, 3], [Replicate()]),  # 2-d onto ranks it shares
    ((9,), [0, 1, 2, 3], [Shard(0)], [[0, 1], [2, 3]], [Shard(0), Replicate()]),  # same ranks, another layout
    ((6, 5), [[0, 1], [2, 3]], [Replicate(), Shard(1)], [[0, 2], [1, 3]], [Shard(1), Shard(0)]),
]


def main() -> int:
    dist.init_process_group("gloo")
    rank, checked = dist.get_rank(), 0
    for dtype in (torch.float32, torch.bfloat16, torch.int32):
        for shape, src, src_placements, dst, dst_placements in CASES:
            full = (torch.arange(torch.Size(shape).numel()).reshape(shape) * 7 % 101 - 50).to(dtype)
            src_mesh, dst_mesh = DeviceMesh("cpu", src), DeviceMesh("cpu", dst)
            x = distribute_tensor(full, src_mesh, src_placements)
            for _ in range(2):  # the second call reuses the cached plan and executor
                y = redistribute(x, dst_mesh, dst_placements)
                expected = distribute_tensor(full, dst_mesh, dst_placements)
                if dst_mesh.get_coordinate() is not None:
                    assert y.placements == tuple(dst_placements) and y.shape == full.shape
                    assert torch.equal(y.to_local(), expected.to_local()), (rank, shape, dtype, y.to_local(), expected.to_local())
                    checked += 1
    assert len(_CACHE) == 3 * len(CASES), len(_CACHE)  # one plan per (case, dtype): the repeat compiled nothing
    try:  # DTensor itself refuses to move between meshes
        x.redistribute(dst_mesh, dst_placements)
        refused = False
    except NotImplementedError as err:
        refused = "Cross device mesh" in str(err)
    assert refused
    checked += _gradient(rank)
    print(f"rank {rank}: ok {checked}", flush=True)
    dist.destroy_process_group()
    return 0


def _gradient(rank: int) -> int:
    """Sharded destination on every rank: each element is on one rank, so the summed loss is
    sum(full * weight) and its gradient with respect to the source is `weight`, laid out on the source
    mesh (both replicas of a replicated source get it, as DTensor's own backward gives them)."""
    shape, src, src_placements, dst, dst_placements = CASES[3]
    full = torch.linspace(-1, 1, torch.Size(shape).numel()).reshape(shape)
    weight = torch.linspace(2, 3, full.numel()).reshape(shape)
    src_mesh, dst_mesh = DeviceMesh("cpu", src), DeviceMesh("cpu", dst)
    x = distribute_tensor(full, src_mesh, src_placements).requires_grad_()
    y = redistribute(x, dst_mesh, dst_placements)
    w = distribute_tensor(weight, dst_mesh, dst_placements).to_local()
    (y.to_local() * w).sum().backward()
    if src_mesh.get_coordinate() is None:
        return 0
    expected = distribute_tensor(weight, src_mesh, src_placements).to_local()
    assert torch.equal(x.grad.to_local(), expected), (rank, x.grad.to_local(), expected)
    return 1


if __name__ == "__main__":
    sys.exit(main())
