"""Executor overhead: time of `run()` beyond the data movement, per unit task, on the CPU (MPI) path.

    .venv/bin/python -m bench.bench_executor                  # launches mpiexec itself, ~1 minute
    .venv/bin/python -m bench.bench_executor --tasks 16,256 --iters 30

Plans of T unit tasks, each one small box (64 B): `send` moves row i from device 0 to device 1
(contiguous, sent in place); `send_strided` moves column i (packed and unpacked through staging);
`broadcast` sends row i down the chain 1 -> 2 -> 3. The baseline is bare mpi4py doing the same
row sends (same buffers) finished by `Waitall`, run with MPICH spinning (heavy yield off, one rank per
core): the data movement alone. Overhead per task =
(executor - baseline) / T, from the same run. Python allocation: tracemalloc over `--iters` calls
of `run()` after warm-up, the largest peak above the level before a call (short-lived objects) and
the net growth over all calls (a leak), per rank, divided by the rank's messages for the per-message
figure. Python calls per `run()`: a profile hook counts the Python function calls one call of `run()` makes,
and the fewest over the `--iters` calls is kept (the work of a call that never waits for a peer; polls while
waiting vary with load), the most over ranks: the same count means the same work, whatever the timing.
`--compare REV` also measures git revision REV's executor (its whole package, run from a copy of that
revision, by this script) on the same plans, each kind alternating with this one (before/after).
Results: bench/results/executor.json.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import click

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
from xmesh_plan.schemas.files import write_atomic

ROW = 16  # float32 elements per box: 64 B


def many_task_plan(tasks: int, kind: str):
    """T hand-made operations, one per unit task (plans must name the tasks their operations serve)."""
    from xmesh_plan.schemas import DeviceMesh, Operation, Placement, Plan, ReshardingProblem, SolverInfo, UnitTask

    receivers = 3 if kind == "broadcast" else 1
    shape = (ROW, tasks) if kind == "send_strided" else (tasks, ROW)
    problem = ReshardingProblem(
        name=f"bench_{kind}_{tasks}", shape=shape, dtype="float32",
        src=Placement(mesh=DeviceMesh(shape=(1,), devices=(0,)), spec="R R"),
        dst=Placement(mesh=DeviceMesh(shape=(receivers,), devices=tuple(range(1, receivers + 1))), spec="R R"))
    op_kind = "broadcast" if kind == "broadcast" else "send"
    dsts = tuple(range(1, receivers + 1))
    regions = [((0, ROW), (i, i + 1)) if kind == "send_strided" else ((i, i + 1), (0, ROW)) for i in range(tasks)]
    cluster = problem.cluster
    units = tuple(UnitTask(id=i, region=region, nbytes=ROW * 4, senders=(0,), receivers=dsts, sender=0, sender_host=0,
                           receiver_hosts=tuple(sorted({cluster.host_of(d) for d in dsts})),
                           strategy="broadcast" if kind == "broadcast" else "send_recv")
                  for i, region in enumerate(regions))
    ops = tuple(Operation(id=i, task=i, kind=op_kind, src=0, dsts=dsts, region=region) for i, region in enumerate(regions))
    return Plan(generator="bench_executor", problem=problem, strategy=op_kind, solver=SolverInfo(name="hand"),
                merged_slices=False, tasks=units, operations=ops, host_order=(), predicted_seconds=0.0, lower_bound_seconds=0.0)


def _timed(comm, iters: int, once) -> float:
    """Median over iterations of the slowest rank's time for `once()`, iterations separated by barriers."""
    from mpi4py import MPI

    times = np.empty(iters)
    for i in range(iters):
        comm.Barrier()
        start = time.perf_counter()
        once()
        times[i] = time.perf_counter() - start
    slowest = np.empty_like(times)
    comm.Allreduce(times, slowest, op=MPI.MAX)
    return float(np.median(slowest))


def _baseline(comm, tasks: int):
    """Bare mpi4py: rank 0 sends T rows, rank 1 receives them in place, then `Waitall` (MPICH's own spinning wait)."""
    from mpi4py import MPI

    src = np.arange(tasks * ROW, dtype=np.float32).reshape(tasks, ROW)
    dst = np.empty_like(src)

    def once() -> None:
        if comm.Get_rank() == 0:
            requests = [comm.Isend([src[i], MPI.BYTE], dest=1, tag=i) for i in range(tasks)]
        else:
            requests = [comm.Irecv([dst[i], MPI.BYTE], source=0, tag=i) for i in range(tasks)]
        MPI.Request.Waitall(requests)

    return once


