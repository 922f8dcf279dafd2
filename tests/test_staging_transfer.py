"""`--max-staging-mb` on multi-tensor (transfer) problems: every tensor's operations cut to the limit,
one staging area per device shared by every tensor in device order, the plan stating each device's peak
(checked here against a brute force over the definitions), and the executor allocating no more than
that on MPI (in process and under mpiexec) and on torch/gloo, every destination shard bit for bit."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import re
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, settings, strategies as st

from xmesh_plan.executor import PlanMismatchError, TransferExecutor
from xmesh_plan.executor.passes import rank_program
from xmesh_plan.executor.lower import Action, lower
from xmesh_plan.executor.ranks import plan_devices
from xmesh_plan.executor.scale import factors_for, scale_tensors
from xmesh_plan.executor.transfer_executor import check_transfer_staging, default_order
from xmesh_plan.planner.cli import main
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.staging_limit import StagingLimitError
from xmesh_plan.planner.transfer_io import build_transfer, load_any_problem
from xmesh_plan.planner.verify import PlanError, verify_plan
from xmesh_plan.schemas import Plan, read_plan_file
from xmesh_plan.schemas.plan_tensors import tensor_plans
from xmesh_plan.schemas.staging import staging_peaks
from tests.support.staging import brute_force_peaks, unsafe_reuse
from tests.support.fake_mpi import FakeWorld, WorldComm
from tests.support.launch import MPIEXEC, mpiexec
from tests.support.transfer import assert_every_shard, fake_executors, full_tensors, random_transfer, run_everywhere

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "plans" / "weight_sync_small.problem.toml"
WORKER = ROOT / "tests" / "workers" / "staging_transfer_worker.py"
SMALL_LIMIT = 16 * 2**10  # a quarter of the small weight sync's largest device-order run without a limit (64 KiB)


TWO = {  # a float64 and an int8 tensor whose boxes are strided on both sides (so most of them stage), on
    # overlapping 2x2 meshes (devices 2 and 3 in both): staging of two element sizes in one area
    "name": "two", "src_mesh": {"shape": [2, 2], "devices": [0, 1, 2, 3]}, "dst_mesh": {"shape": [2, 2], "devices": [2, 3, 4, 5]},
    "cluster": {"devices_per_host": 2},
    "tensors": [{"name": "w", "shape": [8, 6, 4], "dtype": "float64", "src": "S0 S1 R", "dst": "R S0 S1"},
                {"name": "b", "shape": [6, 10, 3], "dtype": "int8", "src": "R S0 S1", "dst": "S1 R S0"}]}


def two_tensors():
    return build_transfer(TWO)


@pytest.fixture(scope="module")
def small_plan() -> Plan:
    return compile_plan(load_any_problem(SMALL), solver="greedy", max_staging_bytes=SMALL_LIMIT)


@pytest.fixture(scope="module")
def two_plan() -> Plan:
    return compile_plan(two_tensors(), solver="greedy", max_staging_bytes=200)


def joint_programs(plan: Plan) -> dict[int, object]:
    """Every device's program of every tensor in device order, as `TransferExecutor.prepare` lays it out."""
    return {device: rank_program(plan, device, "device", concurrent=True, tag_limit=2**29) for device in plan_devices(plan)}


# --- compile ------------------------------------------------------------------------------------------------

def test_the_small_weight_sync_compiles_within_the_limit_and_states_its_peaks(small_plan):
    plain = compile_plan(load_any_problem(SMALL), solver="greedy")
    assert max(staging_peaks(plain, "device").values()) > SMALL_LIMIT  # the limit bites
    assert len(small_plan.operations) > len(plain.operations)
    report = verify_plan(small_plan)
    assert report.tensors == 21 and report.staging_peak == max(small_plan.staging.peak_bytes.values())
    stated = small_plan.staging
    assert stated.limit_bytes == SMALL_LIMIT and stated.order == "device"
    assert 0 < max(stated.peak_bytes.values()) <= SMALL_LIMIT
    assert stated.peak_bytes == brute_force_peaks(small_plan) == staging_peaks(small_plan, "device")
    biggest = max(p.nbytes for p in small_plan.problem.tensor_problems())
    assert SMALL_LIMIT < biggest  # so no device stages a whole tensor of the largest kind


