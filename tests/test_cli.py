"""The `xmesh-plan` command line: compile, inspect, verify, schema.

Most tests run the click app in-process (CliRunner); a few run the installed script as a subprocess to
check what a user really sees on stderr and that plans do not depend on the process's hash seed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xmesh_plan.planner.verify import verify_plan
from xmesh_plan.schemas.plan import Plan
from tests.support.cli import assert_user_error, run_cli

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(sys.executable).parent / "xmesh-plan"
CASE3 = ROOT / "plans" / "case3.problem.json"
CASE3_FLAGS = ["--shape", "1024,1024,512", "--dtype", "int32", "--src-mesh", "2x4", "--src-spec", "R S0 R",
               "--dst-mesh", "2x4", "--dst-spec", "S0 R R"]
FAST = ["--solver", "greedy"]
GOOD = ["--shape", "8,8", "--src-mesh", "2x2", "--src-spec", "S0 R", "--dst-mesh", "2x2", "--dst-spec", "R S1"]


def write_problem(tmp_path: Path, raw) -> str:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(raw) if not isinstance(raw, str) else raw)
    return str(path)


def good_raw(**changes):
    raw = {"shape": [8, 8], "dtype": "float32", "src": {"mesh": "2x2", "spec": "S0 R"}, "dst": {"mesh": "2x2", "spec": "R S1"}}
    raw.update(changes)
    return raw


# --- compile ----------------------------------------------------------------------------------------------

def test_compile_from_flags_and_from_file_give_the_same_plan(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    ra = run_cli("compile", *CASE3_FLAGS, *FAST, "-o", str(a))
    rb = run_cli("compile", str(CASE3), *FAST, "-o", str(b))
    assert ra.exit_code == 0 and rb.exit_code == 0, (ra.output, rb.output)
    plan_a, plan_b = Plan.from_json(a.read_text()), Plan.from_json(b.read_text())
    # the file names the problem; everything else is identical
    assert plan_b.problem.name == "case3"
    assert plan_a.model_copy(update={"problem": plan_a.problem.model_copy(update={"name": "case3"})}) == plan_b
    assert "4 unit tasks" in ra.stdout and "verified" in ra.stdout and "lower bound" in ra.stdout


def test_compile_to_stdout_is_the_plan_json():
    result = run_cli("compile", str(CASE3), *FAST, "-o", "-")
    assert result.exit_code == 0
    plan = Plan.from_json(result.stdout)
    verify_plan(plan)
    assert result.stdout == plan.to_json()


def test_compile_twice_is_byte_identical(tmp_path):
    """With the default solver and options: same input, same bytes."""
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert run_cli("compile", str(CASE3), "-o", str(a)).exit_code == 0
    assert run_cli("compile", str(CASE3), "-o", str(b)).exit_code == 0
    assert a.read_bytes() == b.read_bytes()


def test_plans_do_not_depend_on_the_hash_seed(tmp_path):
    """Two processes with different PYTHONHASHSEED (set and dict-of-str order) write the same bytes."""
    case4 = ROOT / "plans" / "case4.problem.json"
    outputs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([str(SCRIPT), "compile", str(case4), "-o", "-"], capture_output=True, env=env, cwd=tmp_path, timeout=120)
        assert done.returncode == 0, done.stderr.decode()
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1]


@pytest.mark.parametrize("strategy", ["broadcast", "send_recv", "local_allgather", "global_allgather", "auto"])
def test_compile_every_strategy_flag(tmp_path, strategy):
    out = tmp_path / "p.json"
    result = run_cli("compile", *GOOD, *FAST, "--strategy", strategy, "-o", str(out))
    assert result.exit_code == 0, result.output
    plan = Plan.from_json(out.read_text())
    assert plan.strategy == strategy
    verify_plan(plan)


def test_compile_no_merge_and_seed_are_recorded(tmp_path):
    out = tmp_path / "p.json"
    assert run_cli("compile", *GOOD, *FAST, "--no-merge", "--seed", "7", "-o", str(out)).exit_code == 0
    plan = Plan.from_json(out.read_text())
    assert plan.merged_slices is False and plan.solver.seed == 7


def test_compile_toml_problem(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text('shape = [8, 8]\ndtype = "bf16"\n[src]\nmesh = "2x2"\nspec = "S0 R"\n[dst]\nmesh = "2x2"\nspec = "R S1"\n')
    result = run_cli("compile", str(path), *FAST, "-o", "-")
    assert result.exit_code == 0, result.output
    assert Plan.from_json(result.stdout).problem.dtype == "bfloat16"


# --- bad input: exit 2, one line, names the field ---------------------------------------------------------

def _flags(**override):
    flags = dict(zip(GOOD[::2], GOOD[1::2]))
    flags.update(override)
    return [x for kv in flags.items() for x in kv]


@pytest.mark.parametrize("override, words", [
    ({"--src-spec": "S0 X"}, ["src.spec", "'X'"]),
    ({"--dst-spec": "R Q"}, ["dst.spec", "'Q'"]),
    ({"--dst-spec": "R R R"}, ["dst.spec", "3 entries", "2 dims"]),
    ({"--src-spec": "S0 S0"}, ["src.spec", "mesh axis 0"]),
    ({"--src-spec": "S2 R"}, ["src.spec", "mesh axis 2"]),
    ({"--src-spec": ""}, ["src.spec", "empty"]),
    ({"--shape": "8,a"}, ["shape", "8,a"]),
    ({"--shape": "-1,8"}, ["shape"]),
    ({"--src-mesh": "2xq"}, ["src.mesh", "2xq"]),
    ({"--dst-mesh": "two"}, ["dst.mesh", "two"]),
    ({"--dtype": "int33"}, ["dtype", "int33", "bfloat16"]),
])
def test_bad_flags(override, words):
    assert_user_error(run_cli("compile", *_flags(**override), *FAST), *words)


def test_missing_flag_names_it():
    flags = _flags()
    i = flags.index("--dst-spec")
    assert_user_error(run_cli("compile", *(flags[:i] + flags[i + 2:]), *FAST), "--dst-spec")


def test_file_and_flags_together_is_an_error():
    assert_user_error(run_cli("compile", str(CASE3), "--shape", "4", *FAST), "--shape")


@pytest.mark.parametrize("raw, words", [
    ("{bad", ["not valid JSON"]),
    ("[1]", ["problem"]),
    (good_raw(shape=None) | {"shape": None}, ["shape"]),
    ({k: v for k, v in good_raw().items() if k != "shape"}, ["shape", "required"]),
    (good_raw(bogus=1), ["bogus", "not a known field"]),
    (good_raw(dst={"mesh": "2x2"}), ["dst", "spec"]),
    (good_raw(dst={"mesh": {"shape": [2, 2], "bogus": 1}, "spec": "R S1"}), ["dst.mesh", "bogus"]),
    (good_raw(dtype="int33"), ["dtype", "int33"]),
    (good_raw(shape=[8, -1]), ["shape", "negative"]),
    (good_raw(shape=[8.5, 8]), ["shape"]),
    (good_raw(cluster={"devices_per_host": 0}), ["cluster.devices_per_host"]),
    (good_raw(cluster={"nics": []}), ["cluster.nics"]),
    (good_raw(cluster={"bogus": 1}), ["cluster.bogus"]),
    (good_raw(src={"mesh": "2x2", "spec": "S0 Z"}), ["src.spec", "'Z'"]),
])
def test_bad_problem_file(tmp_path, raw, words):
    assert_user_error(run_cli("compile", write_problem(tmp_path, raw), *FAST), *words)


def test_missing_problem_file_names_the_path(tmp_path):
    missing = tmp_path / "nope.json"
    assert_user_error(run_cli("compile", str(missing), *FAST), str(missing), "cannot read")


def test_bad_toml_names_the_file(tmp_path):
    path = tmp_path / "p.toml"
    path.write_text("shape = [\n")
    assert_user_error(run_cli("compile", str(path), *FAST), str(path), "TOML")


@pytest.mark.parametrize("raw, words", [
    (good_raw(dst={"mesh": "0x2", "spec": "R S1"}), ["dst.mesh"]),
    (good_raw(src={"mesh": {"shape": [2, 2], "devices": [0, 0, 1, 2]}, "spec": "S0 R"}), ["src.mesh"]),
    (good_raw(src={"mesh": {"shape": [2, 2], "devices": [0, 1, 2]}, "spec": "S0 R"}), ["src.mesh"]),
])
def test_bad_mesh_names_its_side(tmp_path, raw, words):
    assert_user_error(run_cli("compile", write_problem(tmp_path, raw), *FAST), *words)


@pytest.mark.parametrize("mesh", [[2, "a"], {"shape": [2, 2], "first_host": "a"}])
def test_non_integer_mesh_entries_are_user_errors(tmp_path, mesh):
    raw = good_raw(src={"mesh": mesh, "spec": "S0 R"})
    assert_user_error(run_cli("compile", write_problem(tmp_path, raw), *FAST), "src.mesh")


def test_unknown_solver_is_a_user_error():
    assert_user_error(run_cli("compile", *GOOD, "--solver", "nope"), "solver", "nope", "greedy")


def test_bad_input_through_the_real_script_has_no_traceback():
    done = subprocess.run([str(SCRIPT), "compile", *_flags(**{"--src-spec": "S0 X"}), *FAST], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [done.stderr.strip()] and done.stderr.startswith("error: src.spec")
    assert "Traceback" not in done.stderr and done.stdout == ""


# --- writing the output -----------------------------------------------------------------------------------

def test_write_into_a_missing_folder_fails_cleanly(tmp_path):
    target = tmp_path / "missing" / "plan.json"
    assert_user_error(run_cli("compile", *GOOD, *FAST, "-o", str(target)), "--output", str(target))
    assert list(tmp_path.iterdir()) == []


def test_failed_write_leaves_no_partial_or_temp_file(tmp_path, monkeypatch):
    target = tmp_path / "plan.json"
    target.write_text("old plan\n")

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    assert_user_error(run_cli("compile", *GOOD, *FAST, "-o", str(target)), "--output", "Permission denied")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # no .plan.json.*.tmp left behind
    assert target.read_text() == "old plan\n"  # the old file is untouched


def test_successful_write_leaves_only_the_plan(tmp_path):
    target = tmp_path / "plan.json"
    assert run_cli("compile", *GOOD, *FAST, "-o", str(target)).exit_code == 0
    assert [p.name for p in tmp_path.iterdir()] == ["plan.json"]
    verify_plan(Plan.from_json(target.read_text()))


# --- verify -----------------------------------------------------------------------------------------------

def _planted(tmp_path) -> tuple[Path, Path]:
    good = tmp_path / "good.plan.json"
    assert run_cli("compile", str(CASE3), *FAST, "--strategy", "send_recv", "-o", str(good)).exit_code == 0
    plan = Plan.from_json(good.read_text())
    box = ((0, 512), (0, 512), (0, 512))
    victim = next(op for op in plan.operations if op.region == box and op.dsts == (8,))
    bad_plan = plan.model_copy(update={"operations": tuple(op for op in plan.operations if op is not victim)})
    bad = tmp_path / "bad.plan.json"
    bad.write_text(bad_plan.to_json())
    return good, bad


def test_plan_json_text_round_trips_byte_for_byte(tmp_path):
    out = tmp_path / "p.json"
    assert run_cli("compile", str(CASE3), *FAST, "--strategy", "local_allgather", "-o", str(out)).exit_code == 0
    text = out.read_text()
    assert text.endswith("\n")
    assert Plan.from_json(text).to_json() == text


def test_verify_reference_plans_pass():
    plans = sorted(str(p) for p in (ROOT / "plans").glob("*.plan.json"))
    assert plans
    result = run_cli("verify", *plans)
    assert result.exit_code == 0, result.output
    assert result.stdout.count(": ok: ") == len(plans)


def test_verify_rejects_a_planted_wrong_plan_naming_device_and_box(tmp_path):
    good, bad = _planted(tmp_path)
    result = run_cli("verify", str(good), str(bad))
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"{good}: ok:")
    assert lines[1] == f"{bad}: FAILED: destination device 8 never receives [0:512, 0:512, 0:512] of its shard [0:512, 0:1024, 0:512]"


def test_verify_real_script_exit_1_on_a_wrong_sender(tmp_path):
    good, _ = _planted(tmp_path)
    plan = Plan.from_json(good.read_text())
    victim = next(op for op in plan.operations if op.region == ((0, 512), (0, 512), (0, 512)) and op.dsts == (8,))
    wrong = plan.model_copy(update={"operations": tuple(op.model_copy(update={"src": 5}) if op is victim else op for op in plan.operations)})
    bad = tmp_path / "wrong.plan.json"
    bad.write_text(wrong.to_json())
    done = subprocess.run([str(SCRIPT), "verify", str(bad)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert "device 5 sends [0:512, 0:512, 0:512] which it does not hold" in done.stdout
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("text, words", [
    ("{bad", ["not valid JSON"]),
    ('{"schema_version": 3}', ["schema_version 3"]),
    ('{"schema_version": 1, "generator": "x"}', ["problem", "required"]),
    ("{}", ["not a plan (no schema_version field)"]),
    ("[]", ["not a plan (no schema_version field)"]),
    (b"\xff\xfe\x00binary", ["not a text file"]),
])
def test_verify_unreadable_plan_is_a_user_error(tmp_path, text, words):
    path = tmp_path / "x.plan.json"
    path.write_bytes(text) if isinstance(text, bytes) else path.write_text(text)
    assert_user_error(run_cli("verify", str(path)), str(path), *words)


def test_verify_malformed_box_is_reported_not_a_traceback(tmp_path):
    raw = json.loads((ROOT / "plans" / "case3.plan.json").read_text())
    raw["operations"][0]["region"] = raw["operations"][0]["region"][:2]
    path = tmp_path / "short.plan.json"
    path.write_text(json.dumps(raw))
    result = run_cli("verify", str(path))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 1
    assert f"{path}: FAILED: operation 0" in result.stdout and "[0:512, 0:512]" in result.stdout


@pytest.mark.parametrize("mesh", ["2x", "x4", "2xx4"])
def test_incomplete_mesh_shorthand_is_rejected(mesh):
    assert_user_error(run_cli("compile", *_flags(**{"--src-mesh": mesh}), *FAST), "src.mesh")


def test_verify_missing_plan_file(tmp_path):
    assert_user_error(run_cli("verify", str(tmp_path / "none.json")), "cannot read the plan")


# --- inspect, schema, help -------------------------------------------------------------------------------

def test_inspect_case3_shows_bound_and_efficiency(tmp_path):
    out = tmp_path / "c3.json"
    assert run_cli("compile", str(CASE3), *FAST, "-o", str(out)).exit_code == 0
    plan = Plan.from_json(out.read_text())
    result = run_cli("inspect", str(out), "--tasks", "--ops")
    assert result.exit_code == 0, result.output
    text = result.stdout
    assert f"lower bound: {plan.lower_bound_seconds:.4f} s" in text
    assert f"predicted: {plan.predicted_seconds:.4f} s" in text
    assert f"efficiency (bound/predicted): {plan.efficiency:.1%}" in text
    assert "bytes crossing hosts: 2.000 GiB" in text  # case 3 moves the whole 2 GiB tensor across hosts once
    assert "mesh 2x4 [R S0 R] on hosts 0,1 -> mesh 2x4 [S0 R R] on hosts 2,3" in text
    assert sum(1 for line in text.splitlines() if line.lstrip().startswith("task ")) == len(plan.tasks)
    assert sum(1 for line in text.splitlines() if line.lstrip().startswith("op ")) == len(plan.operations)


def test_inspect_without_flags_omits_task_and_op_lists():
    text = run_cli("inspect", str(ROOT / "plans" / "case3.plan.json")).stdout
    lines = text.splitlines()
    assert any("lower bound" in line for line in lines)
    assert "tasks:" not in lines and "operations:" not in lines
    assert "tasks:" in run_cli("inspect", str(ROOT / "plans" / "case3.plan.json"), "--tasks").stdout.splitlines()


def test_inspect_reports_the_per_message_cost_on_the_busiest_nic_side(tmp_path):
    """A send/recv plan: every operation is one message, so the busiest side's count is plain counting."""
    out = tmp_path / "sr.json"
    assert run_cli("compile", str(CASE3), "--strategy", "send_recv", "-o", str(out)).exit_code == 0
    plan = Plan.from_json(out.read_text())
    host = plan.problem.cluster.host_of
    counts = {}
    for op in plan.operations:
        if op.kind == "send" and host(op.src) != host(op.dsts[0]):
            counts[(host(op.src), "send")] = counts.get((host(op.src), "send"), 0) + 1
            counts[(host(op.dsts[0]), "recv")] = counts.get((host(op.dsts[0]), "recv"), 0) + 1
    busiest = max(counts.values())
    line = next(x for x in run_cli("inspect", str(out)).stdout.splitlines() if x.startswith("per-message cost"))
    overhead = plan.problem.cluster.overhead_s
    assert f"carries {busiest} messages x {overhead * 1e6:g} us overhead = {busiest * overhead:.4f} s" in line, line
    assert "of the" in line and "gap to the bound" in line


