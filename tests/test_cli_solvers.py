"""`xmesh-plan compare`, `check`, and `compile --solver/--time-limit`."""

from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from xmesh_plan.planner.cli import main
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.problem_io import build_problem
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
    for name in list(SOLVERS) + ["alpa-send-recv", "alpa-allgather", "rank0-gather-broadcast", "per-rank-broadcast",
                                 "checkpoint-engine-broadcast"]:
        assert name in result.output
    naive = next(line for line in result.output.splitlines() if "+ naive " in line)
    auto = next(line for line in result.output.splitlines() if "+ auto " in line)
    assert float(naive.split()[3]) > float(auto.split()[3])  # predicted seconds column


def _compare_rows(result) -> dict[str, list[str]]:
    """approach -> its columns (predicted, / bound, / best, wall) from `compare`'s table."""
    rows = [re.match(r"(\S.*?)\s{2,}(.*)$", line) for line in result.output.splitlines()[1:]]
    return {row[1]: row[2].split() for row in rows if row}


def test_compare_with_a_best_of_zero_names_no_infinite_ratio(tmp_path):
    """An empty tensor: the plans take 0 s, the gather-broadcast baseline its latencies; no ratio to 0 exists."""
    problem = write(tmp_path, "empty.json", json.dumps({"shape": [0, 8], "dtype": "float32", "cluster": {"latency_us": 20},
                                                       "src": {"mesh": "1x2", "spec": "S0 R"}, "dst": {"mesh": "1x2", "spec": "R S1"}}))
    result = CliRunner().invoke(main, ["compare", problem, "--time-limit", "0.5"])
    assert result.exit_code == 0, result.output
    assert "inf" not in result.output
    rows = _compare_rows(result)
    assert rows["rank0-gather-broadcast"][0] == "40.0000" and rows["rank0-gather-broadcast"][2] == "-"
    assert rows["broadcast + auto"][:3] == ["0.0000", "1.000", "1.000"]
    assert "predicted us" in result.output and "'-' where the best approach takes 0 s" in result.output


def test_compare_keeps_times_below_a_millisecond_apart(tmp_path):
    """Local copies only: every time below 0.0001 s printed as 0.0000 while the ratios said 8204x."""
    mesh = {"shape": [2], "devices": [0, 1]}
    problem = write(tmp_path, "local.json", json.dumps({"shape": [8, 8], "dtype": "float32", "cluster": {"latency_us": 20},
                                                       "src": {"mesh": mesh, "spec": "S0 R"}, "dst": {"mesh": mesh, "spec": "S0 R"}}))
    result = CliRunner().invoke(main, ["compare", problem, "--time-limit", "0.5"])
    assert result.exit_code == 0, result.output
    rows = _compare_rows(result)
    auto, gather = float(rows["broadcast + auto"][0]), float(rows["rank0-gather-broadcast"][0])
    assert 0 < auto < gather and "predicted us" in result.output
    assert float(rows["rank0-gather-broadcast"][2]) == pytest.approx(gather / auto, rel=0.05)  # from the shown, rounded times


@pytest.mark.parametrize("shape,shared", [([0, 8], False), ([8, 8], True)], ids=["empty", "local-copies-only"])
def test_compare_claims_no_baseline_meets_a_bound_of_zero_it_is_far_above(tmp_path, shape, shared):
    """A bound of 0 (nothing need cross a link): '/ bound' said 1.000 for every row, the gather-broadcast baseline's
    tens of microseconds of cross-host messages too, as if it met the bound."""
    mesh = {"shape": [2], "devices": [0, 1]} if shared else "1x2"
    problem = write(tmp_path, "p.json", json.dumps({"shape": shape, "dtype": "float32", "cluster": {"latency_us": 20},
                                                   "src": {"mesh": mesh, "spec": "S0 R"}, "dst": {"mesh": mesh, "spec": "S0 R" if shared else "R S1"}}))
    result = CliRunner().invoke(main, ["compare", problem, "--time-limit", "0.5"])
    assert result.exit_code == 0, result.output
    rows = _compare_rows(result)
    assert rows["rank0-gather-broadcast"][1] == "-" and rows["broadcast + auto"][1] == "1.000", result.output
    assert "/ bound: '-' where the bound is 0" in result.output


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


def test_check_against_a_reference_of_zero_seconds_names_the_times(tmp_path):
    empty = {"shape": [0, 8], "dtype": "float32", "src": {"mesh": "1x2", "spec": "S0 R"}, "dst": {"mesh": "1x2", "spec": "R S1"}}
    reference = write(tmp_path, "ref.json", compile_plan(build_problem(empty)).to_json())
    plan = write(tmp_path, "plan.json", compile_plan(build_problem({**empty, "shape": [4, 8]})).to_json())
    result = CliRunner().invoke(main, ["check", plan, "--reference", reference])
    assert result.exit_code == 1 and "inf" not in result.output, result.output
    assert "where the reference" in result.output and "takes 0 s" in result.output


def test_check_simulate_times_a_plan_over_the_message_limit_in_the_executors_order_and_gates_on_it(tmp_path, monkeypatch):
    """A multi-tensor plan over `MAX_SIMULATED_MESSAGES` and `executor_order.MAX_EXECUTOR_MESSAGES` states no executor-order time (its times are believed as
    stored); `check` leaves that order untimed and says `--simulate` times it; `check --simulate` simulates it whatever
    its size (the time `executor_order_seconds` gives unlimited) and gates on it with --max-ratio."""
    from pathlib import Path

    from xmesh_plan.planner import compile as compile_module
    from xmesh_plan.planner.executor_order import executor_order_seconds
    from xmesh_plan.planner.transfer_io import load_any_problem

    problem = load_any_problem(Path(__file__).resolve().parents[1] / "plans" / "weight_sync_small.problem.toml")
    plan = compile_plan(problem)
    seconds = executor_order_seconds(plan.operations, problem, plan.host_order)
    assert plan.executor_prediction.predicted_seconds == round(seconds, compile_module.DIGITS)
    path = write(tmp_path, "big.json", plan.model_copy(update={"executor_prediction": None}).to_json())
    from xmesh_plan.planner import executor_order as executor_order_module

    monkeypatch.setattr(compile_module, "MAX_SIMULATED_MESSAGES", 10)  # as if compiled over the limits
    monkeypatch.setattr(executor_order_module, "MAX_EXECUTOR_MESSAGES", 10)
    plain = CliRunner().invoke(main, ["check", path, "--max-ratio", "100"])
    assert plain.exit_code == 0, plain.output
    assert "not timed: too costly to simulate here, not gated; `xmesh-plan check --simulate` times it" in plain.output
    over = seconds / plan.lower_bound_seconds
    timed = CliRunner().invoke(main, ["check", path, "--simulate", "--max-ratio", "100"])
    assert timed.exit_code == 0, timed.output
    assert f"posted (executor default) {seconds:.4f} s ({over:.4f}x)" in timed.output and "not timed" not in timed.output
    gated = CliRunner().invoke(main, ["check", path, "--simulate", "--max-ratio", f"{over * 0.999:.6f}"])
    assert gated.exit_code == 1 and f"{over:.4f}x its lower bound posted (the executor's default order)" in gated.output
