"""Bundles of several tensors sharing one cross-host message (`schemas.carriers`, `compile --cross-tensor`).

What is checked, each against something other than the code under test: the plan's groups against
their definition (written out here), the messages that actually cross hosts on a fake MPI (its log,
not the lowering), every destination shard bit for bit against numpy slicing (in process, under
mpiexec and on torch/gloo), the staging each rank allocates against what the plan says, the
simulator's time against a hand formula, and the plan check against malformed groups."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from xmesh_plan.executor.lower import Action
from xmesh_plan.executor.passes import rank_program
from xmesh_plan.executor.plan_file import PlanFile
from xmesh_plan.executor.ranks import plan_devices
from xmesh_plan.executor.scale import factors_per_tensor, scale_tensors
from xmesh_plan.planner.cli import main
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.inspect_plan import plan_loads
from xmesh_plan.planner.transfer_io import build_transfer, load_any_problem
from xmesh_plan.planner.verify import verify_plan
from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.files import write_atomic
from xmesh_plan.schemas.geometry import region_size
from xmesh_plan.schemas.plan_compact import compact_bytes
from xmesh_plan.schemas.plan_check import PlanError, check_plan
from xmesh_plan.schemas.staging import staging_peaks
from tests.support.launch import MPIEXEC, run_demo, torchrun
from tests.support.transfer import assert_every_shard, fake_executors, full_tensors, random_transfer, run_everywhere

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "plans" / "weight_sync_small.problem.toml"
BUCKET = 4 * 2**20


@pytest.fixture(scope="module")
def shared() -> Plan:
    return compile_plan(load_any_problem(SMALL), solver="greedy")


@pytest.fixture(scope="module")
def separate() -> Plan:
    return compile_plan(load_any_problem(SMALL), solver="greedy", cross_tensor=False)


def _groups(plan: Plan) -> list[list]:
    """The plan's shared messages from the definition: a bundle with a carrier joins the group of the one before it."""
    out = []
    for op in plan.operations:
        if op.carrier is not None:
            assert out and out[-1][0].id == op.carrier, f"op {op.id} is not listed right after its group"
            out[-1].append(op)
        else:
            out.append([op])
    return out


def _bytes(op, plan: Plan) -> int:
    return sum(map(region_size, op.parts)) * plan.problem.tensor_problems()[op.tensor].itemsize


def _cross_host_sends(plan: Plan, log) -> int:
    """Sends between ranks on different hosts in one iteration of the fake MPI's log."""
    host = plan.problem.cluster.host_of
    devices = plan_devices(plan)
    return sum(1 for event, (a, b, _) in log if event == "send" and host(devices[a]) != host(devices[b]))


def test_the_default_compile_of_a_weight_sync_puts_small_tensors_in_shared_messages(shared, separate):
    groups = [g for g in _groups(shared) if len(g) > 1]
    assert groups and sum(map(len, groups)) > len(shared.problem.tensors)
    assert len({op.tensor for g in groups for op in g}) > 1  # pieces of several tensors in one message
    for group in groups:
        assert all(op.kind == "bundle" and (op.src, op.dsts) == (group[0].src, group[0].dsts) for op in group)
        assert sum(_bytes(op, shared) for op in group) <= BUCKET
        align = max(t.itemsize for t in shared.problem.tensor_problems())
        assert all(_bytes(op, shared) % align == 0 for op in group[:-1])
    assert not any(op.carrier is not None for op in separate.operations)
    verify_plan(shared)
    # the same bundles otherwise: only relays and grouping differ, so the bytes crossing hosts are the same
    assert plan_loads(shared).cross_host_bytes == plan_loads(separate).cross_host_bytes
    busiest = lambda plan: plan_loads(plan).busiest_messages()[2]  # noqa: E731
    assert busiest(shared) < busiest(separate) / 4


