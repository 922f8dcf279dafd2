"""`ReshardingExecutor`: what a training loop calls at every stage boundary to reshard one tensor.

    ex = ReshardingExecutor(plan, MPI.COMM_WORLD).prepare()   # once: checks, buffers, communicators
    ex = ReshardingExecutor(plan, group)                       # or a torch.distributed process group
    new_shard = ex.run(old_shard)                              # every iteration
    ex.start(old_shard); ...compute...; new_shard = ex.wait()  # the same, overlapped with compute

Rank r plays the r-th smallest device id of the plan's two meshes (see `executor.ranks`). The
engine is looked up by name in `executor.engines` and fed the lowered program. `run()` returns the
engine's own destination buffer, reused by the next call: copy it if you keep it.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import replace

import numpy as np

from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.staging import stage_budget
from xmesh_plan.schemas.plan_tensors import is_multi

from .arrays import storage_dtype
from .engines import BACKENDS, TORCH_BACKENDS, EngineContext, TransportOptions, engine_entry, world_of_backend
from .errors import ExecutorError, PlanMismatchError
from .lower import ORDERS, RankProgram, in_device_order, lower
from .ranks import device_of_rank, rank_of_devices
from .replay import stopped
from .worlds import MpiWorld, TorchWorld, is_mpi_comm, is_torch_group, poll_until
from .timeouts import MAX_TIMEOUT_S, check_timeout, is_number

DEFAULT_POLL_S = (2e-5, 1e-3)


def plan_fingerprint(plan: Plan) -> np.ndarray:
    """First 16 bytes of the SHA-256 of the plan's JSON, as two int64 (ranks compare these)."""
    return np.frombuffer(hashlib.sha256(plan.to_json().encode()).digest()[:16], dtype=np.int64).copy()


def poll(request, timeout_s: float, poll_s: tuple[float, float], what: str) -> None:
    """Wait for one MPI request with sleeps between tests; PeerTimeoutError naming `what` after `timeout_s`."""
    poll_until(request.Test, timeout_s, poll_s, what)


def make_world(comm, backend: str | None):
    """The world `comm` names: an mpi4py communicator, a torch process group, or None (torch's default group)."""
    if is_torch_group(comm) or (comm is None and world_of_backend(backend) == "torch"):
        return TorchWorld(comm)
    if not is_mpi_comm(comm):
        raise TypeError(f"comm is a {type(comm).__name__}; pass an mpi4py communicator, e.g. MPI.COMM_WORLD, "
                        "or a torch.distributed process group (None: the default group, with backend='torch')")
    return MpiWorld(comm)


def check_staging(plan: Plan, program: RankProgram, order: str) -> RankProgram:
    """`program` when its staging fits the peak the plan states for its device (a plan compiled with
    `--max-staging-mb`); else PlanMismatchError naming the order, the bytes and the fix."""
    if plan.staging is None:
        return program
    stated = plan.staging.peak_bytes.get(program.device, 0)
    if program.stage_bytes > stated:
        limit = plan.staging.limit_bytes
        raise PlanMismatchError(f"order={order!r} needs {program.stage_bytes} B of staging on device {program.device}, but the plan "
                                f"states {stated} B there (compiled with a staging limit of {limit} B, --max-staging-mb, for "
                                f"order={plan.staging.order!r}); run it with order={plan.staging.order!r}, or recompile it "
                                "without --max-staging-mb to run it in this order")
    return program


def check_usable(call: str, closed: bool, engine, in_flight: bool) -> None:
    """Refuse `call` after close(), before prepare() (no engine yet) or after an error, in one line saying what to do."""
    if closed:
        raise ExecutorError(f"{call} after close(); create and prepare a new executor")
    if engine is None:
        raise ExecutorError(f"call prepare() (on every rank) before {call}")
    if engine.broken and not in_flight:
        raise stopped(engine.broken)


def finish_in_flight(engine) -> BaseException | None:
    """Finish an engine's reshard in flight before it is closed: an error the engine raises is dropped (it
    marked itself broken, and closing is cleanup); an interrupt (Ctrl-C) abandons it and is returned,
    for the caller to raise once everything is closed."""
    try:
        engine.wait()
    except ExecutorError:
        return None
    except BaseException as err:
        if not engine.broken:
            engine.abandon(f"{type(err).__name__} in close()")
        return err
    return None


