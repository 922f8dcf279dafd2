"""`ReshardingExecutor`: what a training loop calls at every stage boundary to reshard one tensor.

    ex = ReshardingExecutor(plan, MPI.COMM_WORLD).prepare()   # once: checks, buffers, communicators
    ex = ReshardingExecutor(plan, group)                       # or a torch.distributed process group
    new_shard = ex.run(old_shard)                              # every iteration
    ex.start(old_shard); ...compute...; new_shard = ex.wait()  # the same, overlapped with compute

Rank r plays the r-th smallest device id of the plan's two meshes (see `executor.ranks`). `Executor`
is the one executor: prepare() lowers the plan for this rank's device once, every tensor together, and
runs the passes its order asks for (`passes.rank_program`); the engine is looked up by name in
`executor.engines` and fed that program. `ReshardingExecutor` is its one-tensor face (a shard in and
out), `transfer_executor.TransferExecutor` its multi-tensor face (a name -> shard mapping). `run()`
returns the engine's own destination buffer, reused by the next call: copy it if you keep it.
"""

from __future__ import annotations

import hashlib
from collections import Counter

import numpy as np

from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.plan_tensors import is_multi, tensor_names

from .engines import BACKENDS, TORCH_BACKENDS, EngineContext, TransportOptions, engine_entry, world_of_backend
from .errors import BackendUnavailableError, ExecutorError, PlanMismatchError
from .lower import ORDERS, RankProgram
from .passes import rank_program
from .plan_file import PlanFile, open_plan
from .ranks import device_of_rank, rank_of_devices
from .replay import stopped
from .worlds import MpiWorld, TorchWorld, is_mpi_comm, is_torch_group, poll_until
from .timeouts import MAX_TIMEOUT_S, check_timeout, is_number

DEFAULT_POLL_S = (2e-5, 1e-3)


def plan_fingerprint(plan: Plan | PlanFile) -> np.ndarray:
    """First 16 bytes of the SHA-256 of the plan's JSON (of a plan file's bytes), as two int64 (ranks compare these)."""
    digest = plan.digest() if isinstance(plan, PlanFile) else hashlib.sha256(plan.to_json().encode()).digest()
    return np.frombuffer(digest[:16], dtype=np.int64).copy()


def poll(request, timeout_s: float, poll_s: tuple[float, float], what: str) -> None:
    """Wait for one MPI request with sleeps between tests; PeerTimeoutError naming `what` after `timeout_s`."""
    poll_until(request.Test, timeout_s, poll_s, what)


def world_kind(comm, backend: str | None) -> str:
    """The kind of world `comm` names, read without joining it: `torch` for a torch process group (or None, torch's
    default group, with a torch backend), `mpi` for an mpi4py communicator; TypeError naming what to pass otherwise."""
    if is_torch_group(comm) or (comm is None and world_of_backend(backend) == "torch"):
        return "torch"
    if not is_mpi_comm(comm):
        raise TypeError(f"comm is a {type(comm).__name__}; pass an mpi4py communicator, e.g. MPI.COMM_WORLD, "
                        "or a torch.distributed process group (None: the default group, with backend='torch')")
    return "mpi"


def check_staging(plan: Plan, program: RankProgram, order: str) -> RankProgram:
    """`program` when its staging fits the peak the plan states for its device (a plan compiled with
    `--max-staging-mb`); else PlanMismatchError naming the order, the bytes and the fix (`check_stage_need`)."""
    check_stage_need(plan, order, program.device, program.stage_bytes)
    return program


