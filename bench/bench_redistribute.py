"""`redistribute` against what a DTensor user writes today: `full_tensor()`, broadcast from one rank, slice.

    .venv/bin/python -m bench.bench_redistribute                    # starts 4 gloo ranks, ~1 minute
    .venv/bin/python -m bench.bench_redistribute --sizes 1,16 --iters 10

Moves on 4 CPU ranks (gloo), float32 tensors of `--sizes` MiB:
- `handoff`: ranks [0, 1] Shard(0) -> ranks [2, 3] Shard(1) (a pipeline-stage boundary, disjoint meshes);
- `grid_to_replicas`: 2x2 mesh (Shard(0), Shard(1)) -> ranks [2, 3] Replicate();
- `same_ranks`: ranks [0..3] Shard(0) -> the same ranks Shard(1) (an all-to-all).
The baseline: every source rank calls `x.full_tensor()` (an all-gather on the source mesh), the source
mesh's first rank broadcasts the whole tensor to every rank, and each destination rank slices its
shard (by DTensor's `compute_local_shape_and_global_offset`). Both run in the same processes, same
run, alternating; time = median over iterations of the slowest rank, iterations separated by
barriers; both results are checked equal first. Results: bench/results/redistribute.json.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import click

ROOT = Path(__file__).resolve().parents[1]
RANKS = 4


def _moves():
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard

    return [("handoff", DeviceMesh("cpu", [0, 1]), [Shard(0)], DeviceMesh("cpu", [2, 3]), [Shard(1)]),
            ("grid_to_replicas", DeviceMesh("cpu", [[0, 1], [2, 3]]), [Shard(0), Shard(1)], DeviceMesh("cpu", [2, 3]), [Replicate()]),
            ("same_ranks", DeviceMesh("cpu", [0, 1, 2, 3]), [Shard(0)], DeviceMesh("cpu", [0, 1, 2, 3]), [Shard(1)])]


def _baseline(dist, torch, x, dst_mesh, dst_placements):
    """`full_tensor()` on the source mesh, broadcast from its first rank, slice on each destination rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    src_ranks = x.device_mesh.mesh.flatten().tolist()
    shape, offset = compute_local_shape_and_global_offset(x.shape, dst_mesh, dst_placements)
    box = tuple(slice(o, o + n) for o, n in zip(offset, shape))
    in_src = x.device_mesh.get_coordinate() is not None
    buffer = torch.empty(x.shape, dtype=x.dtype)

    def once():
        full = x.full_tensor() if in_src else buffer
        dist.broadcast(full, src=src_ranks[0])
        return full[box].clone() if dst_mesh.get_coordinate() is not None else None

    return once


def _timed(dist, torch, iters: int, once) -> float:
    times = torch.zeros(iters, dtype=torch.float64)
    for i in range(iters):
        dist.barrier()
        start = time.perf_counter()
        once()
        times[i] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return float(times.median())


def run_worker(sizes_mib: list[float], iters: int) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import distribute_tensor

    from xmesh_plan.redistribute import redistribute

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = []
    for size in sizes_mib:
        rows_n = max(2, int(round((size * 2**20 / 4) ** 0.5)))
        full = torch.arange(rows_n * rows_n, dtype=torch.float32).reshape(rows_n, rows_n)
        for name, src, src_placements, dst, dst_placements in _moves():
            x = distribute_tensor(full, src, src_placements)
            ours = lambda: redistribute(x, dst, dst_placements).to_local()  # noqa: E731
            theirs = _baseline(dist, torch, x, dst, dst_placements)
            a, b = ours(), theirs()
            if dst.get_coordinate() is not None:
                assert torch.equal(a, b), f"{name}: results differ"
            for _ in range(2):
                ours(), theirs()
            t_ours, t_theirs = [], []
            for _ in range(3):  # alternate, so both see the same machine load
                t_ours.append(_timed(dist, torch, max(1, iters // 3), ours))
                t_theirs.append(_timed(dist, torch, max(1, iters // 3), theirs))
            row = {"move": name, "ranks": dist.get_world_size(), "shape": [rows_n, rows_n], "mib": rows_n * rows_n * 4 / 2**20,
                   "redistribute_s": sorted(t_ours)[1], "baseline_s": sorted(t_theirs)[1]}
            row["baseline_over_ours"] = row["baseline_s"] / row["redistribute_s"]
            rows.append(row)
    if dist.get_rank() == 0:
        print(json.dumps(rows), flush=True)
    dist.destroy_process_group()


def launch(sizes: str, iters: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(RANKS):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(RANKS),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(RANKS), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", "--sizes", sizes, "--iters", str(iters)],
                                      env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("a rank failed")
    return json.loads(outs[0].strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    lines = ["| move | ranks | tensor | redistribute | full_tensor + broadcast + slice | baseline / ours |", "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['move']} | {r['ranks']} | {r['shape'][0]}x{r['shape'][1]} float32 ({r['mib']:.1f} MiB) "
                     f"| {r['redistribute_s'] * 1e3:.2f} ms | {r['baseline_s'] * 1e3:.2f} ms | {r['baseline_over_ours']:.2f} |")
    return "\n".join(lines)


@click.command(help=__doc__.splitlines()[0])
@click.option("--sizes", default="1,16", show_default=True, help="tensor sizes in MiB, comma-separated")
@click.option("--iters", type=int, default=15, show_default=True, help="timed iterations per approach")
@click.option("--worker", is_flag=True, hidden=True)
def main(sizes: str, iters: int, worker: bool) -> None:
    try:
        sizes_mib = [float(s) for s in sizes.split(",")]
    except ValueError:
        sizes_mib = []
    if not sizes_mib or min(sizes_mib) <= 0 or iters < 3:
        raise click.UsageError("--sizes must be positive MiB (e.g. 1,16) and --iters at least 3")
    if worker:
        run_worker(sizes_mib, iters)
        return
    rows = launch(sizes, iters)
    save(rows, ROOT / "bench" / "results" / "redistribute.json")
    print(table(rows))


def save(rows: list[dict], path: Path) -> None:
    """Write the results through a temporary file and a rename, so an interrupted run leaves the last results whole."""
    from xmesh_plan.schemas import write_atomic

    write_atomic(path, json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
