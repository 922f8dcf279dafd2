"""Posted within a staging window (`schemas.staging.window_layout`, `executor.window`, the simulator's `window`
discipline): no two operations that may be unfinished at once share a staging byte, an operation waits only for
earlier ones (so the plan's earliest unfinished operation never waits: no deadlock), staging stays within the window,
and the time lies between posted's and device order's."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xmesh_plan.executor.passes import shared_program
from xmesh_plan.executor.ranks import plan_devices
from xmesh_plan.executor.window import in_window, staging_waits
from xmesh_plan.planner.compile import DIGITS, compile_plan
from xmesh_plan.planner.simulate import lower, nic_assignment, run_flows, simulate, simulate_plan, staging_runs, window_waits
from xmesh_plan.planner.transfer_io import load_any_problem
from xmesh_plan.schemas.staging import footprints, stage_budget, staging_align, staging_peaks, window_layout, window_peak
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


def _limited_plans():
    """A few plans that state a staging limit and wait in their windows: the small weight sync, and random transfers."""
    small = load_any_problem(SMALL)
    yield "small@64KiB", compile_plan(small, solver="greedy", max_staging_bytes=2**16)
    yield "small@256KiB", compile_plan(small, solver="greedy", max_staging_bytes=2**18)
    for seed, limit, coalesce in ((1, 16, False), (3, 64, True), (7, 200, False), (11, 64, False)):
        yield f"random{seed}@{limit}", compile_plan(random_transfer(seed, 8), solver="greedy", seed=0,
                                                    max_staging_bytes=limit, coalesce=coalesce)


def test_the_simulators_window_waits_are_the_ones_the_mpi_engine_makes_per_device_and_operation():
    """`window_waits` (what the simulator times) against `executor.window.staging_waits` on each device's program
    before `in_window` (what the engine waits for), and `in_window`'s steps waiting for those operations' last steps."""
    waited = 0
    for label, plan in _limited_plans():
        simulated: dict[int, dict[int, tuple[int, ...]]] = {}
        for head, per_device in window_waits(plan.operations, plan.problem, stage_budget(plan)).items():
            for device, earlier in per_device.items():
                simulated.setdefault(device, {})[head] = earlier
        for device in plan_devices(plan):
            program, carriers = shared_program(plan, device, 2**29)
            made = staging_waits(program, stage_budget(plan), program.align, carriers)
            assert made == simulated.get(device, {}), (label, device)
            waited += sum(map(len, made.values()))
            windowed = in_window(program, stage_budget(plan), program.align, carriers)
            keys = [carriers.get(s.op, s.op) for s in program.steps]
            for s, k in zip(windowed.steps, keys):
                if s.action.reads_staging_first:
                    for j in made.get(k, ()):
                        ends = [t.index for t, key in zip(program.steps, keys) if key == j
                                and not any(keys[u] == j and t.index in program.steps[u].deps for u in range(len(keys)))]
                        assert set(ends) <= set(s.deps), (label, device, k, j)
    assert waited > 50  # the plans wait somewhere, so dropping waits on either side is seen


def test_the_window_discipline_starts_an_operations_messages_at_a_device_once_what_it_waits_for_there_is_done():
    """Timed in the window discipline, each operation's messages to or from a device start once the earlier
    operations `window_waits` names there have finished on that device (what they sent it arrived, what they sent
    from it left); a plan with waits times slower than posted."""
    checked = 0
    for label, plan in _limited_plans():
        waits = window_waits(plan.operations, plan.problem, stage_budget(plan))
        lowering, _ = lower(plan.operations, plan.problem, "window", nic_assignment(plan.host_order), window=waits)
        spans = run_flows(lowering.flows, lowering.capacity)
        ends = lambda f, d: [spans[f.id][1] - (0.0 if b == d else f.latency_s)  # into d: arrived; out of d: left
                             for a, b in [tuple(map(int, f.queue.split(":")[0].split(">")))] if d in (a, b)]
        by_op: dict[int, list] = {}
        for f in lowering.flows:  # a message between two devices is on its connection (a>b:stripe); a local copy waits for no window
            assert f.queue or all(link.endswith(".copy") for link in f.links), (label, f)
            if f.queue:
                by_op.setdefault(f.op, []).append(f)
        for head, per_device in waits.items():
            for device, earlier in per_device.items():
                done = max((t for j in earlier for f in by_op.get(j, ()) for t in ends(f, device)), default=0.0)
                starts = [spans[f.id][0] for f in by_op.get(head, ()) if ends(f, device)]
                assert all(t >= done - 1e-12 for t in starts), (label, head, device)
                checked += bool(earlier and starts)
        if label.startswith("small"):
            assert simulate_plan(plan, "window").makespan_s > simulate_plan(plan, "posted").makespan_s, label
    assert checked > 50


def test_simulate_plan_times_a_limited_plan_in_its_window_as_compile_states_it():
    plan = compile_plan(load_any_problem(SMALL), solver="greedy", max_staging_bytes=2**18)
    assert round(simulate_plan(plan, "window").makespan_s, DIGITS) == plan.executor_prediction.predicted_seconds
    unlimited = compile_plan(load_any_problem(SMALL), solver="greedy")
    with pytest.raises(ValueError, match="states none.*--max-staging-mb"):
        simulate_plan(unlimited, "window")