def check_stage_need(plan: Plan | PlanFile, order: str, device: int, need: int, how: str = "", backend: str | None = None,
                     same_on_every_rank: bool = False) -> None:
    """The one staging refusal: PlanMismatchError where `device` needs `need` bytes of staging in `order` (`how`: what
    is staged at once), more than the plan states for it (a plan compiled with `--max-staging-mb`; none stated: no
    limit; posted, the limit itself). The fix is another order or a recompile without the limit; where `backend` lays staging out its own way
    (NCCL) and needs more than the plan's largest operation, the plan itself is wrong: recompile and verify it."""
    if plan.staging is None:
        return
    limit = plan.staging.limit_bytes  # posted keeps within the limit (`executor.window`), device order within its stated peaks
    stated = limit if order == "posted" else plan.staging.peak_bytes.get(device, 0)
    if need <= stated:
        return
    who = f"order={order!r}" if backend is None else f"backend {backend!r} in order={order!r}"
    head = f"{who} needs {need} B of staging on device {device}{f' ({how})' if how else ''}, but the plan states {stated} B there"
    if backend is None:
        fix = (f"(compiled with a staging limit of {limit} B, --max-staging-mb, for order={plan.staging.order!r}); run it with "
               f"order={plan.staging.order!r}, or recompile it without --max-staging-mb to run it in this order")
    else:
        fix = (f"(staging.peak_bytes; compiled with a staging limit of {limit} B, --max-staging-mb), less than its largest "
               "operation; recompile the plan and check it with `xmesh-plan verify`")
    raise PlanMismatchError(f"{head} {fix}", same_on_every_rank=same_on_every_rank)


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

    def start(self, source, into=None) -> None:
        """Start the engine on `source` (the caller checked `usable` and adopted the source shard), writing the caller's
        destination tensors `into` in place where given (`Executor._into`)."""
        if self.in_flight:
            raise ExecutorError("start() called while a reshard is in flight; call wait() first")
        try:
            self.in_flight = True
            if into is None:
                self.engine.start(source)
            else:
                self.engine.start(source, into)
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