def allocation(run_once, iters: int) -> tuple[int, int]:
    """(largest peak of traced Python memory above the level before a call, net growth after all `iters` calls)."""
    tracemalloc.start()
    worst, start = 0, tracemalloc.get_traced_memory()[0]
    for _ in range(iters):
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        run_once()
        worst = max(worst, tracemalloc.get_traced_memory()[1] - before)
    net = tracemalloc.get_traced_memory()[0] - start
    tracemalloc.stop()
    return worst, net


def fewest_calls(comm, run_once, iters: int) -> int:
    """The fewest Python function calls one `run_once()` makes over `iters` calls (each after a barrier)."""
    calls = 0

    def count(frame, event, arg) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    fewest = None
    for _ in range(iters):
        comm.Barrier()
        calls = 0
        sys.setprofile(count)
        run_once()
        sys.setprofile(None)
        fewest = calls if fewest is None else min(fewest, calls)
    return fewest


def measure(comm, plan, iters: int) -> dict:
    """Median time of `run()` and its allocation (max over ranks)."""
    from xmesh_plan.executor import ReshardingExecutor
    from xmesh_plan.executor.pattern import fill

    ex = ReshardingExecutor(plan, comm).prepare()
    shard = fill(ex.program.src_block, plan.problem.shape, ex.engine.dtype) if ex.program.src_block else None
    for _ in range(3):
        ex.run(shard)
    seconds = _timed(comm, iters, lambda: ex.run(shard))
    peak, net = allocation(lambda: ex.run(shard), iters)
    calls = fewest_calls(comm, lambda: ex.run(shard), iters)
    mine = np.array([peak, net, peak // max(ex.program.messages(), 1), calls], np.int64)
    every = np.zeros((comm.Get_size(), 4), np.int64)
    comm.Allgather(mine, every)
    getattr(ex, "close", lambda: None)()
    return {"executor_s": seconds, "alloc_peak_bytes_max_rank": int(every[:, 0].max()),
            "alloc_net_bytes_max_rank": int(every[:, 1].max()), "alloc_peak_bytes_per_message": int(every[:, 2].max()),
            "python_calls_per_run_max_rank": int(every[:, 3].max())}


def worker(kind: str, task_counts: list[int], iters: int) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    for tasks in task_counts:
        plan = many_task_plan(tasks, kind)
        row = {"kind": kind, "tasks": tasks, "ranks": comm.Get_size(), "current": measure(comm, plan, iters)}
        row |= row["current"]
        row["baseline_s"] = _timed(comm, iters, _baseline(comm, tasks)) if kind == "send" else None
        if comm.Get_rank() == 0:
            print(json.dumps(row), flush=True)


def gpu_bench() -> dict | str:
    """Pack/unpack of strided boxes against a plain device-to-device copy of the same bytes, and a
    single-rank NCCL broadcast; returns a reason string where there is no GPU (never run here yet)."""
    try:
        import cupy
        from cupy.cuda import nccl
        if not cupy.cuda.runtime.getDeviceCount():
            return "no CUDA device"
    except Exception as err:  # ImportError, CUDARuntimeError
        return f"no GPU path here ({type(err).__name__}: {str(err).splitlines()[0][:80]})"

    def seconds(fn, reps: int = 20) -> float:
        fn()
        start, stop = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        for _ in range(reps):
            fn()
        stop.record()
        stop.synchronize()
        return cupy.cuda.get_elapsed_time(start, stop) / 1e3 / reps

    shard = cupy.arange(8192 * 8192, dtype=cupy.float32).reshape(8192, 8192)
    box = (slice(0, 8192), slice(0, 4096))  # half the columns: 4096 runs of 16 KiB
    stage = cupy.empty((8192, 4096), cupy.float32)
    flat_src, flat_dst = cupy.empty(stage.size, cupy.float32), cupy.empty(stage.size, cupy.float32)
    nbytes = stage.nbytes
    pack = seconds(lambda: cupy.copyto(stage, shard[box]))
    unpack = seconds(lambda: cupy.copyto(shard[box], stage))
    plain = seconds(lambda: cupy.copyto(flat_dst, flat_src))
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    stream = cupy.cuda.get_current_stream()
    bcast = seconds(lambda: comm.bcast(flat_src.data.ptr, nbytes, nccl.NCCL_CHAR, 0, stream.ptr))
    return {"bytes": nbytes, "pack_GBps": nbytes / pack / 1e9, "unpack_GBps": nbytes / unpack / 1e9,
            "d2d_copy_GBps": nbytes / plain / 1e9, "pack_vs_copy": plain / pack, "unpack_vs_copy": plain / unpack,
            "nccl_bcast_1rank_s": bcast}


def revision_tree(rev: str) -> Path:
    """Git revision `rev`'s files in a temporary folder, with a `pkg/xmesh_plan` package laid out as pyproject.toml's
    package-dir maps the folders, so that `PYTHONPATH=<it>/pkg` runs that revision's code under the package's name."""
    root = Path(tempfile.mkdtemp())
    archive = subprocess.run(["git", "archive", rev], cwd=ROOT, capture_output=True, check=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root / "src", filter="data")
    package = root / "pkg" / "xmesh_plan"
    package.mkdir(parents=True)
    for entry in (root / "src" / "xmesh_plan").iterdir():
        (package / entry.name).symlink_to(entry)
    for name in ("planner", "executor", "schemas"):
        (package / name).symlink_to(root / "src" / name)
    return root


def table(rows: list[dict]) -> str:
    """The Markdown table for BENCHMARKS.md; `before` columns only when --compare was given."""
    compare = "before" in rows[0]
    head = ["plan", "ranks", "unit tasks", "run() per iteration", "bare mpi4py", "overhead per task", "run() per task",
            "peak alloc per run()", "per message", "net after all runs", "Python calls per run()"]
    head += ["before: run()", "before: peak alloc", "before: per message", "before: Python calls", "time after/before"] if compare else []
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for r in rows:
        base = r["baseline_s"]
        cells = [r["kind"], r["ranks"], r["tasks"], f"{r['executor_s'] * 1e3:.3f} ms",
                 f"{base * 1e3:.3f} ms" if base is not None else "-",
                 f"{(r['executor_s'] - base) / r['tasks'] * 1e6:.1f} us" if base is not None else "-",
                 f"{r['executor_s'] / r['tasks'] * 1e6:.1f} us", f"{r['alloc_peak_bytes_max_rank']} B",
                 f"{r['alloc_peak_bytes_per_message']} B", f"{r['alloc_net_bytes_max_rank']} B", r["python_calls_per_run_max_rank"]]
        if compare:
            b = r["before"]
            cells += [f"{b['executor_s'] * 1e3:.3f} ms", f"{b['alloc_peak_bytes_max_rank']} B",
                      f"{b['alloc_peak_bytes_per_message']} B", b["python_calls_per_run_max_rank"], f"{r['executor_s'] / b['executor_s']:.2f}"]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    return "\n".join(lines)


@click.command(help=__doc__.splitlines()[0])
@click.option("--tasks", default="16,64,256,1024", show_default=True, help="unit-task counts")
@click.option("--iters", type=int, default=40, show_default=True, help="timed iterations per point")
@click.option("--compare", metavar="REV", help="also measure the executor of git revision REV")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=ROOT / "bench" / "results" / "executor.json")
@click.option("--worker", type=click.Choice(("send", "send_strided", "broadcast")), hidden=True)
def main(**options) -> None:
    args = SimpleNamespace(**options)
    counts = [int(x) for x in args.tasks.split(",")]
    if args.worker:
        worker(args.worker, counts, args.iters)
        return
    env = dict(os.environ)
    mpiexec = Path(sys.executable).parent / "mpiexec"
    before = revision_tree(args.compare) if args.compare else None
    rows = []
    for kind, ranks in (("send", 2), ("send_strided", 2), ("broadcast", 4)):
        # 2 ranks on 2 cores may spin (the baseline's Waitall then runs at full speed); 4 ranks must yield.
        spin = ranks <= (os.cpu_count() or 1)

        def measured(script: Path, extra_env: dict) -> list[dict]:
            cmd = [str(mpiexec), "-n", str(ranks), sys.executable, str(script), "--worker", kind, "--tasks", args.tasks,
                   "--iters", str(args.iters)]
            out = subprocess.run(cmd, env=env | extra_env | {"MPIR_CVAR_ENABLE_HEAVY_YIELD": "0" if spin else "1"},
                                 capture_output=True, text=True, timeout=900)
            if out.returncode:
                print(out.stderr[-3000:], file=sys.stderr)
                sys.exit(1)
            return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]

        mine = measured(Path(__file__), {})
        if before is not None:
            theirs = measured(Path(__file__), {"PYTHONPATH": str(before / "pkg")})  # this script, that revision's package
            for row, old in zip(mine, theirs):
                row["before"] = old["current"]
        rows += mine
    gpu = gpu_bench()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out, json.dumps({"cpu_overhead": rows, "compared_with": args.compare, "gpu": gpu}, indent=1) + "\n")
    print(table(rows))
    print(f"\nGPU pack/unpack and NCCL broadcast: {gpu if isinstance(gpu, str) else json.dumps(gpu)}")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
