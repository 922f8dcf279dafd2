"""Issue 9, sections 2 and 3: every number finite and in range at the door, no traceback for any input.

Each row is an input that once escaped as a traceback (or was accepted and broke a later reader);
now it is one `error:` line naming the field, exit code 2. The last-resort handler turns anything
else into one internal-error line (exit 1) unless `--debug` or XMESH_PLAN_DEBUG asks for the traceback.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xmesh_plan.planner import cli
from xmesh_plan.planner.cli import main
from tests.support.cli import assert_user_error, run_cli

DEBUG_ENV = "XMESH_PLAN_DEBUG"  # the documented name (schemas/last_resort.py)

ROOT = Path(__file__).resolve().parents[1]
CASE3_PLAN = ROOT / "plans" / "case3.plan.json"
PIPELINE = ROOT / "bench" / "pipelines" / "gpt-1.3b-2x2-fp16.json"
GOOD = {"shape": [8, 8, 4], "dtype": "int32", "src": {"mesh": "2x4", "spec": "R S0 R"}, "dst": {"mesh": "2x4", "spec": "S0 R R"}}
DIGITS_5000 = "9" * 5000


def with_(path: tuple, value, base=GOOD) -> dict:
    raw = json.loads(json.dumps(base))
    node = raw
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return raw


CLUSTER_NUMBERS = [  # (field path, JSON value, words the error must name)
    (("cluster", "intra_host_gbps"), float("inf"), ["cluster.intra_host_gbps", "finite"]),
    (("cluster", "intra_host_gbps"), 1e-320, ["cluster.intra_host_gbps", "1e-06"]),
    (("cluster", "latency_us"), float("inf"), ["cluster.latency_us", "finite"]),
    (("cluster", "latency_us"), float("nan"), ["cluster.latency_us", "finite"]),
    (("cluster", "latency_us"), -1, ["cluster.latency_us"]),
    (("cluster", "nics"), [{"send_gbps": float("inf")}], ["cluster.nics.0.send_gbps", "finite"]),
    (("cluster", "nics"), [{"recv_gbps": 1e-320}], ["cluster.nics.0.recv_gbps"]),
    (("cluster", "nics"), [{"send_gbps": True}], ["cluster.nics.0.send_gbps", "boolean"]),
    (("cluster", "devices_per_host"), True, ["cluster.devices_per_host", "boolean"]),
    (("cluster", "devices_per_host"), 10**30, ["cluster.devices_per_host", "too large"]),
    (("cluster", "latency_us"), int(DIGITS_5000[:400]), ["cluster.latency_us", "finite"]),
]
SHAPES = [
    (("shape",), [10**30, 8, 4], ["shape.0", "too large"]),
    (("shape",), [2**62, 8, 4], ["shape", "int64"]),  # each dim fits, the size in bytes does not
    (("shape",), [True, 8, 4], ["shape.0", "boolean"]),
    (("shape",), [1] * 17, ["shape", "16"]),
    (("shape",), [-1, 8, 4], ["shape.0", "negative"]),
    (("shape",), DIGITS_5000, ["shape", "2^63-1"]),
]
MESHES = [
    (("src", "mesh"), "1000000x1000000", ["src.mesh", "1,048,576"]),
    (("src", "mesh"), DIGITS_5000, ["src.mesh", "2^63-1"]),
    (("src", "mesh"), {"shape": [2, 4], "first_host": 2**40}, ["src.mesh", "first_host"]),
    (("src", "mesh"), {"shape": [2, 4], "devices": [2**40 + i for i in range(8)]}, ["src.mesh", "device id"]),
    (("src", "mesh"), {"shape": [1] * 40, "devices": [0]}, ["src.mesh", "axes"]),
]


@pytest.mark.parametrize("path,value,words", CLUSTER_NUMBERS + SHAPES + MESHES,
                         ids=[f"{'.'.join(p)}={str(v)[:20]}" for p, v, _ in CLUSTER_NUMBERS + SHAPES + MESHES])
def test_bad_numbers_in_a_problem_are_one_line(tmp_path, path, value, words):
    problem = tmp_path / "p.json"
    problem.write_text(json.dumps(with_(path, value)))
    assert_user_error(run_cli("compile", problem, "--solver", "greedy", "-o", tmp_path / "out.json"), *words)
    assert not (tmp_path / "out.json").exists()


UNREADABLE = [  # (suffix, content, words)
    *[(suffix, b"\xff\xfe\x00binary", ["not a text file"]) for suffix in (".json", ".toml")],
    (".json", '{"name": "\ud800"}'.encode("utf-8", "surrogatepass"), ["not a text file"]),
    (".json", b"[" * 100_000, ["nested too deeply"]),
    (".json", b'{"a":' * 100_000, ["nested too deeply"]),
    (".toml", b"x = " + b"[" * 100_000, ["nested too deeply"]),
    (".toml", b"x = " + b"{a = " * 100_000, ["nested too deeply"]),
    (".json", f'{{"shape": [{DIGITS_5000}]}}'.encode(), ["thousands of digits"]),
    (".toml", f"shape = [{DIGITS_5000}]".encode(), ["thousands of digits"]),
]


@pytest.mark.parametrize("suffix,content,words", UNREADABLE, ids=[f"{s}-{c[:12]!r}" for s, c, _ in UNREADABLE])
def test_unreadable_problem_files_are_one_line(tmp_path, suffix, content, words):
    problem = tmp_path / f"p{suffix}"
    problem.write_bytes(content)
    for command in ("compile", "compare"):
        assert_user_error(run_cli(command, problem), str(problem), *words)


def test_a_byte_order_mark_is_accepted(tmp_path):
    problem = tmp_path / "p.json"
    problem.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode())
    result = run_cli("compile", problem, "--solver", "greedy")
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("content,words", [(b"[" * 100_000, ["nested too deeply"]), (b"\xff\xfe", ["not a text file"]),
                                           (f'{{"x": {DIGITS_5000}}}'.encode(), ["thousands of digits"])])
@pytest.mark.parametrize("command", ["inspect", "verify", "check"])
def test_unreadable_plan_files_are_one_line(tmp_path, content, words, command):
    plan = tmp_path / "x.plan.json"
    plan.write_bytes(content)
    assert_user_error(run_cli(command, plan), str(plan), *words)


@pytest.mark.parametrize("command,words", [
    (["schedule", PIPELINE, "--solver", "greedy", "--seed", "99999999999999999999"], ["--seed", "2147483647"]),
    (["compare", ROOT / "plans" / "case3.problem.json", "--seed", "99999999999999999999"], ["--seed"]),
    (["compile", ROOT / "plans" / "case3.problem.json", "--seed", "-1"], ["--seed"]),
    (["compile", ROOT / "plans" / "case3.problem.json", "--time-limit", "1e300"], ["--time-limit", "1e+06"]),
    (["schedule", PIPELINE, "--schedule", "1f1b-wd", "--weight-delay", DIGITS_5000 + ",0"], ["--weight-delay", "more than"]),
])
def test_flags_are_bounded_to_what_every_component_accepts(command, words):
    assert_user_error(run_cli(*command), *words)


def test_png_to_a_missing_folder_is_one_line(tmp_path):
    pytest.importorskip("matplotlib")
    schedule = tmp_path / "s.json"
    assert run_cli("schedule", PIPELINE, "--solver", "greedy", "-o", schedule).exit_code == 0
    assert_user_error(run_cli("simulate", schedule, "--png", tmp_path / "none" / "x.png"), "--png", "cannot write")


# --- the last-resort handler ------------------------------------------------------------------------------------


def _explode(*args, **kwargs):
    raise ZeroDivisionError("a bug planted by the test")


def test_an_internal_error_is_one_line_exit_1(monkeypatch, capsys):
    monkeypatch.setattr(cli, "summarize", _explode)
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["inspect", str(CASE3_PLAN)])  # as the console script calls it
    assert exit_info.value.code == 1
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("internal error: ZeroDivisionError: a bug planted by the test"), lines[0]
    assert "--debug" in lines[0] and DEBUG_ENV in lines[0]


@pytest.mark.parametrize("debug_flag,env", [(True, None), (False, "1")])
def test_debug_shows_the_real_exception(monkeypatch, debug_flag, env):
    monkeypatch.setattr(cli, "summarize", _explode)
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    if env:
        monkeypatch.setenv(DEBUG_ENV, env)
    with pytest.raises(ZeroDivisionError):
        main(["--debug"] * debug_flag + ["inspect", str(CASE3_PLAN)])


def test_tests_still_see_tracebacks_through_the_cli_runner(monkeypatch):
    monkeypatch.setattr(cli, "summarize", _explode)
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert isinstance(run_cli("inspect", CASE3_PLAN).exception, ZeroDivisionError)


def test_the_console_script_reports_an_internal_error_in_one_line(tmp_path):
    """The installed `xmesh-plan`, with the bug planted through a sitecustomize on its path."""
    (tmp_path / "sitecustomize.py").write_text("import xmesh_plan.planner.cli as cli\ncli.summarize = lambda *a, **k: 1 / 0\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop(DEBUG_ENV, None)
    script = Path(sys.executable).parent / "xmesh-plan"
    result = subprocess.run([str(script), "inspect", str(CASE3_PLAN)], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("internal error: ZeroDivisionError") and "Traceback" not in result.stderr, result.stderr
    debug = subprocess.run([str(script), "--debug", "inspect", str(CASE3_PLAN)], capture_output=True, text=True, env=env, timeout=120)
    assert "Traceback" in debug.stderr and debug.returncode == 1


def test_the_executor_demo_reports_an_internal_error_in_one_line(tmp_path):
    """`python -m xmesh_plan.executor.run`, with reading the plan made to fail unexpectedly."""
    (tmp_path / "sitecustomize.py").write_text("import xmesh_plan.schemas as schemas\nschemas.read_plan_file = lambda *a, **k: 1 / 0\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop(DEBUG_ENV, None)
    result = subprocess.run([sys.executable, "-m", "xmesh_plan.executor.run", str(CASE3_PLAN)], capture_output=True, text=True,
                            env=env, timeout=120, cwd=ROOT)
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("rank 0: internal error: ZeroDivisionError"), result.stderr
    assert "Traceback" not in result.stderr and "--debug" in result.stderr


# --- the demo commands: click, one line, one rank ---------------------------------------------------------------------

DEMOS = {"run": ("xmesh_plan.executor.run", "PMI_RANK", [str(CASE3_PLAN)]),
         "torch_run": ("xmesh_plan.executor.torch_run", "RANK", [str(CASE3_PLAN)]),
         "redistribute_demo": ("xmesh_plan.redistribute_demo", "RANK", []),
         "pipeline_mlp": ("xmesh_plan.executor.examples.pipeline_mlp", "PMI_RANK", ["mlp-inputs"]),
         "torch_pipeline_csv": ("xmesh_plan.executor.examples.torch_pipeline_csv", "RANK", ["s.csv"])}


def _demo(name: str, flags: list[str], rank: int = 0) -> subprocess.CompletedProcess:
    """The demo started as one rank of a job would be (its launcher's rank variable set), before it joins the job."""
    module, variable, plans = DEMOS[name]
    env = {**os.environ, variable: str(rank)}
    env.pop(DEBUG_ENV, None)
    return subprocess.run([sys.executable, "-m", module, *plans, *flags], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)


@pytest.mark.parametrize("name,flags,expect", [
    ("run", ["--iters", "x"], "Invalid value for '--iters': 'x' is not a valid integer"),
    ("run", ["--order", "random"], "Invalid value for '--order'"),
    ("torch_run", ["--iters", "x"], "Invalid value for '--iters': 'x' is not a valid integer"),
    ("torch_run", ["--bogus"], "No such option '--bogus'"),
    ("redistribute_demo", ["--rows", "x"], "Invalid value for '--rows'"),
    ("redistribute_demo", ["--rows", "0"], "--rows, --cols and --iters must be positive, e.g. --rows 1000"),
    ("pipeline_mlp", ["--steps", "0"], "--steps 0: give at least 1, e.g. --steps 3"),
    ("pipeline_mlp", ["--steps", "x"], "Invalid value for '--steps'"),
    ("torch_pipeline_csv", ["--format", "x", "--micro-batches", "4"], "Invalid value for '--format'"),
    ("torch_pipeline_csv", [], "Missing option '--micro-batches'"),
])
def test_a_demo_refuses_a_bad_flag_in_one_line_with_exit_2(name, flags, expect):
    result = _demo(name, flags)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expect in lines[0] and "Traceback" not in result.stderr, result.stderr
    assert "--help" in lines[0] or "e.g." in lines[0]


@pytest.mark.parametrize("name", sorted(set(DEMOS) - {"torch_pipeline_csv"}))  # that one is a single process
def test_a_demo_prints_its_help_on_rank_0_only(name):
    """Every rank of a job gets `--help`; one copy of the help is enough, and no rank joins the job."""
    first, other = _demo(name, ["--help"], rank=0), _demo(name, ["--help"], rank=1)
    assert first.returncode == other.returncode == 0, first.stderr + other.stderr
    assert first.stdout.startswith("Usage: ") and "--help" in first.stdout, first.stdout
    assert other.stdout == "" and other.stderr == ""


# --- the executor API ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("timeout_s", [float("inf"), float("nan"), 0, -1, 1e300, True])
def test_pipeline_runner_refuses_a_timeout_that_is_not_finite(timeout_s):
    from xmesh_plan.executor.pipeline_runner import PipelineRunner, pipeline_executors

    with pytest.raises(ValueError, match="timeout_s=.* must be a finite number of seconds"):
        PipelineRunner(None, None, {}, 0, timeout_s=timeout_s)
    with pytest.raises(ValueError, match="timeout_s=.* must be a finite number of seconds"):
        pipeline_executors(None, {}, None, timeout_s=timeout_s)


PIPELINE_NUMBERS = [  # (mutation of the pipeline file, words the error must name)
    (lambda d: d["stages"][0].update(forward_s=float("inf")), ["stages.0.forward_s", "finite"]),
    (lambda d: d["stages"][0].update(backward_input_s=True), ["stages.0.backward_input_s", "boolean"]),
    (lambda d: d["stages"][0].update(activation_bytes=10**30), ["stages.0.activation_bytes", "too large"]),
    (lambda d: d.update(micro_batches=10**7), ["micro_batches", "10000"]),
    (lambda d: d["tensors"][0].update(shape=[2**62, 8, 1]), ["tensors.0", "int64"]),
    (lambda d: d["tensors"][0].update(src_stage=True), ["tensors.0.src_stage", "boolean"]),
]


@pytest.mark.parametrize("mutate,words", PIPELINE_NUMBERS, ids=[" ".join(w) for _, w in PIPELINE_NUMBERS])
def test_bad_numbers_in_a_pipeline_are_one_line(tmp_path, mutate, words):
    raw = json.loads(PIPELINE.read_text())
    mutate(raw)
    pipeline = tmp_path / "pipeline.json"
    pipeline.write_text(json.dumps(raw))
    assert_user_error(run_cli("schedule", pipeline, "--solver", "greedy"), str(pipeline), *words)
