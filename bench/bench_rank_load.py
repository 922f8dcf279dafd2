"""One rank's load and lowering of a large plan: what `TransferExecutor.from_file(...).prepare()` does before any
byte moves, in seconds and memory, for one device, in a fresh process.

    .venv/bin/xmesh-plan compile plans/weight_sync_llama3_70b.problem.toml -o /tmp/70b.plan.npz   # once, minutes
    .venv/bin/python -m bench.bench_rank_load --plan /tmp/70b.plan.npz
    .venv/bin/xmesh-plan compile plans/weight_sync_deepseek_v3.problem.toml -o /tmp/ds.plan.npz   # 5+ GiB, minutes
    .venv/bin/python -m bench.bench_rank_load --plan /tmp/ds.plan.npz --no-whole

For each device measured (by default the source and the destination device with the most operations), a fresh
process reads the compact file's header (`PlanFile.read`), then the device's operations through the file's index,
checks them and lowers them with the passes of the executor's default order for MPI (`passes.rank_program`, as the
MPI engine asks for it: without the group calls only NCCL replays), and reports wall and CPU seconds and its peak
resident memory above what the imports alone take (`--repeat N`: the row of the N such processes with the least CPU
time, the least disturbed by other jobs). `--whole` adds the same device through the whole plan (`read_plan_file`,
then `rank_program` of the plan object, which checks it whole): what a rank pays without the index. Results: bench/results/rank_load.json, one entry per plan (by its problem's name; a run replaces its plan's),
each with the command that measured it, the revision it ran at, and `--made-by`, the command that wrote the plan
file (not recorded when not given).
"""

from __future__ import annotations

import json
import os
import resource
import shlex
import subprocess
import sys
import time
from pathlib import Path

import click

from xmesh_plan.schemas.files import write_atomic

from bench.report import RESULTS as RESULTS_DIR, ROOT, update_benchmarks_doc

RESULTS = RESULTS_DIR / "rank_load.json"


def _rss_mib() -> float:
    """This process's peak resident memory so far, in MiB: Linux's VmHWM (of this program alone; `ru_maxrss` also
    counts what the parent held when it forked this process), else `ru_maxrss`."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(path: str, device: int, whole: bool) -> dict:
    """Load and lower `device`'s part of the plan at `path` in this process (its part alone, or the whole plan)."""
    from xmesh_plan.executor.engines import ENGINES
    from xmesh_plan.executor.passes import rank_program
    from xmesh_plan.executor.plan_file import PlanFile
    from xmesh_plan.executor.transfer_executor import default_order
    from xmesh_plan.schemas import read_plan_file

    base = _rss_mib()
    wall, cpu = time.perf_counter(), time.process_time()
    plan = read_plan_file(path) if whole else PlanFile.read(path)
    order = default_order(plan, "mpi")
    loaded_s = time.perf_counter() - wall
    mpi = ENGINES["mpi"]  # what the MPI engine's prepare() asks for
    program = rank_program(plan, device, order, mpi.concurrent, tag_limit=2**29 - 1, collectives=mpi.collectives)
    seconds, cpu_s = time.perf_counter() - wall, time.process_time() - cpu  # the load and lowering, not the counts below
    return {"device": device, "whole": whole, "order": order, "operations": len({s.op for s in program.steps}),
            "steps": len(program.steps), "messages": program.messages(),
            "header_s" if not whole else "read_s": loaded_s, "seconds": seconds,
            "cpu_s": cpu_s, "peak_rss_mib": _rss_mib(), "imports_rss_mib": base}


def busiest(path: str) -> list[int]:
    """The source device and the destination device with the most operations (read from the file's index)."""
    from xmesh_plan.executor.plan_file import PlanFile
    from xmesh_plan.schemas.plan_compact import _Members
    from xmesh_plan.schemas.plan_check import meshes

    members = _Members(path)
    devices = members.get("index.devices").tolist()
    counts = dict(zip(devices, members.get("index.offsets")[1:] - members.get("index.offsets")[:-1]))
    src, dst = meshes(PlanFile.read(path).problem)
    pick = [max(mesh.devices, key=lambda d: counts.get(d, 0)) for mesh in (src, dst)]
    return list(dict.fromkeys(pick))