@pytest.mark.parametrize("order", ["posted", "device"])
def test_one_message_crosses_hosts_per_group_bit_exact_on_a_fake_mpi(shared, separate, order):
    """The fake MPI's log counts what crossed: one message per group instead of one per bundle; every shard
    against numpy slicing, twice (the second run overwrites the first's buffers), and each rank's staging
    is what the plan says for that order."""
    crossed = {}
    for name, plan in (("shared", shared), ("separate", separate)):
        executors = fake_executors(plan, order=order)
        world = executors[0].engine.comm.world
        for it in range(2):
            start = len(world.log)
            full = full_tensors(plan, 10 + it)
            assert_every_shard(plan, run_everywhere(plan, executors, full), full)
            crossed[name] = _cross_host_sends(plan, world.log[start:])
        peaks = staging_peaks(plan, order)
        assert {ex.device: ex.stage_bytes for ex in executors if ex.stage_bytes} == peaks
    groups = _groups(shared)
    assert crossed["shared"] == len(groups) < len(separate.operations) == crossed["separate"]


def _pairs_by_definition(group) -> dict[int, Counter]:
    """Device -> Counter of (send or recv, peer) of one shared message of two or more bundles, from the definition
    written out here: each holder other than the sending relay sends it one message, which sends one across, and
    the receiving relay sends one to each needer other than itself."""
    src, relay = group[0].src, group[0].dsts[0]
    holders = {h for op in group for h in op.holders if h != src}
    needers = {d for op in group for need in op.needers for d in need if d != relay}
    out: dict[int, Counter] = {src: Counter({("send", relay): 1}), relay: Counter({("recv", src): 1})}
    for h in holders:
        out[h] = Counter({("send", src): 1})
        out[src][("recv", h)] += 1
    for d in needers:
        out[d] = Counter({("recv", relay): 1})
        out[relay][("send", d)] += 1
    return out


@pytest.mark.parametrize("order", ["posted", "device"])
def test_a_shared_message_is_one_message_per_pair_of_devices(shared, tmp_path, order):
    """Each device's program (read from a compact file, as a rank reads its part) sends and receives exactly one
    message per pair of devices of each shared message, under the carrier's id; every send has one receive with the
    same peers, tag and size, no two messages between a pair share a tag, and every tag is one the plan owns."""
    path = tmp_path / "shared.plan.npz"
    write_atomic(path, compact_bytes(shared))
    source = PlanFile.read(path)
    groups = [g for g in _groups(shared) if len(g) > 1]
    want: dict[int, Counter] = {}
    for group in groups:
        for device, pairs in _pairs_by_definition(group).items():
            want.setdefault(device, Counter()).update({(group[0].id, action, peer): n for (action, peer), n in pairs.items()})
    members = {op.id for g in groups for op in g}
    sends, recvs = Counter(), Counter()
    for device in plan_devices(shared):
        program = rank_program(source, device, order, True, 2**20)
        messages = [s for s in program.steps if s.action.is_message and s.data.buffer != "receipt"]
        got = Counter((s.op, str(s.action), s.peer) for s in messages if s.op in members)
        assert got == want.get(device, Counter()), device
        for s in messages:
            (sends if s.action is Action.SEND else recvs)[(device, s.peer, s.tag) if s.action is Action.SEND
                                                           else (s.peer, device, s.tag), s.data.nbytes] += 1
    assert sends == recvs and max(sends.values()) == 1
    assert len({key for key, _ in sends}) == len(sends)  # a pair's messages never share a tag
    assert max(tag for (_, _, tag), _ in sends) < source.tags


def test_random_multi_tensor_plans_with_shared_messages_are_bit_exact():
    """Random tensors, dtypes and meshes with a small bucket, so groups form often: every plan that has one
    runs bit-exact in both orders, with what crossed hosts one message per group."""
    seen = 0
    for seed in range(40):
        plan = compile_plan(random_transfer(seed, 8), solver="greedy", bucket_bytes=512)
        if not any(op.carrier is not None for op in plan.operations):
            continue
        seen += 1
        verify_plan(plan)
        for order in ("posted", "device"):
            executors = fake_executors(plan, order=order)
            full = full_tensors(plan, seed)
            assert_every_shard(plan, run_everywhere(plan, executors, full), full)
    assert seen >= 5


def test_shrunk_plans_keep_shared_messages_valid():
    """The demo shrinks each tensor by its own factors (`executor.scale`), which can leave a bundle of a shared
    message a size that is no multiple of the largest element; the group is then cut there, and the shrunk
    plan checks, verifies and runs bit-exact (random mixed-dtype transfers, most with groups)."""
    cut = ran = 0
    for seed in range(40):
        plan = compile_plan(random_transfer(seed, 8), solver="greedy", bucket_bytes=512)
        if not any(op.carrier is not None for op in plan.operations):
            continue
        shrunk = scale_tensors(plan, factors_per_tensor(plan, 64))
        check_plan(shrunk)
        verify_plan(shrunk)
        cut += len(_groups(shrunk)) > len(_groups(plan))
        if ran < 4:
            ran += 1
            executors = fake_executors(shrunk, order="posted")
            full = full_tensors(shrunk, seed)
            assert_every_shard(shrunk, run_everywhere(shrunk, executors, full), full)
    assert cut >= 3


