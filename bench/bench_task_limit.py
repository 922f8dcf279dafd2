"""Task limit: peak memory and time per unit task of a full compile, and how fast a too-large problem is refused.

Each size runs in a fresh process (so its peak RSS is its own) through what `xmesh-plan compile -o`
does: cut, cost, schedule, assemble, verify, write the JSON. Meshes (H, 4) -> (H, 4), `S0 S1 R ->
R S0 S1`, float32, default `auto` solver, no task limit. The default `--max-tasks`
(`planner.unit_tasks.DEFAULT_MAX_TASKS`) is chosen from these figures.

    .venv/bin/python -m bench.bench_task_limit            # 4 sizes up to 65,536 tasks, about 1.5 minutes
    .venv/bin/python -m bench.bench_task_limit --large    # adds 130,312, 262,144 and 470,592 tasks (about 10 minutes, 3.6 GiB)
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from bench.report import ROOT, update_benchmarks_doc, write_json
from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.planner.unit_tasks import DEFAULT_MAX_TASKS, TooManyTasksError, check_task_count

HOSTS = [16, 32, 64, 128]  # (H, 4) meshes: 4 H^2 unit tasks
LARGE = [181, 256, 354]
REFUSED = {"shape": "4096,4096,512", "dtype": "float32", "src": {"mesh": "1000x4", "spec": "S0 S1 R"},
           "dst": {"mesh": "1000x4", "spec": "R S0 S1"}}  # the 1000x4 -> 1000x4 problem
COMMAND = ".venv/bin/python -m bench.bench_task_limit"


def raw_problem(hosts: int) -> dict:
    return {"shape": [8192, 8192, 64], "dtype": "float32", "src": {"mesh": f"{hosts}x4", "spec": "S0 S1 R"},
            "dst": {"mesh": f"{hosts}x4", "spec": "R S0 S1"}}


def one(hosts: int, out: str) -> dict:
    """Compile, verify and write one size in this process; stage times and the process's peak RSS."""
    from xmesh_plan.planner.compile import compile_plan
    from xmesh_plan.planner.verify import verify_plan
    from xmesh_plan.schemas.plan import write_atomic

    problem = build_problem(raw_problem(hosts))
    begin = time.perf_counter()
    plan = compile_plan(problem, max_tasks=None)
    compiled = time.perf_counter()
    verify_plan(plan)
    verified = time.perf_counter()
    write_atomic(out, plan.to_json())
    written = time.perf_counter()
    return {"mesh": f"{hosts}x4", "tasks": len(plan.tasks), "operations": len(plan.operations),
            "compile_s": compiled - begin, "verify_s": verified - compiled, "write_s": written - verified,
            "total_s": written - begin, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "plan_mib": Path(out).stat().st_size / 2**20}


def measure(hosts: int) -> dict:
    out = Path("/tmp") / f"bench_task_limit_{hosts}.plan.json"
    child = subprocess.run([sys.executable, "-m", "bench.bench_task_limit", "--one", str(hosts), str(out)], cwd=ROOT,
                           capture_output=True, text=True, check=True)
    out.unlink(missing_ok=True)
    return json.loads(child.stdout)


def refusal() -> dict:
    """Seconds from the raw problem to the refusal, on the issue's 1000x4 -> 1000x4 problem."""
    begin = time.perf_counter()
    try:
        check_task_count(build_problem(REFUSED), DEFAULT_MAX_TASKS)
    except TooManyTasksError as err:
        return {"seconds": time.perf_counter() - begin, "message": str(err)}
    raise AssertionError("the 1000x4 -> 1000x4 problem was not refused")


def main() -> None:
    if sys.argv[1:2] == ["--one"]:
        print(json.dumps(one(int(sys.argv[2]), sys.argv[3])))
        return
    large = "--large" in sys.argv
    rows = []
    for hosts in HOSTS + (LARGE if large else []):
        rows.append(measure(hosts))
        r = rows[-1]
        print(f"{r['mesh']}: {r['tasks']} tasks, {r['total_s']:.1f} s, peak {r['peak_rss_mib']:.0f} MiB", flush=True)
    refused = refusal()
    print(f"refused in {refused['seconds'] * 1e3:.1f} ms: {refused['message']}")
    command = COMMAND + (" --large" if large else "")
    write_json("task_limit.json", {"command": command, "points": rows, "refusal": refused})
    update_benchmarks_doc()


if __name__ == "__main__":
    main()
