"""Scaling: compile time and plan quality (predicted / lower bound) from (2,4) up to (128,8) meshes.

3-D float32 tensors with mixed specs, uneven dims and differently shaped meshes, 8 GPUs per host
(4 for the (2,4) case), one 10 Gbit/s NIC per host. Compile time is wall clock of `compile_plan`
with the default `auto` solver on this machine, which is shared, so times are noisy. The largest
points are optional: `--large` adds (128,8) -> (128,8).

    .venv/bin/python -m bench.bench_scaling [--large]
    .venv/bin/python -m bench.bench_scaling --render   # the BENCHMARKS.md section again from bench/results/scaling.json
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path


from bench.report import replace_section, write_json
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.schemas import Cluster, DeviceMesh, Placement, ReshardingProblem

POINTS = [  # src mesh, dst mesh, src spec, dst spec, tensor shape
    ((2, 4), (2, 4), "R S0 R", "S0 R R", (1024, 1024, 512)),
    ((4, 8), (4, 8), "S0 S1 R", "R S0 S1", (4096, 4096, 256)),
    ((4, 8), (2, 8), "R S01 R", "S1 R S0", (4000, 3000, 250)),
    ((8, 8), (8, 8), "R S01 R", "S01 R R", (4096, 4096, 256)),
    ((16, 8), (8, 8), "S0 R S1", "S1 S0 R", (5000, 3000, 250)),
    ((32, 8), (16, 8), "S0 R S1", "S1 S0 R", (8192, 4096, 256)),
    ((32, 8), (32, 8), "R S0 S1", "S0 S1 R", (8192, 4096, 256)),
    ((32, 8), (32, 8), "S0 R S1", "R S01 R", (4096, 4096, 64)),  # all-to-all of small tasks: latency-bound
    ((64, 8), (32, 8), "S01 R R", "R S0 R", (8000, 8000, 64)),
    ((64, 8), (64, 8), "S0 S1 R", "R S0 S1", (8192, 8192, 64)),
]
LARGE = [((128, 8), (128, 8), "S0 S1 R", "R S0 S1", (8192, 8192, 64))]
COMMAND = ".venv/bin/python -m bench.bench_scaling"


def mesh(shape, first_host, per_host):
    return DeviceMesh(shape=shape, devices=tuple((first_host + h) * per_host + g for h in range(shape[0]) for g in range(shape[1])))


def problem(src, dst, src_spec, dst_spec, shape) -> ReshardingProblem:
    per_host = src[1]
    return ReshardingProblem(shape=shape, dtype="float32", cluster=Cluster(devices_per_host=per_host),
                             src=Placement(mesh=mesh(src, 0, per_host), spec=src_spec),
                             dst=Placement(mesh=mesh(dst, src[0], per_host), spec=dst_spec))


def measure(point) -> dict:
    src, dst, src_spec, dst_spec, shape = point
    p = problem(*point)
    begin = time.perf_counter()
    plan = compile_plan(p)
    seconds = time.perf_counter() - begin
    return {"src": f"{src[0]}x{src[1]}", "dst": f"{dst[0]}x{dst[1]}", "src_spec": src_spec, "dst_spec": dst_spec,
            "shape": "x".join(map(str, shape)), "tasks": len(plan.tasks), "compile_s": seconds,
            "predicted_s": plan.predicted_seconds, "lower_bound_s": plan.lower_bound_seconds,
            "ratio": plan.predicted_seconds / plan.lower_bound_seconds, "winner": plan.solver.details.get("winner", ""),
            "task_mib": sum(t.nbytes for t in plan.tasks) / len(plan.tasks) / 2**20,
            "overhead_share": p.cluster.overhead_s / (sum(t.end_s - t.start_s for t in plan.tasks) / len(plan.tasks)),
            "timed_by": plan.solver.details.get("timed_by", ""),
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def main() -> None:
    if "--render" in sys.argv:  # the section again from the last results file, no measuring
        data = json.loads((Path(__file__).resolve().parent / "results" / "scaling.json").read_text())
        return render(data["points"], data["command"])
    points = POINTS + (LARGE if "--large" in sys.argv else [])
    rows = []
    for point in points:
        rows.append(measure(point))
        r = rows[-1]
        print(f"{r['src']} -> {r['dst']} {r['src_spec']} -> {r['dst_spec']}: {r['tasks']} tasks, {r['compile_s']:.2f} s, "
              f"ratio {r['ratio']:.4f} ({r['winner']})", flush=True)
    command = COMMAND + (" --large" if "--large" in sys.argv else "")
    write_json("scaling.json", {"command": command, "points": rows})
    render(rows, command)


def render(rows: list[dict], command: str) -> None:
    lines = "\n".join(
        f"| {r['src']} {r['src_spec']} | {r['dst']} {r['dst_spec']} | {r['shape']} | {r['tasks']} | {r['compile_s']:.2f} "
        f"| {r['ratio']:.4f} | {r['task_mib']:.3f} | {r['overhead_share']:.1%} | {r['winner']} | {r['timed_by']} | {r['peak_rss_mib']:.0f} |" for r in rows)
    replace_section("Scaling", f"""
Made by (2-core CPU machine shared with other jobs, so compile times are noisy):

```
{command}
```

Compile time (wall clock of `compile_plan`, default `auto` solver, including decomposition, the
simulator and plan assembly) and quality (predicted / lower bound) against the unit-task count.
8 GPUs per host except the first row; one 10 Gbit/s NIC per host. Peak RSS is the process's high-water
mark after the row (rows run in order of size, so the last row's is its own peak). Every row is timed by
the network simulator (the limit is 250,000 operations). Raw: `bench/results/scaling.json`.

| source | destination | tensor | unit tasks | compile s | predicted / bound | MiB per task | overhead share of a task | winner | timed by | peak RSS MiB |
|---|---|---|---:|---:|---:|---:|---:|---|---|---:|
{lines}

The lower bound counts bandwidth only, while the model charges every message an overhead (1 us) on
the links it crosses, besides a latency (20 us) other messages overlap; "overhead share" is that
overhead over the mean task time. Where tasks shrink to a few hundred KiB or less the gap to the
bound is mostly this per-message cost, not the order: in the 32x8 `S0 R S1 -> R S01 R` row (an
all-to-all of 64 KiB boxes) host 0's send side carries 2048 messages x 1 us = 2 ms of the 2 ms
between the prediction and the bound (`xmesh-plan inspect`); `--coalesce` closes it (BENCHMARKS.md,
"Coalesced messages"). Until fb54710 the model made every message hold its NIC for the whole 20 us
latency, and these rows sat at up to 1.38x (32x8 all-to-all) and 1.19x ((128,8) -> (128,8)).

Compile runs with Python's cyclic garbage collector paused (planner/compile.py, since 8f2f932): the
run just before that change took 32.2 s for (128,8) -> (128,8) and 14.5 s for (64,8) -> (64,8), at
load average 11-25 (`bench/results/scaling.json` in git history); this run, at load 7-10, 8.7 s and 2.1 s.
""")


if __name__ == "__main__":
    main()
