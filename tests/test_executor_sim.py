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

from xmesh_plan.executor.arrays import storage_dtype
from xmesh_plan.executor.errors import ExecutorError, PeerTimeoutError
from xmesh_plan.executor.lower import in_device_order, lower
from xmesh_plan.executor.mpi_engine import MpiEngine
from xmesh_plan.executor.pattern import fill, mismatches
from xmesh_plan.executor.ranks import plan_devices, rank_of_devices
from xmesh_plan.schemas.carriers import group_key
from xmesh_plan.schemas.op_kinds import route
from xmesh_plan.planner.verify import verify_plan
from xmesh_plan.schemas.staging import stage_budget
from tests.support.cases import (STRATEGIES, all_fixed_plans, compiled, fixed_problems, random_problem,
                                 two_chunked_broadcasts_from_one_device)
from tests.workers.executor_worker import next_source


class _PersistentSend:
    """A persistent send: each Start() copies the buffer's bytes as they are now into the mailbox."""

    def __init__(self, world, key, buf):
        self.world, self.key, self.buf = world, key, buf

    def Start(self) -> None:
        self.world.mail[self.key].append(bytes(self.buf))
        self.world.log.append(("send", self.key))

    def Test(self) -> bool:
        return True

    def Cancel(self) -> None:
        pass

    def Free(self) -> None:
        self.world.freed += 1


class _PersistentRecv(_PersistentSend):
    """A persistent receive: after Start(), Test() completes once a message of exactly its size is there."""

    active = False

    def Start(self) -> None:
        assert not self.active, f"receive {self.key} started twice"
        self.active = True

    def Test(self) -> bool:
        box = self.world.mail[self.key]
        if not self.active:
            return True
        if not box:
            return False
        data = box.popleft()
        assert len(data) == self.buf.nbytes, f"message {self.key} has {len(data)} B, receiver expects {self.buf.nbytes} B"
        self.buf[:] = np.frombuffer(data, np.uint8)
        self.active = False
        self.world.log.append(("recv", self.key))
        return True


class FakeMPI:
    """The parts of `mpi4py.MPI` the engine uses."""

    BYTE = "byte"
    Exception = RuntimeError


class FakeComm:
    def __init__(self, world, rank: int):
        self.world, self.rank = world, rank

    def Get_rank(self) -> int:
        return self.rank

    def Send_init(self, spec, dest: int, tag: int):
        return _PersistentSend(self.world, (self.rank, dest, tag), spec[0])

    Ssend_init = Send_init  # a mailbox delivers at once: synchronous and buffered sends behave alike here

    def Recv_init(self, spec, source: int, tag: int):
        return _PersistentRecv(self.world, (source, self.rank, tag), spec[0])


class FakeWorld:
    def __init__(self):
        self.mail: dict[tuple, deque] = defaultdict(deque)
        self.freed = 0
        self.log: list[tuple[str, tuple]] = []  # ("send", key) when a send starts, ("recv", key) when a receive lands


def simulate(plan, iterations: int = 4, order: str = "posted", world: FakeWorld | None = None) -> dict[int, np.ndarray]:
    """Run every device's engine round-robin until all finish, checking every destination shard bit for bit
    after each iteration (different data each time); fail on a stall or a stray message."""
    world, rank_of = world or FakeWorld(), rank_of_devices(plan)
    dtype, shape = storage_dtype(plan.problem.dtype), plan.problem.shape
    engines = []
    for rank, device in enumerate(plan_devices(plan)):
        program = lower(plan, device, tag_limit=2**20)
        program = in_device_order(program, stage_budget(plan)) if order == "device" else program
        engine = MpiEngine(program, FakeComm(world, rank), rank_of, dtype, 1.0, (1e-5, 1e-4))
        engine.setup(mpi=FakeMPI)
        engines.append(engine)
    shards = [None] * len(engines)
    for it in range(iterations):
        for k, e in enumerate(engines):
            if e.program.src_block is not None:
                shards[k] = next_source(shards[k], fill(e.program.src_block, shape, dtype, salt=37 * it), it)
            if e.dst is not None:
                e.poison()
        for e, shard in zip(engines, shards):
            e.start(shard)
        for _ in range(10_000):
            if all([e.test() for e in engines]):
                break
        else:
            stuck = [e.steps[i].describe() for e in engines if e.pending for i in e.live[e.head:e.tail] if i >= 0]
            pytest.fail(f"stalled: {stuck[:3]}")
        stray = {k: len(v) for k, v in world.mail.items() if v}
        assert not stray, f"messages nobody received: {stray}"
        for e in engines:
            if e.dst is not None:
                bad, first = mismatches(e.dst, e.program.dst_block, shape, salt=37 * it)
                assert bad == 0, f"iteration {it}: device {e.program.device}: {bad} elements differ, first at {first}"
    return {e.program.device: e.dst for e in engines if e.dst is not None}


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


