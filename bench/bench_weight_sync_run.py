"""Weight sync on the executor: one joint plan for all tensors against one plan per tensor run one after another.

The small weight-sync example (21 tensors, 2x4 FSDP -> 2x2 TP, `plans/weight_sync_small.problem.toml`)
is compiled once as a joint plan and once per tensor; all of them run in one `mpiexec` launch of 8
ranks (`executor.run`, every shard checked bit for bit, both posted: the order multi-tensor plans run
in), so both pay the same start-up and share the machine's load. "One after another" is the sum of
the per-tensor plans' medians. 2 CPU cores and 8 ranks: a ratio of the two, not a speed figure.

    .venv/bin/python bench/bench_weight_sync_run.py [--iters 20]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from report import replace_section, write_json  # noqa: E402
from xmesh_plan.planner.compile import compile_plan  # noqa: E402
from xmesh_plan.planner.transfer_io import build_transfer  # noqa: E402
from xmesh_plan.planner.weight_sync import WEIGHT_SYNC, weight_sync_toml  # noqa: E402
from xmesh_plan.schemas.plan import write_atomic  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = Path(sys.executable).parent / "mpiexec"
TIMING = re.compile(r"([\d.]+) ms/iter median of \d+ \(min ([\d.]+)\)")
COMMAND = ".venv/bin/python bench/bench_weight_sync_run.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    problem = build_transfer(tomllib.loads(weight_sync_toml(*WEIGHT_SYNC["weight_sync_small"])))
    joint = compile_plan(problem)
    alone = [compile_plan(single) for single in problem.tensor_problems()]
    with tempfile.TemporaryDirectory(prefix="weight-sync-run-") as folder:
        paths = []
        for i, plan in enumerate([joint, *alone]):
            paths.append(Path(folder) / f"{i:03d}.plan.json")
            write_atomic(paths[-1], plan.to_json())
        ranks = len(set(problem.src_mesh.devices) | set(problem.dst_mesh.devices))
        cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "xmesh_plan.executor.run", *map(str, paths), "--check",
               "--order", "posted", "--iters", str(args.iters), "--warmup", "2", "--max-mb", "64"]
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                                env={"PYTHONPATH": str(ROOT), "PATH": str(MPIEXEC.parent)})
    lines = [line for line in result.stdout.splitlines() if TIMING.search(line)]
    if result.returncode or len(lines) != len(paths) or result.stdout.count("check ok") != len(paths):
        sys.exit(f"the launch failed (exit {result.returncode}):\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}")
    medians = [float(TIMING.search(line).group(1)) for line in lines]
    row = {"tensors": len(problem.tensors), "ranks": ranks, "iters": args.iters, "joint_ms": medians[0],
           "one_after_another_ms": sum(medians[1:]), "per_tensor_ms": medians[1:],
           "joint_predicted_ms": joint.predicted_seconds * 1e3, "sequential_predicted_ms": sum(p.predicted_seconds for p in alone) * 1e3}
    write_json("weight_sync_run.json", {"command": COMMAND, "row": row, "joint_line": lines[0]})
    print(f"joint {row['joint_ms']:.2f} ms, one after another {row['one_after_another_ms']:.2f} ms "
          f"({row['one_after_another_ms'] / row['joint_ms']:.2f}x); every shard bit-exact")
    replace_section("Weight sync on the executor", f"""
Made by (2-core machine shared with other jobs; 8 ranks oversubscribe it, so compare the ratio, not the times):

```
{COMMAND} --iters {args.iters}
```

The small weight-sync example ({row['tensors']} tensors, `plans/weight_sync_small.problem.toml`) on {ranks} MPI
ranks, one launch: the joint plan, then each tensor's own plan, every destination shard of every
tensor checked bit for bit, all posted. Medians of {args.iters} reshards after 2 warm-up ones.

| plan | measured ms per reshard | predicted ms |
|---|---:|---:|
| joint (one plan, all tensors) | {row['joint_ms']:.2f} | {row['joint_predicted_ms']:.2f} |
| one plan per tensor, one after another | {row['one_after_another_ms']:.2f} | {row['sequential_predicted_ms']:.2f} |

One after another over joint: {row['one_after_another_ms'] / row['joint_ms']:.2f}x measured,
{row['sequential_predicted_ms'] / row['joint_predicted_ms']:.2f}x predicted. Raw: `bench/results/weight_sync_run.json`.
Measured, each per-tensor plan also pays a reshard's fixed cost (the call, its first and last
messages, waking the ranks) once per tensor; the model only sees the links.
""")


if __name__ == "__main__":
    main()
