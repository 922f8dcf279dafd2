"""Run one device's NCCL calls (see `nccl_plan`) through CuPy on the GPU, on the executor's own stream.

CuPy is imported only here and only when this backend is prepared. Packing a non-contiguous box into
staging and unpacking it are CuPy copy kernels on the same stream, so no byte goes through the host.
The unique id of each group's communicator travels over MPI as 128 raw bytes (no pickle). `wait()`
polls a CUDA event per operation with a short sleep; past the deadline it aborts the communicators
and names the first unfinished operation.

CuPy API this relies on (checked against CuPy's `cupy_backends/cuda/libs/nccl.pyx` and docs; see
docs/executor.md): `get_unique_id()` returns a tuple of 128 C `char` ints up to v13 and `bytes` from
v14, and `NcclCommunicator(ndev, commId, rank)` takes the same type back; `bcast(buff, count,
datatype, root, stream)` takes a raw device pointer, a count in elements of `datatype` and a raw
stream pointer, all plain ints; `allReduce(sendbuf, recvbuf, count, datatype, op, stream)` likewise.

Destinations are the engine's own shards (made by the first call that passes none of the caller's for a tensor) or
the caller's CuPy arrays (`run(..., into=...)`, a CUDA tensor through DLPack), written in place on every call: a
broadcast whose bytes are one run of the caller's array (a contiguous one, or a run of a strided view) lands there;
one that is not goes through a shadow buffer the size of the largest such box, unpacked on the same stream (and a
root's part packed from it first), kept across calls; the engine holds the caller's arrays only until `wait()`.

A plan converting at the sender (`executor.conversions`) has every buffer but the caller's source shards in the
destination dtype: torch's own casts run on this engine's stream before each tensor's first call, and a per-tensor
FP8 scale's amax is all-reduced first (`nccl_convert`).
"""

from __future__ import annotations

import time

import numpy as np

from .apart import refuse_overlapping_into, refuse_shared
from .arrays import check_into, check_shard, import_dlpack, is_device_array, raw_torch_view, storage_dtype
from .errors import BackendUnavailableError, PeerTimeoutError, PlanMismatchError
from .lower import RankProgram, StagedCall, flat_pieces
from .conversions import cast_tensors
from .nccl_convert import StreamCasts, requires  # noqa: F401 (requires: the registry's `EngineEntry.requires`)
from .nccl_plan import AmaxMax, Bcast, Copy, nccl_program
from .replay import PROCESS, backoff_wait, refuse_broken

UNIQUE_ID_BYTES = 128


