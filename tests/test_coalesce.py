"""`compile --coalesce`: bundles verify, are refused when broken, run bit-exact, and cut the cross-host
message count to what a brute-force count over the tensor's elements says."""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from xmesh_plan.executor.errors import PlanMismatchError
from xmesh_plan.executor.lower import lower
from xmesh_plan.executor.nccl_plan import nccl_program
from xmesh_plan.executor.ranks import plan_devices
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.verify import PlanError, verify_plan
from xmesh_plan.schemas import load_plan
from xmesh_plan.schemas.op_kinds import bundle_runs, route
from tests.support.cases import BUCKET, CELL_BYTES, CELL_ELEMENTS, all_to_all, coalesced, problem, random_problem
from tests.support.fake_mpi import simulate

ROOT = Path(__file__).resolve().parent.parent

def _host_pair_bytes(prob) -> dict[tuple[int, int], int]:
    """Brute force over every element: bytes each (holding host, needing host) pair must move, from
    numpy masks of the shards; an element is charged to the one host holding it (here each element has one)."""
    shape, host_of = prob.shape, prob.cluster.host_of
    held = np.full(shape, -1)
    for d, block in prob.blocks("src").items():
        held[tuple(slice(a, b) for a, b in block)] = host_of(d)
    out: dict[tuple[int, int], int] = {}
    for d, block in prob.blocks("dst").items():
        sub = held[tuple(slice(a, b) for a, b in block)]
        for h in np.unique(sub):
            if h != host_of(d):
                key = (int(h), host_of(d))
                out[key] = out.get(key, 0) + int((sub == h).sum()) * prob.itemsize
    return out


def _cross_host_sends(plan) -> dict[int, int]:
    """Cross-host send steps per sending host, from every device's lowered program."""
    host_of, out = plan.problem.cluster.host_of, {}
    for d in plan_devices(plan):
        for s in lower(plan, d).steps:
            if s.action == "send" and host_of(s.peer) != host_of(d):
                out[host_of(d)] = out.get(host_of(d), 0) + 1
    return out


def test_all_to_all_bundles_verify_and_send_one_message_per_bundle():
    prob = all_to_all()
    plan = coalesced(prob)
    verify_plan(plan)
    assert "bundle" in {op.kind for op in plan.operations}
    pair_bytes = _host_pair_bytes(prob)
    expected: dict[int, int] = {}
    for (h, _), nbytes in pair_bytes.items():  # the host pair's bytes in bundles of at most BUCKET (every cell is CELL_BYTES)
        expected[h] = expected.get(h, 0) + math.ceil(nbytes / BUCKET)
    assert _cross_host_sends(plan) == expected
    plain = compile_plan(prob, solver="greedy", seed=0)
    assert max(_cross_host_sends(plain).values()) == max(pair_bytes_per_host(pair_bytes).values()) // CELL_BYTES
    assert max(expected.values()) < max(_cross_host_sends(plain).values())


def pair_bytes_per_host(pair_bytes):
    out: dict[int, int] = {}
    for (h, _), nbytes in pair_bytes.items():
        out[h] = out.get(h, 0) + nbytes
    return out


def test_same_input_gives_a_byte_identical_plan_and_plain_plans_have_no_bundle_fields():
    assert coalesced(all_to_all()).to_json() == coalesced(all_to_all()).to_json()
    plain = compile_plan(all_to_all(), solver="greedy", seed=0).to_json()
    assert "holders" not in plain and "needers" not in plain and "coalesce" not in plain


def test_coalesced_plan_predicts_less_than_the_plain_one():
    prob = all_to_all()
    assert coalesced(prob, bucket=2**20).predicted_seconds < compile_plan(prob, solver="greedy", seed=0).predicted_seconds


def _first_bundle(plan):
    return next(op for op in plan.operations if op.kind == "bundle")


def _mutated(plan, update):
    """The plan with its first bundle changed by `update(op)`."""
    ops = list(plan.operations)
    k = ops.index(_first_bundle(plan))
    ops[k] = ops[k].model_copy(update=update(ops[k]))
    return plan.model_copy(update={"operations": tuple(ops)})


