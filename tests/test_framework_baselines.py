"""The RL frameworks' weight-sync baselines (`planner/baselines.py`): times against the simulator's
formulas by hand, bytes on every NIC side against an independent count, every destination element delivered."""

from __future__ import annotations

import tomllib

import numpy as np
import pytest

from xmesh_plan.planner.baselines import BASELINES, baseline_operations, baseline_seconds
from xmesh_plan.planner.simulate import _Lowering, simulate
from xmesh_plan.planner.transfer_io import build_transfer
from xmesh_plan.planner.weight_sync import WEIGHT_SYNC, weight_sync_toml

from tests.support.builders import make_problem

RL_BASELINES = ("rank0-gather-broadcast", "per-rank-broadcast")
TWO_PER_HOST = {"cluster": {"devices_per_host": 2}}  # 10 Gbit/s NIC, 800 Gbit/s inside a host, 20 us latency, 1 us overhead
NIC, INTRA, LATENCY, OVERHEAD = 10e9 / 8, 800e9 / 8, 20e-6, 1e-6


def one_host_to_two(dst_spec: str):
    """1 MiB (1024x256 float32) from devices 0,1 on host 0 (rows split) to devices 2,3 (host 1) and 4,5 (host 2)."""
    return make_problem((1024, 256), "1x2", "S1 R", "2x2", dst_spec, **TWO_PER_HOST)


def test_rank0_time_is_the_gather_then_the_pipelined_broadcast():
    """Device 1 sends its 512 KiB to device 0 (one intra-host message: overhead, bytes, latency); then
    device 0 broadcasts the whole MiB down 0 -> 2 -> 3 -> 4 -> 5 (cross, intra, cross, intra) in K chunks:
    `A L + sum(c_h) + (K-1) max(c_h)` (planner/simulate.py's docstring)."""
    p = one_host_to_two("S1 R")
    ops = BASELINES["rank0-gather-broadcast"](p)
    assert [(o.kind, o.src, o.dsts) for o in ops] == [("send", 1, (0,)), ("broadcast", 0, (2, 3, 4, 5))]
    gather = OVERHEAD + 2**19 / INTRA + LATENCY
    k = ops[1].chunks
    assert k > 1
    cross, intra = OVERHEAD + 2**20 / k / NIC, OVERHEAD + 2**20 / k / INTRA
    broadcast = 4 * LATENCY + 2 * cross + 2 * intra + (k - 1) * cross
    result = simulate(ops, p, "device-order")
    assert result.op_start_s[1] == pytest.approx(gather, rel=1e-9)  # the broadcast waits for the gather to arrive
    assert result.makespan_s == pytest.approx(gather + broadcast, rel=1e-9)
    assert baseline_seconds(p, "rank0-gather-broadcast") == result.makespan_s


def test_per_rank_broadcasts_run_at_once_and_share_the_nics():
    """Rows 0:512 (device 0) go to devices 2 and 4, rows 512:1024 (device 1) to 3 and 5: two chains of two
    cross-host hops at once, each chunk sharing its NIC sides with the other chain's, so every chunk
    takes twice its lone time c: `2 L + (K+1) 2c`."""
    p = one_host_to_two("S1 R")
    ops = BASELINES["per-rank-broadcast"](p)
    assert [(o.kind, o.src, o.dsts, o.region) for o in ops] == [
        ("broadcast", 0, (2, 4), ((0, 512), (0, 256))), ("broadcast", 1, (3, 5), ((512, 1024), (0, 256)))]
    k = ops[0].chunks
    assert k > 1 and ops[1].chunks == k
    shared = 2 * (OVERHEAD + 2**19 / k / NIC)
    result = simulate(ops, p, "device-order")
    assert result.op_start_s[0] == result.op_start_s[1] == 0.0
    assert result.makespan_s == pytest.approx(2 * LATENCY + (k + 1) * shared, rel=1e-9)