def test_inspect_orders_times_the_plan_as_each_executor_queues_it(tmp_path):
    """Case 3 in the naive order: queued per NIC side it is 1.5x the bound; posted at once (as the MPI
    engine runs it, and as measured on the emulated cluster) the links stay full and it meets the bound."""
    out = tmp_path / "naive.json"
    assert run_cli("compile", str(CASE3), "--solver", "naive", "-o", str(out)).exit_code == 0
    plan = Plan.from_json(out.read_text())
    text = run_cli("inspect", str(out), "--orders").stdout
    seconds = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
               if line.startswith("  ") and line.split()[0] in ("host-order", "device-order", "posted")}
    assert set(seconds) == {"host-order", "device-order", "posted"}
    assert seconds["host-order"] == pytest.approx(plan.predicted_seconds, abs=1e-4)
    assert seconds["host-order"] > 1.3 * plan.lower_bound_seconds
    assert seconds["posted"] == pytest.approx(plan.lower_bound_seconds, rel=0.01)
    assert "each queueing" not in run_cli("inspect", str(out)).stdout


@pytest.mark.parametrize("which, key", [("plan", "operations"), ("problem", "src")])
def test_schema_prints_valid_json(which, key):
    result = run_cli("schema", "--of", which)
    assert result.exit_code == 0
    schema = json.loads(result.stdout)
    assert key in schema["properties"]