def test_a_dropped_part_is_refused_naming_the_operation():
    plan = coalesced(all_to_all())
    op = _first_bundle(plan)
    broken = _mutated(plan, lambda op: {"parts": op.parts[1:], "holders": op.holders[1:], "needers": op.needers[1:]})
    with pytest.raises(PlanError, match=rf"destination device {op.needers[0][0]} never receives"):
        verify_plan(broken)
    short = _mutated(plan, lambda op: {"holders": op.holders[1:]})
    with pytest.raises(PlanError, match=rf"operation {op.id} .*one holder and one needers list per part"):
        verify_plan(short)


def test_a_wrong_holder_is_refused_naming_the_operation_and_device():
    plan = coalesced(all_to_all())
    op = _first_bundle(plan)
    same_host = [d for d in plan.problem.src.mesh.devices if plan.problem.cluster.host_of(d) == plan.problem.cluster.host_of(op.src)]
    other = next(d for d in same_host if d != op.holders[0])
    with pytest.raises(PlanError, match=rf"operation {op.id} .*device {other} sends .* which it does not hold"):
        verify_plan(_mutated(plan, lambda o: {"holders": (other,) + o.holders[1:]}))
    far = next(d for d in plan.problem.src.mesh.devices if plan.problem.cluster.host_of(d) != plan.problem.cluster.host_of(op.src))
    with pytest.raises(PlanError, match=rf"operation {op.id} .*holder d{far} .* is not on the host of relay"):
        verify_plan(_mutated(plan, lambda o: {"holders": (far,) + o.holders[1:]}))
    with pytest.raises(PlanError, match=rf"operation {op.id} .*needers \[{op.src}\]"):
        verify_plan(_mutated(plan, lambda o: {"needers": ((o.src,),) + o.needers[1:]}))


@pytest.mark.parametrize("order", ["posted", "device"])
@pytest.mark.parametrize("dtype", ["int32", "bfloat16", "complex128"])
def test_all_to_all_runs_bit_exact(order, dtype):
    prob = all_to_all(dtype)
    plan = coalesced(prob, bucket=12 * CELL_ELEMENTS * prob.itemsize)  # bundles of 12 cells and of 4
    assert any(op.kind == "bundle" for op in plan.operations)
    out = simulate(plan, iterations=2, order=order)
    assert set(out) == set(plan.problem.blocks("dst"))


def test_random_problems_include_bundles():
    kinds = [{op.kind for op in coalesced(random_problem(seed, max_devices=9, exact=False), bucket=2048).operations} for seed in range(40)]
    assert sum("bundle" in k for k in kinds) >= 10


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), devices=st.integers(2, 9), bucket=st.sampled_from([64, 512, 2048, 8192]))
def test_random_coalesced_plans_verify_and_run_bit_exact(seed, devices, bucket):
    plan = coalesced(random_problem(seed, max_devices=devices, exact=False), bucket=bucket)
    verify_plan(plan)
    simulate(plan, iterations=2)


def test_the_nccl_program_sends_each_message_of_a_bundle_as_a_broadcast_in_a_group_of_two():
    """Every message of every bundle's route (`op_kinds.route`), and nothing else, is one broadcast in the group of
    its two devices rooted at its sender, on both devices, with the message's bytes."""
    from xmesh_plan.executor.lower import StagedCall

    plan = coalesced(all_to_all())
    itemsize = plan.problem.itemsize
    want = {(op.id, tuple(sorted((h.src, h.dst))), h.src, h.elements * itemsize) for op in plan.operations if op.kind == "bundle"
            for h in route(op) if h.src != h.dst and h.elements}
    seen = defaultdict(set)
    for device in plan_devices(plan):
        for call in nccl_program(lower(plan, device)).actions:
            if isinstance(call, StagedCall) and call.action == "bcast":
                seen[(call.op, call.group, call.root, call.stop - call.start)].add(device)
    assert set(seen) == want
    assert all(devices == set(key[1]) for key, devices in seen.items())


def small_all_to_all(dtype: str = "int32"):
    """2 hosts of 4 devices, 8 ranks: devices 0,1,4,5 -> 2,3,6,7, every source device sends to every destination device."""
    return problem("a2a8", (16, 16, 8), (2, 2), (0, 1, 4, 5), "S0 R S1", (2, 2), (2, 3, 6, 7), "R S01 R", dtype=dtype, devices_per_host=4)


