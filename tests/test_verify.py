"""The verifier: correct plans pass, and planted faults are rejected with a message naming device and box.

Faults are planted in plans compiled by `compile_plan` (any solver): the mutated operation is found by
what it does (its region and receiver), never by its position, so the tests do not depend on the order
a solver picks.
"""

from __future__ import annotations

import random

import pytest

from xmesh_plan.planner.verify import PlanError, VerifyReport, verify_plan
from xmesh_plan.schemas.plan import Plan, format_region

BOX = ((0, 512), (0, 512), (0, 512))  # case 3: rows 0:512 go to host 2 (devices 8-11), cols 0:512 live on host 0
BOX_TEXT = "[0:512, 0:512, 0:512]"


def with_ops(plan: Plan, ops) -> Plan:
    """The plan with these operations, listed in execution order (start time, then id) as plans must be."""
    return plan.model_copy(update={"operations": tuple(sorted(ops, key=lambda o: (o.start_s, o.id)))})


def the_op(plan: Plan, kind: str, region, receiver: int):
    found = [op for op in plan.operations if op.kind == kind and op.region == region and receiver in op.dsts]
    assert len(found) == 1, f"expected one {kind} of {format_region(region)} to d{receiver}, got {found}"
    return found[0]


def rejected(plan: Plan) -> str:
    with pytest.raises(PlanError) as err:
        verify_plan(plan)
    return str(err.value)


@pytest.fixture
def send_recv_case3(case, compile_quick):
    return compile_quick(case("case3"), "send_recv")


@pytest.fixture
def allgather_case3(case, compile_quick):
    return compile_quick(case("case3"), "local_allgather")


# --- correct plans --------------------------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["broadcast", "send_recv", "local_allgather", "global_allgather"])
def test_compiled_case3_verifies_with_a_report(case, compile_quick, strategy):
    plan = compile_quick(case("case3"), strategy)
    report = verify_plan(plan)
    assert isinstance(report, VerifyReport)
    assert report.operations == len(plan.operations) and report.devices_checked == 8
    assert str(report).startswith(f"ok: {len(plan.operations)} operations replayed, 8 destination devices")


def test_operations_listed_out_of_execution_order_are_rejected(send_recv_case3):
    """The executor replays the list in order, so the list must be the execution order the times say."""
    ops = list(send_recv_case3.operations)
    random.Random(0).shuffle(ops)
    verify_plan(with_ops(send_recv_case3, ops))  # sorted back into order: fine
    message = rejected(send_recv_case3.model_copy(update={"operations": tuple(ops)}))
    assert "listed ahead of it" in message and "list operations in execution order (start time, then id)" in message


def test_a_box_received_in_two_halves_from_two_holders_verifies(send_recv_case3):
    op = the_op(send_recv_case3, "send", BOX, 8)
    top = op.model_copy(update={"region": ((0, 256), (0, 512), (0, 512)), "src": 1})
    bottom = op.model_copy(update={"id": 10_000, "region": ((256, 512), (0, 512), (0, 512)), "src": 2})
    ops = [o for o in send_recv_case3.operations if o is not op] + [top, bottom]
    verify_plan(with_ops(send_recv_case3, ops))


def test_empty_plan_for_a_zero_size_tensor_verifies(problem, compile_quick):
    plan = compile_quick(problem((0, 8), "2x2", "S0 R", "2x2", "R S1"))
    assert plan.operations == () and plan.tasks == ()
    verify_plan(plan)


# --- planted faults: the three --------------------------------------------------------------------

def test_missing_slice_names_the_device_and_the_box(send_recv_case3):
    op = the_op(send_recv_case3, "send", BOX, 8)
    message = rejected(with_ops(send_recv_case3, [o for o in send_recv_case3.operations if o is not op]))
    assert message == f"destination device 8 never receives {BOX_TEXT} of its shard [0:512, 0:1024, 0:512]"


def test_missing_broadcast_names_the_first_device_of_its_chain(case, compile_quick):
    plan = compile_quick(case("case3"), "broadcast")
    op = the_op(plan, "broadcast", BOX, 8)
    message = rejected(with_ops(plan, [o for o in plan.operations if o is not op]))
    assert f"destination device {min(op.dsts)} never receives {BOX_TEXT}" in message


@pytest.mark.parametrize("wrong_sender", [4, 5, 7])  # host 1 holds columns 512:1024 only
def test_wrong_sender_names_the_device_and_the_box(send_recv_case3, wrong_sender):
    op = the_op(send_recv_case3, "send", BOX, 8)
    bad = op.model_copy(update={"src": wrong_sender})
    message = rejected(with_ops(send_recv_case3, [bad if o is op else o for o in send_recv_case3.operations]))
    assert f"operation {op.id} (task {op.task}, send)" in message
    assert f"device {wrong_sender} sends {BOX_TEXT} which it does not hold" in message


def test_sender_outside_the_source_mesh_is_rejected(send_recv_case3):
    op = the_op(send_recv_case3, "send", BOX, 8)
    bad = op.model_copy(update={"src": 9})
    message = rejected(with_ops(send_recv_case3, [bad if o is op else o for o in send_recv_case3.operations]))
    assert "device 9 is not in the source mesh" in message


