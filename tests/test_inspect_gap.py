"""`xmesh-plan inspect` says where a plan's time over the byte bound goes on the bound's NIC side."""


def test_inspect_splits_the_time_over_the_bound_on_the_busiest_side_into_parts_that_add_up():
    """`inspect`'s gap line: before the first operation on the bound's side, idle between, held beyond the bytes'
    time, after the last; with that side's byte time they make the predicted time."""
    from pathlib import Path

    from xmesh_plan.planner.inspect_plan import plan_loads, side_gap
    from xmesh_plan.schemas import read_plan_file

    plans = Path(__file__).resolve().parents[1] / "plans"
    for name in ("case3", "case6", "one_to_2x2", "weight_sync_small"):
        plan = read_plan_file(plans / f"{name}.plan.json")
        gap = side_gap(plan, plan_loads(plan))
        assert f"host {gap.host} {'send' if gap.side == 'send' else 'receive'}" in plan.solver.details["lower_bound_reason"], name
        assert abs(gap.need - plan.lower_bound_seconds) <= 1e-9 * plan.lower_bound_seconds
        total = gap.need + gap.before + gap.idle + gap.beyond + gap.after
        assert abs(total - plan.predicted_seconds) <= 1e-9 + 1e-9 * plan.predicted_seconds, name
        assert min(gap.before, gap.idle, gap.after) >= 0.0


def test_inspect_traces_the_bounds_side_flow_by_flow_in_parts_that_add_up():
    """`inspect`'s flow line: before the first message on the bound's side, its bytes' time (the bound), per-message
    overhead, the rest a message is on it, idle waiting for the next one's data or its sender, after the last."""
    from pathlib import Path

    from xmesh_plan.planner.compile import compile_plan
    from xmesh_plan.planner.inspect_plan import nic_trace, plan_loads, summarize
    from xmesh_plan.schemas import read_plan_file
    from tests.support.transfer import many_bundles

    plans = Path(__file__).resolve().parents[1] / "plans"
    bundled = compile_plan(many_bundles(), bucket_bytes=4096)
    for plan in [read_plan_file(plans / f"{name}.plan.json") for name in ("case3", "case6", "weight_sync_small")] + [bundled]:
        trace = nic_trace(plan, plan_loads(plan))
        assert abs(trace.need - plan.lower_bound_seconds) <= 1e-9 * plan.lower_bound_seconds
        parts = (trace.before, trace.need, trace.overhead, trace.shared, trace.waiting_data, trace.waiting_sender, trace.after)
        assert abs(sum(parts) - plan.predicted_seconds) <= 1e-9 + 1e-9 * plan.predicted_seconds
        assert min(parts) >= -1e-12 and trace.overhead > 0
    assert f"flows on host {trace.host} {trace.side}:" in summarize(bundled)


def test_the_per_message_line_says_what_striping_over_several_nics_costs():
    """A plan on hosts of 4 NICs stripes every message over all of them, so each NIC pays every message's overhead:
    the line says so and what one NIC per message would pay (a quarter); on hosts of one NIC it says nothing of it."""
    from pathlib import Path

    from xmesh_plan.planner.inspect_plan import message_cost_line, plan_loads
    from xmesh_plan.schemas import Nic, read_plan_file

    plan = read_plan_file(Path(__file__).resolve().parents[1] / "plans" / "weight_sync_small.plan.json")
    assert "striped" not in message_cost_line(plan, plan_loads(plan))
    cluster = plan.problem.cluster.model_copy(update={"nics": (Nic(send_gbps=2.5, recv_gbps=2.5),) * 4})
    four = plan.model_copy(update={"problem": plan.problem.model_copy(update={"cluster": cluster})})
    loads = plan_loads(four)
    cost = loads.busiest_messages()[2] * cluster.overhead_s
    line = message_cost_line(four, loads)
    assert f"striped over 4 NICs, each NIC pays every message's overhead: one NIC per message, balanced, would pay {cost / 4:.4f} s" in line, line


def test_inspect_says_what_bundle_relays_move_inside_hosts_and_how_fast_their_ports_are():
    """`inspect`'s bundle line, checked against the bundles' own fields: every part crosses hosts once in its message,
    is gathered into the sending relay unless that relay holds it, and scattered from the receiving relay to each of
    its needers but the relay itself; a plan without bundles has no such line."""
    from pathlib import Path

    from xmesh_plan.planner.compile import compile_plan
    from xmesh_plan.planner.inspect_plan import relay_line, relay_load, summarize
    from xmesh_plan.schemas import read_plan_file
    from xmesh_plan.schemas.geometry import region_size
    from xmesh_plan.schemas.op_kinds import bundle_runs
    from tests.support.transfer import many_bundles

    plan = compile_plan(many_bundles(), bucket_bytes=16384)  # 12 bundles, 8 of them riding in others' messages
    itemsizes = [p.itemsize for p in plan.problem.tensor_problems()]
    cross = gathered = scattered = 0
    for op in (op for op in plan.operations if op.kind == "bundle"):
        src = op.src if op.carrier is None else plan.operations[op.carrier].src
        relay = op.dsts[0] if op.carrier is None else plan.operations[op.carrier].dsts[0]
        for part, holder, needers in zip(op.parts, op.holders, op.needers):
            nbytes = region_size(part) * itemsizes[op.tensor or 0]
            cross += nbytes
            gathered += nbytes if holder != src else 0
            scattered += nbytes * sum(1 for d in needers if d != relay)
    load = relay_load(plan)
    assert (load.cross_bytes, load.gathered, load.scattered) == (cross, gathered, scattered)
    # intra-host messages as the executor sends them: a shared message one per holder and per needer other than its
    # relays, written out from the group's bundles; a bundle alone one per run of consecutive parts
    gathers = scatters = 0
    for group in _message_groups(plan.operations):
        src, relay = group[0].src, group[0].dsts[0]
        if len(group) > 1:
            gathers += len({h for op in group for h in op.holders if h != src})
            scatters += len({d for op in group for n in op.needers for d in n if d != relay})
        else:
            gathers += len(bundle_runs(group[0])[0])
            scatters += len(bundle_runs(group[0])[1])
    assert (load.gathers, load.scatters) == (gathers, scatters)
    assert f"in {gathers} messages and scatter" in relay_line(plan)[0]
    assert load.bundles == sum(op.kind == "bundle" for op in plan.operations) > load.messages > 0
    assert relay_line(plan)[0] in summarize(plan)
    assert relay_load(read_plan_file(Path(__file__).resolve().parents[1] / "plans" / "case3.plan.json")) is None