def test_two_element_sizes_share_one_area_aligned_to_the_larger(two_plan):
    verify_plan(two_plan)
    peaks = two_plan.staging.peak_bytes
    assert peaks == brute_force_peaks(two_plan) and 0 < max(peaks.values()) <= 200
    assert {op.tensor for op in two_plan.operations} == {0, 1}
    for device, joint in joint_programs(two_plan).items():
        assert joint.stage_bytes == peaks.get(device, 0), device
        starts = {s.data.start for s in joint.steps if s.data and s.data.buffer == "stage"}
        op_starts = {}
        for s in joint.steps:
            if s.data and s.data.buffer == "stage":
                op_starts[s.op] = min(op_starts.get(s.op, s.data.start), s.data.start)
        assert all(start % 8 == 0 for start in op_starts.values()), (device, sorted(starts))
        assert all(s.data.stop <= joint.stage_bytes for s in joint.steps if s.data and s.data.buffer == "stage")
        assert unsafe_reuse(joint) == []


def test_same_input_and_seed_give_a_byte_identical_limited_plan(small_plan):
    again = compile_plan(load_any_problem(SMALL), solver="greedy", max_staging_bytes=SMALL_LIMIT)
    assert again.to_json() == small_plan.to_json()
    assert Plan.model_validate_json(small_plan.to_json()) == small_plan
    assert "staging" not in json.loads(compile_plan(two_tensors(), solver="greedy").to_json())


def limited_transfer(seed: int, strategy: str, devices: int, share: float, coalesce: bool) -> tuple[Plan, int]:
    """(plan, limit): `random_transfer(seed, devices)` compiled under a limit of `share` of its largest posted peak
    (at least one element of its widest dtype, and 64 B when coalescing)."""
    problem = random_transfer(seed, devices)
    options = dict(strategy=strategy, solver="greedy", seed=0, coalesce=coalesce, bucket_bytes=64 if coalesce else None)
    plain = compile_plan(problem, **options)
    widest = max(p.itemsize for p in problem.tensor_problems())
    limit = max(widest, int(max(staging_peaks(plain, "posted").values(), default=0) * share), 64 if coalesce else 0)
    return compile_plan(problem, max_staging_bytes=limit, **options), limit


SHARED_SCATTER = dict(seed=14028, strategy="broadcast", devices=8, share=0.0, coalesce=True)  # see the test below


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), strategy=st.sampled_from(("broadcast", "send_recv", "local_allgather", "global_allgather", "auto")),
       devices=st.integers(2, 9), share=st.sampled_from([0.0, 0.3, 0.7]), coalesce=st.booleans())
@example(**SHARED_SCATTER)
def test_random_limited_transfers_agree_with_the_brute_force_and_run_bit_exact(seed, strategy, devices, share, coalesce):
    plan, limit = limited_transfer(seed, strategy, devices, share, coalesce)
    verify_plan(plan)
    assert plan.staging.peak_bytes == brute_force_peaks(plan) and all(n <= limit for n in plan.staging.peak_bytes.values())
    for device, joint in joint_programs(plan).items():
        assert joint.stage_bytes == plan.staging.peak_bytes.get(device, 0)
        assert unsafe_reuse(joint) == []
    executors = fake_executors(plan, order="device")
    full = full_tensors(plan, seed)
    assert_every_shard(plan, run_everywhere(plan, executors, full), full)
    for ex in executors:
        assert ex.stage_bytes == plan.staging.peak_bytes.get(ex.device, 0)
    windowed = staging_peaks(plan, "posted")  # posted within the limit (`executor.window`), the MPI engine's default
    assert windowed == brute_force_peaks(plan, "posted") and all(n <= limit for n in windowed.values())
    posted = fake_executors(plan, order="posted")
    assert_every_shard(plan, run_everywhere(plan, posted, full), full)
    for ex in posted:
        assert ex.stage_bytes == ex.engine.stage.nbytes == windowed.get(ex.device, 0)
        assert unsafe_reuse(ex.program) == []


def test_a_shared_message_scattered_from_itself_while_its_members_unpack_is_no_reuse():
    """Device 6 relays one message of three bundles (ops 17-19): it sends device 7 its share from the message itself
    while it unpacks each member's part of the same bytes, no step waiting for another. Reads of one received message
    overwrite nothing (the executors run it bit exact); a write in the send's place is reuse."""
    plan, _ = limited_transfer(**SHARED_SCATTER)
    joint = joint_programs(plan)[6]
    staged = [s for s in joint.steps if s.data is not None and s.data.buffer == "stage"]
    send = next(s for s in staged if s.action is Action.SEND)
    unpacks = [s for s in staged if s.action is Action.UNPACK and s.op != send.op
               and s.data.start < send.data.stop and send.data.start < s.data.stop]
    assert {s.op for s in unpacks} == {18, 19} and send.op == 17
    assert all(s.index < send.index and s.index not in send.deps for s in unpacks)
    assert unsafe_reuse(joint) == []
    full = full_tensors(plan, 1)
    assert_every_shard(plan, run_everywhere(plan, fake_executors(plan, order="device"), full), full)
    received = dataclasses.replace(send, action=Action.RECV)
    written = dataclasses.replace(joint, steps=tuple(received if s is send else s for s in joint.steps))
    assert len(unsafe_reuse(written)) == len(unpacks)