def _fresh(path: str, device: int, whole: bool) -> dict:
    """`measure` in a fresh Python process (so the peak memory is this rank's alone)."""
    out = subprocess.run([sys.executable, "-m", "bench.bench_rank_load", "--plan", path, "--one", str(device)]
                         + (["--whole"] if whole else ["--no-whole"]), cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _best(path: str, device: int, whole: bool, repeat: int) -> dict:
    """The `_fresh` row of `repeat` runs with the least CPU time (the least disturbed by the machine's other jobs)."""
    return min((_fresh(path, device, whole) for _ in range(repeat)), key=lambda row: row["cpu_s"])


def plan_entry(path: str, devices: str, whole: bool, made_by: str, rows: list[dict], repeat: int = 1) -> dict:
    """The results entry of one run: the plan's size, the command that wrote the file (`made_by`; None when not
    given: it is not guessed), the command that measured it (shell-quoted, so `shlex.split` gives its arguments
    back), the revision that measured it (`git rev-parse --short HEAD`), and the rows."""
    from xmesh_plan.executor.plan_file import PlanFile
    from xmesh_plan.schemas.plan_compact import _Members

    head = PlanFile.read(path)
    args = [".venv/bin/python", "-m", "bench.bench_rank_load", "--plan", path] + (["--devices", devices] if devices else []) \
        + ([] if whole else ["--no-whole"]) + (["--repeat", str(repeat)] if repeat != 1 else []) + (["--made-by", made_by] if made_by else [])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    return {"plan": head.problem.name, "tensors": len(head.problem.tensor_problems()),
            "operations": _Members(path).text("header")["counts"]["operations"], "file_bytes": os.path.getsize(path),
            "made_by": made_by or None, "command": shlex.join(args), "commit": commit.stdout.strip(), "rows": rows}


@click.command(help=__doc__.splitlines()[0])
@click.option("--plan", "path", required=True, type=click.Path(exists=True, dir_okay=False), help="a compact plan file (*.plan.npz)")
@click.option("--devices", default="", help="comma-separated devices (default: the busiest source and destination device)")
@click.option("--whole/--no-whole", default=True, show_default=True, help="also load the whole plan for the first device")
@click.option("--one", type=int, default=None, hidden=True, help="measure this device in this process and print JSON")
@click.option("--repeat", type=click.IntRange(1), default=1, show_default=True,
              help="fresh processes per row; the one with the least CPU time is kept")
@click.option("--made-by", default="", help="the command that wrote the plan file, as you ran it (default: not recorded)")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=RESULTS, show_default=True, help="results JSON")
def main(path: str, devices: str, whole: bool, one: int | None, repeat: int, made_by: str, out: Path) -> None:
    if one is not None:
        print(json.dumps(measure(path, one, whole)))
        return
    picked = [int(d) for d in devices.split(",") if d] or busiest(path)
    rows = [_best(path, d, False, repeat) for d in picked] + ([_best(path, picked[0], True, repeat)] if whole else [])
    for r in rows:
        print(f"device {r['device']} ({'whole plan' if r['whole'] else 'its part'}): {r['steps']} steps, {r['seconds']:.2f} s "
              f"({r['cpu_s']:.2f} CPU s), peak RSS {r['peak_rss_mib']:.0f} MiB ({r['peak_rss_mib'] - r['imports_rss_mib']:.0f} above imports)")
    entry = plan_entry(path, devices, whole, made_by, rows, repeat)
    name = entry["plan"]
    plans = json.loads(out.read_text())["plans"] if out.exists() else []
    plans = [entry if p["plan"] == name else p for p in plans] + ([] if any(p["plan"] == name for p in plans) else [entry])
    write_atomic(out, json.dumps({"plans": plans}, indent=1) + "\n")
    print(f"written to {out}")
    if Path(out).resolve() == RESULTS.resolve():
        update_benchmarks_doc()


if __name__ == "__main__":
    main()