def _replicated(dst: str) -> Plan:
    """16 small tensors from host 0 (sharded over its 8 devices) to host 1, `dst` there: one shared message."""
    return compile_plan(build_transfer(
        {"name": "rep", "src_mesh": {"shape": [8], "devices": list(range(8))}, "dst_mesh": {"shape": [8], "devices": list(range(8, 16))},
         "cluster": {"devices_per_host": 8},
         "tensors": [{"name": f"t{i}", "shape": [64, 64], "dtype": "float32", "src": "S0 R", "dst": dst} for i in range(16)]}), solver="greedy")


@pytest.mark.parametrize("order", ["posted", "device"])
def test_a_peer_whose_pieces_are_one_range_of_the_message_is_sent_from_and_received_into_it(order):
    """Destinations replicated over the receiving host: every needer needs every piece, laid out as the message, so
    the receiving relay sends the message itself to each (no side area, no move: it stages the message once); each
    holder of the sending host holds one row range of every tensor, one piece per member, so the sending relay keeps
    a side area per holder and moves. Bit-exact, and each rank's staging is the plan's."""
    plan = _replicated("R R")
    groups = [g for g in _groups(plan) if len(g) > 1]
    assert len(groups) == 1 and len(groups[0]) == 16
    group = groups[0]
    message = sum(_bytes(op, plan) for op in group)
    src, relay = group[0].src, group[0].dsts[0]
    executors = fake_executors(plan, order=order)
    full = full_tensors(plan, 3)
    assert_every_shard(plan, run_everywhere(plan, executors, full), full)
    assert {ex.device: ex.stage_bytes for ex in executors if ex.stage_bytes} == staging_peaks(plan, order)
    programs = {d: rank_program(plan, d, order, True, 2**20) for d in (src, relay)}
    moves = {d: sum(s.action is Action.MOVE for s in p.steps) for d, p in programs.items()}
    assert moves[relay] == 0 and moves[src] > 0
    assert programs[relay].stage_bytes == message < programs[src].stage_bytes
    sent = [s for s in programs[relay].steps if s.action is Action.SEND]
    assert len(sent) == 7 and all(s.data.nbytes == message for s in sent)


def test_the_relays_stage_no_side_area_for_a_peer_whose_pieces_are_one_range_of_the_message():
    """Float32 bundles a (parts of 4 and 4 B) and b (12 B), relays d0 -> d4: the message is 20 B. Holder d1 holds a's
    first part and b (not consecutive in the message: a 16 B side area on d0, b from byte 4 of it); holder d2 only
    a's second part (one piece: received into the message). Needer d5 needs a's first part and b (a side area on d4);
    d6 a's second part and b, consecutive in the message at the same distances (sent from it)."""
    from xmesh_plan.schemas.carriers import group_staging
    from xmesh_plan.schemas.plan import Operation

    a = Operation(id=0, task=0, tensor=0, kind="bundle", src=0, dsts=(4,), region=((0, 2),), parts=(((0, 1),), ((1, 2),)),
                  holders=(1, 2), needers=((5,), (4, 6)))
    b = Operation(id=1, task=1, tensor=1, kind="bundle", src=0, dsts=(4,), region=((0, 3),), parts=(((0, 3),),),
                  holders=(1,), needers=((5, 6),), carrier=0)
    assert group_staging([a, b], [[4, 4], [12]], 4) == {0: 20 + 16, 1: 16, 2: 4, 4: 20 + 16, 5: 16, 6: 16}


