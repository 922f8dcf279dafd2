"""The network simulator against hand arithmetic: one broadcast, two tasks on one NIC, fair sharing, rings."""

from __future__ import annotations

import tomllib

import pytest

from xmesh_plan.planner import simulate as simulator
from xmesh_plan.planner.baselines import BASELINES, alpa_allgather, alpa_send_recv, baseline_seconds
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.simulate import Flow, max_min_rates, run_flows, simulate, simulate_plan
from xmesh_plan.planner.transfer_io import build_transfer
from xmesh_plan.planner.verify import verify_plan
from xmesh_plan.planner.weight_sync import TOY, Layout, weight_sync_toml
from xmesh_plan.schemas import Cluster, DeviceMesh, Nic, Operation, Placement, ReshardingProblem
from xmesh_plan.schemas.staging import SYNC_SEND_BYTES

GBPS10 = 10e9 / 8  # bytes per second of a 10 Gbit/s NIC


def one_gpu_hosts(latency_us: float = 0.0, hosts: int = 8, shape=(1024, 1024, 64), overhead_us: float = 0.0) -> ReshardingProblem:
    """A problem whose only use here is its cluster: one device per host, so every hop crosses hosts."""
    cluster = Cluster(devices_per_host=1, latency_us=latency_us, overhead_us=overhead_us)
    mesh = DeviceMesh(shape=(1, 1), devices=(0,))
    other = DeviceMesh(shape=(1, hosts - 1), devices=tuple(range(1, hosts)))
    return ReshardingProblem(shape=shape, dtype="int32", cluster=cluster,
                             src=Placement(mesh=mesh, spec="R R R"), dst=Placement(mesh=other, spec="R R R"))


def full(problem):
    return tuple((0, n) for n in problem.shape)


@pytest.mark.parametrize("receivers,chunks", [(1, 1), (3, 1), (3, 8), (4, 100), (7, 64)])
def test_one_broadcast_matches_the_pipeline_formula(receivers, chunks):
    """A hosts in a chain, K chunks: t + (A-1) t/K exactly, within the paper's t + A t/K."""
    p = one_gpu_hosts()
    op = Operation(id=0, task=0, kind="broadcast", src=0, dsts=tuple(range(1, receivers + 1)), region=full(p), chunks=chunks)
    t = p.nbytes / GBPS10
    result = simulate([op], p)
    assert result.makespan_s == pytest.approx(t + (receivers - 1) * t / chunks, rel=1e-9)
    assert result.makespan_s <= t + receivers * t / chunks


def test_broadcast_pays_latency_once_per_hop_and_overhead_per_chunk():
    """Chunks stream back to back: a link sends the next while the last is in flight (2 hops, 4 chunks)."""
    p = one_gpu_hosts(latency_us=20.0, overhead_us=3.0)
    op = Operation(id=0, task=0, kind="broadcast", src=0, dsts=(1, 2), region=full(p), chunks=4)
    chunk = 3e-6 + p.nbytes / 4 / GBPS10
    assert simulate([op], p).makespan_s == pytest.approx(2 * 20e-6 + 2 * chunk + 3 * chunk, rel=1e-9)


@pytest.mark.parametrize("discipline,expected", [("host-order", (1, 2, 1)), ("device-order", (1, 2, 1))])
def test_back_to_back_messages_on_one_nic_overlap_their_latency(discipline, expected):
    """The NIC sends the second message while the first is in flight (2t + L): in host order by the
    plan's NIC queue; in device order device 0's second send (another peer) waits for its first to
    have left, not to have landed (a send completes once the transport holds its bytes)."""
    cluster = Cluster(devices_per_host=2, latency_us=50.0, overhead_us=0.0)
    p = ReshardingProblem(shape=(1024, 1024, 64), dtype="int32", cluster=cluster,
                          src=Placement(mesh=DeviceMesh(shape=(1, 1), devices=(0,)), spec="R R R"),
                          dst=Placement(mesh=DeviceMesh(shape=(2, 1), devices=(2, 4)), spec="R R R"))
    ops = [Operation(id=i, task=i, kind="send", src=0, dsts=(2 + 2 * i,), region=full(p)) for i in range(2)]
    result = simulate(ops, p, discipline)
    t, latency = p.nbytes / GBPS10, 50e-6
    first_sends, second_sends, latencies = expected
    assert result.op_end_s[0] == pytest.approx(first_sends * t + latency)
    assert result.op_end_s[1] == pytest.approx(second_sends * t + latencies * latency)


