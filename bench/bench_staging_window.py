"""Limited plans timed posted within a staging window (the MPI engine's order) and in device order (torch's, NCCL's).

Each cut is compiled with `--max-staging-mb W` and timed by the simulator posted (every staged box at once), in device
order (the torch and NCCL engines' order for a plan that states a limit) and posted within a window of W bytes per device
(the MPI engine's order, `executor.window`; `planner.simulate.window_waits`), over the byte bound, with the busiest
device's staging in each.

    .venv/bin/python -m bench.bench_staging_window
    .venv/bin/python -m bench.bench_staging_window --cut weight_sync_deepseek_v3:4 --window-mb 1024

Writes bench/results/staging_window.json (a point measured again replaces its row), then remakes BENCHMARKS.md.
"""

from __future__ import annotations

import json
import time
import tomllib

import click

from bench.bench_frontier import problem_text
from bench.report import RESULTS, update_benchmarks_doc, write_json
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.simulate import nic_assignment, simulate, staging_runs
from xmesh_plan.planner.transfer_io import build_transfer
from xmesh_plan.schemas.staging import footprints, staging_align, staging_peaks, window_peak

COMMAND = ".venv/bin/python -m bench.bench_staging_window"
CUTS = ("weight_sync_llama3_70b:16", "weight_sync_deepseek_v3:4", "weight_sync_kimi_k2:4")
WINDOWS_MIB = (1024, 256)


def timed(plan, discipline: str, **options) -> tuple[float, float]:
    """(time over the bound, CPU seconds of the simulation)."""
    cpu = time.process_time()
    seconds = simulate(plan.operations, plan.problem, discipline, nic_assignment(plan.host_order), **options).makespan_s
    return seconds / plan.lower_bound_seconds, time.process_time() - cpu


def point(name: str, layers: int, window_mib: int) -> dict:
    """One cut compiled with the window as its staging limit, timed in the three orders."""
    limit = window_mib * 2**20
    problem = build_transfer(tomllib.loads(problem_text(name, layers)))
    cpu = time.process_time()
    plan = compile_plan(problem, max_staging_bytes=limit)
    compile_s = time.process_time() - cpu
    posted, posted_s = timed(plan, "posted")
    device, device_s = timed(plan, "device-order", run_numbers=staging_runs(plan))
    window, window_s = timed(plan, "window", window_bytes=limit)
    align = staging_align(plan)
    peak = max((window_peak([n for _, n in f], limit, align) for f in footprints(plan).values()), default=0)
    return {"problem": name, "layers": layers, "window_mib": window_mib, "operations": len(plan.operations),
            "compile_cpu_s": round(compile_s, 1), "predicted_over_bound": plan.predicted_seconds / plan.lower_bound_seconds,
            "posted_over_bound": posted, "device_over_bound": device, "window_over_bound": window,
            "posted_mib": max(staging_peaks(plan.model_copy(update={"staging": None}), "posted").values(), default=0) / 2**20,
            "device_mib": max(staging_peaks(plan, "device").values(), default=0) / 2**20,
            "window_mib_peak": peak / 2**20,
            "simulate_cpu_s": {"posted": round(posted_s, 1), "device": round(device_s, 1), "window": round(window_s, 1)}}


@click.command(help=__doc__.splitlines()[0])
@click.option("--cut", "cuts", multiple=True, default=CUTS, show_default=True, help="problem:layers")
@click.option("--window-mb", "windows", multiple=True, type=int, default=WINDOWS_MIB, show_default=True)
def main(cuts: tuple[str, ...], windows: tuple[int, ...]) -> None:
    path = RESULTS / "staging_window.json"
    rows = json.loads(path.read_text())["points"] if path.exists() else []
    for cut in cuts:
        name, layers = cut.split(":")
        for w in windows:
            row = point(name, int(layers), w)
            print(json.dumps(row), flush=True)
            rows = [r for r in rows if (r["problem"], r["layers"], r["window_mib"]) != (name, int(layers), w)] + [row]
            write_json("staging_window.json", {"command": COMMAND, "points": rows})
    update_benchmarks_doc()


if __name__ == "__main__":
    main()
