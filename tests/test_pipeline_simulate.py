"""The pipeline simulator: hand-checked timings, overlap effects, NIC contention, metrics, trace, PNG, determinism."""

from __future__ import annotations

import json

import pytest

from xmesh_plan.planner.pipeline.build import build_schedule
from xmesh_plan.planner.pipeline.costs import signal_costs
from xmesh_plan.planner.pipeline.schedules import stage_actions
from xmesh_plan.planner.pipeline.simulate import evaluate, peak_in_flight, simulate
from xmesh_plan.planner.pipeline.trace import trace_json
from xmesh_plan.schemas.pipeline import PipelineProblem, PipelineSchedule, TransferCost
from xmesh_plan.schemas.problem import DeviceMesh


def chain(stages: int, micro_batches: int, forward=1.0, backward=1.0, weight=1.0, skip=False) -> PipelineProblem:
    st = [{"mesh": DeviceMesh(shape=(1,), devices=(i,)), "forward_s": forward, "backward_input_s": backward,
           "backward_weight_s": weight, "activation_bytes": 100} for i in range(stages)]
    ts = [{"name": f"h{i}", "src_stage": i, "dst_stage": i + 1, "shape": (8,), "src_spec": "R", "dst_spec": "R"} for i in range(stages - 1)]
    if skip:
        ts.append({"name": "skip", "src_stage": 0, "dst_stage": stages - 1, "shape": (8,), "src_spec": "R", "dst_spec": "R"})
    return PipelineProblem(stages=st, tensors=ts, micro_batches=micro_batches)


def costs_for(problem: PipelineProblem, seconds: float, shared_nic: bool = False) -> tuple[TransferCost, ...]:
    """Each transfer on its own link, or (shared_nic) every forward one through the same NIC side."""
    out = []
    for name, direction in problem.transfers():
        t = problem.tensor(name)
        src, dst = (t.src_stage, t.dst_stage) if direction == "F" else (t.dst_stage, t.src_stage)
        nics = ("h0:send",) if shared_nic and direction == "F" else (f"h{src}:send", f"h{dst}:recv")
        out.append(TransferCost(tensor=name, direction=direction, seconds=seconds, nics=nics))
    return tuple(out)


def iteration(problem, name, costs, overlap=True) -> float:
    return evaluate(build_schedule(problem, name, costs, overlap))[1].iteration_s


def test_one_micro_batch_by_hand():
    # s0 F [0,1], h0 [1,1.5], s1 F [1.5,2.5], s1 B [2.5,4.5], grad [4.5,5], s0 B [5,7]
    problem = chain(2, 1)
    assert iteration(problem, "1f1b", costs_for(problem, 0.5)) == pytest.approx(7.0)
    assert iteration(problem, "1f1b", signal_costs(costs_for(problem, 0.5))) == pytest.approx(6.0)
    # split: s1 I ends at 3.5, grad arrives at 4, s0 I [4,5] W [5,6]
    assert iteration(problem, "1f1b-wd", costs_for(problem, 0.5)) == pytest.approx(6.0)


def test_blocking_send_holds_the_sender():
    problem = chain(2, 4)
    costs = costs_for(problem, 0.5)
    timeline = simulate(problem, stage_actions(problem, "gpipe"), costs, overlap=False)
    second_forward = next(c for c in timeline.compute if str(c.action) == "0F1")
    assert second_forward.start_s == pytest.approx(1.5)
    assert iteration(problem, "gpipe", costs, overlap=False) > iteration(problem, "gpipe", costs)


def test_transfers_sharing_a_nic_do_not_overlap():
    problem = chain(3, 4, skip=True)
    timeline = simulate(problem, stage_actions(problem, "eager-1f1b"), costs_for(problem, 0.7, shared_nic=True))
    spans = sorted((t.start_s, t.end_s) for t in timeline.transfers if t.direction == "F")
    assert len(spans) == 4 * 3
    assert all(a_end <= b_start + 1e-12 for (_, a_end), (b_start, _) in zip(spans, spans[1:]))


