"""Trace JSON and Gantt chart of the 8-stage GPT pipeline: no overlapping slices on a track, a flow per transfer,
every micro-batch number drawn."""

from __future__ import annotations

import json
from collections import defaultdict
from decimal import Decimal
from pathlib import Path

import pytest

from xmesh_plan.planner.pipeline.build import build_schedule
from xmesh_plan.planner.pipeline.costs import transfer_costs
from xmesh_plan.planner.pipeline.io import load_pipeline
from xmesh_plan.planner.pipeline.simulate import evaluate
from xmesh_plan.planner.pipeline.trace import trace_json
from xmesh_plan.schemas.pipeline import PipelineProblem, TransferCost
from xmesh_plan.schemas.problem import DeviceMesh

ROOT = Path(__file__).resolve().parents[1]
EIGHT_STAGES = ROOT / "bench/pipelines/gpt-2.6b-8stage-fp16.json"


@pytest.fixture(scope="module")
def eight_stage_timelines():
    """The bench file's timelines under the schedules whose traces overlapped most before ends were rounded first."""
    pipeline = load_pipeline(EIGHT_STAGES)
    costs = transfer_costs(pipeline)
    return {name: evaluate(build_schedule(pipeline, name, costs))[0] for name in ("1f1b", "eager-1f1b-wd")}


def trace_events(timeline) -> list[dict]:
    """Parsed with exact decimals, as a viewer that reads the printed microseconds to the nanosecond sees them."""
    return json.loads(trace_json(timeline), parse_float=Decimal)["traceEvents"]


def partial_overlaps(events: list[dict]) -> list[tuple]:
    """Pairs of slices on one track that overlap without one containing the other."""
    tracks = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"], e["name"]))
    bad = []
    for key, spans in tracks.items():
        spans.sort()
        for (start, end, name), (next_start, next_end, next_name) in zip(spans, spans[1:]):
            if next_start < end < next_end:
                bad.append((key, name, next_name, end - next_start))
    return bad


@pytest.mark.parametrize("name", ["1f1b", "eager-1f1b-wd"])
def test_no_two_slices_on_a_track_of_the_8_stage_trace_overlap(eight_stage_timelines, name):
    events = trace_events(eight_stage_timelines[name])
    assert partial_overlaps(events) == []
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events if e["ph"] == "X")


def test_overlapping_transfers_on_one_route_get_a_second_row():
    stages = [{"mesh": DeviceMesh(shape=(1,), devices=(i,)), "forward_s": 1.0, "backward_input_s": 1.0} for i in range(2)]
    problem = PipelineProblem(stages=stages, micro_batches=4,
                              tensors=[{"name": "h0", "src_stage": 0, "dst_stage": 1, "shape": (8,), "src_spec": "R", "dst_spec": "R"}])
    costs = tuple(TransferCost(tensor="h0", direction=d, seconds=2.5) for d in "FB")  # no NIC: transfers overlap
    events = trace_events(evaluate(build_schedule(problem, "eager-1f1b", costs))[0])
    rows = {e["args"]["name"] for e in events if e["ph"] == "M" and e["pid"] == 1 and e["name"] == "thread_name"}
    assert {"h0 s0->s1", "h0 s0->s1 (2)"} <= rows
    assert partial_overlaps(events) == []


def test_every_transfer_has_a_flow_from_the_compute_that_sends_it_to_the_one_that_receives_it(eight_stage_timelines):
    timeline = eight_stage_timelines["eager-1f1b-wd"]
    events = trace_events(timeline)
    flows = defaultdict(dict)
    for e in events:
        if e["ph"] in ("s", "f"):
            flows[e["id"]][e["ph"]] = e
    assert len(flows) == len(timeline.transfers)
    compute = [e for e in events if e["ph"] == "X" and e["pid"] == 0 and e["cat"] != "wait"]

    def enclosing(flow_event):
        return [c for c in compute if c["tid"] == flow_event["tid"] and c["ts"] < flow_event["ts"] < c["ts"] + c["dur"]]

    for transfer, flow_id in zip(timeline.transfers, sorted(flows)):
        start, finish = flows[flow_id]["s"], flows[flow_id]["f"]
        assert finish["bp"] == "e" and start["cat"] == finish["cat"] and start["name"] == finish["name"]
        assert start["tid"] == transfer.src_stage and finish["tid"] == transfer.dst_stage
        made, used = enclosing(start), enclosing(finish)
        kinds = {"F"} if transfer.direction == "F" else {"I", "B"}
        assert [m["args"]["micro_batch"] for m in made] == [transfer.micro_batch] and made[0]["name"][0] in kinds
        assert [u["args"]["micro_batch"] for u in used] == [transfer.micro_batch] and used[0]["name"][0] in kinds
        assert start["ts"] < finish["ts"]


def test_8_stage_gantt_numbers_every_box_and_names_every_transfer_row(eight_stage_timelines):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from xmesh_plan.planner.pipeline.gantt import LANE, ROW, Rows, gantt_figure, lane_name, route_of

    timeline = eight_stage_timelines["eager-1f1b-wd"]
    rows = Rows.of(timeline)
    fig = gantt_figure(timeline, "8 stages")
    try:
        ax = fig.axes[0]
        shown = {(round(t.get_position()[0], 6), round(t.get_position()[1], 6), t.get_text()) for t in ax.texts}

        def labelled(start_s, end_s, y, micro_batch):
            return (round((start_s + end_s) / 2 * 1e3, 6), round(y, 6), str(micro_batch)) in shown

        missing = [str(c.action) for c in timeline.compute
                   if not labelled(c.start_s, c.end_s, rows.stage_bottom[c.action.stage] + ROW / 2, c.action.micro_batch)]
        missing += [f"{t.tensor}/{t.direction}{t.micro_batch}" for t in timeline.transfers
                    if not labelled(t.start_s, t.end_s, rows.lane_bottom[(t.dst_stage, route_of(t))] + LANE / 2, t.micro_batch)]
        assert missing == []
        assert {str(m) for m in range(16)} <= {t.get_text() for t in ax.texts}
        names = {label.get_text() for label in ax.get_yticklabels()}
        assert {lane_name(route_of(t)) for t in timeline.transfers} <= names
        assert {"h0 from s0", "h0.grad from s1", "h6 from s6"} <= names
    finally:
        plt.close(fig)
