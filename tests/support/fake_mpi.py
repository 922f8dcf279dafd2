"""A fake `mpi4py` world in one process: every rank's engine over mailboxes keyed by (source, dest, tag).

The fake delivers a send into a mailbox and completes a receive only when a message of exactly its size is
there, so a tag, peer or size that the two ends disagree on shows up as a stall; stray messages left at the
end fail the run too.
"""

from __future__ import annotations

from collections import defaultdict, deque

import numpy as np
import pytest

from xmesh_plan.executor.arrays import storage_dtype
from xmesh_plan.executor.lower import in_device_order, lower
from xmesh_plan.executor.mpi_engine import MpiEngine
from xmesh_plan.executor.pattern import fill, mismatches
from xmesh_plan.executor.ranks import plan_devices, rank_of_devices
from xmesh_plan.schemas.carriers import group_key
from xmesh_plan.schemas.op_kinds import route
from xmesh_plan.schemas.staging import stage_budget
from tests.workers.executor_worker import next_source


class PersistentSend:
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


class PersistentRecv(PersistentSend):
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
        return PersistentSend(self.world, (self.rank, dest, tag), spec[0])

    Ssend_init = Send_init  # a mailbox delivers at once: synchronous and buffered sends behave alike here

    def Recv_init(self, spec, source: int, tag: int):
        return PersistentRecv(self.world, (source, self.rank, tag), spec[0])


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
        engine = MpiEngine(program, FakeComm(world, rank), rank_of, 1.0, (1e-5, 1e-4))
        engine.setup(mpi=FakeMPI)
        engines.append(engine)
    shards = [None] * len(engines)
    for it in range(iterations):
        for k, e in enumerate(engines):
            if e.program.src_block is not None:
                shards[k] = next_source(shards[k], fill(e.program.src_block, shape, dtype, salt=37 * it), it)
            if e.program.dst_block is not None:  # poison() makes the own shard the first run would make
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


class WorldComm(FakeComm):
    """Enough of a world communicator of `size` ranks for the executors' constructors (tests set the engines up
    themselves, so nothing duplicates it)."""

    def __init__(self, world, rank, size: int = 8):
        super().__init__(world, rank)
        self.size = size

    def Get_size(self) -> int:
        return self.size

    def Idup(self):
        raise AssertionError("not used: the test sets the engines up itself")


def out_of_device_order(plan, world: FakeWorld, steps_of=None) -> list[str]:
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