def _sends(pairs: tuple[tuple[int, int], ...]) -> tuple[ReshardingProblem, list[Operation]]:
    """A 16 MiB send per (src, dst) pair, one device per host used (2 devices per host)."""
    cluster = Cluster(devices_per_host=2, latency_us=50.0, overhead_us=0.0)
    p = ReshardingProblem(shape=(1024, 1024, 4), dtype="int32", cluster=cluster,
                          src=Placement(mesh=DeviceMesh(shape=(1, 1), devices=(0,)), spec="R R R"),
                          dst=Placement(mesh=DeviceMesh(shape=(1, 1), devices=(2,)), spec="R R R"))
    return p, [Operation(id=i, task=i, kind="send", src=a, dsts=(b,), region=full(p)) for i, (a, b) in enumerate(pairs)]


def test_device_order_runs_operations_with_the_same_peers_together():
    """As `executor.lower.in_device_order`: 0 -> 2 then 2 -> 0 have the same peers on both devices, one
    run, so the second does not wait (both end at t + L); 0 -> 2 then 4 -> 0 change device 0's peers,
    so the second waits for device 0's send to have left (ends at 2t + L)."""
    t, latency = 1024 * 1024 * 4 * 4 / GBPS10, 50e-6
    p, ops = _sends(((0, 2), (2, 0)))
    result = simulate(ops, p, "device-order")
    assert result.op_end_s[1] == pytest.approx(t + latency)
    p, ops = _sends(((0, 2), (4, 0)))
    result = simulate(ops, p, "device-order")
    assert result.op_start_s[1] == pytest.approx(t) and result.op_end_s[1] == pytest.approx(2 * t + latency)


@pytest.mark.parametrize("discipline", ["device-order", "posted"])
def test_messages_between_one_pair_of_devices_go_in_order(discipline):
    """The executor's orders send every message between two devices over one connection, so a second
    message on the pair starts when the first has left (t + L, then 2t + L), instead of sharing the
    link with it (both at 2t + L); host order keeps its own NIC queue."""
    t, latency = 1024 * 1024 * 4 * 4 / GBPS10, 50e-6
    p, ops = _sends(((0, 2), (0, 2)))
    result = simulate(ops, p, discipline)
    assert result.op_end_s[0] == pytest.approx(t + latency) and result.op_end_s[1] == pytest.approx(2 * t + latency)