class Flight:
    """The calls into one engine and the protocol around them, the same for every executor face: refuse a call before
    prepare(), after close() or after an error (`check_usable`); one reshard in flight at a time; anything that
    escapes an engine call (a peer timeout, Ctrl-C, an exception from a signal handler) leaves requests half done,
    so the engine is marked broken (`abandon`) and never restarts them; close() finishes a reshard in flight first.
    (Each call is written out rather than wrapped, so a call allocates no bound method.)"""

    __slots__ = ("engine", "in_flight", "closed")

    def __init__(self) -> None:
        self.engine = None  # set once prepared
        self.in_flight = False
        self.closed = False

    def usable(self, call: str) -> None:
        check_usable(call, self.closed, self.engine, self.in_flight)

    def start(self, source) -> None:
        """Start the engine on `source` (the caller checked `usable` and adopted the source shard)."""
        if self.in_flight:
            raise ExecutorError("start() called while a reshard is in flight; call wait() first")
        try:
            self.in_flight = True
            self.engine.start(source)
        except BaseException as err:
            self.abandon(err, "start()")
            raise

    def test(self) -> bool:
        self.usable("test()")
        if not self.in_flight:
            return True
        try:
            return self.engine.test()
        except BaseException as err:
            self.abandon(err, "test()")
            raise

    def wait(self):
        """Finish the reshard in flight; the engine's destination shard."""
        self.usable("wait()")
        if not self.in_flight:
            raise ExecutorError("wait() called without start()")
        try:
            self.engine.wait()
        except BaseException as err:
            self.abandon(err, "wait()")
            raise
        self.in_flight = False
        return self.engine.dst

    def abandon(self, err: BaseException, call: str) -> None:
        """Give up the reshard in flight after `err` escaped `call`: the engine refuses to run again."""
        self.in_flight = False
        if not self.engine.broken:
            self.engine.abandon(f"{type(err).__name__} in {call}")

    def close(self) -> BaseException | None:
        """Finish a reshard in flight (`finish_in_flight`), close the engine; an interrupt to raise once the caller
        has released the rest, or None."""
        interrupted = None
        if self.in_flight:
            interrupted = finish_in_flight(self.engine)
            self.in_flight = False
        if self.engine is not None and hasattr(self.engine, "close"):
            self.engine.close()
        self.closed = True
        return interrupted


class Flying:
    """An executor face's `engine`, `in_flight` and `closed`, read from its `flight` (a `Flight`)."""

    flight: Flight

    @property
    def engine(self):
        """The engine that replays this rank's reshards (None before prepare())."""
        return self.flight.engine

    @engine.setter
    def engine(self, engine) -> None:
        self.flight.engine = engine

    @property
    def in_flight(self) -> bool:
        return self.flight.in_flight

    @property
    def closed(self) -> bool:
        return self.flight.closed


