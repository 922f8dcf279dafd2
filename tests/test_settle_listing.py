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


def test_a_plan_of_more_messages_than_the_limit_is_timed_by_the_schedule_without_making_a_flow(monkeypatch):
    """Past `MAX_SIMULATED_MESSAGES` messages (counted from the operations, not from flows) compile keeps the
    schedule's timetable before it lowers anything to flows, and says so; `check` (`audit_plan`) decides alike."""
    from pathlib import Path

    from xmesh_plan.planner import audit as audit_module
    from xmesh_plan.planner import simulate as simulate_module
    from xmesh_plan.planner.transfer_io import load_any_problem

    problem = load_any_problem(Path(__file__).resolve().parents[1] / "plans" / "weight_sync_small.problem.toml")
    simulated = compile_plan(problem)
    messages = compile_module.simulated_messages(simulated.operations)
    lowered = len(lower(simulated.operations, problem, "host-order", nic_assignment(simulated.host_order))[0].flows)
    assert len(simulated.operations) < messages and lowered <= messages  # a bundle is several messages; bundles share some
    monkeypatch.setattr(compile_module, "MAX_SIMULATED_MESSAGES", messages - 1)

    def no_lowering(*args, **kwargs):
        raise AssertionError("a plan over the message limit was lowered to flows")

    monkeypatch.setattr(simulate_module, "lower", no_lowering)
    monkeypatch.setattr(compile_module, "DETAILED_STAGES", 0)
    heard: list[str] = []
    plan = compile_plan(problem, on_stage=heard.append)
    assert plan.solver.details["timed_by"] == f"schedule (more than {messages - 1:,} messages to simulate)"
    assert f"timing {len(plan.operations):,} operations by the schedule ({messages:,} messages: too many to simulate)" in heard
    assert not any(stage.startswith("simulating") for stage in heard)
    assert plan.executor_prediction is None and plan.predicted_seconds != simulated.predicted_seconds
    audit = audit_module.audit_plan(plan)
    assert not audit.retimed and audit.mismatch is None


@pytest.mark.parametrize("name", ["case7", "case8", "weight_sync_small"])
def test_the_message_count_behind_the_limit_is_the_routes_message_count(name):
    """`simulated_messages` (closed form: a broadcast's chunks on every hop, an all-gather's steps on every ring pair,
    a bundle's tags) equals the messages its operations' routes put on the wire (`op_kinds.messages`, made hop by hop),
    local copies counted once."""
    from pathlib import Path

    from xmesh_plan.schemas.op_kinds import messages
    from xmesh_plan.schemas.plan import read_plan_file

    plan = read_plan_file(Path(__file__).resolve().parents[1] / "plans" / f"{name}.plan.json")
    assert compile_module.simulated_messages(plan.operations) == sum(messages(op) or 1 for op in plan.operations)


def test_check_of_a_simulated_plan_past_the_message_limit_says_why_and_simulates_it_when_asked(monkeypatch, tmp_path):
    """A plan compile simulated (timed_by simulator) with more messages than the limit now allows (as under the older
    operation limit): `check` decides as compile does (`compile.too_many_messages`), says it did not re-simulate, why
    and what timed the plan, not that the schedule timed it; `--simulate` re-simulates it, and then catches a stored
    time that is wrong."""
    from pathlib import Path

    from click.testing import CliRunner

    from xmesh_plan.planner.cli import main
    from xmesh_plan.schemas.plan import read_plan_file

    path = Path(__file__).resolve().parents[1] / "plans" / "weight_sync_small.plan.json"
    plan = read_plan_file(path)
    assert plan.solver.details["timed_by"] == "simulator (host-order)"
    messages = compile_module.simulated_messages(plan.operations)
    monkeypatch.setattr(compile_module, "MAX_SIMULATED_MESSAGES", messages - 1)
    run = CliRunner().invoke(main, ["check", str(path)])
    assert run.exit_code == 0, run.output
    assert f"stored times not re-simulated: {messages:,} messages, more than {messages - 1:,} messages to simulate" in run.output
    assert "compiled timed by simulator (host-order); --simulate simulates it anyway" in run.output
    assert "timed by the schedule model" not in run.output and "too costly" not in run.output
    assert f"posted (executor default) {plan.executor_prediction.predicted_seconds:.4f} s as stored, not re-simulated" in run.output
    forced = CliRunner().invoke(main, ["check", str(path), "--simulate"])
    assert forced.exit_code == 0 and "not re-simulated" not in forced.output and forced.output.rstrip().endswith(" ok"), forced.output
    wrong = tmp_path / "wrong.plan.json"
    stated = plan.executor_prediction
    wrong.write_text(plan.model_copy(update={"executor_prediction": stated.model_copy(update={"predicted_seconds": stated.predicted_seconds * 1.5})}).to_json())
    assert CliRunner().invoke(main, ["check", str(wrong)]).exit_code == 0  # unchecked: the stored time stands
    caught = CliRunner().invoke(main, ["check", str(wrong), "--simulate"])
    assert caught.exit_code == 1 and "disagrees with" in caught.output, caught.output


def test_check_simulate_times_a_plan_compile_left_to_the_schedule_beside_its_own_times(monkeypatch, tmp_path):
    """`check --simulate` of a plan timed by the schedule (past the message limit) simulates it and reports that
    time beside the stored one, gated by --max-ratio, instead of failing its schedule times as wrong."""
    from pathlib import Path

    from click.testing import CliRunner

    from xmesh_plan.planner.cli import main
    from xmesh_plan.planner.transfer_io import load_any_problem

    problem = load_any_problem(Path(__file__).resolve().parents[1] / "plans" / "case3.problem.json")
    simulated = compile_plan(problem)
    monkeypatch.setattr(compile_module, "MAX_SIMULATED_MESSAGES", compile_module.simulated_messages(simulated.operations) - 1)
    plan = compile_plan(problem)
    assert plan.solver.details["timed_by"].startswith("schedule (more than")
    assert f"{plan.predicted_seconds:.4f}" != f"{simulated.predicted_seconds:.4f}"
    path = tmp_path / "schedule.plan.json"
    path.write_text(plan.to_json())
    plain = CliRunner().invoke(main, ["check", str(path)])
    assert plain.exit_code == 0 and "stored times not re-simulated" in plain.output, plain.output
    forced = CliRunner().invoke(main, ["check", str(path), "--simulate"])
    assert forced.exit_code == 0, forced.output
    assert f"simulated (--simulate) {simulated.predicted_seconds:.4f} s" in forced.output
    assert "operation times are the schedule's" in forced.output and "not re-simulated" not in forced.output
    tight = CliRunner().invoke(main, ["check", str(path), "--simulate", "--max-ratio", "1.0003"])
    assert tight.exit_code == 1 and "its lower bound simulated in host order" in tight.output, tight.output
