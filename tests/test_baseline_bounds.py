"""Baselines at frontier scale from their bytes over links and devices (`planner/baseline_bounds.py`): never above
what the simulator gives the same operations, counted once per kind exactly as tensor by tensor, and by hand on a
small case; checkpoint-engine's broadcast; the problem's bound without a compile; one plan per tensor back to back."""

from __future__ import annotations

import tomllib
from collections import Counter

import pytest

from xmesh_plan.planner.baseline_bounds import (Loads, baseline_estimate, operation_loads, per_tensor_plans_seconds,
                                                problem_bound)
from xmesh_plan.planner.baselines import BASELINES, baseline_operations, baseline_seconds
from xmesh_plan.planner.compile import compile_plan
from xmesh_plan.planner.simulate import simulate
from xmesh_plan.planner.transfer_io import build_transfer
from xmesh_plan.planner.weight_sync import WEIGHT_SYNC, weight_sync_toml

from tests.support.builders import make_problem

ESTIMATED = ("checkpoint-engine-broadcast", "rank0-gather-broadcast", "per-rank-broadcast")
BIG_NICS = {"devices_per_host": 4, "nics": [{"send_gbps": 400, "recv_gbps": 400}] * 2, "intra_host_gbps": 2400, "latency_us": 10}


def small_sync():
    return build_transfer(tomllib.loads(weight_sync_toml(*WEIGHT_SYNC["weight_sync_small"])))


CASES = {  # name -> problem: large messages (held senders) and small ones (buffered), one and two NICs
    "weight_sync_small": small_sync,
    "rows 2x4 -> 2x4 TP, 64 MiB": lambda: make_problem((4096, 4096), "2x4", "S01 R", "2x4", "R S1", cluster=BIG_NICS),
    "cols 1x4 -> 2x2, 16 MiB": lambda: make_problem((1024, 4096), "1x4", "R S1", "2x2", "S0 S1", cluster=BIG_NICS),
}


@pytest.mark.parametrize("name", ESTIMATED)
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_estimate_is_never_above_the_simulated_time(name, case):
    p = CASES[case]()
    estimate = baseline_estimate(p, name).seconds
    assert 0 < estimate <= baseline_seconds(p, name, max_tasks=None) * (1 + 1e-9)


@pytest.mark.parametrize("name", ESTIMATED)
def test_counting_each_kind_once_gives_what_every_tensor_counted_gives(name):
    p = small_sync()
    links, devices = Counter(), Counter()
    for single in p.tensor_problems():
        loads = operation_loads(BASELINES[name](single), single)
        links.update(loads.links)
        devices.update(loads.devices)
    assert baseline_estimate(p, name).seconds == pytest.approx(Loads(dict(links), dict(devices)).seconds(), rel=1e-12)


def test_rank0_is_held_by_every_gather_and_its_broadcast_in_turn():
    """64 MiB float32 rows over 8 devices (hosts 0-1) -> column TP over hosts 2-3 (2 replicas): rank 0 takes 3 blocks
    of 8 MiB from its host (intra-host rate) and 4 over the NICs (both NICs' rate), then sends the whole 64 MiB over
    the NICs; nothing else is as busy."""
    p = CASES["rows 2x4 -> 2x4 TP, 64 MiB"]()
    block, nic, intra = 8 * 2**20, 2 * 400e9 / 8, 2400e9 / 8
    estimate = baseline_estimate(p, "rank0-gather-broadcast")
    assert estimate.busiest == "device 0"
    assert estimate.seconds == pytest.approx(3 * block / intra + 4 * block / nic + 8 * block / nic, rel=1e-12)


def test_checkpoint_engine_sends_every_block_to_every_destination_device():
    """Each inference rank receives the whole tensor, not only its part: each destination host takes in all 64 MiB
    over its two NICs (host 2 also passes it on to host 3). Where a device needs only some blocks (columns over host 0
    -> a 2x2 grid, a row per host), per-rank broadcast brings each column block to the one device of each host needing
    it (no hop inside a host), checkpoint-engine to both (one hop inside each host)."""
    p = CASES["rows 2x4 -> 2x4 TP, 64 MiB"]()
    ops = BASELINES["checkpoint-engine-broadcast"](p)
    dst = set(p.dst.mesh.devices)
    assert len(ops) == 8 and all(o.kind == "broadcast" and set(o.dsts) == dst for o in ops)
    estimate = baseline_estimate(p, "checkpoint-engine-broadcast")
    assert estimate.seconds == pytest.approx(64 * 2**20 / (2 * 400e9 / 8), rel=1e-12)
    assert estimate.busiest in ("h2.recv", "h2.send", "h3.recv")
    grid = CASES["cols 1x4 -> 2x2, 16 MiB"]()
    intake = {name: sum(s for link, s in operation_loads(BASELINES[name](grid), grid).links.items() if link.endswith(".in"))
              for name in ("per-rank-broadcast", "checkpoint-engine-broadcast")}
    assert intake["per-rank-broadcast"] == 0
    assert intake["checkpoint-engine-broadcast"] == pytest.approx(2 * 16 * 2**20 / (2400e9 / 8), rel=1e-12)


def test_the_problem_bound_is_the_one_a_compile_states():
    p = small_sync()
    assert problem_bound(p).seconds == pytest.approx(compile_plan(p).lower_bound_seconds, rel=1e-6)


def test_one_plan_per_tensor_is_every_tensor_planned_alone_one_after_another():
    p = small_sync()
    plans = per_tensor_plans_seconds(p)
    alone = [simulate(compile_plan(single).operations, single, "device-order").makespan_s for single in p.tensor_problems()]
    assert plans.seconds == pytest.approx(sum(alone), rel=1e-9)
    assert sum(count for _, count, _ in plans.kinds) == len(p.tensors) > len(plans.kinds)
    assert plans.kinds[0][0] == p.tensors[0].name


def test_multi_tensor_checkpoint_engine_list_covers_every_tensor():
    p = small_sync()
    ops = baseline_operations(p, "checkpoint-engine-broadcast")
    assert {op.tensor for op in ops} == set(range(len(p.tensors)))
