"""Pipeline schedules: action text form, warm-up counts, weight splitting, validation and deadlock check."""

from __future__ import annotations

import pytest

from xmesh_plan.planner.pipeline.actions import Action, format_actions, parse_actions
from xmesh_plan.planner.pipeline.schedules import SCHEDULE_NAMES, eager_one_f_one_b, one_f_one_b, split_backward, stage_actions
from xmesh_plan.planner.pipeline.validate import ScheduleError, validate
from xmesh_plan.schemas.pipeline import PipelineProblem
from xmesh_plan.schemas.problem import DeviceMesh


def unet(stages: int = 4, micro_batches: int = 6) -> PipelineProblem:
    """Adjacent activations plus a skip from stage 0 to the last stage."""
    st = [{"mesh": DeviceMesh(shape=(2,), devices=(2 * i, 2 * i + 1)), "forward_s": 1.0, "backward_input_s": 1.0,
           "backward_weight_s": 1.0} for i in range(stages)]
    ts = [{"name": f"h{i}", "src_stage": i, "dst_stage": i + 1, "shape": (4, 8), "src_spec": "S0 R", "dst_spec": "R S0"}
          for i in range(stages - 1)]
    ts.append({"name": "skip", "src_stage": 0, "dst_stage": stages - 1, "shape": (4, 8), "src_spec": "S0 R", "dst_spec": "S0 R"})
    return PipelineProblem(stages=st, tensors=ts, micro_batches=micro_batches)


@pytest.mark.parametrize("text", ["0F3", "12B0", "2I7", "3W1", "0SEND_F[h0]3", "1RECV_F[h0]3", "1SEND_B[skip.x-1]0", "0RECV_B[h_0]12"])
def test_action_text_round_trips(text):
    assert str(Action.from_str(text)) == text


@pytest.mark.parametrize("text", ["F3", "0X3", "0SEND_F3", "0F[h0]3", "0F", "0SEND_F[0h]1"])
def test_bad_action_text_names_the_form(text):
    with pytest.raises(ValueError, match="e.g."):
        Action.from_str(text)


def test_stage_line_round_trips_and_rejects_other_stages():
    actions = stage_actions(unet(), "eager-1f1b-wd", (1, 0, 2, 1))[2]
    assert parse_actions(format_actions(actions), 2) == actions
    with pytest.raises(ValueError, match="stage 1"):
        parse_actions("0F0", 1)


def forwards_before_first_backward(order):
    return next(i for i, (kind, _) in enumerate(order) if kind == "B")


@pytest.mark.parametrize("stages,micro_batches", [(2, 8), (4, 8), (4, 2), (8, 16)])
def test_warmup_counts_match_the_paper(stages, micro_batches):
    for i in range(stages):
        # warm-up forwards, then the steady phase starts with one more forward (if any remain)
        plain = min(micro_batches, stages - i - 1)
        eager = min(micro_batches, 2 * (stages - i) - 1)
        assert forwards_before_first_backward(one_f_one_b(i, stages, micro_batches)) == min(micro_batches, plain + 1)
        assert forwards_before_first_backward(eager_one_f_one_b(i, stages, micro_batches)) == min(micro_batches, eager + 1)


@pytest.mark.parametrize("delay", [0, 1, 3, 50])
def test_split_backward_keeps_every_part_in_order(delay):
    order = one_f_one_b(0, 4, 8)
    split = split_backward(order, delay)
    assert sorted(split) == sorted([("F", m) for m in range(8)] + [("I", m) for m in range(8)] + [("W", m) for m in range(8)])
    for m in range(8):
        i, w = split.index(("I", m)), split.index(("W", m))
        passed = [k for k, _ in split[i + 1:w] if k != "W"]  # compute actions W(m) was moved behind
        remaining = [k for k, _ in split[i + 1:] if k != "W"]
        assert w > i and len(passed) == min(delay, len(remaining))


@pytest.mark.parametrize("name", SCHEDULE_NAMES)
@pytest.mark.parametrize("micro_batches", [1, 3, 8])
def test_every_schedule_is_complete_and_deadlock_free(name, micro_batches):
    problem = unet(4, micro_batches)
    validate(problem, stage_actions(problem, name, (2, 1, 0, 3)))


def test_unknown_schedule_lists_the_names():
    with pytest.raises(ValueError, match="eager-1f1b"):
        stage_actions(unet(), "zero-bubble")


def test_missing_and_duplicated_actions_are_named():
    problem = unet(2, 2)
    actions = stage_actions(problem, "1f1b")
    broken = [actions[0], [a for a in actions[1] if str(a) != "1F1"]]
    with pytest.raises(ScheduleError, match="1F1 is missing"):
        validate(problem, broken)
    with pytest.raises(ScheduleError, match="appears 2 times"):
        validate(problem, [actions[0] + [actions[0][0]], actions[1]])


def test_receive_after_its_consumer_is_rejected():
    problem = unet(2, 2)
    actions = stage_actions(problem, "1f1b")
    stage1 = actions[1]
    i = stage1.index(Action.from_str("1F0"))
    stage1[i - 1], stage1[i] = stage1[i], stage1[i - 1]  # F before the RECV it needs (last RECV_F)
    with pytest.raises(ScheduleError, match="comes after 1F0"):
        validate(problem, [actions[0], stage1])


def test_deadlock_is_found_and_the_cycle_printed():
    problem = unet(2, 2)
    actions = stage_actions(problem, "gpipe")
    # stage 0 waits for micro-batch 0's gradient before it sends micro-batch 1's activations
    stage0 = [a for a in actions[0] if a.micro_batch == 0] + [a for a in actions[0] if a.micro_batch == 1]
    with pytest.raises(ScheduleError, match="deadlock: .*RECV"):
        validate(problem, [stage0, actions[1]])