class ReshardingExecutor(Flying):
    """Replays one plan on this rank; see the module docstring for the calling pattern."""

    def __init__(self, plan: Plan, comm=None, backend: str | None = None, timeout_s: float = 60.0,
                 poll_s: tuple[float, float] = DEFAULT_POLL_S, gpu: int | None = None, order: str = "device",
                 transport: TransportOptions | None = None):
        """`backend`: a name in `executor.engines.BACKENDS`; None picks `mpi` for an mpi4py communicator and
        `torch` for a process group. With a process group, `gloo` and `nccl` also pick `torch` and must
        match the group's backend. `order`: `device` (each device takes part in one operation at a time,
        in plan order, as the plan was scheduled; measured as fast or faster for our plans on the emulated
        cluster, and steadier) or `posted` (every message posted at once, the transport shares the links);
        see `lower.in_device_order`. Staging is the largest run's in device order and the sum of every
        staged box posted; a plan compiled with `--max-staging-mb` states its peaks, and an order that
        would need more is refused in prepare(). `transport`: how messages are matched and acknowledged
        (`engines.TransportOptions`; the defaults suit every engine), the same on every rank."""
        if not isinstance(plan, Plan):
            raise TypeError(f"plan is a {type(plan).__name__}; pass a schemas.Plan, e.g. schemas.read_plan_file('x.plan.json')")
        if is_multi(plan):
            raise TypeError(f"plan moves {len(plan.problem.tensors)} tensors; run it with executor.TransferExecutor "
                            "(a name -> shard mapping in and out)")
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is unknown; use one of: {', '.join(BACKENDS)}")
        if order not in ORDERS:
            raise ValueError(f"order {order!r} is unknown; use one of: {', '.join(ORDERS)}")
        world = make_world(comm, backend)
        self.entry = engine_entry(backend, world.kind)
        timeout_s = check_timeout(timeout_s)
        if not (isinstance(poll_s, (tuple, list)) and len(poll_s) == 2 and all(map(is_number, poll_s))
                and 0 < poll_s[0] <= poll_s[1] <= MAX_TIMEOUT_S):
            raise ValueError(f"poll_s={poll_s!r} must be (shortest, longest) sleep in seconds with 0 < shortest <= longest")
        self.plan, self.world, self.backend = plan, world, backend or self.entry.name
        self.timeout_s, self.poll_s, self.gpu, self.order = float(timeout_s), (float(poll_s[0]), float(poll_s[1])), gpu, order
        if transport is not None and not isinstance(transport, TransportOptions):
            raise TypeError(f"transport is a {type(transport).__name__}; pass an executor.TransportOptions or None")
        self.transport = transport or TransportOptions()
        self.program: RankProgram | None = None
        self.flight = Flight()  # the engine (once prepared) and the calls into it
        self.comm = None
        # Set by TransferExecutor before prepare(): tags start here and the engine uses this communicator
        # (another executor's, which owns and releases it), so the tensors of one plan share one.
        self.tag_offset, self.shared_comm = 0, None
        # Set by TransferExecutor in device order: the steps stay as lowered (flagged device order, so engines
        # send large messages synchronously) and one joint engine orders them across the plan's tensors.
        self.joined = False

    @property
    def device(self) -> int:
        return device_of_rank(self.plan, self.world.rank, self.world.size, self.world.label, self.world.launch)

    def prepare(self) -> "ReshardingExecutor":
        """Check the plan against this world on every rank, then allocate buffers; all ranks must call it.

        Each rank lowers the plan for its device; the ranks then compare plan fingerprints and
        outcomes, so a bad plan or a rank with another plan fails everywhere before any byte moves.
        """
        self.lower_program()
        self.setup_engine()
        return self

    def lower_program(self) -> RankProgram:
        """`prepare()`'s first half, on every rank: lower the plan for this device and agree that every rank could.

        `TransferExecutor` calls the halves apart, so that in device order it can lay every tensor's
        staging out in one area (`executor.joint`) before the engines are set up."""
        if self.flight.engine is not None or self.program is not None or self.flight.closed:
            raise ExecutorError("prepare() was already called on this executor; call it once, then run() every iteration")
        # messages each need their own tag (below MPI's TAG_UB); an engine without tags has no limit
        tag_limit = self.world.tag_limit() if self.entry.tagged else 2**62
        error = program = None
        try:  # a refusal here (the world size too) is shared with every rank before anyone raises
            program = lower(self.plan, self.device, tag_limit=tag_limit, first_tag=self.tag_offset)
            if self.order == "device":  # joined: one engine orders every tensor's steps (TransferExecutor)
                program = replace(program, order="device") if self.joined else in_device_order(program, stage_budget(self.plan))
            program = check_staging(self.plan, program, self.order)
        except PlanMismatchError as err:
            error = err
        self._agree(error)
        self.program = program
        return program

    def setup_engine(self, stage=None, stage_bytes: int | None = None) -> None:
        """`prepare()`'s second half: the communicator, the engine and its buffers (`stage`: a staging area the
        engine uses instead of allocating its own; `TransferExecutor` passes one shared by every tensor, which
        the first tensor's engine allocates, `stage_bytes` of it where the tensors run one after another)."""
        self.src_shape = self.program.src_shape
        self.comm = self.shared_comm if self.shared_comm is not None else self.world.engine_comm(self.timeout_s, self.poll_s)
        problem = self.plan.problem
        context = EngineContext(self.comm, rank_of_devices(self.plan), problem.dtype, storage_dtype(problem.dtype),
                                self.timeout_s, self.poll_s, self.gpu, problem.cluster.devices_per_host, self.joined,
                                self.transport)
        self.flight.engine = engine = self.entry.make(self.program, context)
        if self.backend in TORCH_BACKENDS and self.world.kind == "torch" and self.world.backend != self.backend:
            raise ExecutorError(f"backend={self.backend!r} but the process group runs {self.world.backend}; "
                                "pass backend='torch' (any group) or a group of that backend")
        if stage is not None:
            engine.setup(stage=stage)
        elif stage_bytes is not None:
            engine.setup(stage_bytes=stage_bytes)
        else:
            engine.setup()

    def _agree(self, error: PlanMismatchError | None) -> None:
        """All ranks learn whether any rank refused the plan or loaded a different one."""
        mine = np.concatenate([[0 if error is None else 1], plan_fingerprint(self.plan)]).astype(np.int64)
        every = self.world.allgather(mine, self.timeout_s, self.poll_s, "prepare() on every rank")
        prints = [every[r, 1:].tobytes() for r in range(len(every))]
        counts = Counter(prints)
        common = max(counts, key=lambda f: (counts[f], f == prints[0]))  # the majority's plan (rank 0's on a tie)
        other = [r for r, f in enumerate(prints) if f != common]
        if other:
            rest = len(prints) - len(other)
            raise PlanMismatchError(f"{_list(other)} loaded a different plan than the other {rest} rank{'s' if rest > 1 else ''}; "
                                    "start every rank with the same plan file", same_on_every_rank=True)
        if error is not None:
            raise error
        refused = [r for r in range(len(every)) if every[r, 0]]
        if refused:
            raise PlanMismatchError(f"{_list(refused)} refused the plan (their errors say why); nothing was moved",
                                    same_on_every_rank=True)

    def run(self, local_shard=None):
        """Reshard once: this rank's source shard in (None if it has none), its destination shard out (or None)."""
        self.start(local_shard)
        return self.wait()

    def start(self, local_shard=None) -> None:
        """Begin a reshard and return at once; do not modify `local_shard` until `wait()` returns."""
        self._startable()
        self.flight.start(self._adopt(local_shard))

    def start_adopted(self, array) -> None:
        """`start()` with a source shard its caller already checked and adopted (`_adopt`), so a multi-tensor
        executor checks every tensor's input before starting any without checking it twice."""
        self._startable()
        self.flight.start(array)

    def _startable(self) -> None:
        flight = self.flight
        flight.usable("run() or start()")
        if flight.in_flight:
            raise ExecutorError("start() called while a reshard is in flight; call wait() first")

    def test(self) -> bool:
        """Drive communication without blocking (call it now and then between start() and wait()).

        True when the reshard has finished (and when none is in flight); raises if the executor failed.
        """
        return self.flight.test()

    def wait(self):
        """Finish the reshard begun by start(); returns the destination shard (None on ranks outside the destination mesh)."""
        return self.flight.wait()

    def close(self) -> None:
        """Release what prepare() made: the engine's requests or communicators, and the duplicated MPI communicator.

        Call it on every rank when done with an executor (a loop that makes executors without closing
        them runs out of MPI communicators after about 2,000). The executor cannot run again. A
        reshard still in flight (say, an exception in compute between test() calls) is first
        finished, for up to `timeout_s`, since the peers are waiting for this rank's part; if it
        cannot finish it is abandoned, so `close()` in a `finally:` block always returns. After an
        abandoned reshard, sends still in flight may go on reading the source shard handed to
        start(): do not overwrite it until the peers are done.
        """
        interrupted = self.flight.close()
        comm, self.comm = self.comm, None
        if self.shared_comm is None:  # a shared communicator is its owner's to release
            self.world.release(comm)
        if interrupted is not None:
            raise interrupted

    def _adopt(self, local_shard):
        """The source shard as the backend's array type, checked against the plan (None when this rank sends nothing)."""
        p = self.program
        if p.src_block is None:
            if local_shard is not None:
                raise PlanMismatchError(f"run(): device {p.device} (rank {self.world.rank}) is not in the source mesh, "
                                        "so it has no source shard; pass None (check the rank-to-device mapping in docs/executor.md)")
            return None
        if local_shard is None:
            raise PlanMismatchError(f"run(): device {p.device} is in the source mesh; pass its source shard of shape {p.src_shape}")
        engine = self.flight.engine
        array = engine.adopt(local_shard)
        engine.check(array, self.src_shape, self.plan.problem.dtype, p.device, self.plan.problem.src.spec)
        return engine.contiguous(array)


def _list(ranks: list[int]) -> str:
    """`rank 3` or `ranks 1,2,5`."""
    shown = ",".join(map(str, ranks[:8])) + (f" (+{len(ranks) - 8} more)" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"

