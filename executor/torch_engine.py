"""Run one device's steps over a torch.distributed process group: gloo on CPU tensors, NCCL on CUDA tensors.

Every message moves raw bytes (a uint8 view of the shard or of staging), so every dtype the planner
knows travels bit for bit, bfloat16 and float8 included, although gloo has no such types. Local
copies, packs and unpacks are `Tensor.copy_` between views made in `setup()` (staging) and when a call hands in
another shard (source shards; destination shards: the engine's own or the caller's tensors, written in place,
`executor.destinations`): no numpy, no host round trip. Messages are posted straight on the ProcessGroup
(`group.send([buf], peer, tag)`, what `dist.isend` does after its checks) with one-tensor lists made alike.

One discipline serves both backends. NCCL ignores tags and runs a pair's messages in the order they
were posted, one after another on that pair's stream, so both ends must post them in the same order,
and a send must not be posted before the receives it needs. Every rank therefore keeps one queue per
peer, in the plan's message order (tag, then step), and posts each queue's front as soon as it is
ready (a receive at once, a send when its data is in); it waits for posted receives earliest first.
A send depends only on receives of its own or smaller tags, so the first unfinished message of the
whole plan is always posted at both ends: no deadlock, on either backend. Tests also run gloo with every tag 0
(`TransportOptions(match_by_tag=False)`), which makes gloo match a pair's messages by order alone, as NCCL does, so a
wrong order shows as wrong bytes.

In device order on gloo, an operation's messages of 256 KiB or more (`TransportOptions.receipt_bytes`, the size from which the MPI
engine sends synchronously) from one device to another get a receipt: once the last of them has arrived the receiver
sends 1 byte back, and the sender's next steps wait for that instead of the sends. Gloo ends a send once the kernel's
socket buffer holds the rest (megabytes), so without it a device would begin its next operation while the last is still
on the wire (`passes.with_receipts` adds them to the program; this engine replays them). A receipt sits in both ends' queues after every message of its operation between the
two, and it waits only for a receive of that operation, while what waits for it belongs to later operations, so the
order above still has the first unfinished message posted at both ends. The receipt size must be the same on every
rank: a rank that expects a receipt the other never sends waits until its timeout.

A plan that converts at the sender (`executor.conversions`; the registry's `converts`) has every buffer but the caller's
source shards in the destination dtype: each run the progress thread first swaps the amax of per-tensor FP8 scales with
the tensor's other senders, then casts each source shard once, whole, with its scales, into a buffer that the steps
reading the source were bound to in `setup()`, just before the first of those steps (or of those reading its scales) is
posted or run, so casting one tensor overlaps the messages posted before it (docs/executor.md, "Conversion at the
sender").

Gloo's point-to-point work cannot be polled: `is_completed()` stays False until `wait()` is called
(checked with torch 2.13), and `wait(timeout)` closes the connection when it expires. So each engine
has one progress thread (started by its first reshard) that posts the messages and waits for them.
`start()` hands the iteration to that thread and returns; `test()` looks at a flag; `wait()` sleeps
on an event and, when nothing completes for `timeout_s`, raises naming the op, task and peer the
thread waits on. On NCCL a work's
`wait()` only orders the thread's CUDA stream after it, so the thread records an event and polls it.
The CUDA lines (device, stream and event handling) have run on one H200 with every rank on GPU 0
(NCCL over sockets, `NCCL_HOSTID` per rank): four plans bit-exact, a 21-tensor weight sync on 8 ranks among them;
it has not run on several GPUs.
"""

from __future__ import annotations

import heapq
import math
import threading
import time

import numpy as np

from .apart import refuse_overlapping_into, refuse_shared
from .arrays import RAW_KINDS, storage_dtype
from .conversions import cast_once, mark_casts, sender_buffers, swap_peers
from .destinations import Destinations, bytes_of
from .engines import EngineContext
from .errors import BackendUnavailableError, ExecutorError, PeerTimeoutError, PlanMismatchError
from .lower import Action, Bytes, RankProgram
from .replay import PROCESS, Dependencies, abandoned, backoff_wait, failure, refuse_broken
from .worlds import group_backend, group_rank


