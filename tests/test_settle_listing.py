"""`compile.settle_listing` takes a new listing that only renumbers the flows (`simulate.renumbered_only`) as settled
on the times just simulated; on random plans that gives exactly the listing and times that simulating every round
until the listing stops changing gives, and the shortcut is taken on some of them."""

from __future__ import annotations

import pytest

from xmesh_plan.planner import compile as compile_module
from xmesh_plan.planner.compile import DIGITS, MAX_RELISTINGS, compile_plan, settle_listing
from xmesh_plan.planner.simulate import lower, nic_assignment, renumbered_only, simulate

from tests.support.cases import random_problem
from tests.support.transfer import random_transfer


def settle_by_simulating(operations, problem, nic_of_task):
    """The listing settle that simulates every listing it makes."""
    listing = operations
    for _ in range(MAX_RELISTINGS):
        result = simulate(listing, problem, "host-order", nic_of_task)
        position = {op.id: i for i, op in enumerate(listing)}
        order = sorted(listing, key=lambda op: (round(result.op_start_s[op.id], DIGITS), position[op.id]))
        if order == list(listing):
            return listing, result
        listing = tuple(order)
    return None


def schedule_listings():
    """Operations in the schedule's order (what compile settles), with the plan's NIC choices, on random problems."""
    shuffled = []
    for seed in range(30):
        for problem in (random_problem(seed, max_devices=12, exact=False), random_transfer(seed, 12)):
            plan = compile_plan(problem, solver="greedy")
            ops = sorted(plan.operations, key=lambda op: (op.task, op.id))  # a listing the simulation reorders
            shuffled.append((tuple(ops), plan.problem, nic_assignment(plan.host_order)))
    return shuffled


def test_the_settled_listing_and_times_are_those_of_simulating_every_round(monkeypatch):
    shortcuts = []
    real = compile_module.renumbered_only

    def counting(before, after, lowering):
        taken = real(before, after, lowering)
        shortcuts.append(taken)
        return taken

    monkeypatch.setattr(compile_module, "renumbered_only", counting)
    for ops, problem, nics in schedule_listings():
        fast, slow = settle_listing(ops, problem, nics), settle_by_simulating(ops, problem, nics)
        assert (fast is None) == (slow is None)
        if fast is not None:
            assert [op.id for op in fast[0]] == [op.id for op in slow[0]]
            assert fast[1] == slow[1]  # every start and end, bit for bit, and the work
    assert any(shortcuts) and not all(shortcuts)


def test_a_listing_that_swaps_two_operations_on_one_nic_side_is_not_a_renumbering():
    """Two sends from one host's NIC: swapping them changes which one waits for the other there."""
    problem = random_problem(3, max_devices=12, exact=False)
    plan = compile_plan(problem, solver="greedy")
    lowering, _ = lower(plan.operations, problem, "host-order", nic_assignment(plan.host_order))
    sides: dict[str, list[int]] = {}
    for f in lowering.flows:
        for link in f.links:
            if link.startswith("h") and f.op not in sides.get(link, []):
                sides.setdefault(link, []).append(f.op)
    shared = next(ids for ids in sides.values() if len(ids) > 1)
    a, b = (next(i for i, op in enumerate(plan.operations) if op.id == x) for x in shared[:2])
    swapped = list(plan.operations)
    swapped[a], swapped[b] = swapped[b], swapped[a]
    assert not renumbered_only(plan.operations, swapped, lowering)
    assert renumbered_only(plan.operations, list(plan.operations), lowering)
    with pytest.raises(ValueError, match="host-order"):
        renumbered_only(plan.operations, swapped, lower(plan.operations, problem, "posted")[0])