@pytest.mark.parametrize("elements", [SYNC_SEND_BYTES // 4 - 1024, SYNC_SEND_BYTES // 4])
def test_device_order_goes_on_after_a_buffered_send_once_it_is_posted(elements):
    """The MPI engine sends a message under `SYNC_SEND_BYTES` buffered (it ends once posted), a larger
    one synchronously: device 0's send to device 4 then waits for its send to device 2 to have left
    (starts at t), and after a buffered one it starts at once, the two sharing the NIC (both end at 2t)."""
    cluster = Cluster(devices_per_host=2, latency_us=0.0, overhead_us=0.0)
    p = ReshardingProblem(shape=(elements, 1, 1), dtype="int32", cluster=cluster,
                          src=Placement(mesh=DeviceMesh(shape=(1, 1), devices=(0,)), spec="R R R"),
                          dst=Placement(mesh=DeviceMesh(shape=(2, 1), devices=(2, 4)), spec="R R R"))
    ops = [Operation(id=i, task=i, kind="send", src=0, dsts=(2 + 2 * i,), region=full(p)) for i in range(2)]
    result = simulate(ops, p, "device-order")
    t = p.nbytes / GBPS10
    if p.nbytes < SYNC_SEND_BYTES:
        assert result.op_start_s[1] == 0.0 and result.op_end_s[0] == pytest.approx(2 * t)
    else:
        assert result.op_start_s[1] == pytest.approx(t) and result.op_end_s[1] == pytest.approx(2 * t)
    assert simulate(ops, p, "host-order").op_start_s[1] == pytest.approx(t)  # the plan's NIC queue is unchanged


def test_a_flow_counts_as_left_once_its_buffer_holds_the_rest_but_its_connection_stays_busy():
    """`Flow.sent_below`: 10 bytes at 1 byte/s with 4 buffered: a flow waiting for it to have left starts at 6, one
    queued behind it on the same connection at 10; a flow the buffer takes whole counts as left at once."""
    flows = [Flow(0, 0, 10.0, 0.0, ("L",), queue="c", sent_below=4.0),
             Flow(1, 1, 1.0, 0.0, ("M",), after_sent=(0,)),
             Flow(2, 2, 1.0, 0.0, ("L",), queue="c"),
             Flow(3, 3, 3.0, 0.0, ("N",), sent_below=4.0),
             Flow(4, 4, 1.0, 0.0, ("P",), after_sent=(3,))]
    span = run_flows(flows, {"L": 1.0, "M": 1.0, "N": 1.0, "P": 1.0})
    assert span[1] == pytest.approx((6.0, 7.0)) and span[0] == pytest.approx((0.0, 10.0))
    assert span[2] == pytest.approx((10.0, 11.0))
    assert span[4] == pytest.approx((0.0, 1.0)) and span[3] == pytest.approx((0.0, 3.0))


@pytest.mark.parametrize("buffer_fraction", [0.25, 2.0])
def test_device_order_with_a_send_buffer_goes_on_once_the_buffer_holds_the_rest(buffer_fraction):
    """`simulate(send_buffer_bytes=)` (gloo ends a send once the socket's buffer holds the rest): device 0's second
    send, a synchronous one for the MPI engine (it starts at t), starts once a quarter of the first is left to go,
    sharing the NIC from then (t - t/4 alone, then both at half rate: the first ends at t + t/4); a buffer as large
    as the message lets it start at once."""
    elements = 4 * SYNC_SEND_BYTES // 4
    cluster = Cluster(devices_per_host=2, latency_us=0.0, overhead_us=0.0)
    p = ReshardingProblem(shape=(elements, 1, 1), dtype="int32", cluster=cluster,
                          src=Placement(mesh=DeviceMesh(shape=(1, 1), devices=(0,)), spec="R R R"),
                          dst=Placement(mesh=DeviceMesh(shape=(2, 1), devices=(2, 4)), spec="R R R"))
    ops = [Operation(id=i, task=i, kind="send", src=0, dsts=(2 + 2 * i,), region=full(p)) for i in range(2)]
    t = p.nbytes / GBPS10
    assert simulate(ops, p, "device-order").op_start_s[1] == pytest.approx(t)
    result = simulate(ops, p, "device-order", send_buffer_bytes=buffer_fraction * p.nbytes)
    if buffer_fraction < 1:
        assert result.op_start_s[1] == pytest.approx(0.75 * t) and result.op_end_s[0] == pytest.approx(1.25 * t)
    else:
        assert result.op_start_s[1] == 0.0 and result.op_end_s[0] == pytest.approx(2 * t)
    assert result.op_end_s[1] == pytest.approx(2 * t)
    assert simulate(ops, p, "host-order", send_buffer_bytes=p.nbytes).op_start_s[1] == pytest.approx(t)  # the plan's queue


def test_a_send_buffer_inside_a_host_counts_in_core_microseconds_and_bad_sizes_are_refused():
    """With the CPU modelled a message inside a host is CPU work at both ends (core microseconds), so the buffer is too:
    device 0's second send (to another peer, a new run) starts once a quarter of the first's copying is left (0.75 t,
    t the first alone at one core per end). A buffer that is not a positive number is refused."""
    from xmesh_plan.schemas import Cpu

    elements = SYNC_SEND_BYTES  # 4 x SYNC_SEND_BYTES bytes of int32: a synchronous send for the MPI engine
    cluster = Cluster(devices_per_host=4, latency_us=0.0, overhead_us=0.0, cpu=Cpu(cores=4, copy_gbps=8, message_us=0))
    p = ReshardingProblem(shape=(elements, 1, 1), dtype="int32", cluster=cluster,
                          src=Placement(mesh=DeviceMesh(shape=(1, 1), devices=(0,)), spec="R R R"),
                          dst=Placement(mesh=DeviceMesh(shape=(2, 1), devices=(1, 2)), spec="R R R"))
    ops = [Operation(id=i, task=i, kind="send", src=0, dsts=(1 + i,), region=full(p)) for i in range(2)]
    t = p.nbytes / 1e9  # 8 Gbit/s of copying per core
    assert simulate(ops, p, "device-order").op_start_s[1] == pytest.approx(t)
    assert simulate(ops, p, "device-order", send_buffer_bytes=p.nbytes / 4).op_start_s[1] == pytest.approx(0.75 * t)
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="send_buffer_bytes=.*give a positive number of bytes"):
            simulate(ops, p, "device-order", send_buffer_bytes=bad)


def test_posted_messages_on_one_connection_go_in_the_order_they_are_ready():
    """Posted, device 1 forwards a broadcast to device 2 once it has arrived (at t) and also sends its
    own message to device 2, ready at once and later in the plan: over their one connection the ready
    one goes first (ends at t), the relayed one after it (ends at 2t); in plan order it would wait to 3t."""
    p = one_gpu_hosts()
    t = p.nbytes / GBPS10
    ops = [Operation(id=0, task=0, kind="broadcast", src=0, dsts=(1, 2), region=full(p), chunks=1),
           Operation(id=1, task=1, kind="send", src=1, dsts=(2,), region=full(p))]
    result = simulate(ops, p, "posted")
    assert result.op_end_s[1] == pytest.approx(t) and result.op_end_s[0] == pytest.approx(2 * t)


def test_device_order_frees_a_chain_head_before_the_tail():
    """A device's next operation waits for its own part of a broadcast (its last chunk sent), not for
    the chain's tail: the head's next send starts at t, while the 3-hop chain ends at t + 2t/K + 3L."""
    p = one_gpu_hosts(latency_us=50.0)
    t, chunks = p.nbytes / GBPS10, 4
    ops = [Operation(id=0, task=0, kind="broadcast", src=0, dsts=(1, 2, 3), region=full(p), chunks=chunks),
           Operation(id=1, task=1, kind="send", src=0, dsts=(4,), region=full(p))]
    result = simulate(ops, p, "device-order")
    assert result.op_end_s[0] == pytest.approx(t + 2 * t / chunks + 3 * 50e-6)
    assert result.op_start_s[1] == pytest.approx(t)
    assert result.op_end_s[1] == pytest.approx(2 * t + 50e-6)


def test_overhead_keeps_the_link_busy():
    """Two one-element sends in a row on one NIC, each with 0.5 s of overhead: the second ends after both."""
    p = one_gpu_hosts(overhead_us=0.5e6)
    ops = [Operation(id=i, task=i, kind="send", src=0, dsts=(1,), region=((0, 1),) * 3) for i in range(2)]
    result = simulate(ops, p, "host-order")
    assert result.op_end_s[1] == pytest.approx(2 * (0.5 + 4 / GBPS10))


def two_sends_from_one_host(discipline: str, one_device: bool = False) -> tuple[float, float, float]:
    """Devices 0 and 1 of host 0 (or device 0 twice) each send the whole tensor to a different host."""
    cluster = Cluster(devices_per_host=2, latency_us=0.0, overhead_us=0.0)
    p = ReshardingProblem(shape=(1024, 1024, 64), dtype="int32", cluster=cluster,
                          src=Placement(mesh=DeviceMesh(shape=(1, 2), devices=(0, 1)), spec="R R R"),
                          dst=Placement(mesh=DeviceMesh(shape=(2, 1), devices=(2, 4)), spec="R R R"))
    ops = [Operation(id=0, task=0, kind="send", src=0, dsts=(2,), region=full(p)),
           Operation(id=1, task=1, kind="send", src=0 if one_device else 1, dsts=(4,), region=full(p))]
    result = simulate(ops, p, discipline)
    return result.op_end_s[0], result.op_end_s[1], p.nbytes / GBPS10


def test_two_tasks_on_one_nic_share_it_fairly_when_devices_run_freely():
    first, second, t = two_sends_from_one_host("device-order")
    assert first == pytest.approx(2 * t) and second == pytest.approx(2 * t)


def test_two_tasks_on_one_nic_run_one_after_the_other_in_host_order():
    first, second, t = two_sends_from_one_host("host-order")
    assert first == pytest.approx(t) and second == pytest.approx(2 * t)


def test_posted_operations_share_the_nic_even_from_one_device():
    """The MPI and torch engines post every operation at once: no queue per NIC side or per device."""
    first, second, t = two_sends_from_one_host("posted", one_device=True)
    assert first == pytest.approx(2 * t) and second == pytest.approx(2 * t)
    first, second, t = two_sends_from_one_host("device-order", one_device=True)
    assert first == pytest.approx(t) and second == pytest.approx(2 * t)


def test_unknown_discipline_names_the_choices():
    with pytest.raises(ValueError, match="host-order, device-order, posted"):
        two_sends_from_one_host("fifo")


def test_max_min_fair_rates():
    """x (capacity 1) carries A and B; y (capacity 2) carries A and C: A and B get 0.5, C the rest."""
    flows = [Flow(0, 0, 1.0, 0.0, ("x", "y")), Flow(1, 1, 1.0, 0.0, ("x",)), Flow(2, 2, 1.0, 0.0, ("y",))]
    assert max_min_rates(flows, {"x": 1.0, "y": 2.0}) == {0: 0.5, 1: 0.5, 2: 1.5}


def test_a_flow_speeds_up_when_its_competitor_finishes():
    """Flows of 1 and 3 bytes on one link of 1 B/s: the short one ends at 2 s, the long one at 4 s."""
    spans = run_flows([Flow(0, 0, 1.0, 0.0, ("x",)), Flow(1, 1, 3.0, 0.0, ("x",))], {"x": 1.0})
    assert spans[0][1] == pytest.approx(2.0) and spans[1][1] == pytest.approx(4.0)


def test_dependencies_delay_a_flow():
    """Flow 1 needs flow 0's data (sent at 2 s, arrived 0.5 s later); flow 2 only queues behind it on x."""
    flows = [Flow(0, 0, 2.0, 0.5, ("x",)), Flow(1, 1, 1.0, 0.0, ("y",), after=(0,)), Flow(2, 2, 1.0, 0.25, ("x",), after_sent=(0,))]
    spans = run_flows(flows, {"x": 1.0, "y": 1.0})
    assert spans[0] == pytest.approx((0.0, 2.5))
    assert spans[1] == pytest.approx((2.5, 3.5))
    assert spans[2] == pytest.approx((2.0, 3.25))


def test_a_long_run_of_empty_messages_queued_on_one_link_finishes():
    """Empty messages leave at once and release the next in line: 5,000 of them, then one real one."""
    flows = [Flow(i, i, 0.0, 1e-3, ("x",), after_sent=(i - 1,) if i else ()) for i in range(5000)]
    flows.append(Flow(5000, 5000, 2.0, 0.0, ("x",), after_sent=(4999,)))
    spans = run_flows(flows, {"x": 1.0})
    assert spans[4999] == pytest.approx((0.0, 1e-3)) and spans[5000] == pytest.approx((0.0, 2.0))


@pytest.mark.parametrize("discipline", ["host-order", "posted"])
def test_ring_allgather_waits_for_its_parts_and_takes_n_minus_1_steps(discipline):
    cluster = Cluster(devices_per_host=4, latency_us=0.0, overhead_us=0.0, intra_host_gbps=80.0)
    p = ReshardingProblem(shape=(4, 1024, 1024), dtype="int32", cluster=cluster,
                          src=Placement(mesh=DeviceMesh(shape=(1, 1), devices=(0,)), spec="R R R"),
                          dst=Placement(mesh=DeviceMesh(shape=(1, 4), devices=(4, 5, 6, 7)), spec="R R R"))
    parts = tuple(((i, i + 1), (0, 1024), (0, 1024)) for i in range(4))
    sends = [Operation(id=i, task=0, kind="send", src=0, dsts=(4 + i,), region=parts[i]) for i in range(4)]
    gather = Operation(id=4, task=0, kind="allgather", src=None, dsts=(4, 5, 6, 7), region=full(p), parts=parts)
    result = simulate(sends + [gather], p, discipline)
    part_bytes = 1024 * 1024 * 4
    sent = 4 * part_bytes / GBPS10  # the four sends share host 1's receive side
    assert result.op_start_s[4] == pytest.approx(sent)
    assert result.makespan_s == pytest.approx(sent + 3 * part_bytes / (80e9 / 8))


def case(src_spec, dst_spec, src_mesh=(2, 4), dst_mesh=(2, 4)):
    def mesh(shape, first):
        return DeviceMesh(shape=shape, devices=tuple((first + h) * 4 + g for h in range(shape[0]) for g in range(shape[1])))
    return ReshardingProblem(shape=(1024, 1024, 512), dtype="int32", src=Placement(mesh=mesh(src_mesh, 0), spec=src_spec),
                             dst=Placement(mesh=mesh(dst_mesh, src_mesh[0]), spec=dst_spec))


def test_compiled_plans_are_timed_by_the_simulator_and_still_verify():
    plan = compile_plan(case("R S0 R", "S0 R R"))
    assert plan.solver.details["timed_by"].startswith("simulator")
    assert plan.predicted_seconds == pytest.approx(simulate_plan(plan).makespan_s, abs=1e-9)
    assert plan.lower_bound_seconds <= plan.predicted_seconds <= 1.01 * plan.lower_bound_seconds
    verify_plan(plan)


def test_alpa_send_recv_on_case3_is_six_times_ours():
    """Each destination device pulls 1 GiB: host 2 receives 4 GiB (3.44 s) in the ideal case, and
    Alpa's device order queues it further; ours receives 1 GiB per host in 0.86 s."""
    p = case("R S0 R", "S0 R R")
    ours = compile_plan(p).predicted_seconds
    assert baseline_seconds(p, "alpa-send-recv") == pytest.approx(6 * ours, rel=0.01)
    assert baseline_seconds(p, "alpa-allgather") > 1.4 * ours


def test_baseline_operations_deliver_every_byte():
    """Wrapping Alpa's operations in our plan record, the verifier accepts them."""
    p = case("R S0 R", "R R S0")
    plan = compile_plan(p, strategy="send_recv")
    for build in (alpa_send_recv, alpa_allgather):
        ops = build(p)
        timed = simulate(ops, p, "device-order")
        # Alpa numbers its own tasks; file every operation under one of the plan's tasks so the record is consistent
        ops = [o.model_copy(update={"start_s": timed.op_start_s[o.id], "end_s": timed.op_end_s[o.id], "task": plan.tasks[0].id})
               for o in ops]
        ops.sort(key=lambda o: (o.start_s, o.id))  # a plan lists operations in execution order
        verify_plan(plan.model_copy(update={"operations": tuple(ops), "predicted_seconds": timed.makespan_s}))


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="alpa-send-recv"):
        baseline_seconds(case("S0 R R", "S0 R R"), "nccl")
    with pytest.raises(ValueError, match="host-order"):
        simulate([], case("S0 R R", "S0 R R"), "random-order")
    assert set(BASELINES) == {"alpa-send-recv", "alpa-allgather", "rank0-gather-broadcast", "per-rank-broadcast",
                              "checkpoint-engine-broadcast"}


