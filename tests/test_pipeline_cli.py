"""`xmesh-plan schedule / simulate / compare-schedules`: outputs, determinism, one-line errors with exit code 2."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from xmesh_plan.planner.cli import main
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.pipeline.io import load_pipeline
from xmesh_plan.planner.solvers import SOLVERS
from xmesh_plan.planner.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]

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
    assert "'1Q0'; write <stage><kind>[<tensor>]<micro-batch>, e.g. '0F3', '2I0', '0SEND_F[h0]3' or '1RECV_B[skip0]2'" in text
    assert text.count("'") % 2 == 0, "every quote is closed"


@pytest.mark.parametrize("schedule,delay,expect", [
    ("1f1b-wd", "1,2", "2 entries for 3 stages; give one per stage, e.g. --weight-delay 0,1,2"),
    ("eager-1f1b", "1,1,1", "schedule eager-1f1b does not split the backward"),
    ("gpipe", "0,0,0", "use --schedule gpipe-wd or drop --weight-delay"),
    ("1f1b-wd", "99,99,99", "99 is more than 7, the compute actions a weight part can be moved behind with 4 micro-batches"),
    ("1f1b-wd", "8,0,0", "8 is more than 7"),
    ("1f1b-wd", "a,b,c", "give one non-negative integer per stage, e.g. --weight-delay 0,1,2"),
    ("1f1b-wd", "2x4", "give one non-negative integer per stage"),
])
def test_bad_weight_delay_is_one_line_exit_2_with_a_fitting_example(tmp_path, pipeline_file, schedule, delay, expect):
    out = tmp_path / "s.json"
    code, text = invoke("schedule", str(pipeline_file), "--schedule", schedule, "--weight-delay", delay, "-o", str(out))
    assert code == 2, text
    assert expect in text and len(text.strip().splitlines()) == 1 and "1024,1024,512" not in text
    assert not out.exists()


def test_weight_delay_in_range_is_used_as_given(tmp_path, pipeline_file):
    out = tmp_path / "s.json"
    assert invoke("schedule", str(pipeline_file), "--schedule", "1f1b-wd", "--weight-delay", "7,0,1", "-o", str(out))[0] == 0
    assert json.loads(out.read_text())["weight_delay"] == [7, 0, 1]


@pytest.mark.parametrize("command", ["schedule", "compare-schedules"])
def test_help_examples_name_files_that_exist(command):
    code, text = invoke(command, "--help")
    assert code == 0
    examples = [line.split() for line in text.splitlines() if line.strip().startswith("xmesh-plan ")]
    assert examples
    for words in examples:
        assert (ROOT / words[2]).is_file(), f"{shlex.join(words)}: {words[2]} does not exist from the repo root"


@pytest.mark.parametrize("content,expect", [("{bad", "not valid JSON"), (None, "cannot read the pipeline file"),
                                            ('{"stages": 3}', "the file must hold one object")])
def test_pipeline_file_errors_name_the_path_once(tmp_path, content, expect):
    path = tmp_path / "bp.json"
    if content is not None:
        path.write_text(content)
    code, text = invoke("schedule", str(path))
    assert code == 2 and expect in text and len(text.strip().splitlines()) == 1, text
    assert text.count("bp.json") == 1, text


@pytest.mark.parametrize("command", ["schedule", "compare-schedules"])
def test_plan_options_match_compile(command):
    options = {p.name: p for p in main.commands[command].params}
    compile_options = {p.name: p for p in main.commands["compile"].params}
    assert list(options["solver"].type.choices) == list(SOLVERS) and options["solver"].default == "auto"
    assert list(options["strategy"].type.choices) == list(STRATEGIES) + ["auto"] and options["strategy"].default == "broadcast"
    for name in ("solver", "strategy", "seed"):
        assert options[name].default == compile_options[name].default
    code, text = invoke(command, str(ROOT / "bench/pipelines/utrans-2.1b-fp16.json"), "--solver", "gredy")
    assert code == 2 and "'gredy' is not one of" in text and "'greedy'" in text and len(text.strip().splitlines()) == 1


def test_schedule_costs_come_from_the_default_compile(tmp_path, pipeline_file):
    out = tmp_path / "s.json"
    assert invoke("schedule", str(pipeline_file), "--schedule", "1f1b", "-o", str(out))[0] == 0
    pipeline = load_pipeline(pipeline_file)
    costs = {(c["tensor"], c["direction"]): c["seconds"] for c in json.loads(out.read_text())["costs"]}
    assert costs == {(n, d): compile_plan(pipeline.resharding_problem(n, d)).predicted_seconds for n, d in pipeline.transfers()}


@pytest.mark.parametrize("name,legend", [
    ("1f1b", ["forward", "backward"]),
    ("eager-1f1b-wd", ["forward", "backward (input part)", "backward (weight part)"]),
])
def test_gantt_numbers_forward_boxes_fits_the_title_and_names_the_backward_drawn(pipeline_file, name, legend):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from xmesh_plan.planner.pipeline.build import build_schedule
    from xmesh_plan.planner.pipeline.gantt import ROW, Rows, gantt_figure
    from xmesh_plan.planner.pipeline.simulate import evaluate

    data = json.loads(json.dumps(PIPELINE))
    for stage in data["stages"]:  # forwards far shorter than backwards, as in the paper's models
        stage.update(forward_s=0.001, backward_input_s=0.0055, backward_weight_s=0.0055)
    path = pipeline_file.with_name("skewed.json")
    path.write_text(json.dumps(data))
    pipeline = load_pipeline(path)
    schedule = build_schedule(pipeline, name, _cheap_costs(pipeline))
    timeline, _ = evaluate(schedule)
    title = "a long title " * 30
    fig = gantt_figure(timeline, title)
    try:
        ax = fig.axes[0]
        assert [t.get_text() for t in ax.get_legend().get_texts()] == legend
        renderer = fig.canvas.get_renderer()
        shown = {(round(t.get_position()[0], 9), round(t.get_position()[1], 9), t.get_text()) for t in ax.texts}
        forwards = [c for c in timeline.compute if c.action.kind == "F"]
        bottom = Rows.of(timeline).stage_bottom
        centre = {c: (round((c.start_s + c.end_s) / 2 * 1e3, 9), round(bottom[c.action.stage] + ROW / 2, 9)) for c in forwards}
        labelled = [c for c in forwards if (*centre[c], str(c.action.micro_batch)) in shown]
        assert len(labelled) == len(forwards), "every forward box here is wide enough for its number"
        assert all(c.end_s - c.start_s < timeline.iteration_s / 60 for c in forwards)  # narrower than the old cut-off
        heading = ax.title if ax.title.get_text() else ax._left_title
        assert heading.get_text().replace("\n", " ").split() == title.split()
        assert heading.get_window_extent(renderer).x1 <= fig.bbox.width
        for text in ax.texts:  # every number shown lies inside the figure, none cut
            assert text.get_window_extent(renderer).x1 <= fig.bbox.width
    finally:
        plt.close(fig)


def _cheap_costs(pipeline):
    from xmesh_plan.schemas.pipeline import TransferCost

    return tuple(TransferCost(tensor=n, direction=d, seconds=0.0005, nics=(f"{n}:{d}",)) for n, d in pipeline.transfers())


@pytest.mark.parametrize("command,per", [(["schedule", "--schedule", "1f1b"], 2), (["schedule", "--schedule", "1f1b-wd"], 3),
                                         (["compare-schedules"], 3)])
def test_a_schedule_above_max_actions_is_refused_before_planning(tmp_path, monkeypatch, command, per):
    from xmesh_plan.planner import cli_pipeline

    monkeypatch.setattr(cli_pipeline, "_costs", lambda *a, **k: pytest.fail("planned before the size was checked"))
    path = tmp_path / "big.json"
    path.write_text(json.dumps({**PIPELINE, "micro_batches": 10_000}))
    actions = 3 * 10_000 * per
    result = CliRunner().invoke(main, [command[0], str(path), *command[1:]])
    assert result.exit_code == 2, result.output
    assert f"{actions:,} compute actions" in result.stderr and f"--max-actions {actions}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_max_actions_lets_a_schedule_at_the_limit_through(pipeline_file):
    actions = 3 * 4 * 2
    assert invoke("schedule", str(pipeline_file), "--schedule", "1f1b", "--max-actions", str(actions))[0] == 0
    code, _ = invoke("schedule", str(pipeline_file), "--schedule", "1f1b", "--max-actions", str(actions - 1))
    assert code == 2
