"""Staging memory: the peak `schemas.staging` computes is what the lowering allocates (and what a brute
force over the definitions says), device order's reuse is safe, and `compile --max-staging-mb` keeps
every device within the limit, states it, and still runs bit-exact."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings, strategies as st

from xmesh_plan.executor.errors import PlanMismatchError
from xmesh_plan.executor.executor import check_staging
from xmesh_plan.executor.lower import Action, Bytes, Step, in_device_order, lower
from xmesh_plan.executor.nccl_plan import nccl_program
from xmesh_plan.executor.ranks import plan_devices
from xmesh_plan.executor.scale import scale_plan
from xmesh_plan.executor.window import in_window
from xmesh_plan.planner.cli import main
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.staging_limit import StagingLimitError, piece_count, split_box
from xmesh_plan.planner.verify import PlanError, verify_plan
from xmesh_plan.schemas import Plan, load_plan
from xmesh_plan.schemas.geometry import region_size
from xmesh_plan.schemas.staging import stage_budget, staging_peaks
from tests.support.cases import DEVICES, STRATEGIES, all_to_all, coalesced, fixed_problems, random_problem, write_plans
from tests.support.fake_mpi import simulate
from tests.support.launch import EXECUTOR_WORKER as WORKER, MPIEXEC, mpiexec
from tests.support.staging import brute_force_peaks, unsafe_reuse

ORDERS = ("posted", "device")


def lowered(plan: Plan, order: str) -> dict[int, object]:
    """Every device's program in `order`, as the executor makes it."""
    out = {}
    for d in plan_devices(plan):
        program = lower(plan, d, tag_limit=2**29)
        if order == "device":
            out[d] = in_device_order(program, stage_budget(plan))
        else:
            out[d] = program if stage_budget(plan) is None else in_window(program, stage_budget(plan))
    return out


def allocated(plan: Plan, order: str) -> dict[int, int]:
    return {d: p.stage_bytes for d, p in lowered(plan, order).items() if p.stage_bytes}


def random_plan(seed: int, strategy: str, devices: int, limit_share: float | None, coalesce: bool) -> Plan:
    """A random single-tensor plan, compiled with a staging limit at `limit_share` of its largest staged box when given."""
    prob = random_problem(seed, max_devices=devices, exact=False)
    options = dict(strategy=strategy, solver="greedy", seed=0, coalesce=coalesce, bucket_bytes=64 if coalesce else None)
    plain = compile_plan(prob, **options)
    if limit_share is None:
        return plain
    largest = max(list(staging_peaks(plain, "posted").values()) + [prob.itemsize])
    limit = max(prob.itemsize, int(largest * limit_share), 64 if coalesce else 0)
    return compile_plan(prob, max_staging_bytes=limit, **options)


plans_strategy = dict(seed=st.integers(0, 10**6), strategy=st.sampled_from(STRATEGIES + ("auto",)), devices=st.integers(2, 9),
                      limit_share=st.sampled_from([None, 0.0, 0.3, 0.7]), coalesce=st.booleans())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**plans_strategy)
def test_the_peak_is_what_the_lowering_allocates_and_what_a_brute_force_says(seed, strategy, devices, limit_share, coalesce):
    plan = random_plan(seed, strategy, devices, limit_share, coalesce)
    for order in ORDERS:
        peaks = staging_peaks(plan, order)
        assert peaks == allocated(plan, order), order
        assert peaks == brute_force_peaks(plan, order), order


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**plans_strategy)
def test_device_order_reuses_staging_only_after_the_operation_using_it_is_done(seed, strategy, devices, limit_share, coalesce):
    plan = random_plan(seed, strategy, devices, limit_share, coalesce)
    for order in ORDERS:
        for program in lowered(plan, order).values():
            assert unsafe_reuse(program) == [], order


def test_the_reuse_check_can_fail():
    """Device order's reused layout with posted order's dependencies (nothing waits for earlier operations) is caught."""
    plan = compile_plan(all_to_all(), solver="greedy", seed=0)
    posted = lowered(plan, "posted").values()
    program = next(p for p in posted if in_device_order(p).stage_bytes < p.stage_bytes)
    squeezed = in_device_order(program)
    unordered = replace(squeezed, steps=tuple(replace(s, deps=o.deps) for s, o in zip(squeezed.steps, program.steps)))
    assert unsafe_reuse(squeezed) == [] and unsafe_reuse(unordered)