AMAX_TAG = 2**31 - 1  # the senders' amax swap (per-tensor FP8 scales); a plan's own tags count from 0 and stay far below


def torch_dtype(torch, name: str):
    """The torch dtype of a plan dtype name (every name in schemas.dtypes has one)."""
    return getattr(torch, name)



class TorchEngine:
    """Replays a RankProgram over a torch.distributed process group; an `executor.engines.Engine`. Buffers are
    keyed by (tensor, side): `dsts[t]` is tensor t's own destination shard, made by the first call that passes no tensor
    of the caller's for it (`dst`: tensor 0's, the one-tensor face); `into` holds what each call writes."""

    test_progresses = False  # progress happens elsewhere; test() only looks (`replay.backoff_wait`)

    def __init__(self, program: RankProgram, context: EngineContext):
        self.program, self.context, self.group = program, context, context.comm
        self.timeout_s, self.poll_s = context.timeout_s, context.poll_s
        self.steps = program.steps
        self.single = len(program.tensors) == 1
        self.dst = None
        self.dsts: list = []
        self.broken: str | None = None
        self.failure: ExecutorError | None = None

    def setup(self) -> None:
        """Make staging on the group's device and every view that reads neither a source nor a destination shard;
        destination shards are bound per call (`_bind_dst`)."""
        import torch
        import torch.distributed as dist

        self.torch = torch
        backend = group_backend(dist, self.group)
        if backend not in ("gloo", "nccl"):
            raise BackendUnavailableError(f"the torch engine runs on gloo (CPU) or nccl (CUDA) process groups, this one runs "
                                          f"{backend}; make the group with backend='gloo' or 'nccl'")
        self.cuda = backend == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        p = self.program
        n = len(p.tensors)
        self.dtypes = [torch_dtype(torch, t.dst_dtype) for t in p.tensors]  # of every buffer but the caller's source shards
        self.dtype_of = {name: torch_dtype(torch, name) for t in p.tensors for name in (t.dtype, t.dst_dtype)}  # for check()
        self.dtype = self.dtypes[0]
        self.dsts = [None] * n  # the engine's own destination shards, made by the first call that passes none (`_own`)
        self.stage = torch.empty(p.stage_bytes, dtype=torch.uint8, device=self.device)
        receipts = max((s.data.stop for s in self.steps if s.data is not None and s.data.buffer == "receipt"), default=0)
        self.flat = {"stage": self.stage, "receipt": torch.zeros(receipts, dtype=torch.uint8, device=self.device)}
        self.rank = group_rank(dist, self.group)
        self.peer_rank = [self.context.rank_of.get(s.peer, -1) for s in self.steps]
        self.buffers: list = [None] * len(self.steps)  # [uint8 view] per message, (target, source) per local copy
        self.works: list = [None] * len(self.steps)
        self.src_typed: list = [None] * n  # per tensor, the source shard bound (`_bind_tensor`), and its bytes
        self.src_flat: list = [None] * n
        self.into = Destinations(n)  # per tensor, the destination shard bound (`_bind_dst`)
        self.staged: dict[int, object] = {}  # pack or unpack step -> its typed view of staging
        self.reads_src, self.uses_dst, neither = p.shard_steps()  # per tensor, the steps made in _bind_tensor() and _bind_dst()
        for i in neither:
            self._make(i)
        self.converting: list = []  # (tensor, conversion, its converted shard or None), where this device converts
        self.casts_before: list = [None] * len(self.steps)  # per step, the converting tensors (indices) to cast before it runs
        if any(t.convert is not None for t in p.tensors):
            self._setup_conversion()
        self._schedule()

    def _setup_conversion(self) -> None:
        """Buffers for the senders' conversion (`executor.conversions`): each converted source shard and each scale
        tensor's source shard, with the steps that read them bound once; the amax each per-tensor scale swaps with
        the other source devices, one message each way per peer."""
        from . import convert  # torch itself, imported with the engine's first setup

        self.convert = convert
        torch, p = self.torch, self.program
        made, self.converting, self.scale_shards = sender_buffers(
            p, lambda t: torch.empty(p.tensors[t].src_shape, dtype=self.dtypes[t], device=self.device),
            lambda t: bool(self.reads_src[t]))
        readers = {t: self.reads_src[t] for t in made}
        for t, buffer in made.items():
            self.src_typed[t], self.src_flat[t] = buffer, bytes_of(buffer)
            for i in self.reads_src[t]:
                self._make(i)
            self.reads_src[t] = []  # read from `buffer`, never from the caller's shard
        mark_casts(self.casts_before, self.converting, readers)  # what reads the cast shard or its scales casts it first
        self.cast_run = [-1] * len(self.converting)  # the run that last cast each converting tensor
        self.shards = None  # the converting tensors' typed source shards, during a run (`_prepare_casts`)
        self.run_count = 0
        self.amax_swaps = [(peer, ts, torch.empty(len(ts), device=self.device), torch.empty(len(ts), device=self.device))
                           for peer, ts in swap_peers(self.converting)]

    def _message_key(self, i: int) -> tuple:
        """Where message `i` stands in the plan's message order, which both ends of every pair share: its operation
        counted in step order (the program's order of operations, across tensors), then its tag."""
        return self.ordinal[i], self.steps[i].tag, i

    def _receipts(self) -> None:
        """Where each receipt (`passes.with_receipts`: a 1-byte message a receiver sends back once an operation's large
        messages from its peer have arrived) stands among the messages, and what each acknowledges. A receipt goes
        after every message of its operation between the two devices, which both ends place alike."""
        self.acknowledges: dict[int, tuple[int, ...]] = {s.index: s.acks for s in self.steps if s.acks}
        self.receipt_key: dict[int, tuple] = {}
        if not self.acknowledges:
            return
        pair_keys: dict[tuple[int, int], list[tuple]] = {}  # (operation, peer) -> the keys of all its messages, both ways
        for s in self.steps:
            if s.action.is_message and s.index not in self.acknowledges:
                pair_keys.setdefault((s.op, s.peer), []).append(self._message_key(s.index)[:-1])
        for i, members in self.acknowledges.items():
            s = self.steps[i]
            self.receipt_key[i] = (*max(pair_keys[(s.op, s.peer)]), math.inf, max(members, key=self._message_key))

    def _key(self, i: int) -> tuple:
        """`_message_key`; a receipt goes after every message of its operation between the two devices, which both ends
        place alike (a ring step of two devices sends each way with one tag: the receipt must follow the data going
        its way at both ends; and after the last chunk, so the chunks before it flow as they would without it)."""
        return self.receipt_key[i] if i in self.receipt_key else self._message_key(i)

    def _schedule(self) -> None:
        """Receipts (`_receipts`), the per-peer message queues and dependency counts; the progress thread starts
        with the first reshard."""
        self.ordinal, count, last = [], -1, None  # each step's operation counted in step order (ids need not be)
        for s in self.steps:
            count += s.op != last
            self.ordinal.append(count)
            last = s.op
        self._receipts()
        deps = Dependencies(self.steps)
        self.dependents, self.initial, self.remaining, self.local = deps.dependents, deps.initial, deps.remaining, deps.local
        for receipt, members in self.acknowledges.items():  # what waited for those sends now waits for their receipt
            if self.steps[receipt].action is Action.RECV:
                self.dependents[receipt] = [d for m in members for d in self.dependents[m]]  # counts stay: one per wait
                for m in members:
                    self.dependents[m] = []
        self.local_first = [s.index for s in self.steps if not s.deps and not s.action.is_message]
        self.order = sorted((s.index for s in self.steps if s.action.is_message), key=self._key)
        self.position = {i: k for k, i in enumerate(self.order)}  # each message's place in the plan's message order
        peers = sorted({self.steps[i].peer for i in self.order})
        self.queues = [[i for i in self.order if self.steps[i].peer == peer] for peer in peers]  # per peer, in order
        self.queue_of = {i: q for q, queue in enumerate(self.queues) for i in queue}
        self.heads = [0] * len(self.queues)  # the first message of each queue not posted yet
        self.sends = [i for i in self.order if self.steps[i].action is Action.SEND]
        by_tag = self.context.transport.match_by_tag
        self.tags = [s.tag if by_tag else 0 for s in self.steps]
        self.posted_recvs: list[int] = []  # a heap of the positions of receives (and sends a step waits for) posted, not finished
        self.ready = None
        self.bound: list = [None] * len(self.program.tensors)
        self.src = None
        self.current = -1  # the step the progress thread waits on
        self.launching = -1  # the step being posted, when posting itself fails
        self.amax_peer: int | None = None  # the peer device of the amax swap being posted or waited on, else None
        self.thread_error: tuple[int, BaseException] | None = None
        self.go, self.done, self.stopping = threading.Event(), threading.Event(), False
        self.done.set()
        self.thread = None  # made by the first start()

    def _make(self, i: int) -> None:
        """Step i's [uint8 view] (message) or (target, source) views (local copy), over the staging area and the shards
        bound now (`src_typed`, `into`); None while a shard it needs is not bound. A message into or out of a destination
        byte range that is not one run of the caller's tensor goes through a shadow buffer (`Destinations.span`)."""
        s = self.steps[i]
        into = self.into
        if s.action.is_message:
            data = s.data
            if data.buffer == "dst":
                view = into.span(self, i)
            elif data.buffer == "src":
                whole = self.src_flat[data.tensor]
                view = None if whole is None else whole[data.start:data.stop]
            else:
                view = self.flat[data.buffer][data.start:data.stop]
            self.buffers[i] = None if view is None else [view]
        elif s.action is Action.COPY:
            target, source = into.typed[s.target.tensor], self.src_typed[s.box.tensor]
            self.buffers[i] = None if target is None or source is None else (target[s.target.index], source[s.box.index])
        elif s.action is Action.MOVE:  # staging bytes to staging bytes (a shared message's pieces)
            self.buffers[i] = (self.stage[s.data.start:s.data.stop], self.stage[s.origin.start:s.origin.stop])
        else:
            t = s.box.tensor
            staged = self.staged.get(i)  # made once: rebinding a destination each call remakes only its own side
            if staged is None:
                staged = self.staged[i] = self.stage[s.data.start:s.data.stop].view(self.dtypes[t]).view(s.box.shape)
            shard = into.typed[t] if s.box.side == "dst" else self.src_typed[t]
            boxed = shard[s.box.index] if shard is not None else None
            self.buffers[i] = (boxed, staged) if s.action is Action.UNPACK else (staged, boxed)

    def _bind(self, src) -> None:
        """Point the steps that read a source shard at it: one per tensor (None where this device has none)."""
        for t, shard in enumerate(src):
            self._bind_tensor(t, shard)

    def _bind_tensor(self, t: int, src) -> None:
        """Point the steps that read tensor t's source shard at `src`; remade only when another tensor arrives."""
        if src is None or src is self.bound[t] or not self.reads_src[t]:
            return
        dtype = self.dtypes[t]
        typed = src if src.dtype == dtype else src.view(dtype)  # a raw same-size view of bfloat16/float8
        self.src_typed[t], self.src_flat[t] = typed, bytes_of(typed)
        for i in self.reads_src[t]:
            self._make(i)
        self.bound[t] = src

    def _bind_dsts(self, into) -> None:
        """Point every tensor's destination steps at the caller's tensor in `into` (a sequence, one per tensor, None
        where not given; None: none given) or at the engine's own shard."""
        if into is None:
            if self.into.own_bound:
                return
            into = (None,) * len(self.dsts)
        for t, target in enumerate(into):
            if self.uses_dst[t]:
                self._bind_dst(t, target)
            elif target is None:  # nothing arrives (an empty shard): the engine's own, still handed back
                self._own(t)
        self.into.own_bound = all(target is None for target in into)

    def _bind_dst(self, t: int, target) -> None:
        """Point tensor t's destination steps at `target` (the caller's tensor, written in place until the reshard ends)
        or, for None, at the engine's own shard (made now if this is the first call that passes none)."""
        if target is None:
            target = self._own(t)
        if target is self.into.typed[t]:
            return
        dtype = self.dtypes[t]
        self.into.bind(t, target if target.dtype == dtype else target.view(dtype), target is not self.dsts[t])
        for i in self.uses_dst[t]:
            self._make(i)

    def _own(self, t: int):
        """Tensor t's own destination shard, made on first use: a call that passes the caller's tensor allocates none."""
        if self.dsts[t] is None:
            shape = self.program.tensors[t].dst_shape
            if shape is None:
                return None
            self.dsts[t] = self.torch.empty(shape, dtype=self.dtypes[t], device=self.device)
            self.dst = self.dsts[0]
        return self.dsts[t]

    def _release(self) -> None:
        """Drop every view of the caller's destination tensors (once a reshard has ended): the engine keeps no
        reference to them, and the next call binds what it is given."""
        for t in self.into.callers:
            self.into.unbind(t)
            for i in self.uses_dst[t]:
                self.buffers[i] = None
                self.into.drop(i)
        self.into.callers.clear()
        self.into.own_bound = False

    def adopt(self, array):
        """`array` as a torch tensor on this engine's device (numpy is wrapped without a copy)."""
        torch = self.torch
        if isinstance(array, np.ndarray):
            array = torch.from_numpy(array)
        if not isinstance(array, torch.Tensor):
            raise PlanMismatchError(f"run(): device {self.program.device} got a {type(array).__name__}; pass a torch tensor")
        if array.device != self.device:
            raise PlanMismatchError(f"run(): device {self.program.device}'s source shard is on {array.device} but this rank's "
                                    f"process group moves tensors on {self.device}; pass a shard on {self.device}")
        return array

    def check(self, array, shape: tuple[int, ...], dtype_name: str, device: int, spec: object) -> None:
        """Refuse (PlanMismatchError) a source shard of another shape or element type (bfloat16 and float8 also as any
        integer tensor of that item size); on every run(), so it looks the dtype up (`dtype_of`) and calls nothing
        unless the shard differs."""
        if array.shape != shape:
            raise PlanMismatchError(f"run(): device {device}'s source shard has shape {tuple(array.shape)} but the source "
                                    f"spec {str(spec)!r} gives it {shape}; pass this rank's shard under the source spec")
        want = self.dtype_of[dtype_name]
        if array.dtype != want and not (dtype_name.startswith(RAW_KINDS) and not array.dtype.is_floating_point
                                        and array.element_size() == want.itemsize):
            raise PlanMismatchError(f"run(): device {device}'s source shard is {array.dtype} but the plan moves {dtype_name}; "
                                    f"pass a {want} tensor (or recompile the plan with that dtype)")

    def check_into(self, array, shape: tuple[int, ...], dtype_name: str, device: int, name: str) -> None:
        """Refuse (PlanMismatchError) a caller's destination tensor of another shape or element type than its shard, or
        whose elements share memory (`executor.apart`)."""
        if array.shape != shape:
            raise PlanMismatchError(f"run(): into[{name!r}] on device {device} has shape {tuple(array.shape)} but the plan gives "
                                    f"this device's destination shard {shape}; pass a tensor (or a view) of that shape")
        want = self.dtype_of[dtype_name]
        if array.dtype != want:
            raise PlanMismatchError(f"run(): into[{name!r}] on device {device} is {array.dtype} but the plan delivers {dtype_name}; "
                                    f"pass a {want} tensor")
        refuse_overlapping_into(array, device, name)

    check_apart = staticmethod(refuse_shared)  # the caller's tensors of one call: no destination shares memory with another

    def contiguous(self, array):
        return array if array.is_contiguous() else array.contiguous()

    def poison(self) -> None:
        """Fill the engine's own destination shards (made now if no call made them yet) with 0xA5 bytes."""
        for t in range(len(self.dsts)):
            own = self._own(t)
            if own is not None:
                bytes_of(own).fill_(0xA5)

    def host_copy(self, array) -> np.ndarray:
        """`array`'s bits as a numpy array of the plan's storage dtype (uint16 for bfloat16, uint8 for float8)."""
        raw = bytes_of(array.contiguous()).cpu().numpy()
        return raw.view(storage_dtype(str(array.dtype).removeprefix("torch."))).reshape(tuple(array.shape))

    def start(self, src, into=None) -> None:
        """Hand one reshard to the progress thread and return; `src`: the contiguous source shard (a one-tensor
        program) or a sequence of them, one per tensor (None where this device has none). `into`: the caller's
        destination tensors, written in place (`executor.destinations`): the tensor (a one-tensor program) or a
        sequence, one per tensor, None where the engine's own shard is to be written; None: the engine's own."""
        refuse_broken(self.broken)
        if self.single:  # one call on the per-run path, as many as for one tensor
            self._bind_tensor(0, src)
            self._bind_dsts(None if into is None else (into,))
        else:
            self._bind(src)
            self._bind_dsts(into)
        self.src = src
        if self.cuda:  # the progress thread's stream waits for what the caller's stream wrote so far
            self.ready = self.torch.cuda.Event()
            self.ready.record()
        self.last_progress = time.monotonic()
        self.done.clear()
        if self.thread is None:
            self.thread = threading.Thread(target=self._serve, name=f"xmesh-torch-engine-d{self.program.device}", daemon=True)
            self.thread.start()
        self.go.set()

    def _serve(self) -> None:
        """The progress thread: one reshard per `go`, until close()."""
        while True:
            self.go.wait()
            self.go.clear()
            if self.stopping:
                return
            try:
                self.launching = -1
                self._iterate()
            except BaseException as err:  # kept for test()/wait() to raise in the caller's thread
                self.thread_error = (self.launching if self.launching >= 0 else self.current, err)
            self.done.set()

    def _iterate(self) -> None:
        """Run the local steps that wait for nothing and post what is ready, then finish the posted receives
        earliest first, posting what each unblocks; then wait for the sends."""
        if self.cuda:
            self.torch.cuda.set_device(self.device)
            self.torch.cuda.current_stream().wait_event(self.ready)  # the caller's writes to the source come first
        heads, posted = self.heads, self.posted_recvs
        for q in range(len(heads)):
            heads[q] = 0
        posted.clear()
        if self.converting:
            self._prepare_casts()
        for i in self.local_first:
            self._run_local(i)
        for q in range(len(heads)):
            self._advance(q)
        while posted:
            self._received(self.order[heapq.heappop(posted)])
        if any(head < len(queue) for head, queue in zip(heads, self.queues)):
            raise ExecutorError("some messages wait for steps that never finish; recompile the plan and check it with `xmesh-plan verify`")
        for i in self.sends:
            if self.works[i] is not None:  # not finished above for a step that waited for it
                self._complete(i)
        if self.cuda:
            self._complete(-1)
        self.current = -1

    def _prepare_casts(self) -> None:
        """Before any message: the typed source shard of each tensor this device converts and, for per-tensor scales,
        the max of every source device's amax, swapped with each peer first (the lower device sends first, so both
        ends of a pair post alike, as NCCL needs; with every tag 0 they come before the plan's messages at both ends).
        The casts themselves wait for the first step that reads each cast shard or its scales (`_cast`)."""
        convert, sources = self.convert, [self.src] if self.single else self.src
        self.shards = {t: self._source_view(t, sources[t]) for t, _, _ in self.converting}
        self.amaxes = {t: convert.amax(self.shards[t]) for t, c, _ in self.converting if c.scale == "tensor"}
        if self.amax_swaps:
            self._swap_amax(self.amaxes)
        self.run_count += 1
        self.last_progress = time.monotonic()

    def _cast(self, ks: tuple[int, ...]) -> None:
        """Cast the converting tensors `ks` (indices into `converting`) not cast yet this run, and write their scales
        (`executor.convert`): run just before the first step reading either is posted or run, so the cast of one tensor
        overlaps the messages of those posted before it; each tensor is still cast once, whole, so its bytes and scales
        are those of casting every tensor first (`conversions.cast_once`)."""
        cast_once(self, ks)
        self.last_progress = time.monotonic()

    def _swap_amax(self, amaxes: dict) -> None:
        """Each per-tensor scale's amax becomes the max over the tensor's source devices: one message each way per
        peer holding a source box of the same tensors (the lower device sends first, the other receives first)."""
        tag = AMAX_TAG if self.context.transport.match_by_tag else 0
        works = []
        for peer, ts, mine, theirs in self.amax_swaps:
            self.amax_peer = peer  # a timeout or a dead peer names this swap
            mine.copy_(self.torch.stack([amaxes[t] for t in ts]))
            rank = self.context.rank_of[peer]
            if self.program.device < peer:
                works += [(peer, self.group.send([mine], rank, tag)), (peer, self.group.recv([theirs], rank, tag))]
            else:
                works += [(peer, self.group.recv([theirs], rank, tag)), (peer, self.group.send([mine], rank, tag))]
        for peer, work in works:
            self.amax_peer = peer
            work.wait()
        self.amax_peer = None
        for _, ts, _, theirs in self.amax_swaps:
            for k, t in enumerate(ts):
                amaxes[t] = self.torch.maximum(amaxes[t], theirs[k])

    def _source_view(self, t: int, src):
        """The caller's source shard of tensor t in its source dtype (a same-size integer view is accepted)."""
        dtype = self.dtype_of[self.program.tensors[t].dtype]
        return src if src.dtype == dtype else src.view(dtype)

    def _advance(self, q: int) -> None:
        """Post the messages at the front of peer queue `q` while they are ready (a receive always is; a send once
        every step it waits for has finished)."""
        queue, steps, remaining, before = self.queues[q], self.steps, self.remaining, self.into.before
        head = self.heads[q]
        while head < len(queue):
            i = queue[head]
            if remaining[i]:
                break
            remaining[i] = self.initial[i]
            self.launching = i  # a dead peer can make posting raise too: name this step, not the one waited on
            casts = self.casts_before[i]
            if casts is not None:
                self._cast(casts)
            pack = before.get(i)  # a send out of a caller's strided destination: its bytes into the shadow first
            if pack is not None:
                for target, source in pack:
                    target.copy_(source)
            if steps[i].action is Action.RECV:
                self.works[i] = self.group.recv(self.buffers[i], self.peer_rank[i], self.tags[i])
                heapq.heappush(self.posted_recvs, self.position[i])
            else:
                self.works[i] = self.group.send(self.buffers[i], self.peer_rank[i], self.tags[i])
                if self.dependents[i]:  # a step waits for this send (order="device"): finish it in message order too
                    heapq.heappush(self.posted_recvs, self.position[i])
            self.launching = -1
            head += 1
        self.heads[q] = head

    def _complete(self, i: int) -> None:
        """Wait until message `i` has finished (i = -1: everything this thread queued on its CUDA stream)."""
        self.current = i
        if not self.cuda:
            self.works[i].wait()  # releases the GIL; a dead peer makes gloo raise here
        else:  # the stream waits for the work; polling an event keeps wait() able to name what hangs
            if i >= 0:
                self.works[i].wait()
            finished = self.torch.cuda.Event()
            finished.record()
            nap = self.poll_s[0]
            while not finished.query():
                time.sleep(nap)
                nap = min(nap * 2, self.poll_s[1])
        if i >= 0:
            self.works[i] = None
        self.last_progress = time.monotonic()

    def _received(self, i: int) -> None:
        self._complete(i)
        unpack = self.into.after.get(i)  # arrived in a shadow: into the caller's strided destination
        if unpack is not None:
            for target, source in unpack:
                target.copy_(source)
        for m in self.acknowledges.get(i, ()):  # a receipt: the sends it acknowledges are done (their waits return at once)
            if self.works[m] is not None:
                self._complete(m)
                self._finish(m)
        self._finish(i)

    def _run_local(self, i: int) -> None:
        casts = self.casts_before[i]
        if casts is not None:
            self._cast(casts)
        target, source = self.buffers[i]
        target.copy_(source)
        self._finish(i)

    def _finish(self, i: int) -> None:
        """Step `i` is done: post a message it unblocked at the front of its queue, then run the local steps it was the last
        wait of (messages first: a local copy runs at once, so a pack run first would hold back a send that is ready now)."""
        remaining, initial, local, dependents = self.remaining, self.initial, self.local, self.dependents[i]
        for d in dependents:
            remaining[d] -= 1
        for d in dependents:
            if remaining[d] == 0 and not local[d]:  # a receive waits for something in order="device"
                q = self.queue_of[d]
                if self.queues[q][self.heads[q]] == d:
                    self._advance(q)
        for d in dependents:  # a copy's own dependents cannot be among these at zero: they still wait for it
            if remaining[d] == 0 and local[d]:
                remaining[d] = initial[d]
                self._run_local(d)

    def test(self) -> bool:
        """True when the reshard has finished; raises what the progress thread hit."""
        if self.broken:
            raise self.failure or abandoned(self.broken)
        if not self.done.is_set():
            return False
        if self.thread_error is not None:
            step, err = self.thread_error
            self._fail(f"torch.distributed reported an error ({str(err).strip().splitlines()[0][:300]})", step)
        self.src = self.shards = None
        if self.into.callers:
            self._release()
        return True

    def wait(self) -> None:
        """Sleep until done (`replay.backoff_wait`); PeerTimeoutError naming the step waited on when nothing completes
        for `timeout_s`."""
        backoff_wait(self)

    def idle(self, nap: float) -> None:
        self.done.wait(nap)

    def timed_out(self) -> None:
        self._fail(f"nothing completed for {self.timeout_s:g} s", self.current)

    def unbind(self) -> None:
        """Drop the views of the last source shard, so that this engine no longer keeps it alive (the next
        start() makes them again). Only between reshards: the progress thread may still read them."""
        if not self.done.is_set():
            raise ExecutorError("unbind() while a reshard is in flight; call wait() first")
        for reads in self.reads_src:
            for i in reads:
                self.buffers[i] = None
        self.bound = [None] * len(self.bound)
        self.src = None

    def close(self) -> None:
        """Stop the progress thread (when idle) and drop the views; the engine cannot run again."""
        self.broken = self.broken or "closed"
        if self.done.is_set():
            self.stopping = True
            self.go.set()
            if self.thread is not None:
                self.thread.join(self.timeout_s)
            self.buffers = [None] * len(self.steps)
            self.bound = [None] * len(self.program.tensors)
            self.into = Destinations(len(self.program.tensors))
            self.src = None

    def abandon(self, why: str) -> None:
        """Refuse to run again; the progress thread may stay blocked in gloo (it cannot cancel a receive),
        so the works and buffers it uses stay referenced."""
        self.broken = why
        PROCESS.keep((self.works, self.src, self.buffers))

    def _fail(self, why: str, step: int) -> None:
        if step >= 0:
            at = f"{self.steps[step].describe()} (rank {self.peer_rank[step]})"
        elif self.amax_peer is not None:
            at = f"the amax swap of per-tensor FP8 scales with device {self.amax_peer} (rank {self.context.rank_of.get(self.amax_peer, -1)})"
        else:
            at = "local steps"
        others = sum(w is not None for w in self.works) - (step >= 0 and self.works[step] is not None)
        self.failure = failure(self.program.device, self.rank, why, [at], more=others)
        self.abandon(why)
        raise self.failure

