"""Every rank's executor engine run in one process over a fake MPI, checked bit for bit.

The fake delivers a send into a mailbox keyed by (source, dest, tag) and completes a receive only
when a message of exactly its size is there, so a tag, peer or size that the two ends disagree on
shows up as a stall; stray messages left at the end fail the test too.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from xmesh_plan.executor.arrays import storage_dtype
from xmesh_plan.executor.errors import ExecutorError, PeerTimeoutError
from xmesh_plan.executor.mpi_engine import MpiEngine
from xmesh_plan.executor.pattern import fill, mismatches
from xmesh_plan.executor.lower import lower
from xmesh_plan.executor.ranks import plan_devices, rank_of_devices
from xmesh_plan.planner.verify import verify_plan
from tests.support.cases import (STRATEGIES, all_fixed_plans, compiled, fixed_problems, random_problem,
                                 two_chunked_broadcasts_from_one_device)
from tests.support.fake_mpi import FakeComm, FakeMPI, FakeWorld, PersistentRecv, WorldComm, out_of_device_order, simulate


def assert_bit_exact(plan) -> None:
    out = simulate(plan)
    assert set(out) == set(plan.problem.blocks("dst"))


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


@pytest.mark.parametrize("plan", all_fixed_plans(), ids=lambda p: f"{p.problem.name}-{p.strategy}")
def test_device_order_puts_one_operation_at_a_time_on_the_wire_and_stays_bit_exact(plan):
    world = FakeWorld()
    simulate(plan, order="device", world=world)
    assert out_of_device_order(plan, world) == []


def test_posted_order_does_send_ahead_of_earlier_operations():
    """The check above can fail: posting every operation at once starts some sends early."""
    early = 0
    for plan in all_fixed_plans():
        world = FakeWorld()
        simulate(plan, iterations=1, world=world)
        early += len(out_of_device_order(plan, world))
    assert early > 0


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10**6), strategy=st.sampled_from(STRATEGIES + ("auto",)), devices=st.integers(1, 9))
def test_random_plans_in_device_order_finish_bit_exact(seed, strategy, devices):
    plan = compiled(random_problem(seed, max_devices=devices, exact=False), strategy)
    simulate(plan, iterations=2, order="device")


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
        engine = MpiEngine(program, FakeComm(world, rank), rank_of, 1.0, (1e-5, 1e-4))
        engine.setup(mpi=FakeMPI)
        engine.start(fill(program.src_block, plan.problem.shape, dtype) if program.src_block else None)
        engines.append(engine)
    for _ in range(100):
        [e.test() for e in engines]
    assert engines[-1].pending and any(s.action == "recv" for s in engines[-1].steps)


class _MpiError(RuntimeError):
    def Get_error_string(self) -> str:
        return "Message truncated\nerror stack: ..."


class _FailingMPI(FakeMPI):
    Exception = _MpiError


def test_an_mpi_error_is_reported_as_such_not_as_a_timeout(monkeypatch):
    """Exit code 3 and 'raise timeout_s' advice belong to timeouts; an error MPI reports is an ExecutorError."""
    plan = compiled(random_problem(3), "send_recv")
    device = next(op.dsts[0] for op in plan.operations if op.kind in ("send", "broadcast"))
    engine = MpiEngine(lower(plan, device, tag_limit=2**20), FakeComm(FakeWorld(), 0), rank_of_devices(plan), 1.0, (1e-5, 1e-4))
    engine.setup(mpi=_FailingMPI)
    # every receive fails (those into the destination shard are made by start(), which binds it)
    monkeypatch.setattr(PersistentRecv, "Test", lambda self: (_ for _ in ()).throw(_MpiError("truncated")))
    engine.start(None if engine.program.src_block is None else fill(engine.program.src_block, plan.problem.shape, engine.dtype))
    with pytest.raises(ExecutorError, match=r"MPI reported an error \(Message truncated\); waiting on") as err:
        engine.wait()
    assert not isinstance(err.value, PeerTimeoutError) and "\n" not in str(err.value)
    assert engine.broken


def test_an_error_in_a_reshard_driven_by_another_wait_is_kept_for_its_own_executor():
    """A's wait() drives B (another reshard in flight); B's MPI error must surface from B, not from A."""
    plan = compiled(random_problem(3), "send_recv")
    receivers = [op.dsts[0] for op in plan.operations if op.kind in ("send", "broadcast")]
    engines = []
    for device, timeout_s in ((receivers[0], 0.2), (receivers[-1], 5.0)):
        engine = MpiEngine(lower(plan, device, tag_limit=2**20), FakeComm(FakeWorld(), 0), rank_of_devices(plan), timeout_s, (1e-5, 1e-4))
        engine.setup(mpi=_FailingMPI)
        src = engine.program.src_block
        engine.start(None if src is None else fill(src, plan.problem.shape, engine.dtype))
        engines.append(engine)
    a, b = engines  # nobody sends in these fake worlds, so A waits until its deadline
    assert a.program.device != b.program.device
    receive = next(r for r in b.requests if isinstance(r, PersistentRecv) and r.active)
    receive.Test = lambda: (_ for _ in ()).throw(_MpiError("truncated"))
    with pytest.raises(PeerTimeoutError, match=rf"device {a.program.device} .*nothing completed for 0.2 s"):
        a.wait()
    assert b.broken and "MPI reported an error" in b.broken
    with pytest.raises(ExecutorError, match=rf"device {b.program.device} .*MPI reported an error \(Message truncated\)"):
        b.test()


def _executor_on(world: FakeWorld, plan, device: int, timeout_s: float):
    """A ReshardingExecutor for `device` over the fake MPI, set up without prepare()."""
    from xmesh_plan.executor import ReshardingExecutor

    rank = rank_of_devices(plan)[device]
    ex = ReshardingExecutor(plan, WorldComm(world, rank))
    ex.program = lower(plan, device, tag_limit=2**20)
    ex.engine = MpiEngine(ex.program, FakeComm(world, rank), rank_of_devices(plan), timeout_s, (1e-5, 1e-4))
    ex.engine.setup(mpi=FakeMPI)
    return ex


def test_close_while_a_reshard_is_in_flight_finishes_it_when_the_peers_do():
    """`close()` in a `finally:` after an exception between test() calls: the peers still get this rank's part."""
    plan = compiled(fixed_problems()[0], "send_recv")  # even_disjoint: devices 0-3 send, 4-7 receive
    world = FakeWorld()
    receiver = _executor_on(world, plan, 5, 5.0)
    receiver.start(None)
    senders = [_executor_on(world, plan, d, 5.0) for d in range(4)]
    for ex in senders:  # their sends go into the fake mailboxes at start()
        ex.start(fill(ex.program.src_block, plan.problem.shape, ex.engine.dtype))
    receiver.close()
    assert receiver.closed and receiver.engine.broken == "closed" and not receiver.in_flight
    assert mismatches(receiver.engine.dst, receiver.program.dst_block, plan.problem.shape) == (0, None)


