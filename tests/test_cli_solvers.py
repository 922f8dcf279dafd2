"""`xmesh-plan compare`, `check`, and `compile --solver/--time-limit`."""

from __future__ import annotations

import json

from click.testing import CliRunner

from xmesh_plan.planner.cli import main
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.solvers import SOLVERS
from xmesh_plan.schemas import DeviceMesh, Placement, ReshardingProblem


def case3() -> ReshardingProblem:
    def mesh(first):
        return DeviceMesh(shape=(2, 4), devices=tuple((first + h) * 4 + g for h in range(2) for g in range(4)))
    return ReshardingProblem(name="case3", shape=(1024, 1024, 512), dtype="int32",
                             src=Placement(mesh=mesh(0), spec="R S0 R"), dst=Placement(mesh=mesh(2), spec="S0 R R"))


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_compare_lists_every_solver_and_baseline(tmp_path):
    problem = write(tmp_path, "p.json", case3().model_dump_json())
    result = CliRunner().invoke(main, ["compare", problem, "--time-limit", "0.5"])
    assert result.exit_code == 0, result.output
    for name in list(SOLVERS) + ["alpa-send-recv", "alpa-allgather", "rank0-gather-broadcast", "per-rank-broadcast"]:
        assert name in result.output
    naive = next(line for line in result.output.splitlines() if "+ naive " in line)
    auto = next(line for line in result.output.splitlines() if "+ auto " in line)
    assert float(naive.split()[3]) > float(auto.split()[3])  # predicted seconds column


def test_check_passes_a_good_plan_and_fails_a_poor_one(tmp_path):
    good = write(tmp_path, "good.json", compile_plan(case3()).to_json())
    poor = write(tmp_path, "poor.json", compile_plan(case3(), solver="naive").to_json())
    ok = CliRunner().invoke(main, ["check", good, "--max-ratio", "1.05"])
    assert ok.exit_code == 0 and "ok" in ok.output
    bad = CliRunner().invoke(main, ["check", good, poor, "--max-ratio", "1.1"])
    assert bad.exit_code == 1
    assert "poor.json" in bad.output and "FAIL" in bad.output


def test_check_against_a_reference_plan(tmp_path):
    good = write(tmp_path, "good.json", compile_plan(case3()).to_json())
    poor = write(tmp_path, "poor.json", compile_plan(case3(), solver="naive").to_json())
    result = CliRunner().invoke(main, ["check", poor, "--reference", good, "--max-ratio", "1.4"])
    assert result.exit_code == 1 and "reference" in result.output
    assert CliRunner().invoke(main, ["check", good, "--reference", poor, "--max-ratio", "1.4"]).exit_code == 0


def test_compile_takes_solver_and_time_limit(tmp_path):
    problem = write(tmp_path, "p.json", case3().model_dump_json())
    out = tmp_path / "plan.json"
    result = CliRunner().invoke(main, ["compile", problem, "--solver", "cpsat", "--time-limit", "0.5", "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = json.loads(out.read_text())
    assert plan["solver"]["name"] == "cpsat" and plan["solver"]["details"]["deterministic_time_limit"] == "0.5"
    assert "solver cpsat" in result.output


def test_compile_rejects_an_unknown_solver_listing_the_names(tmp_path):
    problem = write(tmp_path, "p.json", case3().model_dump_json())
    result = CliRunner().invoke(main, ["compile", problem, "--solver", "magic"])
    assert result.exit_code == 2 and "list-backfill" in result.output
