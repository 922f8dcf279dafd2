"""Every rank's executor engine run in one process over a fake MPI, checked bit for bit.

The fake delivers a send into a mailbox keyed by (source, dest, tag) and completes a receive only
when a message of exactly its size is there, so a tag, peer or size that the two ends disagree on
shows up as a stall; stray messages left at the end fail the test too.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from executor.arrays import storage_dtype
from executor.lower import lower
from executor.mpi_engine import MpiEngine
from executor.pattern import fill, mismatches
from executor.ranks import plan_devices, rank_of_devices
from planner.verify import verify_plan
from test_executor_cases import STRATEGIES, all_fixed_plans, compiled, random_problem


class _Done:
    def test(self) -> bool:
        return True


class _Recv:
    def __init__(self, world, key, buf):
        self.world, self.key, self.buf = world, key, buf

    def test(self) -> bool:
        box = self.world.mail[self.key]
        if not box:
            return False
        data = box.popleft()
        assert len(data) == self.buf.nbytes, f"message {self.key} has {len(data)} B, receiver expects {self.buf.nbytes} B"
        self.buf[:] = np.frombuffer(data, np.uint8)
        return True


class FakeMPI:
    """The parts of `mpi4py.MPI` the engine uses."""

    BYTE = "byte"
    Exception = RuntimeError
    REQUEST_NULL = None

    class Request:
        @staticmethod
        def Testsome(requests):
            """Like MPI: finished requests become REQUEST_NULL in place; None when all are null."""
            if all(r is None for r in requests):
                return None
            done = [k for k, r in enumerate(requests) if r is not None and r.test()]
            for k in done:
                requests[k] = None
            return done


class FakeComm:
    def __init__(self, world, rank: int):
        self.world, self.rank = world, rank

    def Get_rank(self) -> int:
        return self.rank

    def Isend(self, spec, dest: int, tag: int):
        self.world.mail[(self.rank, dest, tag)].append(bytes(spec[0]))
        return _Done()

    def Irecv(self, spec, source: int, tag: int):
        return _Recv(self.world, (source, self.rank, tag), spec[0])


class FakeWorld:
    def __init__(self):
        self.mail: dict[tuple, deque] = defaultdict(deque)


def simulate(plan, iterations: int = 2) -> dict[int, np.ndarray]:
    """Run every device's engine round-robin until all finish; fail on a stall or a stray message."""
    world, rank_of = FakeWorld(), rank_of_devices(plan)
    dtype = storage_dtype(plan.problem.dtype)
    engines = []
    for rank, device in enumerate(plan_devices(plan)):
        engine = MpiEngine(lower(plan, device, tag_limit=2**20), FakeComm(world, rank), rank_of, dtype, 1.0, (1e-5, 1e-4))
        engine.setup(mpi=FakeMPI)
        engines.append(engine)
    shards = [fill(e.program.src_block, plan.problem.shape, dtype) if e.program.src_block else None for e in engines]
    for _ in range(iterations):
        for e in engines:
            if e.dst is not None:
                e.poison()
        for e, shard in zip(engines, shards):
            e.start(shard)
        for _ in range(10_000):
            if all([e.test() for e in engines]):
                break
        else:
            stuck = [e.steps[i].describe() for e in engines if e.pending
                     for i, r in zip(e.request_steps, e.requests) if r is not None][:3]
            pytest.fail(f"stalled: {stuck[:3]}")
        stray = {k: len(v) for k, v in world.mail.items() if v}
        assert not stray, f"messages nobody received: {stray}"
    return {e.program.device: e.dst for e in engines if e.dst is not None}


def assert_bit_exact(plan) -> None:
    out = simulate(plan)
    blocks = plan.problem.blocks("dst")
    assert set(out) == set(blocks)
    for device, shard in out.items():
        bad, first = mismatches(shard, blocks[device], plan.problem.shape)
        assert bad == 0, f"device {device}: {bad} elements differ, first at {first}"


@pytest.mark.parametrize("plan", all_fixed_plans(), ids=lambda p: f"{p.problem.name}-{p.strategy}")
def test_fixed_cases_bit_exact(plan):
    assert_bit_exact(plan)


def test_every_operation_kind_is_exercised():
    kinds = {op.kind for plan in all_fixed_plans() for op in plan.operations}
    chunked = any(op.chunks > 1 for plan in all_fixed_plans() for op in plan.operations)
    assert kinds == {"copy", "send", "broadcast", "allgather"} and chunked


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), strategy=st.sampled_from(STRATEGIES + ("auto",)), devices=st.integers(1, 9))
def test_random_planner_cases_bit_exact(seed, strategy, devices):
    plan = compiled(random_problem(seed, max_devices=devices, exact=False), strategy)
    verify_plan(plan)
    assert_bit_exact(plan)


def test_a_tag_mismatch_stalls_instead_of_corrupting():
    """The harness itself: shifting every receive tag of one device must stall the exchange, not pass."""
    plan = all_fixed_plans()[0]
    world, rank_of = FakeWorld(), rank_of_devices(plan)
    dtype = storage_dtype(plan.problem.dtype)
    engines = []
    for rank, device in enumerate(plan_devices(plan)):
        program = lower(plan, device, tag_limit=2**20)
        if device == max(rank_of):
            steps = tuple(replace(s, tag=s.tag + 1) if s.action == "recv" else s for s in program.steps)
            program = replace(program, steps=steps)
        engine = MpiEngine(program, FakeComm(world, rank), rank_of, dtype, 1.0, (1e-5, 1e-4))
        engine.setup(mpi=FakeMPI)
        engine.start(fill(program.src_block, plan.problem.shape, dtype) if program.src_block else None)
        engines.append(engine)
    for _ in range(100):
        [e.test() for e in engines]
    assert engines[-1].pending and any(s.action == "recv" for s in engines[-1].steps)