def test_close_while_a_reshard_is_in_flight_abandons_it_when_it_cannot_finish():
    from xmesh_plan.executor import ExecutorError

    plan = compiled(fixed_problems()[0], "send_recv")
    ex = _executor_on(FakeWorld(), plan, 5, 0.2)
    ex.start(None)
    assert not ex.test() and ex.in_flight  # nobody sends in this fake world
    ex.close()  # returns (after timeout_s) instead of raising: it is cleanup
    assert ex.closed and not ex.in_flight and "nothing completed for 0.2 s" in ex.engine.broken
    with pytest.raises(ExecutorError, match=r"run\(\) or start\(\) after close\(\)"):
        ex.run(None)


def test_a_thread_never_progresses_an_engine_another_thread_holds_and_then_sees_its_error():
    """While another thread's wait() drives an engine, its owner's test() does not block or touch it; once
    the driver lets go, an error the driver found is raised by the owner, never swallowed as done."""
    import threading

    plan = compiled(random_problem(3), "send_recv")
    device = next(op.dsts[0] for op in plan.operations if op.kind in ("send", "broadcast"))
    engine = MpiEngine(lower(plan, device, tag_limit=2**20), FakeComm(FakeWorld(), 0), rank_of_devices(plan), 5.0, (1e-5, 1e-4))
    engine.setup(mpi=_FailingMPI)
    src = engine.program.src_block
    engine.start(None if src is None else fill(src, plan.problem.shape, engine.dtype))
    receive = next(r for r in engine.requests if isinstance(r, PersistentRecv) and r.active)
    receive.Test = lambda: (_ for _ in ()).throw(_MpiError("truncated"))
    seen = []

    def owner_test():
        try:
            seen.append(engine.test())
        except ExecutorError as err:
            seen.append(err)

    assert engine.lock.acquire(False)  # this thread plays the driver
    worker = threading.Thread(target=owner_test)
    worker.start()
    worker.join(timeout=5)
    assert not worker.is_alive() and seen == [False], "the owner must skip, not block on or run a held engine"
    with pytest.raises(ExecutorError):
        engine._progress()  # the driver finds the MPI error
    engine.lock.release()
    worker = threading.Thread(target=owner_test)
    worker.start()
    worker.join(timeout=5)
    assert isinstance(seen[1], ExecutorError) and "MPI reported an error" in str(seen[1])