class Executor(Flying):
    """The executor: one plan (every tensor of it) on this rank, lowered once into one program (`passes.rank_program`)
    that one engine replays. `ReshardingExecutor` (one tensor, a shard in and out) and `TransferExecutor` (a name ->
    shard mapping in and out) are its two faces; they differ only in what they take and give back.

    `backend`: a name in `executor.engines.BACKENDS`; None picks `mpi` for an mpi4py communicator and `torch` for a
    process group. With a process group, `gloo` and `nccl` also pick `torch` and must match the group's backend.
    `order`: `device` (each device takes part in one operation at a time, in plan order, as the plan was scheduled)
    or `posted` (every message posted at once; see `lower.in_device_order`). `transport`: how messages are matched
    and acknowledged (`engines.TransportOptions`), the same on every rank."""

    def __init__(self, plan: Plan | PlanFile, comm=None, backend: str | None = None, timeout_s: float = 60.0,
                 poll_s: tuple[float, float] = DEFAULT_POLL_S, gpu: int | None = None, order: str = "device",
                 transport: TransportOptions | None = None):
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend {backend!r} is unknown; use one of: {', '.join(BACKENDS)}")
        # the plan is checked before `comm` (every rank refuses a bad plan alike); world_kind agrees with this guess or raises
        self.entry = engine_entry(backend, "mpi" if is_mpi_comm(comm) else "torch")
        order = self._order(plan, order)
        if order not in ORDERS:
            raise ValueError(f"order {order!r} is unknown; use one of: {', '.join(ORDERS)}")
        self._check_plan(plan, order)
        world_kind(comm, backend)
        world = TorchWorld(comm) if self.entry.world == "torch" else MpiWorld(comm)
        timeout_s = check_timeout(timeout_s)
        if not (isinstance(poll_s, (tuple, list)) and len(poll_s) == 2 and all(map(is_number, poll_s))
                and 0 < poll_s[0] <= poll_s[1] <= MAX_TIMEOUT_S):
            raise ValueError(f"poll_s={poll_s!r} must be (shortest, longest) sleep in seconds with 0 < shortest <= longest")
        self.plan, self.world, self.backend = plan, world, backend or self.entry.name
        self.problems = plan.problem.tensor_problems()  # each tensor's own problem (its shape, dtype and specs)
        self.names = tensor_names(plan)  # the tensors' names, in plan order; `index`: name -> position
        self.index = {name: t for t, name in enumerate(self.names)}
        self.timeout_s, self.poll_s, self.gpu, self.order = float(timeout_s), (float(poll_s[0]), float(poll_s[1])), gpu, order
        if transport is not None and not isinstance(transport, TransportOptions):
            raise TypeError(f"transport is a {type(transport).__name__}; pass an executor.TransportOptions or None")
        self.transport = transport or TransportOptions()
        self.program: RankProgram | None = None
        self.flight = Flight()  # the engine (once prepared) and the calls into it
        self.comm = None
        self.own_file: PlanFile | None = None  # a file from_file() opened: closed once prepare() read it, or by close()

    def _order(self, plan: Plan | PlanFile, order: str | None) -> str | None:
        """The order to run in, `order` as given (a face may pick one where it is None, from the plan and `self.entry`)."""
        return order

    def _check_plan(self, plan: Plan | PlanFile, order: str) -> None:
        """What a face refuses from the plan alone, on every rank alike, before the world is joined (nothing here)."""

    @classmethod
    def from_file(cls, path, comm=None, **options):
        """The executor of the plan file `path` (the same options as the constructor): of a compact file
        (`*.plan.npz`) each rank reads only the operations its device takes part in (`plan_file`), in
        prepare(), from the file it opened here; a JSON file is read whole."""
        plan = open_plan(path)
        try:
            executor = cls(plan, comm, **options)
        except BaseException:
            if isinstance(plan, PlanFile):
                plan.close()
            raise
        executor.own_file = plan if isinstance(plan, PlanFile) else None
        return executor

    @property
    def device(self) -> int:
        return device_of_rank(self.plan, self.world.rank, self.world.size, self.world.label, self.world.launch)

    @property
    def program(self) -> RankProgram | None:
        """This device's program (every tensor of the plan), made by prepare()."""
        return self._program

    @program.setter
    def program(self, program: RankProgram | None) -> None:
        self._program = program
        self.src_shapes = None if program is None else [t.given_shape for t in program.tensors]  # made once: run() checks against them

    @property
    def stage_bytes(self) -> int:
        """Bytes of staging this rank allocated (the engine's own layout where it has one, NCCL's), at most what the
        plan states for this device when it states any."""
        own = getattr(self.flight.engine, "stage_bytes", None)
        return own if own is not None else self.program.stage_bytes

    def prepare(self):
        """Check the plan against this world on every rank, then allocate buffers; all ranks must call it.

        Each rank lowers the plan for its device (`passes.rank_program`); the ranks then compare plan
        fingerprints and outcomes, so a bad plan or a rank with another plan fails everywhere before any byte moves.
        """
        if self.flight.engine is not None or self.program is not None or self.flight.closed:
            raise ExecutorError("prepare() was already called on this executor; call it once, then run() every iteration")
        # messages each need their own tag (below MPI's TAG_UB); an engine without tags has no limit
        tag_limit = self.world.tag_limit() if self.entry.tagged else None
        error = program = None
        try:  # a refusal here (the world size too) is shared with every rank before anyone raises
            receipts = self.transport.receipt_bytes if self.entry.receipts and self.world.buffered_sends else None
            program = rank_program(self.plan, self.device, self.order, self.entry.concurrent, tag_limit, receipts,
                                   self.entry.collectives)
            self._check_staging(program)
            self.entry.check_requires(program)
        except (PlanMismatchError, BackendUnavailableError) as err:
            error = err
        try:
            self._agree(error)
        finally:
            self._close_file()
        self.program = program
        self._setup_engine()
        return self

    def _close_file(self) -> None:
        """Close the plan file from_file() opened (its header stays: all that the executor uses after prepare())."""
        if self.own_file is not None:
            self.own_file.close()

    def _check_staging(self, program: RankProgram) -> None:
        """Refuse (PlanMismatchError) a program whose staging is above the peak the plan states for its device."""
        check_staging(self.plan, program, self.order)

    def _setup_engine(self) -> None:
        """`prepare()`'s second half: the communicator, the engine and its buffers."""
        self.comm = self.world.engine_comm(self.timeout_s, self.poll_s)
        context = EngineContext(self.comm, rank_of_devices(self.plan), self.timeout_s, self.poll_s, self.gpu,
                                self.plan.problem.cluster.devices_per_host, self.transport)
        self.flight.engine = engine = self.entry.make(self.program, context)
        if self.backend in TORCH_BACKENDS and self.world.kind == "torch" and self.world.backend != self.backend:
            raise ExecutorError(f"backend={self.backend!r} but the process group runs {self.world.backend}; "
                                "pass backend='torch' (any group) or a group of that backend")
        engine.setup()

    def _agree(self, error: PlanMismatchError | BackendUnavailableError | None) -> None:
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

    def _startable(self) -> None:
        flight = self.flight
        flight.usable("run() or start()")
        if flight.in_flight:
            raise ExecutorError("start() called while a reshard is in flight; call wait() first")

    def _adopt(self, t: int, local_shard, call: str = "run()"):
        """Tensor t's source shard as the backend's array type, checked against the plan (None when this rank sends
        none of it)."""
        p = self._program
        shape = self.src_shapes[t]
        if shape is None:
            if local_shard is not None:
                raise PlanMismatchError(f"{call}: device {p.device} (rank {self.world.rank}) is not in the source mesh, "
                                        "so it has no source shard; pass None (check the rank-to-device mapping in docs/executor.md)")
            return None
        if local_shard is None:
            raise PlanMismatchError(f"{call}: device {p.device} is in the source mesh; pass its source shard of shape {shape}")
        engine = self.flight.engine
        array = engine.adopt(local_shard)
        problem = self.problems[t]
        engine.check(array, shape, problem.dtype, p.device, problem.src.spec)
        return engine.contiguous(array)

    def _into(self, t: int, array, call: str):
        """The caller's destination tensor for tensor t (None: none given), checked against the plan: this device
        holds a destination shard of it, and the engine writes tensors in place (`engines.EngineEntry.receives_into`)."""
        if array is None:
            return None
        p = self._program
        shape = p.tensors[t].dst_shape
        if not self.entry.receives_into:
            raise PlanMismatchError(f"{call}: backend {self.entry.name!r} binds its requests to its own destination shards once, "
                                    "in prepare(), so it cannot write yours in place; copy from the shards run() returns, or run "
                                    "over a torch process group (backend='torch'), which receives into the tensors you pass")
        if shape is None:
            raise PlanMismatchError(f"{call}: device {p.device} (rank {self.world.rank}) holds no destination shard of tensor "
                                    f"{self._name(t)!r}; pass `into` only for the tensors whose destination mesh has this device")
        engine = self.flight.engine
        array = engine.adopt_into(array, self._name(t)) if self.entry.adopts_into else engine.adopt(array)
        problem = self.problems[t]
        engine.check_into(array, shape, problem.dst_dtype or problem.dtype, p.device, self._name(t))
        return array

    def _name(self, t: int) -> str:
        return self.names[t]

    def _apart(self, targets: dict, sources: list) -> None:
        """Refuse arrays of one call sharing memory with one it writes, on an engine that checks it: the caller's
        destination tensors (`targets`, by name) with each other or with its source shards (`sources`, per tensor;
        `check_apart`), and on every call the engine's own destination shards that it writes with the caller's arrays
        (`check_own`)."""
        engine = self.flight.engine
        check, own = getattr(engine, "check_apart", None), getattr(engine, "check_own", None)
        if (check is None or not targets) and own is None:
            return
        named = dict(zip(self.names, sources))
        if check is not None and targets:
            check(targets, named, self._program.device)
        if own is not None:
            own(targets, named, self._program.device)

    def test(self) -> bool:
        """Drive communication without blocking (call it now and then between start() and wait()).

        True when the reshard has finished (and when none is in flight); raises if the executor failed.
        """
        return self.flight.test()

    def close(self) -> None:
        """Release what prepare() made: the engine's requests or communicators, and the duplicated MPI communicator.

        Call it on every rank when done with an executor (a loop that makes executors without closing
        them runs out of MPI communicators after about 2,000). The executor cannot run again. A
        reshard still in flight (say, an exception in compute between test() calls) is first
        finished, for up to `timeout_s`, since the peers are waiting for this rank's part; if it
        cannot finish it is abandoned, so `close()` in a `finally:` block always returns. After an
        abandoned reshard, sends still in flight may go on reading the source shards handed to
        start(): do not overwrite them until the peers are done.
        """
        interrupted = self.flight.close()
        self._close_file()
        comm, self.comm = self.comm, None
        self.world.release(comm)
        if interrupted is not None:
            raise interrupted


