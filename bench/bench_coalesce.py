"""Coalesced messages: the 32x8 all-to-all of bench_scaling.py (POINTS[7]) compiled with and without
`--coalesce`, predicted time against the byte bound, and the cross-host messages on the busiest NIC side.

    .venv/bin/python -m bench.bench_coalesce
"""

from __future__ import annotations

import time

from bench.bench_scaling import POINTS, problem
from bench.report import update_benchmarks_doc, write_json
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.simulate import simulate_plan
from xmesh_plan.planner.verify import verify_plan
from xmesh_plan.schemas.op_kinds import route

COMMAND = ".venv/bin/python -m bench.bench_coalesce"
POINT = POINTS[7]  # 32x8 S0 R S1 -> 32x8 R S01 R, 4096x4096x64 float32: 65,536 unit tasks of 64 KiB


def busiest_send_side(plan) -> tuple[int, int]:
    """(host, cross-host messages it sends) for the host sending the most, from every operation's route."""
    host_of, count = plan.problem.cluster.host_of, {}
    for op in plan.operations:
        for hop in route(op):
            if host_of(hop.src) != host_of(hop.dst):
                count[host_of(hop.src)] = count.get(host_of(hop.src), 0) + 1
    host = max(sorted(count), key=count.get)
    return host, count[host]


def measure(coalesce: bool, bucket_mb: float = 4.0) -> dict:
    p = problem(*POINT)
    begin = time.perf_counter()
    plan = compile_plan(p, coalesce=coalesce, bucket_bytes=int(bucket_mb * 2**20))
    seconds = time.perf_counter() - begin
    verify_plan(plan)
    host, messages = busiest_send_side(plan)
    return {"coalesce": coalesce, "bucket_mb": bucket_mb if coalesce else None, "tasks": len(plan.tasks),
            "operations": len(plan.operations), "compile_s": seconds, "predicted_s": plan.predicted_seconds,
            "lower_bound_s": plan.lower_bound_seconds, "ratio": plan.predicted_seconds / plan.lower_bound_seconds,
            "busiest_host": host, "busiest_messages": messages, "timed_by": plan.solver.details.get("timed_by", ""),
            **{f"{order}_ratio": simulate_plan(plan, order).makespan_s / plan.lower_bound_seconds for order in ("device-order", "posted")}}


def main() -> None:
    rows = [measure(False), measure(True, 4.0), measure(True, 1.0)]
    for r in rows:
        print(r, flush=True)
    write_json("coalesce.json", {"command": COMMAND, "rows": rows})
    update_benchmarks_doc()


if __name__ == "__main__":
    main()