def _started_receiver(timeout_s: float) -> MpiEngine:
    plan = compiled(fixed_problems()[0], "send_recv")
    engine = _executor_on(FakeWorld(), plan, 5, timeout_s).engine
    engine.start(None)
    return engine


def test_a_lock_left_taken_ends_in_an_error_not_an_endless_false():
    """A Ctrl-C in another thread right after it took this engine's lock leaves it taken: test() must give up
    after timeout_s with a message about the lock, not return False for ever nor blame a peer."""
    engine = _started_receiver(0.05)
    assert engine.lock.acquire(False)  # the interrupted call that never released it
    engine.last_progress -= 1.0  # nothing has moved for longer than timeout_s
    with pytest.raises(ExecutorError, match=r"device 5: this reshard's engine was held by another call for over 0.05 s"):
        engine.test()
    assert engine.broken and "lock stayed taken" in engine.broken


def test_close_from_a_handler_that_interrupted_this_threads_test_leaves_the_requests_alone():
    """close() from a signal handler runs while the same thread's test() holds the lock mid-pass: it must not
    free the requests under that pass (they go to the finalizer), and must not wait for a lock it holds itself."""
    engine = _started_receiver(5.0)
    assert engine.lock.acquire(False)  # this thread is "inside test()"
    engine.close()
    assert engine.broken == "closed" and any(r is not None for r in engine.requests)
    engine.lock.release()


def test_a_send_goes_as_soon_as_its_chunk_is_packed_not_after_every_ready_pack():
    """When an operation's wait ends (device order: the one before it finished), its first chunk leaves after one
    chunk's pack, not after every pack that became ready at that moment: a local copy runs at once, so the engine
    starts the messages a finished step unblocks before it runs the copies (on the emulated cluster the packs of a
    4-chunk 2 MiB broadcast held its first send back 7-12 ms)."""
    problem, plan, sender, program = two_chunked_broadcasts_from_one_device()
    launched: list[int] = []

    class Recording(MpiEngine):
        def _launch(self, i):
            launched.append(i)
            super()._launch(i)

    world, rank_of = FakeWorld(), rank_of_devices(plan)
    engine = Recording(program, FakeComm(world, rank_of[sender]), rank_of, 1.0, (1e-5, 1e-4))
    engine.setup(mpi=FakeMPI)
    engine.start(fill(program.src_block, problem.shape, np.dtype(np.int32)))
    for _ in range(100):
        if engine.test():
            break
    steps = program.steps
    second = max(s.op for s in steps)
    packs = [k for k, i in enumerate(launched) if steps[i].op == second and steps[i].action == "pack"]
    sends = [k for k, i in enumerate(launched) if steps[i].op == second and steps[i].action == "send"]
    assert len(packs) >= 4 and len(sends) == 4, (packs, sends)  # the box is strided: packed chunk by chunk
    assert sends[0] < packs[-1], f"the first send of op {second} started only after all {len(packs)} packs: {launched}"
