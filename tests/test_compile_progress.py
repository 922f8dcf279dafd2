"""compile_plan reports its steps for progress display; a terminal sees them with elapsed time."""

import sys

import pytest

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


def test_a_long_run_piped_prints_one_line_per_phase_and_a_short_one_nothing(monkeypatch, capsys):
    """stderr not a terminal (a log, CI): nothing for a run under QUIET_S, then a line for each phase as it starts."""
    import time

    from xmesh_plan.planner import progress as module

    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    monkeypatch.setattr(module, "QUIET_S", 0.05)
    with module.progress("compiling") as timing:
        timing["stage"]("cutting unit tasks")
        deadline = time.monotonic() + 30
        while "cutting" not in capsys.readouterr().err and time.monotonic() < deadline:  # the timer thread prints it
            time.sleep(0.01)
        timing["stage"]("costing 4 cells")
        timing["count"](1, 4)
        timing["stage"]("scheduling 4 tasks with auto")
    lines = capsys.readouterr().err.splitlines()
    assert lines[:2] == ["compiling: costing 4 cells ...", "compiling: scheduling 4 tasks with auto ..."]
    assert lines[2].startswith("compiling: done in ") and len(lines) == 3


def test_verify_reports_its_steps_and_counts_the_tensors_it_replays():
    from pathlib import Path

    from xmesh_plan.planner.verify import verify_plan
    from xmesh_plan.schemas import read_plan_file

    plan = read_plan_file(Path(__file__).resolve().parents[1] / "plans" / "weight_sync_small.plan.json")
    stages, counts = [], []
    verify_plan(plan, on_stage=stages.append, on_count=lambda done, total: counts.append((done, total)))
    assert stages == [f"checking {len(plan.operations)} operations", "replaying 21 tensors"]
    assert counts == [(k, 21) for k in range(22)]


def test_compile_pauses_the_cyclic_collector_and_turns_it_back_on_even_when_it_fails(case):
    """compile_plan runs with gc paused (a third of a large compile was collector passes) and restores it."""
    import gc

    from xmesh_plan.planner.compile import compile_plan

    seen = []
    compile_plan(case("case3"), on_stage=lambda stage: seen.append(gc.isenabled()))
    assert seen and not any(seen) and gc.isenabled()
    with pytest.raises(ValueError, match="unknown solver"):
        compile_plan(case("case3"), solver="nope")
    assert gc.isenabled()
    gc.disable()
    try:
        compile_plan(case("case3"))
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()
