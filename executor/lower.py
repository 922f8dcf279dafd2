"""Lower a plan to the steps one device runs: local copies, packs, unpacks, sends and receives.

One program per device for the whole plan, every tensor of it: a step's boxes and bytes name their
tensor, so buffers are keyed by (tensor, side), and one staging area serves every tensor. Only the
operations the device takes part in are walked (`plan_index`). Every rank lowers the same plan the
same way, so both ends of a message agree on its peer, tag and size without talking. Steps are plain records with the indices of the steps they wait for; the
backends only walk them. A box that is one contiguous run of its shard is sent from, or received
into, the shard itself; any other box goes through a staging area (packed before a send, unpacked
after it arrives; chunk by chunk when it is sent in chunks). Staging is laid out one operation after another (`stage_bytes` is the
sum: every operation may be in flight at once); `in_device_order` (a pass, like those in `executor.passes`)
lets each run of operations reuse it.

What each operation kind sends is its route in `schemas.op_kinds` (a chain for send and broadcast,
a ring for all-gather); this module lowers each route pattern, and tests check the steps against the route.
Tags: every operation owns a block of tags (`op_kinds.tags_used`: one per chunk of a broadcast, one
per ring step of an all-gather), tensor by tensor and in plan order within a tensor (`plan_index`), so two
messages between the same pair never share a tag.
"""

from __future__ import annotations

import math
from itertools import repeat
from dataclasses import dataclass, field, fields, replace
from enum import StrEnum
from functools import lru_cache
from typing import Any, Callable, Hashable, Literal, Mapping, Sequence

import numpy as np

from xmesh_plan.schemas import Operation, Plan
from xmesh_plan.schemas.geometry import Region, intersect, local_slices, region_shape, region_size
from xmesh_plan.schemas.plan import format_region
from xmesh_plan.schemas.op_kinds import bundle_runs, chunk_bounds, nccl_group, rule_of, supported, tags_used
from xmesh_plan.schemas.plan_check import TOLERANCE_S, PlanError, check_device_ops, describe, uncovered, uncovered_each
from xmesh_plan.schemas.plan_compact import DeviceOps
from xmesh_plan.schemas.carriers import group_key, group_runs, piece_layout, relay_areas
from xmesh_plan.schemas.staging import ORDERS, aligned, chained, contiguous_span, device_layout, staging_align

from .conversions import Conversion, conversions, scale_owners
from .errors import PlanMismatchError
from .plan_index import device_ops, plan_index, refusal_advice

class Action(StrEnum):
    """What a step does: a local copy between shards, a pack into or unpack out of staging, a move from staging to
    staging (a shared message's pieces into or out of the message, `_lower_group`), or one end of a message."""

    COPY = "copy"
    PACK = "pack"
    UNPACK = "unpack"
    MOVE = "move"
    SEND = "send"
    RECV = "recv"

    @property
    def is_message(self) -> bool:
        """A send or receive: a request to a peer (the others are local copies that run at once)."""
        return self in _MESSAGES

    @property
    def reads_staging_first(self) -> bool:
        """A step that device order gates behind the operations before it (messages, and packs into staging)."""
        return self in _GATED


def maker(cls: type) -> type:
    """A class whose call `maker(cls)(*values)` returns the `cls` that `cls(*values)` makes, every field given in field
    order, for `cls` a frozen dataclass with slots and no `__post_init__`: an unfrozen class with the same slots sets
    each field with a plain attribute store, then the instance becomes a `cls`. A frozen dataclass's own `__init__`
    sets each field through `object.__setattr__`, about ten times slower, and a rank of a large plan makes 10^5-10^6
    steps and byte ranges."""
    names = tuple(f.name for f in fields(cls))
    if names != getattr(cls, "__slots__", None):
        raise TypeError(f"{cls.__name__}: maker() needs a dataclass with slots=True, its slots its fields")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: maker() skips __post_init__, so it cannot make a class that has one; "
                        f"make {cls.__name__} with its own constructor")
    body = "".join(f"    self.{name} = {name}\n" for name in names)
    space = {"cls": cls}
    exec(f"def __init__(self, {', '.join(names)}):\n{body}    self.__class__ = cls\n", space)
    return type(f"_{cls.__name__}Maker", (), {"__slots__": names, "__init__": space["__init__"]})


_MESSAGES = frozenset({Action.SEND, Action.RECV})
_GATED = frozenset({Action.SEND, Action.RECV, Action.PACK})
Side = Literal["src", "dst"]


@dataclass(frozen=True, slots=True)
class Box:
    """A region as it sits in one of this device's shards; `span` is its byte range when contiguous."""

    side: Side
    region: Region
    index: tuple[slice, ...]
    shape: tuple[int, ...]
    nbytes: int
    span: tuple[int, int] | None
    tensor: int = 0  # which tensor's shard (an index into the plan's tensors; 0 for a single-tensor plan)