def _out_of_device_order(plan, world: FakeWorld, steps_of=None) -> list[str]:
    """Messages a device sent or received (first iteration) before a receive of an earlier operation of its own
    with other peers had landed; operations with the same peers may overlap (one link, in order anyway).
    `steps_of(device)`: the steps whose tags name that device's messages (default: its lowering of `plan`;
    a multi-tensor plan passes every tensor's, tags as its executor numbered them). Earlier: in the plan's list."""
    op_of = {}  # (rank, "send"/"recv", peer rank, tag) -> op id (a shared message's bundles: their carrier's)
    peers = defaultdict(set)  # (rank, op) -> peer ranks, read from the plan (the op-kind table's route), not the lowering
    rank_of = rank_of_devices(plan)
    key = {op.id: group_key(op) for op in plan.operations}  # bundles sharing one message are one operation (schemas.carriers)
    position = {op.id: k for k, op in enumerate(plan.operations)}
    steps_of = steps_of or (lambda device: lower(plan, device, tag_limit=2**20).steps)
    for op in plan.operations:  # a device's peers: the other ends of the messages it sends or receives (empty ones are not sent)
        for hop in route(op):
            if hop.src != hop.dst and hop.elements:
                peers[(rank_of[hop.src], key[op.id])].add(rank_of[hop.dst])
                peers[(rank_of[hop.dst], key[op.id])].add(rank_of[hop.src])
    for device, rank in rank_of.items():
        for s in steps_of(device):
            if s.action in ("send", "recv"):
                assert (rank, s.action, rank_of[s.peer], s.tag) not in op_of, "two messages share a tag"
                op_of[(rank, s.action, rank_of[s.peer], s.tag)] = key[s.op]
    waiting: dict[int, set] = defaultdict(set)  # rank -> ops with a receive not landed yet
    for (rank, action, peer, tag), op in op_of.items():
        if action == "recv":
            waiting[rank].add(op)
    bad = []

    def blockers(rank, op):
        return [e for e in waiting[rank] if position[e] < position[op] and peers[(rank, e)] != peers[(rank, op)]]

    for event, (src, dst, tag) in world.log[:len(op_of)]:
        if event == "recv":
            op = op_of[(dst, "recv", src, tag)]
            if blockers(dst, op):
                bad.append(f"rank {dst} received op {op} while op {min(blockers(dst, op), key=position.get)} had not arrived")
            waiting[dst].discard(op)
        else:
            op = op_of[(src, "send", dst, tag)]
            if blockers(src, op):
                bad.append(f"rank {src} sent op {op} while op {min(blockers(src, op), key=position.get)} had not arrived")
    return bad


@pytest.mark.parametrize("plan", all_fixed_plans(), ids=lambda p: f"{p.problem.name}-{p.strategy}")
def test_device_order_puts_one_operation_at_a_time_on_the_wire_and_stays_bit_exact(plan):
    world = FakeWorld()
    simulate(plan, order="device", world=world)
    assert _out_of_device_order(plan, world) == []


