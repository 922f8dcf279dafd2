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
from xmesh_plan.planner.transfer_io import load_any_problem
from xmesh_plan.planner.unit_tasks import (DEFAULT_MAX_TASKS, TooManyTasksError, decompose, split_by_receiver_host,
                                          split_task_count, task_count_bound)
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


# --- what --split-hosts makes, and multi-tensor files counted before they are built ---------------------------

def _fan_out_problem():
    """One replicated box, one source device, received on four hosts: one cell, four tasks once split by host."""
    return build_problem({"shape": [4], "dtype": "float32", "src": {"mesh": "1x1", "spec": "R"}, "dst": {"mesh": "4x1", "spec": "R"}})


def test_max_tasks_counts_what_split_hosts_makes():
    problem = _fan_out_problem()
    assert task_count_bound(problem) == 1
    with pytest.raises(TooManyTasksError, match="--split-hosts.* 4 unit tasks.*--max-tasks 4"):
        compile_plan(problem, solver=FAST_SOLVER, split_hosts=True, max_tasks=3)
    assert len(compile_plan(problem, solver=FAST_SOLVER, split_hosts=True, max_tasks=4).tasks) == 4


def test_the_cli_refuses_split_tasks_above_max_tasks(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"shape": [4], "dtype": "float32", "src": {"mesh": "1x1", "spec": "R"},
                                "dst": {"mesh": "4x1", "spec": "R"}}))
    refused = CliRunner().invoke(main, ["compile", str(path), "--split-hosts", "--max-tasks", "3"])
    assert refused.exit_code == 2 and "--split-hosts" in refused.stderr and "--max-tasks 4" in refused.stderr, refused.output


@settings(max_examples=80, **SETTINGS)
@given(problems())
def test_the_split_count_is_what_splitting_the_cut_cells_makes(problem):
    """Counted from the cut points, merged or not, on disjoint, shared-host and shared-device meshes."""
    for merge in (True, False):
        cut = split_by_receiver_host(decompose(problem, merge=merge, max_tasks=None), problem.cluster)
        assert split_task_count(problem, merge) == len(cut)


SMALL = ROOT / "plans" / "weight_sync_small.problem.toml"
LLAMA = ROOT / "plans" / "weight_sync_llama3_8b.problem.toml"


def test_the_first_refusal_names_the_limit_the_next_compile_passes(tmp_path):
    """The issue's repro: --max-tasks 10 named 100 (the cells before splitting), and 100 was then refused naming 200.
    Before cutting, the 7 kinds of tensor split into 72 boxes: the refusal names what all 21 tensors split into (200),
    which the scheduled count (84, small boxes bundled) passes too."""
    out = tmp_path / "ws.plan.json"
    refused = CliRunner().invoke(main, ["compile", str(SMALL), "--solver", FAST_SOLVER, "--max-tasks", "10", "-o", str(out)])
    assert refused.exit_code == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.output
    assert "the 7 kinds of tensor it cuts (shape and specs) give 72 unit tasks" in refused.stderr, refused.stderr
    assert "--max-tasks 200 " in refused.stderr and "what its 21 tensors give together" in refused.stderr, refused.stderr
    assert "--no-split-hosts" in refused.stderr
    passed = CliRunner().invoke(main, ["compile", str(SMALL), "--solver", FAST_SOLVER, "--max-tasks", "200", "-o", str(out)])
    assert passed.exit_code == 0, passed.output
    unsplit = CliRunner().invoke(main, ["compile", str(SMALL), "--no-split-hosts", "--max-tasks", "1"])
    named = int(unsplit.stderr.split("--max-tasks ")[1].split()[0])
    assert unsplit.exit_code == 2 and 1 < named, unsplit.output
    assert CliRunner().invoke(main, ["compile", str(SMALL), "--solver", FAST_SOLVER, "--no-split-hosts", "--max-tasks", str(named),
                                     "-o", str(out)]).exit_code == 0


def test_max_tasks_counts_the_tasks_a_compile_schedules(tmp_path):
    """The kinds' 72 boxes pass a limit of 80; the 84 tasks the 21 tensors schedule (small boxes bundled) do not, and
    the refusal comes before anything is costed, naming 84, which then passes."""
    from xmesh_plan.planner import compile as compile_module

    problem = load_any_problem(SMALL)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compile_module, "task_options", lambda *a, **k: pytest.fail("costed before the scheduled count"))
        with pytest.raises(TooManyTasksError, match=r"its 21 tensors schedule 84 unit tasks \(split by receiving host, small "
                                                    r"boxes bundled\), above the limit of 80; pass --max-tasks 84 "):
            compile_plan(problem, solver=FAST_SOLVER, max_tasks=80)
    assert len(compile_plan(problem, solver=FAST_SOLVER, max_tasks=84).tasks) == 84


