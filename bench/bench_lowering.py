"""Executor `prepare()` cost: time to lower a plan into one device's steps, on plans with many operations.

    .venv/bin/python -m bench.bench_lowering                    # about 20 s
    .venv/bin/python -m bench.bench_lowering --compare 80312b2  # also times executor/lower.py of that revision (1 min)

Each plan gathers a tensor sharded over many source devices onto one host (`local_allgather`), so
the busiest destination device receives hundreds of boxes and then all-gathers them: every part it
sends must wait for the steps that wrote it, which is what made lowering quadratic. The time is the
best of `--repeat` runs of `lower(plan, device)` for that device; `--compare REV` loads the lowering
module of git revision REV and times it in the same run, interleaved. Results: bench/results/lowering.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from bench.report import best_seconds, compare_command, module_at

from xmesh_plan.schemas.files import write_atomic
from xmesh_plan.executor.lower import lower
from xmesh_plan.executor.ranks import plan_devices
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.problem_io import build_problem

ROOT = Path(__file__).resolve().parents[1]

CASES = [  # (source hosts, tensor shape): 4 devices per host, `S01 R R` gathered onto one host as `R R R`
    (64, (4096, 4096, 64)),
    (128, (4096, 4096, 64)),
    (256, (4096, 4096, 64)),
]


def gather_plan(hosts: int, shape: tuple[int, ...]):
    problem = build_problem({"name": f"gather{hosts}x4", "shape": list(shape), "dtype": "float32",
                             "src": {"mesh": f"{hosts}x4", "spec": "S01 R R"},
                             "dst": {"mesh": "1x4", "spec": "R R R"},
                             "cluster": {"devices_per_host": 4}})
    return compile_plan(problem, strategy="local_allgather", seed=0)


@compare_command(__doc__, "executor/lower.py", "lowering.json")
def main(**options) -> None:
    args = SimpleNamespace(**options)
    before = module_at(args.compare, "executor/lower.py", "xmesh_plan.executor.lower_compared") if args.compare else None
    rows = []
    for hosts, shape in CASES:
        plan = gather_plan(hosts, shape)
        counts = {d: len(lower(plan, d).steps) for d in plan_devices(plan)}
        device = max(counts, key=counts.get)
        steps = counts[device]
        row = {"plan": plan.problem.name, "operations": len(plan.operations), "device": device, "steps": steps,
               "lower_s": best_seconds(lambda: lower(plan, device), args.repeat)}
        if before is not None:
            row["before_s"] = best_seconds(lambda: before.lower(plan, device, tag_limit=2**29 - 1), args.repeat)
        rows.append(row)
        print(row, flush=True)
    head = "| plan | operations | busiest device | its steps | lower() |" + (f" before ({args.compare}) | after/before |" if before else "")
    print("\n" + head + "\n|---|---:|---:|---:|---:|" + ("---:|---:|" if before else ""))
    for r in rows:
        line = f"| {r['plan']} | {r['operations']} | {r['device']} | {r['steps']} | {r['lower_s']:.3f} s |"
        if before is not None:
            line += f" {r['before_s']:.3f} s | {r['lower_s'] / r['before_s']:.2f} |"
        print(line)
    write_atomic(args.out, json.dumps({"compared_with": args.compare, "rows": rows}, indent=1) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