def nic_bytes(ops, problem) -> dict[str, float]:
    """Bytes the simulator puts on each NIC side (`h2.recv`), NICs of one host added up."""
    lowering = _Lowering(problem, "device-order", None)
    for op in ops:
        lowering.add(op)
    out: dict[str, float] = {}
    for flow in lowering.flows:
        for link in flow.links:
            if link.startswith("h"):
                side = link.split(":")[0]
                out[side] = out.get(side, 0.0) + flow.nbytes
    return out


@pytest.mark.parametrize("name,expected", [
    # gather: host 1's two blocks (32 B each) into device 0; broadcast: the whole 128 B into host 2, then host 3
    ("rank0-gather-broadcast", {"h0.recv": 64, "h1.send": 64, "h0.send": 128, "h2.recv": 128, "h2.send": 128, "h3.recv": 128}),
    # each 32 B block to the device on host 2 that needs it, then on to host 3's: 4 blocks into and out of host 2
    ("per-rank-broadcast", {"h0.send": 64, "h1.send": 64, "h2.recv": 128, "h2.send": 128, "h3.recv": 128}),
])
@pytest.mark.parametrize("nics", [1, 2])
def test_bytes_on_every_nic_side_match_a_hand_count(name, expected, nics):
    """8x4 float32 (128 B), rows over 4 devices on hosts 0-1 -> rows over the 2 devices of each of hosts 2-3
    (a replica per host); with two NICs a message is striped, so each host's total stays the same."""
    cluster = {"devices_per_host": 2, "nics": [{"send_gbps": 10, "recv_gbps": 10}] * nics}
    p = make_problem((8, 4), "2x2", "S01 R", "2x2", "S1 R", cluster=cluster)
    got = nic_bytes(BASELINES[name](p), p)
    assert {side: b for side, b in got.items() if b} == pytest.approx(expected, rel=1e-12)


def test_rank0_gathers_a_replicated_block_from_its_own_host():
    """Columns split over each host's two devices, replicated over hosts 0 and 1: device 1 (beside the
    root) sends the other half, not device 3 on host 1, so nothing enters host 0's NIC."""
    p = make_problem((8, 4), "2x2", "R S1", "2x2", "S1 R", **TWO_PER_HOST)
    ops = BASELINES["rank0-gather-broadcast"](p)
    assert [(o.kind, o.src) for o in ops] == [("send", 1), ("broadcast", 0)]
    assert "h0.recv" not in nic_bytes(ops, p)


def weight_sync_small():
    return build_transfer(tomllib.loads(weight_sync_toml(*WEIGHT_SYNC["weight_sync_small"])))


def test_weight_sync_bytes_match_a_count_from_the_shards():
    """On the small weight sync, counted from the shards alone: rank 0's host receives every block held
    off it, and each destination host receives every tensor once; per rank, a destination host receives a
    block once when any of its devices needs any of it."""
    p = weight_sync_small()
    host = p.cluster.host_of
    root, singles = p.src_mesh.devices[0], p.tensor_problems()
    dst_hosts = sorted({host(d) for d in p.dst_mesh.devices})
    off_root = sum(np.prod([b - a for a, b in block]) * s.itemsize
                   for s in singles for block in set(b for d, b in s.blocks("src").items() if host(d) != host(root)))
    rank0 = nic_bytes(baseline_operations(p, "rank0-gather-broadcast"), p)
    assert rank0[f"h{host(root)}.recv"] == pytest.approx(off_root)
    for h in dst_hosts:
        assert rank0[f"h{h}.recv"] == pytest.approx(p.nbytes)
    per_rank = nic_bytes(baseline_operations(p, "per-rank-broadcast"), p)
    for h in dst_hosts:
        wanted = 0
        for s in singles:
            needs = [box for d, box in s.blocks("dst").items() if host(d) == h]
            for block in set(s.blocks("src").values()):
                if any(all(max(a0, b0) < min(a1, b1) for (a0, a1), (b0, b1) in zip(block, box)) for box in needs):
                    wanted += np.prod([b - a for a, b in block]) * s.itemsize
        assert per_rank[f"h{h}.recv"] == pytest.approx(wanted)