def test_the_reuse_check_names_writes_over_bytes_still_read_and_lets_reads_share():
    """Two operations reading the same staging bytes unordered are safe; a write over bytes another operation still
    reads (a move's origin counts) without waiting for it is reuse."""
    def step(index, action, op, deps, start, origin=None):
        return Step(index, action, op, 0, "bundle", deps, data=Bytes("stage", start, start + 8),
                    origin=None if origin is None else Bytes("stage", origin, origin + 8))

    arrived = step(0, Action.RECV, 1, (), 0)
    reads = [arrived, step(1, Action.SEND, 1, (0,), 0), step(2, Action.UNPACK, 2, (0,), 0)]
    assert unsafe_reuse(SimpleNamespace(device=3, steps=reads)) == []
    moved = [arrived, step(1, Action.MOVE, 1, (0,), 8, origin=0), step(2, Action.RECV, 2, (0,), 0)]
    assert unsafe_reuse(SimpleNamespace(device=3, steps=moved)) == [
        "device 3: op 2 (task 0, bundle): receive 8 B from device -1 does not wait for op 1 (task 0, bundle): move on staging "
        "bytes both use"]
    waits = [*moved[:2], step(2, Action.RECV, 2, (1,), 0)]
    assert unsafe_reuse(SimpleNamespace(device=3, steps=waits)) == []


def test_device_order_needs_less_than_posted_on_the_reference_plans():
    for name in ("case3", "case4", "case9"):
        plan = load_plan(f"plans/{name}.plan.json")
        device, posted = staging_peaks(plan, "device"), staging_peaks(plan, "posted")
        assert all(device.get(d, 0) <= n for d, n in posted.items())
        assert sum(device.values()) < sum(posted.values()), name


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), strategy=st.sampled_from(STRATEGIES + ("auto",)), devices=st.integers(2, 9),
       share=st.sampled_from([0.0, 0.2, 0.5]), coalesce=st.booleans())
def test_a_limited_plan_stays_within_its_limit_verifies_and_runs_bit_exact_in_device_order(seed, strategy, devices, share, coalesce):
    plan = random_plan(seed, strategy, devices, share, coalesce)
    limit = plan.staging.limit_bytes
    assert all(n <= limit for n in plan.staging.peak_bytes.values())
    assert plan.staging.peak_bytes == staging_peaks(plan, "device") == allocated(plan, "device")
    verify_plan(plan)
    simulate(plan, iterations=2, order="device")


def test_the_limit_cuts_big_staged_boxes_and_no_device_holds_the_whole_tensor():
    prob = fixed_problems()[0]  # 8x6x4 int32, S0 S1 R -> R S0 S1: every box is strided somewhere
    plain = compile_plan(prob, solver="greedy", seed=0)
    limited = compile_plan(prob, solver="greedy", seed=0, max_staging_bytes=40)
    assert max(staging_peaks(plain, "device").values()) > 40
    assert len(limited.operations) > len(plain.operations)
    assert 0 < max(limited.staging.peak_bytes.values()) <= 40 < prob.nbytes
    assert "staging" not in json.loads(plain.to_json())  # absent unless asked for: existing plans stay byte-identical
    assert compile_plan(prob, solver="greedy", seed=0, max_staging_bytes=40).to_json() == limited.to_json()


def test_split_box_cuts_into_consecutive_boxes_within_the_limit():
    for region, limit in [(((0, 8), (0, 6), (0, 4)), 7), (((2, 9), (1, 4)), 2), (((0, 5),), 2), (((0, 3), (0, 3)), 100)]:
        pieces = split_box(region, limit)
        assert len(pieces) == piece_count(region, limit)
        assert all(0 < region_size(p) <= limit for p in pieces)
        assert sum(map(region_size, pieces)) == region_size(region)
        covered = np.zeros([b for _, b in region], int)
        for p in pieces:
            covered[tuple(slice(a, b) for a, b in p)] += 1
        assert (covered[tuple(slice(a, b) for a, b in region)] == 1).all()