@pytest.mark.mpi
def test_a_coalesced_plan_runs_bit_exact_under_mpiexec(tmp_path):
    from tests.support.launch import EXECUTOR_WORKER as WORKER, MPIEXEC, mpiexec
    from tests.support.cases import write_plans
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec at {MPIEXEC}")
    plans = [coalesced(small_all_to_all(dtype), bucket=2**16) for dtype in ("int32", "bfloat16")]
    assert all("bundle" in {op.kind for op in plan.operations} for plan in plans)  # and sends inside each host
    result = mpiexec(8, str(WORKER), "check", *write_plans(tmp_path, plans))
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ok ") == len(plans), result.stdout


@pytest.mark.slow
@pytest.mark.timeout(800)
def test_a_coalesced_plan_runs_bit_exact_on_the_torch_engine_matching_by_order(tmp_path):
    """Gloo matches each pair's messages in posting order (every tag 0), as NCCL would: a bundle's
    scatter runs to one needer must be posted in the same order at both ends."""
    from tests.support.cases import write_plans
    from tests.support.launch import launch
    plans = [coalesced(small_all_to_all(dtype), bucket=2**16) for dtype in ("int32", "bfloat16")]
    assert any(len({d for d, _ in bundle_runs(op)[1]}) < len(bundle_runs(op)[1]) for op in plans[0].operations if op.kind == "bundle")
    lines = launch(8, "check_by_order", *write_plans(tmp_path, plans))
    ours = [line for line in lines if line.startswith("rank 0:")]
    assert len(ours) == len(plans) and all(line.endswith((": ok", ": ok (our boxes)")) for line in ours), lines


def test_two_nics_and_split_hosts_combine_with_coalesce():
    from xmesh_plan.schemas.problem import Nic
    prob = all_to_all()
    two = prob.model_copy(update={"cluster": prob.cluster.model_copy(update={"nics": (Nic(), Nic(send_gbps=5, recv_gbps=5))})})
    for plan in (coalesced(two), coalesced(prob, split_hosts=True)):
        verify_plan(plan)
        assert "bundle" in {op.kind for op in plan.operations}
        simulate(plan, iterations=1)


