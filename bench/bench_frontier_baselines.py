"""Frontier scale, beside ours: what the RL frameworks' weight syncs take on the same problems, in the same network model.

For each frontier problem (`plans/weight_sync_*.problem.toml`, or `--layers N` of it as `bench.bench_frontier` cuts
it), in a fresh process, with 8 x 400 Gbit/s NICs per host and 2400 Gbit/s between the GPUs of a host:
- the byte bound of the problem (`baseline_bounds.problem_bound`: what a compile states, made from each kind of tensor
  once, so it holds for a problem too large to compile here) and the bytes that cross (FP8 destinations count their
  converted bytes);
- checkpoint-engine's broadcast (`baselines.py`, `checkpoint-engine-broadcast`: every source rank broadcasts the
  blocks it holds to every inference rank, which keeps its part) and rank-0 gather then broadcast
  (`rank0-gather-broadcast`), each at its least time in the model from its bytes over the links and devices it uses
  (`baseline_bounds.baseline_estimate`: the busiest NIC side, device port or device; no latency, per-message overhead
  or pipeline fill, so at most what the simulator gives the same operations: it favours the baseline), with what sets it;
- one plan per tensor back to back: our planner on each tensor alone (default flags), simulated in device order, one
  tensor after another; tensors of one kind (shape, dtypes, layouts) have the same plan, so one per kind is compiled
  and its time multiplied by the kind's count (`baseline_bounds.per_tensor_plans_seconds`);
- with `--simulate` (cuts only: millions of chunk messages at full size), the simulator's device-order time of the two
  broadcast baselines' operation lists, to show how far above their estimate they run.
Our plan's time is the frontier row of the same problem and cut (`bench.bench_frontier`, in frontier.json or
frontier-shrunk.json), in the executor's order where the plan states it.

    .venv/bin/python -m bench.bench_frontier_baselines                       # all frontier problems, full size
    .venv/bin/python -m bench.bench_frontier_baselines --layers 1 --simulate --problems weight_sync_llama3_70b

Adds each point to bench/results/frontier-baselines.json as it is measured (a point measured again replaces its
row), then remakes BENCHMARKS.md.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
import tomllib

import click

from bench.bench_frontier import problem_text
from bench.report import ROOT, update_benchmarks_doc, write_json

PROBLEMS = ("weight_sync_llama3_70b", "weight_sync_deepseek_v3", "weight_sync_kimi_k2")
BROADCASTS = ("checkpoint-engine-broadcast", "rank0-gather-broadcast")
COMMAND = ".venv/bin/python -m bench.bench_frontier_baselines"
OUT = "frontier-baselines.json"


def one(name: str, layers: int, simulate: bool, per_tensor: bool) -> dict:
    """Every figure of one problem, in this process."""
    from xmesh_plan.planner.baseline_bounds import baseline_estimate, per_tensor_plans_seconds, problem_bound
    from xmesh_plan.planner.baselines import baseline_seconds
    from xmesh_plan.planner.transfer_io import build_transfer

    begin = time.perf_counter()
    problem = build_transfer(tomllib.loads(problem_text(name, layers)))
    singles = problem.tensor_problems()
    bound = problem_bound(problem)
    point = {"problem": name, "layers": layers or None, "tensors": len(singles), "gib": problem.nbytes / 2**30,
             "wire_gib": sum(s.nbytes for s in singles) / 2**30, "bound_s": bound.seconds, "bound_reason": bound.reason,
             "baselines": {}}
    for baseline in BROADCASTS:
        estimate = baseline_estimate(problem, baseline)
        point["baselines"][baseline] = {"estimate_s": estimate.seconds, "busiest": estimate.busiest}
        if simulate:
            point["baselines"][baseline]["simulated_s"] = baseline_seconds(problem, baseline, max_tasks=None)
    if per_tensor:
        plans = per_tensor_plans_seconds(problem)
        point["per_tensor"] = {"seconds": plans.seconds, "kinds": [list(k) for k in plans.kinds]}
    return point | {"seconds": time.perf_counter() - begin, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


@click.command()
@click.option("--problems", default=",".join(PROBLEMS), show_default=True, help="comma-separated problem names")
@click.option("--layers", type=click.IntRange(0), default=0, show_default=True, help="cuts of N layers (0: full size)")
@click.option("--simulate", is_flag=True, help="also simulate the broadcast baselines (cuts only: slow at full size)")
@click.option("--per-tensor/--no-per-tensor", default=True, show_default=True, help="time one plan per tensor back to back")
@click.option("--timeout", "timeout_s", type=click.FloatRange(1), default=3600, show_default=True, help="seconds per point")
@click.option("--one", "single", default=None, hidden=True, help="measure one problem in this process (used by the parent)")
def main(problems: str, layers: int, simulate: bool, per_tensor: bool, timeout_s: float, single: str | None) -> None:
    """The frontier problems' baselines, each problem in a fresh process; write the results and BENCHMARKS.md."""
    if single is not None:
        print(json.dumps(one(single, layers, simulate, per_tensor)))
        return
    names = [n for n in problems.split(",") if n]
    unknown = [n for n in names if n not in PROBLEMS]
    if unknown:
        raise click.BadParameter(f"{unknown[0]!r}; choose from {', '.join(PROBLEMS)}", param_hint="--problems")
    flags = (f" --layers {layers}" if layers else "") + (" --simulate" if simulate else "") + ("" if per_tensor else " --no-per-tensor")
    path = ROOT / "bench" / "results" / OUT
    points = json.loads(path.read_text())["points"] if path.exists() else []
    for name in names:
        args = [sys.executable, "-m", "bench.bench_frontier_baselines", "--one", name, "--layers", str(layers)]
        args += (["--simulate"] if simulate else []) + ([] if per_tensor else ["--no-per-tensor"])
        child = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        if child.returncode:
            raise click.ClickException(f"{name}: the point failed:\n{child.stderr[-2000:]}")
        point = json.loads(child.stdout.splitlines()[-1])
        print(json.dumps(point), flush=True)
        points = [p for p in points if (p["problem"], p["layers"]) != (name, layers or None)]
        points.append({**point, "command": COMMAND + (f" --problems {name}" if len(names) < len(PROBLEMS) else "") + flags})
        points.sort(key=lambda p: (PROBLEMS.index(p["problem"]), p["layers"] or 0))
        write_json(OUT, {"command": COMMAND, "points": points})
    update_benchmarks_doc()


if __name__ == "__main__":
    main()
