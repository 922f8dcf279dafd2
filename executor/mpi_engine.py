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
shard only between `start()` and `wait()`).
"""

from __future__ import annotations

import ctypes
import threading
import time
import weakref

import numpy as np

from xmesh_plan.schemas.staging import SYNC_SEND_BYTES  # device order: sends this large are synchronous (docs/executor.md)

from .arrays import as_host_array, check_shard, storage_dtype
from .errors import ExecutorError, PeerTimeoutError
from .lower import Action, RankProgram
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

    Buffers are keyed by (tensor, side): `dsts[t]` is tensor t's destination shard (`dst`: tensor 0's, the
    one-tensor face), and `start()` takes a one-tensor program's source shard, or one per tensor."""

    test_progresses = True  # test() progresses the requests itself (`replay.backoff_wait`)

    def __init__(self, program: RankProgram, comm, rank_of: dict[int, int], timeout_s: float, poll_s: tuple[float, float]):
        self.program, self.comm, self.rank_of = program, comm, rank_of
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.steps = program.steps
        self.dtypes = [storage_dtype(t.dtype) for t in program.tensors]
        self.dtype = self.dtypes[0]
        self.single = len(program.tensors) == 1
        self.dst: np.ndarray | None = None
        self.dsts: list[np.ndarray | None] = []
        self.src = None
        self.broken: str | None = None
        self.failure: ExecutorError | None = None  # the error that broke it, raised again by test()
        self.owner: object | None = None  # the token of the thread that last started or waited for a reshard
        self.lock = threading.Lock()  # held while a thread progresses this engine's requests

    def setup(self, mpi=None) -> None:
        """Allocate the destination shards and staging, and make every request and view that does not read a source
        shard. `mpi` stands in for the `mpi4py.MPI` module (tests pass an in-process fake)."""
        if mpi is None:
            from mpi4py import MPI as mpi
        self._mpi = mpi
        p, n = self.program, len(self.steps)
        self.dsts = [np.empty(t.dst_shape, dtype) if t.dst_shape is not None else None for t, dtype in zip(p.tensors, self.dtypes)]
        self.dst = self.dsts[0]
        self.stage = np.empty(p.stage_bytes, np.uint8)
        self.flat = {"dst": [d.reshape(-1).view(np.uint8) if d is not None else None for d in self.dsts], "stage": self.stage}
        self.peer_rank = [self.rank_of.get(s.peer, -1) for s in self.steps]
        self.requests: list = [None] * n
        self.pairs: list = [None] * n
        weakref.finalize(self, _free_requests, self.requests, mpi)
        self.reads_src: list[list[int]] = [[] for _ in p.tensors]  # per tensor, the steps made in _bind()
        for s in self.steps:
            if s.reads_src:
                self.reads_src[s.tensor].append(s.index)
            else:
                self._make(s.index, self.flat)
        self._schedule()

    def _schedule(self) -> None:
        """The per-iteration bookkeeping of the steps' dependencies (after the requests and views exist)."""
        PROCESS.register(self)  # a waiting engine drives the others this thread started
        deps = Dependencies(self.steps)
        self.dependents, self.initial, self.remaining, self.local = deps.dependents, deps.initial, deps.remaining, deps.local
        self.first = [s.index for s in self.steps if not s.deps and s.action is Action.RECV]
        self.first += [s.index for s in self.steps if not s.deps and s.action is not Action.RECV]
        self.live = [-1] * self.program.messages()
        self.head = self.tail = self.holes = self.pending = 0
        count = len(self.program.tensors)
        self.bound_address: list[int | None] = [None] * count
        self.bound_ref: list[weakref.ref | None] = [None] * count

    def _make(self, i: int, flat: dict) -> None:
        """The persistent request (message) or (target, source) views (local copy) of step i, reading `flat` buffers
        ("stage": the staging area; "src", "src_typed", "dst": tensor -> that tensor's shard, raw or typed)."""
        s, mpi = self.steps[i], self._mpi
        if s.action.is_message:
            data = s.data
            whole = flat["stage"] if data.buffer == "stage" else flat[data.buffer][data.tensor]
            buf = [whole[data.start:data.stop], mpi.BYTE]
            if s.action is Action.RECV:
                self.requests[i] = self.comm.Recv_init(buf, source=self.peer_rank[i], tag=s.tag)
            else:
                # in device order a large send must not finish while its bytes sit in a socket buffer, or the
                # device would start its next operation early: a synchronous send ends once it is being received.
                # Small ones stay buffered: a round trip each would cost more than the order saves (many-box plans)
                sync = self.program.order == "device" and data.nbytes >= SYNC_SEND_BYTES
                send_init = self.comm.Ssend_init if sync else self.comm.Send_init
                self.requests[i] = send_init(buf, dest=self.peer_rank[i], tag=s.tag)
        elif s.action is Action.COPY:
            self.pairs[i] = (self.dsts[s.target.tensor][s.target.index], flat["src_typed"][s.box.tensor][s.box.index])
        else:
            t = s.box.tensor
            staged = self.stage[s.data.start:s.data.stop].view(self.dtypes[t]).reshape(s.box.shape)
            shard = self.dsts[t] if s.box.side == "dst" else flat["src_typed"][t]
            boxed = shard[s.box.index] if shard is not None else None
            self.pairs[i] = (boxed, staged) if s.action is Action.UNPACK else (staged, boxed)

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
            flat = {"src": {t: raw}, "src_typed": {t: raw.view(self.dtypes[t]).reshape(self.program.tensors[t].src_shape)}}
            _free_requests([self.requests[i] for i in reads], self._mpi)
            for i in reads:
                self._make(i, flat)
            self.bound_address[t] = address
        self.bound_ref[t] = weakref.ref(src)

    def adopt(self, array) -> np.ndarray:
        return as_host_array(array, self.program.device)

    check = staticmethod(check_shard)

    def contiguous(self, array: np.ndarray) -> np.ndarray:
        return array if array.flags.c_contiguous else np.ascontiguousarray(array)

    def poison(self) -> None:
        """Overwrite the destination shards with 0xA5 bytes, so a check proves the next run wrote all of them."""
        for flat in self.flat["dst"]:
            if flat is not None:
                flat.fill(0xA5)

    def host_copy(self, array: np.ndarray) -> np.ndarray:
        return array

    def start(self, src) -> None:
        """Start every step that waits for nothing (receives first); `src`: the C-contiguous source shard (a
        one-tensor program) or a sequence of them, one per tensor (None where this device has none)."""
        refuse_broken(self.broken)
        self.owner = _thread_token()
        if not self.lock.acquire(True, LOCK_WAIT_S):  # another thread's wait() drives it for a moment at most
            raise ExecutorError("start(): this executor is held by a call that was interrupted; close() it and make a new one")
        try:
            if self.single:  # one call on the per-run path, as many as for one tensor
                self._bind_tensor(0, src)
            else:
                self._bind(src)
            self.src = src  # keeps a temporary contiguous copy alive until wait()
            self.pending = len(self.steps)
            self.head = self.tail = self.holes = 0
            self.last_progress = time.monotonic()
            for i in self.first:
                self._launch(i)
        finally:
            self.lock.release()

    def _launch(self, i: int) -> None:
        request = self.requests[i]
        if request is not None:
            request.Start()
            self.live[self.tail] = i
            self.tail += 1
        else:
            target, source = self.pairs[i]
            np.copyto(target, source)
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
        self.src = None

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
                _free_requests(self.requests, self._mpi)
            finally:
                self.lock.release()

    def abandon(self, why: str) -> None:
        """Refuse to run again after a reshard that did not finish; requests may still be active."""
        self.broken = why
        PROCESS.keep(self.src)  # active sends may still read it (they point at its memory, not the array)

    def _fail(self, why: str, error: type = PeerTimeoutError) -> None:
        """Raise with the pending transfers named; the engine refuses further runs."""
        waiting = [i for i in self.live[self.head:self.tail] if i >= 0]
        described = [f"{self.steps[i].describe()} (rank {self.peer_rank[i]})" for i in waiting]
        self.failure = failure(self.program.device, self.comm.Get_rank(), why, described, blocked=self.pending - len(waiting),
                               error=error)
        self.abandon(why)
        raise self.failure


def _free_requests(requests: list, mpi) -> None:
    """Free the persistent requests in place; skipped once MPI is finalized.

    A request still active after a failure is not freed or cancelled (cancelling a persistent send
    crashes MPICH 4 at exit) but kept (`replay.PROCESS`), so it is never deallocated while MPI may use it.
    """
    if getattr(mpi, "Is_finalized", lambda: False)():
        return
    for k, request in enumerate(requests):
        if request is None:
            continue
        try:
            if request.Test():
                request.Free()
            else:
                PROCESS.keep(request)
        except mpi.Exception:
            PROCESS.keep(request)
        requests[k] = None