def import_cupy():
    """CuPy and its NCCL module, or BackendUnavailableError saying what to install."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as err:
        raise BackendUnavailableError(f"the nccl backend needs CuPy with NCCL ({err}); pip install cupy-cuda12x "
                                      "(and nvidia-nccl-cu12), or use backend='mpi'") from None
    if not getattr(nccl, "available", True):
        raise BackendUnavailableError("CuPy was built without NCCL; install a cupy-cuda12x wheel with nvidia-nccl-cu12, or use backend='mpi'")
    return cupy, nccl


def unique_id_bytes(uid) -> np.ndarray:
    """The 128 raw bytes of an id from `nccl.get_unique_id()`: `bytes` (CuPy >= 14) or a tuple of C chars
    (CuPy <= 13: -128..127 where char is signed, as on x86; 0..255 where it is unsigned, as on ARM)."""
    if isinstance(uid, (bytes, bytearray)):
        raw = np.frombuffer(uid, np.uint8)
    else:
        raw = (np.asarray(uid, dtype=np.int64) & 0xFF).astype(np.uint8)
    if raw.shape != (UNIQUE_ID_BYTES,):
        raise BackendUnavailableError(f"nccl.get_unique_id() gave {raw.size} bytes, expected {UNIQUE_ID_BYTES}")
    return raw


def unique_id_forms(raw: np.ndarray) -> tuple:
    """What `NcclCommunicator(ndev, commId, rank)` may take for `commId`, most recent CuPy first: `bytes`
    (v14), then a tuple of signed chars (v13 and older on x86), then of unsigned chars (older on ARM)."""
    raw = np.asarray(raw, np.uint8)
    return (raw.tobytes(), tuple(int(x) for x in raw.view(np.int8)), tuple(int(x) for x in raw))


def gpu_count(cupy) -> int:
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError as err:
        raise BackendUnavailableError(f"CuPy finds no CUDA device ({err}); use backend='mpi' on this machine") from None


class NcclEngine:
    """Replays the NCCL calls of one device's lowered program (`nccl_plan.nccl_program`: every tensor on one stream,
    one communicator per group, one staging area); an `executor.engines.Engine`. `dsts[t]` is tensor t's own destination
    shard, made by the first call that passes no array of the caller's for it (`dst`: tensor 0's, the one-tensor face)."""

    test_progresses = False  # progress happens elsewhere; test() only looks (`replay.backoff_wait`)

    def __init__(self, program: RankProgram, comm, rank_of: dict[int, int], timeout_s: float,
                 poll_s: tuple[float, float], gpu: int | None = None, devices_per_host: int = 1):
        self.program, self.comm, self.rank_of = program, comm, rank_of
        self.dtypes = [storage_dtype(t.dst_dtype) for t in program.tensors]  # of every buffer but the caller's source shards
        self.src_dtypes = [storage_dtype(t.dtype) for t in program.tensors]
        self.dtype = self.dtypes[0]
        self.single = len(program.tensors) == 1
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.gpu = program.device % devices_per_host if gpu is None else gpu
        self.stage = None
        self.dsts: list = [None] * len(program.tensors)
        self.communicators: dict = {}
        self.broken: str | None = None
        self.held = None  # the caller's arrays of the reshard in flight, until wait()
        self.casts = None  # a converting plan's casts on the stream (`nccl_convert.StreamCasts`), made in setup()

    @property
    def dst(self):
        return self.dsts[0]

    def setup(self) -> None:
        """Pick the GPU, create the communicators (every rank in the same order), allocate staging and, for a converting
        plan, the cast shards and scales."""
        cupy, nccl = import_cupy()
        self.cupy, self.nccl = cupy, nccl
        count = gpu_count(cupy)
        if not 0 <= self.gpu < count:
            raise PlanMismatchError(f"device {self.program.device} maps to GPU {self.gpu} but this host has {count}; "
                                    "pass gpu= (python -m xmesh_plan.executor.run --gpu) or place fewer devices per host")
        cupy.cuda.Device(self.gpu).use()
        self.calls = nccl_program(self.program)
        self.stage = cupy.empty(max(self.calls.stage_bytes, 1), cupy.uint8)
        self.shadow = cupy.empty(0, cupy.uint8)  # a strided destination's boxes that are not one run of it (`_layout`)
        self.layouts: dict[int, tuple] = {}
        self._connect()
        self.dst_bcasts = [[] for _ in self.program.tensors]  # per tensor, its unstaged broadcasts over its destination shard
        for i, (call, t) in enumerate(zip(self.calls.actions, self.call_tensors)):
            if isinstance(call, Bcast) and call.stage is None and call.box.side == "dst":
                self.dst_bcasts[t].append(i)
        if cast_tensors(self.program):  # a device that only receives converted bytes casts nothing (and needs no torch)
            self.casts = StreamCasts(self.program, self.calls.actions, self.call_tensors, cupy, self.stream, self.gpu)

    @property
    def stage_bytes(self) -> int:
        """Bytes of staging this engine allocated (the largest staged call, or shared message), None before setup()."""
        return getattr(getattr(self, "calls", None), "stage_bytes", None)

    def _connect(self) -> None:
        """The calls' communicators, a stream, an event per call."""
        cupy, nccl = self.cupy, self.nccl
        self.communicators = self._communicators()
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.input_ready = cupy.cuda.Event(disable_timing=True)
        self.done = [cupy.cuda.Event(disable_timing=True) for _ in self.calls.actions]
        self.call_tensors = [_tensor_of(call) for call in self.calls.actions]
        self.uint8 = getattr(nccl, "NCCL_UINT8", nccl.NCCL_CHAR)
        self.amax_bits, self.max_op = nccl.NCCL_UINT32, nccl.NCCL_MAX  # see `_reduce`
        self.pending = False

    def _communicators(self) -> dict:
        """One NCCL communicator per group this device is in, created in order of first use on every rank.

        The id travels tagged with the group's first operation, which every member of the group knows.
        """
        me, mine = self.calls.device, {}
        ids = {}
        requests = []
        first_op = {}
        for call in self.calls.actions:
            if len(getattr(call, "group", ())) > 1:
                first_op.setdefault(call.group, call.op)
        for group in self.calls.groups:
            buf, tag = np.zeros(UNIQUE_ID_BYTES, np.uint8), first_op[group] % 32768
            if me == group[0]:
                buf[:] = unique_id_bytes(self.nccl.get_unique_id())
                requests += [self.comm.Isend(buf, dest=self.rank_of[d], tag=tag) for d in group[1:]]
            else:
                requests.append(self.comm.Irecv(buf, source=self.rank_of[group[0]], tag=tag))
            ids[group] = buf
        deadline = time.monotonic() + self.timeout_s
        while not all(r.Test() for r in requests):
            if time.monotonic() > deadline:
                raise PeerTimeoutError(f"device {me}: NCCL unique ids did not arrive within {self.timeout_s:g} s; "
                                       "every rank must call prepare() with the same plan")
            time.sleep(self.poll_s[0])
        for group, buf in ids.items():
            mine[group] = self._communicator(len(group), buf, group.index(me))
        return mine

    def _communicator(self, size: int, uid: np.ndarray, rank: int):
        """`ncclCommInitRank` through CuPy, whichever form of the id this CuPy takes (see `unique_id_forms`)."""
        errors = []
        for form in unique_id_forms(uid):
            try:
                return self.nccl.NcclCommunicator(size, form, rank)
            except (TypeError, OverflowError) as err:  # raised by Cython's argument conversion, before NCCL is called
                errors.append(f"{type(form).__name__}: {err}")
        raise BackendUnavailableError(f"this CuPy's NcclCommunicator takes no known form of the NCCL unique id ({'; '.join(errors)})")

    def adopt(self, array):
        """A CuPy view of `array` (CuPy, or a CUDA tensor through DLPack); numpy input is copied to the GPU."""
        out = self._on_gpu(array, f"device {self.program.device}'s source shard", written=False)
        return self.cupy.asarray(np.asarray(array)) if out is None else out

    check = staticmethod(check_shard)

    def adopt_into(self, array, name: str):
        """The caller's destination array for tensor `name` as a CuPy view of its memory (a CUDA tensor through DLPack),
        written in place; host memory, and memory of another GPU, refused."""
        what = f"into[{name!r}] on device {self.program.device}"
        out = self._on_gpu(array, what, written=True)
        if out is None:
            raise PlanMismatchError(f"run(): {what} is a {type(array).__name__} in host memory, which the nccl backend cannot "
                                    f"write in place; pass a CuPy array or a CUDA tensor on GPU {self.gpu}")
        return out

    def _on_gpu(self, array, what: str, written: bool):
        """`array` (CuPy, or a CUDA tensor through DLPack) as a CuPy view on this rank's GPU; None for host memory. A
        tensor requiring grad (a Parameter) is read through `detach()`, the same memory, and refused where `written`:
        the reshard would change it behind autograd's back."""
        if isinstance(array, self.cupy.ndarray):
            out = array
        elif is_device_array(array):  # a bfloat16/float8 torch tensor as its bits: whether CuPy imports those kinds varies
            if getattr(array, "requires_grad", False):
                if written:
                    raise PlanMismatchError(f"run(): {what} is a tensor that requires grad, which the reshard would write "
                                            "behind autograd's back; pass tensor.detach() (or a Parameter's .data), the same memory")
                array = array.detach()
            raw = raw_torch_view(array)
            out = import_dlpack(self.cupy.from_dlpack, array if raw is None else raw, "cupy", self.program.device)
        else:
            return None
        where = getattr(getattr(out, "device", None), "id", self.gpu)
        if where != self.gpu:
            raise PlanMismatchError(f"run(): {what} is on GPU {where} but this rank runs on GPU {self.gpu}; pass one on GPU "
                                    f"{self.gpu} (or set gpu=)")
        return out

    @staticmethod
    def check_into(array, shape: tuple[int, ...], dtype_name: str, device: int, name: str) -> None:
        """Refuse a caller's destination array of another shape or element type than its shard, or whose elements share
        memory (`executor.apart`)."""
        check_into(array, shape, dtype_name, device, name)
        refuse_overlapping_into(array, device, name)

    check_apart = staticmethod(refuse_shared)  # the caller's arrays of one call: no destination shares memory with another array

    def contiguous(self, array):
        return array if array.flags.c_contiguous else self.cupy.ascontiguousarray(array)

    def _own(self, t: int):
        """Tensor t's own destination shard (None outside the destination mesh), made on first use."""
        if self.dsts[t] is None and self.program.tensors[t].dst_shape is not None:
            self.dsts[t] = self.cupy.empty(self.program.tensors[t].dst_shape, self.dtypes[t])
        return self.dsts[t]

    def poison(self) -> None:
        """Fill the own destination shards (made now if no call made them yet) with 0xA5 bytes."""
        for t in range(len(self.dsts)):
            own = self._own(t)
            if own is not None:
                own.reshape(-1).view(self.cupy.uint8).fill(0xA5)

    def host_copy(self, array) -> np.ndarray:
        return self.cupy.asnumpy(array)

    def start(self, src, into=None) -> None:
        """Enqueue every call on the executor's stream, after the work already queued on the caller's stream; `src`: the
        source shard (a one-tensor program) or a sequence of them, one per tensor (None where this device has none).
        `into`: the caller's destination arrays in the same form (None where the engine's own shard is to be written),
        written in place; None: the engine's own. A converting plan's amaxes and casts are enqueued too."""
        refuse_broken(self.broken)
        cupy = self.cupy
        srcs = [src] if self.single else list(src)
        for t, (shard, dtype) in enumerate(zip(srcs, self.src_dtypes)):
            if shard is not None and shard.dtype != dtype:  # bfloat16/float8 handed in as another int of the same size
                srcs[t] = shard.view(dtype)
        dsts = self._targets(into)
        casts, sources = self.casts, srcs
        if casts is not None:  # the calls read the cast shards and the scales instead of the caller's shards
            sources = [casts.made.get(t, shard) for t, shard in enumerate(srcs)]
        self.held = (srcs, dsts)
        self.input_ready.record(cupy.cuda.get_current_stream())
        self.stream.wait_event(self.input_ready)
        with self.stream:
            if casts is not None:
                casts.amaxes(srcs)
            for i, (call, t, event) in enumerate(zip(self.calls.actions, self.call_tensors, self.done)):
                if casts is not None and casts.before[i]:
                    casts.cast(casts.before[i], srcs)
                if t is None:  # an amax all-reduce: no tensor's shards
                    self._reduce(call)
                else:
                    self._call(i, call, sources[t], dsts[t], self.dtypes[t])
                event.record(self.stream)
        self.pending = bool(self.done)
        self.started = time.monotonic()

    def _targets(self, into) -> list:
        """Per tensor, the destination shard this call writes: the caller's array (typed as the plan's storage dtype)
        where `into` gives one, else the engine's own."""
        given = (None,) * len(self.dsts) if into is None else (into,) if self.single else into
        out = []
        for t, target in enumerate(given):
            if target is None:
                out.append(self._own(t))
                continue
            if target.dtype != self.dtypes[t]:  # bfloat16/float8 handed in as another int of the same size
                target = target.view(self.dtypes[t])
            if not target.flags.c_contiguous:
                self._layout(t, target)
            out.append(target)
        return out

    def _layout(self, t: int, target) -> None:
        """For a strided destination of tensor t: where each unstaged broadcast over it lies in its memory (a byte
        offset from its first element where its bytes are one run there, else None: through the shadow, grown to the
        largest such box now, before any call is enqueued). Kept per tensor for the last strides seen."""
        key = (target.shape, target.strides)
        if self.layouts.get(t, (None,))[0] == key:
            return
        at, size = {}, target.itemsize
        for i in self.dst_bcasts[t]:
            box = self.calls.actions[i].box
            pieces = flat_pieces(target.shape, box.span[0] // size, box.span[1] // size)
            view = target[tuple(slice(a, b) for a, b in pieces[0])] if len(pieces) == 1 else None
            at[i] = view.data.ptr - target.data.ptr if view is not None and view.flags.c_contiguous else None
            if at[i] is None and box.nbytes > self.shadow.nbytes:
                self.shadow = self.cupy.empty(box.nbytes, self.cupy.uint8)
        self.layouts[t] = (key, at)

    def _call(self, i: int, call, src, dst, dtype) -> None:
        """Enqueue call i (a copy, bundle step or broadcast of one tensor) on the current stream, over the shards `src`
        and `dst` of element type `dtype`."""
        if isinstance(call, Copy):
            self.cupy.copyto(dst[call.target.index], src[call.source.index])
        elif isinstance(call, StagedCall):
            self._staged(call, src, dst, dtype)
        else:
            self._bcast(i, call, src, dst, dtype)

    def _reduce(self, call: AmaxMax) -> None:
        """The max of the per-tensor amaxes over their senders, in place (`nccl_plan.AmaxMax`), over their float32 bits as
        uint32: NCCL's float max is fmaxf, which drops a NaN, where the torch and MPI engines' maximum keeps it. Amaxes
        are magnitudes (>= 0), whose bits sort as their values, and any NaN's bits sort above +inf's."""
        buffer = self.casts.amax_at[call.tensors[0]][0]
        self.communicators[call.group].allReduce(buffer.data.ptr, buffer.data.ptr, len(call.tensors), self.amax_bits,
                                                 self.max_op, self.stream.ptr)

    def _bcast(self, i: int, call: Bcast, src, dst, dtype) -> None:
        box, cupy = call.box, self.cupy
        shard = src if box.side == "src" else dst
        staged = None
        if call.stage is not None:
            staged = self.stage[call.stage:call.stage + box.nbytes]
        elif shard.flags.c_contiguous:
            base = shard.data.ptr + box.span[0]
        else:  # a strided destination of the caller's (`_layout`)
            at = self.layouts[box.tensor][1][i]
            if at is None:
                staged = self.shadow[:box.nbytes]
            else:
                base = shard.data.ptr + at
        if staged is not None:
            staged = staged.view(dtype).reshape(box.shape)
            base = staged.data.ptr
            if call.is_root:
                cupy.copyto(staged, shard[box.index])
        comm, root = self.communicators[call.group], call.group.index(call.root)
        for lo, hi in call.chunks:
            comm.bcast(base + lo, hi - lo, self.uint8, root, self.stream.ptr)
        if staged is not None and not call.is_root:
            cupy.copyto(dst[box.index], staged)

    def _staged(self, call: StagedCall, src, dst, dtype) -> None:
        """One step of a bundle over staging (`lower.StagedCall`)."""
        if call.action == "bcast":
            comm = self.communicators[call.group]
            comm.bcast(self.stage.data.ptr + call.start, call.stop - call.start, self.uint8,
                       call.group.index(call.root), self.stream.ptr)
            return
        if call.action == "move":  # a shared message's pieces between the message and a side area
            self.cupy.copyto(self.stage[call.start:call.stop], self.stage[call.source:call.source + call.stop - call.start])
            return
        box = call.box
        staged = self.stage[call.start:call.stop].view(dtype).reshape(box.shape)
        if call.action == "pack":
            self.cupy.copyto(staged, src[box.index])
        else:
            self.cupy.copyto(dst[box.index], staged)

    def test(self) -> bool:
        if self.pending and self.done[-1].done:
            self.pending = False
        return not self.pending

    def wait(self) -> None:
        """Poll the last call's event (`replay.backoff_wait`); past `timeout_s` from here, abort and raise."""
        self.last_progress = time.monotonic()  # the stream reports no progress before its last event: one deadline
        backoff_wait(self)
        self.held = None

    def idle(self, nap: float) -> None:
        time.sleep(nap)

    def timed_out(self) -> None:
        self._fail()

    def close(self) -> None:
        """Wait for the stream, then destroy the communicators in creation order (the same on every rank)."""
        if self.broken is None and getattr(self, "stream", None) is not None:
            self.stream.synchronize()
        for comm in getattr(self, "communicators", {}).values():
            comm.destroy()  # CuPy makes this a no-op on an aborted communicator
        self.communicators = {}
        self.broken = self.broken or "closed"

    def abandon(self, why: str) -> None:
        """Give up on the calls in flight: abort the communicators (their queued broadcasts may never
        finish) and refuse to run again."""
        for comm in self.communicators.values():
            comm.abort()
        self.broken = why
        PROCESS.keep(self.held)  # the aborted stream may still use their memory

    def _fail(self) -> None:
        first = next((c for c, e in zip(self.calls.actions, self.done) if not e.done), self.calls.actions[-1])
        what = first.describe() if isinstance(first, (Bcast, AmaxMax)) else f"op {first.op}: local copy" if isinstance(first, Copy) else \
            f"op {first.op} (task {first.task}, bundle): {first.action} of staging bytes {first.start}-{first.stop}"
        self.abandon(f"timed out in {what}")
        raise PeerTimeoutError(f"device {self.calls.device} (GPU {self.gpu}): {what} did not finish within "
                               f"{self.timeout_s:g} s; check that every rank is alive and runs the same plan "
                               "(the communicators were aborted)")


def _tensor_of(call) -> int | None:
    """The tensor whose shards an NCCL call reads and writes (None: none, an amax all-reduce)."""
    if isinstance(call, AmaxMax):
        return None
    return call.source.tensor if isinstance(call, Copy) else call.box.tensor if isinstance(call, Bcast) else call.tensor

