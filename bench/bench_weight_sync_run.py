"""Weight sync on the executor: one joint plan for all tensors against one plan per tensor run one after another,
in both executor orders.

The small weight-sync example (21 tensors, 2x4 FSDP -> 2x2 TP, `plans/weight_sync_small.problem.toml`)
is compiled as three joint plans (the default, whose bundles share messages across tensors; bundles of
one tensor each; chained, neither split nor coalesced) and once per tensor; all of them run in one `mpiexec` launch of 8
ranks (`executor.run`, every shard checked bit for bit) per order, `posted` and `device` launches
taking turns `--rounds` times, so both orders and both ways of planning pay the same start-up and
share the machine's load. Each plan's figure is the median over its launches of the launch's median
per reshard; "one after another" is the sum of the per-tensor plans' figures. 2 CPU cores and 8
ranks: ratios, not speed figures.

    .venv/bin/python -m bench.bench_weight_sync_run [--iters 20] [--rounds 3]
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from types import SimpleNamespace

import click

from bench.report import update_benchmarks_doc, write_json
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.simulate import simulate_plan
from xmesh_plan.planner.transfer_io import build_transfer
from xmesh_plan.planner.weight_sync import WEIGHT_SYNC, weight_sync_toml
from xmesh_plan.schemas.carriers import message_groups
from xmesh_plan.schemas.plan import write_atomic

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TIMING = re.compile(r"([\d.]+) ms/iter median of \d+ \(min ([\d.]+)\)")
COMMAND = ".venv/bin/python -m bench.bench_weight_sync_run"


ORDERS = ("posted", "device")
MODELS = {"posted": "posted", "device": "device-order"}  # executor --order -> the simulator queueing that describes it


def launch(paths: list[Path], ranks: int, order: str, iters: int) -> list[float]:
    """One `mpiexec` launch of every plan in `order`; each plan's median ms per reshard (every shard checked)."""
    cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "xmesh_plan.executor.run", *map(str, paths), "--check",
           "--order", order, "--iters", str(iters), "--warmup", "2", "--max-mb", "64"]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                            env={"PYTHONPATH": str(ROOT), "PATH": str(MPIEXEC.parent)})
    lines = [line for line in result.stdout.splitlines() if TIMING.search(line)]
    if result.returncode or len(lines) != len(paths) or result.stdout.count("check ok") != len(paths):
        sys.exit(f"the {order} launch failed (exit {result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    return [float(TIMING.search(line).group(1)) for line in lines]


JOINTS = {  # the joint plans run, by row label: compile flags
    "joint, default (bundles sharing messages across tensors)": {},
    "joint, bundles of one tensor each (--no-cross-tensor)": {"cross_tensor": False},
    "joint, chained (--no-split-hosts --no-coalesce)": {"split_hosts": False, "coalesce": False},
}


@click.command(help=__doc__.splitlines()[0])
@click.option("--iters", type=int, default=20, show_default=True, help="timed reshards per plan and launch")
@click.option("--rounds", type=int, default=3, show_default=True, help="launches per order, taking turns")
def main(**options) -> None:
    args = SimpleNamespace(**options)
    problem = build_transfer(tomllib.loads(weight_sync_toml(*WEIGHT_SYNC["weight_sync_small"])))
    joints = {label: compile_plan(problem, **flags) for label, flags in JOINTS.items()}
    alone = [compile_plan(single) for single in problem.tensor_problems()]
    ranks = len(set(problem.src_mesh.devices) | set(problem.dst_mesh.devices))
    runs: dict[str, list[list[float]]] = {order: [] for order in ORDERS}
    with tempfile.TemporaryDirectory(prefix="weight-sync-run-") as folder:
        paths = []
        for i, plan in enumerate([*joints.values(), *alone]):
            paths.append(Path(folder) / f"{i:03d}.plan.json")
            write_atomic(paths[-1], plan.to_json())
        for _ in range(args.rounds):
            for order in ORDERS:
                runs[order].append(launch(paths, ranks, order, args.iters))
    k = len(joints)
    rows = {}
    for order, medians in runs.items():
        per_plan = [statistics.median(m[i] for m in medians) for i in range(len(paths))]
        rows[order] = {"joint_ms": dict(zip(joints, per_plan[:k])), "one_after_another_ms": sum(per_plan[k:]),
                       "per_tensor_ms": per_plan[k:], "launches_ms": medians}
    predicted = {model: {"joint_ms": {label: simulate_plan(plan, model).makespan_s * 1e3 for label, plan in joints.items()},
                         "sequential_ms": sum(simulate_plan(p, model).makespan_s for p in alone) * 1e3} for model in MODELS.values()}
    messages = {label: len(message_groups(plan.operations)) for label, plan in joints.items()}
    write_json("weight_sync_run.json", {"command": f"{COMMAND} --iters {args.iters} --rounds {args.rounds}", "tensors": len(problem.tensors),
                                        "ranks": ranks, "iters": args.iters, "rounds": args.rounds, "orders": rows, "predicted": predicted,
                                        "operations_or_shared_messages": messages})
    for order, row in rows.items():
        print(f"{order}: " + ", ".join(f"{label} {ms:.2f} ms" for label, ms in row["joint_ms"].items())
              + f"; one after another {row['one_after_another_ms']:.2f} ms")
    update_benchmarks_doc()


if __name__ == "__main__":
    main()
