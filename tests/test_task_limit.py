"""Bounded work: the unit-task count is bounded from the cut points before cutting, and a problem above
`max_tasks` (`--max-tasks`) is refused with its count, by the library and by every command that compiles."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import given, settings

from xmesh_plan.planner.baselines import baseline_seconds
from xmesh_plan.planner.cli import main
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.problem_io import build_problem
from xmesh_plan.planner.unit_tasks import DEFAULT_MAX_TASKS, TooManyTasksError, decompose, task_count_bound
from tests.support.builders import FAST_SOLVER
from tests.support.strategies import SETTINGS, problems

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "xmesh-plan"
# The issue's problem: ran 90 s, passed 3.8 GB and died before the limit existed.
HUGE_FLAGS = ["--shape", "4096,4096,512", "--src-mesh", "1000x4", "--src-spec", "S0 S1 R",
              "--dst-mesh", "1000x4", "--dst-spec", "R S0 S1"]
HUGE_TASKS = 820 * 823 * 4  # 4096 over 1000 shards of 5 leaves 820 non-empty ones; the union with the other side has 823
CASE3 = ROOT / "plans" / "case3.problem.json"


def huge_problem():
    return build_problem({"shape": "4096,4096,512", "dtype": "float32", "src": {"mesh": "1000x4", "spec": "S0 S1 R"},
                          "dst": {"mesh": "1000x4", "spec": "R S0 S1"}})


@settings(max_examples=60, **SETTINGS)
@given(problems())
def test_the_bound_is_the_unmerged_cell_count_and_bounds_every_task_list(problem):
    bound = task_count_bound(problem)
    assert bound == len(decompose(problem, merge=False, max_tasks=None))
    assert bound >= len(decompose(problem, max_tasks=None))
    assert bound >= len(compile_plan(problem, solver=FAST_SOLVER, max_tasks=bound).tasks)


def test_the_issues_problem_is_counted_without_cutting():
    assert task_count_bound(huge_problem()) == HUGE_TASKS > DEFAULT_MAX_TASKS


@pytest.mark.parametrize("build", [
    lambda p: compile_plan(p),
    lambda p: decompose(p),
    lambda p: baseline_seconds(p, "alpa-send-recv"),
], ids=["compile_plan", "decompose", "baseline_seconds"])
def test_the_library_refuses_above_the_default_limit_naming_the_count_and_flag(build):
    with pytest.raises(TooManyTasksError) as err:
        build(huge_problem())
    message = str(err.value)
    assert f"{HUGE_TASKS:,} unit tasks" in message and f"--max-tasks {HUGE_TASKS}" in message
    assert f"limit of {DEFAULT_MAX_TASKS:,}" in message and "\n" not in message


def test_the_limit_is_inclusive():
    problem = build_problem(json.loads(CASE3.read_text()))
    bound = task_count_bound(problem)
    assert len(compile_plan(problem, solver=FAST_SOLVER, max_tasks=bound).tasks) == bound
    with pytest.raises(TooManyTasksError, match=f"--max-tasks {bound}"):
        compile_plan(problem, solver=FAST_SOLVER, max_tasks=bound - 1)


def test_compile_refuses_the_issues_problem_with_one_line_and_exit_2():
    """The installed script, as a user runs it; the timeout only catches the old behaviour (minutes, then death)."""
    result = subprocess.run([str(SCRIPT), "compile", *HUGE_FLAGS], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: problem: cutting it gives up to 2,699,440 unit tasks"), result.stderr
    assert f"--max-tasks {HUGE_TASKS}" in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", [
    ["compile", str(CASE3), "--solver", FAST_SOLVER],
    ["compare", str(CASE3)],
])
def test_every_problem_command_takes_max_tasks(command):
    refused = CliRunner().invoke(main, command + ["--max-tasks", "3"])
    assert refused.exit_code == 2, refused.output
    assert "up to 4 unit tasks" in refused.stderr and "--max-tasks 4" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1
    assert CliRunner().invoke(main, command + ["--max-tasks", "4"]).exit_code == 0


@pytest.mark.parametrize("command", ["schedule", "compare-schedules"])
def test_pipeline_commands_take_max_tasks(command):
    pipeline = ROOT / "bench" / "pipelines" / "gpt-1.3b-2x2-fp16.json"
    refused = CliRunner().invoke(main, [command, str(pipeline), "--solver", FAST_SOLVER, "--max-tasks", "1"])
    assert refused.exit_code == 2, refused.output
    assert "unit tasks" in refused.stderr and "--max-tasks" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_max_tasks_must_be_positive():
    result = CliRunner().invoke(main, ["compile", str(CASE3), "--max-tasks", "0"])
    assert result.exit_code == 2 and "--max-tasks" in result.stderr
