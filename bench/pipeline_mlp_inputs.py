"""Plan the example MLP pipeline's transfers and lay out every schedule, for `executor.examples.pipeline_mlp`.

The executor never imports the planner, so the planner's part runs here, beforehand: one resharding
plan per (tensor, direction) and one schedule file per variant (every schedule with overlap, then
1f1b without), listed in order in `manifest.json` in the output folder.

Run: .venv/bin/python -m bench.pipeline_mlp_inputs --meshes 2,1,1,2 --skip -o mlp-inputs
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from xmesh_plan.executor.examples.pipeline_mlp import MANIFEST, make_problem, plan_file
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.pipeline.build import build_schedule
from xmesh_plan.planner.pipeline.costs import transfer_costs
from xmesh_plan.planner.pipeline.schedules import SCHEDULE_NAMES
from xmesh_plan.schemas.pipeline import PipelineProblem
from xmesh_plan.schemas.plan import write_atomic


def write_inputs(problem: PipelineProblem, folder: Path) -> list[str]:
    """Write the plans, the schedules and the manifest into `folder`; returns the schedule file names."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, direction in problem.transfers():
        write_atomic(folder / plan_file(name, direction), compile_plan(problem.resharding_problem(name, direction)).to_json())
    costs = transfer_costs(problem, compile_plan)
    names = []
    for schedule_name, overlap in [(n, True) for n in SCHEDULE_NAMES] + [("1f1b", False)]:
        file = f"{schedule_name}{'' if overlap else '-no-overlap'}.schedule.json"
        write_atomic(folder / file, build_schedule(problem, schedule_name, costs, overlap).to_json())
        names.append(file)
    write_atomic(folder / MANIFEST, json.dumps({"schedules": names}, indent=1) + "\n")
    return names


@click.command(help=__doc__.splitlines()[0])
@click.option("--meshes", default="2,2", show_default=True, help="ranks per stage, e.g. 2,1,1,2")
@click.option("--micro-batches", type=int, default=4, show_default=True, help="micro-batches per step")
@click.option("--skip", is_flag=True, help="also send stage 0's output to the last stage")
@click.option("-o", "--output", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="folder to write into (created if missing)")
def main(meshes: str, micro_batches: int, skip: bool, output: Path) -> None:
    try:
        ranks = [int(n) for n in meshes.split(",")]
    except ValueError:
        ranks = []
    if len(ranks) < 2 or min(ranks) < 1:
        raise click.UsageError(f"--meshes {meshes!r}: give two or more positive rank counts, e.g. --meshes 2,1,1,2")
    if micro_batches < 1:
        raise click.UsageError(f"--micro-batches {micro_batches}: give at least 1, e.g. --micro-batches 4")
    write_inputs(make_problem(ranks, micro_batches, skip), output)
    click.echo(f"wrote {output}; now run: mpiexec -n {sum(ranks)} python -m xmesh_plan.executor.examples.pipeline_mlp {output}")


if __name__ == "__main__":
    main()
