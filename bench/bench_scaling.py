"""Scaling: compile time and plan quality (predicted / lower bound) from (2,4) up to (128,8) meshes.

3-D float32 tensors with mixed specs, uneven dims and differently shaped meshes, 8 GPUs per host
(4 for the (2,4) case), one 10 Gbit/s NIC per host. Compile time is wall clock of `compile_plan`
with the default `auto` solver on this machine, which is shared, so times are noisy. The largest
points are optional: `--large` adds (128,8) -> (128,8).

    .venv/bin/python -m bench.bench_scaling [--large]

Writes bench/results/scaling.json and remakes BENCHMARKS.md ("Scale").
"""

from __future__ import annotations

import resource
import sys
import time

from bench.report import update_benchmarks_doc, write_json
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
    points = POINTS + (LARGE if "--large" in sys.argv else [])
    rows = []
    for point in points:
        rows.append(measure(point))
        r = rows[-1]
        print(f"{r['src']} -> {r['dst']} {r['src_spec']} -> {r['dst_spec']}: {r['tasks']} tasks, {r['compile_s']:.2f} s, "
              f"ratio {r['ratio']:.4f} ({r['winner']})", flush=True)
    command = COMMAND + (" --large" if "--large" in sys.argv else "")
    write_json("scaling.json", {"command": command, "points": rows})
    update_benchmarks_doc()


if __name__ == "__main__":
    main()