def test_with_free_transfers_1f1b_and_eager_take_the_same_time():
    problem = chain(4, 8)
    free = signal_costs(costs_for(problem, 1.0))
    assert iteration(problem, "1f1b", free) == pytest.approx(iteration(problem, "eager-1f1b", free))


@pytest.mark.parametrize("stages,skip", [(2, False), (2, True), (4, False), (4, True)])
def test_eager_and_weight_delaying_hide_exposed_communication(stages, skip):
    problem = chain(stages, 12, skip=skip)
    costs = costs_for(problem, 0.6)
    blocking = iteration(problem, "1f1b", costs, overlap=False)
    plain = iteration(problem, "1f1b", costs)
    eager = iteration(problem, "eager-1f1b", costs)
    delayed = iteration(problem, "eager-1f1b-wd", costs)
    free = iteration(problem, "1f1b", signal_costs(costs))
    assert blocking >= plain > eager > delayed
    assert plain > free  # the communication is exposed under 1F1B


def test_weight_delay_is_the_least_that_helps():
    problem = chain(2, 8)
    schedule = build_schedule(problem, "eager-1f1b-wd", costs_for(problem, 0.6))
    best = evaluate(schedule)[1].iteration_s
    for stage, delay in enumerate(schedule.weight_delay):
        if delay:
            less = list(schedule.weight_delay)
            less[stage] -= 1
            smaller = build_schedule(problem, "eager-1f1b-wd", costs_for(problem, 0.6), weight_delay=tuple(less))
            assert evaluate(smaller)[1].iteration_s > best


def test_peak_in_flight_matches_the_warmup():
    problem = chain(4, 8)
    costs = costs_for(problem, 0.5)
    plain = evaluate(build_schedule(problem, "1f1b", costs))[1]
    eager = evaluate(build_schedule(problem, "eager-1f1b", costs))[1]
    assert plain.peak_in_flight == (4, 3, 2, 1)
    assert eager.peak_in_flight == (8, 6, 4, 2)
    assert eager.peak_activation_bytes == (800, 600, 400, 200)
    assert peak_in_flight(stage_actions(problem, "gpipe")[0]) == 8


def test_metrics_are_consistent():
    problem = chain(3, 6, skip=True)
    timeline, metrics = evaluate(build_schedule(problem, "1f1b", costs_for(problem, 0.8)))
    busy = sum(c.end_s - c.start_s for c in timeline.compute)
    assert busy == pytest.approx(3 * 6 * 3.0)
    assert metrics.bubble_fraction == pytest.approx(1 - busy / (3 * metrics.iteration_s))
    assert metrics.exposed_comm_s > 0
    assert all(w > 0 for w in metrics.wait_s[1:])


def test_schedule_and_trace_are_deterministic_and_round_trip():
    problem = chain(4, 6, skip=True)
    first = build_schedule(problem, "eager-1f1b-wd", costs_for(problem, 0.6))
    second = build_schedule(problem, "eager-1f1b-wd", costs_for(problem, 0.6))
    assert first.to_json() == second.to_json()
    assert PipelineSchedule.from_json(first.to_json()).to_json() == first.to_json()
    trace = trace_json(evaluate(first)[0])
    assert trace == trace_json(evaluate(second)[0])
    timeline = evaluate(first)[0]
    events = json.loads(trace)["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == len(timeline.compute) + len(timeline.transfers) + len(timeline.waits)
    assert {e["cat"] for e in slices} >= {"forward", "backward-input", "backward-weight", "transfer"}


def test_gantt_png_is_written(tmp_path):
    pytest.importorskip("matplotlib")
    from xmesh_plan.planner.pipeline.gantt import draw_gantt

    problem = chain(2, 4)
    draw_gantt(evaluate(build_schedule(problem, "eager-1f1b", costs_for(problem, 0.5)))[0], str(tmp_path / "g.png"), "t")
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