def test_a_limited_plan_stating_less_staging_than_the_relays_need_is_refused_naming_an_older_compile(shared):
    """A plan compiled with --max-staging-mb by an xmesh-plan whose staging model left out a shared message's side
    areas states less on a relay than it needs now: refused, saying such a plan must be recompiled."""
    limited = compile_plan(load_any_problem(SMALL), solver="greedy", max_staging_bytes=2**22)
    relay = next(g[0].dsts[0] for g in _groups(limited) if len(g) > 1)
    peaks = limited.staging.peak_bytes
    older = limited.model_copy(update={"staging": limited.staging.model_copy(update={"peak_bytes": {**peaks, relay: peaks[relay] - 8}})})
    with pytest.raises(PlanError, match=rf"states {peaks[relay] - 8} B for device {relay}, .*--max-staging-mb by an older xmesh-plan"
                                        ".*; recompile the plan$"):
        check_plan(older)


def _two_tiny_tensors(overhead_us: float):
    return build_transfer({"name": "tiny", "src_mesh": {"shape": [1], "devices": [0]}, "dst_mesh": {"shape": [1], "devices": [1]},
                           "cluster": {"devices_per_host": 1, "overhead_us": overhead_us, "latency_us": 10.0},
                           "tensors": [{"name": "a", "shape": [64], "dtype": "float32", "src": "S0", "dst": "R"},
                                       {"name": "b", "shape": [32], "dtype": "float32", "src": "S0", "dst": "R"}]})


def test_a_shared_message_pays_one_message_overhead():
    """Two small tensors, host 0 -> host 1 (one device each: no gathers or scatters), with a per-message overhead
    far above their bytes' time: the plan with one shared message predicts one overhead, the plan with a bundle
    per tensor two, back to back on the NIC (hand formula: overheads + one latency + the bytes' time)."""
    overhead = 2000e-6
    problem = _two_tiny_tensors(overhead * 1e6)
    one = compile_plan(problem, solver="greedy")
    two = compile_plan(problem, solver="greedy", cross_tensor=False)
    assert [len(g) for g in _groups(one)] == [2] and [len(g) for g in _groups(two)] == [1, 1]
    cluster = problem.cluster
    nbytes = (64 + 32) * 4
    wire = nbytes / cluster.message_bytes_per_s
    assert one.predicted_seconds == pytest.approx(overhead + cluster.latency_s + wire, rel=0.02, abs=20e-6)
    assert two.predicted_seconds == pytest.approx(2 * overhead + cluster.latency_s + wire, rel=0.02, abs=20e-6)


# --- the plan check refuses malformed groups ---------------------------------------------------------------

def _replace(plan: Plan, index: int, **update) -> Plan:
    ops = list(plan.operations)
    ops[index] = ops[index].model_copy(update=update)
    return plan.model_copy(update={"operations": tuple(ops)})


def _first_rider(plan: Plan) -> int:
    return next(k for k, op in enumerate(plan.operations) if op.carrier is not None)


def test_the_plan_check_refuses_malformed_groups(shared):
    check_plan(shared)
    k = _first_rider(shared)
    rider = shared.operations[k]
    with pytest.raises(PlanError, match="no operation 1000000 in the plan"):
        check_plan(_replace(shared, k, carrier=10**6))
    with pytest.raises(PlanError, match="differ from its carrier's"):
        check_plan(_replace(shared, k, dsts=(rider.dsts[0] + 1,)))
    # a bundle naming the carrier of an earlier group, with other messages listed in between
    ops = shared.operations
    later = next(j for j in range(k + 1, len(ops)) if ops[j].carrier is None and ops[j - 1].carrier is not None
                 and ops[j - 1].carrier != rider.carrier or (ops[j].carrier is None and ops[j - 1].carrier is None and j > k + 1))
    with pytest.raises(PlanError, match="listed right after operation"):
        check_plan(_replace(shared, later, carrier=rider.carrier))
    # naming as carrier a bundle that itself rides in another's message
    assert ops[k + 1].carrier == rider.carrier
    with pytest.raises(PlanError, match="must be a bundle that sends its own message"):
        check_plan(_replace(shared, k + 1, carrier=rider.id))


