"""The simulator's device order follows the executor's runs, which a staging budget also ends.

In device order the executor runs a device's consecutive operations with the same peers together; with
a staging budget (`compile --max-staging-mb`) a run also ends before it would stage more than the
budget (`schemas.staging.device_layout`), and the next run waits for the one before. The simulator takes
those runs (`run_numbers`, `simulate.staging_runs`) so a limited plan's stated time is the one it runs in."""

from __future__ import annotations

import pytest

from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.simulate import nic_assignment, simulate, simulate_plan, staging_runs
from xmesh_plan.planner.transfer_io import build_transfer
from xmesh_plan.schemas import Operation
from xmesh_plan.schemas.staging import device_runs, footprints, staging_align


def _problem(latency_us: float = 1000.0):
    return build_transfer({"name": "two", "src_mesh": {"shape": [1], "devices": [0]}, "dst_mesh": {"shape": [1], "devices": [1]},
                           "cluster": {"devices_per_host": 1, "latency_us": latency_us, "overhead_us": 0.0},
                           "tensors": [{"name": "a", "shape": [1024], "dtype": "float32", "src": "R", "dst": "R"},
                                       {"name": "b", "shape": [1024], "dtype": "float32", "src": "R", "dst": "R"}]})


def test_a_run_cut_in_two_waits_for_the_first_half_to_arrive():
    """Two sends d0 -> d1 (other hosts): in one run the second follows the first on the link (one latency
    in all); cut into two runs the second starts once the first has arrived (two latencies): hand formula."""
    problem = _problem()
    ops = [Operation(id=k, task=k, tensor=k, kind="send", src=0, dsts=(1,), region=((0, 1024),)) for k in range(2)]
    wire = 1024 * 4 / problem.cluster.message_bytes_per_s
    latency = problem.cluster.latency_s
    together = simulate(ops, problem, "device-order", run_numbers={0: [0, 0], 1: [0, 0]}).makespan_s
    apart = simulate(ops, problem, "device-order", run_numbers={0: [0, 1], 1: [0, 1]}).makespan_s
    assert together == pytest.approx(2 * wire + latency, rel=1e-6)
    assert apart == pytest.approx(2 * wire + 2 * latency, rel=1e-6)
    assert simulate(ops, problem, "device-order").makespan_s == pytest.approx(together)  # no budget: the peers decide


def test_a_limited_plan_states_its_time_in_the_runs_its_budget_makes():
    """A random transfer under a 64-byte budget: the budget cuts runs the peers alone would not, the device-order
    simulation of the plan keeps those runs and is later than the peers' runs alone predict; the plan states its time
    posted within the budget (the executor's default on MPI)."""
    from tests.support.transfer import random_transfer

    plan = compile_plan(random_transfer(1, 8), solver="greedy", max_staging_bytes=64)
    f, align = footprints(plan), staging_align(plan)
    runs = staging_runs(plan)
    assert runs == {d: device_runs(v, 64, align) for d, v in f.items()}
    assert sum(max(r) for r in runs.values()) > sum(max(device_runs(v, None, align)) for v in f.values())
    stated = plan.executor_prediction
    assert stated.order == "posted"
    assert stated.predicted_seconds == pytest.approx(simulate(plan.operations, plan.problem, "window", nic_assignment(plan.host_order),
                                                              window_bytes=64).makespan_s, abs=1e-12)
    # later by what the cut runs cost on this plan (1.09x since the schedule books only busy time; the factor is the plan's)
    assert simulate_plan(plan, "device-order").makespan_s > simulate(plan.operations, plan.problem, "device-order").makespan_s
    assert staging_runs(compile_plan(_problem(), solver="greedy")) is None