def test_byte_received_twice_names_the_device_and_the_box(send_recv_case3):
    op = the_op(send_recv_case3, "send", BOX, 8)
    again = op.model_copy(update={"id": max(o.id for o in send_recv_case3.operations) + 1})
    message = rejected(with_ops(send_recv_case3, list(send_recv_case3.operations) + [again]))
    assert f"device 8 receives {BOX_TEXT} a second time" in message


def test_partial_overlap_received_twice_names_only_the_overlap(send_recv_case3):
    op = the_op(send_recv_case3, "send", BOX, 8)
    extra = op.model_copy(update={"id": 10_000, "region": ((256, 512), (0, 512), (0, 512)), "src": 3})
    message = rejected(with_ops(send_recv_case3, list(send_recv_case3.operations) + [extra]))
    assert "device 8 receives [256:512, 0:512, 0:512] a second time" in message


# --- planted faults: more --------------------------------------------------------------------------------

def test_delivery_outside_the_destination_shard(send_recv_case3):
    op = the_op(send_recv_case3, "send", BOX, 8)
    bad = op.model_copy(update={"dsts": (12,)})  # device 12 needs rows 512:1024
    message = rejected(with_ops(send_recv_case3, [bad if o is op else o for o in send_recv_case3.operations]))
    assert f"device 12 receives {BOX_TEXT} outside its destination shard" in message


def test_broadcast_chain_member_outside_its_shard(case, compile_quick):
    plan = compile_quick(case("case3"), "broadcast")
    op = the_op(plan, "broadcast", BOX, 8)
    bad = op.model_copy(update={"dsts": op.dsts + (13,)})
    message = rejected(with_ops(plan, [bad if o is op else o for o in plan.operations]))
    assert f"device 13 receives {BOX_TEXT} outside its destination shard" in message


def test_delivery_to_a_device_outside_the_destination_mesh(send_recv_case3):
    op = the_op(send_recv_case3, "send", BOX, 8)
    bad = op.model_copy(update={"dsts": (3,)})
    message = rejected(with_ops(send_recv_case3, [bad if o is op else o for o in send_recv_case3.operations]))
    assert f"device 3 receives {BOX_TEXT} but is not in the destination mesh" in message


def test_allgather_before_its_sends_end_is_rejected(allgather_case3):
    plan = allgather_case3
    gather = next(op for op in plan.operations if op.kind == "allgather")
    sends = [op for op in plan.operations if op.kind == "send" and op.task == gather.task]
    last = max(sends, key=lambda op: (op.end_s, op.id))
    early = gather.model_copy(update={"start_s": last.end_s - 1e-3})
    message = rejected(with_ops(plan, [early if o is gather else o for o in plan.operations]))
    (member,) = last.dsts
    assert f"operation {gather.id} (task {gather.task}, allgather)" in message
    assert f"device {member} sends {format_region(last.region)} which it does not hold" in message


def test_allgather_whose_part_never_arrived_is_rejected(allgather_case3):
    plan = allgather_case3
    gather = next(op for op in plan.operations if op.kind == "allgather")
    victim = next(op for op in plan.operations if op.kind == "send" and op.task == gather.task and op.dsts[0] == gather.dsts[1])
    message = rejected(with_ops(plan, [o for o in plan.operations if o is not victim]))
    assert f"device {gather.dsts[1]} sends {format_region(victim.region)} which it does not hold" in message


def test_allgather_with_a_part_nobody_contributes(allgather_case3):
    plan = allgather_case3
    gather = next(op for op in plan.operations if op.kind == "allgather")
    parts = list(gather.parts)
    lost = parts[-1]
    parts[-1] = tuple((a, a) for a, _ in lost)
    bad = gather.model_copy(update={"parts": tuple(parts)})
    message = rejected(with_ops(plan, [bad if o is gather else o for o in plan.operations]))
    assert f"no member contributes {format_region(lost)}" in message


def test_allgather_with_fewer_parts_than_members(allgather_case3):
    plan = allgather_case3
    gather = next(op for op in plan.operations if op.kind == "allgather")
    bad = gather.model_copy(update={"parts": gather.parts[:-1]})
    message = rejected(with_ops(plan, [bad if o is gather else o for o in plan.operations]))
    assert f"{len(gather.dsts)} members but {len(gather.parts) - 1} parts" in message


def test_send_with_two_receivers_is_rejected(send_recv_case3):
    op = the_op(send_recv_case3, "send", BOX, 8)
    bad = op.model_copy(update={"dsts": (8, 9)})
    message = rejected(with_ops(send_recv_case3, [bad if o is op else o for o in send_recv_case3.operations]))
    assert "a send has exactly one receiver, got [8, 9]" in message


def test_operation_ending_before_it_starts_is_rejected(send_recv_case3):
    op = the_op(send_recv_case3, "send", BOX, 8)
    bad = op.model_copy(update={"end_s": op.start_s - 1.0})
    message = rejected(with_ops(send_recv_case3, [bad if o is op else o for o in send_recv_case3.operations]))
    assert f"operation {op.id}" in message and "before it starts" in message