def test_inspect_says_what_a_schedule_timed_plan_counts_and_what_it_does_not(monkeypatch):
    """A plan with too many messages to simulate in host order is timed by its schedule: inspect says so and names what
    that timetable leaves out (a relay's gathers), which a simulated plan's flow line measures instead, and that the
    simulator timed its executor's order, whose time it prints."""
    import xmesh_plan.planner.compile as compile_module
    from xmesh_plan.planner.compile import compile_plan
    from xmesh_plan.planner.inspect_plan import summarize, timed_by_line
    from tests.support.transfer import many_bundles

    simulated = compile_plan(many_bundles(), bucket_bytes=16384)
    assert timed_by_line(simulated) == []
    monkeypatch.setattr(compile_module, "MAX_SIMULATED_MESSAGES", 0)
    timed = compile_plan(many_bundles(), bucket_bytes=16384)
    (line,) = timed_by_line(timed)
    assert line.startswith("timed by the schedule (more than 0 messages to simulate): ") and "gathers" in line
    assert line.endswith("; posted, the executor's order, by the simulator (the executor's prediction above)")
    assert line in summarize(timed)
    from xmesh_plan.planner.inspect_plan import executor_summary

    stated = timed.executor_prediction
    assert executor_summary(timed).startswith(f" in host order (the schedule's timetable), {stated.predicted_seconds:.4f} s posted")
    assert executor_summary(simulated).startswith(" in host order, ")
    assert f"predicted posted (the executor's default order for this plan): {stated.predicted_seconds:.4f} s" in summarize(timed)


def test_the_relay_line_names_only_ports_that_move_something():
    """A plan whose sending relays hold every part of their bundles gathers nothing: the line names no port for it
    (never a device -1 taking in 0 B)."""
    from tests.support.transfer import random_transfer
    from xmesh_plan.planner.compile import compile_rows
    from xmesh_plan.planner.inspect_plan import relay_line

    plan = compile_rows(random_transfer(3, 9)).to_plan()
    [line] = relay_line(plan)
    assert "gather 0 B" in line and "device -1" not in line and "takes in" not in line and "sends out" in line, line


def test_the_relay_line_counts_messages_per_port_and_names_shared_messages_only_where_there_are_some():
    """The relay port with the most intra-host messages is one port, in or out, counted from the plan's own bundles
    (a relay's gathers in, its scatters out, never the two added); the note on shared messages shows only where bundles
    share a message."""
    from xmesh_plan.planner.compile import compile_plan
    from xmesh_plan.planner.inspect_plan import relay_line, relay_load
    from xmesh_plan.schemas.op_kinds import bundle_runs
    from tests.support.transfer import many_bundles

    for bucket, shared in ((16384, True), (None, False)):
        plan = compile_plan(many_bundles(), bucket_bytes=bucket) if bucket else compile_plan(many_bundles())
        groups = _message_groups(plan.operations)
        if not shared:
            plan = plan.model_copy(update={"operations": tuple(op.model_copy(update={"carrier": None}) for op in plan.operations)})
            groups = [[op] for op in plan.operations]
        ports: dict = {}
        for group in (g for g in groups if g[0].kind == "bundle"):
            src, relay = group[0].src, group[0].dsts[0]
            if len(group) > 1:  # one message per holder into the sending relay, one per needer out of the receiving one
                gathers = len({h for op in group for h in op.holders if h != src})
                scatters = len({d for op in group for n in op.needers for d in n if d != relay})
            else:  # a bundle alone: one per run of consecutive parts
                gathers, scatters = map(len, bundle_runs(group[0]))
            ports[(src, "in")] = ports.get((src, "in"), 0) + gathers
            ports[(relay, "out")] = ports.get((relay, "out"), 0) + scatters
        load = relay_load(plan)
        assert load.busiest_messages[2] == max(ports.values()) and ports[load.busiest_messages[:2]] == max(ports.values())
        [line] = relay_line(plan)
        side = "takes in" if load.busiest_messages[1] == "in" else "sends out"
        assert f"device {load.busiest_messages[0]} {side} {load.busiest_messages[2]}," in line, line
        assert ("(a shared message: one per holder and per needer)" in line) is shared, line


def _message_groups(operations) -> list[list]:
    """The plan's shared messages from their definition: a bundle with a carrier joins the group of the one before it."""
    out: list[list] = []
    for op in operations:
        if op.carrier is not None:
            out[-1].append(op)
        else:
            out.append([op])
    return [g for g in out if g[0].kind == "bundle"]