def test_an_impossible_limit_names_the_flag_and_the_smallest_value_that_works(tmp_path):
    problem_file = tmp_path / "p.json"
    problem_file.write_text(json.dumps({"shape": [8, 6, 4], "dtype": "int32", "src": {"mesh": "2x2", "spec": "S0 S1 R"},
                                        "dst": {"mesh": "2x2", "spec": "R S0 S1"}}))
    runner = CliRunner()
    below = runner.invoke(main, ["compile", str(problem_file), "--max-staging-mb", "0.000001"])
    assert below.exit_code == 2 and below.output.count("\n") == 1 and "Traceback" not in below.output
    assert "--max-staging-mb" in below.output and "below one int32 element (4 B)" in below.output
    too_many = runner.invoke(main, ["compile", str(problem_file), "--max-staging-mb", "0.00001", "--max-tasks", "60"])
    assert too_many.exit_code == 2 and too_many.output.count("\n") == 1, too_many.output
    smallest = too_many.output.rsplit("--max-staging-mb ", 1)[1].split()[0]
    assert "more than --max-tasks 60" in too_many.output
    out = tmp_path / "smallest.plan.json"
    works = runner.invoke(main, ["compile", str(problem_file), "--max-staging-mb", smallest, "--max-tasks", "60", "-o", str(out)])
    assert works.exit_code == 0, works.output
    plan = load_plan(out)
    assert len(plan.operations) <= 60 and max(plan.staging.peak_bytes.values(), default=0) <= float(smallest) * 2**20
    below_smallest = f"{float(smallest) - 0.000001:.6f}"
    assert runner.invoke(main, ["compile", str(problem_file), "--max-staging-mb", below_smallest, "--max-tasks", "60"]).exit_code == 2


def test_a_limit_no_cut_can_meet_names_the_max_tasks_that_works(tmp_path):
    """Device 0 is on both sides, so the 2 unit tasks are 3 operations before any cut: at --max-tasks 2 (the
    number the task-count refusal names) no staging limit fits, and the refusal named one that was then refused."""
    problem_file = tmp_path / "p.json"
    problem_file.write_text(json.dumps({"shape": [11], "dtype": "float32", "cluster": {"devices_per_host": 6},
                                        "src": {"mesh": {"shape": [2]}, "spec": "S0"},
                                        "dst": {"mesh": {"shape": [2, 1], "devices": [3, 0]}, "spec": "S1"}}))
    runner = CliRunner()
    counted = runner.invoke(main, ["compile", str(problem_file), "--no-merge", "--max-tasks", "1"])
    assert counted.exit_code == 2 and "--max-tasks 2 " in counted.output, counted.output
    cuts_nothing = runner.invoke(main, ["compile", str(problem_file), "--no-merge", "--max-tasks", "2", "--max-staging-mb", "0.0001"])
    assert cuts_nothing.exit_code == 2 and cuts_nothing.output.count("\n") == 1, cuts_nothing.output
    assert "no --max-staging-mb brings it within (uncut, the plan has 3 operations); pass --max-tasks 3" in cuts_nothing.output
    below = runner.invoke(main, ["compile", str(problem_file), "--no-merge", "--max-tasks", "2", "--max-staging-mb", "0.000001"])
    assert below.exit_code == 2 and below.output.count("\n") == 1, below.output
    assert "the smallest value that works is --max-staging-mb 0.000004 with --max-tasks 3 " in below.output
    for limit in ("0.0001", "0.000004"):
        works = runner.invoke(main, ["compile", str(problem_file), "--no-merge", "--max-tasks", "3", "--max-staging-mb", limit,
                                     "-o", str(tmp_path / "out.json")])
        assert works.exit_code == 0, works.output


def test_the_bucket_may_not_exceed_the_limit_and_transfers_take_a_limit_too(tmp_path):
    runner = CliRunner()
    over = runner.invoke(main, ["compile", "plans/case3.problem.json", "--coalesce", "--bucket-mb", "8", "--max-staging-mb", "4"])
    assert over.exit_code == 2 and "--bucket-mb 8 is above --max-staging-mb 4" in over.output
    plan = coalesced(all_to_all(), bucket=None, max_staging_bytes=4096)  # the bucket becomes 4096 B: 8 cells a bundle
    assert any(op.kind == "bundle" for op in plan.operations) and max(plan.staging.peak_bytes.values()) <= 4096
    transfer = runner.invoke(main, ["compile", "plans/weight_sync_small.problem.toml", "--max-staging-mb", "1"])
    assert transfer.exit_code == 0 and "per device (device order, limit 1.0 MiB)" in transfer.output  # tests/test_staging_transfer.py
    with pytest.raises(StagingLimitError):
        compile_plan(all_to_all(), solver="greedy", seed=0, max_staging_bytes=2)


