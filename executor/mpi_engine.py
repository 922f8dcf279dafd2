"""Run one device's steps over MPI with persistent requests, allocating no Python objects per message.

Every message is a persistent request (`Send_init`/`Recv_init` on raw bytes) and every local copy
(copy, pack, unpack) a (target, source) pair of views, all made once in `setup()`. An iteration
`Start`s each request when the steps it waits for have finished and polls requests one at a time
with `Test`: mpi4py's `Startall`, `Testall` and `Testsome` copy the request list into a temporary C
array on every call (and `Testsome` returns a new list); `Start` and `Test` without a status
allocate nothing. Between polls `wait()` sleeps a little, because a blocking MPI wait spins a core;
if nothing completes for `timeout_s` it raises, naming the pending transfers and peers. While it
waits it also drives the other reshards this thread started, so ranks may wait for several
executors in different orders without deadlocking on a relay that only the other wait would launch.
Each engine has a lock, always taken without blocking on the per-call path (a `with` block would
allocate, and a blocking acquire could hang on a lock a Ctrl-C left held): a thread that finds it
taken skips the engine this time round.

Sends and copies that read the caller's source shard are bound to its address: they are remade
only when a shard arrives at another address, and hold no reference to it (the executor keeps the
shard only between `start()` and `wait()`). Destination steps are bound alike, per tensor, to the engine's own shard
or to the caller's array (`run(..., into=...)`, written in place), remade only when another array
(address and strides) arrives: a message whose bytes are one run of that array's memory is received straight into
it, one that is not (a strided view) through an MPI derived datatype that scatters it into the view, so this engine
copies no byte either way.

The engine's own destination shards are made by the first call that passes none of the caller's for them (`_own`), once:
a caller who always passes `into` gets no destination buffer of the engine's. A call whose source shard or `into` array
shares memory with an own shard that it writes (what an earlier run returned, passed back) is refused (`check_own`).

A plan that converts at the sender (`executor.conversions`) has every buffer but the caller's source shards in the
destination dtype: each source shard is cast once per run (`executor.convert_host`, torch's bits), with its FP8 scales,
into a buffer the steps reading it were bound to in `setup()`, just before the first of those steps (or of those reading
its scales) is started or run (`_cast`): the cast of one tensor follows the messages of those started before it. A
per-tensor scale takes the max of every sender's amax: `start()` computes the amax of each tensor it swaps, and each pair
of senders swaps theirs with one persistent request each way (tag TAG_UB), started before any other step; the steps
reading those tensors (or their scales) wait for the swaps like for any other step, so `start()` never blocks.
"""

from __future__ import annotations

import bisect
import ctypes
import threading
import time
import weakref

import numpy as np

from xmesh_plan.schemas.staging import SYNC_SEND_BYTES  # device order: sends this large are synchronous (docs/executor.md)

from .apart import byte_bounds, refuse_overlapping_into, refuse_shared
from .arrays import as_host_array, check_into, check_shard, storage_dtype
from .conversions import cast_once, mark_casts, sender_buffers, swap_peers
from .errors import ExecutorError, PeerTimeoutError, PlanMismatchError
from .lower import Action, RankProgram, flat_pieces
from .replay import PROCESS, Dependencies, abandoned, backoff_wait, failure, refuse_broken

WINDOW = 16
LOCK_WAIT_S = 1.0  # another thread holds an engine's lock for one pass over its requests; longer means it leaked
_THREAD = threading.local()


def _thread_token() -> object:
    """An object unique to the calling thread (made on its first call; later calls allocate nothing)."""
    try:
        return _THREAD.token
    except AttributeError:
        _THREAD.token = object()
        return _THREAD.token