def test_compile_plan_counts_split_tasks_before_cutting_anything(monkeypatch):
    """compile_plan's own check (the library path, no reader in front) counts each kind's boxes before any tensor is
    cut, and names what all the tensors split into."""
    from xmesh_plan.planner import compile as compile_module

    problem = load_any_problem(LLAMA)
    monkeypatch.setattr(compile_module, "decompose", lambda *a, **k: pytest.fail("a tensor was cut before the count"))
    with pytest.raises(TooManyTasksError, match="kinds of tensor it cuts .* give .* unit tasks.*--max-tasks 47296 .*what its 291 "
                                                "tensors give together"):
        compile_plan(problem, max_tasks=10)
    with pytest.raises(TooManyTasksError, match="--max-tasks 23648 .*what its 291 tensors give together"):
        compile_plan(problem, max_tasks=10, split_hosts=False)


def test_the_reader_and_compile_name_the_same_limit():
    """The file reader counts from the entries as written, compile_plan from the built problem: one number."""
    import tomllib

    from xmesh_plan.planner.transfer_io import build_transfer

    for path in (SMALL, LLAMA):
        raw = tomllib.loads(path.read_text())
        for split in (True, False):
            with pytest.raises(TooManyTasksError) as read:
                build_transfer(raw, max_tasks=10, split_hosts=split)
            with pytest.raises(TooManyTasksError) as compiled:
                compile_plan(build_transfer(raw), max_tasks=10, split_hosts=split)
            assert str(read.value) == str(compiled.value)


def test_the_reader_and_compile_count_the_same_kinds():
    """l1.a takes l0.b's specs from a rule, so the four tensors are two kinds: the reader (from the entries, name by
    name) and compile (from the built problem) count them alike."""
    from xmesh_plan.planner.transfer_io import build_transfer

    raw = {"src_mesh": "1x4", "dst_mesh": "1x2", "rules": [{"match": "l1.a", "src": "S1 R", "dst": "R S1"},
                                                          {"match": "*", "src": "R R", "dst": "R R"}],
           "tensors": [{"repeat": 2, "group": [{"name": "l{i}.a", "shape": [8, 8]},
                                               {"name": "l{i}.b", "shape": [8, 8], "src": "S1 R", "dst": "R S1"}]}]}
    with pytest.raises(TooManyTasksError) as read:
        build_transfer(json.loads(json.dumps(raw)), max_tasks=1)
    with pytest.raises(TooManyTasksError) as compiled:
        compile_plan(build_transfer(json.loads(json.dumps(raw))), max_tasks=1)
    assert "the 2 kinds of tensor" in str(compiled.value) and str(read.value) == str(compiled.value)


REPEATED = {"src_mesh": "2x4", "dst_mesh": "2x4", "rules": [{"match": "*", "src": "S0 R", "dst": "R S1"}],
            "tensors": [{"repeat": 100_000, "group": [{"name": "l{i}.w", "shape": [64, 64]}]}]}


def test_a_repeated_file_is_refused_from_its_counts_before_the_problem_is_built(monkeypatch):
    from xmesh_plan.planner import transfer_io

    counted = []
    count_tasks = transfer_io.count_tasks
    monkeypatch.setattr(transfer_io, "count_tasks", lambda p, *a: counted.append(p) or count_tasks(p, *a))

    def not_built(**kwargs):
        raise AssertionError("the transfer problem was built before its task count was checked")

    monkeypatch.setattr(transfer_io, "TransferProblem", not_built)
    monkeypatch.setattr(transfer_io, "_tensor", lambda *a: pytest.fail("a repeated group was unrolled before counting"))
    # each tensor cuts into 8 cells, each received on the 2 destination hosts: 16 tasks once split (the default); the
    # one kind's 16 pass a limit of 16, and above it the refusal names what the 100,000 tensors split into
    with pytest.raises(TooManyTasksError, match="the 1 kinds of tensor it cuts .* give 16 unit tasks.*--max-tasks 1600000 "):
        transfer_io.build_transfer(json.loads(json.dumps(REPEATED)), max_tasks=15)
    assert len(counted) == 1  # 100,000 tensors of one shape and specs: one count


def test_the_cli_refuses_a_repeated_file_above_max_tasks(tmp_path, monkeypatch):
    from xmesh_plan.planner import transfer_io

    monkeypatch.setattr(transfer_io.TransferProblem, "__init__", lambda *a, **k: pytest.fail("built before counting"))
    path = tmp_path / "p.json"
    path.write_text(json.dumps(REPEATED))
    refused = CliRunner().invoke(main, ["compile", str(path), "--max-tasks", "15"])
    assert refused.exit_code == 2 and "--max-tasks 1600000 " in refused.stderr, refused.output
    unsplit = CliRunner().invoke(main, ["compile", str(path), "--no-split-hosts", "--max-tasks", "7"])
    assert unsplit.exit_code == 2 and "--max-tasks 800000 " in unsplit.stderr, unsplit.output