def test_a_plan_whose_simulation_passes_the_work_budget_keeps_the_schedules_times_and_check_agrees(monkeypatch):
    """Past `MAX_SIMULATION_WORK` units of work compile keeps the schedule's timetable and says so; `check`
    (`audit_plan`) stops at the same count, so it believes those times instead of calling them wrong."""
    from pathlib import Path

    from xmesh_plan.planner import audit as audit_module
    from xmesh_plan.planner.transfer_io import load_any_problem

    problem = load_any_problem(Path(__file__).resolve().parents[1] / "plans" / "weight_sync_small.problem.toml")
    simulated = compile_plan(problem)
    assert simulated.solver.details["timed_by"] == "simulator (host-order)"
    monkeypatch.setattr(compile_module, "MAX_SIMULATION_WORK", 10)
    monkeypatch.setattr(audit_module, "MAX_SIMULATION_WORK", 10)
    plan = compile_plan(problem)
    assert plan.solver.details["timed_by"] == "schedule (a simulation takes more than 10 units of work)"
    assert plan.executor_prediction is None and plan.predicted_seconds != simulated.predicted_seconds
    audit = audit_module.audit_plan(plan)
    assert not audit.retimed and audit.mismatch is None


def test_a_plan_of_more_messages_than_the_limits_is_timed_by_the_schedule_without_making_a_flow(monkeypatch):
    """Past `MAX_SIMULATED_MESSAGES` messages (counted from the operations, not from flows) and past
    `executor_order.MAX_EXECUTOR_MESSAGES`, compile keeps the schedule's timetable and states no time in the executor's
    order, before it lowers anything to flows, and says so; `check` (`audit_plan`) decides alike."""
    from pathlib import Path

    from xmesh_plan.planner import audit as audit_module
    from xmesh_plan.planner import executor_order as executor_order_module
    from xmesh_plan.planner import simulate as simulate_module
    from xmesh_plan.planner.transfer_io import load_any_problem

    problem = load_any_problem(Path(__file__).resolve().parents[1] / "plans" / "weight_sync_small.problem.toml")
    simulated = compile_plan(problem)
    messages = compile_module.simulated_messages(simulated.operations)
    lowered = len(lower(simulated.operations, problem, "host-order", nic_assignment(simulated.host_order))[0].flows)
    assert 0 < lowered <= messages  # one flow a message, or one a NIC a message is striped over
    monkeypatch.setattr(compile_module, "MAX_SIMULATED_MESSAGES", messages - 1)
    monkeypatch.setattr(executor_order_module, "MAX_EXECUTOR_MESSAGES", messages - 1)

    def no_lowering(*args, **kwargs):
        raise AssertionError("a plan over the message limit was lowered to flows")

    monkeypatch.setattr(simulate_module, "lower", no_lowering)
    monkeypatch.setattr(compile_module, "DETAILED_STAGES", 0)
    heard: list[str] = []
    plan = compile_plan(problem, on_stage=heard.append)
    assert plan.solver.details["timed_by"] == f"schedule (more than {messages - 1:,} messages to simulate)"
    assert f"timing {len(plan.operations):,} operations by the schedule ({messages:,} messages: too many to simulate in host order)" in heard
    assert not any(stage.startswith("simulating") for stage in heard)
    assert plan.executor_prediction is None and plan.predicted_seconds != simulated.predicted_seconds
    audit = audit_module.audit_plan(plan)
    assert not audit.retimed and audit.mismatch is None
    from xmesh_plan.schemas import ExecutorPrediction

    monkeypatch.setattr(simulate_module, "lower", lower)  # a time the plan states past the limits: as stored, unless any_size
    forged = plan.model_copy(update={"executor_prediction": ExecutorPrediction(order="posted", predicted_seconds=123.0)})
    assert audit_module.audit_plan(forged).mismatch is None and audit_module.audit_plan(forged).executor_seconds is None
    assert "stored executor_prediction (posted) 123.0 s disagrees" in audit_module.audit_plan(forged, any_size=True).mismatch


