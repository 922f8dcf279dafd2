"""The DeepSeek-V3-like MoE weight sync run by the executor on 48 MPI ranks, bit-exact.

`plans/weight_sync_deepseek_v3_48.problem.toml` (`make plans`) keeps the structure of the DeepSeek-V3-like frontier
problem on fewer hosts: its real tensor shapes (3 layers: the dense first one, 2 MoE ones with 256 experts stacked as
[256, 2048, 7168]), sources FSDP + EP over 2 hosts of 8 GPUs, destinations 2 inference instances of 2 hosts of 8
GPUs (experts split over an instance's 16 GPUs, attention TP=8 inside a host), 8 x 400 Gbit/s NICs per host. The
bench compiles it with default flags (what `xmesh-plan compile -o` does) and runs it with

    mpiexec -n 48 python -m xmesh_plan.executor.run PLAN --check --max-mb M --iters N

which shrinks every tensor to at most M MiB, dims in proportion, so the plan's operations stay the same with smaller
boxes (`executor/scale.py`), fills the sources with a pattern of global indices and compares every destination shard
bit for bit. Records the compile's seconds, the plan's operations, the launch's wall seconds and rank 0's report.

    .venv/bin/python -m bench.bench_moe_mpi                 # 48 ranks, --max-mb 4
    .venv/bin/python -m bench.bench_moe_mpi --max-mb 1 --iters 2

Writes bench/results/moe_mpi.json, then remakes BENCHMARKS.md.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import click

from bench.report import ROOT, update_benchmarks_doc, write_json

PROBLEM = ROOT / "plans" / "weight_sync_deepseek_v3_48.problem.toml"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
COMMAND = ".venv/bin/python -m bench.bench_moe_mpi"


def launch(plan: Path, ranks: int, max_mb: float, iters: int, timeout_s: float) -> subprocess.CompletedProcess:
    """`mpiexec -n ranks python -m xmesh_plan.executor.run plan --check ...`; ranks yield the CPU while they wait
    (MPICH's heavy yield: 48 ranks share this machine's cores)."""
    env = dict(os.environ, MPIR_CVAR_ENABLE_HEAVY_YIELD="1")
    cmd = [str(MPIEXEC), "-n", str(ranks), sys.executable, "-m", "xmesh_plan.executor.run", str(plan), "--check",
           "--max-mb", str(max_mb), "--iters", str(iters), "--warmup", "1"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)


def compile_to(problem_file: Path, plan_path: Path):
    """Compile a problem file with default flags into `plan_path` (JSON); the plan."""
    from xmesh_plan.planner.compile import compile_plan
    from xmesh_plan.planner.transfer_io import build_transfer
    from xmesh_plan.schemas.plan import write_atomic

    plan = compile_plan(build_transfer(tomllib.loads(problem_file.read_text())))
    write_atomic(plan_path, plan.to_json())
    return plan


@click.command()
@click.option("--max-mb", type=click.FloatRange(0, min_open=True), default=4.0, show_default=True, help="executor.run's --max-mb")
@click.option("--iters", type=click.IntRange(1), default=3, show_default=True, help="timed iterations")
@click.option("--timeout", "timeout_s", type=click.FloatRange(1), default=1200, show_default=True, help="seconds for the launch")
def main(max_mb: float, iters: int, timeout_s: float) -> None:
    """Compile the 48-GPU DeepSeek-V3-like problem, run it on 48 MPI ranks with --check; write the results and BENCHMARKS.md."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "weight_sync_deepseek_v3_48.plan.json"
        begin = time.perf_counter()
        plan = compile_to(PROBLEM, path)
        compile_s = time.perf_counter() - begin
        ranks = len(set(plan.problem.src_mesh.devices) | set(plan.problem.dst_mesh.devices))
        begin = time.perf_counter()
        run = launch(path, ranks, max_mb, iters, timeout_s)
        wall_s = time.perf_counter() - begin
    lines = (run.stdout + run.stderr).splitlines()
    report = next((line for line in lines if line.startswith("weight_sync_deepseek_v3_48:")), "")
    passed = run.returncode == 0 and "check ok" in report
    flags = (f" --max-mb {max_mb:g}" if max_mb != 4.0 else "") + (f" --iters {iters}" if iters != 3 else "")
    result = {"command": COMMAND + flags, "ranks": ranks, "tensors": len(plan.problem.tensors), "gib": plan.problem.nbytes / 2**30,
              "operations": len(plan.operations), "kinds": sorted({op.kind for op in plan.operations}), "compile_s": compile_s,
              "max_mb": max_mb, "iters": iters, "launch_wall_s": wall_s, "returncode": run.returncode, "check_ok": passed,
              "report": report}
    print(report or "\n".join(lines[-20:]))
    write_json("moe_mpi.json", result)
    update_benchmarks_doc()
    if not passed:
        raise click.ClickException(f"the 48-rank run failed (exit {run.returncode}):\n" + "\n".join(lines[-20:]))


if __name__ == "__main__":
    main()
