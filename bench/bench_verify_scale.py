"""verify and the compact plan file at scale: a synthetic plan of N operations (default 10^6), verified and written.

The plan moves a (N * rows_per_op, 64) float32 tensor between two 8-device meshes on 4-device hosts, row-sharded on
both; each operation broadcasts one row from the source device that holds it down the chain of the two destination
devices that need it (the destination mesh is 4 x 2, rows sharded over its first axis). It is built directly as records (no compile: compiling 10^6 tasks is issue 29's
other part), so the figures are verify's and the file's alone.

    .venv/bin/python -m bench.bench_verify_scale [--ops 1000000] [--out plan.npz]
    .venv/bin/python -m bench.bench_verify_scale --cli plan.npz [--record after]

With `--cli FILE` it times `xmesh-plan verify FILE` in a fresh process instead (what a user runs: read + verify):
CPU seconds (user + system), wall seconds and peak RSS of that process; `--record LABEL` keeps the figures under
LABEL, with the commit, in bench/results/verify_scale.json (BENCHMARKS.md's verify table).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import click

from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.planner.verify import verify_plan
from xmesh_plan.schemas.plan import HostOrder, Operation, Plan, SolverInfo, UnitTask
from xmesh_plan.schemas.plan_compact import compact_bytes

from bench.report import RESULTS as RESULTS_DIR, update_benchmarks_doc, write_json

STEP_S = 1e-6
RESULTS = RESULTS_DIR / "verify_scale.json"


def synthetic_plan(ops: int) -> Plan:
    """`ops` operations over 8 source and 8 destination devices (destination pairs replicate a block)."""
    rows = ops  # one row per operation
    problem = build_problem({"shape": [rows, 64], "dtype": "float32", "cluster": {"devices_per_host": 4},
                             "src": {"mesh": [8], "spec": "S0 R"}, "dst": {"mesh": [4, 2], "spec": "S0 R"}})
    src_blocks, dst_blocks = problem.blocks("src"), problem.blocks("dst")
    owners = sorted(src_blocks, key=lambda d: src_blocks[d][0])
    holders = {}
    for device, block in dst_blocks.items():
        holders.setdefault(block[0], []).append(device)
    host_of = problem.cluster.host_of
    tasks, operations, sends, recvs = [], [], {}, {}
    for row in range(rows):
        src = next(d for d in owners if src_blocks[d][0][0] <= row < src_blocks[d][0][1])
        chain = tuple(sorted(next(v for (lo, hi), v in holders.items() if lo <= row < hi)))
        region = ((row, row + 1), (0, 64))
        start = row * STEP_S
        tasks.append(UnitTask(id=row, region=region, nbytes=256, senders=(src,), receivers=chain, sender=src, sender_host=host_of(src),
                              receiver_hosts=(host_of(chain[0]),), strategy="broadcast", start_s=start, end_s=start + STEP_S))
        operations.append(Operation(id=row, task=row, kind="broadcast", src=src, dsts=chain, region=region, chunks=1,
                                    start_s=start, end_s=start + STEP_S))
        sends.setdefault(host_of(src), []).append(row)
        recvs.setdefault(host_of(chain[0]), []).append(row)
    order = [HostOrder(host=h, side="send", tasks=tuple(t)) for h, t in sorted(sends.items())]
    order += [HostOrder(host=h, side="recv", tasks=tuple(t)) for h, t in sorted(recvs.items())]
    end = rows * STEP_S
    return Plan(generator="bench", problem=problem, strategy="broadcast", solver=SolverInfo(name="synthetic"), merged_slices=False,
                tasks=tuple(tasks), operations=tuple(operations), host_order=tuple(order), predicted_seconds=end, lower_bound_seconds=0.0)


def cli_verify(path: str) -> dict:
    """`xmesh-plan verify path` in a fresh process: its verdict line, CPU s, wall s, peak RSS (MiB)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "xmesh_plan.planner.cli", "verify", path], capture_output=True, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"verify failed ({done.returncode}): {done.stdout}{done.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"verdict": done.stdout.strip().split(": ", 1)[1], "cpu_s": round(cpu, 2), "wall_s": round(wall, 2),
            "peak_rss_mib": round(after.ru_maxrss / 1024, 1)}


def record(label: str, path: str, point: dict) -> None:
    """Keep `point` under `label` in the results file, with the commit and the file's size."""
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {"points": {}}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    data["command"] = "python -m bench.bench_verify_scale --ops 1000000 --out plan.npz && python -m bench.bench_verify_scale --cli plan.npz --record LABEL"
    data["points"][label] = {**point, "commit": commit, "plan_bytes": Path(path).stat().st_size}
    write_json(RESULTS.name, data)
    update_benchmarks_doc()


@click.command(help=__doc__.splitlines()[0])
@click.option("--ops", type=click.IntRange(1), default=1_000_000, show_default=True, help="operations in the synthetic plan")
@click.option("--out", type=click.Path(dir_okay=False), help="also write the compact plan here")
@click.option("--cli", "cli_file", metavar="FILE", type=click.Path(exists=True, dir_okay=False),
              help="time `xmesh-plan verify FILE` in a fresh process instead")
@click.option("--record", "record_as", metavar="LABEL", help="with --cli: keep the figures under LABEL in bench/results/verify_scale.json")
def main(ops: int, out: str | None, cli_file: str | None, record_as: str | None) -> None:
    if cli_file:
        point = cli_verify(cli_file)
        print(json.dumps(point))
        if record_as:
            record(record_as, cli_file, point)
        return
    t = time.perf_counter()
    plan = synthetic_plan(ops)
    print(f"built {len(plan.operations):,} operations in {time.perf_counter() - t:.1f} s", flush=True)
    t = time.perf_counter()
    report = verify_plan(plan)
    print(f"verify: {time.perf_counter() - t:.1f} s ({report})", flush=True)
    t = time.perf_counter()
    data = compact_bytes(plan)
    print(f"compact: {len(data):,} bytes, {len(data) / len(plan.operations):.0f} per operation (with its task), "
          f"written in {time.perf_counter() - t:.1f} s", flush=True)
    if out:
        with open(out, "wb") as handle:
            handle.write(data)
    print(f"peak memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GiB")


if __name__ == "__main__":
    main()