def test_two_nics_stripe_a_message_and_halve_its_time():
    p = one_gpu_hosts()
    p2 = p.model_copy(update={"cluster": p.cluster.model_copy(update={"nics": (p.cluster.nics[0],) * 2})})
    op = Operation(id=0, task=0, kind="send", src=0, dsts=(1,), region=full(p))
    assert simulate([op], p2).makespan_s == pytest.approx(simulate([op], p).makespan_s / 2, rel=1e-9)
    assert simulate([op], p2, nic_of_task={0: 1}).makespan_s == pytest.approx(simulate([op], p).makespan_s, rel=1e-9)


@pytest.mark.parametrize("discipline", ["host-order", "device-order", "posted"])
@pytest.mark.parametrize("nics,pooled", [(2, True), (4, True), (8, True), (3, False)])
def test_alike_nics_pooled_into_one_side_time_every_operation_as_the_stripes_do_bit_for_bit(monkeypatch, discipline, nics, pooled):
    """A weight sync's plan on hosts of several alike NICs, simulated with each host's NICs pooled (one flow per
    message) and striped (one per NIC): the same start and end of every operation, to the last bit."""
    layout = Layout("toy", "2x2", "2x2", devices_per_host=2, nic_gbps=100.0, latency_us=5.0, nics=nics)
    p = build_transfer(tomllib.loads(weight_sync_toml("toy", TOY, layout)))
    plan = compile_plan(p, solver="greedy")
    assert simulator.pooled_nics(p.cluster) is pooled
    together = simulate(plan.operations, p, discipline)
    monkeypatch.setattr(simulator, "pooled_nics", lambda cluster: False)
    striped = simulate(plan.operations, p, discipline)
    assert together.op_start_s == striped.op_start_s and together.op_end_s == striped.op_end_s
    assert together.flows < striped.flows if pooled else together.flows == striped.flows
    assert not simulator.pooled_nics(p.cluster.model_copy(update={"nics": (Nic(), Nic(send_gbps=5.0))}))