# --- the executor -------------------------------------------------------------------------------------------

def test_every_tensor_shares_one_staging_area_and_runs_bit_exact_in_process(two_plan, small_plan):
    for plan in (two_plan, small_plan):
        executors = fake_executors(plan, order="device")
        for seed in (1, 2):
            full = full_tensors(plan, seed)
            assert_every_shard(plan, run_everywhere(plan, executors, full), full)
        for ex in executors:
            stage = ex.engine.stage  # one buffer for every tensor: the one engine's
            assert ex.stage_bytes == stage.nbytes == plan.staging.peak_bytes.get(ex.device, 0) <= plan.staging.limit_bytes
    posted = sum(staging_peaks(small_plan, "posted").values())
    assert posted > sum(small_plan.staging.peak_bytes.values())


def test_a_limited_plan_runs_posted_within_its_limit_on_mpi_and_in_device_order_on_torch(small_plan):
    assert default_order(small_plan, "mpi") == "posted" and default_order(small_plan, "torch") == "device"
    comm = WorldComm(FakeWorld(), 0, 8)
    assert TransferExecutor(small_plan, comm).order == "posted"
    assert TransferExecutor(small_plan, comm, order="device").order == "device"
    # torch posted runs the tensors one after another in one area: the largest tensor's staged boxes at once
    with pytest.raises(PlanMismatchError, match=r"order='posted' needs 262144 B of staging on device 0 \(the largest tensor's "
                                                r"staged boxes at once\)"):
        check_transfer_staging(small_plan, "posted", "torch")
    # NCCL runs them on one stream, one call's staging at a time, joined by default or one tensor after another
    # posted: prepare() checks what it allocated on each rank (tests/test_executor_gpu.py runs both on the fake NCCL)
    assert TransferExecutor(small_plan, comm, backend="nccl").order == "device"
    assert TransferExecutor(small_plan, comm, backend="nccl", order="posted").order == "posted"


def test_a_plan_stating_less_than_it_needs_is_refused_before_anything_runs(two_plan):
    device = max(two_plan.staging.peak_bytes, key=two_plan.staging.peak_bytes.get)
    peaks = {**two_plan.staging.peak_bytes, device: 8}
    wrong = two_plan.model_copy(update={"staging": two_plan.staging.model_copy(update={"peak_bytes": peaks})})
    with pytest.raises(PlanError, match=f"states 8 B for device {device}, but the plan needs"):
        verify_plan(wrong)
    with pytest.raises(PlanMismatchError, match=f"states 8 B for device {device}, but the plan needs"):  # the same refusal
        TransferExecutor(wrong, WorldComm(FakeWorld(), 0, 6))


