"""compile_plan reports its steps for progress display; a terminal sees them with elapsed time."""

import sys

from xmesh_plan.planner.cli_solvers import progress
from xmesh_plan.planner.compile import compile_plan


def test_compile_reports_each_step_in_order_without_changing_the_plan(case):
    problem = case("case4")
    stages: list[str] = []
    plan = compile_plan(problem, on_stage=stages.append)
    assert [s.split()[0] for s in stages] == ["cutting", "costing", "scheduling", "timing"]
    assert stages[2] == f"scheduling {len(plan.tasks)} tasks with auto"
    assert plan.to_json() == compile_plan(problem).to_json()


def test_progress_draws_the_stage_on_a_terminal_and_stays_silent_when_piped(monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    with progress("compiling") as timing:
        timing["stage"]("scheduling 4 tasks with auto")
    shown = capsys.readouterr().err
    assert "compiling: scheduling 4 tasks with auto ... " in shown and "compiling: done in" in shown
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    with progress("compiling") as timing:
        timing["stage"]("scheduling 4 tasks with auto")
    assert capsys.readouterr().err == "" and timing["seconds"] >= 0
