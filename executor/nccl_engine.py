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
stream pointer, all plain ints.
"""

from __future__ import annotations

import time

import numpy as np

from .arrays import check_shard, import_dlpack, is_device_array, storage_dtype
from .errors import BackendUnavailableError, PeerTimeoutError, PlanMismatchError
from .lower import RankProgram, StagedCall
from .nccl_plan import Bcast, Copy, nccl_program
from .replay import backoff_wait, refuse_broken

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
    one communicator per group, one staging area); an `executor.engines.Engine`. `dsts[t]` is tensor t's destination
    shard (`dst`: tensor 0's, the one-tensor face)."""

    test_progresses = False  # progress happens elsewhere; test() only looks (`replay.backoff_wait`)

    def __init__(self, program: RankProgram, comm, rank_of: dict[int, int], timeout_s: float,
                 poll_s: tuple[float, float], gpu: int | None = None, devices_per_host: int = 1):
        self.program, self.comm, self.rank_of = program, comm, rank_of
        self.dtypes = [storage_dtype(t.dtype) for t in program.tensors]
        self.dtype = self.dtypes[0]
        self.single = len(program.tensors) == 1
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.gpu = program.device % devices_per_host if gpu is None else gpu
        self.dst = self.stage = None
        self.dsts: list = []
        self.communicators: dict = {}
        self.broken: str | None = None

    def setup(self) -> None:
        """Pick the GPU, create the communicators (every rank in the same order) and allocate the destination
        shards and staging."""
        cupy, nccl = import_cupy()
        self.cupy, self.nccl = cupy, nccl
        count = gpu_count(cupy)
        if not 0 <= self.gpu < count:
            raise PlanMismatchError(f"device {self.program.device} maps to GPU {self.gpu} but this host has {count}; "
                                    "pass gpu= (python -m xmesh_plan.executor.run --gpu) or place fewer devices per host")
        cupy.cuda.Device(self.gpu).use()
        p = self.program
        self.dsts = [cupy.empty(t.dst_shape, dtype) if t.dst_shape is not None else None for t, dtype in zip(p.tensors, self.dtypes)]
        self.dst = self.dsts[0]
        self.calls = nccl_program(p)
        self.stage = cupy.empty(max(self.calls.stage_bytes, 1), cupy.uint8)
        self._connect()

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
        if isinstance(array, self.cupy.ndarray):
            out = array
        elif is_device_array(array):
            out = import_dlpack(self.cupy.from_dlpack, array, "cupy", self.program.device)
        else:
            return self.cupy.asarray(np.asarray(array))
        where = getattr(getattr(out, "device", None), "id", self.gpu)
        if where != self.gpu:
            raise PlanMismatchError(f"run(): device {self.program.device}'s source shard is on GPU {where} but this rank "
                                    f"runs on GPU {self.gpu}; pass a shard on GPU {self.gpu} (or set gpu=)")
        return out

    check = staticmethod(check_shard)

    def contiguous(self, array):
        return array if array.flags.c_contiguous else self.cupy.ascontiguousarray(array)

    def poison(self) -> None:
        for dst in self.dsts:
            if dst is not None:
                dst.reshape(-1).view(self.cupy.uint8).fill(0xA5)

    def host_copy(self, array) -> np.ndarray:
        return self.cupy.asnumpy(array)

    def start(self, src) -> None:
        """Enqueue every call on the executor's stream, after the work already queued on the caller's stream; `src`: the
        source shard (a one-tensor program) or a sequence of them, one per tensor (None where this device has none)."""
        refuse_broken(self.broken)
        cupy = self.cupy
        srcs = [src] if self.single else list(src)
        for t, (shard, dtype) in enumerate(zip(srcs, self.dtypes)):
            if shard is not None and shard.dtype != dtype:  # bfloat16/float8 handed in as another int of the same size
                srcs[t] = shard.view(dtype)
        self.input_ready.record(cupy.cuda.get_current_stream())
        self.stream.wait_event(self.input_ready)
        with self.stream:
            for call, t, event in zip(self.calls.actions, self.call_tensors, self.done):
                self._call(call, srcs[t], self.dsts[t], self.dtypes[t])
                event.record(self.stream)
        self.pending = bool(self.done)
        self.started = time.monotonic()

    def _call(self, call, src, dst, dtype) -> None:
        """Enqueue one call on the current stream, over the shards `src` and `dst` of element type `dtype`."""
        if isinstance(call, Copy):
            self.cupy.copyto(dst[call.target.index], src[call.source.index])
        elif isinstance(call, StagedCall):
            self._staged(call, src, dst, dtype)
        else:
            self._bcast(call, src, dst, dtype)

    def _bcast(self, call: Bcast, src, dst, dtype) -> None:
        box, cupy = call.box, self.cupy
        shard = src if box.side == "src" else dst
        if call.stage is None:
            base = shard.data.ptr + box.span[0]
        else:
            staged = self.stage[call.stage:call.stage + box.nbytes].view(dtype).reshape(box.shape)
            base = staged.data.ptr
            if call.is_root:
                cupy.copyto(staged, shard[box.index])
        comm, root = self.communicators[call.group], call.group.index(call.root)
        for lo, hi in call.chunks:
            comm.bcast(base + lo, hi - lo, self.uint8, root, self.stream.ptr)
        if call.stage is not None and not call.is_root:
            cupy.copyto(dst[box.index], staged)

    def _staged(self, call: StagedCall, src, dst, dtype) -> None:
        """One step of a bundle over staging (`lower.StagedCall`)."""
        if call.action == "bcast":
            comm = self.communicators[call.group]
            comm.bcast(self.stage.data.ptr + call.start, call.stop - call.start, self.uint8,
                       call.group.index(call.root), self.stream.ptr)
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

    def _fail(self) -> None:
        first = next((c for c, e in zip(self.calls.actions, self.done) if not e.done), self.calls.actions[-1])
        what = first.describe() if isinstance(first, Bcast) else f"op {first.op}: local copy" if isinstance(first, Copy) else \
            f"op {first.op} (task {first.task}, bundle): {first.action} of staging bytes {first.start}-{first.stop}"
        self.abandon(f"timed out in {what}")
        raise PeerTimeoutError(f"device {self.calls.device} (GPU {self.gpu}): {what} did not finish within "
                               f"{self.timeout_s:g} s; check that every rank is alive and runs the same plan "
                               "(the communicators were aborted)")


def _tensor_of(call) -> int:
    """The tensor whose shards an NCCL call reads and writes."""
    return call.source.tensor if isinstance(call, Copy) else call.box.tensor if isinstance(call, Bcast) else call.tensor
