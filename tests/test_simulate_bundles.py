"""Host order queues a bundle's messages inside its hosts: its gathers behind a NIC turn (`GATHER_AHEAD` bundles ahead
of the NIC, not every bundle's at once), its scatters one at a time between two devices. A weight sync's MoE layer has tens
of thousands of bundle messages, which moving all at once made too costly to simulate."""

from __future__ import annotations

import pytest

from xmesh_plan.planner.compile import compile_plan, simulated_messages
from xmesh_plan.planner.simulate import DISCIPLINES, GATHER_AHEAD, lower, nic_assignment, run_flows, simulate, window_waits
from xmesh_plan.schemas.carriers import group_runs, message_groups
from xmesh_plan.schemas.geometry import region_size
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


def _intra_host_flows(lowering, head, src: int, relay: int) -> tuple[dict[int, float], dict[int, float]]:
    """(holder -> bytes it sends the sending relay, needer -> bytes the receiving relay sends it) in the flows of the
    message `head`, each flow counted once by device, with how many flows each device had."""
    gathers: dict[int, list[float]] = {}
    scatters: dict[int, list[float]] = {}
    for f in lowering.flows:
        if f.op != head or not all(link.startswith("d") for link in f.links):
            continue
        ports = dict(link[1:].split(".") for link in f.links)  # device -> "in" / "out"
        sender = next(int(d) for d, side in ports.items() if side == "out")
        receiver = next(int(d) for d, side in ports.items() if side == "in")
        if receiver == src:
            gathers.setdefault(sender, []).append(f.nbytes)
        if sender == relay:
            scatters.setdefault(receiver, []).append(f.nbytes)
    return gathers, scatters


@pytest.mark.parametrize("discipline", DISCIPLINES)
def test_a_shared_message_sends_one_intra_host_message_per_pair_of_devices(discipline):
    """The flows of a shared message inside its hosts, against `carriers.group_runs` (the executor's messages): one
    flow from each holder to the sending relay and one from the receiving relay to each needer, each with the bytes
    of all that device's pieces of the group; a bundle per tensor would send each holder's parts of every bundle apart."""
    plan = compile_plan(many_bundles(), bucket_bytes=16384)  # shared messages of three bundles
    groups = [g for g in message_groups(plan.operations) if len(g) > 1]
    assert groups
    itemsizes = [p.itemsize for p in plan.problem.tensor_problems()]
    window = window_waits(plan.operations, plan.problem, 2**12) if discipline == "window" else None
    lowering, _ = lower(plan.operations, plan.problem, discipline, nic_assignment(plan.host_order), window=window)
    several = 0
    for group in groups:
        head = group[0]
        gathers, scatters = _intra_host_flows(lowering, head.id, head.src, head.dsts[0])
        want_gathers, want_scatters = group_runs(group)
        several += sum(len({m for m, _ in pieces}) > 1 for _, pieces in want_gathers)
        piece_bytes = {(m, i): region_size(group[m].parts[i]) * itemsizes[group[m].tensor] for m in range(len(group))
                       for i in range(len(group[m].parts))}
        assert gathers == {h: [sum(piece_bytes[p] for p in pieces)] for h, pieces in want_gathers}
        assert scatters == {d: [sum(piece_bytes[p] for p in pieces)] for d, pieces in want_scatters}
    assert several  # some holder has parts of several bundles of one message: one message where bundles would send more


def test_compile_counts_the_messages_the_simulator_makes_of_shared_messages():
    """`compile.simulated_messages` (what decides whether a plan is simulated) counts a shared message's intra-host
    messages as the simulator makes them: one flow per message on hosts of one NIC."""
    plan = compile_plan(many_bundles(), bucket_bytes=16384)
    assert len(plan.problem.cluster.nics) == 1 and any(op.carrier is not None for op in plan.operations)
    lowering, _ = lower(plan.operations, plan.problem, "posted", nic_assignment(plan.host_order))
    assert simulated_messages(plan.operations) == len(lowering.flows)


def test_a_shared_messages_intra_host_messages_are_counted_as_group_runs_lists_them():
    """`coalesce.shared_messages_inside` counts what `carriers.group_runs` lists, on every shared message of a plan."""
    from xmesh_plan.planner.coalesce import shared_messages_inside

    plan = compile_plan(many_bundles(), bucket_bytes=16384)
    groups = [g for g in message_groups(plan.operations) if len(g) > 1]
    assert groups and all(shared_messages_inside(g) == tuple(map(len, group_runs(g))) for g in groups)


def test_a_shared_message_lowers_to_the_route_and_devices_of_its_group_fused_into_one_bundle():
    """`simulate.shared_message` (made without fusing the group) gives hop for hop the route `op_kinds.merged_route`
    gives the group fused into one bundle of bytes (`carriers.fused`), and that bundle's devices (`op_kinds.members`),
    also when its bundles' sums are kept from another group that shares their tuples, and when the kept sums are
    dropped at MAX_KEPT_SUMS."""
    from xmesh_plan.planner import simulate as sim
    from xmesh_plan.schemas.carriers import fused
    from xmesh_plan.schemas.op_kinds import members, merged_route

    plan = compile_plan(many_bundles(), bucket_bytes=16384)
    itemsizes = [p.itemsize for p in plan.problem.tensor_problems()]
    groups = [g for g in message_groups(plan.operations) if len(g) > 1]
    assert groups
    sums: dict = {}
    for group in groups + groups:  # the second time from the kept sums
        want = fused(group, itemsizes)
        got = sim.shared_message(group, itemsizes, sums)
        assert (got.id, got.task, got.src, got.dsts) == (want.id, want.task, want.src, want.dsts)
        assert got.hops == merged_route(want) and got.devices == members(want)
    assert 0 < len(sums) <= sum(map(len, groups))
    kept = sim.MAX_KEPT_SUMS
    try:
        sim.MAX_KEPT_SUMS, sums = 1, {}
        assert [sim.shared_message(g, itemsizes, sums).hops for g in groups] == [merged_route(fused(g, itemsizes)) for g in groups]
        assert len(sums) == 1
    finally:
        sim.MAX_KEPT_SUMS = kept
