"""Frontier scale: compile, write and verify the Llama-3-70B-like, DeepSeek-V3-like and Kimi-K2-like weight syncs with default flags.

The problems are the ones `make plans` writes (`plans/weight_sync_llama3_70b.problem.toml`,
`plans/weight_sync_deepseek_v3.problem.toml`, `plans/weight_sync_kimi_k2.problem.toml`: FP8 destinations;
`planner/weight_sync.py`), or a shrunk variant of each with fewer
layers (`--layers N`: the same layer types, N layers, the MoE keeping about its share of dense layers). Each point
runs in a fresh process through what `xmesh-plan compile -o NAME.plan.npz` and `xmesh-plan verify` do, and records:
compile wall and CPU seconds (CPU seconds hold on a loaded machine, wall seconds do not) and the process's peak RSS
when the compile returned and at the end (and each phase's start: wall and CPU seconds, peak RSS); unit tasks, operations, the compact plan file's bytes and the seconds to
write it; verify seconds;
the byte bound, the plan's predicted time over it and what timed it (`solver.details.timed_by`: the simulator in
host order, or the schedule's own timetable), and the executor's order over the bound where the plan states it.
A point past `--timeout` seconds is recorded as not finished, with the phase it was in. `--max-tasks` passes a
limit to the compile (recorded with the point and its command); the limit counts what a compile holds (the boxes
of each kind of tensor, then the tasks scheduled), which for the DeepSeek-V3-like problem is 613,248 tasks, under
the default.

    .venv/bin/python -m bench.bench_frontier                              # every problem, full size
    .venv/bin/python -m bench.bench_frontier --layers 4 --out frontier-shrunk.json
    .venv/bin/python -m bench.bench_frontier --problems weight_sync_deepseek_v3 --max-tasks 7099392

Adds each point to bench/results/frontier.json (or --out) as it is measured (a point measured again replaces its
row), then remakes BENCHMARKS.md.
"""

from __future__ import annotations

import dataclasses
import json
import resource
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

import click

from bench.report import ROOT, update_benchmarks_doc, write_json

PROBLEMS = ("weight_sync_llama3_70b", "weight_sync_deepseek_v3", "weight_sync_kimi_k2")
COMMAND = ".venv/bin/python -m bench.bench_frontier"


def problem_text(name: str, layers: int) -> str:
    """The problem file's text: as `make plans` writes it, or with `layers` layers (0: all)."""
    from xmesh_plan.planner.weight_sync import WEIGHT_SYNC, weight_sync_toml

    file_name, model, layout = WEIGHT_SYNC[name]
    if layers:
        changes = {"layers": layers}
        if hasattr(model, "dense_layers"):  # keep about the model's share of dense layers, at least one of each
            changes["dense_layers"] = max(1, min(layers - 1, round(layers * model.dense_layers / model.layers)))
        model = dataclasses.replace(model, **changes)
    return weight_sync_toml(file_name, model, layout)


def one(name: str, layers: int, max_tasks: int | None) -> dict:
    """Compile (default flags), write compact and verify that file, in this process, as `xmesh-plan compile -o
    NAME.plan.npz` does: the plan as rows, its file made from them (`planner.plan_rows`), the file proved from its
    columns (`verify_plan_file`); the figures, and each phase as it starts on stderr (the parent names the last one
    when the point runs out of time)."""
    from xmesh_plan.planner.compile import compile_rows
    from xmesh_plan.planner.transfer_io import build_transfer
    from xmesh_plan.planner.verify import verify_plan_file
    from xmesh_plan.schemas.plan import write_atomic
    from xmesh_plan.schemas.plan_io import plan_file_bytes

    problem = build_transfer(tomllib.loads(problem_text(name, layers)))
    wall, cpu = time.perf_counter(), time.process_time()
    phases: list[list] = []  # [stage, wall s, CPU s, peak RSS MiB] as each begins

    def phase(stage: str) -> None:
        print(f"phase: {stage}", file=sys.stderr, flush=True)
        phases.append([stage, time.perf_counter() - wall, time.process_time() - cpu, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024])

    busiest: list[tuple[int, int]] = []  # the CLI's posted-staging note, counted as the CLI counts it
    plan = compile_rows(problem, on_stage=phase, on_posted_staging=lambda *d: busiest.append(d),
                        **({} if max_tasks is None else {"max_tasks": max_tasks}))
    compile_s, compile_cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    phase("writing the plan")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"{name}.plan.npz"
        begin = time.perf_counter()
        write_atomic(path, plan_file_bytes(plan, "compact"))
        write_s, plan_bytes = time.perf_counter() - begin, path.stat().st_size
        phase("verifying")
        begin = time.perf_counter()
        verify_plan_file(path)
        verify_s = time.perf_counter() - begin
    phase("done")
    bound = plan.lower_bound_seconds
    executed = plan.executor_prediction
    return {"problem": name, "layers": layers or None, "max_tasks": max_tasks, "tensors": len(problem.tensors), "gib": problem.nbytes / 2**30,
            "tasks": len(plan.tasks), "operations": len(plan.operations), "compile_s": compile_s, "compile_cpu_s": compile_cpu_s,
            "peak_rss_mib": peak, "peak_rss_all_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "plan_format": "compact", "plan_bytes": plan_bytes, "write_s": write_s, "verify_s": verify_s, "bound_s": bound,
            "predicted_over_bound": plan.predicted_seconds / bound, "timed_by": plan.solver.details.get("timed_by", ""),
            "gap_to_proven_bound": plan.solver.details.get("gap_to_proven_bound"),
            "executor_order": executed.order if executed else None,
            "executor_over_bound": executed.predicted_seconds / bound if executed else None,
            "posted_staging_busiest": list(busiest[0]) if busiest else None, "phases": phases}


