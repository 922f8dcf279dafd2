"""The torch engine on gloo: several processes on the CPU, every destination shard bit-exact, failures in time.

Ranks are plain subprocesses given env:// variables (as torchrun sets them), so a rank that dies
does not take the others down with it (torchrun's agent would); one test runs the documented
torchrun command itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from xmesh_plan.executor.scale import factors_for, scale_plan
from xmesh_plan.schemas import load_plan
from tests.support.cases import (DEVICES, all_fixed_plans, compiled, fixed_problems, random_problem,
                                 two_chunked_broadcasts_from_one_device, write_plans)
from tests.support.builders import make_problem
from tests.support.launch import TORCH_LAUNCH_TIMEOUT_S, launch, run_ranks, torchrun

ROOT = Path(__file__).resolve().parents[1]
PLANS = ROOT / "plans"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2 * TORCH_LAUNCH_TIMEOUT_S)]


def small(plans, max_bytes: int = 64 * 1024):
    return [scale_plan(p, factors_for(p, max_bytes)) for p in plans]


# The checks below share one launch of 16 gloo ranks (`batch`): each runs its mode on its plans with the first
# `ranks` ranks as a process group of their own, as its own launch did (16 processes importing torch take about as long
# as the check itself on a 2-core machine; the dead-rank and torchrun tests keep launches of their own).
REFERENCE = {12: ["case7", "case8"], 16: ["case1", "case2", "case3", "case4", "case5", "case9"]}


def _by_order_plans():
    return all_fixed_plans() + [compiled(random_problem(seed), "auto") for seed in range(6)]


def _receipt_plans():
    return [p for p in all_fixed_plans() if p.strategy in ("global_allgather", "broadcast")]


def _multi_tensor_plans():
    from xmesh_plan.planner.compile import compile_plan
    from tests.support.transfer import random_transfer, three_tensors

    chained = {"split_hosts": False, "coalesce": False}  # every strategy's own operations, no bundles
    plans = [compile_plan(three_tensors(), strategy=s, solver="greedy", **chained) for s in ("broadcast", "send_recv", "local_allgather")]
    return plans + [compile_plan(random_transfer(seed, 6, exact=True), strategy="auto", solver="greedy", **chained) for seed in range(4)]


def _float8_plans():
    from tests.support.cases import problem

    return [compiled(problem(f"f8_{dtype}", (6, 10), (2,), (0, 1), "S0 R", (2, 2), range(4), "R S01", dtype=dtype), strategy)
            for dtype in ("float8_e4m3fn", "float8_e5m2") for strategy in ("send_recv", "global_allgather")]


def _jobs():
    """(name, mode, ranks, plans) of every check the shared launch runs (the reference plans' where compiled)."""
    reference = [(f"reference{n}", "check", n, small([load_plan(PLANS / f"{name}.plan.json") for name in names]))
                 for n, names in REFERENCE.items() if all((PLANS / f"{name}.plan.json").exists() for name in names)]
    return reference + [
        ("by_order", "check_by_order", DEVICES, _by_order_plans()),
        ("device_order", "check_in_device_order", DEVICES, all_fixed_plans()),
        ("device_order_mixed", "check_in_device_order_mixed_receipts", DEVICES, all_fixed_plans()),
        ("receipts", "check_in_device_order_with_receipts", DEVICES, _receipt_plans()),
        ("multi_tensor", "check_transfer_by_order", 6, _multi_tensor_plans()),
        ("float8", "check", 4, _float8_plans()),
        ("disagree", "disagree", DEVICES, [compiled(fixed_problems()[0], s) for s in ("send_recv", "broadcast")])]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """Job name -> (its plan files, the `rank R: ...` lines its ranks printed, the job's name taken out); every rank
    of the one launch succeeded."""
    folder = tmp_path_factory.mktemp("shared")
    jobs = []
    for name, mode, ranks, plans in _jobs():
        (folder / name).mkdir()
        jobs.append({"name": name, "mode": mode, "ranks": ranks, "plans": write_plans(folder / name, plans)})
    (folder / "jobs.json").write_text(json.dumps(jobs))
    out = {job["name"]: (job["plans"], []) for job in jobs}
    for line in launch(16, "batch", str(folder / "jobs.json")):
        rank, name, rest = line.split(": ", 2)
        out[name][1].append(f"{rank}: {rest}")
    return out


def test_fixed_and_random_plans_are_bit_exact_on_8_gloo_ranks(shared):
    """Every strategy on disjoint, overlapping, uneven problems (bfloat16, float16, complex128, int8 ...),
    chunked broadcasts and seeded random problems: 3 iterations each, every shard bit-exact. Every message
    has tag 0, so gloo matches each pair's messages in posting order, as NCCL does: the engine's posting
    order (the one it uses on NCCL) must agree at both ends of every pair."""
    plans = _by_order_plans()
    assert {"bfloat16", "float16", "complex128", "int8"} <= {p.problem.dtype for p in plans}
    assert {"copy", "send", "broadcast", "allgather"} <= {op.kind for p in plans for op in p.operations}
    assert any(op.chunks > 1 for p in plans for op in p.operations)
    overlapping = [p for p in plans if set(p.problem.src.mesh.devices) & set(p.problem.dst.mesh.devices)]
    assert overlapping
    paths, lines = shared["by_order"]
    ours = [line for line in lines if line.startswith("rank 0:")]
    assert len(ours) == len(paths) and all(line.endswith((": ok", ": ok (our boxes)")) for line in ours), lines
    by_dtensor = [line for line in ours if line.endswith(": ok")]  # shards compared with DTensor's own boxes
    assert len(by_dtensor) >= len(ours) * 3 // 4, ours


@pytest.mark.parametrize("mode", ["device_order", "device_order_mixed"])
def test_device_order_on_gloo_matching_by_order_is_bit_exact(shared, mode):
    """order="device" makes steps wait for sends of earlier operations; the engine must finish those sends
    in message order too (it deadlocked before), with every tag 0 as on NCCL. Again with receipts on the messages of
    16 B or more (these plans' are 2-192 B), so a plan's operations end both ways and both ends must place every
    receipt alike among the messages."""
    paths, lines = shared[mode]
    ours = [line for line in lines if line.startswith("rank 0:")]
    assert len(ours) == len(paths) == len(all_fixed_plans()) and all(line.endswith((": ok", ": ok (our boxes)")) for line in ours), lines


def test_receipts_in_device_order_on_gloo_with_its_tags_are_bit_exact(shared):
    """Receipts on every operation's messages between two devices, whatever their size (the engine's threshold is
    256 KiB), gloo matching by tag: a two-device ring step sends each way with one tag, so a receipt shares its tag
    with the data going its way, and both ends must post it after that data."""
    plans = _receipt_plans()
    assert any(op.kind == "allgather" and len(op.dsts) == 2 for p in plans for op in p.operations)
    paths, lines = shared["receipts"]
    ours = [line for line in lines if line.startswith("rank 0:")]
    assert len(ours) == len(plans) == len(paths) and all(line.endswith((": ok", ": ok (our boxes)")) for line in ours), lines


def test_multi_tensor_plans_in_device_order_on_gloo_matching_by_order_are_bit_exact(shared):
    """TransferExecutor's joint engine posts each pair's messages in the joint plan's operation order, across
    tensors; with every tag 0 (gloo matching by order, as NCCL) both ends must agree on that order, or bytes
    land in the wrong tensor. Three tensors of three dtypes, every strategy, and random multi-tensor plans; 6 ranks."""
    plans = _multi_tensor_plans()
    assert all(len({op.tensor for op in p.operations}) > 1 for p in plans[:3])
    assert {"copy", "send", "broadcast", "allgather"} <= {op.kind for p in plans for op in p.operations}
    paths, lines = shared["multi_tensor"]
    ours = [line for line in lines if line.startswith("rank 0:")]
    assert ours == [f"rank 0: {Path(p).name}: ok" for p in paths], lines
    assert len({line.split(":")[0] for line in lines}) == 6  # run by the plans' own number of ranks


def test_float8_plans_are_bit_exact(shared):
    paths, lines = shared["float8"]  # R S01 over 2x2 of 10: DTensor splits 3,2,3,2, we 3,3,3,1
    assert sorted(line for line in lines if line.startswith("rank 0:")) == sorted(
        f"rank 0: {Path(p).name}: ok (our boxes)" for p in paths)


@pytest.mark.parametrize("ranks", [12, 16])
def test_reference_plans_scaled_down_are_bit_exact(shared, ranks):
    if f"reference{ranks}" not in shared:
        pytest.skip("reference plans not compiled yet; run `make plans`")
    paths, lines = shared[f"reference{ranks}"]
    ours = [line for line in lines if line.startswith("rank 0:")]
    assert len(ours) == len(REFERENCE[ranks]) == len(paths) and all(line.endswith(": ok") for line in ours), lines  # every box DTensor's
    assert len({line.split(":")[0] for line in lines}) == ranks  # run by the plans' own number of ranks


def test_plan_disagreement_fails_on_every_rank_before_anything_moves(shared):
    _, lines = shared["disagree"]
    assert len(lines) == DEVICES and all("refused: rank 1 loaded a different plan than the other 7 ranks" in line for line in lines), lines


def test_a_dead_rank_ends_every_other_rank_within_the_deadline(tmp_path):
    path = write_plans(tmp_path, small([compiled(fixed_problems()[0], "broadcast")]))[0]
    lines = launch(DEVICES, "die", path)
    assert len(lines) == DEVICES - 1, lines
    waiting = [line for line in lines if "PeerTimeoutError" in line]
    assert waiting, lines  # the ranks that receive from or send to rank 7 (device 7)
    for line in waiting:
        seconds = float(line.split(" after ")[1].split(" s:")[0])
        assert seconds < 3 * 5.0, line  # the deadline is 5 s without progress (a dead peer is seen sooner: gloo closes the pair)
        assert "op " in line and "task " in line and "(rank " in line, line
    assert all("PeerTimeoutError" in line or line.endswith("finished") for line in lines), lines


def test_the_documented_torchrun_command_works(tmp_path):
    plan = small([compiled(fixed_problems()[1], "global_allgather")])[0]
    path = write_plans(tmp_path, [plan])[0]
    result = torchrun(DEVICES, "xmesh_plan.executor.torch_run", path, "--check", "--iters", "2", "--max-mb", "1")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "check ok: every destination shard bit-exact" in result.stdout, result.stdout


def test_the_torch_engine_posts_a_send_as_soon_as_its_chunk_is_packed(monkeypatch):
    """As the MPI engine (tests/test_executor_sim.py): when an operation's wait ends in device order, its first chunk's
    send is posted after its own pack, not after every chunk's. In process, on a stand-in group whose sends finish
    at once (one source device: it only sends)."""
    from xmesh_plan.executor import torch_engine

    events: list[tuple[str, int]] = []

    class Done:
        def wait(self):
            pass

    class Group:
        def send(self, buffer, peer, tag):
            events.append(("send", tag))
            return Done()

        def recv(self, buffer, peer, tag):
            raise AssertionError("the source device receives nothing")

    class Recording(torch_engine.TorchEngine):
        def _run_local(self, i):
            events.append((self.steps[i].action, self.steps[i].op))
            super()._run_local(i)

    program = _one_reshard_in_process(monkeypatch, Group(), Recording)
    second = max(s.op for s in program.steps)
    tags = {s.tag for s in program.steps if s.op == second and s.action == "send"}
    packs = [k for k, (what, op) in enumerate(events) if what == "pack" and op == second]
    sends = [k for k, (what, tag) in enumerate(events) if what == "send" and tag in tags]
    assert len(packs) >= 4 and len(sends) == 4, events
    assert sends[0] < packs[-1], f"op {second}'s first send was posted only after all {len(packs)} packs: {events}"


@pytest.mark.parametrize("receipts", [True, False])
def test_in_device_order_a_gloo_send_ends_for_its_device_when_the_receiver_acknowledges_it(monkeypatch, receipts):
    """Gloo ends a send once the socket buffer holds the rest, so in device order the engine waits for a 1-byte receipt
    from the receiver before the device's next operation (as the MPI engine sends synchronously): one per operation and
    receiver, asked for right after the operation's last message to it, so its chunks go out without waiting. In
    process, on a stand-in group whose sends end at once (gloo's early end): the second broadcast's first send comes
    only after every receipt of the first was waited for; with receipts off it comes with none."""
    from xmesh_plan.executor import torch_engine

    events: list[tuple[str, int]] = []

    class Done:
        def __init__(self, what="", tag=-1):
            self.what, self.tag = what, tag

        def wait(self):
            if self.what:
                events.append((self.what, self.tag))

    class Group:
        def send(self, buffer, peer, tag):
            events.append(("send", tag))
            return Done()

        def recv(self, buffer, peer, tag):
            assert buffer[0].numel() == 1, "the sender receives only receipts"
            events.append(("post receipt", tag))
            return Done("receipt", tag)

    from xmesh_plan.executor import TransportOptions

    transport = TransportOptions(receipt_bytes=1 if receipts else None)  # every message of this small plan
    program = _one_reshard_in_process(monkeypatch, Group(), torch_engine.TorchEngine, transport)
    first, second = sorted({s.op for s in program.steps})
    tags = {op: {s.tag for s in program.steps if s.op == op and s.action == "send"} for op in (first, second)}
    sends = {op: [k for k, (what, tag) in enumerate(events) if what == "send" and tag in tags[op]] for op in (first, second)}
    acked = [k for k, (what, tag) in enumerate(events) if what == "receipt" and tag in tags[first]]
    assert len(sends[first]) == len(tags[first]) >= 4 and len(sends[second]) == len(tags[second]) >= 4, events
    if not receipts:
        assert all(what == "send" for what, _ in events), events
        return
    receivers = {s.peer for s in program.steps if s.op == first and s.action == "send"}
    assert len(acked) == len(receivers), events
    for peer in receivers:  # one receipt, asked for right after the last chunk to that receiver (not one per chunk)
        chunks = sorted(s.tag for s in program.steps if s.op == first and s.action == "send" and s.peer == peer)
        k = events.index(("send", chunks[-1]))
        assert len(chunks) >= 4 and events[k + 1] == ("post receipt", chunks[-1]), events
        assert [what for what, tag in events[:k + 1] if tag in chunks] == ["send"] * len(chunks), events
    assert max(acked) < sends[second][0], f"op {second} began before op {first}'s messages were received: {events}"


def _one_reshard_in_process(monkeypatch, group, engine_class, transport=None):
    """One reshard of `two_chunked_broadcasts_from_one_device`'s sender (device order) by `engine_class` on `group`, a
    stand-in for a gloo process group, with `transport` options (None: the defaults); returns the sender's program."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from xmesh_plan.executor.engines import EngineContext, TransportOptions
    from xmesh_plan.executor.pattern import fill
    from xmesh_plan.executor.ranks import rank_of_devices

    monkeypatch.setattr(dist, "get_backend", lambda group: "gloo")
    monkeypatch.setattr(dist, "get_rank", lambda group: 0)
    from xmesh_plan.executor.passes import with_receipts

    problem, plan, _, program = two_chunked_broadcasts_from_one_device()
    transport = transport or TransportOptions()
    replayed = program if transport.receipt_bytes is None else with_receipts(program, transport.receipt_bytes)  # as on gloo
    engine = engine_class(replayed, EngineContext(group, rank_of_devices(plan), 5.0, (1e-4, 1e-3), transport=transport))
    engine.setup()
    try:
        engine.start(torch.from_numpy(np.ascontiguousarray(fill(program.src_block, problem.shape, np.dtype(np.int32)))))
        engine.wait()
    finally:
        engine.close()
    return program


@pytest.mark.parametrize("flags,expect", [
    (["--max-mb", "inf"], "--max-mb inf: give a positive size in MiB"),
    (["--timeout", "inf"], "--timeout inf: give a positive number of seconds"),
    (["--iters", "0"], "--iters 0: give 1 to"),
])
def test_the_torch_demo_refuses_flags_out_of_range_in_one_line(tmp_path, flags, expect):
    path = write_plans(tmp_path, [small([compiled(fixed_problems()[1], "global_allgather")])[0]])[0]
    result = subprocess.run([sys.executable, "-m", "xmesh_plan.executor.torch_run", path, *flags], cwd=ROOT, capture_output=True,
                            text=True, timeout=TORCH_LAUNCH_TIMEOUT_S, env={**os.environ, "XMESH_PLAN_DEBUG": "0"})
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expect in lines[0], result.stderr


def test_a_rank_that_dies_mid_run_makes_its_peer_stop_in_one_line(tmp_path):
    """Rank 1 dies between iterations; rank 0 reports one line naming what it waited for and exits 3, no gloo traceback."""
    problem = make_problem((8, 4), "1x1", "R R", "1x1", "R R", cluster={"devices_per_host": 1})  # device 0 to device 1
    path = write_plans(tmp_path, [compiled(problem, "broadcast")])[0]
    (code0, _, err0), (code1, _, _) = run_ranks(2, ROOT / "tests" / "workers" / "torch_demo_dies.py", path, "--iters", "5",
                                                 "--timeout", "20", env={"XMESH_PLAN_DEBUG": "0"})
    assert code1 == 9
    assert code0 == 3, err0[-3000:]
    lines = [line for line in err0.strip().splitlines() if line.startswith("rank 0: ")]
    assert len(lines) == 1 and "a peer stopped or hangs" in lines[0], err0[-3000:]
    assert "Traceback" not in err0, err0[-3000:]
