"""`xmesh-plan schedule / simulate / compare-schedules`: outputs, determinism, one-line errors with exit code 2."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from planner.cli import main

PIPELINE = {
    "name": "tiny-unet",
    "micro_batches": 4,
    "stages": [
        {"mesh": "1x2", "forward_s": 0.002, "backward_input_s": 0.002, "backward_weight_s": 0.002},
        {"mesh": {"shape": [2, 2], "devices": [4, 5, 6, 7]}, "forward_s": 0.002, "backward_input_s": 0.002, "backward_weight_s": 0.002},
        {"mesh": "2x1", "forward_s": 0.002, "backward_input_s": 0.002, "backward_weight_s": 0.002},
    ],
    "tensors": [
        {"name": "h0", "src_stage": 0, "dst_stage": 1, "shape": "16,256,256", "src_spec": "R S0 R", "dst_spec": "S0 R S1"},
        {"name": "h1", "src_stage": 1, "dst_stage": 2, "shape": [16, 256, 256], "src_spec": "S0 R R", "dst_spec": "S0 R R"},
        {"name": "skip", "src_stage": 0, "dst_stage": 2, "shape": "16,256,256", "dtype": "fp32", "src_spec": "R R R", "dst_spec": "R S0 R"},
    ],
}


def invoke(*args):
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output


@pytest.fixture
def pipeline_file(tmp_path):
    path = tmp_path / "pipe.json"
    path.write_text(json.dumps(PIPELINE))
    return path


def test_schedule_then_simulate_writes_schedule_trace_and_png(tmp_path, pipeline_file):
    out = tmp_path / "s.json"
    code, text = invoke("schedule", str(pipeline_file), "--schedule", "eager-1f1b-wd", "-o", str(out))
    assert code == 0, text
    assert "weight delay" in text and "iteration" in text
    saved = json.loads(out.read_text())
    assert saved["schedule"] == "eager-1f1b-wd" and len(saved["stages"]) == 3
    assert {(c["tensor"], c["direction"]) for c in saved["costs"]} == {(t, d) for t in ("h0", "h1", "skip") for d in "FB"}
    trace, png = tmp_path / "t.json", tmp_path / "g.png"
    args = ["simulate", str(out), "--trace", str(trace), "--json"]
    if pytest.importorskip("matplotlib"):
        args += ["--png", str(png)]
    code, text = invoke(*args)
    assert code == 0, text
    metrics = json.loads(text)
    assert metrics["iteration_s"] > 0 and len(metrics["peak_in_flight"]) == 3
    assert json.loads(trace.read_text())["traceEvents"]
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_schedule_is_byte_identical_across_runs(tmp_path, pipeline_file):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    for path in (first, second):
        assert invoke("schedule", str(pipeline_file), "--schedule", "eager-1f1b-wd", "-o", str(path))[0] == 0
    assert first.read_bytes() == second.read_bytes()
    traces = []
    for name in ("ta.json", "tb.json"):
        assert invoke("simulate", str(first), "--trace", str(tmp_path / name))[0] == 0
        traces.append((tmp_path / name).read_bytes())
    assert traces[0] == traces[1]


def test_compare_prints_every_schedule_and_the_signal_bound(pipeline_file):
    code, text = invoke("compare-schedules", str(pipeline_file))
    assert code == 0, text
    for label in ("1f1b (no overlap)", "| gpipe", "| 1f1b |", "| eager-1f1b |", "| eager-1f1b-wd", "| signal ("):
        assert label in text


@pytest.mark.parametrize("change,expect", [
    (lambda p: p["tensors"][0].update(dst_stage=7), "dst_stage 7"),
    (lambda p: p["tensors"][0].update(src_spec="R S5 R"), "mesh axis 5"),
    (lambda p: p["tensors"][1].update(name="h0"), "more than once"),
    (lambda p: p["tensors"][0].update(src_stage=1), "must be below dst_stage"),
    (lambda p: p["stages"][1].update(mesh={"shape": [2, 2], "devices": [0, 1, 2, 3]}), "device 0 is in the meshes"),
    (lambda p: p["stages"][0].pop("forward_s"), "forward_s"),
    (lambda p: p.update(micro_batches=0), "micro_batches"),
])
def test_bad_pipeline_is_one_line_exit_2(tmp_path, change, expect):
    data = json.loads(json.dumps(PIPELINE))
    change(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    code, text = invoke("schedule", str(path), "-o", str(tmp_path / "s.json"))
    assert code == 2, text
    assert expect in text and len(text.strip().splitlines()) == 1 and "Traceback" not in text
    assert not (tmp_path / "s.json").exists()


def test_edited_schedule_with_a_deadlock_is_refused(tmp_path, pipeline_file):
    out = tmp_path / "s.json"
    assert invoke("schedule", str(pipeline_file), "--schedule", "gpipe", "-o", str(out))[0] == 0
    saved = json.loads(out.read_text())
    actions = saved["stages"][0].split()
    saved["stages"][0] = " ".join([a for a in actions if a.endswith("0")] + [a for a in actions if not a.endswith("0")])
    out.write_text(json.dumps(saved))
    code, text = invoke("simulate", str(out))
    assert code == 2 and "deadlock" in text and len(text.strip().splitlines()) == 1


def test_bad_action_text_and_bad_weight_delay_are_one_line_errors(tmp_path, pipeline_file):
    out = tmp_path / "s.json"
    assert invoke("schedule", str(pipeline_file), "-o", str(out))[0] == 0
    saved = json.loads(out.read_text())
    saved["stages"][1] = saved["stages"][1].replace("1F0", "1Q0")
    out.write_text(json.dumps(saved))
    code, text = invoke("simulate", str(out))
    assert code == 2 and "bad action '1Q0'" in text
    code, text = invoke("schedule", str(pipeline_file), "--schedule", "1f1b-wd", "--weight-delay", "1,2")
    assert code == 2 and "weight_delay has 2 entries" in text