@dataclass(frozen=True, slots=True)
class Bytes:
    """A byte range of a buffer: tensor `tensor`'s source or destination shard (buffers are keyed by (tensor,
    side)), or the one staging area every tensor of the program shares."""

    buffer: Literal["src", "dst", "stage", "receipt"]  # receipt: 1-byte receipts (`passes.with_receipts`)
    start: int
    stop: int
    tensor: int = 0  # for "src" and "dst": whose shard

    @property
    def nbytes(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class Step:
    """One thing a device does; it may start once every step in `deps` has finished."""

    index: int
    action: Action
    op: int
    task: int
    kind: str
    deps: tuple[int, ...] = ()
    peer: int = -1
    tag: int = 0
    data: Bytes | None = None
    box: Box | None = None
    target: Box | None = None
    piece: str = ""
    tensor: int = 0  # the tensor whose operation this step belongs to
    acks: tuple[int, ...] = ()  # a receipt (`passes.with_receipts`): the messages whose arrival it reports
    origin: Bytes | None = None  # a move: the staging bytes it copies into `data`

    def moved(self, index: int, deps: tuple[int, ...]) -> "Step":
        """The same step at `index`, waiting for `deps` (what passes that renumber steps make)."""
        return self.at(index, deps, self.data)

    def at(self, index: int, deps: tuple[int, ...], data: "Bytes | None") -> "Step":
        """The same step at `index`, waiting for `deps`, on bytes `data` (passes that renumber steps or move their
        staging; `dataclasses.replace` costs ten times more, and they remake up to 10^6 steps); it names every field,
        which `test_a_moved_step_keeps_every_field_but_its_index_deps_and_data` checks."""
        return new_step(index, self.action, self.op, self.task, self.kind, deps, self.peer, self.tag, data, self.box,
                        self.target, self.piece, self.tensor, self.acks, self.origin)

    def shifted(self, index: int, deps: tuple[int, ...], by: int) -> "Step":
        """The same step at `index`, waiting for `deps`, its staging bytes (`data`, and a move's `origin`) `by` bytes
        lower: what passes that lay staging out again make."""
        data, origin = self.data, self.origin
        if data is not None and data.buffer == "stage":
            data = new_bytes("stage", data.start - by, data.stop - by, 0)
        if origin is not None:
            origin = new_bytes("stage", origin.start - by, origin.stop - by, 0)
        return new_step(index, self.action, self.op, self.task, self.kind, deps, self.peer, self.tag, data, self.box,
                        self.target, self.piece, self.tensor, self.acks, origin)

    @property
    def reads_src(self) -> bool:
        """Whether the step reads the caller's source shard (engines remake its request or views per shard)."""
        if self.action is Action.SEND:
            return self.data.buffer == "src"
        return (self.action is Action.COPY or self.action is Action.PACK) and self.box.side == "src"

    @property
    def src_tensor(self) -> int:
        """The tensor whose source shard a step that `reads_src` reads."""
        return self.tensor if self.action is Action.SEND else self.box.tensor

    @property
    def dst_tensor(self) -> int | None:
        """The tensor whose destination shard the step reads or writes (None: none): a message from or into it, a local
        copy into it, a pack or unpack of one of its boxes."""
        if self.action.is_message:
            return self.data.tensor if self.data.buffer == "dst" else None
        if self.action is Action.COPY:
            return self.target.tensor
        if self.action is Action.MOVE:
            return None
        return self.box.tensor if self.box.side == "dst" else None

    def describe(self) -> str:
        """`op 7 (task 3, broadcast chunk 2/4): receive 4096 B from device 5`, for error messages."""
        what = f"op {self.op} (task {self.task}, {self.kind}{' ' + self.piece if self.piece else ''})"
        if self.action is Action.SEND:
            return f"{what}: send {self.data.nbytes} B to device {self.peer}"
        if self.action is Action.RECV:
            return f"{what}: receive {self.data.nbytes} B from device {self.peer}"
        return f"{what}: {self.action}"


new_box, new_bytes, new_step = maker(Box), maker(Bytes), maker(Step)  # what the lowering and the passes make by the 10^5


@dataclass(frozen=True, slots=True)
class Collective:
    """One operation as a group call, for engines built on collectives (NCCL): `root` sends `box` to
    the rest of `group` in the byte ranges `chunks`; a local copy is a group of one with a `target`."""

    op: int
    task: int
    kind: str
    group: tuple[int, ...]
    root: int
    box: Box
    chunks: tuple[tuple[int, int], ...] = ()
    target: Box | None = None
    tensor: int = 0


@dataclass(frozen=True, slots=True)
class StagedCall:
    """One step of a bundle (or of a shared message's bundles, lowered together) for engines built on collectives
    (NCCL), in the order this device takes it: `pack` `box` (its source shard) into staging bytes [start, stop),
    `unpack` them into `box` (its destination shard), `move` the staging bytes at `source` into them, or `bcast`
    them from `root` to the other device of `group` (a send as a broadcast in a group of two). The bytes count from
    the start of the operation's (the shared message's) own staging: a stream runs one operation after another."""

    op: int
    task: int
    kind: str
    action: Literal["pack", "unpack", "move", "bcast"]
    start: int
    stop: int
    box: Box | None = None
    group: tuple[int, ...] = ()
    root: int = -1
    crossing: bool = False  # the cross-host message
    tensor: int = 0
    source: int = 0  # a move: where the bytes it copies start


def _staged_calls(steps: list[Step], first: int, device: int, tensor: int) -> list[StagedCall]:
    """A bundle's (or a shared message's) steps from index `first` on (this device's, in lowering order) as `StagedCall`s."""
    mine = steps[first:]
    base = min((s.data.start for s in mine if s.data is not None), default=0)
    out = []
    for s in mine:
        lo, hi = s.data.start - base, s.data.stop - base
        if s.action is Action.PACK or s.action is Action.UNPACK:
            out.append(StagedCall(s.op, s.task, s.kind, s.action, lo, hi, s.box, tensor=s.box.tensor))
        elif s.action is Action.MOVE:
            out.append(StagedCall(s.op, s.task, s.kind, "move", lo, hi, tensor=s.tensor, source=s.origin.start - base))
        elif s.action.is_message:
            root = device if s.action is Action.SEND else s.peer
            out.append(StagedCall(s.op, s.task, s.kind, "bcast", lo, hi, group=tuple(sorted((device, s.peer))), root=root,
                                  crossing=s.piece == "bundle", tensor=tensor))
    return out


@dataclass(frozen=True, slots=True)
class TensorShards:
    """One tensor's shards on a device: the box it holds before (`src_block`) and after (`dst_block`) the
    reshard (None outside that mesh), its element size as it crosses and its dtype name (`schemas.dtypes`).
    `convert`: how a sender converts it (`conversions.Conversion`; then `itemsize` and every buffer but the
    caller's source shard are in `dst_dtype`); `scale_of`: it carries that tensor's FP8 scales, which the
    senders compute, so the caller passes no source shard of it (`given_shape` is None)."""

    src_block: Region | None
    dst_block: Region | None
    itemsize: int
    dtype: str
    convert: Conversion | None = None
    scale_of: int | None = None

    @property
    def dst_dtype(self) -> str:
        """The dtype of the destination shard, of staging and of every message."""
        return self.dtype if self.convert is None else self.convert.dst_dtype

    @property
    def given_shape(self) -> tuple[int, ...] | None:
        """The shape of the source shard the caller passes (None: none, outside the source mesh or computed by the senders)."""
        return None if self.scale_of is not None else self.src_shape

    @property
    def src_shape(self) -> tuple[int, ...] | None:
        return None if self.src_block is None else region_shape(self.src_block)

    @property
    def dst_shape(self) -> tuple[int, ...] | None:
        return None if self.dst_block is None else region_shape(self.dst_block)


@dataclass(frozen=True, slots=True)
class RankProgram:
    """Everything one device does for a plan, every tensor of it: the steps, each tensor's shards
    (`tensors`, indexed as the plan's tensors; a step's boxes and bytes name theirs) and the staging
    area they share.

    `steps` are point-to-point (MPI, torch.distributed); `collectives` are the same operations as
    group calls in plan order (NCCL through CuPy): one lowering feeds every engine (it leaves the collectives out
    where asked: an engine that replays steps does not read them, `engines.EngineEntry.collectives`). The passes
    (`executor.passes`, `in_device_order`) map a program to a program; `carriers` and `align` are
    what `passes.share_messages` leaves for engines that merge a shared message's calls themselves.
    """

    device: int
    steps: tuple[Step, ...]
    stage_bytes: int
    tensors: tuple[TensorShards, ...]
    collectives: tuple[Collective | StagedCall, ...] = ()
    order: str = "posted"  # "device" after in_device_order: engines then also make a send finish only once received
    carriers: tuple[tuple[int, int], ...] = ()  # (bundle, the operation whose message carries it), `passes.share_messages`
    align: int = 1  # where each operation's staging starts (a multiple of the largest element size)

    # the one-tensor face: tensor 0's shards (a single-tensor plan's only tensor)
    @property
    def src_block(self) -> Region | None:
        return self.tensors[0].src_block

    @property
    def dst_block(self) -> Region | None:
        return self.tensors[0].dst_block

    @property
    def itemsize(self) -> int:
        return self.tensors[0].itemsize

    @property
    def src_shape(self) -> tuple[int, ...] | None:
        return self.tensors[0].src_shape

    @property
    def dst_shape(self) -> tuple[int, ...] | None:
        return self.tensors[0].dst_shape

    def messages(self) -> int:
        return sum(s.action.is_message for s in self.steps)

    def shard_steps(self) -> tuple[list[list[int]], list[list[int]], list[int]]:
        """Per tensor, the steps that read its source shard and those that read or write its destination shard (an
        engine binds them to the shards of each call), and the steps that touch neither (made once)."""
        reads: list[list[int]] = [[] for _ in self.tensors]
        uses: list[list[int]] = [[] for _ in self.tensors]
        neither = []
        for s in self.steps:
            touches = s.dst_tensor
            if s.reads_src:
                reads[s.src_tensor].append(s.index)
            if touches is not None:
                uses[touches].append(s.index)
            if not s.reads_src and touches is None:
                neither.append(s.index)
        return reads, uses, neither


def make_box(side: Side, region: Region, block: Region, itemsize: int, tensor: int = 0) -> Box:
    """`region` (inside `block`) as it sits in the C-ordered shard of tensor `tensor` holding `block`."""
    return new_box(side, region, *_placed(region, block, itemsize), tensor)


@lru_cache(maxsize=1 << 16)
def _placed(region: Region, block: Region, itemsize: int) -> tuple[tuple[slice, ...], tuple[int, ...], int, tuple[int, int] | None]:
    """(index, shape, bytes, byte span when contiguous) of `region` in a shard holding `block`: computed once per
    distinct box and shard, which a model's layers repeat."""
    shape = region_shape(region)
    return local_slices(region, block), shape, math.prod(shape) * itemsize, contiguous_span(region, block, itemsize)


def chunk_ranges(nbytes: int, chunks: int, itemsize: int) -> list[tuple[int, int]]:
    """Byte ranges of the non-empty pieces when `nbytes` is cut into `chunks` on element boundaries
    (`op_kinds.chunk_bounds`: all `chunks` of them in a checked plan, which has no more chunks than elements).

    >>> chunk_ranges(10, 3, 2)
    [(0, 2), (2, 6), (6, 10)]
    """
    return [(lo * itemsize, hi * itemsize) for lo, hi in chunk_bounds(nbytes // itemsize, chunks) if hi > lo]


def _chunk_names(ranges: list) -> list[str]:
    """`chunk 2/4` for each chunk of a message sent in several, for error messages ("" for one)."""
    return [f"chunk {k + 1}/{len(ranges)}" if len(ranges) > 1 else "" for k in range(len(ranges))]


def flat_pieces(shape: tuple[int, ...], lo: int, hi: int) -> list[Region]:
    """Boxes, relative to a box of `shape`, whose elements in C order are its elements lo..hi-1 in turn:
    at most 2 * ndim - 1 of them, so a chunk of a staged box is packed and unpacked on its own.

    >>> flat_pieces((2, 3), 1, 5)
    [((0, 1), (1, 3)), ((1, 2), (0, 2))]
    >>> flat_pieces((2, 3), 0, 6)
    [((0, 2), (0, 3))]
    """
    if lo >= hi:
        return []
    if len(shape) == 1:
        return [((lo, hi),)]
    inner = math.prod(shape[1:])
    (r0, c0), (r1, c1) = divmod(lo, inner), divmod(hi, inner)
    if r0 == r1:
        return [((r0, r0 + 1),) + p for p in flat_pieces(shape[1:], c0, c1)]
    out = []
    if c0:
        out += [((r0, r0 + 1),) + p for p in flat_pieces(shape[1:], c0, inner)]
        r0 += 1
    if r1 > r0:
        out.append(((r0, r1),) + tuple((0, n) for n in shape[1:]))
    if c1:
        out += [((r1, r1 + 1),) + p for p in flat_pieces(shape[1:], 0, c1)]
    return out


def is_empty(region: Region) -> bool:
    return any(a >= b for a, b in region)


class _Writes:
    """The boxes of the destination shard written so far, each with the step that writes it; finds the
    ones overlapping a box with one vectorised test instead of a Python loop over all of them."""

    def __init__(self, ndim: int):
        self.ndim = ndim
        self.regions: list[Region] = []
        self.steps: list[int] = []
        self.ends: list[float] = []  # predicted end of the operation that writes region k
        self.bounds = np.empty((0, 2, ndim), np.int64)  # [k, 0] = starts, [k, 1] = stops of region k, made when asked

    def add(self, region: Region, step: int, end_s: float) -> None:
        self.regions.append(region)
        self.steps.append(step)
        self.ends.append(end_s)

    def overlapping(self, region: Region) -> list[tuple[Region, int, float]]:
        """(the part of each written box inside `region`, its step, its end time), in write order."""
        n = len(self.regions)
        if not n:
            return []
        if len(self.bounds) < n:  # the boxes added since the last call, as arrays
            added = np.array(self.regions[len(self.bounds):], np.int64).reshape(-1, self.ndim, 2).transpose(0, 2, 1)
            self.bounds = np.concatenate([self.bounds, added])
        lo, hi = np.array(region, np.int64).T
        b = self.bounds
        hit = np.flatnonzero(((b[:, 0] < hi) & (b[:, 1] > lo) & (b[:, 0] < b[:, 1]) & (lo < hi)).all(axis=1))
        return [(intersect(self.regions[k], region), self.steps[k], self.ends[k]) for k in hit.tolist()]


@dataclass
class _Tensor:
    """One tensor as one device lowers it: its shards, and the boxes of its destination shard received so far."""

    index: int
    shards: TensorShards
    ndim: int
    writes: _Writes = field(init=False)
    received: list[tuple[Operation, Sequence[Region]]] = field(default_factory=list)  # (operation, the boxes it brought)
    received_elements: int = 0  # the elements of the boxes in `received`, counted as they arrive

    def __post_init__(self) -> None:
        self.writes = _Writes(self.ndim)


@dataclass
class _Builder:
    """Accumulates one device's steps while walking its operations in plan order; `tensor` is the one the
    operation being lowered moves (`enter`)."""

    device: int
    tensors: list[_Tensor]
    collect: bool = True  # make `collectives` (only engines built on collectives replay them)
    steps: list[Step] = field(default_factory=list)
    collectives: list[Collective | StagedCall] = field(default_factory=list)
    stage_bytes: int = 0
    tensor: _Tensor = field(init=False)
    itemsize: int = 0
    writes: _Writes = field(init=False)
    _memo: dict = field(default_factory=dict)  # `memo`

    def enter(self, tensor: int) -> None:
        """The next operations move tensor `tensor`: its shards, element size and writes."""
        self.tensor = self.tensors[tensor]
        self.itemsize, self.writes = self.tensor.shards.itemsize, self.tensor.writes

    def add(self, action: Action, op: Operation, deps: tuple[int, ...] = (), peer: int = -1, tag: int = 0,
            data: Bytes | None = None, box: Box | None = None, target: Box | None = None, piece: str = "",
            origin: Bytes | None = None) -> int:
        index = len(self.steps)
        self.steps.append(new_step(index, action, op.id, op.task, op.kind, deps, peer, tag, data, box, target, piece,
                                   self.tensor.index, (), origin))
        return index

    def collective(self, op: Operation, root: int, box: Box, chunks=(), target: Box | None = None) -> None:
        if self.collect:
            self.collectives.append(Collective(op.id, op.task, op.kind, nccl_group(op), root, box, tuple(chunks), target, box.tensor))

    def stage(self, nbytes: int) -> int:
        start, self.stage_bytes = self.stage_bytes, self.stage_bytes + nbytes
        return start

    def memo(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """`make()`, once per `key` for this lowering: what a model's repeated layers would work out again. Keys may
        name objects by `id`: the operations being lowered keep them alive while the builder is."""
        try:
            return self._memo[key]
        except KeyError:
            value = self._memo[key] = make()
            return value

    def part_sizes(self, op: Operation) -> tuple[int, ...]:
        """Each part's bytes of bundle `op`, in its tensor's element size (once per parts list and element size)."""
        itemsize = self.tensors[op.tensor or 0].shards.itemsize
        return self.memo(("sizes", id(op.parts), itemsize), lambda: tuple(region_size(p) * itemsize for p in op.parts))

    def held(self, op: Operation) -> tuple[int, ...]:
        """The parts of bundle `op` this device holds (once per holders list: a model's layers share theirs)."""
        return self.memo(("held", id(op.holders)), lambda: tuple(i for i, h in enumerate(op.holders) if h == self.device))

    def needed(self, op: Operation) -> tuple[int, ...]:
        """The parts of bundle `op` this device needs (once per needers list)."""
        return self.memo(("needed", id(op.needers)), lambda: tuple(i for i, group in enumerate(op.needers) if self.device in group))

    def placements(self, parts: tuple[Region, ...], block: Region, itemsize: int) -> list:
        """Per part of `parts`, `_placed` in a shard holding `block`, filled in as the parts are first placed (`_staged_parts`)."""
        return self.memo(("placed", id(parts), block, itemsize), lambda: [None] * len(parts))

    def fail(self, op: Operation, message: str) -> None:
        raise PlanMismatchError(refusal_advice(f"{describe(op)}: {message}"))

    def box(self, side: Side, region: Region) -> Box:
        """`region` inside this device's shard of the current tensor (check_plan has proved it lies there)."""
        shards = self.tensor.shards
        block = shards.src_block if side == "src" else shards.dst_block
        return make_box(side, region, block, self.itemsize, self.tensor.index)

    def record(self, op: Operation, box: Box, steps: list[int]) -> None:
        """This device receives `box` of its destination shard (written by `steps`); `lower` checks at the end that
        nothing arrived twice."""
        region, tensor = box.region, self.tensor
        tensor.received.append((op, (region,)))
        tensor.received_elements += box.nbytes // self.itemsize
        for step in steps:
            self.writes.add(region, step, op.end_s)

    def check_received_once(self, tensor: _Tensor) -> None:
        """Every received box lies in the shard (check_plan), so more elements received than the shard has
        means some arrived twice; only then look for the first repeat, to name it."""
        block = tensor.shards.dst_block
        if block is None or tensor.received_elements <= region_size(block):
            return
        seen = _Writes(tensor.ndim)
        for op, regions in tensor.received:
            for region in regions:
                earlier = seen.overlapping(region)
                if earlier:
                    self.fail(op, f"device {self.device} receives {format_region(earlier[0][0])} a second time")
                seen.add(region, 0, 0.0)

    def outgoing(self, op: Operation, box: Box, deps: tuple[int, ...]) -> tuple[Bytes, tuple[int, ...]]:
        """Where the bytes of `box` are sent from: the shard itself, or staging after a pack step."""
        data, (deps,) = self.outgoing_chunks(op, box, deps, [(0, box.nbytes)], [""])
        return data, deps

    def outgoing_chunks(self, op: Operation, box: Box, deps: tuple[int, ...], ranges: list[tuple[int, int]],
                        names: list[str]) -> tuple[Bytes, list[tuple[int, ...]]]:
        """`outgoing` for a box sent in chunks (byte ranges of it): a staged box is packed chunk by chunk,
        so its first chunk leaves after one chunk's pack, not the whole box's; what each chunk's send waits for."""
        if box.span is not None:
            return new_bytes(box.side, *box.span, box.tensor), [deps] * len(ranges)
        start = self.stage(box.nbytes)
        data = new_bytes("stage", start, start + box.nbytes, 0)
        return data, [tuple(self.add(Action.PACK, op, deps=deps, data=d, box=piece, piece=name)
                            for d, piece in self.pieces(box, data, lo, hi)) for (lo, hi), name in zip(ranges, names)]

    def pieces(self, box: Box, staged: Bytes, lo: int, hi: int) -> list[tuple[Bytes, Box]]:
        """Bytes lo..hi-1 of staged `box` as (staging bytes, sub-box) pairs to pack or unpack one by one (`flat_pieces`)."""
        if (lo, hi) == (0, box.nbytes):
            return [(staged, box)]
        out, at = [], staged.start + lo
        for rel in flat_pieces(box.shape, lo // self.itemsize, hi // self.itemsize):
            piece = self.box(box.side, tuple((r0 + a, r0 + b) for (r0, _), (a, b) in zip(box.region, rel)))
            out.append((new_bytes("stage", at, at + piece.nbytes, 0), piece))
            at += piece.nbytes
        return out

    def landing(self, box: Box) -> Bytes:
        """Where the bytes of `box` arrive: the destination shard itself, or staging."""
        if box.span is not None:
            return new_bytes("dst", *box.span, box.tensor)
        start = self.stage(box.nbytes)
        return new_bytes("stage", start, start + box.nbytes, 0)

    def receive(self, op: Operation, box: Box, peer: int, tags: list[int], ranges, pieces: list[str],
                forward_to: int | None = None) -> None:
        """Receive `box` from `peer` in pieces (forwarding each to `forward_to`), unpack if staged, record the write."""
        land = self.landing(box)
        done = []
        for tag, (lo, hi), piece in zip(tags, ranges, pieces):
            chunk = new_bytes(land.buffer, land.start + lo, land.start + hi, land.tensor)
            recv = self.add(Action.RECV, op, peer=peer, tag=tag, data=chunk, piece=piece)
            if forward_to is not None:
                self.add(Action.SEND, op, deps=(recv,), peer=forward_to, tag=tag, data=chunk, piece=piece)
            if land.buffer != "stage":
                done.append(recv)
            else:  # unpacked chunk by chunk, while the next chunks arrive
                done += [self.add(Action.UNPACK, op, deps=(recv,), data=d, box=sub, piece=piece) for d, sub in self.pieces(box, land, lo, hi)]
        self.record(op, box, done)


def _lower_copy(b: _Builder, op: Operation, base: int) -> None:
    if op.src == b.device:
        source, target = b.box("src", op.region), b.box("dst", op.region)
        b.record(op, target, [b.add(Action.COPY, op, box=source, target=target)])
        b.collective(op, b.device, source, target=target)


def _lower_chain(b: _Builder, op: Operation, base: int) -> None:
    """A send is a broadcast down a chain of one; chunk k travels src -> dsts[0] -> dsts[1] -> ..."""
    chain = op.dsts
    if b.device != op.src and b.device not in chain:
        return
    ranges = chunk_ranges(math.prod(region_shape(op.region)) * b.itemsize, op.chunks, b.itemsize)
    tags = [base + k for k in range(len(ranges))]
    pieces = _chunk_names(ranges)
    own = b.box("src" if b.device == op.src else "dst", op.region)
    b.collective(op, op.src, own, ranges)
    if b.device == op.src:
        data, waits = b.outgoing_chunks(op, own, (), ranges, pieces)
        for tag, (lo, hi), piece, deps in zip(tags, ranges, pieces, waits):
            b.add(Action.SEND, op, deps=deps, peer=chain[0], tag=tag, data=new_bytes(data.buffer, data.start + lo, data.start + hi, data.tensor),
                  piece=piece)
        return
    i = chain.index(b.device)
    prev = op.src if i == 0 else chain[i - 1]
    nxt = chain[i + 1] if i + 1 < len(chain) else None
    b.receive(op, own, prev, tags, ranges, pieces, forward_to=nxt)


def _lower_ring(b: _Builder, op: Operation, base: int) -> None:
    """The ring of `op_kinds.route`: at step s member i sends part (i - s) mod n to member i+1 with tag
    base + s, its own part (from its destination shard) at step 0, later the part it received from
    member i-1 the step before; empty parts are not sent. Tags count steps, so each pair's messages
    come in tag order (engines that match by order post them so)."""
    ring, n = op.dsts, len(op.dsts)
    if b.device not in ring:
        return
    i = ring.index(b.device)
    left, right = ring[i - 1], ring[(i + 1) % n]
    for peer, part in zip(ring, op.parts) if b.collect else ():  # as NCCL calls: one broadcast per non-empty part
        if not is_empty(part):
            box = b.box("dst", part)
            b.collective(op, peer, box, [(0, box.nbytes)])
    mine = op.parts[i]
    if not is_empty(mine):
        held = b.writes.overlapping(mine)
        missing = None if held and held[0][0] == mine else uncovered(mine, [r for r, _, _ in held])  # usually one write is the part
        late = [r for r, _, end in held if end > op.start_s + TOLERANCE_S]
        if missing is not None or late:
            b.fail(op, f"device {b.device} sends {format_region(missing or late[0])} which it does not hold at {op.start_s:.9g}s")
        data, deps = b.outgoing(op, b.box("dst", mine), tuple(step for _, step, _ in held))
        b.add(Action.SEND, op, deps=deps, peer=right, tag=base, data=data, piece=_piece("part", i))
    for step in range(n - 1):  # receive at `step` what member i-1 sends, and pass it on at step + 1
        j = (i - 1 - step) % n
        if is_empty(op.parts[j]):
            continue
        box = b.box("dst", op.parts[j])
        land = b.landing(box)
        recv = b.add(Action.RECV, op, peer=left, tag=base + step, data=land, piece=_piece("part", j))
        if step < n - 2:
            b.add(Action.SEND, op, deps=(recv,), peer=right, tag=base + step + 1, data=land, piece=_piece("part", j))
        done = [recv] if land.buffer != "stage" else [b.add(Action.UNPACK, op, deps=(recv,), data=land, box=box)]
        b.record(op, box, done)


_PART_NAMES: list[str] = []


def _part_names(count: int) -> list[str]:
    """`part 0`, `part 1`, ...: at least `count` of them (`_piece("part", k)`, in a list a loop indexes)."""
    while len(_PART_NAMES) < count:
        _PART_NAMES.append(_piece("part", len(_PART_NAMES)))
    return _PART_NAMES


@lru_cache(maxsize=None)
def _piece(word: str, k: int) -> str:
    """`part 3`, `gather 0`, `scatter 1`: a step's piece name, made once and shared by every step that bears it."""
    return f"{word} {k}"


@lru_cache(maxsize=1 << 12)
def _part_offsets(parts: tuple[Region, ...], itemsize: int) -> tuple[int, ...]:
    """Each part's byte offset in a bundle's cross-host message, and its end: once per distinct bundle."""
    offsets = [0]
    for part in parts:
        offsets.append(offsets[-1] + math.prod(region_shape(part)) * itemsize)
    return tuple(offsets)


def _lower_bundle(b: _Builder, op: Operation, base: int) -> None:
    """The bundle of `op_kinds.route`: always through staging. The cross-host message is the parts in
    index order; a holder packs each run it sends, src packs its own parts and receives the other runs
    into their places, dsts[0] unpacks the parts it needs and sends each run on from where it landed,
    and every other needer receives its runs and unpacks them. Tags: the route's, one per message."""
    gathers, scatters = bundle_runs(op)
    offsets = _part_offsets(op.parts, b.itemsize)
    relay = op.dsts[0]
    cross = base + len(gathers)

    def span(start: int, run: tuple[int, ...]) -> Bytes:
        return new_bytes("stage", start + offsets[run[0]], start + offsets[run[-1] + 1], 0)

    if b.device == op.src:
        at = b.stage(offsets[-1])
        ready = [b.add(Action.PACK, op, data=span(at, (i,)), box=b.box("src", part), piece=_piece("part", i))
                 for i, (part, holder) in enumerate(zip(op.parts, op.holders)) if holder == b.device]
        ready += [b.add(Action.RECV, op, peer=h, tag=base + k, data=span(at, run), piece=_piece("gather", k))
                  for k, (h, run) in enumerate(gathers)]
        b.add(Action.SEND, op, deps=tuple(ready), peer=relay, tag=cross, data=new_bytes("stage", at, at + offsets[-1], 0), piece="bundle")
        return
    for k, (h, run) in enumerate(gathers):
        if h == b.device:
            at = b.stage(offsets[run[-1] + 1] - offsets[run[0]]) - offsets[run[0]]
            packs = tuple(b.add(Action.PACK, op, data=span(at, (i,)), box=b.box("src", op.parts[i]), piece=_piece("part", i)) for i in run)
            b.add(Action.SEND, op, deps=packs, peer=op.src, tag=base + k, data=span(at, run), piece=_piece("gather", k))
    if b.device == relay:
        at = b.stage(offsets[-1])
        arrived = (b.add(Action.RECV, op, peer=op.src, tag=cross, data=new_bytes("stage", at, at + offsets[-1], 0), piece="bundle"),)
        for i in b.needed(op):  # `arrived`: one tuple for every step that waits for the message
            box = b.box("dst", op.parts[i])
            b.record(op, box, [b.add(Action.UNPACK, op, arrived, data=span(at, (i,)), box=box, piece=_piece("part", i))])
        for j, (d, run) in enumerate(scatters):
            b.add(Action.SEND, op, arrived, peer=d, tag=cross + 1 + j, data=span(at, run), piece=_piece("scatter", j))
        return
    for j, (d, run) in enumerate(scatters):
        if d == b.device:
            at = b.stage(offsets[run[-1] + 1] - offsets[run[0]]) - offsets[run[0]]
            arrived = (b.add(Action.RECV, op, peer=relay, tag=cross + 1 + j, data=span(at, run), piece=_piece("scatter", j)),)
            for i in run:
                box = b.box("dst", op.parts[i])
                b.record(op, box, [b.add(Action.UNPACK, op, arrived, data=span(at, (i,)), box=box, piece=_piece("part", i))])


@dataclass(frozen=True, slots=True)
class _Named:
    """What a step names of the operation it belongs to: a shared message's messages and moves name the group's
    carrier (its id, `carriers.group_key`, which every device of the group knows) with the task and kind of the first
    member this device lowers."""

    id: int
    task: int
    kind: str


def _runs_of(pieces: Sequence[tuple[int, int]], offsets: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first piece, last piece + 1) index pairs of `pieces` cut where the member changes or a part is skipped, with
    the first piece's byte in the area `offsets` lays out: each run is one range both in its device's area and in the
    message, so one move copies it."""
    out = []
    for k, (m, i) in enumerate(pieces):
        if out and pieces[k - 1] == (m, i - 1):
            out[-1] = (out[-1][0], k + 1, out[-1][2])
        else:
            out.append((k, k + 1, offsets[k]))
    return out


def _lower_group(b: _Builder, group: Sequence[Operation], bases: Sequence[int], align: int) -> None:
    """The bundles of one shared message of two or more (`schemas.carriers`; `group`: those this device takes part
    in, all of them on the relays; `bases`: their first tags), one message per pair of devices (`carriers.group_runs`).
    A holder packs its pieces into one area (`carriers.piece_layout`) and sends it to the sending relay in one message;
    the sending relay packs its own parts into the message (the members one after another), receives each holder's
    area into a side area and moves each run of pieces into its place, and sends the message; the receiving relay
    receives it, unpacks its own parts, moves each needer's pieces out into a side area and sends it in one message;
    a needer receives its area and unpacks it. A peer whose area is one range of the message laid out alike
    (`carriers.relay_areas`) is received into or sent from the message itself, with no side area and no move. Tags: the carrier's cross-host tag, and for the message of holder
    (needer) d the tag its first run of the first member it takes part in has in that member's block (`_lower_bundle`),
    so each message's tag is one no other message of the plan has, and both ends pick it alike.

    The layout of a group (`_relay_layout`, `_peer_layout`) depends on its members' parts, holders and needers only, which
    a model's layers repeat: it is worked out once per distinct group (`_Builder.memo`) and placed at each group's staging."""
    head, key = group[0], group_key(group[0])
    src, relay = head.src, head.dsts[0]
    for op in group:
        if (op.src, op.dsts[:1]) != (src, (relay,)) or group_key(op) != key:
            b.fail(op, f"it shares operation {key}'s message but its relays are not d{src} -> d{relay}")
    named = _Named(key, head.task, head.kind)
    b.enter(head.tensor or 0)
    if b.device == src or b.device == relay:
        _lower_relay(b, group, bases, align, named)
    else:
        _lower_peer(b, group, bases, align, named)


def _signature(b: _Builder, group: Sequence[Operation]) -> tuple:
    """What a group's layout on this device depends on: its relays and each member's parts, holders, needers and
    element size (the objects themselves, by identity: a file's reader shares them between the operations of one
    layout, so the layers of a model give one signature)."""
    return (group[0].src, group[0].dsts[0], b.device,
            tuple((id(op.parts), id(op.holders), id(op.needers), b.tensors[op.tensor or 0].shards.itemsize) for op in group))


def _tag_offset(op: Operation, d: int, gathering: bool) -> int:
    """Where the message of holder (needer) `d` of bundle `op` sits in its tag block (`_lower_bundle`): its first run's."""
    gathers, scatters = bundle_runs(op)
    if gathering:
        return next(k for k, (h, _) in enumerate(gathers) if h == d)
    return len(gathers) + 1 + next(j for j, (n, _) in enumerate(scatters) if n == d)


def _own(b: _Builder, group: Sequence[Operation], places: Sequence[Sequence[int]] | None, holding: bool) -> tuple:
    """Per member: (the parts this device holds (`holding`) or needs, their bytes in its area: `places[m][i]` of every
    part i of member m, or where None, one after another as `_peer_layout` lays them out, filled in there)."""
    out = []
    for m, op in enumerate(group):
        parts = b.held(op) if holding else b.needed(op)
        out.append((parts, None if places is None else tuple(places[m][i] for i in parts)))
    return tuple(out)


def _relay_layout(b: _Builder, group: Sequence[Operation], align: int, sending: bool) -> tuple:
    """A relay's layout of a shared message, relative to its staging's first byte: (per member, the parts it packs
    (`sending`) or unpacks itself and their bytes in the message (`_own`), the message's bytes, all it stages, the
    cross-host tag's offset in the first member's block, and per peer (the device, (member, tag offset) of its message,
    its area's start, its bytes, its moves as (side byte, bytes, message byte))). `sending`: the sending relay (its
    peers are the holders), else the receiving one (the needers)."""
    sizes = [b.part_sizes(op) for op in group]
    gathers, scatters = group_runs(group)
    every = tuple((m, i) for m, op in enumerate(group) for i in range(len(op.parts)))
    layout = piece_layout(every, sizes, align)
    where = layout[0]
    place = dict(zip(every, where))
    runs = gathers if sending else scatters
    (message, staged), areas = relay_areas(runs, sizes, align, every, layout)
    side = aligned(message, align)
    peers = []
    for (d, pieces), (local, nbytes, inside) in zip(runs, areas):
        tag = (pieces[0][0], _tag_offset(group[pieces[0][0]], d, sending))
        if inside is not None:
            peers.append((d, tag, inside, nbytes, ()))
            continue
        start = aligned(side, align) if nbytes else side
        # a run is consecutive parts of one member, one after another in the side area: its bytes end where its last part does
        moves = tuple((start + lo, local[k1 - 1] + sizes[pieces[k1 - 1][0]][pieces[k1 - 1][1]] - lo, place[pieces[k0]])
                      for k0, k1, lo in _runs_of(pieces, local))
        peers.append((d, tag, start, nbytes, moves))
        side = start + nbytes
    members, k = [], 0
    for op in group:
        members.append(where[k:k + len(op.parts)])
        k += len(op.parts)
    return _own(b, group, members, sending), message, staged, len(bundle_runs(group[0])[0]), tuple(peers)


def _lower_relay(b: _Builder, group: Sequence[Operation], bases: Sequence[int], align: int, named: _Named) -> None:
    """`_lower_group` on the sending or the receiving relay."""
    head, device = group[0], b.device
    sending = device == head.src
    own, message, staged, cross, peers = b.memo(("relay",) + _signature(b, group), lambda: _relay_layout(b, group, align, sending))
    at = b.stage(staged)
    whole = new_bytes("stage", at, at + message, 0)
    cross += bases[0]
    if sending:
        ready = []
        for op, (parts, places) in zip(group, own):
            ready += _staged_parts(b, op, parts, places, at, Action.PACK, ())
        b.enter(head.tensor or 0)
        for k, (h, (m, offset), start, nbytes, moves) in enumerate(peers):
            name = _piece("gather", k)
            recv = b.add(Action.RECV, named, peer=h, tag=bases[m] + offset, data=new_bytes("stage", at + start, at + start + nbytes, 0), piece=name)
            ready += [b.add(Action.MOVE, named, (recv,), data=new_bytes("stage", at + lo, at + lo + n, 0),
                            origin=new_bytes("stage", at + s, at + s + n, 0), piece=name) for s, n, lo in moves] or [recv]
        b.add(Action.SEND, named, deps=tuple(ready), peer=head.dsts[0], tag=cross, data=whole, piece="bundle")
        return
    arrived = (b.add(Action.RECV, named, peer=head.src, tag=cross, data=whole, piece="bundle"),)
    for op, (parts, places) in zip(group, own):
        _staged_parts(b, op, parts, places, at, Action.UNPACK, arrived)
    b.enter(head.tensor or 0)
    for j, (d, (m, offset), start, nbytes, moves) in enumerate(peers):
        name = _piece("scatter", j)
        moved = tuple(b.add(Action.MOVE, named, arrived, data=new_bytes("stage", at + s, at + s + n, 0),
                            origin=new_bytes("stage", at + lo, at + lo + n, 0), piece=name) for s, n, lo in moves)
        b.add(Action.SEND, named, moved or arrived, peer=d, tag=bases[m] + offset, data=new_bytes("stage", at + start, at + start + nbytes, 0),
              piece=name)


def _peer_layout(b: _Builder, group: Sequence[Operation], align: int) -> tuple:
    """A holder's and a needer's area of a shared message on a device that is neither relay: for each (gathering, then
    scattering), None when it has no piece, else (per member, the parts it holds (needs) and their bytes in its area
    (`_own`), the area's bytes, (member, tag offset) of its message)."""
    sizes, out = [b.part_sizes(op) for op in group], []
    for gathering in (True, False):
        own = _own(b, group, None, gathering)
        flat = tuple((m, i) for m, (parts, _) in enumerate(own) for i in parts)
        if not flat:
            out.append(None)
            continue
        where, nbytes = piece_layout(flat, sizes, align)
        members, k = [], 0
        for parts, _ in own:
            members.append((parts, where[k:k + len(parts)]))
            k += len(parts)
        out.append((tuple(members), nbytes, (flat[0][0], _tag_offset(group[flat[0][0]], b.device, gathering))))
    return tuple(out)


def _lower_peer(b: _Builder, group: Sequence[Operation], bases: Sequence[int], align: int, named: _Named) -> None:
    """`_lower_group` on a holder or needer that is neither relay: one message of all its pieces each way."""
    head = group[0]
    for gathering, layout in zip((True, False), b.memo(("peer",) + _signature(b, group), lambda: _peer_layout(b, group, align))):
        if layout is None:
            continue
        own, nbytes, (m, offset) = layout
        at = b.stage(nbytes)
        area = new_bytes("stage", at, at + nbytes, 0)
        if gathering:
            packs = []
            for op, (parts, places) in zip(group, own):
                packs += _staged_parts(b, op, parts, places, at, Action.PACK, ())
            b.enter(head.tensor or 0)
            b.add(Action.SEND, named, tuple(packs), peer=head.src, tag=bases[m] + offset, data=area, piece=_piece("gather", 0))
        else:
            b.enter(head.tensor or 0)
            arrived = (b.add(Action.RECV, named, peer=head.dsts[0], tag=bases[m] + offset, data=area, piece=_piece("scatter", 0)),)
            for op, (parts, places) in zip(group, own):
                _staged_parts(b, op, parts, places, at, Action.UNPACK, arrived)


def _staged_parts(b: _Builder, op: Operation, parts: tuple[int, ...], places: Sequence[int], at: int, action: Action,
                  deps: tuple[int, ...]) -> list[int]:
    """Pack (`Action.PACK`, from the source shard) or unpack (`Action.UNPACK`, into the destination shard, recorded as
    received) parts `parts` of bundle `op` at staging bytes `at + places[i]` (`places`: a byte per part of `parts`), each
    step waiting for `deps`; the steps' indices. The loop a relay, holder or needer of a shared message runs once per
    part: 10^5 of them on a busy device."""
    if not parts:
        return []
    t = op.tensor or 0
    b.enter(t)
    tensor, itemsize = b.tensor, b.itemsize
    unpack = action is Action.UNPACK
    side = "dst" if unpack else "src"
    block = tensor.shards.dst_block if unpack else tensor.shards.src_block
    placed = b.placements(op.parts, block, itemsize)
    regions, steps = op.parts, b.steps
    names = _part_names(max(parts) + 1)
    op_id, task, kind = op.id, op.task, op.kind
    made, elements = [], 0  # the steps' own index objects (not new ints: the writes below keep 10^5 of them)
    for index, (i, lo) in enumerate(zip(parts, places), len(steps)):
        where = placed[i]
        if where is None:
            where = placed[i] = _placed(regions[i], block, itemsize)
        nbytes = where[2]
        elements += nbytes
        steps.append(new_step(index, action, op_id, task, kind, deps, -1, 0, new_bytes("stage", at + lo, at + lo + nbytes, 0),
                              new_box(side, regions[i], where[0], where[1], nbytes, where[3], t), None, names[i], t, (), None))
        made.append(index)
    if unpack:  # recorded as `_Builder.record` does, a list at a time
        mine = [regions[i] for i in parts]
        tensor.received.append((op, mine))
        tensor.writes.regions += mine
        tensor.writes.steps += made
        tensor.writes.ends += repeat(op.end_s, len(mine))
        tensor.received_elements += elements // itemsize
    return made


_LOWER = supported("executor.lower", {"local": _lower_copy, "chain": _lower_chain, "ring": _lower_ring, "bundle": _lower_bundle})


def lower(plan: Plan, device: int, tag_limit: int | None = None, collectives: bool = True, share: bool = False) -> RankProgram:
    """The steps `device` runs for the whole `plan`, every tensor of it, posted (every operation at once, each
    operation's staging after the one before, `RankProgram.stage_bytes` their sum); raises PlanMismatchError
    naming the op when the plan is inconsistent. The plan is checked (`check_plan`) and indexed once per plan
    object (`plan_index`); only the operations the device takes part in are walked (`plan_index.device_ops`).
    Tags: `plan_index` (tensor by tensor, in plan order); `tag_limit`: the largest tag the transport allows
    (MPI's TAG_UB), None for none. `collectives`: also make `RankProgram.collectives` (what engines built on group
    calls replay; the others leave them out, `engines.EngineEntry.collectives`). `share`: the bundles of each shared
    message (`schemas.carriers`) lowered together, one message per pair of devices (`_lower_group`; the steps
    `passes.share_messages` lays out); else each bundle with its own messages, as on its own."""
    index = plan_index(plan)
    return _lower(device_ops(plan, device), device, tag_limit, [(src.get(device), dst.get(device)) for src, dst in index.blocks],
                  collectives, share)


def lower_device_ops(ops: DeviceOps, device: int, tag_limit: int | None = None, collectives: bool = True,
                     share: bool = False) -> RankProgram:
    """`lower` for a device's part of a plan read on its own (`schemas.plan_io.read_plan_ops`, `plan_index.device_ops`):
    the same program as lowering the whole plan. Its operations are checked on their own first
    (`plan_check.check_device_ops`); what needs the whole plan is `xmesh-plan verify`'s, and the ranks' plan
    fingerprints (`Executor.prepare`) make sure every rank read the same file."""
    try:
        check_device_ops(ops)
    except PlanError as err:
        raise PlanMismatchError(refusal_advice(str(err))) from None
    return _lower(ops, device, tag_limit, [(p.block_of("src", device), p.block_of("dst", device))
                                           for p in ops.problem.tensor_problems()], collectives, share)


def _lower(ops: DeviceOps, device: int, tag_limit: int | None, blocks: list[tuple[Region | None, Region | None]],
           collectives: bool = True, share: bool = False) -> RankProgram:
    """The program of a checked part (`blocks`: each tensor's source and destination box on `device`), with its
    collectives where asked; `share`: the bundles of a shared message lowered together (`_lower_group`)."""
    plan = ops  # what the lowering reads of the plan: its problem (the operations and tags are the part's)
    problems = plan.problem.tensor_problems()
    converts, owners = conversions(plan.problem, device), scale_owners(plan.problem)  # in converted bytes (`executor.conversions`)
    tensors = [_Tensor(t, TensorShards(src, dst, p.itemsize, p.dtype, converts[t], owners[t]), len(p.shape))
               for t, (p, (src, dst)) in enumerate(zip(problems, blocks))]
    b = _Builder(device, tensors, collectives)
    align = staging_align(plan)
    operations, tags = ops.operations, ops.first_tags
    shared = ops.shared if share else frozenset()
    k = 0
    while k < len(operations):
        op = operations[k]
        if op.id in shared:  # a shared message: one message per pair of devices for all its bundles
            key, end = group_key(op), k + 1
            while end < len(operations) and operations[end].id in shared and group_key(operations[end]) == key:
                end += 1
            first = len(b.steps)
            _lower_group(b, operations[k:end], tags[k:end], align)
            if collectives:  # collective engines replay its messages as broadcasts in groups of two, its moves as copies
                b.collectives += _staged_calls(b.steps, first, device, b.tensor.index)
            k = end
            continue
        b.enter(op.tensor or 0)
        first = len(b.steps)
        pattern = rule_of(op).pattern
        _LOWER[pattern](b, op, tags[k])
        if pattern == "bundle" and collectives:  # collective engines replay its messages as broadcasts in groups of two
            b.collectives += _staged_calls(b.steps, first, device, b.tensor.index)
        k += 1
    if tag_limit is not None and ops.tags > tag_limit + 1:  # every message has its own tag; reusing one could match the wrong message
        raise PlanMismatchError(f"the plan needs {ops.tags} message tags but this MPI allows tags up to {tag_limit} (its TAG_UB); "
                                f"run it with an MPI whose TAG_UB is at least {ops.tags - 1} (MPICH's is 2**29 - 1)")
    received = [t for t in tensors if t.shards.dst_block is not None]
    holes = dict(zip((t.index for t in received), uncovered_each([t.shards.dst_block for t in received], [t.writes.regions for t in received])))
    for tensor in tensors:
        b.check_received_once(tensor)
        dst_block = tensor.shards.dst_block
        if dst_block is not None:
            missing = holes[tensor.index]
            if missing is not None:
                named = f"tensor {tensor.index}: " if len(tensors) > 1 else ""
                raise PlanMismatchError(refusal_advice(f"{named}destination device {device} never receives {format_region(missing)} "
                                                       f"of its shard {format_region(dst_block)}"))
    return RankProgram(device, tuple(b.steps), b.stage_bytes, tuple(t.shards for t in tensors), tuple(b.collectives),
                       align=align)


def stage_ranges(steps: Sequence[Step], keys: Sequence[Hashable]) -> dict[Hashable, tuple[int, int]]:
    """Key -> (start, stop) of the staging bytes of the steps with that key (`keys[i]` is step i's), equal when
    none, in the order keys first appear. The lowering stages one operation after another, so an operation's
    staging is one range; `in_device_order` and `executor.passes` key steps by operation."""
    spans: dict[Hashable, tuple[int | None, int]] = {}
    for s, k in zip(steps, keys):
        data = s.data
        if data is not None and data.buffer == "stage":
            lo, hi = spans.get(k, (None, 0))
            spans[k] = (data.start if lo is None or data.start < lo else lo, data.stop if data.stop > hi else hi)
        elif k not in spans:
            spans[k] = (None, 0)
    return {k: (lo or 0, hi) for k, (lo, hi) in spans.items()}


def _staging_spans(program: RankProgram, key: Mapping[int, int]) -> dict[int, tuple[frozenset[int], int, int]]:
    """Op (or the group `key` puts it in) -> (its peers, the start and stop of its staging bytes), in plan order
    (`passes.share_messages` lays a shared message's bundles out one after another, so a group's staging is one range too)."""
    keys = [key.get(s.op, s.op) for s in program.steps]
    peers: dict[int, frozenset[int]] = {}
    for s, k in zip(program.steps, keys):
        peers[k] = peers.get(k, frozenset()) | ({s.peer} if s.action.is_message else set())
    return {k: (peers[k], lo, hi) for k, (lo, hi) in stage_ranges(program.steps, keys).items()}


def in_device_order(program: RankProgram, stage_budget: int | None = None, align: int | None = None,
                    key: Mapping[int, int] | None = None) -> RankProgram:
    """The same steps, but each operation's messages (and packs) wait for every step of this device's
    earlier operations, so a device takes part in one operation at a time, in plan order, at both ends of
    a message: the simulator's `device-order`, as NCCL runs a stream's calls, instead of posting every
    operation at once (`posted`). Consecutive operations with the same peers (a local copy has none and joins the run it is in) run together: they share
    the same links in order anyway, and waiting between them would only add a round trip each; with a
    `stage_budget` (the plan's `--max-staging-mb`) a run also ends before it would stage more than that
    (`schemas.staging.device_layout`). Every run starts its staging at byte 0, its operations one after
    another, each at a multiple of `align` (default: the program's, the largest element size among the
    plan's tensors): the runs before it have finished, so `stage_bytes` becomes the
    largest run's staging (`schemas.staging.staging_peaks`).
    Deadlock-free: every rank walks the plan in one order, so the earliest unfinished operation never
    waits on a later one. `key` (op -> op) makes several operations one here: the bundles of one shared
    message (`schemas.carriers`), keyed by their carrier.
    """
    key = key or {}
    spans = _staging_spans(program, key)
    layout = device_layout([(peers, hi - lo) for peers, lo, hi in spans.values()], stage_budget, align or program.align)
    run_of = {op: run for op, (run, _) in zip(spans, layout)}
    shift = {op: lo - start for (op, (_, lo, _)), (_, start) in zip(spans.items(), layout)}  # posted byte - shift = byte in its run
    peak = max((start + hi - lo for (_, lo, hi), (_, start) in zip(spans.values(), layout) if hi > lo), default=0)
    steps: list[Step] = []
    barrier: tuple[int, ...] = ()  # steps whose completion means every operation before this run has finished
    run: list[int] = []  # steps of the current run
    current = None
    gated = False  # whether the run has a step that waits for `barrier`
    for s in program.steps:
        k = key.get(s.op, s.op)
        if run_of[k] != current:
            if run:
                barrier = tuple(run) if gated else tuple(sorted(set(barrier) | set(run)))
            run, current, gated = [], run_of[k], False
        deps, data = s.deps, s.data
        if barrier and s.action.reads_staging_first:
            deps, gated = tuple(sorted(set(deps) | set(barrier))), True
        if data is not None and data.buffer == "stage" and shift[k]:
            steps.append(s.shifted(s.index, deps, shift[k]))
        else:
            steps.append(s if deps is s.deps else s.at(s.index, deps, data))
        run.append(s.index)
    return replace(program, steps=tuple(steps), stage_bytes=peak, order="device")
