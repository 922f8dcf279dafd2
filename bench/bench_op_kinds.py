"""The planner's hot paths that read the table of operation kinds, timed against a git revision in one run.

    .venv/bin/python -m bench.bench_op_kinds                 # this tree only
    .venv/bin/python -m bench.bench_op_kinds --compare REV   # also REV's modules, interleaved (about 1 min)

The simulator takes each operation's flows from its kind's `route` in `schemas/op_kinds.py`, and the
strategies their links from `wire_pairs`. This times, on the same plans and
interleaved, `simulate_plan` and every strategy on every unit task (what `compile` runs per task)
with the modules of this tree and of revision REV (`planner/simulate.py`, `planner/strategies.py`,
loaded from git). Best of `--repeat`, the versions taking turns. Results: bench/results/op_kinds.json. For the executor's
lowering see bench/bench_lowering.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from bench.report import best_seconds, compare_command, module_at

from xmesh_plan.schemas.files import write_atomic
from xmesh_plan.planner import simulate as simulate_now
from xmesh_plan.planner import strategies as strategies_now
from xmesh_plan.planner.compile import _sender_per_host, compile_plan
from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.planner.unit_tasks import decompose

ROOT = Path(__file__).resolve().parents[1]

CASES = [  # (name, source mesh, source spec, destination mesh, destination spec, shape, strategy)
    ("all-to-all 32x4", "32x4", "S0 R", "32x4", "R S0", (4096, 4096), "auto"),
    ("broadcast 8x4 -> 8x4", "8x4", "S0 R", "8x4", "R R", (8192, 1024), "broadcast"),
    ("gather 64x4 local_allgather", "64x4", "S01 R R", "1x4", "R R R", (4096, 4096, 64), "local_allgather"),
    ("global_allgather 8x4 -> 8x4", "8x4", "S01 R", "8x4", "R R", (8192, 1024), "global_allgather"),
]


def contexts(problem, strategies):
    """Every (unit task, sender host) a compile tries, as strategy inputs."""
    out = []
    for cell in decompose(problem):
        for _, device in sorted(_sender_per_host(cell, problem).items()) if cell.receivers and cell.senders else ():
            out.append(strategies.TaskContext(cell.region, cell.nbytes(problem.itemsize), device, cell.receivers,
                                              problem.cluster, problem.itemsize))
    return out


def run_strategies(module, ctxs) -> None:
    module._pipelined_seconds.cache_clear()
    for ctx in ctxs:
        for fn in module.STRATEGIES.values():
            fn(ctx)


@compare_command(__doc__, "the simulator and strategies", "op_kinds.json")
def main(**options) -> None:
    args = SimpleNamespace(**options)
    versions = [("now", simulate_now, strategies_now)]
    if args.compare:
        versions.append(("before", module_at(args.compare, "planner/simulate.py", "xmesh_plan.planner.simulate_compared"),
                         module_at(args.compare, "planner/strategies.py", "xmesh_plan.planner.strategies_compared")))
    rows = []
    for name, src_mesh, src_spec, dst_mesh, dst_spec, shape, strategy in CASES:
        problem = build_problem({"name": name, "shape": list(shape), "dtype": "float32", "cluster": {"devices_per_host": 4},
                                 "src": {"mesh": src_mesh, "spec": src_spec}, "dst": {"mesh": dst_mesh, "spec": dst_spec}})
        plan = compile_plan(problem, strategy=strategy, solver="greedy", seed=0)
        ctxs = contexts(problem, strategies_now)
        timed = [sim.simulate_plan(plan) for _, sim, _ in versions]
        assert all((t.makespan_s, t.op_start_s, t.op_end_s, t.flows) == (timed[0].makespan_s, timed[0].op_start_s, timed[0].op_end_s,
                                                                         timed[0].flows) for t in timed), "the simulators disagree"
        row = {"case": name, "operations": len(plan.operations), "flows": simulate_now.simulate_plan(plan).flows, "tasks": len(ctxs)}
        for _ in range(args.repeat):  # interleaved, so a burst of load on this shared machine hits both versions
            for label, sim, strat in versions:
                for what, fn in (("simulate", lambda: sim.simulate_plan(plan)), ("strategies", lambda: run_strategies(strat, ctxs))):
                    key = f"{what}_{label}_s"
                    row[key] = min(row.get(key, float("inf")), best_seconds(fn, 1))
        rows.append(row)
        print(row, flush=True)
    if args.compare:
        table(rows, args.compare)
    write_atomic(args.out, json.dumps({"compared_with": args.compare, "rows": rows}, indent=1) + "\n")
    print(f"written to {args.out}")


def table(rows: list[dict], rev: str) -> None:
    print(f"\n| plan | operations | flows | simulate_plan | before ({rev}) | now/before | every strategy, every task (tasks) | before | now/before |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['case']} | {r['operations']} | {r['flows']} | {r['simulate_now_s']:.3f} s | {r['simulate_before_s']:.3f} s | "
              f"{r['simulate_now_s'] / r['simulate_before_s']:.2f} | {r['strategies_now_s']:.3f} s ({r['tasks']}) | "
              f"{r['strategies_before_s']:.3f} s | {r['strategies_now_s'] / r['strategies_before_s']:.2f} |")


if __name__ == "__main__":
    main()
