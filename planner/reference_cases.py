"""The paper's benchmark cases as problems, and `python -m xmesh_plan.planner.reference_cases --out plans`.

Nine many-to-many cases (tensor 1024x1024x512 int32, 2 GiB) and seven one-to-many cases (1 GiB,
replicated, from one device to meshes of 1 to 8 devices) on the paper's cluster: 4 GPUs per host,
one 10 Gbit/s NIC. Case 6 pads 1024 over 3 hosts unevenly, as the paper describes.

Then the multi-tensor weight-sync examples (`planner/weight_sync.py`): their TOML problem files, and
the plan of the small one (the Llama-3-8B one compiles with the multi-tensor defaults to 9,864 unit tasks
and a 12 MB plan in under a minute: compile it yourself, see the README).
"""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import click
from tabulate import tabulate

from xmesh_plan.schemas import ReshardingProblem
from xmesh_plan.schemas.plan import write_atomic

from .baselines import baseline_seconds
from .compile import compile_plan
from .problem_io import build_problem
from .transfer_io import build_transfer
from .verify import verify_plan
from .weight_sync import WEIGHT_SYNC, weight_sync_toml

COMPILED_TRANSFERS = ("weight_sync_small",)  # weight-sync examples whose plan `make plans` writes too

MANY_TO_MANY = [
    # name, src mesh, dst mesh, src spec, dst spec
    ("case1", "2x4", "2x4", "S0 R R", "S0 R R"),
    ("case2", "2x4", "2x4", "R R R", "S0 R R"),
    ("case3", "2x4", "2x4", "R S0 R", "S0 R R"),
    ("case4", "2x4", "2x4", "R S01 R", "S01 R R"),
    ("case5", "2x4", "2x4", "S1 R R", "S0 R R"),
    ("case6", "2x4", "3x4", "S0 R R", "S0 R R"),
    ("case7", "1x4", "2x4", "S1 R R", "R R R"),
    ("case8", "2x3", "3x2", "R R R", "R R R"),
    ("case9", "2x4", "2x4", "R S0 R", "R R S0"),
]
ONE_TO_MANY = ["1x1", "1x2", "1x3", "1x4", "2x2", "3x2", "4x2"]


def reference_problems() -> list[tuple[str, dict]]:
    """(name, raw problem data) for every reference case, in a fixed order."""
    cases = []
    for name, src_mesh, dst_mesh, src_spec, dst_spec in MANY_TO_MANY:
        cases.append((name, {"name": name, "shape": [1024, 1024, 512], "dtype": "int32",
                             "src": {"mesh": src_mesh, "spec": src_spec}, "dst": {"mesh": dst_mesh, "spec": dst_spec}}))
    for dst_mesh in ONE_TO_MANY:
        name = f"one_to_{dst_mesh}"
        cases.append((name, {"name": name, "shape": [1024, 1024, 256], "dtype": "int32",
                             "src": {"mesh": "1x1", "spec": "R R R"}, "dst": {"mesh": dst_mesh, "spec": "R R R"}}))
    return cases


def reference_cases() -> list[tuple[str, ReshardingProblem]]:
    return [(name, build_problem(raw)) for name, raw in reference_problems()]


def summary_row(name: str, plan) -> list:
    """One table row: ours against Alpa's two approaches, all timed by the same network simulator."""
    p = plan.problem
    alpa = [baseline_seconds(p, b) for b in ("alpa-send-recv", "alpa-allgather")]
    ours = plan.predicted_seconds
    return [name, f"{p.src.mesh.label} {p.src.spec} -> {p.dst.mesh.label} {p.dst.spec}", len(plan.tasks), f"{alpa[0]:.4f}",
            f"{alpa[1]:.4f}", f"{ours:.4f}", f"{min(alpa) / ours:.2f}x", f"{plan.lower_bound_seconds:.4f}", f"{plan.efficiency:.3f}",
            plan.solver.details.get("winner", plan.solver.name)]


def transfer_row(name: str, plan) -> list:
    """`summary_row` for a multi-tensor plan."""
    alpa = [baseline_seconds(plan.problem, b) for b in ("alpa-send-recv", "alpa-allgather")]
    ours = plan.predicted_seconds
    return [name, len(plan.problem.tensors), len(plan.tasks), f"{alpa[0]:.4f}", f"{alpa[1]:.4f}", f"{ours:.4f}",
            f"{min(alpa) / ours:.2f}x", f"{plan.lower_bound_seconds:.4f}", f"{plan.efficiency:.3f}"]


def markdown(rows: list[list], headers: list[str], left: int) -> str:
    """`rows` as a Markdown table (tabulate): the first `left` columns and any text column after the figures left-aligned."""
    align = ["left"] * left + ["right" if isinstance(v, int) or v[:1].isdigit() else "left" for v in rows[0][left:]]
    return tabulate(rows, headers=headers, tablefmt="pipe", disable_numparse=True, colalign=align)


@click.command()
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default="plans", show_default=True, help="folder for problem and plan files")
@click.option("--quiet", is_flag=True, help="write the files without printing the table")
def main(out_dir: str, quiet: bool) -> None:
    """Compile every reference case into OUT (problem + plan JSON), verify each, print a comparison table."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows, transfers = [], []
    for name, raw in reference_problems():
        problem = build_problem(raw)
        plan = compile_plan(problem)
        verify_plan(plan)
        write_atomic(out / f"{name}.problem.json", json.dumps(raw, indent=1, sort_keys=True) + "\n")
        write_atomic(out / f"{name}.plan.json", plan.to_json())
        rows.append(summary_row(name, plan))
    for name, config in WEIGHT_SYNC.items():
        text = weight_sync_toml(*config)
        write_atomic(out / f"{name}.problem.toml", text)
        if name in COMPILED_TRANSFERS:
            plan = compile_plan(build_transfer(tomllib.loads(text)))
            verify_plan(plan)
            write_atomic(out / f"{name}.plan.json", plan.to_json())
            transfers.append(transfer_row(name, plan))
    if not quiet:
        click.echo(f"Compiled and verified {len(rows)} reference cases into {out}/. Seconds predicted by one network "
                   "simulator for all columns;\nspeed-up is over the better of Alpa's two approaches; efficiency = lower bound / ours.\n")
        click.echo(markdown(rows, ["case", "resharding", "tasks", "Alpa send/recv", "Alpa send+all-gather", "ours", "speed-up",
                                   "lower bound", "efficiency", "solver"], left=2))
        click.echo("\nMulti-tensor weight sync (all tensors in one plan; Alpa's approaches run tensor after tensor):\n")
        click.echo(markdown(transfers, ["problem", "tensors", "tasks", "Alpa send/recv", "Alpa send+all-gather", "ours", "speed-up",
                                        "lower bound", "efficiency"], left=1))

if __name__ == "__main__":
    sys.exit(main())
