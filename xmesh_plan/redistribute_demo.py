"""`torchrun --standalone --nproc-per-node 4 -m xmesh_plan.redistribute_demo`: move DTensors between meshes.

Two moves DTensor itself refuses, on a gloo group of N ranks (N even): a pipeline-stage handoff from
the first half of the ranks (rows split) to the second half (columns split), and a 2-d mesh over every
rank (rows and columns split) onto the second half (replicated). Each
destination shard is compared bit for bit with DTensor's own `distribute_tensor` on the destination mesh;
rank 0 prints the time per call. Exit status 1 if any shard differs.
"""

from __future__ import annotations

import sys
import time

import click
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from xmesh_plan.executor.flags import TORCH_RANK, UsageError, command, launcher_rank, parse
from xmesh_plan.redistribute import redistribute


def moves(world: int) -> list[tuple[str, DeviceMesh, list, DeviceMesh, list]]:
    """(label, source mesh, placements, destination mesh, placements) for a world of `world` ranks (every rank calls)."""
    half = world // 2
    first, second = list(range(half)), list(range(half, world))
    grid = [list(range(row * half, (row + 1) * half)) for row in range(2)]
    return [(f"ranks {first} Shard(0) -> ranks {second} Shard(1)", DeviceMesh("cpu", first), [Shard(0)],
             DeviceMesh("cpu", second), [Shard(1)]),
            (f"2-d mesh {grid} (Shard(0), Shard(1)) -> ranks {second} Replicate()", DeviceMesh("cpu", grid),
             [Shard(0), Shard(1)], DeviceMesh("cpu", second), [Replicate()])]


PROG = "torchrun --standalone --nproc-per-node 4 -m xmesh_plan.redistribute_demo"


@command(__doc__.splitlines()[0])
@click.option("--rows", type=int, default=1000, help="rows of the bfloat16 tensor (default 1000)")
@click.option("--cols", type=int, default=768, help="columns (default 768)")
@click.option("--iters", type=int, default=5, help="timed calls per move after the first (default 5)")
def _command(**_) -> None:
    """The flags (`main` reads them)."""


def main(argv: list[str] | None = None) -> int:
    """The demo; a bad flag is one line from rank 0 and exit status 2 on every rank, before any rank joins the group."""
    try:
        args = parse(_command, argv, PROG, show_help=launcher_rank(*TORCH_RANK) == 0)
        if args.rows < 1 or args.cols < 1 or args.iters < 1:
            raise UsageError("--rows, --cols and --iters must be positive, e.g. --rows 1000 --cols 768 --iters 5")
    except UsageError as err:
        if launcher_rank(*TORCH_RANK) == 0:
            print(f"error: {err}", file=sys.stderr)
        return 2
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world < 2 or world % 2:
        if rank == 0:
            print(f"error: this demo needs an even number of ranks, got {world}; run it with --nproc-per-node 4", file=sys.stderr)
        dist.destroy_process_group()
        return 2
    full = (torch.arange(args.rows * args.cols, dtype=torch.float32).reshape(args.rows, args.cols) % 251 / 7).to(torch.bfloat16)
    wrong = 0
    for label, src, src_placements, dst, dst_placements in moves(world):
        x = distribute_tensor(full, src, src_placements)
        y = redistribute(x, dst, dst_placements)  # compiles the plan and prepares the executor once
        start = time.perf_counter()
        for _ in range(args.iters):
            y = redistribute(x, dst, dst_placements)
        per_call = (time.perf_counter() - start) / args.iters
        expected = distribute_tensor(full, dst, dst_placements)
        if dst.get_coordinate() is not None and not torch.equal(y.to_local(), expected.to_local()):
            wrong += 1
            print(f"rank {rank}: {label}: shard differs from distribute_tensor", flush=True)
        if rank == 0:
            print(f"{label}: {args.rows}x{args.cols} bfloat16, {per_call * 1e3:.2f} ms per call", flush=True)
    flag = torch.tensor([wrong])
    dist.all_reduce(flag)
    if rank == 0:
        print("every destination shard bit-exact against distribute_tensor" if not flag.item()
              else f"FAILED: {flag.item()} shards differ", flush=True)
    dist.destroy_process_group()
    return 1 if flag.item() else 0


if __name__ == "__main__":
    sys.exit(main())
