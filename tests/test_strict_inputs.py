"""Inputs are taken as written or refused in one line (issue 28, items 3, 12, 13, 15, 16, 17).

Plan and problem numbers are strict: a boolean, a text number or a float where an integer belongs is
refused, not coerced; a JSON object naming a key twice is refused; a mesh gives `devices` or
`first_host`, not both; a plan whose cross-host operations are listed in no `host_order` is refused.
User text (a tensor name, an unknown key, a path) is quoted where it could break the one line. `compare`
works where nothing crosses a host (a lower bound of 0), and compile writes no plan its readers refuse.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xmesh_plan.planner.verify import PlanError, verify_plan
from xmesh_plan.schemas import Plan, files
from xmesh_plan.schemas.plan import PlanFileError, read_plan_file
from tests.support.cli import assert_user_error, run_cli

ROOT = Path(__file__).resolve().parents[1]
CASE3_PLAN = ROOT / "plans" / "case3.plan.json"
CASE3 = ROOT / "plans" / "case3.problem.json"
GOOD = {"shape": [8, 8], "dtype": "float32", "src": {"mesh": "1x2", "spec": "S0 R"}, "dst": {"mesh": "1x2", "spec": "R S1"}}
TRANSFER = {"src_mesh": "1x2", "dst_mesh": "1x2", "rules": [{"match": "*", "src": "S0", "dst": "R"}],
            "tensors": [{"name": "w", "shape": [4]}]}



def compile_raw(tmp_path: Path, raw, name: str = "p.json"):
    path = tmp_path / name
    path.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return run_cli("compile", path, "--solver", "greedy")


# --- 17: strict types at the door ---------------------------------------------------------------------------

def edited(source: Path, tmp_path: Path, where: tuple, value) -> Path:
    """A copy of the JSON file `source` in `tmp_path` with the field at path `where` set to `value`."""
    raw = json.loads(source.read_text())
    node = raw
    for key in where[:-1]:
        node = node[key]
    node[where[-1]] = value
    path = tmp_path / f"edited-{source.name}"
    path.write_text(json.dumps(raw))
    return path


@pytest.mark.parametrize("where,value", [
    (("operations", 0, "chunks"), True),
    (("operations", 0, "src"), True),
    (("operations", 0, "start_s"), "0.9"),
    (("operations", 0, "region", 0, 1), 512.0),
    (("tasks", 0, "nbytes"), "4096"),
    (("predicted_seconds",), "0.9"),
    (("merged_slices",), 1),
    (("host_order", 0, "tasks", 0), False),
])
def test_plan_numbers_and_flags_are_not_coerced(tmp_path, where, value):
    with pytest.raises(PlanFileError, match=".".join(map(str, where))):
        read_plan_file(edited(CASE3_PLAN, tmp_path, where, value))


@pytest.mark.parametrize("shape", [[8.0, 8], [8.5, 8], ["8", 8]])
def test_a_shape_of_floats_or_text_is_refused(tmp_path, shape):
    assert_user_error(compile_raw(tmp_path, {**GOOD, "shape": shape}), "shape.0")


def test_a_number_as_text_in_the_cluster_is_refused(tmp_path):
    assert_user_error(compile_raw(tmp_path, {**GOOD, "cluster": {"latency_us": "5"}}), "cluster.latency_us")


def test_a_duplicate_key_is_refused_naming_it(tmp_path):
    text = json.dumps(GOOD)[:-1] + ', "shape": [4, 4]}'
    assert_user_error(compile_raw(tmp_path, text), "shape", "twice")


def test_a_duplicate_key_in_a_plan_is_refused(tmp_path):
    path = tmp_path / "x.plan.json"
    path.write_text(CASE3_PLAN.read_text().replace('"strategy": "broadcast",', '"strategy": "broadcast", "strategy": "auto",', 1))
    assert_user_error(run_cli("verify", path), "strategy", "twice")


def test_first_host_with_devices_is_refused(tmp_path):
    raw = {**GOOD, "dst": {"mesh": {"shape": [2], "devices": [0, 1], "first_host": 5}, "spec": "R R"}}
    assert_user_error(compile_raw(tmp_path, raw), "dst.mesh", "devices", "first_host")


def test_an_empty_host_order_does_not_verify():
    plan = Plan.from_json(CASE3_PLAN.read_text())
    with pytest.raises(PlanError, match="host_order"):
        verify_plan(plan.model_copy(update={"host_order": ()}))


# --- 16: messages that say what is wrong ----------------------------------------------------------------------

@pytest.mark.parametrize("spec,words", [([1, 2], ["src.spec", "[1, 2]", "not a sharding spec"]),
                                        (3, ["src.spec", "not a sharding spec"]), (None, ["src.spec", "None"])])
def test_a_spec_that_is_not_text_says_so(tmp_path, spec, words):
    line = assert_user_error(compile_raw(tmp_path, {**GOOD, "src": {"mesh": "1x2", "spec": spec}}), *words)
    assert "empty" not in line


def test_a_cluster_that_is_not_an_object_says_so(tmp_path):
    line = assert_user_error(compile_raw(tmp_path, {**GOOD, "cluster": []}), "cluster: ")
    assert "cluster.Input" not in line


# --- 15: user text quoted -----------------------------------------------------------------------------------

def test_an_unknown_key_with_a_newline_is_quoted(tmp_path):
    assert_user_error(compile_raw(tmp_path, {**TRANSFER, "oops\nkey": 1}), "'oops\\nkey'")


def test_a_tensor_name_with_a_newline_is_quoted(tmp_path):
    raw = {**TRANSFER, "tensors": [{"name": "bad\nname", "shape": [4], "dtype": "nope"}]}
    assert_user_error(compile_raw(tmp_path, raw), "'bad\\nname'")


def test_a_solver_details_key_with_a_newline_is_quoted(tmp_path):
    assert_user_error(run_cli("inspect", edited(CASE3_PLAN, tmp_path, ("solver", "details", "x\ny"), 1)), "'x\\ny'")


def test_a_problem_path_with_a_newline_is_quoted(tmp_path):
    folder = tmp_path / "a\nb"
    folder.mkdir()
    path = folder / "p.json"
    path.write_text("{")
    assert_user_error(run_cli("compile", path), "a\\nb")


# --- 13: a repeated group's name that is not text -----------------------------------------------------------

@pytest.mark.parametrize("name", [["l{i}.w"], {"n": "l{i}.w"}])
def test_a_repeated_name_that_is_not_text_is_one_line(tmp_path, name):
    raw = {**TRANSFER, "tensors": [{"repeat": 2, "group": [{"name": name, "shape": [4]}]}]}
    assert_user_error(compile_raw(tmp_path, raw), "tensors[0].group[0].name", "not text")


# --- 12: compare with a lower bound of 0 --------------------------------------------------------------------

def test_compare_a_problem_of_local_copies_only(tmp_path):
    mesh = {"shape": [2], "devices": [0, 1]}
    path = tmp_path / "local.json"
    path.write_text(json.dumps({**GOOD, "src": {"mesh": mesh, "spec": "S0 R"}, "dst": {"mesh": mesh, "spec": "S0 R"}}))
    result = run_cli("compare", path, "--time-limit", "1")
    assert result.exit_code == 0, result.output
    assert "lower bound 0.0000 s" in result.output


# --- 3: compile writes no plan its readers refuse -----------------------------------------------------------

def test_compile_refuses_to_write_a_plan_above_what_readers_take(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MAX_FILE_BYTES", 2000)
    out = tmp_path / "plan.json"
    assert_user_error(run_cli("compile", CASE3, "--solver", "greedy", "-o", out), "--output", "MiB", "readers")
    assert not out.exists()
    assert_user_error(run_cli("compile", CASE3, "--solver", "greedy", "-o", "-"), "--output", "readers")


def test_an_oversized_plan_file_is_not_called_not_a_plan(tmp_path, monkeypatch):
    monkeypatch.setattr(files, "MAX_FILE_BYTES", 2000)
    line = assert_user_error(run_cli("verify", CASE3_PLAN), "MiB")
    assert "not a plan" not in line


def test_a_schedule_flag_as_a_number_is_refused(tmp_path):
    pipeline = ROOT / "bench" / "pipelines" / "gpt-1.3b-2x2-fp16.json"
    schedule = tmp_path / "s.json"
    assert run_cli("schedule", pipeline, "--schedule", "1f1b", "--solver", "greedy", "-o", schedule).exit_code == 0
    assert_user_error(run_cli("simulate", edited(schedule, tmp_path, ("overlap",), 1)), "overlap")


def test_verify_quotes_a_plan_path_with_a_newline(tmp_path):
    folder = tmp_path / "a\nb"
    folder.mkdir()
    path = folder / "x.plan.json"
    path.write_text(CASE3_PLAN.read_text())
    result = run_cli("verify", path)
    assert result.exit_code == 0 and result.output.count("\n") == 1 and "a\\nb" in result.output, result.output