def test_a_ragged_bundle_cannot_share_a_message_with_the_next(tmp_path):
    """A group member that is not a multiple of the largest element size, followed by another, is refused
    (the executor lays the group out with no padding); the planner never makes one."""
    problem = build_transfer({"name": "ragged", "src_mesh": {"shape": [1], "devices": [0]}, "dst_mesh": {"shape": [1], "devices": [1]},
                              "cluster": {"devices_per_host": 1},
                              "tensors": [{"name": "a", "shape": [3], "dtype": "int8", "src": "R", "dst": "R"},
                                          {"name": "b", "shape": [4], "dtype": "int8", "src": "R", "dst": "R"},
                                          {"name": "c", "shape": [2], "dtype": "float32", "src": "R", "dst": "R"}]})
    plan = compile_plan(problem, solver="greedy")
    for group in _groups(plan):
        assert all(_bytes(op, plan) % 4 == 0 for op in group[:-1])
    ops = list(plan.operations)
    ragged = next(k for k, op in enumerate(ops) if op.tensor == 0)
    other = next(k for k, op in enumerate(ops) if op.tensor == 1)
    listed = [ops[ragged], ops[other]] + [op for k, op in enumerate(ops) if k not in (ragged, other)]
    relays = {"src": ops[ragged].src, "dsts": ops[ragged].dsts}
    bad = plan.model_copy(update={"operations": tuple(
        op.model_copy(update={"id": i, "start_s": 0.0, "carrier": 0 if i == 1 else None, **(relays if i == 1 else {})})
        for i, op in enumerate(listed))})
    with pytest.raises(PlanError, match="not a multiple of 4 B"):
        check_plan(bad)
    path = tmp_path / "bad.plan.json"
    path.write_text(bad.to_json())
    result = CliRunner().invoke(main, ["verify", str(path)])
    assert result.exit_code == 1 and "not a multiple of 4 B" in result.output and "Traceback" not in result.output  # verify: 1 = a wrong plan


def test_cli_cross_tensor_flags(tmp_path):
    runner = CliRunner()
    result = runner.invoke(main, ["compile", str(SMALL), "-o", str(tmp_path / "a.json")])
    assert result.exit_code == 0, result.output
    assert "bundles in 4 shared cross-host messages" in result.output
    result = runner.invoke(main, ["compile", str(SMALL), "--no-cross-tensor", "-o", str(tmp_path / "b.json")])
    assert result.exit_code == 0 and "shared" not in result.output, result.output
    result = runner.invoke(main, ["compile", str(SMALL), "--no-coalesce", "--cross-tensor"])
    assert result.exit_code == 2 and "--cross-tensor" in result.output and "--coalesce" in result.output
    assert not (tmp_path / "c.json").exists()
    result = runner.invoke(main, ["compile", str(ROOT / "plans" / "case3.problem.json"), "--coalesce", "--cross-tensor"])
    assert result.exit_code == 2 and "has one tensor" in result.output and "Traceback" not in result.output
    result = runner.invoke(main, ["inspect", str(tmp_path / "a.json")])
    assert "84 bundles in 4 shared cross-host messages" in result.output


def test_same_input_gives_a_byte_identical_plan_with_shared_messages():
    problem = load_any_problem(SMALL)
    assert compile_plan(problem, solver="greedy").to_json() == compile_plan(problem, solver="greedy").to_json()


# --- real processes ---------------------------------------------------------------------------------------------

def _write(tmp_path, plan: Plan) -> Path:
    path = tmp_path / "weight_sync_small.plan.json"
    path.write_text(plan.to_json())
    return path


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec at {MPIEXEC}")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("order", ["posted", "device"])
def test_mpiexec_runs_shared_messages_bit_exact(tmp_path, shared, order):
    path = _write(tmp_path, shared)
    result = run_demo(8, path, "--check", "--iters", "2", "--order", order, timeout=500)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "check ok: 21 tensors x 4 destination shards bit-exact" in result.stdout, result.stdout
    want = max(staging_peaks(shared, order).values())
    assert f"staging {want / 2**20:.1f} MiB/rank at most ({order} order)" in result.stdout, result.stdout


@pytest.mark.slow
@pytest.mark.timeout(800)
@pytest.mark.parametrize("order", ["device", "posted"])
def test_torchrun_runs_shared_messages_on_gloo_bit_exact(tmp_path, shared, order):
    """The torch engine's device order replays the joint program, so it sends each group one message per pair of
    devices (with receipts on gloo); posted, it runs one tensor after another, each bundle with its own messages."""
    pytest.importorskip("torch")
    path = _write(tmp_path, shared)
    result = torchrun(8, "xmesh_plan.executor.torch_run", str(path), "--check", "--iters", "2", "--order", order, timeout=700)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "check ok: every destination shard of every tensor bit-exact" in result.stdout, result.stdout