def test_the_cli_compiles_with_coalesce_for_one_tensor_and_for_a_transfer(tmp_path):
    from click.testing import CliRunner
    from xmesh_plan.planner.cli import main
    out = tmp_path / "a2a.plan.json"
    result = CliRunner().invoke(main, ["compile", "--shape", "16,16,8", "--src-mesh", "2x2", "--src-spec", "S0 R S1", "--dst-mesh", "2x2",
                                       "--dst-spec", "R S01 R", "--coalesce", "--bucket-mb", "0.0625", "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    verify_plan(plan)
    assert "bundle" in {op.kind for op in plan.operations}
    assert plan.solver.details["coalesce"] == "bundles of at most 65536 B"
    out = tmp_path / "ws.plan.json"
    result = CliRunner().invoke(main, ["compile", "plans/weight_sync_small.problem.toml", "--split-hosts", "--coalesce", "-o", str(out)])
    assert result.exit_code == 0, result.output
    plan = load_plan(out)
    verify_plan(plan)
    bundles = [op for op in plan.operations if op.kind == "bundle"]
    assert bundles and len({op.tensor for op in bundles}) > 1  # every tensor's small boxes bundled, a bundle per tensor


def _weight_sync(**options):
    from xmesh_plan.planner.transfer_io import load_any_problem
    return compile_plan(load_any_problem(ROOT / "plans" / "weight_sync_small.problem.toml"), solver="greedy", **options)


def test_coalescing_a_transfer_sends_fewer_cross_host_messages_and_predicts_less():
    """Each receiving host gets its boxes of a tensor from a sending host in a few bundles, not box by box."""
    plain, packed = _weight_sync(split_hosts=True, coalesce=False), _weight_sync(split_hosts=True, coalesce=True)
    host = plain.problem.cluster.host_of

    def cross_messages(plan):
        from xmesh_plan.schemas.op_kinds import route
        return sum(host(h.src) != host(h.dst) for op in plan.operations for h in route(op))

    assert cross_messages(packed) < cross_messages(plain) / 2
    assert packed.predicted_seconds < plain.predicted_seconds


def test_small_boxes_needed_on_several_hosts_are_cut_per_host_and_bundled_large_ones_stay_chained():
    """The small weight sync without --split-hosts: norms and small shards go to both TP replicas' hosts."""
    from xmesh_plan.planner.coalesce import SMALL_FRACTION, coalesce_cells
    from xmesh_plan.planner.unit_tasks import decompose
    plain, packed = _weight_sync(split_hosts=False, coalesce=False), _weight_sync(split_hosts=False, coalesce=True)
    verify_plan(packed)
    host = packed.problem.cluster.host_of
    bucket = 4 * 2**20
    for single in packed.problem.tensor_problems():
        cells = [c for c in decompose(single) if c.receivers]
        rest, bundles = coalesce_cells(cells, single, bucket)
        bundled = {(part, d) for b in bundles for part, needers in zip(b.parts, b.needers) for d in needers}
        for cell in cells:
            small = cell.nbytes(single.itemsize) * SMALL_FRACTION <= bucket and len({host(d) for d in cell.senders}) == 1
            if small and not cell.local_copies:  # every receiver gets it from a bundle
                assert all((cell.region, d) in bundled for d in cell.receivers), cell
            else:
                assert cell in rest
    assert len(packed.operations) < len(plain.operations)


@pytest.mark.mpi
@pytest.mark.timeout(600)
def test_a_coalesced_transfer_runs_bit_exact_under_mpiexec(tmp_path):
    """`executor.run --check` on the small weight sync compiled with --split-hosts --coalesce (every op a bundle)."""
    from tests.support.launch import MPIEXEC, run_demo
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec at {MPIEXEC}")
    plan = _weight_sync(split_hosts=True, coalesce=True)
    assert {op.kind for op in plan.operations} == {"bundle"}
    path = tmp_path / "ws.plan.json"
    path.write_text(plan.to_json())
    result = run_demo(8, path, "--check", "--iters", "2", "--warmup", "1", timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "check ok: 21 tensors x 4 destination shards bit-exact" in result.stdout, result.stdout


@pytest.mark.parametrize("cells_per_bundle", [8, 9, 12, 16, 40])
def test_bundles_hold_every_small_cross_host_cell_once_and_stay_within_the_bucket(cells_per_bundle):
    from xmesh_plan.planner.coalesce import coalesce_cells
    from xmesh_plan.planner.unit_tasks import decompose
    prob = all_to_all()
    bucket = cells_per_bundle * CELL_BYTES
    cells = decompose(prob)
    rest, bundles = coalesce_cells(cells, prob, bucket)
    host = prob.cluster.host_of
    cross = sorted(c.region for c in cells if host(c.senders[0]) != host(c.receivers[0]))
    assert sorted(p for b in bundles for p in b.parts) == cross
    assert sorted(c.region for c in rest) == sorted(c.region for c in cells if host(c.senders[0]) == host(c.receivers[0]))
    assert all(b.nbytes(prob.itemsize) <= bucket for b in bundles)
    assert len(bundles) == 12 * math.ceil(16 / cells_per_bundle)  # 12 host pairs of 16 cells each
    assert coalesce_cells(cells, prob, 7 * CELL_BYTES)[1] == []  # cells above 1/8 of the bucket go on their own


def test_a_bundle_holds_its_nic_sides_for_its_overhead_and_bytes_not_its_latency_or_scatter():
    """The bundle's message keeps the two NIC sides busy for the overhead and its bytes; its latency and then the
    receiving relay's scatter to the other needers (its messages as the simulator times them) delay the bundle's end, not the NICs (the simulator's flows: a link
    carries the next message while one is in flight), so the schedule can start the next message on a side when this
    one's last byte has left."""
    from xmesh_plan.planner.coalesce import bundle_result, coalesce_cells, relays
    from xmesh_plan.planner.unit_tasks import decompose
    from xmesh_plan.schemas.geometry import region_size
    prob = all_to_all()
    cluster = prob.cluster
    _, bundles = coalesce_cells(decompose(prob), prob, BUCKET)
    for index, bundle in enumerate(bundles[:4]):
        result, option = bundle_result(bundle, index, prob)
        relay = relays(bundle, index)[1]
        scattered = sum(region_size(part) * prob.itemsize for part, needers in zip(bundle.parts, bundle.needers)
                        for d in needers if d != relay)
        assert scattered > 0
        needed = [[i for i, needers in enumerate(bundle.needers) if d in needers] for d in bundle.receivers if d != relay]
        messages = sum(1 + sum(b != a + 1 for a, b in zip(mine, mine[1:])) for mine in needed)  # runs of consecutive parts
        # the message's latency, then the relay's port scatters (one overhead per message), the last arriving a latency later
        tail = cluster.latency_s + messages * cluster.overhead_s + scattered / cluster.intra_bytes_per_s + cluster.latency_s
        assert option.tail_s == result.tail_s == result.ops[0].tail_s == pytest.approx(tail, rel=1e-12)
        assert option.busy_s == pytest.approx(cluster.overhead_s + bundle.nbytes(prob.itemsize) / cluster.message_bytes_per_s,
                                              rel=1e-9)
        assert option.duration_s == result.duration_s == result.ops[0].duration_s == pytest.approx(option.busy_s + tail)


def _nic_work_s(plan) -> float:
    """The most time any NIC side is busy with the plan's messages (overhead and bytes, a shared message once), from
    the simulator's flows in host order: no timing of the plan can end before it."""
    from xmesh_plan.planner.simulate import lower as lower_flows, nic_assignment
    lowering, _ = lower_flows(plan.operations, plan.problem, "host-order", nic_assignment(plan.host_order))
    busy: dict[str, float] = defaultdict(float)
    for flow in lowering.flows:
        for link in flow.links:
            if link.startswith("h"):
                busy[link] += flow.work / lowering.capacity[link]
    return max(busy.values())


@pytest.mark.parametrize("name", ["weight_sync_small", "weight_sync_deepseek_v3"])
def test_a_plan_timed_by_its_schedule_keeps_every_nic_side_busy_no_shorter_than_its_messages(monkeypatch, name):
    """Where the schedule times a plan (too many messages to simulate), its shared messages are replayed on the NIC
    sides (`coalesce.retimed_on_nics`): a shared message starts at its head bundle's turn and carries every rider's
    bytes, so the plan cannot end before its busiest NIC side has moved them all; the plan still verifies. (Timed at
    each bundle's own place, a 2-layer DeepSeek-V3-like cut was timed at 0.998x its byte bound while its busiest
    side's messages took 1.028x.)"""
    import tomllib
    import xmesh_plan.planner.compile as compile_module
    from bench.bench_frontier import problem_text
    from xmesh_plan.planner.transfer_io import build_transfer
    monkeypatch.setattr(compile_module, "MAX_SIMULATED_MESSAGES", 0)
    prob = build_transfer(tomllib.loads(problem_text(name, 2 if name != "weight_sync_small" else 0)))
    plan = compile_plan(prob)
    assert plan.solver.details["timed_by"].startswith("schedule")
    assert any(op.carrier is not None for op in plan.operations)
    assert plan.predicted_seconds >= _nic_work_s(plan) + prob.cluster.latency_s - 1e-12
    verify_plan(plan)


def test_a_transfers_bundle_messages_spread_their_relays_over_the_hosts_devices():
    """A relay gathers or scatters its message's parts through one device port, slower than the host's NICs together,
    so the cross-host messages into a host must not all scatter from one device (`coalesce._balanced_relays`). On a
    2-layer DeepSeek-V3-like cut, with each message from its first bundle's relays, device 256 scattered 5.6 times
    the mean of the destination devices; spread, the busiest scatters at most a quarter more than the mean, and the
    busiest sending relay gathers at most that much more too."""
    import tomllib
    from bench.bench_frontier import problem_text
    from xmesh_plan.planner.inspect_plan import relay_load
    from xmesh_plan.planner.transfer_io import build_transfer
    prob = build_transfer(tomllib.loads(problem_text("weight_sync_deepseek_v3", 2)))
    load = relay_load(compile_plan(prob))
    assert load.busiest_out[1] <= 1.25 * load.scattered / len(prob.dst_mesh.devices)
    assert load.busiest_in[1] <= 1.25 * load.gathered / len(prob.src_mesh.devices)


def test_a_bundle_sent_between_balanced_relays_has_its_receiving_relays_scatter_as_its_tail(monkeypatch):
    """`_balanced_relays` may give a shared message another receiving relay than its bundles' own: each bundle's tail
    is then the latency and that relay's scatter (one overhead per message it sends, one latency after the last), as
    `bundle_result` states it for its own (a 2-layer
    Llama-3-70B-like cut: 32 of 128 messages kept their first relay's tail, up to 3.7% off)."""
    import math
    import tomllib

    from bench.bench_frontier import problem_text
    from xmesh_plan.planner import coalesce, compile as compile_module
    from xmesh_plan.planner.transfer_io import build_transfer

    problem = build_transfer(tomllib.loads(problem_text("weight_sync_llama3_70b", 2)))
    itemsizes = [p.itemsize for p in problem.tensor_problems()]
    cluster = problem.cluster
    seen = []
    replay = coalesce.retimed_on_nics

    def checked(groups, timing, host_of):
        for group in groups:
            if group[0][3].kind != "bundle":
                continue
            relay = group[0][3].dsts[0]
            share = sum(math.prod(b - a for a, b in part) * sum(1 for d in needers if d != relay) * itemsizes[tensor or 0]
                        for _, _, tensor, op in group for part, needers in zip(op.parts, op.needers))
            needs = [needers for _, _, _, op in group for needers in op.needers]
            others = list(dict.fromkeys(d for needers in needs for d in needers if d != relay))
            if len(group) > 1:  # a shared message scatters one message per needer
                messages = len(others)
            else:  # a bundle alone one per run of consecutive parts
                mine = [[i for i, needers in enumerate(needs) if d in needers] for d in others]
                messages = sum(1 + sum(b != a + 1 for a, b in zip(m, m[1:])) for m in mine)
            scatter = messages * cluster.overhead_s + share / cluster.intra_bytes_per_s + cluster.latency_s if messages else 0.0
            seen.append(math.isclose(group[0][3].tail_s, cluster.latency_s + scatter, rel_tol=1e-9, abs_tol=1e-15))
        return replay(groups, timing, host_of)

    monkeypatch.setattr(compile_module, "retimed_on_nics", checked)
    monkeypatch.setattr(compile_module, "MAX_SIMULATED_MESSAGES", 0)
    compile_module.compile_rows(problem)
    assert seen and all(seen), f"{seen.count(False)} of {len(seen)} messages with another relay's scatter as their tail"


@pytest.mark.parametrize("seed", [2, 128])
def test_a_schedule_timed_plan_states_no_proven_bound_above_its_predicted_time(seed, monkeypatch):
    """A plan timed by the schedule's timetable (`coalesce.retimed_on_nics` moves tasks by their NIC sides) states a
    proven bound no later than its own predicted time: seed 2 has shared messages, seed 128 none (the timetable moved
    a task ahead of one still holding its device port, which the solver's bound counts)."""
    import xmesh_plan.planner.compile as compile_module
    from tests.support.transfer import random_transfer

    monkeypatch.setattr(compile_module, "MAX_SIMULATED_MESSAGES", 0)
    plan = compile_plan(random_transfer(seed, 16))
    assert plan.solver.details["timed_by"].startswith("schedule")
    stated = round(plan.solver.proven_bound_seconds, compile_module.DIGITS)  # the prediction is rounded to DIGITS
    assert plan.lower_bound_seconds <= stated <= plan.predicted_seconds


def test_the_gap_to_the_proven_bound_is_measured_against_the_bound_the_plan_states():
    """`shared_bound` lowers the stated bound below the solver's for shared messages: the details' gap is the winning
    schedule's makespan over the bound the plan states (random_transfer seed 2: 3%, against the solver's 0.007%)."""
    from tests.support.transfer import random_transfer

    plan = compile_plan(random_transfer(2, 16))
    details = plan.solver.details
    makespan = float(dict(c.split("=") for c in details["candidates"].split())[details["winner"]])
    assert float(details["gap_to_proven_bound"]) == pytest.approx(makespan / plan.solver.proven_bound_seconds - 1, abs=1e-4)
    assert float(details["gap_to_proven_bound"]) > 0.01


def test_planned_op_sent_is_replace_with_every_other_field_kept():
    """`PlannedOp.sent` changes the route and times and keeps every other field (a field added to PlannedOp and not
    carried fails here)."""
    import dataclasses

    from xmesh_plan.planner.strategies import PlannedOp

    values = {"kind": "bundle", "src": 1, "dsts": (2,), "region": ((0, 4), (0, 2)), "parts": (((0, 1), (0, 2)),),
              "chunks": 3, "offset_s": 0.5, "holders": (7,), "needers": ((8, 9),), "duration_s": 1.25, "tail_s": 0.25}
    assert set(values) == {f.name for f in dataclasses.fields(PlannedOp)}
    op = PlannedOp(**values)
    assert op.sent(5, (6, 7), 2.5, 0.75) == dataclasses.replace(op, src=5, dsts=(6, 7), duration_s=2.5, tail_s=0.75)
