"""Torch engine overhead: `run()` against bare torch.distributed isend/irecv of the same messages, on gloo.

    .venv/bin/python -m bench.bench_torch_engine                    # starts its own ranks, ~1 minute
    .venv/bin/python -m bench.bench_torch_engine --tasks 16,256 --iters 30

Plans of T unit tasks, each one 64 B box (`bench_executor.many_task_plan`): `send` moves row i
from device 0 to device 1 (sent in place), `send_strided` column i (packed and unpacked through
staging), `broadcast` row i down the chain 1 -> 2 -> 3. The baseline, for `send`, is bare
`dist.isend`/`dist.irecv` of the same rows into the same buffers, then `wait()` on each: the data
movement alone. Times: median over iterations of the slowest rank, iterations separated by
barriers, engine and baseline in the same processes, same run. Python allocation: tracemalloc over
`--iters` calls after warm-up (all threads, the engine's progress thread included): the largest
rise during one call, and what stayed after all calls. Ranks are subprocesses with env://
variables, one process group. Results: bench/results/torch_engine.json.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import click

from bench.bench_executor import ROW, allocation, many_task_plan
from xmesh_plan.schemas.files import write_atomic

ROOT = Path(__file__).resolve().parents[1]

RANKS = {"send": 2, "send_strided": 2, "broadcast": 4}


def _timed(dist, torch, iters: int, once) -> float:
    times = torch.zeros(iters, dtype=torch.float64)
    for i in range(iters):
        dist.barrier()
        start = time.perf_counter()
        once()
        times[i] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return float(times.median())


def _bare(dist, torch, tasks: int):
    """Rank 0 isends T rows, rank 1 irecvs them in place, then wait() on each."""
    src = torch.arange(tasks * ROW, dtype=torch.float32).reshape(tasks, ROW)
    dst = torch.empty_like(src)
    rank = dist.get_rank()

    def once() -> None:
        if rank == 0:
            works = [dist.isend(src[i], 1, tag=i) for i in range(tasks)]
        else:
            works = [dist.irecv(dst[i], 0, tag=i) for i in range(tasks)]
        for w in works:
            w.wait()

    return once


def _worst(torch, dist, values: list[int]) -> list[int]:
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [int(x) for x in t]


def worker(kind: str, task_counts: list[int], iters: int) -> None:
    import torch
    import torch.distributed as dist

    from xmesh_plan.executor import ReshardingExecutor

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rows = []
    for tasks in task_counts:
        plan = many_task_plan(tasks, kind)
        ex = ReshardingExecutor(plan, backend="gloo").prepare()
        src = torch.arange(tasks * ROW, dtype=torch.float32).reshape(plan.problem.shape) if ex.program.src_block else None
        for _ in range(3):
            ex.run(src)
        row = {"kind": kind, "ranks": dist.get_world_size(), "tasks": tasks,
               "engine_s": _timed(dist, torch, iters, lambda: ex.run(src))}
        peak, net = allocation(lambda: ex.run(src), iters)
        row["engine_peak_bytes"], row["engine_net_bytes"] = _worst(torch, dist, [peak, net])
        ex.close()
        if kind == "send":
            bare = _bare(dist, torch, tasks)
            for _ in range(3):
                bare()
            row["bare_s"] = _timed(dist, torch, iters, bare)
            peak, net = allocation(bare, iters)
            row["bare_peak_bytes"], row["bare_net_bytes"] = _worst(torch, dist, [peak, net])
            row["time_ratio"] = row["engine_s"] / row["bare_s"]
            row["alloc_ratio"] = row["engine_peak_bytes"] / max(row["bare_peak_bytes"], 1)
        rows.append(row)
    if dist.get_rank() == 0:
        print(json.dumps(rows), flush=True)
    dist.destroy_process_group()


def launch(kind: str, tasks: str, iters: int) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    n, procs = RANKS[kind], []
    for rank in range(n):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": str(n),
               "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(n), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, "-m", "bench.bench_torch_engine", "--worker", kind, "--tasks", tasks,
                                       "--iters", str(iters)], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{kind}: a rank failed")
    return json.loads(outs[0].strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    lines = ["| plan | ranks | unit tasks | run() per iteration | bare isend/irecv | time ratio | run() per task | peak alloc per run() "
             "| bare: peak alloc | alloc ratio | net after all runs |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        bare = "bare_s" in r
        cells = [r["kind"], r["ranks"], r["tasks"], f"{r['engine_s'] * 1e3:.3f} ms",
                 f"{r['bare_s'] * 1e3:.3f} ms" if bare else "-", f"{r['time_ratio']:.2f}" if bare else "-",
                 f"{r['engine_s'] / r['tasks'] * 1e6:.1f} us", f"{r['engine_peak_bytes']} B",
                 f"{r['bare_peak_bytes']} B" if bare else "-", f"{r['alloc_ratio']:.2f}" if bare else "-", f"{r['engine_net_bytes']} B"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


@click.command(help=__doc__.splitlines()[0])
@click.option("--tasks", default="16,64,256,1024", show_default=True, help="unit-task counts, comma-separated")
@click.option("--iters", type=int, default=30, show_default=True, help="timed iterations per point")
@click.option("--kinds", default="send,send_strided,broadcast", show_default=True, help="plans to time, comma-separated")
@click.option("--worker", hidden=True)
def main(**options) -> None:
    args = SimpleNamespace(**options)
    counts = [int(t) for t in args.tasks.split(",")]
    if args.worker:
        worker(args.worker, counts, args.iters)
        return
    rows = [row for kind in args.kinds.split(",") for row in launch(kind, args.tasks, args.iters)]
    out = ROOT / "bench" / "results" / "torch_engine.json"
    write_atomic(out, json.dumps(rows, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