class MpiEngine:
    """Replays a RankProgram over an mpi4py communicator (one the executor owns); an `executor.engines.Engine`.

    Buffers are keyed by (tensor, side): `dsts[t]` is tensor t's own destination shard (`dst`: tensor 0's, the
    one-tensor face); `start()` takes a one-tensor program's source shard, or one per tensor, and where given the
    caller's arrays to write instead (`into`)."""

    test_progresses = True  # test() progresses the requests itself (`replay.backoff_wait`)

    def __init__(self, program: RankProgram, comm, rank_of: dict[int, int], timeout_s: float, poll_s: tuple[float, float]):
        self.program, self.comm, self.rank_of = program, comm, rank_of
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.steps = program.steps
        self.dtypes = [storage_dtype(t.dst_dtype) for t in program.tensors]  # of every buffer but the caller's source shards
        self.dtype = self.dtypes[0]
        self.single = len(program.tensors) == 1
        self.dst: np.ndarray | None = None
        self.dsts: list[np.ndarray | None] = []
        self.own_spans: tuple | None = None  # the own shards' byte ranges by address (`check_own`; None: not sorted yet)
        self.src = None
        self.into = None  # the caller's destination arrays of the reshard in flight (only until wait() returns)
        self.shards = None  # the converted tensors' source shards, typed, of the reshard in flight (`_prepare_casts`)
        self.broken: str | None = None
        self.failure: ExecutorError | None = None  # the error that broke it, raised again by test()
        self.owner: object | None = None  # the token of the thread that last started or waited for a reshard
        self.lock = threading.Lock()  # held while a thread progresses this engine's requests

    def setup(self, mpi=None) -> None:
        """Allocate staging and make every request and view that touches no shard of the caller's or the engine's own
        (those are bound by the calls: `_bind_tensor`, `_bind_dst`; the own destination shards are made by the first call
        that passes none of the caller's, `_own`). `mpi` stands in for the `mpi4py.MPI` module (tests pass an in-process
        fake)."""
        if mpi is None:
            from mpi4py import MPI as mpi
        self._mpi = mpi
        p, n = self.program, len(self.steps)
        count = len(p.tensors)
        self.dsts = [None] * count  # the engine's own destination shards (`_own`)
        self.stage = np.empty(p.stage_bytes, np.uint8)
        self.src_raw: list = [None] * count  # per tensor, the bytes and the typed view its source steps read
        self.src_typed: list = [None] * count
        self.dst_typed: list = [None] * count  # per tensor, the typed view its destination steps write
        self.bound_dst: list = [None] * count  # what they write: "own", or the caller's array as (address, strides)
        self.own_bound = False  # every tensor's destination steps write the engine's own shard
        self.peer_rank = [self.rank_of.get(s.peer, -1) for s in self.steps]
        self.requests: list = [None] * n
        self.pairs: list = [None] * n
        self.types: list = [None] * n  # derived datatypes of messages into or out of a strided array of the caller's
        weakref.finalize(self, _free_requests, self.requests, mpi, self.types)
        self.reads_src, self.uses_dst, neither = p.shard_steps()  # per tensor, the steps made in _bind_tensor() and _bind_dst()
        for i in neither:
            self._make(i)
        self.converting: list = []  # (tensor, conversion, its converted shard or None), where this device converts
        self.casts_before: list = [None] * n  # per step, the converting tensors (indices into `converting`) to cast before it
        self.swaps: list = []  # (peer, tensors, my amaxes, theirs): the amax swaps of per-tensor scales
        self.gated: list[int] = []  # the steps that wait for the swaps
        self.merge = -1  # the local step merging the swapped amaxes (`_merge_amaxes`), after the swaps' requests
        if any(t.convert is not None for t in p.tensors):
            self._setup_conversion()
        self._schedule()

    def _setup_conversion(self) -> None:
        """Buffers for the senders' conversion (`executor.conversions`): each converted source shard and each scale
        tensor's source shard, with the steps that read them bound once, each of which casts what it reads first
        (`casts_before`); the persistent requests of the amax swaps (one each way per peer), after the steps', then a
        local step merging the amaxes that waits for them."""
        from . import convert_host

        self.convert = convert_host
        p, mpi = self.program, self._mpi
        made, self.converting, self.scale_shards = sender_buffers(p, lambda t: np.empty(p.tensors[t].src_shape, self.dtypes[t]),
                                                                 lambda t: bool(self.reads_src[t]))
        self.source_types = {t: convert_host.host_dtype(shards.dtype) for t, shards in enumerate(p.tensors) if shards.convert}
        swapped = {t for t, shards in enumerate(p.tensors) if shards.convert is not None and shards.convert.peers}
        readers = {t: self.reads_src[t] for t in made}
        for t, buffer in made.items():
            self.src_typed[t], self.src_raw[t] = buffer, buffer.reshape(-1).view(np.uint8)
            for i in self.reads_src[t]:
                self._make(i)
            if t in swapped or p.tensors[t].scale_of in swapped:
                self.gated += self.reads_src[t]
            self.reads_src[t] = []  # read from `buffer`, never from the caller's shard
        mark_casts(self.casts_before, self.converting, readers)  # what reads the cast shard or its scales casts it first
        self.cast_run = [-1] * len(self.converting)  # the run that last cast each converting tensor
        self.run_count = 0
        self.amaxes: dict = {}  # per converting tensor with a per-tensor scale, its amax over every sender, this run
        peers = swap_peers(self.converting)
        if not peers:
            return
        tag = self.comm.Get_attr(mpi.TAG_UB)
        clash = next((s for s in self.steps if s.action.is_message and s.peer in dict(peers) and s.tag == tag), None)
        if clash is not None:
            raise PlanMismatchError(f"the plan gives tag {tag} (this MPI's TAG_UB) to {clash.describe()}, the tag of the amax "
                                    "swap of per-tensor FP8 scales; run it with an MPI whose TAG_UB is larger")
        for peer, ts in peers:
            mine, theirs, rank = np.empty(len(ts), np.float32), np.empty(len(ts), np.float32), self.rank_of[peer]
            self.swaps.append((peer, ts, mine, theirs))
            self.requests += [self.comm.Recv_init([theirs, mpi.BYTE], source=rank, tag=tag),
                              self.comm.Send_init([mine, mpi.BYTE], dest=rank, tag=tag)]
            self.peer_rank += [rank, rank]
        self.merge = len(self.requests)
        self.requests.append(None)  # the merge of the swapped amaxes (`_merge_amaxes`): a local step
        self.pairs += [None] * (len(self.requests) - len(self.pairs))
        self.types += [None] * (len(self.requests) - len(self.types))
        self.casts_before += [None] * (len(self.requests) - len(self.casts_before))

    def _schedule(self) -> None:
        """The per-iteration bookkeeping of the steps' dependencies (after the requests and views exist); the amax swaps'
        requests and the merge of the amaxes waiting for them follow the steps, and the steps reading the tensors whose
        amaxes it merges (or their scales) wait for it."""
        PROCESS.register(self)  # a waiting engine drives the others this thread started
        deps = Dependencies(self.steps)
        self.dependents, self.initial, self.remaining, self.local = deps.dependents, deps.initial, deps.remaining, deps.local
        self.first = [s.index for s in self.steps if not s.deps and s.action is Action.RECV]
        self.first += [s.index for s in self.steps if not s.deps and s.action is not Action.RECV]
        self.count = len(self.requests)  # the steps, then any swaps' requests and their merge
        if self.swaps:
            n, merge = len(self.steps), self.merge
            swap = list(range(n, merge))  # a receive, then a send, per peer
            self.dependents += [[merge] if (i - n) % 2 == 0 else [] for i in swap] + [list(self.gated)]
            self.initial += [0] * len(swap) + [len(self.swaps)]
            self.local += [False] * len(swap) + [True]
            for i in self.gated:
                self.initial[i] += 1
            self.remaining = list(self.initial)
            gated = set(self.gated)
            self.first = swap + [i for i in self.first if i not in gated]
        self.live = [-1] * (self.program.messages() + 2 * len(self.swaps))
        self.head = self.tail = self.holes = self.pending = 0
        count = len(self.program.tensors)
        self.bound_address: list[int | None] = [None] * count
        self.bound_ref: list[weakref.ref | None] = [None] * count

    def _make(self, i: int) -> None:
        """The persistent request (message) or (target, source) views (local copy) of step i, over the staging area and
        the shards bound now (`src_raw`, `src_typed`, `dst_typed`); None while a shard it needs is not bound."""
        s, mpi = self.steps[i], self._mpi
        if s.action.is_message:
            data = s.data
            if data.buffer == "dst":
                buf = self._dst_message(i)
            else:
                whole = self.stage if data.buffer == "stage" else self.src_raw[data.tensor]
                buf = None if whole is None else [whole[data.start:data.stop], mpi.BYTE]
            if buf is None:
                self.requests[i] = None
            elif s.action is Action.RECV:
                self.requests[i] = self.comm.Recv_init(buf, source=self.peer_rank[i], tag=s.tag)
            else:
                # in device order a large send must not finish while its bytes sit in a socket buffer, or the
                # device would start its next operation early: a synchronous send ends once it is being received.
                # Small ones stay buffered: a round trip each would cost more than the order saves (many-box plans)
                sync = self.program.order == "device" and data.nbytes >= SYNC_SEND_BYTES
                send_init = self.comm.Ssend_init if sync else self.comm.Send_init
                self.requests[i] = send_init(buf, dest=self.peer_rank[i], tag=s.tag)
        elif s.action is Action.COPY:
            target, source = self.dst_typed[s.target.tensor], self.src_typed[s.box.tensor]
            self.pairs[i] = None if target is None or source is None else (target[s.target.index], source[s.box.index])
        elif s.action is Action.MOVE:  # staging bytes to staging bytes (a shared message's pieces)
            self.pairs[i] = (self.stage[s.data.start:s.data.stop], self.stage[s.origin.start:s.origin.stop])
        else:
            t = s.box.tensor
            staged = self.stage[s.data.start:s.data.stop].view(self.dtypes[t]).reshape(s.box.shape)
            shard = self.dst_typed[t] if s.box.side == "dst" else self.src_typed[t]
            boxed = None if shard is None else shard[s.box.index]
            self.pairs[i] = None if boxed is None else (boxed, staged) if s.action is Action.UNPACK else (staged, boxed)

    def _dst_message(self, i: int) -> list | None:
        """What message step i moves its destination bytes through: a byte range of the bound shard when they are one
        run of its memory, else the shard's memory with a derived datatype picking them out (None: unbound)."""
        data, mpi = self.steps[i].data, self._mpi
        typed = self.dst_typed[data.tensor]
        if typed is None:
            return None
        if typed.flags.c_contiguous:
            return [typed.reshape(-1).view(np.uint8)[data.start:data.stop], mpi.BYTE]
        size = typed.itemsize
        pieces = [typed[tuple(slice(a, b) for a, b in piece)] for piece in flat_pieces(typed.shape, data.start // size, data.stop // size)]
        if len(pieces) == 1 and pieces[0].flags.c_contiguous:
            return [pieces[0].reshape(-1).view(np.uint8), mpi.BYTE]
        base = typed.base  # the raw bytes the caller's view was remade over (`_caller_view`)
        self.types[i] = _scatter_type(mpi, pieces, base.__array_interface__["data"][0])
        return [base, 1, self.types[i]]

    def _remake(self, steps: list[int]) -> None:
        """Free the requests and datatypes of `steps` (inactive between reshards), then make them over what is bound now."""
        _free_requests([self.requests[i] for i in steps], self._mpi, [self.types[i] for i in steps])
        for i in steps:
            self.types[i] = None
            self._make(i)

    def _bind(self, src) -> None:
        """Point the steps that read a source shard at it: one per tensor (None where this device has none)."""
        for t, shard in enumerate(src):
            self._bind_tensor(t, shard)

    def _bind_tensor(self, t: int, src: np.ndarray | None) -> None:
        """Point the steps that read tensor t's source shard at `src`; remade only when its address changed since the last call."""
        reads = self.reads_src[t]
        if src is None or not reads:
            return
        ref = self.bound_ref[t]
        if ref is not None and ref() is src:
            return
        address = src.__array_interface__["data"][0]
        if address != self.bound_address[t]:
            self.bound_address[t] = None
            # A view of the raw memory, not of `src`: the requests must not keep the caller's array alive.
            raw = np.frombuffer((ctypes.c_ubyte * src.nbytes).from_address(address), np.uint8) if src.nbytes else np.empty(0, np.uint8)
            self.src_raw[t], self.src_typed[t] = raw, raw.view(self.dtypes[t]).reshape(self.program.tensors[t].src_shape)
            self._remake(reads)
            self.bound_address[t] = address
        self.bound_ref[t] = weakref.ref(src)

    def _bind_dsts(self, into) -> None:
        """Point every tensor's destination steps at the caller's array in `into` (a sequence, one per tensor, None where
        not given; None: none given) or at the engine's own shard."""
        if into is None:
            if self.own_bound:
                return
            into = (None,) * len(self.dsts)
        for t, target in enumerate(into):
            self._bind_dst(t, target)
        self.own_bound = all(target is None for target in into)

    def _bind_dst(self, t: int, target: np.ndarray | None) -> None:
        """Point tensor t's destination steps at `target` (the caller's array, written in place) or, for None, at the
        engine's own shard; remade only when another array (address, strides) or the own shard takes its place."""
        if target is None:
            own = self._own(t)
            if self.bound_dst[t] == "own" or own is None:
                return
            self.bound_dst[t], self.dst_typed[t] = "own", own
        else:
            key = (target.__array_interface__["data"][0], target.strides)
            if key == self.bound_dst[t]:
                return
            self.bound_dst[t], self.dst_typed[t] = key, _caller_view(target, self.dtypes[t])
        self._remake(self.uses_dst[t])

    def _own(self, t: int) -> np.ndarray | None:
        """Tensor t's own destination shard (None outside the destination mesh), made on first use."""
        if self.dsts[t] is None:
            shape = self.program.tensors[t].dst_shape
            if shape is None:
                return None
            self.dsts[t] = np.empty(shape, self.dtypes[t])
            self.dst = self.dsts[0]
            self.own_spans = None  # `check_own` sorts them again
        return self.dsts[t]

    def adopt(self, array) -> np.ndarray:
        return as_host_array(array, self.program.device)

    check = staticmethod(check_shard)

    @staticmethod
    def check_into(array: np.ndarray, shape: tuple[int, ...], dtype_name: str, device: int, name: str) -> None:
        """Refuse a caller's destination array of another shape or element type than its shard, read-only, or whose
        elements share memory (`executor.apart`)."""
        check_into(array, shape, dtype_name, device, name)
        refuse_overlapping_into(array, device, name)

    check_apart = staticmethod(refuse_shared)  # the caller's arrays of one call: no destination shares memory with another array

    def check_own(self, targets: dict, sources: dict, device: int) -> None:
        """Refuse, before any call starts, a source shard (`sources`, by name in tensor order) or caller's destination
        array (`targets`, by name) sharing memory with an own destination shard that the call writes (of a tensor
        `targets` leaves out): what an earlier run returned, passed back. The own shards are separate allocations,
        sorted by address once; each array costs one `byte_bounds` and a bisection, `numpy.shares_memory` only where
        byte ranges meet; nothing while the engine has none."""
        spans = self.own_spans
        if spans is None:
            if not any(own is not None for own in self.dsts):
                return
            spans = self.own_spans = _spans(self.dsts)
        lows, highs, owners = spans
        names = list(sources)
        for written, arrays in ((False, sources), (True, targets)):
            for name, array in arrays.items():
                if array is None or not array.size:
                    continue
                low, high = byte_bounds(array)
                k = bisect.bisect_right(highs, low)
                while k < len(lows) and lows[k] < high:
                    t = owners[k]
                    if names[t] not in targets and np.shares_memory(array, self.dsts[t]):
                        raise PlanMismatchError(_own_refusal(written, name, names[t], device))
                    k += 1

    def contiguous(self, array: np.ndarray) -> np.ndarray:
        return array if array.flags.c_contiguous else np.ascontiguousarray(array)

    def poison(self) -> None:
        """Overwrite the own destination shards with 0xA5 bytes, so a check proves the next run wrote all of them."""
        for t in range(len(self.dsts)):
            own = self._own(t)
            if own is not None:
                own.reshape(-1).view(np.uint8).fill(0xA5)

    def host_copy(self, array: np.ndarray) -> np.ndarray:
        return array

    def start(self, src, into=None) -> None:
        """Start every step that waits for nothing (receives first); `src`: the C-contiguous source shard (a
        one-tensor program) or a sequence of them, one per tensor (None where this device has none). `into`: the
        caller's destination arrays in the same form (None where the engine's own shard is to be written), written in
        place; None: the engine's own. A converting plan's casts run as the steps reading them start (`_cast`); only the
        amaxes its senders swap are computed here, before anything is sent (`_prepare_casts`)."""
        refuse_broken(self.broken)
        self.owner = _thread_token()
        if not self.lock.acquire(True, LOCK_WAIT_S):  # another thread's wait() drives it for a moment at most
            raise ExecutorError("start(): this executor is held by a call that was interrupted; close() it and make a new one")
        try:
            if self.single:  # one call on the per-run path, as many as for one tensor
                self._bind_tensor(0, src)
                if into is not None or not self.own_bound:
                    self._bind_dsts(None if into is None else (into,))
            else:
                self._bind(src)
                if into is not None or not self.own_bound:
                    self._bind_dsts(into)
            self.src = src  # keeps a temporary contiguous copy alive until wait()
            self.into = into
            if self.converting:
                self._prepare_casts()
            self.pending = self.count
            self.head = self.tail = self.holes = 0
            self.last_progress = time.monotonic()
            for i in self.first:
                self._launch(i)
        finally:
            self.lock.release()

    def _prepare_casts(self) -> None:
        """The typed source shard of each tensor this device converts, and the amax of each whose per-tensor scale other
        senders share, into the swaps' send buffers; the casts wait for the steps reading them (`_cast`)."""
        convert, sources = self.convert, [self.src] if self.single else self.src
        self.shards = {t: sources[t].view(self.source_types[t]) for t, _, _ in self.converting}
        amaxes = self.amaxes
        amaxes.clear()
        for _, ts, mine, _ in self.swaps:
            for k, t in enumerate(ts):
                if t not in amaxes:
                    amaxes[t] = convert.amax(self.shards[t])
                mine[k] = amaxes[t]
        self.run_count += 1

    def _merge_amaxes(self) -> None:
        """Once every swap has arrived: each swapped per-tensor amax becomes the max over its senders."""
        for _, ts, _, theirs in self.swaps:
            for k, t in enumerate(ts):
                self.amaxes[t] = np.maximum(self.amaxes[t], theirs[k])

    def _cast(self, ks: tuple[int, ...]) -> None:
        """Cast the converting tensors `ks` (indices into `converting`) not cast yet this run, with their scales
        (`conversions.cast_once`; a per-tensor scale of this sender alone takes its amax now), just before a step
        reading them starts; each is still cast once, whole, so its bytes and scales are those of casting every tensor
        first."""
        cast_once(self, ks)
        self.last_progress = time.monotonic()

    def _launch(self, i: int) -> None:
        casts = self.casts_before[i]
        if casts is not None:  # it reads a source shard converted at the sender, or its scales: cast them first
            self._cast(casts)
        request = self.requests[i]
        if request is not None:
            request.Start()
            self.live[self.tail] = i
            self.tail += 1
        else:
            if i == self.merge:  # the merge of the amaxes, once the swaps have arrived
                self._merge_amaxes()
            else:
                pair = self.pairs[i]
                np.copyto(pair[0], pair[1])
            self._finish(i)

    def _finish(self, i: int) -> None:
        """Step i is done: launch the steps it was the last wait of, messages first. A local copy runs at once, so a
        pack launched first would hold back a send that is ready now until every ready pack (and what it frees) had run."""
        self.pending -= 1
        remaining = self.remaining  # one name per line: a 4-name unpack would build a tuple on every call
        initial = self.initial
        local = self.local
        dependents = self.dependents[i]
        for d in dependents:
            remaining[d] -= 1
        for d in dependents:
            if remaining[d] == 0 and not local[d]:
                remaining[d] = initial[d]
                self._launch(d)
        for d in dependents:  # a copy's own dependents cannot be among these at zero: they still wait for it
            if remaining[d] == 0:
                remaining[d] = initial[d]
                self._launch(d)

    def test(self) -> bool:
        """Drive progress once without sleeping; True when every step has finished (False while another
        thread's wait() is driving this engine)."""
        if not self.lock.acquire(False):
            if time.monotonic() - self.last_progress > self.timeout_s:  # held, and nothing moved: it leaked
                self.abandon("its lock stayed taken (a call interrupted in another thread?)")
                raise ExecutorError(f"device {self.program.device}: this reshard's engine was held by another call for over "
                                    f"{self.timeout_s:g} s without progress (an interrupted wait() in another thread?); "
                                    "close() the executor and make a new one")
            return False
        try:
            if self.broken:  # checked under the lock: a driver may have just found an error
                raise self.failure or abandoned(self.broken)
            return self._progress()
        finally:
            self.lock.release()

    def drive(self) -> None:
        """Progress on behalf of another engine's wait(); skipped while another thread holds this
        engine. An error is kept for this engine's own test()/wait() to raise, not raised here."""
        if not self.lock.acquire(False):
            return
        try:
            if self.pending and not self.broken:  # checked again under the lock: it may have been closed
                self._progress()
        except ExecutorError:
            pass  # _fail kept it in self.failure and marked the engine broken
        except BaseException:
            self.abandon("interrupted while another reshard's wait() drove it")
            raise
        finally:
            self.lock.release()

    def _progress(self) -> bool:
        """One pass over the started requests, finishing those done; True when every step has finished.

        `live[head:tail]` holds the started, unfinished requests in start order (-1 once finished).
        Testing all n of them for each of n completions would cost O(n^2) (MPICH completes about one
        receive per progress call), so the oldest WINDOW are tested first and the rest only when none
        of those finished; the list is compacted in place once half of it is holes.
        """
        if self.pending and self.tail > self.head:
            live, head = self.live, self.head
            while head < self.tail and live[head] < 0:
                head += 1
                self.holes -= 1
            self.head = head
            window = min(head + WINDOW, self.tail)
            if self._test_range(head, window) or self._test_range(window, self.tail):
                self.last_progress = time.monotonic()
                if 2 * self.holes > self.tail - self.head:
                    self._compact()
        return self.pending == 0

    def _test_range(self, lo: int, hi: int) -> int:
        """Test live[lo:hi] one request at a time, finishing those done; how many finished."""
        live, requests, done = self.live, self.requests, 0
        try:
            for k in range(lo, hi):
                i = live[k]
                if i >= 0 and requests[i].Test():
                    live[k] = -1
                    done += 1
                    self.holes += 1
                    self._finish(i)
        except self._mpi.Exception as err:
            self._fail(f"MPI reported an error ({err.Get_error_string().splitlines()[0]})", ExecutorError)
        return done

    def _compact(self) -> None:
        """Move the unfinished entries of live[head:tail] together, keeping their order."""
        live, kept = self.live, self.head
        for k in range(self.head, self.tail):
            if live[k] >= 0:
                live[kept] = live[k]
                kept += 1
        self.tail, self.holes = kept, 0

    def wait(self) -> None:
        """Poll until done (`replay.backoff_wait`); raise PeerTimeoutError when nothing completes for `timeout_s`."""
        self.owner = _thread_token()
        self.last_progress = time.monotonic()
        backoff_wait(self)
        self.src = self.into = self.shards = None

    def idle(self, nap: float) -> None:
        """Between polls of wait(): drive the other reshards this thread started, then sleep `nap` seconds."""
        PROCESS.drive_others(self, self.owner)
        time.sleep(nap)

    def timed_out(self) -> None:
        self._fail(f"nothing completed for {self.timeout_s:g} s")

    def close(self) -> None:
        """Free the persistent requests (MPICH reports any still allocated at exit); the engine cannot run again."""
        # Taken by this very thread (close() from a signal handler that interrupted test()), or held past
        # LOCK_WAIT_S: leave the requests to the finalizer rather than free them under a call in progress.
        held = self.lock.acquire(False) or (self.owner is not _thread_token() and self.lock.acquire(True, LOCK_WAIT_S))
        self.broken = self.broken or "closed"
        if held:
            try:
                _free_requests(self.requests, self._mpi, self.types)
            finally:
                self.lock.release()

    def abandon(self, why: str) -> None:
        """Refuse to run again after a reshard that did not finish; requests may still be active."""
        self.broken = why
        PROCESS.keep((self.src, self.into))  # active requests may still use them (they point at their memory, not the arrays)

    def _describe(self, i: int) -> str:
        if i < len(self.steps):
            return self.steps[i].describe()
        peer = self.swaps[(i - len(self.steps)) // 2][0]
        return f"the amax swap of per-tensor FP8 scales with device {peer}"

    def _fail(self, why: str, error: type = PeerTimeoutError) -> None:
        """Raise with the pending transfers named; the engine refuses further runs."""
        waiting = [i for i in self.live[self.head:self.tail] if i >= 0]
        described = [f"{self._describe(i)} (rank {self.peer_rank[i]})" for i in waiting]
        self.failure = failure(self.program.device, self.comm.Get_rank(), why, described, blocked=self.pending - len(waiting),
                               error=error)
        self.abandon(why)
        raise self.failure


def _free_requests(requests: list, mpi, types: list | None = None) -> None:
    """Free the persistent requests in place, and `types[k]`, the derived datatype of `requests[k]` where it has one;
    skipped once MPI is finalized.

    A request still active after a failure is not freed or cancelled (cancelling a persistent send
    crashes MPICH 4 at exit) but kept (`replay.PROCESS`), so it is never deallocated while MPI may use it.
    """
    if getattr(mpi, "Is_finalized", lambda: False)():
        return
    for k, request in enumerate(requests):
        if request is None:
            continue
        datatype = None if types is None else types[k]
        try:
            if request.Test():
                request.Free()
                if datatype is not None:
                    datatype.Free()
            else:
                PROCESS.keep((request, datatype))
        except mpi.Exception:
            PROCESS.keep((request, datatype))
        requests[k] = None
        if datatype is not None:
            types[k] = None



def _spans(shards: list) -> tuple[list[int], list[int], list[int]]:
    """The byte ranges of the nonempty `shards` (None where absent) sorted by address: their starts, their ends, their
    indices."""
    spans = sorted((*byte_bounds(shard), t) for t, shard in enumerate(shards) if shard is not None and shard.size)
    return [low for low, _, _ in spans], [high for _, high, _ in spans], [t for _, _, t in spans]


def _own_refusal(written: bool, name: str, owner: str, device: int) -> str:
    """The one-line refusal of a caller's array (a destination array when `written`, else a source shard) of tensor
    `name` sharing memory with the engine's own destination shard of tensor `owner`, which the same call writes."""
    what = f"into[{name!r}]" if written else f"the source shard of {name!r}"
    return (f"run(): {what} on device {device} shares memory with the engine's own destination shard of {owner!r} (what an "
            f"earlier run returned for it; this call writes it): pass a copy, or pass into={{{owner!r}: ...}} for it")


def _caller_view(array: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`array`'s elements (any strides) as a view of `dtype` over its raw memory, not of `array`: the requests and views
    made over it must not keep the caller's array alive. Its `base` is those raw bytes, from the lowest one it touches."""
    low, high = byte_bounds(array)
    raw = np.frombuffer((ctypes.c_ubyte * (high - low)).from_address(low), np.uint8) if high > low else np.empty(0, np.uint8)
    return np.ndarray(array.shape, dtype, buffer=raw, offset=array.__array_interface__["data"][0] - low, strides=array.strides)


def _scatter_type(mpi, pieces: list[np.ndarray], origin: int):
    """A committed MPI datatype of the elements of `pieces` (strided views over one buffer starting at address `origin`),
    each in C order, one piece after another: what a message whose bytes are those pieces in turn is received into (or
    sent from) with count 1 over that buffer."""
    made, parts = [], []
    for piece in pieces:
        kind = mpi.BYTE.Create_contiguous(piece.itemsize)
        made.append(kind)
        for n, stride in zip(reversed(piece.shape), reversed(piece.strides)):
            kind = kind.Create_hvector(n, 1, stride)
            made.append(kind)
        parts.append((piece.__array_interface__["data"][0] - origin, kind))
    whole = mpi.Datatype.Create_struct([1] * len(parts), [at for at, _ in parts], [kind for _, kind in parts]).Commit()
    for kind in made:
        kind.Free()
    return whole