# --- overlapping meshes: local copies -------------------------------------------------------------------

@pytest.fixture
def overlap_plan(problem, compile_quick):
    # source devices 0,1 split [0:4]; destination devices 0 and 2 want all of it: device 0 copies [0:2] locally
    p = problem((4,), {"shape": [2], "devices": [0, 1]}, "S0", {"shape": [2], "devices": [0, 2]}, "R")
    return compile_quick(p, "send_recv")


def test_overlap_plan_has_a_local_copy_and_verifies(overlap_plan):
    copies = [op for op in overlap_plan.operations if op.kind == "copy"]
    assert [(op.src, op.dsts, op.region) for op in copies] == [(0, (0,), ((0, 2),))]
    assert all(0 not in op.dsts for op in overlap_plan.operations if op.kind != "copy" and op.region == ((0, 2),))
    verify_plan(overlap_plan)


def test_missing_local_copy_is_a_missing_slice(overlap_plan):
    ops = [op for op in overlap_plan.operations if op.kind != "copy"]
    assert rejected(with_ops(overlap_plan, ops)) == "destination device 0 never receives [0:2] of its shard [0:4]"


def test_copy_to_another_device_is_rejected(overlap_plan):
    copy = next(op for op in overlap_plan.operations if op.kind == "copy")
    bad = copy.model_copy(update={"dsts": (2,)})
    message = rejected(with_ops(overlap_plan, [bad if o is copy else o for o in overlap_plan.operations]))
    assert "a copy must stay on device 0, but names [2]" in message


def test_copy_of_data_the_device_does_not_hold_is_rejected(overlap_plan):
    copy = next(op for op in overlap_plan.operations if op.kind == "copy")
    bad = copy.model_copy(update={"region": ((2, 4),)})
    message = rejected(with_ops(overlap_plan, [bad if o is copy else o for o in overlap_plan.operations]))
    assert "device 0 sends [2:4] which it does not hold" in message


# --- uneven shards ------------------------------------------------------------------------------------------

def test_uneven_case6_missing_slice_names_the_uneven_box(case, compile_quick):
    plan = compile_quick(case("case6"), "send_recv")
    verify_plan(plan)
    victim = next(op for op in plan.operations if op.region[0] == (684, 1024))
    device = victim.dsts[0]
    message = rejected(with_ops(plan, [o for o in plan.operations if o is not victim]))
    assert message.startswith(f"destination device {device} never receives [684:1024, 0:1024, 0:512]")
    assert message.endswith("of its shard [684:1024, 0:1024, 0:512]")


# --- malformed boxes -----------------------------------------------------------------------------------------

def test_box_beyond_the_tensor_is_rejected(send_recv_case3):
    op = the_op(send_recv_case3, "send", BOX, 8)
    bad = op.model_copy(update={"region": ((0, 2000), (0, 512), (0, 512))})
    message = rejected(with_ops(send_recv_case3, [bad if o is op else o for o in send_recv_case3.operations]))
    assert f"operation {op.id}" in message and "region [0:2000, 0:512, 0:512] is not a box inside the tensor" in message


def test_box_with_too_few_dims_is_a_plan_error(send_recv_case3):
    op = the_op(send_recv_case3, "send", BOX, 8)
    bad = op.model_copy(update={"region": BOX[:2]})
    message = rejected(with_ops(send_recv_case3, [bad if o is op else o for o in send_recv_case3.operations]))
    assert f"operation {op.id}" in message


def test_box_with_too_many_dims_is_a_plan_error(send_recv_case3):
    ops = [o.model_copy(update={"region": o.region + ((0, 7),)}) for o in send_recv_case3.operations]
    rejected(with_ops(send_recv_case3, ops))


def test_inverted_box_is_a_plan_error(send_recv_case3):
    op = the_op(send_recv_case3, "send", BOX, 8)
    extra = op.model_copy(update={"id": 10_000, "region": ((512, 0), (0, 512), (0, 512))})
    message = rejected(with_ops(send_recv_case3, list(send_recv_case3.operations) + [extra]))
    assert "operation 10000" in message


# --- records: ids, task references and times ---------------------------------------------------------------

def test_operation_naming_a_missing_task_is_rejected(send_recv_case3):
    ops = list(send_recv_case3.operations)
    ops[0] = ops[0].model_copy(update={"task": 77})
    assert "names task 77, which the plan does not have" in rejected(with_ops(send_recv_case3, ops))


def test_operation_ids_must_be_unique(send_recv_case3):
    ops = [op.model_copy(update={"id": 0}) for op in send_recv_case3.operations]
    assert "operation at position 1 reuses id 0" in rejected(with_ops(send_recv_case3, ops))


def test_predicted_time_must_cover_the_last_operation(send_recv_case3):
    early = send_recv_case3.model_copy(update={"predicted_seconds": -5.0})
    assert "predicted_seconds -5.0 is before the last operation ends" in rejected(early)