def test_a_plan_over_the_host_order_limit_states_its_time_in_the_executors_order_from_one_simulation(monkeypatch):
    """Past `MAX_SIMULATED_MESSAGES` messages but within `executor_order.MAX_EXECUTOR_MESSAGES`, compile keeps the
    schedule's times for the operations and states the plan's time in the executor's order (posted) from one posted
    simulation of its listing, no host-order one, and says so in `timed_by`; `check` (`audit_plan`) re-derives that time
    and catches a wrong one. Past `executor_order.EXECUTOR_WORK` units of that simulation's work it states none, and
    `check` agrees."""
    from pathlib import Path

    from xmesh_plan.planner import audit as audit_module
    from xmesh_plan.planner import executor_order as executor_order_module
    from xmesh_plan.planner import simulate as simulate_module
    from xmesh_plan.planner.executor_order import executor_order_seconds
    from xmesh_plan.planner.transfer_io import load_any_problem
    from xmesh_plan.schemas import ExecutorPrediction

    problem = load_any_problem(Path(__file__).resolve().parents[1] / "plans" / "weight_sync_small.problem.toml")
    simulated = compile_plan(problem)
    messages = compile_module.simulated_messages(simulated.operations)
    monkeypatch.setattr(compile_module, "MAX_SIMULATED_MESSAGES", messages - 1)
    monkeypatch.setattr(executor_order_module, "MAX_EXECUTOR_MESSAGES", messages)
    lowered: list[str] = []
    real_lower = simulate_module.lower

    def counted(operations, problem, discipline="host-order", *args, **kwargs):
        lowered.append(discipline)
        return real_lower(operations, problem, discipline, *args, **kwargs)

    monkeypatch.setattr(simulate_module, "lower", counted)
    monkeypatch.setattr(compile_module, "DETAILED_STAGES", 0)
    heard: list[str] = []
    plan = compile_plan(problem, on_stage=heard.append)
    assert lowered == ["posted"]
    assert f"simulating {messages:,} messages in the executor's order (posted)" in heard
    assert plan.solver.details["timed_by"] == (f"schedule (more than {messages - 1:,} messages to simulate); "
                                               "posted, the executor's order, by the simulator")
    seconds = executor_order_seconds(plan.operations, problem, plan.host_order)
    assert plan.executor_prediction == ExecutorPrediction(order="posted", predicted_seconds=round(seconds, DIGITS))
    assert plan.predicted_seconds != simulated.predicted_seconds  # the schedule's times for the operations
    audit = audit_module.audit_plan(plan)
    assert not audit.retimed and audit.mismatch is None and audit.executor_seconds == plan.executor_prediction.predicted_seconds
    wrong = plan.model_copy(update={"executor_prediction": ExecutorPrediction(order="posted", predicted_seconds=seconds * 1.01)})
    assert "stored executor_prediction (posted)" in audit_module.audit_plan(wrong).mismatch
    monkeypatch.setattr(executor_order_module, "EXECUTOR_WORK", 10)
    costly = compile_plan(problem)
    assert costly.executor_prediction is None and costly.solver.details["timed_by"] == f"schedule (more than {messages - 1:,} messages to simulate)"
    audit = audit_module.audit_plan(costly)
    assert audit.mismatch is None and audit.executor_seconds is None


@pytest.mark.parametrize("name", ["case7", "case8", "weight_sync_small"])
def test_the_message_count_behind_the_limit_is_the_routes_message_count(name):
    """`simulated_messages` (closed form: a broadcast's chunks on every hop, an all-gather's steps on every ring pair,
    a bundle's tags, a shared message's distinct holders and needers) equals the messages its operations' routes put on
    the wire (`op_kinds.messages`, made hop by hop; a shared message's as the one bundle it is on the wire, its
    intra-host messages one per pair of devices: `merged_route`), local copies counted once."""
    from pathlib import Path

    from xmesh_plan.schemas.carriers import fused, message_groups
    from xmesh_plan.schemas.op_kinds import merged_route, messages
    from xmesh_plan.schemas.plan import read_plan_file

    plan = read_plan_file(Path(__file__).resolve().parents[1] / "plans" / f"{name}.plan.json")
    itemsizes = [p.itemsize for p in plan.problem.tensor_problems()]
    hop_by_hop = sum(messages(group[0]) or 1 if len(group) == 1 else
                     sum(h.src != h.dst and h.elements > 0 for h in merged_route(fused(group, itemsizes)))
                     for group in message_groups(plan.operations))
    assert compile_module.simulated_messages(plan.operations) == hop_by_hop


