"""One engine protocol and a name -> engine registry: every engine replays the same lowered `RankProgram`.

The executor (`executor.Executor`) lowers the plan once per rank, every tensor together, checks it on
every rank, then asks the registry for the engine its `backend` names and hands it the program and an
`EngineContext`. What an engine can do is data in its entry (`EngineEntry`), read instead of its name. Engines raise
only the classes in `executor.errors`, for the same states:

- `PlanMismatchError`: the shard handed in does not fit the plan (nothing moved);
- `PeerTimeoutError`: a transfer passed its deadline (the message names op, task and peer);
- `ExecutorError`: the engine was used after it broke or was closed;
- `BackendUnavailableError`: its library or device is missing.

>>> engine_entry("mpi", "mpi").module
'xmesh_plan.executor.mpi_engine'
>>> engine_entry("gloo", "torch").name
'torch'
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from xmesh_plan.schemas.convert import FP8_MAX
from xmesh_plan.schemas.staging import SYNC_SEND_BYTES

from .errors import PlanMismatchError
from .lower import RankProgram


@dataclass(frozen=True)
class TransportOptions:
    """How an engine matches and acknowledges its messages; pass the same on every rank (a rank that expects a
    receipt its peer never sends waits until its timeout).

    `match_by_tag`: False posts every message with tag 0, so gloo matches a pair's messages by their order alone,
    as NCCL does (tests use it to show a wrong order as wrong bytes). `receipt_bytes`: in device order on gloo, an
    engine with receipts (the torch engine) ends an operation's messages of at least this many bytes to one peer
    when the peer's 1-byte receipt arrives (`passes.with_receipts`; the MPI engine's synchronous sends start at the
    same size); None: no receipts."""

    match_by_tag: bool = True
    receipt_bytes: int | None = SYNC_SEND_BYTES

    def __post_init__(self) -> None:
        if not isinstance(self.match_by_tag, bool):
            raise ValueError(f"TransportOptions.match_by_tag={self.match_by_tag!r}; pass True or False")
        if self.receipt_bytes is not None and (not isinstance(self.receipt_bytes, int) or self.receipt_bytes < 1):
            raise ValueError(f"TransportOptions.receipt_bytes={self.receipt_bytes!r}; pass a positive byte count or None (no receipts)")


@dataclass(frozen=True)
class EngineContext:
    """What an engine needs besides its program (which names every tensor's shards and dtype): the communicator
    it owns, where each device's rank is, its deadline and poll sleeps, and (GPU engines) which device to use."""

    comm: Any
    rank_of: dict[int, int]
    timeout_s: float
    poll_s: tuple[float, float]
    gpu: int | None = None
    devices_per_host: int = 1
    transport: TransportOptions = TransportOptions()


class Engine(Protocol):
    """Replays one RankProgram (every tensor of a plan) every iteration; made by the registry, then `setup()` once."""

    program: RankProgram
    dsts: list  # per tensor, this rank's destination shard (the engine's own buffer, reused), None outside that mesh (and, on an
    # engine that `receives_into`, until a call passes no tensor of the caller's for it)
    dst: Any  # dsts[0]: the one-tensor face
    broken: str | None  # why the engine refuses to run again, None while usable

    def setup(self) -> None:
        """Allocate buffers and make everything that does not depend on the source shard."""

    def adopt(self, array: Any) -> Any:
        """The caller's source shard as this engine's array type, without a copy where possible."""

    def check(self, array: Any, shape: tuple[int, ...], dtype_name: str, device: int, spec: object) -> None:
        """Refuse (PlanMismatchError) a shard of the wrong shape or element type."""

    def contiguous(self, array: Any) -> Any:
        """`array` itself when C-contiguous, else a contiguous copy."""

    def start(self, src: Any) -> None:
        """Begin one reshard and return at once: `src` is a one-tensor program's source shard, or a sequence of one per
        tensor (None where the device has none). An engine with `EngineEntry.receives_into` also takes `into`: the
        caller's destination tensors in the same form, written in place (`executor.destinations`)."""

    def test(self) -> bool:
        """Drive progress without blocking; True when finished."""

    def wait(self) -> None:
        """Block until finished or raise PeerTimeoutError after `timeout_s` without progress."""

    def abandon(self, why: str) -> None:
        """Give up on a reshard in flight and refuse to run again."""

    def close(self) -> None:
        """Release what setup() made; the engine cannot run again."""

    def poison(self) -> None:
        """Fill the destination shards with 0xA5 bytes (checks prove the next run wrote all of them)."""

    def host_copy(self, array: Any) -> np.ndarray:
        """`array` as a numpy array on the host (for checks)."""


@dataclass(frozen=True)
class EngineEntry:
    """A registered engine: the kind of world it runs over, where it lives and how to build it."""

    name: str
    world: str  # "mpi" (an mpi4py communicator) or "torch" (a torch.distributed process group)
    module: str
    build: Callable[[Any, RankProgram, EngineContext], Engine]
    summary: str
    # What the engine can do, read by the executor instead of comparing engine names:
    # several reshards in flight at once, a waiting one driving the others (so a multi-tensor plan posts
    # every tensor's messages at once, and that is its default order for such a plan; an engine that cannot
    # runs a multi-tensor plan posted one tensor after another, `passes.one_tensor_at_a_time`)
    concurrent: bool = False
    # messages carry MPI-style tags, each below the world's tag limit (NCCL's calls carry none)
    tagged: bool = True
    # it lays staging out its own way: what it allocates is known only once the program is lowered (`need`)
    own_staging: bool = False
    # the staging bytes the engine allocates for a program (None: the program's own `stage_bytes`)
    need: Callable[[Any, RankProgram], int] | None = None
    # replays receipts (`passes.with_receipts`): in device order, on a world whose sends end once buffered
    # (`worlds.TorchWorld.buffered_sends`: gloo), large sends end when the receiver's receipt arrives
    receipts: bool = False
    # writes the caller's destination tensors in place (`run(..., into=...)`, `executor.destinations`); an engine that
    # binds persistent requests or communicator calls to its own shards once, in setup(), refuses them instead
    receives_into: bool = False
    # takes the caller's destination tensors through its own `adopt_into(array, name)`, which checks where their memory
    # is and names the tensor when it refuses (else through `adopt`, as source shards)
    adopts_into: bool = False
    # converts at the sender (`executor.conversions`): casts each source shard to its destination dtype and computes
    # FP8 scales before sending; an engine that cannot refuses a converting plan in `make`
    converts: bool = False
    # replays the program's group calls (`RankProgram.collectives`) rather than its steps: the lowering makes them only
    # for such an engine (a rank of a large plan makes half the objects without them)
    collectives: bool = False
    # raises BackendUnavailableError where a library the engine imports in setup() for this device's program is missing;
    # `prepare()` calls it before the ranks agree, so every rank learns of it before any communicator is made
    requires: Callable[[Any, RankProgram], None] | None = None

    def check_requires(self, program: RankProgram) -> None:
        """BackendUnavailableError where this device's part of `program` needs a library that is missing (`requires`)."""
        if self.requires is not None:
            self.requires(importlib.import_module(self.module), program)

    def make(self, program: RankProgram, context: EngineContext) -> Engine:
        """Import the engine's module (only now: CuPy and torch are optional) and build the engine; PlanMismatchError,
        the same on every rank, for a converting plan on an engine that does not convert."""
        converting = next((t for t in program.tensors if t.convert is not None), None)
        unscaled = next((t for t in program.tensors if t.convert is not None and t.convert.dst_dtype in FP8_MAX
                         and t.convert.scale is None), None)
        if unscaled is not None:
            raise PlanMismatchError(f"the plan converts {unscaled.dtype} to {unscaled.dst_dtype} without scales; give the tensor "
                                    "scale = \"tensor\" or \"block\" in a multi-tensor problem, which carries them in its .scale "
                                    "tensor", same_on_every_rank=True)
        if converting is not None and not self.converts:
            can = " or ".join(e.name for e in ENGINES.values() if e.converts)
            raise PlanMismatchError(f"the plan converts {converting.dtype} to {converting.dst_dtype} at the sender, which the "
                                    f"{self.name} engine does not run; run it on the {can} engine (backend='mpi' with an "
                                    "mpi4py communicator, or 'gloo' or 'nccl' with a torch process group) or compile the plan "
                                    "without dst_dtype", same_on_every_rank=True)
        return self.build(importlib.import_module(self.module), program, context)

    def stage_need(self, program: RankProgram) -> int:
        """Bytes of staging this engine allocates to replay `program`."""
        return program.stage_bytes if self.need is None else self.need(importlib.import_module(self.module), program)


ENGINES: dict[str, EngineEntry] = {e.name: e for e in (
    EngineEntry("mpi", "mpi", "xmesh_plan.executor.mpi_engine",
                lambda m, p, c: m.MpiEngine(p, c.comm, c.rank_of, c.timeout_s, c.poll_s),
                "MPI point-to-point on host memory (numpy)", concurrent=True, receives_into=True, converts=True),
    EngineEntry("nccl", "mpi", "xmesh_plan.executor.nccl_engine",
                lambda m, p, c: m.NcclEngine(p, c.comm, c.rank_of, c.timeout_s, c.poll_s, gpu=c.gpu,
                                             devices_per_host=c.devices_per_host),
                "NCCL broadcasts through CuPy on GPUs, ids exchanged over MPI", tagged=False, own_staging=True, collectives=True,
                need=lambda m, p: m.nccl_program(p).stage_bytes, receives_into=True, adopts_into=True, converts=True,
                requires=lambda m, p: m.requires(p)),
    EngineEntry("torch", "torch", "xmesh_plan.executor.torch_engine", lambda m, p, c: m.TorchEngine(p, c),
                "torch.distributed isend/irecv over any process group (gloo on CPU, NCCL on CUDA)", receipts=True,
                receives_into=True, converts=True),
)}

TORCH_BACKENDS = ("gloo", "nccl")
"""Process-group backend names that, with a torch process group, select the torch engine (and are checked against the group)."""

ALIASES = {"gloo": "torch"}
"""Backend names that always select another engine (`gloo` runs over a torch process group whatever the world)."""

DEFAULT_ENGINE = {"mpi": "mpi", "torch": "torch"}
"""The engine a world of each kind runs when no backend is named."""

BACKENDS = (*ENGINES, *ALIASES)


def world_of_backend(backend: str | None) -> str | None:
    """The kind of world a backend name needs when no communicator says (None: either, or unknown)."""
    entry = ENGINES.get(ALIASES.get(backend, backend)) if backend is not None else None
    return None if entry is None else entry.world


def engine_entry(backend: str | None, world: str) -> EngineEntry:
    """The engine `backend` names for a world of kind `world` (None: the world's default); ValueError listing
    the valid names otherwise."""
    if backend is None:
        backend = DEFAULT_ENGINE[world]
    named = "torch" if world == "torch" and backend in TORCH_BACKENDS else ALIASES.get(backend, backend)
    entry = ENGINES.get(named)
    if entry is None:
        raise ValueError(f"backend {backend!r} is unknown; use one of: {', '.join(BACKENDS)}")
    if entry.world != world:
        hint = ("pass a torch.distributed process group (or None for the default group)" if entry.world == "torch"
                else "pass an mpi4py communicator, e.g. MPI.COMM_WORLD, or backend='torch' with a process group")
        raise ValueError(f"backend {backend!r} runs over {'a torch process group' if entry.world == 'torch' else 'MPI'}; {hint}")
    return entry