class ReshardingExecutor(Executor):
    """The one-tensor face of `Executor`: replays one plan on this rank, a shard in and out; see the module
    docstring for the calling pattern. Staging is the largest run's in device order and the sum of every staged
    box posted; a plan compiled with `--max-staging-mb` states its peaks, and an order that would need more is
    refused in prepare()."""

    def __init__(self, plan: Plan | PlanFile, comm=None, backend: str | None = None, timeout_s: float = 60.0,
                 poll_s: tuple[float, float] = DEFAULT_POLL_S, gpu: int | None = None, order: str = "device",
                 transport: TransportOptions | None = None):
        if not isinstance(plan, (Plan, PlanFile)):
            raise TypeError(f"plan is a {type(plan).__name__}; pass a schemas.Plan, e.g. schemas.read_plan_file('x.plan.json')")
        if is_multi(plan):
            raise TypeError(f"plan moves {len(plan.problem.tensors)} tensors; run it with executor.TransferExecutor "
                            "(a name -> shard mapping in and out)")
        super().__init__(plan, comm, backend, timeout_s, poll_s, gpu, order, transport)
        self.target = None  # the caller's destination tensor of the reshard in flight (start()'s `into`)

    def run(self, local_shard=None, into=None):
        """Reshard once: this rank's source shard in (None if it has none), its destination shard out (or None);
        `into`: the tensor to write it in (`start`)."""
        self._start(local_shard, into, "run()")
        return self.wait()

    def start(self, local_shard=None, into=None) -> None:
        """Begin a reshard and return at once; do not modify `local_shard` until `wait()` returns. `into`: a tensor of
        this rank's destination shard's shape and dtype (a view into a larger tensor is fine) that the reshard writes in
        place, kept only until `wait()` returns (None: the engine's own buffer)."""
        self._start(local_shard, into, "start()")

    def _start(self, local_shard, into, call: str) -> None:
        """start() for `call`, the call that was made (its name in a refusal)."""
        self._startable()
        try:
            target = None if into is None else self._into(0, into, call)  # no call on the common path: run() is timed per call
            source = self._adopt(0, local_shard, call)
            self._apart({} if target is None else {self.names[0]: target}, [source])
        except PlanMismatchError as err:
            raise named_call(err, call) from None
        self.flight.start(source, target)
        self.target = target

    def wait(self):
        """Finish the reshard begun by start(); returns the destination shard (None on ranks outside the destination
        mesh): the tensor passed as `into`, else the engine's own buffer, reused by the next call."""
        target, self.target = self.target, None
        shard = self.flight.wait()
        return shard if target is None else target


def named_call(err: PlanMismatchError, call: str) -> PlanMismatchError:
    """`err`, a refusal of a call's arrays by a check that run() and start() share (its text begins `run(): `), naming
    `call`, the call that was made."""
    text = str(err)
    if call == "run()" or not text.startswith("run(): "):
        return err
    return PlanMismatchError(call + text[len("run()"):], err.same_on_every_rank)


def _list(ranks: list[int]) -> str:
    """`rank 3` or `ranks 1,2,5`."""
    shown = ",".join(map(str, ranks[:8])) + (f" (+{len(ranks) - 8} more)" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"

