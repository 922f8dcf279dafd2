"""Staging memory: the largest staging area on one device, with every staged box at once (posted order) and with
device order reusing a run's staging once the run is done, on the reference plans and the weight-sync examples; plans compiled with
`--max-staging-mb` (the small weight sync too: a multi-tensor plan shares one area per device); and the
executor's time per reshard with and without a limit, measured in one launch per problem.

    .venv/bin/python -m bench.bench_staging [--iters 20]
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import click

from bench.report import update_benchmarks_doc, write_json
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.planner.simulate import simulate_plan
from xmesh_plan.planner.transfer_io import load_any_problem
from xmesh_plan.planner.verify import verify_plan
from xmesh_plan.schemas import Plan, load_plan
from xmesh_plan.schemas.plan import write_atomic
from xmesh_plan.schemas.plan_tensors import is_multi
from xmesh_plan.schemas.staging import staging_peaks

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"
COMMAND = ".venv/bin/python -m bench.bench_staging"
TIMING = re.compile(r"([\d.]+) ms/iter median of \d+ \(min ([\d.]+)\).*staging ([\d.]+) (B|KiB|MiB)/rank")
UNITS = {"B": 2**-10, "KiB": 1, "MiB": 2**10}
LIMITED = {"case3": (64, 16), "case4": (64, 16), "case9": (64, 16),  # the reference plans that stage anything
           "weight_sync_small": (1 / 32, 1 / 128)}  # MiB: a multi-tensor plan (its plain device-order peak is 64 KiB)
SMALL = {"name": "staging_small", "shape": [256, 256, 64], "dtype": "int32", "src": {"mesh": "2x2", "spec": "S0 S1 R"},
         "dst": {"mesh": "2x2", "spec": "R S0 S1"}, "cluster": {"devices_per_host": 2}}  # 16 MiB on 8 ranks, every box strided
SMALL_LIMITS_MB = (1, 0.25)  # half and an eighth of the plain plan's device-order peak (2 MiB)
SYNC = ROOT / "plans" / "weight_sync_small.problem.toml"  # 21 bfloat16 tensors, 7.8 MiB on 8 ranks
SYNC_LIMITS_MB = LIMITED["weight_sync_small"]


def mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f}"


def before_after(name: str, plan: Plan) -> dict:
    posted, device = staging_peaks(plan, "posted"), staging_peaks(plan, "device")
    return {"plan": name, "operations": len(plan.operations), "sum_max_mib": max(posted.values(), default=0) / 2**20,
            "reuse_max_mib": max(device.values(), default=0) / 2**20, "multi": is_multi(plan)}


def limited_rows() -> list[dict]:
    rows = []
    for name, limits in LIMITED.items():
        problem = load_any_problem(next((ROOT / "plans").glob(f"{name}.problem.*")))
        plain = load_plan(ROOT / "plans" / f"{name}.plan.json")
        for limit_mb in limits:
            begin = time.perf_counter()
            plan = compile_plan(problem, max_staging_bytes=int(limit_mb * 2**20))
            seconds = time.perf_counter() - begin
            verify_plan(plan)
            rows.append({"plan": name, "limit_mb": limit_mb, "operations": len(plan.operations), "plain_operations": len(plain.operations),
                         "peak_mib": max(plan.staging.peak_bytes.values(), default=0) / 2**20,
                         "posted_peak_mib": max(staging_peaks(plan, "posted").values(), default=0) / 2**20,
                         "predicted_s": plan.predicted_seconds, "plain_predicted_s": plain.predicted_seconds, "compile_s": seconds})
    return rows


def launch(plans: list[Plan], iters: int, *flags: str) -> list[str]:
    """The executor's timing lines for `plans`, one launch of 8 ranks, every shard checked."""
    with tempfile.TemporaryDirectory(prefix="staging-") as folder:
        paths = [Path(folder) / f"{i}.plan.json" for i in range(len(plans))]
        for path, plan in zip(paths, plans):
            write_atomic(path, plan.to_json())
        cmd = [str(MPIEXEC), "-n", "8", sys.executable, "-m", "xmesh_plan.executor.run", *map(str, paths), "--check",
               *flags, "--iters", str(iters), "--warmup", "2", "--max-mb", "64"]
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                                env={"PYTHONPATH": str(ROOT), "PATH": str(MPIEXEC.parent)})
    lines = [line for line in result.stdout.splitlines() if TIMING.search(line)]
    if result.returncode or len(lines) != len(plans) or result.stdout.count("check ok") != len(plans):
        sys.exit(f"the launch failed (exit {result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return lines


def measured(iters: int, problem, limits_mb, *flags: str) -> dict:
    """`problem` without and with each limit, every plan in one launch of 8 ranks (with `flags`)."""
    plans = [compile_plan(problem)] + [compile_plan(problem, max_staging_bytes=int(mb * 2**20)) for mb in limits_mb]
    lines = launch(plans, iters, *flags)
    found = [TIMING.search(line) for line in lines]
    return {"iters": iters, "lines": lines, "flags": list(flags), "operations": [len(p.operations) for p in plans],
            "median_ms": [float(m.group(1)) for m in found], "min_ms": [float(m.group(2)) for m in found],
            "staging_kib": [float(m.group(3)) * UNITS[m.group(4)] for m in found],
            "posted_kib": [max(staging_peaks(p, "posted").values(), default=0) / 2**10 for p in plans],
            "predicted_ms": [p.predicted_seconds * 1e3 for p in plans],
            "device_order_ms": [simulate_plan(p, "device-order").makespan_s * 1e3 for p in plans]}


def size(nbytes: float) -> str:
    """`64.0 MiB` or `16.0 KiB`: a staging size small weight-sync boxes still show."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 else f"{nbytes / 2**10:.1f} KiB"


def measured_rows(run: dict, labels: list[str]) -> str:
    ms, kib, predicted = run["median_ms"], run["staging_kib"], run["device_order_ms"]
    return "\n".join(f"| {label} | {run['operations'][i]} | {kib[i]:.1f} | {run['posted_kib'][i]:.1f} | {ms[i]:.2f} "
                     f"| {run['min_ms'][i]:.2f} | {predicted[i]:.2f} | {ms[i] / ms[0]:.2f}x | {predicted[i] / predicted[0]:.2f}x |"
                     for i, label in enumerate(labels))


@click.command(help=__doc__.splitlines()[0])
@click.option("--iters", type=int, default=20, show_default=True, help="timed reshards per plan")
def main(**options) -> None:
    args = SimpleNamespace(**options)
    references = [before_after(path.name.removesuffix(".plan.json"), load_plan(path)) for path in sorted((ROOT / "plans").glob("*.plan.json"))]
    llama = compile_plan(load_any_problem(ROOT / "plans" / "weight_sync_llama3_8b.problem.toml"),
                         split_hosts=False, coalesce=False)  # the chained plan BENCHMARKS.md's figures are of
    references.append(before_after("weight_sync_llama3_8b (compiled here)", llama))
    limited = limited_rows()
    run = measured(args.iters, build_problem(SMALL), SMALL_LIMITS_MB, "--order", "device")
    sync = measured(args.iters, load_any_problem(SYNC), SYNC_LIMITS_MB, "--order", "device")
    posted = TIMING.search(launch([compile_plan(load_any_problem(SYNC))], args.iters)[0])  # the plain plan in its default order
    sync["posted_default"] = {"median_ms": float(posted.group(1)), "min_ms": float(posted.group(2)),
                              "staging_kib": float(posted.group(3)) * UNITS[posted.group(4)]}
    for row in references + limited:
        print(row, flush=True)
    print(run, sync, flush=True)
    write_json("staging.json", {"command": COMMAND, "references": references, "limited": limited, "measured": run, "weight_sync": sync})
    update_benchmarks_doc()


if __name__ == "__main__":
    main()
