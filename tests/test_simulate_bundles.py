"""Host order queues a bundle's messages inside its hosts: its gathers behind a NIC turn (`GATHER_AHEAD` bundles ahead
of the NIC, not every bundle's at once), its scatters one at a time between two devices. A weight sync's MoE layer has tens
of thousands of bundle messages, which moving all at once made too costly to simulate."""

from __future__ import annotations

from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.simulate import GATHER_AHEAD, lower, nic_assignment, run_flows, simulate
from xmesh_plan.schemas.op_kinds import rule_of

from tests.support.reference_flows import reference_simulate
from tests.support.transfer import many_bundles


def flow_spans(plan):
    lowering, _ = lower(plan.operations, plan.problem, "host-order", nic_assignment(plan.host_order))
    spans = run_flows(lowering.flows, lowering.capacity)
    return lowering, spans


def test_a_bundles_gathers_wait_for_the_turn_of_the_operation_before_it_on_its_nic():
    plan = compile_plan(many_bundles(), bucket_bytes=4096)
    lowering, spans = flow_spans(plan)
    ops = {op.id: op for op in plan.operations}
    bundles = [op for op in plan.operations if rule_of(op).pattern == "bundle" and op.carrier is None]
    assert len(bundles) >= GATHER_AHEAD + 4
    cross = {f.op: f for f in lowering.flows if any(link.startswith("h0.send") for link in f.links)}
    gathers = {}
    for f in lowering.flows:
        if ops[f.op].kind == "bundle" and f.links and all(link.startswith("d") for link in f.links) and f"d{ops[f.op].src}.in" in f.links:
            gathers.setdefault(f.op, []).append(f.id)
    on_nic = [op.id for op in sorted(bundles, key=lambda op: spans[cross[op.id].id][0])]
    ahead = GATHER_AHEAD + 1
    assert all(gathers.get(i) for i in on_nic[ahead:])
    for before, op in zip(on_nic, on_nic[ahead:]):  # the one GATHER_AHEAD before has its turn once the one before it has left
        left = spans[cross[before].id][1] - cross[before].latency_s
        assert left > 0
        assert min(spans[g][0] for g in gathers[op]) >= left * (1 - 1e-12)
    times = simulate(plan.operations, plan.problem, "host-order", nic_assignment(plan.host_order))
    for op in bundles:  # a bundle starts with its message across hosts, its gathers before
        assert times.op_start_s[op.id] == spans[cross[op.id].id][0]
        assert min(spans[g][0] for g in gathers.get(op.id, [cross[op.id].id])) <= times.op_start_s[op.id]


def test_a_relay_scatters_to_one_needer_one_message_at_a_time():
    plan = compile_plan(many_bundles(), bucket_bytes=4096)
    lowering, spans = flow_spans(plan)
    ops = {op.id: op for op in plan.operations}
    by_pair = {}
    for f in lowering.flows:
        op = ops[f.op]
        if op.kind == "bundle" and f"d{op.dsts[0]}.out" in f.links:
            needer = next(int(link[1:-3]) for link in f.links if link.endswith(".in"))
            by_pair.setdefault((op.dsts[0], needer), []).append((spans[f.id][0], spans[f.id][1] - f.latency_s))
    assert any(len(v) > 1 for v in by_pair.values())
    for moving in by_pair.values():
        moving.sort()
        for (_, left), (start, _) in zip(moving, moving[1:]):
            assert start >= left * (1 - 1e-12)


def test_bundle_plans_time_as_the_reference_engine():
    plan = compile_plan(many_bundles(), bucket_bytes=4096)
    args = (plan.operations, plan.problem, "host-order", nic_assignment(plan.host_order))
    new, old = simulate(*args), reference_simulate(*args)
    assert new.op_start_s.keys() == old.op_start_s.keys()
    for i in new.op_start_s:
        assert abs(new.op_start_s[i] - old.op_start_s[i]) <= 1e-11 * max(1.0, old.op_start_s[i])
        assert abs(new.op_end_s[i] - old.op_end_s[i]) <= 1e-11 * max(1.0, old.op_end_s[i])
    assert plan.solver.details["timed_by"] == "simulator (host-order)"