def test_posted_order_does_send_ahead_of_earlier_operations():
    """The check above can fail: posting every operation at once starts some sends early."""
    early = 0
    for plan in all_fixed_plans():
        world = FakeWorld()
        simulate(plan, iterations=1, world=world)
        early += len(_out_of_device_order(plan, world))
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
        engine = MpiEngine(program, FakeComm(world, rank), rank_of, dtype, 1.0, (1e-5, 1e-4))
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


def test_an_mpi_error_is_reported_as_such_not_as_a_timeout():
    """Exit code 3 and 'raise timeout_s' advice belong to timeouts; an error MPI reports is an ExecutorError."""
    plan = compiled(random_problem(3), "send_recv")
    device = next(op.dsts[0] for op in plan.operations if op.kind in ("send", "broadcast"))
    engine = MpiEngine(lower(plan, device, tag_limit=2**20), FakeComm(FakeWorld(), 0), rank_of_devices(plan),
                       storage_dtype(plan.problem.dtype), 1.0, (1e-5, 1e-4))
    engine.setup(mpi=_FailingMPI)
    receive = next(r for r in engine.requests if isinstance(r, _PersistentRecv))
    receive.Test = lambda: (_ for _ in ()).throw(_MpiError("truncated"))
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
        engine = MpiEngine(lower(plan, device, tag_limit=2**20), FakeComm(FakeWorld(), 0), rank_of_devices(plan),
                           storage_dtype(plan.problem.dtype), timeout_s, (1e-5, 1e-4))
        engine.setup(mpi=_FailingMPI)
        src = engine.program.src_block
        engine.start(None if src is None else fill(src, plan.problem.shape, engine.dtype))
        engines.append(engine)
    a, b = engines  # nobody sends in these fake worlds, so A waits until its deadline
    assert a.program.device != b.program.device
    receive = next(r for r in b.requests if isinstance(r, _PersistentRecv) and r.active)
    receive.Test = lambda: (_ for _ in ()).throw(_MpiError("truncated"))
    with pytest.raises(PeerTimeoutError, match=rf"device {a.program.device} .*nothing completed for 0.2 s"):
        a.wait()
    assert b.broken and "MPI reported an error" in b.broken
    with pytest.raises(ExecutorError, match=rf"device {b.program.device} .*MPI reported an error \(Message truncated\)"):
        b.test()


class _WorldComm(FakeComm):
    """Enough of a world communicator for ReshardingExecutor's constructor."""

    def Get_size(self) -> int:
        return 8

    def Idup(self):
        raise AssertionError("not used: the test sets the engine up itself")


def _executor_on(world: FakeWorld, plan, device: int, timeout_s: float):
    """A ReshardingExecutor for `device` over the fake MPI, set up without prepare()."""
    from xmesh_plan.executor import ReshardingExecutor

    rank = rank_of_devices(plan)[device]
    ex = ReshardingExecutor(plan, _WorldComm(world, rank))
    ex.program = lower(plan, device, tag_limit=2**20)
    ex.src_shape = ex.program.src_shape
    ex.engine = MpiEngine(ex.program, FakeComm(world, rank), rank_of_devices(plan), storage_dtype(plan.problem.dtype),
                          timeout_s, (1e-5, 1e-4))
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
    engine = MpiEngine(lower(plan, device, tag_limit=2**20), FakeComm(FakeWorld(), 0), rank_of_devices(plan),
                       storage_dtype(plan.problem.dtype), 5.0, (1e-5, 1e-4))
    engine.setup(mpi=_FailingMPI)
    src = engine.program.src_block
    engine.start(None if src is None else fill(src, plan.problem.shape, engine.dtype))
    receive = next(r for r in engine.requests if isinstance(r, _PersistentRecv) and r.active)
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
    engine = Recording(program, FakeComm(world, rank_of[sender]), rank_of, np.dtype(np.int32), 1.0, (1e-5, 1e-4))
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
