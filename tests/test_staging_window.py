"""Posted within a staging window (`schemas.staging.window_layout`, `executor.window`, the simulator's `window`
discipline): no two operations that may be unfinished at once share a staging byte, an operation waits only for
earlier ones (so the plan's earliest unfinished operation never waits: no deadlock), staging stays within the window,
and the time lies between posted's and device order's."""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.simulate import nic_assignment, simulate, staging_runs, window_waits
from xmesh_plan.planner.transfer_io import load_any_problem
from xmesh_plan.schemas.staging import footprints, staging_align, staging_peaks, window_layout, window_peak
from tests.support.transfer import random_transfer

SMALL = Path(__file__).resolve().parents[1] / "plans" / "weight_sync_small.problem.toml"


def closure(waits: list[tuple[int, ...]], k: int) -> set[int]:
    """Every operation that has finished once operation k may start: what it waits for, and what those waited for."""
    out, stack = set(), list(waits[k])
    while stack:
        j = stack.pop()
        if j not in out:
            out.add(j)
            stack.extend(waits[j])
    return out


@settings(max_examples=300, deadline=None)
@given(sizes=st.lists(st.integers(0, 40), max_size=40), budget=st.integers(1, 64), align=st.sampled_from([1, 2, 4, 8]))
def test_an_operation_starts_only_once_every_earlier_user_of_its_bytes_has_finished(sizes, budget, align):
    layout = window_layout(sizes, budget, align)
    waits = [w for _, w in layout]
    for k, ((start, mine), n) in enumerate(zip(layout, sizes)):
        assert all(j < k for j in mine)  # only earlier operations: the plan's earliest unfinished one waits for nothing
        if not n:
            assert mine == ()
            continue
        assert start % align == 0 and (start + n <= budget or start == 0)
        done = closure(waits, k)
        for j in range(k):
            other, m = layout[j][0], sizes[j]
            if m and other < start + n and start < other + m:
                assert j in done, (k, j)
    assert window_peak(sizes, budget, align) <= max([budget, *sizes])


def test_an_operation_larger_than_the_window_runs_alone():
    layout = window_layout([3, 3, 20, 3], budget=8)
    assert layout[2] == (0, (0, 1)) and layout[3] == (0, (2,))


def test_the_small_weight_sync_in_a_window_stays_within_it_and_times_between_posted_and_device_order():
    limit = 2**18
    plan = compile_plan(load_any_problem(SMALL), solver="greedy", max_staging_bytes=limit)
    nic = nic_assignment(plan.host_order)
    posted = simulate(plan.operations, plan.problem, "posted", nic).makespan_s
    device = simulate(plan.operations, plan.problem, "device-order", nic, run_numbers=staging_runs(plan)).makespan_s
    window = simulate(plan.operations, plan.problem, "window", nic, window_bytes=limit).makespan_s
    assert posted <= window < device
    peaks = staging_peaks(plan, "posted")  # posted within the plan's limit
    assert 0 < max(peaks.values()) <= limit < max(sum(n for _, n in f) for f in footprints(plan).values())
    assert peaks == {d: v for d, f in footprints(plan).items() if (v := window_peak([n for _, n in f], limit, staging_align(plan)))}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), devices=st.integers(2, 9), window=st.sampled_from([8, 64, 512]))
def test_random_transfers_in_a_tiny_window_finish_and_wait_only_for_earlier_operations(seed, devices, window):
    plan = compile_plan(random_transfer(seed, devices), solver="greedy", seed=0)
    order = {op.id: k for k, op in enumerate(plan.operations)}
    for head, per_device in window_waits(plan.operations, plan.problem, window).items():
        assert all(order[j] < order[head] for earlier in per_device.values() for j in earlier)
    result = simulate(plan.operations, plan.problem, "window", nic_assignment(plan.host_order), window_bytes=window)
    assert set(result.op_end_s) == {op.id for op in plan.operations}  # every operation ran (a wait cycle would raise)