def test_check_of_a_simulated_plan_past_the_message_limit_says_why_and_what_timed_it(monkeypatch, tmp_path):
    """A plan compile simulated (timed_by simulator) with more messages than the limits now allow (as under the older
    operation limit): `check` decides as compile does (`compile.too_many_messages`, `executor_order.MAX_EXECUTOR_MESSAGES`)
    and says it did not re-simulate the stored times, why and what timed the plan, not that the schedule timed it; its
    stated executor-order time is shown as stored; `--simulate` times that order and holds the stated time to it."""
    from pathlib import Path

    from click.testing import CliRunner

    from xmesh_plan.planner import executor_order as executor_order_module
    from xmesh_plan.planner.cli import main
    from xmesh_plan.schemas.plan import read_plan_file

    path = Path(__file__).resolve().parents[1] / "plans" / "weight_sync_small.plan.json"
    plan = read_plan_file(path)
    assert plan.solver.details["timed_by"] == "simulator (host-order)"
    messages = compile_module.simulated_messages(plan.operations)
    monkeypatch.setattr(compile_module, "MAX_SIMULATED_MESSAGES", messages - 1)
    monkeypatch.setattr(executor_order_module, "MAX_EXECUTOR_MESSAGES", messages - 1)
    run = CliRunner().invoke(main, ["check", str(path)])
    assert run.exit_code == 0, run.output
    assert (f"stored host-order times not re-simulated: {messages:,} messages, more than {messages - 1:,} messages to "
            "simulate (compile.MAX_SIMULATED_MESSAGES); compiled timed by simulator (host-order)") in run.output
    assert "timed by the schedule model" not in run.output and "too costly" not in run.output
    stated = plan.executor_prediction
    assert f"posted (executor default) {stated.predicted_seconds:.4f} s as stored, not re-simulated, not gated" in run.output
    timed = CliRunner().invoke(main, ["check", str(path), "--simulate"])
    assert timed.exit_code == 0 and "as stored" not in timed.output, timed.output
    wrong = tmp_path / "wrong.plan.json"
    wrong.write_text(plan.model_copy(update={"executor_prediction": stated.model_copy(update={"predicted_seconds": stated.predicted_seconds * 1.5})}).to_json())
    assert CliRunner().invoke(main, ["check", str(wrong)]).exit_code == 0  # not re-simulated: the stored time stands
    caught = CliRunner().invoke(main, ["check", str(wrong), "--simulate"])
    assert caught.exit_code == 1 and "stored executor_prediction (posted)" in caught.output, caught.output


def test_check_of_a_plan_past_the_work_budget_names_the_budget(monkeypatch):
    """A plan whose host-order simulation passes `MAX_SIMULATION_WORK`: `check` keeps its stored times as compile does
    and names the budget as the reason."""
    from pathlib import Path

    from xmesh_plan.planner import audit as audit_module
    from xmesh_plan.schemas.plan import read_plan_file

    plan = read_plan_file(Path(__file__).resolve().parents[1] / "plans" / "case3.plan.json")
    assert audit_module.audit_plan(plan).retimed
    monkeypatch.setattr(audit_module, "MAX_SIMULATION_WORK", 1)
    audit = audit_module.audit_plan(plan)
    assert not audit.retimed and audit.mismatch is None
    assert audit.unsimulated == "its simulation takes more than 1 units of work (compile.MAX_SIMULATION_WORK)"
