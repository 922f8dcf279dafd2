"""BENCHMARKS.md is generated from bench/results/*.json by bench/benchmarks_doc.py; the committed file must be what the
script makes of the committed results, so no table shows a figure its results file does not hold."""

import runpy
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def render() -> str:
    return runpy.run_path(str(ROOT / "bench" / "benchmarks_doc.py"))["render"]()


def test_benchmarks_md_is_what_the_results_files_make():
    made = render()
    assert (ROOT / "BENCHMARKS.md").read_text() == made, "BENCHMARKS.md is stale: run `make benchmarks-doc`"


def test_every_section_answers_one_question_with_a_command_and_a_table():
    text = render()
    sections = text.split("\n## ")[1:]
    titles = [s.splitlines()[0] for s in sections]
    assert titles == ["Metrics", "Paper cases, held against the bound", "Weight sync", "Scale", "Frontier scale", "Executor overhead",
                      "Emulated cluster, measured against the model", "Pipelines"]
    for section in sections[1:]:
        assert "```\n" in section and "\n|:" in section, section.splitlines()[0]


def _rank_load_entry(tmp_path, monkeypatch, *flags: str) -> dict:
    """What `bench.bench_rank_load` records of a run on the small weight sync's compact file (the measuring
    processes replaced by a fixed row: the entry's fields are what is looked at)."""
    import json

    from click.testing import CliRunner

    from bench import bench_rank_load
    from xmesh_plan.schemas import read_plan_file
    from xmesh_plan.schemas.files import write_atomic
    from xmesh_plan.schemas.plan_compact import compact_bytes

    path = tmp_path / "it's small.plan.npz"
    write_atomic(path, compact_bytes(read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json")))
    monkeypatch.setattr(bench_rank_load, "_fresh", lambda plan, device, whole: {
        "device": device, "whole": whole, "steps": 1, "seconds": 0.5, "cpu_s": 0.5, "peak_rss_mib": 60.0, "imports_rss_mib": 50.0})
    out = tmp_path / "rank_load.json"
    result = CliRunner().invoke(bench_rank_load.main, ["--plan", str(path), "--devices", "0", "--out", str(out), *flags])
    assert result.exit_code == 0, result.output
    [entry] = json.loads(out.read_text())["plans"]
    return entry


def test_a_rank_load_entry_does_not_guess_the_command_that_wrote_the_plan(tmp_path, monkeypatch):
    """Without --made-by the entry records no command for the plan file (not one guessed from the problem's name), and
    the revision it was measured at."""
    import subprocess

    entry = _rank_load_entry(tmp_path, monkeypatch)
    assert entry["made_by"] is None
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
    assert entry["commit"] == head.stdout.strip()


def test_a_rank_load_entry_records_a_command_that_splits_back_into_its_arguments(tmp_path, monkeypatch):
    """The recorded commands are shell-quoted: an apostrophe in --made-by or in the plan's path survives `shlex.split`."""
    import shlex

    made_by = "xmesh-plan compile plans/it's.problem.toml -o 'x y.plan.npz'"
    entry = _rank_load_entry(tmp_path, monkeypatch, "--made-by", made_by, "--no-whole")
    args = shlex.split(entry["command"])
    assert args[args.index("--made-by") + 1] == made_by
    assert args[args.index("--plan") + 1] == str(tmp_path / "it's small.plan.npz")
    assert entry["made_by"] == made_by


def test_the_rank_load_text_names_the_rows_that_miss_the_target():
    """BENCHMARKS' rank-load section names every row over 1 CPU s or 256 MiB peak RSS, and none under both."""
    from bench.benchmarks_doc import rank_load_over_target

    loads = [{"plan": "p", "rows": [
        {"device": 1, "whole": False, "cpu_s": 0.5, "peak_rss_mib": 100.0},
        {"device": 2, "whole": False, "cpu_s": 1.5, "peak_rss_mib": 100.0},
        {"device": 3, "whole": True, "cpu_s": 0.5, "peak_rss_mib": 300.0}]}]
    text = rank_load_over_target(loads)
    assert "device 2" in text and "device 3" in text and "device 1 " not in text


def test_a_rank_load_counts_its_own_memory_not_its_parent_s(tmp_path):
    """A measuring process started by a parent holding 300 MiB reports the memory it holds after its imports, not the
    parent's (`ru_maxrss` of a forked and exec'd child starts at what the parent held; Linux's VmHWM does not)."""
    import json
    import subprocess
    import sys

    from xmesh_plan.schemas import read_plan_file
    from xmesh_plan.schemas.files import write_atomic
    from xmesh_plan.schemas.plan_compact import compact_bytes

    if not Path("/proc/self/status").exists():
        pytest.skip("no /proc: the peak is ru_maxrss there")
    path = tmp_path / "small.plan.npz"
    write_atomic(path, compact_bytes(read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json")))
    parent = ("import subprocess, sys; held = bytearray(300 * 2**20); "
              f"print(subprocess.run([sys.executable, '-m', 'bench.bench_rank_load', '--plan', {str(path)!r}, '--one', '0', '--no-whole'], "
              "capture_output=True, text=True, check=True).stdout)")
    out = subprocess.run([sys.executable, "-c", parent], cwd=ROOT, capture_output=True, text=True, check=True)
    row = json.loads(out.stdout.strip().splitlines()[-1])
    assert row["imports_rss_mib"] < 250 and row["peak_rss_mib"] < 250, row


def test_a_rank_load_row_is_the_least_cpu_time_of_its_repeats(tmp_path, monkeypatch):
    """With --repeat 3 each device is measured in three processes and the row with the least CPU time is kept; the
    recorded command says --repeat 3."""
    import json
    import shlex

    from click.testing import CliRunner

    from bench import bench_rank_load
    from xmesh_plan.schemas import read_plan_file
    from xmesh_plan.schemas.files import write_atomic
    from xmesh_plan.schemas.plan_compact import compact_bytes

    path = tmp_path / "small.plan.npz"
    write_atomic(path, compact_bytes(read_plan_file(ROOT / "plans" / "weight_sync_small.plan.json")))
    times = iter([0.9, 0.4, 0.7])
    monkeypatch.setattr(bench_rank_load, "_fresh", lambda plan, device, whole: {
        "device": device, "whole": whole, "steps": 1, "seconds": 1.0, "cpu_s": next(times), "peak_rss_mib": 60.0, "imports_rss_mib": 50.0})
    out = tmp_path / "rank_load.json"
    result = CliRunner().invoke(bench_rank_load.main, ["--plan", str(path), "--devices", "0", "--no-whole", "--repeat", "3", "--out", str(out)])
    assert result.exit_code == 0, result.output
    [entry] = json.loads(out.read_text())["plans"]
    assert [row["cpu_s"] for row in entry["rows"]] == [0.4]
    args = shlex.split(entry["command"])
    assert args[args.index("--repeat") + 1] == "3"