def test_a_repeated_group_with_rules_is_counted_name_by_name_before_unrolling(monkeypatch):
    from xmesh_plan.planner import transfer_io

    monkeypatch.setattr(transfer_io, "_tensor", lambda *a: pytest.fail("a repeated group was unrolled before counting"))
    raw = {**REPEATED, "rules": [{"match": "l1?.w", "src": "R R", "dst": "R R"}, {"match": "*", "src": "S0 R", "dst": "R S1"}],
           "tensors": [{"repeat": 20, "group": [{"name": "l{i}.w", "shape": [64, 64]}]}]}
    # l10.w .. l19.w take the first rule (nothing to cut: 1 task each), the other ten 8 tasks each: two kinds, 1 + 8
    with pytest.raises(TooManyTasksError, match="the 2 kinds of tensor it cuts .* give 9 unit tasks.*--max-tasks 90 "):
        transfer_io.build_transfer(raw, max_tasks=8, split_hosts=False)
    # split by host, each of those cells is received on the 2 destination hosts: 2 + 16, and 10 x 2 + 10 x 16 together
    with pytest.raises(TooManyTasksError, match="give 18 unit tasks.*--max-tasks 180 "):
        transfer_io.build_transfer(raw, max_tasks=17)


@pytest.mark.parametrize("groups,size", [(1, 50), (30, 1)])
def test_tensors_past_the_file_limit_are_not_counted_name_by_name(monkeypatch, groups, size):
    """100,000 copies of a 50-tensor group (or 30 groups of 100,000): the file states more tensors than a problem
    may hold, so it is refused naming the entry that passes the limit, after at most that many rule matches (not
    5,000,000 of them first, 43 s)."""
    from xmesh_plan.planner import transfer_io

    matched = []
    spec = transfer_io._RuleMatcher.spec
    monkeypatch.setattr(transfer_io._RuleMatcher, "spec", lambda self, name, side: matched.append(name) or spec(self, name, side))
    group = [{"name": f"l{{i}}.t{j}", "shape": [64, 64]} for j in range(size)]
    raw = {**REPEATED, "tensors": [{"repeat": 100_000, "group": group} for _ in range(groups)]}
    with pytest.raises(transfer_io.InputError, match=r"tensors\[\d+\]: 100000 x \d+ tensors would pass 100,000 in all"):
        transfer_io.build_transfer(raw, max_tasks=DEFAULT_MAX_TASKS)
    assert len(matched) <= 2 * transfer_io.MAX_TENSORS  # one match per side and tensor within the limit


def test_tensors_past_the_file_limit_are_refused_as_such_not_as_too_many_tasks():
    """Tensors giving their own specs count from the entries; past the tensor limit, raising --max-tasks cannot help,
    so the message is the tensor limit's."""
    from xmesh_plan.planner import transfer_io

    group = [{"name": "a{i}", "shape": [64, 64], "src": "S0 R", "dst": "R S1"}]
    raw = {**REPEATED, "tensors": [{"repeat": 100_000, "group": group} for _ in range(30)]}
    with pytest.raises(transfer_io.InputError, match=r"tensors\[1\]: 100000 x 1 tensors would pass 100,000 in all"):
        transfer_io.build_transfer(raw, max_tasks=DEFAULT_MAX_TASKS)


def test_rules_are_bounded(tmp_path):
    from xmesh_plan.planner.transfer_io import MAX_RULES, InputError, build_transfer

    raw = {**REPEATED, "rules": [{"match": f"x{k}.*", "src": "S0 R", "dst": "R S1"} for k in range(MAX_RULES + 1)]}
    with pytest.raises(InputError, match=f"rules: {MAX_RULES + 1} rules; give at most {MAX_RULES}"):
        build_transfer(raw)


def test_the_first_fitting_rule_gives_each_side_and_unused_patterns_are_named():
    from xmesh_plan.planner.transfer_io import InputError, build_transfer

    raw = {"src_mesh": "1x2", "dst_mesh": "1x2", "tensors": [{"name": "a.w", "shape": [4]}, {"name": "b.w", "shape": [4]}],
           "rules": [{"match": "a.*", "dst": "S0"}, {"match": "*.w", "src": "S0", "dst": "R"}, {"match": "[ab].w", "src": "R"}]}
    problem = build_transfer(raw)  # rules[2] is shadowed by rules[1], but its pattern fits names: kept
    assert [(str(t.src), str(t.dst)) for t in problem.tensors] == [("S0", "S0"), ("S0", "R")]
    raw["rules"][2]["match"] = "c.w"
    with pytest.raises(InputError, match=r"rules\[2\] \(match 'c.w'\) fits no tensor"):
        build_transfer(raw)


def test_the_deepseek_v3_like_weight_sync_passes_the_default_limit():
    """Its 1,025 tensors split into 7,099,392 boxes, which the default refused; its 17 kinds are cut once each (148,480 boxes)
    and it schedules 613,248 tasks (boxes up to 4 MiB bundled into 32 MiB bundles), within the default: refused below that, before anything is costed."""
    from xmesh_plan.planner import compile as compile_module

    problem = load_any_problem(ROOT / "plans" / "weight_sync_deepseek_v3.problem.toml", DEFAULT_MAX_TASKS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compile_module, "task_options", lambda *a, **k: pytest.fail("costed before the scheduled count"))
        with pytest.raises(TooManyTasksError, match="its 1025 tensors schedule 613,248 unit tasks .*--max-tasks 613248 "):
            compile_plan(problem, max_tasks=613_247)
    assert 613_248 <= DEFAULT_MAX_TASKS
