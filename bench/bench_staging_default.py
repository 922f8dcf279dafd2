"""The staging default: each plan compiled with default flags (no staging limit: posted) and with `--max-staging-mb 1024`
(posted within a window of 1024 MiB per device, `executor/window.py`) in one process, on cuts of the frontier weight syncs (bench/bench_frontier.py's `--layers`) and on the committed reference
problems (`make plans`).

For each: operations, the host-order prediction and the time in the executor's default order for the plan (posted,
within the staging limit where the plan states one) over the byte bound, the busiest device's staging in that order,
and for a limited plan its time in device order (the order the torch and NCCL engines run it in). A multi-tensor plan given no limit runs posted; `xmesh-plan compile` names `--max-staging-mb` where a device stages
more than `POSTED_STAGING_WARN_BYTES` so (`planner/compile_defaults.py`), and this measures what that limit costs.

    .venv/bin/python -m bench.bench_staging_default
"""

from __future__ import annotations

import time
import tomllib

import click

from bench.bench_frontier import problem_text
from bench.report import ROOT, update_benchmarks_doc, write_json
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.compile_defaults import POSTED_STAGING_WARN_BYTES
from xmesh_plan.planner.simulate import simulate_plan
from xmesh_plan.planner.transfer_io import build_transfer, load_any_problem
from xmesh_plan.schemas.staging import staging_peaks

COMMAND = ".venv/bin/python -m bench.bench_staging_default"
CUTS = (("weight_sync_llama3_70b", 16), ("weight_sync_deepseek_v3", 4), ("weight_sync_kimi_k2", 4))  # (problem, layers)


def figures(plan, cpu_s: float) -> dict:
    """What one compile gives: its operations, times over the bound, and the busiest device's staging in the executor's order
    (with a limit, also its time in device order)."""
    stated = plan.executor_prediction
    order = stated.order if stated else "device"
    peaks = staging_peaks(plan, order)
    return {"operations": len(plan.operations), "compile_cpu_s": cpu_s,
            "limit_mib": plan.staging.limit_bytes / 2**20 if plan.staging else None,
            "predicted_over_bound": plan.predicted_seconds / plan.lower_bound_seconds if plan.lower_bound_seconds else None,
            "executor_order": order,
            "executor_over_bound": stated.predicted_seconds / plan.lower_bound_seconds if stated else None,
            "staging_mib": max(peaks.values(), default=0) / 2**20,
            "device_over_bound": simulate_plan(plan, "device-order").makespan_s / plan.lower_bound_seconds
            if plan.staging and plan.lower_bound_seconds else None,
            "posted_mib": max(staging_peaks(plan, "posted").values(), default=0) / 2**20}


def both(problem) -> dict:
    """`figures` with default flags and with the warning threshold as the staging limit, the same problem object in the
    same process."""
    out = {}
    for label, options in (("default", {}), ("limited", {"max_staging_bytes": POSTED_STAGING_WARN_BYTES})):
        cpu = time.process_time()
        plan = compile_plan(problem, **options)
        out[label] = figures(plan, time.process_time() - cpu)
    return out


@click.command(help=__doc__.splitlines()[0])
@click.option("--cuts/--no-cuts", default=True, show_default=True, help="measure the frontier cuts (minutes)")
def main(cuts: bool) -> None:
    points = []
    for name, layers in CUTS if cuts else ():
        problem = build_transfer(tomllib.loads(problem_text(name, layers)))
        points.append({"problem": name, "layers": layers, **both(problem)})
        print(points[-1], flush=True)
    references = []
    for path in sorted((ROOT / "plans").glob("*.problem.*")):
        name = path.name.split(".problem.")[0]
        if not (ROOT / "plans" / f"{name}.plan.json").exists():
            continue
        references.append({"problem": name, **both(load_any_problem(path))})
        print(references[-1], flush=True)
    write_json("staging_default.json", {"command": COMMAND, "limit_mib": POSTED_STAGING_WARN_BYTES / 2**20,
                                        "cuts": points, "references": references})
    update_benchmarks_doc()


if __name__ == "__main__":
    main()