def measure(name: str, layers: int, timeout_s: float, max_tasks: int | None) -> dict:
    """`one` in a fresh process; a point that runs out of time names the phase it was in."""
    args = [sys.executable, "-m", "bench.bench_frontier", "--one", name, "--layers", str(layers)]
    args += [] if max_tasks is None else ["--max-tasks", str(max_tasks)]
    begin = time.perf_counter()
    try:
        child = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        phases = [line for line in (err.stderr or b"").decode().splitlines() if line.startswith("phase: ")]
        return {"problem": name, "layers": layers or None, "max_tasks": max_tasks, "finished": False, "timeout_s": timeout_s,
                "last_phase": phases[-1][len("phase: "):] if phases else "starting"}
    if child.returncode:
        raise click.ClickException(f"{name}: the point failed:\n{child.stderr[-2000:]}")
    return {**json.loads(child.stdout.splitlines()[-1]), "finished": True, "seconds": time.perf_counter() - begin}


@click.command()
@click.option("--problems", default=",".join(PROBLEMS), show_default=True, help="comma-separated problem names")
@click.option("--layers", type=click.IntRange(0), default=0, show_default=True, help="shrunk variants of N layers (0: full size)")
@click.option("--timeout", "timeout_s", type=click.FloatRange(1), default=1800, show_default=True, help="seconds per point")
@click.option("--max-tasks", type=click.IntRange(1), default=None, help="compile's max_tasks (default: compile's own default)")
@click.option("--out", default="frontier.json", show_default=True, help="results file in bench/results/")
@click.option("--one", "single", default=None, hidden=True, help="measure one problem in this process (used by the parent)")
def main(problems: str, layers: int, timeout_s: float, max_tasks: int | None, out: str, single: str | None) -> None:
    """Compile, write and verify the frontier weight syncs, each in a fresh process; write the results and BENCHMARKS.md."""
    if single is not None:
        print(json.dumps(one(single, layers, max_tasks)))
        return
    names = [n for n in problems.split(",") if n]
    unknown = [n for n in names if n not in PROBLEMS]
    if unknown:
        raise click.BadParameter(f"{unknown[0]!r}; choose from {', '.join(PROBLEMS)}", param_hint="--problems")
    command = COMMAND + (f" --layers {layers}" if layers else "") + (f" --out {out}" if out != "frontier.json" else "")
    given = f" --max-tasks {max_tasks}" if max_tasks is not None else ""
    path = ROOT / "bench" / "results" / out
    points = json.loads(path.read_text())["points"] if path.exists() else []
    for name in names:  # each point is written as it is measured; one measured again replaces its row
        point = measure(name, layers, timeout_s, max_tasks)
        print(json.dumps(point), flush=True)
        points = [p for p in points if (p["problem"], p["layers"]) != (name, layers or None)] + [{**point, "command": command + given}]
        points.sort(key=lambda p: (PROBLEMS.index(p["problem"]), p["layers"] or 0))
        write_json(out, {"command": command, "points": points})
    update_benchmarks_doc()


if __name__ == "__main__":
    main()