def test_schema_default_is_the_plan():
    assert json.loads(run_cli("schema").stdout)["title"] == "Plan"


@pytest.mark.parametrize("command", [[], ["compile"], ["inspect"], ["verify"], ["schema"]])
def test_help_of_every_command_has_an_example(command):
    result = run_cli(*command, "--help")
    assert result.exit_code == 0
    assert "Example" in result.stdout
    assert "xmesh-plan " in result.stdout.split("Example", 1)[1]


def test_check_says_a_plan_predates_the_per_message_overhead(tmp_path):
    """A plan file without cluster.overhead_us whose times the simulator no longer reproduces: the
    failure says why (made by the earlier network model); with the field, it does not."""
    import json
    data = json.loads((ROOT / "plans" / "case3.plan.json").read_text())
    data["problem"]["cluster"]["latency_us"] = 500.0  # times no longer match the stored ones
    with_field = tmp_path / "with.plan.json"
    with_field.write_text(json.dumps(data))
    del data["problem"]["cluster"]["overhead_us"]
    without = tmp_path / "without.plan.json"
    without.write_text(json.dumps(data))
    old, new = run_cli("check", str(without)), run_cli("check", str(with_field))
    assert old.exit_code == 1 and "compiled before the network model charged latency as a delay" in old.output, old.output
    assert new.exit_code == 1 and "stored" in new.output and "overhead_us" not in new.output, new.output