def test_a_two_nic_cluster_plan_predicts_about_half():
    p = case("R S0 R", "S0 R R")
    two = p.model_copy(update={"cluster": p.cluster.model_copy(update={"nics": (p.cluster.nics[0],) * 2})})
    one_plan, two_plan = compile_plan(p), compile_plan(two)
    assert two_plan.predicted_seconds == pytest.approx(one_plan.predicted_seconds / 2, rel=0.02)
    assert two_plan.predicted_seconds <= 1.05 * two_plan.lower_bound_seconds
    verify_plan(two_plan)


@pytest.mark.parametrize("discipline", ["host-order", "device-order", "posted"])
def test_an_allgather_starts_once_every_member_holds_its_part(discipline):
    """In the executor's orders a member may send its own part before the others have theirs, but the
    operation's start (what the verifier and the executor check holdings at) is when all parts are there."""
    p = one_gpu_hosts()
    x, rest = p.shape[0], p.shape[1:]
    half = ((0, x // 4), *((0, n) for n in rest))
    other = ((x // 4, x), *((0, n) for n in rest))
    ops = [Operation(id=0, task=0, kind="send", src=0, dsts=(1,), region=half),
           Operation(id=1, task=0, kind="send", src=0, dsts=(2,), region=other),
           Operation(id=2, task=0, kind="allgather", dsts=(1, 2), region=full(p), parts=(half, other))]
    result = simulate(ops, p, discipline)
    assert result.op_start_s[2] >= result.op_end_s[1] > result.op_end_s[0]
    assert result.op_end_s[2] > result.op_start_s[2]


def test_flows_numbered_otherwise_than_their_list_order_time_as_renumbered():
    """Per-flow state is kept in lists indexed by flow id; flows numbered otherwise are renumbered and answered by
    their own ids, timed alike. A flow waiting for one not in the list is refused (it could never start)."""
    listed = [Flow(0, 0, 2.0, 0.5, ("x",)), Flow(1, 1, 1.0, 0.0, ("y",), after=(0,)), Flow(2, 2, 1.0, 0.25, ("x",), after_sent=(0,))]
    spans = run_flows(listed, {"x": 1.0, "y": 1.0})
    ids = {0: 7, 1: 3, 2: 5}
    own = [Flow(ids[f.id], f.op, f.nbytes, f.latency_s, f.links, tuple(ids[p] for p in f.after),
                tuple(ids[p] for p in f.after_sent)) for f in listed]
    assert run_flows(own, {"x": 1.0, "y": 1.0}) == {ids[i]: span for i, span in spans.items()}
    with pytest.raises(ValueError, match="not in the list"):
        run_flows([Flow(1, 0, 1.0, 0.0, ("x",), after=(0,))], {"x": 1.0})


def test_a_flow_waiting_for_a_negative_id_is_refused_not_read_from_the_end():
    with pytest.raises(ValueError, match="not in the list"):
        run_flows([Flow(0, 0, 1.0, 0.0, ("x",)), Flow(1, 1, 1.0, 0.0, ("x",), after=(-1,))], {"x": 1.0})


def test_flows_given_out_of_id_order_time_as_in_id_order():
    """Ties between flows finishing together break by flow id, whatever the list's order: two flows ending at once
    release their dependants (sharing one queue) in id order, given in either order."""
    cap = {"a": 1.0, "b": 1.0, "c": 1.0}
    flows = [Flow(1, 0, 1.0, 0.0, ("a",)), Flow(0, 0, 1.0, 0.0, ("b",)),
             Flow(2, 0, 1.0, 0.0, ("c",), after=(1,), queue="q"), Flow(3, 0, 2.0, 0.0, ("c",), after=(0,), queue="q")]
    in_order = run_flows(sorted(flows, key=lambda f: f.id), cap)
    assert run_flows(flows, cap) == in_order
    assert in_order[3] == (1.0, 3.0) and in_order[2] == (3.0, 4.0)  # flow 0 ends first by id: its dependant 3 goes first