def test_inspect_prints_and_verify_checks_the_stated_peaks(tmp_path):
    out = tmp_path / "c4.plan.json"
    runner = CliRunner()
    compiled = runner.invoke(main, ["compile", "plans/case4.problem.json", "--max-staging-mb", "16", "-o", str(out)])
    assert compiled.exit_code == 0 and "staging at most 16.0 MiB per device" in compiled.output
    text = runner.invoke(main, ["inspect", str(out)]).output
    assert "device order 16.0 MiB" in text and "stated staging: limit 16.0 MiB per device (--max-staging-mb 16)" in text
    assert "stated staging right" in runner.invoke(main, ["verify", str(out)]).output
    plan = load_plan(out)
    device = min(plan.staging.peak_bytes)
    wrong = plan.model_copy(update={"staging": plan.staging.model_copy(update={"peak_bytes": {**plan.staging.peak_bytes, device: 1}})})
    with pytest.raises(PlanError, match=f"states 1 B for device {device}, but the plan needs"):
        verify_plan(wrong)
    low = plan.model_copy(update={"staging": plan.staging.model_copy(update={"limit_bytes": 1024})})
    with pytest.raises(PlanError, match="above the plan's limit"):
        verify_plan(low)
    assert "posted order 256.0 MiB" in runner.invoke(main, ["inspect", "plans/case4.plan.json"]).output


def test_the_executor_refuses_an_order_that_needs_more_than_the_stated_peak():
    plan = compile_plan(fixed_problems()[0], solver="greedy", seed=0, max_staging_bytes=40)
    device = max(plan.staging.peak_bytes, key=plan.staging.peak_bytes.get)
    posted = lower(plan, device)
    assert posted.stage_bytes > plan.staging.peak_bytes[device]
    with pytest.raises(PlanMismatchError, match="order='posted' needs .* run it with order='device'"):
        check_staging(plan, posted, "posted")
    ordered = in_device_order(posted, stage_budget(plan))
    assert check_staging(plan, ordered, "device") is ordered
    assert nccl_program(ordered).stage_bytes <= ordered.stage_bytes  # one CUDA stream: the largest box


def test_a_scaled_plan_restates_its_staging():
    plan = compile_plan(fixed_problems()[0], solver="greedy", seed=0, max_staging_bytes=64)
    scaled = scale_plan(plan, (2, 1, 1))
    assert scaled.staging.limit_bytes == 32
    verify_plan(scaled)


@pytest.mark.mpi
@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec at {MPIEXEC} (install the mpich wheel)")
@pytest.mark.timeout(600)
def test_limited_plans_run_bit_exact_under_mpiexec_in_device_order_and_posted_within_the_limit(tmp_path):
    """Real MPI, the executor's default order: every fixed case under a limit of a few elements, and posted order within it."""
    plans = [compile_plan(p, strategy=s, solver="greedy", seed=0, max_staging_bytes=4 * p.itemsize)
             for p in fixed_problems() for s in ("broadcast", "local_allgather")]
    assert all(plan.staging.peak_bytes for plan in plans[:2])
    assert all(max(plan.staging.peak_bytes.values(), default=0) <= 4 * plan.problem.itemsize for plan in plans)
    paths = write_plans(tmp_path, plans)
    result = mpiexec(DEVICES, str(WORKER), "check", *paths)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ok ") == len(plans), result.stdout
    posted = mpiexec(DEVICES, "-m", "xmesh_plan.executor.run", paths[0], "--order", "posted", "--check")
    assert posted.returncode == 0 and "bit-exact" in posted.stdout, posted.stdout + posted.stderr[-3000:]
    assert f"staging {4 * plans[0].problem.itemsize} B/rank at most (posted order)" in posted.stdout, posted.stdout