def test_a_scaled_transfer_restates_its_staging(two_plan):
    """The executor's demo shrinks each tensor by its own factors: the limit shrinks by the least of them."""
    factors = [factors_for(single, single.problem.nbytes // 2) for single in tensor_plans(two_plan)]
    assert any(math.prod(f) > 1 for f in factors)
    scaled = scale_tensors(two_plan, factors)
    assert scaled.staging.limit_bytes == -(-200 // min(math.prod(f) for f in factors))
    verify_plan(scaled)
    assert scaled.staging.peak_bytes == brute_force_peaks(scaled)


# --- the command line ---------------------------------------------------------------------------------------

def _transfer_file(tmp_path: Path) -> Path:
    path = tmp_path / "two.problem.json"
    path.write_text(json.dumps(TWO))
    return path


def test_a_limit_below_one_element_names_the_flag_the_tensor_and_the_smallest_value(tmp_path):
    runner = CliRunner()
    below = runner.invoke(main, ["compile", str(_transfer_file(tmp_path)), "--max-staging-mb", "0.000006"])  # 6 B < one float64
    assert below.exit_code == 2 and below.output.count("\n") == 1 and "Traceback" not in below.output, below.output
    assert "--max-staging-mb: 6 B is below one float64 element (8 B, tensor 'w')" in below.output
    assert "the smallest value that works is --max-staging-mb 0.000008" in below.output
    with pytest.raises(StagingLimitError):
        compile_plan(two_tensors(), solver="greedy", max_staging_bytes=7)


def test_a_bucket_above_the_limit_is_refused_naming_both_flags(tmp_path):
    result = CliRunner().invoke(main, ["compile", str(SMALL), "--coalesce", "--bucket-mb", "1", "--max-staging-mb", "0.5"])
    assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
    assert "--bucket-mb 1 is above --max-staging-mb 0.5" in result.output and "leave out --bucket-mb" in result.output
    coalesced = compile_plan(load_any_problem(SMALL), solver="greedy", coalesce=True, max_staging_bytes=SMALL_LIMIT)
    assert any(op.kind == "bundle" for op in coalesced.operations)  # the bucket became the limit
    assert max(coalesced.staging.peak_bytes.values()) <= SMALL_LIMIT and coalesced.staging.peak_bytes == brute_force_peaks(coalesced)


def test_compile_verify_and_inspect_state_the_limit(tmp_path):
    out = tmp_path / "small.plan.json"
    runner = CliRunner()
    result = runner.invoke(main, ["compile", str(SMALL), "--solver", "greedy", "--max-staging-mb", "0.015625", "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert re.search(r"staging at most [\d.]+ KiB per device \(device order, limit 16.0 KiB\)", result.output), result.output
    assert "stated staging right" in runner.invoke(main, ["verify", str(out)]).output
    text = runner.invoke(main, ["inspect", str(out)]).output
    assert re.search(r"device order [\d.]+ KiB \(device \d+; \d+ devices? stage\); posted order within the limit [\d.]+ KiB", text), text
    assert "stated staging: limit 16.0 KiB per device (--max-staging-mb 0.015625)" in text, text
    orders = runner.invoke(main, ["inspect", "--orders", str(out)]).output
    stated = re.search(r"predicted posted within the staging limit \(the executor's default order for this plan\): ([\d.]+) s", orders)
    window = re.search(r"^  window +([\d.]+) s .*posted within the limit's window per device \(the MPI engine's default for this plan\)$",
                       orders, re.M)
    assert stated and window and window.group(1) == stated.group(1), orders  # the default timed is the one the plan states
    assert re.search(r"^  device-order .*\(the torch and NCCL engines' default for this plan\)$", orders, re.M), orders
    assert re.search(r"^  posted .*every staged box at once \(the MPI engine keeps this plan within its limit: window\)$", orders, re.M), orders
    assert "refused" not in orders and "the executor's default for this plan: it states a staging limit" not in orders, orders
    assert read_plan_file(out).to_json() == compile_plan(load_any_problem(SMALL), solver="greedy", max_staging_bytes=SMALL_LIMIT).to_json()


# --- real launches ------------------------------------------------------------------------------------------

@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec at {MPIEXEC}")
@pytest.mark.timeout(900)
def test_mpiexec_runs_limited_transfers_bit_exact_within_the_stated_staging(tmp_path, small_plan, two_plan):
    """Real MPI, the executor's default order (posted within the limit the plan states, `executor.window`): 3 reshards
    each, every shard checked, each rank's allocated staging (its engine's buffer) within the limit; and device order,
    within the peak the plan states."""
    for plan, ranks in ((small_plan, 8), (two_plan, 6)):
        path = tmp_path / f"{plan.problem.name}.plan.json"
        path.write_text(plan.to_json())
        for order in ("", "device"):
            result = mpiexec(ranks, str(WORKER), *(["--order", order] if order else []), str(path))
            assert result.returncode == 0, result.stderr[-3000:]
            found = re.search(r"ok (\S+) order (\w+) staging (\d+) stated (\d+) limit (\d+)", result.stdout)
            assert found, result.stdout
            name, ran, allocated, stated, limit = found.groups()
            assert (name, ran) == (plan.problem.name, order or "posted")
            assert 0 < int(allocated) <= (int(stated) if order else int(limit)) and int(stated) <= int(limit) == plan.staging.limit_bytes


@pytest.fixture(scope="module")
def gloo_lines(tmp_path_factory, two_plan) -> dict[str, list[str]]:
    """One launch of 6 torch/gloo ranks (the worker's `batch`: each job in turn, a barrier between) for the two tests
    below: job name -> its `rank R: ...` lines, as the job's mode alone prints them (the job's name taken out)."""
    from tests.support.launch import launch

    folder = tmp_path_factory.mktemp("gloo")
    (folder / "two.plan.json").write_text(two_plan.to_json())
    (folder / "two_posted.plan.json").write_text(compile_plan(two_tensors(), solver="greedy").to_json())
    jobs = [{"name": "device", "mode": "check_transfer_by_order", "plans": [str(folder / "two.plan.json")]},
            {"name": "posted", "mode": "check_transfer_posted_by_order", "plans": [str(folder / "two_posted.plan.json")]}]
    (folder / "jobs.json").write_text(json.dumps(jobs))
    out: dict[str, list[str]] = {"device": [], "posted": []}
    for line in launch(6, "batch", str(folder / "jobs.json")):
        rank, name, rest = line.split(": ", 2)
        out[name].append(f"{rank}: {rest}")
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_torch_gloo_runs_a_limited_transfer_bit_exact_within_the_stated_staging(gloo_lines, two_plan):
    """The torch engine in device order: one staging tensor every tensor shares, each shard bit for bit (tags 0: gloo matches by order, as NCCL)."""
    lines = gloo_lines["device"]
    assert [line for line in lines if line.startswith("rank 0:") and "ok" in line] == ["rank 0: two.plan.json: ok"], lines
    staged = [line for line in lines if "staging" in line]
    assert len(staged) == 6 and all(re.search(r"staging (\d+) B, stated (\d+) B, shared", line) for line in staged), lines
    for line in staged:
        allocated, stated = map(int, re.search(r"staging (\d+) B, stated (\d+) B", line).groups())
        assert allocated <= stated <= two_plan.staging.limit_bytes, line


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_torch_gloo_posted_runs_the_tensors_one_after_another_in_one_staging_area(gloo_lines):
    """The torch engine posted runs a multi-tensor plan's tensors one after another, so they share one staging
    tensor, the largest any tensor's posted program needs on that device (not the sum); bit for bit on gloo."""
    plan = compile_plan(two_tensors(), solver="greedy")
    lines = gloo_lines["posted"]
    assert [line for line in lines if line.startswith("rank 0:") and "ok" in line] == ["rank 0: two_posted.plan.json: ok"], lines
    staged = {int(m.group(1)): (int(m.group(2)), m.group(3)) for line in lines
              if (m := re.search(r"device (\d+) staging (\d+) B, stated None B, (.*)$", line))}
    assert len(staged) == 6, lines
    singles = tensor_plans(plan)
    summed = 0
    for device, (allocated, shared) in staged.items():
        own = [lower(single, device).stage_bytes for single in singles]
        assert shared == "shared" and allocated == max(own), (device, allocated, own)
        summed = max(summed, sum(own) - max(own))
    assert summed > 0  # some device would have held more with one area per tensor


def test_a_one_tensor_plan_over_its_staging_gets_the_same_advice_from_both_faces():
    """A one-tensor plan compiled with a staging limit, given a posted program staging one byte more than the limit
    (what posted stages without its window, `executor.window`): both faces refuse it with the same advice, to run
    it in device order."""
    from xmesh_plan.executor import ReshardingExecutor, TransferExecutor, PlanMismatchError
    from xmesh_plan.executor.lower import lower
    from xmesh_plan.executor.ranks import plan_devices
    from xmesh_plan.planner.compile import compile_plan
    from tests.support.cases import random_problem
    from tests.support.fake_mpi import FakeWorld, WorldComm
    plan = compile_plan(random_problem(0, max_devices=6), solver="greedy", max_staging_bytes=64)
    devices = plan_devices(plan)
    program = lower(plan, devices[0], 2**20)
    program = dataclasses.replace(program, stage_bytes=plan.staging.limit_bytes + 1)
    messages = []
    for face in (ReshardingExecutor, TransferExecutor):
        with pytest.raises(PlanMismatchError) as err:
            face(plan, WorldComm(FakeWorld(), 0, len(devices)), order="posted")._check_staging(program)
        messages.append(str(err.value))
    assert messages[0] == messages[1] and "run it with order='device'" in messages[1]


def test_staging_on_every_member_at_once_is_staged_bytes_on_each():
    """`staged_on_members` (a bundle's part sizes counted once for all its devices) gives `staged_bytes` on every
    member of every operation of random coalesced transfers, bundles among them."""
    from xmesh_plan.schemas.op_kinds import members
    from xmesh_plan.schemas.staging import staged_bytes, staged_on_members

    from tests.support.transfer import random_transfer

    kinds = set()
    for seed in range(8):
        problem = random_transfer(seed, max_devices=8)
        plan = compile_plan(problem, coalesce=True, max_staging_bytes=0)
        singles = problem.tensor_problems()
        for op in plan.operations:
            kinds.add(op.kind)
            p = singles[op.tensor or 0]
            src, dst = p.blocks("src"), p.blocks("dst")
            want = [(d, staged_bytes(op, d, src.get(d), dst.get(d), p.itemsize)) for d in members(op)]
            assert staged_on_members(op, src, dst, p.itemsize) == want
    assert "bundle" in kinds