def test_a_bundle_listed_on_other_nic_sides_than_its_carrier_is_refused(shared):
    """One message crosses one NIC side at each end: a group's bundle listed elsewhere in host_order than its
    carrier's task is refused (the simulator times the group on its carrier's sides)."""
    k = _first_rider(shared)
    rider = shared.operations[k]
    moved = []
    for entry in shared.host_order:
        tasks = tuple(t for t in entry.tasks if t != rider.task)
        if entry.side == "recv" and rider.task not in entry.tasks:
            tasks = tasks + (rider.task,)
        moved.append(entry.model_copy(update={"tasks": tasks}))
    bad = shared.model_copy(update={"host_order": tuple(e for e in moved if e.tasks)})
    with pytest.raises(PlanError, match="other NIC sides than task"):
        check_plan(bad)


def test_inspect_orders_prints_one_ratio_where_the_bound_is_zero(tmp_path):
    """Nothing crosses a link (one device holds and needs everything): every line says 1.000x, none inf."""
    problem = build_transfer({"name": "local", "src_mesh": {"shape": [1], "devices": [0]}, "dst_mesh": {"shape": [1], "devices": [0]},
                              "tensors": [{"name": "a", "shape": [8], "dtype": "float32", "src": "R", "dst": "R"}]})
    plan = compile_plan(problem, solver="greedy")
    assert plan.lower_bound_seconds == 0
    path = tmp_path / "local.plan.json"
    path.write_text(plan.to_json())
    result = CliRunner().invoke(main, ["inspect", "--orders", str(path)])
    assert result.exit_code == 0, result.output
    assert "inf" not in result.output and result.output.count("1.000x") >= 3


@pytest.mark.parametrize("timed_by", ["simulator", "schedule"])
def test_a_plan_of_shared_messages_states_a_proven_bound_within_its_time(timed_by, monkeypatch):
    """The solver's bound counts one overhead per bundle; the shared message pays one: the plan's proven bound is a
    bound of what it sends in the schedule's model, so never above the schedule's timetable. The simulator is another
    model (it can finish before that bound, docs/format.md); on this plan of one message it times it no earlier."""
    import xmesh_plan.planner.compile as compile_module

    if timed_by == "schedule":
        monkeypatch.setattr(compile_module, "MAX_SIMULATED_MESSAGES", 0)
    overhead = 2000e-6
    plan = compile_plan(_two_tiny_tensors(overhead * 1e6))
    assert [len(g) for g in _groups(plan)] == [2]
    assert plan.solver.details["timed_by"].startswith(timed_by)
    assert 0 < plan.solver.proven_bound_seconds <= plan.predicted_seconds
    assert plan.solver.proven_bound_seconds >= overhead  # still a bound of one message's overhead, not dropped to nothing


@pytest.mark.parametrize("discipline", ["host-order", "posted", "device-order"])
def test_the_simulator_times_the_intra_host_messages_the_executor_sends_for_shared_messages(shared, tmp_path, discipline):
    """The simulator's flows inside hosts for the shared messages (`simulate.lower`) are the executor's messages (each
    rank's program read from a compact file): the same (message, from, to, bytes), once each."""
    from xmesh_plan.planner.simulate import lower as lower_flows, nic_assignment

    path = tmp_path / "shared.plan.npz"
    write_atomic(path, compact_bytes(shared))
    source = PlanFile.read(path)
    host = shared.problem.cluster.host_of
    heads = {g[0].id for g in _groups(shared) if len(g) > 1}
    sent = Counter()
    for device in plan_devices(shared):
        program = rank_program(source, device, "posted", True, 2**20)
        sent.update((s.op, device, s.peer, s.data.nbytes) for s in program.steps
                    if s.action is Action.SEND and s.data.buffer != "receipt" and s.op in heads and host(s.peer) == host(device))
    lowering, _ = lower_flows(shared.operations, shared.problem, discipline, nic_assignment(shared.host_order))
    flows = Counter()
    for f in lowering.flows:
        if f.op in heads and all(link.startswith("d") for link in f.links):
            ports = {side: int(d) for d, side in (link[1:].split(".") for link in f.links)}
            flows[(f.op, ports["out"], ports["in"], int(f.nbytes))] += 1
    assert sent and flows == sent