def delivered_everything(ops, problem) -> None:
    """Replay the list on boolean arrays: a sender must hold what it sends (its source shard, or what an
    earlier operation brought it), and at the end every destination device holds its whole shard. List
    order is a valid data order here: the baselines run in device order, where a device's operations go
    in list order, and a device only gains data from operations it takes part in."""
    held = {}
    for d, (box) in problem.blocks("src").items():
        held[d] = np.zeros(problem.shape, dtype=bool)
        held[d][tuple(slice(a, b) for a, b in box)] = True
    for d in problem.blocks("dst"):
        held.setdefault(d, np.zeros(problem.shape, dtype=bool))
    for op in ops:
        idx = tuple(slice(a, b) for a, b in op.region)
        if op.kind == "allgather":
            for d, part in zip(op.dsts, op.parts):
                assert held[d][tuple(slice(a, b) for a, b in part)].all(), f"{op}: d{d} lacks its part"
        else:
            assert held[op.src][idx].all(), f"{op}: d{op.src} sends what it does not hold"
        for d in op.dsts:
            held[d][idx] = True
    for d, box in problem.blocks("dst").items():
        missing = ~held[d][tuple(slice(a, b) for a, b in box)]
        assert not missing.any(), f"destination device {d} misses {int(missing.sum())} elements of its shard {box}"


COVERAGE_CASES = {
    "2x2 rows -> 2x2 replicas of rows": ((8, 4), "2x2", "S01 R", "2x2", "S1 R", TWO_PER_HOST),
    "replicated source, split columns": ((8, 6), "2x2", "R S1", "1x2", "S0 S1", TWO_PER_HOST),
    "uneven, an empty block": ((3, 5), "1x4", "S1 R", "2x2", "R S0", {}),
    "overlapping meshes, root is a destination": ((6, 4), {"shape": [1, 2], "devices": [0, 1]}, "S1 R",
                                                 {"shape": [1, 2], "devices": [0, 1]}, "R S1", TWO_PER_HOST),
}


@pytest.mark.parametrize("name", sorted(BASELINES))
@pytest.mark.parametrize("case", sorted(COVERAGE_CASES))
def test_every_baseline_delivers_every_destination_element(name, case):
    shape, src_mesh, src_spec, dst_mesh, dst_spec, extra = COVERAGE_CASES[case]
    p = make_problem(shape, src_mesh, src_spec, dst_mesh, dst_spec, **extra)
    delivered_everything(BASELINES[name](p), p)


@pytest.mark.parametrize("name", RL_BASELINES)
def test_a_broken_list_fails_the_coverage_check(name):
    """The check above can fail: drop one broadcast and some destination device misses its shard."""
    p = make_problem((8, 4), "2x2", "S01 R", "2x2", "S1 R", **TWO_PER_HOST)
    ops = BASELINES[name](p)
    last = max(i for i, o in enumerate(ops) if o.kind == "broadcast")
    with pytest.raises(AssertionError, match="misses"):
        delivered_everything(ops[:last] + ops[last + 1:], p)


@pytest.mark.parametrize("name", RL_BASELINES)
def test_multi_tensor_lists_go_tensor_after_tensor_and_cover_every_tensor(name):
    p = weight_sync_small()
    ops = baseline_operations(p, name)
    tensors = [op.tensor for op in ops]
    assert tensors == sorted(tensors) and set(tensors) == set(range(len(p.tensors)))
    assert [op.id for op in ops] == list(range(len(ops)))
    for k, single in enumerate(p.tensor_problems()):
        delivered_everything([op for op in ops if op.tensor == k], single)
    assert baseline_seconds(p, name) == baseline_seconds(p, name)  # same input, same figure


def test_unknown_baseline_names_the_valid_ones():
    p = one_host_to_two("S1 R")
    with pytest.raises(ValueError, match="unknown baseline 'rank0'; choose one of: alpa-send-recv, alpa-allgather, "
                                         "rank0-gather-broadcast, per-rank-broadcast"):
        baseline_seconds(p, "rank0")
