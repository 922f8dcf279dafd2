"""A fake CuPy (+ `cupy.cuda.nccl`) that checks every call against the real API, without a GPU, and the NCCL
engine of every rank run over it in one process."""

from __future__ import annotations

import ctypes
import itertools
import sys
import types
from collections import defaultdict, deque

import numpy as np

from xmesh_plan.executor.arrays import storage_dtype
from xmesh_plan.executor.lower import lower
from xmesh_plan.executor.pattern import fill, mismatches
from xmesh_plan.executor.ranks import plan_devices, rank_of_devices


# ---------------------------------------------------------------------------------------------
# A fake CuPy (+ cupy.cuda.nccl) that checks every call against the real API, without a GPU.
#
# Signatures and types follow CuPy's cupy_backends/cuda/libs/nccl.pyx (Cython): pointers, counts,
# datatypes, roots and streams are plain ints; `NcclCommunicator(int ndev, <id> commId, int rank)`
# takes a tuple of C chars up to v13 and bytes from v14. Memory is host memory (numpy), so the
# collectives really move bytes. Streams run in order; an NCCL call completes only when every
# member of its communicator has it at the head of its stream (a send only when the matching
# receive is there too), so a wrong call order or an ungrouped send/send pair deadlocks here as it
# may on a GPU, and `drain()` reports it.
# ---------------------------------------------------------------------------------------------

NCCL_SIZES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8, 9: 2}  # ncclDataType_t -> bytes (nccl.h)
NCCL_NUMPY = {0: np.int8, 1: np.uint8, 2: np.int32, 3: np.uint32, 4: np.int64, 5: np.uint64, 6: np.float16, 7: np.float32, 8: np.float64}
REDUCTIONS = {0: np.add, 1: np.multiply, 2: np.fmax, 3: np.fmin}  # ncclRedOp_t (nccl.h); ncclAvg (4) is unused here
"""NCCL's float max and min are fmaxf and fminf (src/device/reduce_kernel.h), which drop a NaN; on integers the same."""


def _plain_int(name: str, value, lo: int | None = None, hi: int | None = None) -> int:
    if type(value) is not int:
        raise TypeError(f"{name}: expected a plain int (pointer, count, datatype, rank or stream), got {type(value).__name__}")
    if (lo is not None and value < lo) or (hi is not None and value >= hi):
        raise OverflowError(f"{name}={value} outside [{lo}, {hi})")
    return value


class FakeArray(np.ndarray):
    """A 'device' array: numpy memory that knows its device; `.data.ptr` is its address."""

    def __array_finalize__(self, obj):
        self._device = getattr(obj, "_device", None)

    @property
    def device(self):  # numpy 2's own `device` is the string "cpu"
        return self._device

    @property
    def data(self):
        return types.SimpleNamespace(ptr=self.__array_interface__["data"][0])


FakeArray.__module__ = "cupy"


class FakeStream:
    def __init__(self, gpu, null=False, non_blocking=False):
        self.gpu, self.null, self.non_blocking = gpu, null, non_blocking
        self.ptr = 0 if null else next(gpu.handles)
        self.process = gpu.process
        self.queue: deque = deque()
        if not null:
            gpu.streams.append(self)

    def __enter__(self):
        self.gpu.stream_stack.append(self)
        return self

    def __exit__(self, *exc):
        self.gpu.stream_stack.pop()

    def enqueue(self, kernel) -> None:
        if self.null:
            assert kernel[0] in ("host", "record"), "fake: the null stream only takes copies here"
            kernel[1]() if kernel[0] == "host" else kernel[1].set()
        else:
            self.queue.append(kernel)

    def wait_event(self, event) -> None:
        self.enqueue(("wait", event))

    def record(self, event=None):
        event = event or FakeEvent(self.gpu)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.gpu.progress()
        if self.queue:
            raise AssertionError(f"fake: stream {self.ptr:#x} can never finish: {self.gpu.stuck()}")

    @property
    def done(self) -> bool:
        self.gpu.progress()
        return not self.queue


class FakeEvent:
    def __init__(self, gpu, block=False, disable_timing=False, interprocess=False):
        self.gpu, self._done = gpu, True

    def set(self) -> None:
        self._done = True

    def record(self, stream=None) -> None:
        stream = stream if stream is not None else self.gpu.null_stream  # CuPy: "the null stream is used by default"
        assert isinstance(stream, FakeStream), f"Event.record takes a Stream, got {type(stream).__name__}"
        self._done = False
        stream.enqueue(("record", self))

    @property
    def done(self) -> bool:
        self.gpu.progress()
        return self._done

    def synchronize(self) -> None:
        if not self.done:
            raise AssertionError(f"fake: event can never complete: {self.gpu.stuck()}")


class Clique:
    def __init__(self, ndev: int):
        self.ndev, self.members, self.seq = ndev, {}, {}


class FakeCommunicator:
    def __init__(self, gpu, ndev, commId, rank):
        gpu.log.append(("NcclCommunicator", type(ndev).__name__, type(commId).__name__, type(rank).__name__))
        _plain_int("ndev", ndev, 1)
        _plain_int("rank", rank, 0, ndev)
        raw = gpu.id_from_argument(commId)
        if gpu.process not in gpu.current_device:
            raise AssertionError("fake: ncclCommInitRank before cupy.cuda.Device(i).use(): NCCL would bind GPU 0")
        clique = gpu.cliques.get(raw)
        if clique is None:
            raise AssertionError("fake: a unique id that get_unique_id() never returned (corrupted on the way?)")
        if clique.ndev is None:
            clique.ndev = ndev
        assert clique.ndev == ndev, f"fake: ranks of one communicator disagree on its size ({clique.ndev} vs {ndev})"
        assert rank not in clique.members, f"fake: rank {rank} joined communicator twice"
        self.gpu, self.clique, self.rank, self.ndev = gpu, clique, rank, ndev
        self.process, self.device, self.alive = gpu.process, gpu.current_device[gpu.process], "ok"
        clique.members[rank] = self
        gpu.init_order[gpu.process].append(raw)
        self.sent = defaultdict(int)

    # -- checks shared by every call --------------------------------------------------------
    def _check(self, name, stream, buffers):
        if self.alive != "ok":
            raise AssertionError(f"fake: {name} on a communicator after {self.alive}()")
        _plain_int("stream", stream)
        owner = next((s for s in self.gpu.streams if s.ptr == stream), None)
        assert stream != 0 and owner is not None, f"fake: {name} on stream {stream:#x}, not a Stream this rank created"
        assert owner.process == self.process, f"fake: {name} on another rank's stream"
        for what, ptr, nbytes in buffers:
            self.gpu.check_range(name, what, ptr, nbytes, self.process, self.device)
        return owner

    def _count(self, count):
        return _plain_int("count", count, 0, self.gpu.max_count)

    def _datatype(self, datatype):
        _plain_int("datatype", datatype)
        if datatype not in NCCL_SIZES:
            raise ValueError(f"fake: {datatype} is no ncclDataType_t")
        return NCCL_SIZES[datatype]

    def _collective(self, stream, part):
        seq = self.clique.seq.get(self.rank, 0)
        self.clique.seq[self.rank] = seq + 1
        self.gpu.submit(stream, ("coll", id(self.clique), seq, self, part))

    # -- the API ------------------------------------------------------------------------------
    def bcast(self, buff, count, datatype, root, stream):
        self.gpu.log.append(("bcast",) + tuple(type(a).__name__ for a in (buff, count, datatype, root, stream)))
        size, count = self._datatype(datatype), self._count(count)
        _plain_int("root", root, 0, self.ndev)
        owner = self._check("bcast", stream, [("buff", _plain_int("buff", buff), count * size)])
        self._collective(owner, ("bcast", root, datatype, count, buff, buff))

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        size, count = self._datatype(datatype), self._count(count)
        _plain_int("root", root, 0, self.ndev)
        owner = self._check("broadcast", stream, [("sendbuff", _plain_int("sendbuff", sendbuff), count * size if self.rank == root else 0),
                                                  ("recvbuff", _plain_int("recvbuff", recvbuff), count * size)])
        self._collective(owner, ("bcast", root, datatype, count, sendbuff, recvbuff))

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        size, count = self._datatype(datatype), self._count(count)
        owner = self._check("allGather", stream, [("sendbuf", _plain_int("sendbuf", sendbuf), count * size),
                                                  ("recvbuf", _plain_int("recvbuf", recvbuf), count * size * self.ndev)])
        self._collective(owner, ("allgather", None, datatype, count, sendbuf, recvbuf))

    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        self.gpu.log.append(("allReduce",) + tuple(type(a).__name__ for a in (sendbuf, recvbuf, count, datatype, op, stream)))
        size, count = self._datatype(datatype), self._count(count)
        if _plain_int("op", op) not in REDUCTIONS:
            raise ValueError(f"fake: {op} is no ncclRedOp_t")
        owner = self._check("allReduce", stream, [("sendbuf", _plain_int("sendbuf", sendbuf), count * size),
                                                  ("recvbuf", _plain_int("recvbuf", recvbuf), count * size)])
        self._collective(owner, ("allreduce", op, datatype, count, sendbuf, recvbuf))

    def send(self, sendbuf, count, datatype, peer, stream):
        size, count = self._datatype(datatype), self._count(count)
        _plain_int("peer", peer, 0, self.ndev)
        owner = self._check("send", stream, [("sendbuf", _plain_int("sendbuf", sendbuf), count * size)])
        k = self.sent[("to", peer)]
        self.sent[("to", peer)] += 1
        self.gpu.submit(owner, ("p2p", (id(self.clique), self.rank, peer, k), None, self, ("send", datatype, count, sendbuf)))

    def recv(self, recvbuf, count, datatype, peer, stream):
        size, count = self._datatype(datatype), self._count(count)
        _plain_int("peer", peer, 0, self.ndev)
        owner = self._check("recv", stream, [("recvbuf", _plain_int("recvbuf", recvbuf), count * size)])
        k = self.sent[("from", peer)]
        self.sent[("from", peer)] += 1
        self.gpu.submit(owner, ("p2p", (id(self.clique), peer, self.rank, k), None, self, ("recv", datatype, count, recvbuf)))

    def destroy(self):
        if self.alive == "ok":
            self.gpu.destroyed.append((self.process, id(self.clique)))
        self.alive = "destroy" if self.alive == "ok" else self.alive

    def abort(self):
        self.alive = "abort" if self.alive == "ok" else self.alive

    def check_async_error(self):
        pass

    def rank_id(self):
        return self.rank

    def size(self):
        return self.ndev

    def device_id(self):
        return self.device


class FakeGpu:
    """Fake CUDA + NCCL for all ranks of a test, one process; `process` says which rank is calling."""

    def __init__(self, api: int = 14, char_signed: bool = True, devices: int = 4, max_count: int = 2**64):
        self.api, self.char_signed, self.devices, self.max_count = api, char_signed, devices, max_count
        self.handles = itertools.count(0x7F0000)
        self.process = None
        self.current_device: dict = {}
        self.allocations: list = []
        self.streams: list[FakeStream] = []
        self.stream_stack: list[FakeStream] = []
        self.cliques: dict[bytes, Clique] = {}
        self.init_order: dict = defaultdict(list)
        self.destroyed: list = []
        self.group: dict | None = None
        self.log: list = []
        self.rng = np.random.default_rng(7)
        self.null_stream = FakeStream(self, null=True)
        self.cupy, self.modules = self._modules()

    # -- memory ----------------------------------------------------------------------------------
    def wrap(self, host: np.ndarray) -> FakeArray:
        if self.process not in self.current_device:
            raise AssertionError("fake: GPU memory allocated before cupy.cuda.Device(i).use()")
        array = host.view(FakeArray)
        array._device = types.SimpleNamespace(id=self.current_device[self.process])
        lo = host.__array_interface__["data"][0]
        self.allocations.append((lo, lo + host.nbytes, self.process, array.device.id, host))
        return array

    def check_range(self, call, what, ptr, nbytes, process, device) -> None:
        for lo, hi, owner, dev, _ in self.allocations:
            if lo <= ptr and ptr + nbytes <= hi:
                assert owner == process and dev == device, f"fake: {call} {what} is memory of another rank or GPU"
                return
        raise AssertionError(f"fake: {call} {what} [{ptr:#x}, +{nbytes} B) is not inside one allocation "
                             "(count in bytes vs elements? pointer of another buffer?)")

    # -- streams and progress --------------------------------------------------------------------
    def current_stream(self) -> FakeStream:
        return self.stream_stack[-1] if self.stream_stack else self.null_stream

    def submit(self, stream, part) -> None:
        if self.group is not None:
            self.group.setdefault(stream, []).append(part)
        else:
            stream.enqueue(("nccl", [part], set()))

    def progress(self) -> None:
        moved = True
        while moved:
            moved = False
            for s in self.streams:
                while s.queue and s.queue[0][0] != "nccl":
                    kind, what = s.queue[0][:2]
                    if kind == "wait" and not what._done:
                        break
                    s.queue.popleft()
                    what() if kind == "host" else (what.set() if kind == "record" else None)
                    moved = True
            heads = [s.queue[0] for s in self.streams if s.queue and s.queue[0][0] == "nccl"]
            running: dict = defaultdict(list)
            for kernel in heads:
                for i, part in enumerate(kernel[1]):
                    if i not in kernel[2]:
                        running[part[:3] if part[0] == "coll" else part[:2]].append((kernel, i, part))
            for key, parts in running.items():
                comm = parts[0][2][3]
                if any(p[3].alive != "ok" for _, _, p in parts):  # aborted: NCCL kernels bail out
                    done = parts
                elif key[0] == "coll" and len(parts) == comm.ndev:
                    self._collective(key, [p for _, _, p in parts])
                    done = parts
                elif key[0] == "p2p" and len(parts) == 2:
                    self._p2p(key, [p for _, _, p in parts])
                    done = parts
                else:
                    continue
                for kernel, i, _ in done:
                    kernel[2].add(i)
            for s in self.streams:
                if s.queue and s.queue[0][0] == "nccl" and len(s.queue[0][2]) == len(s.queue[0][1]):
                    s.queue.popleft()
                    moved = True

    def _collective(self, key, parts) -> None:
        calls = {p[3].rank: p[4] for p in parts}
        shapes = {(c[0], c[1], c[2], c[3]) for c in calls.values()}
        assert len(shapes) == 1, f"fake: members of one communicator issued different collectives as call {key[2]}: {shapes}"
        kind, root, datatype, count, _, _ = calls[0]
        nbytes = count * NCCL_SIZES[datatype]
        if kind == "bcast":
            for rank, c in calls.items():
                if rank != root:
                    ctypes.memmove(c[5], calls[root][4], nbytes)
            if calls[root][5] != calls[root][4]:
                ctypes.memmove(calls[root][5], calls[root][4], nbytes)
        elif kind == "allreduce":  # `root` holds the ncclRedOp_t
            def values(ptr):
                return np.frombuffer((ctypes.c_ubyte * nbytes).from_address(ptr), NCCL_NUMPY[datatype])
            result = values(calls[0][4]).copy()
            for rank in range(1, len(calls)):
                result = REDUCTIONS[root](result, values(calls[rank][4]))
            for c in calls.values():
                values(c[5])[:] = result
        else:
            for rank, c in calls.items():
                for other, o in calls.items():
                    ctypes.memmove(o[5] + rank * nbytes, c[4], nbytes)

    def _p2p(self, key, parts) -> None:
        send = next(p[4] for p in parts if p[4][0] == "send")
        recv = next((p[4] for p in parts if p[4][0] == "recv"), None)
        assert recv is not None, f"fake: two sends matched as one message {key}"
        assert send[1:3] == recv[1:3], f"fake: send {send[1:3]} and recv {recv[1:3]} disagree on datatype/count"
        ctypes.memmove(recv[3], send[3], send[2] * NCCL_SIZES[send[1]])

    def stuck(self) -> str:
        return "; ".join(f"stream {s.ptr:#x} of rank {s.process} waits at {s.queue[0][0]} {s.queue[0][1][0][:2] if s.queue[0][0] == 'nccl' else ''}"
                         for s in self.streams if s.queue)

    def drain(self) -> None:
        """Run everything that can run; fail naming the stuck streams if anything cannot (a deadlock)."""
        self.progress()
        if any(s.queue for s in self.streams):
            raise AssertionError(f"fake: deadlock: {self.stuck()}")

    def check_init_order(self) -> None:
        """ncclCommInitRank blocks until all ranks of the communicator call it: replay every rank's order."""
        pos = {p: 0 for p in self.init_order}
        while True:
            heads = defaultdict(set)
            for p, order in self.init_order.items():
                if pos[p] < len(order):
                    heads[order[pos[p]]].add(p)
            if not heads:
                return
            ready = [raw for raw, ps in heads.items() if len(ps) == self.cliques[raw].ndev]
            if not ready:
                raise AssertionError(f"fake: communicator creation deadlocks: {dict((k[:4].hex(), sorted(v)) for k, v in heads.items())}")
            for raw in ready:
                for p in heads[raw]:
                    pos[p] += 1

    # -- unique ids ------------------------------------------------------------------------------
    def get_unique_id(self):
        raw = self.rng.integers(0, 256, 128, dtype=np.uint8)
        raw[0] = 0xC3  # a byte >= 128: its sign differs between the tuple forms
        self.cliques[raw.tobytes()] = Clique(None)
        if self.api >= 14:
            return raw.tobytes()
        return tuple(int(x) for x in (raw.view(np.int8) if self.char_signed else raw))

    def id_from_argument(self, commId) -> bytes:
        want = bytes if self.api >= 14 else tuple
        if type(commId) is not want:
            raise TypeError(f"Argument 'commId' has incorrect type (expected {want.__name__}, got {type(commId).__name__})")
        assert len(commId) == 128
        if want is bytes:
            return commId
        lo, hi = (-128, 128) if self.char_signed else (0, 256)
        for x in commId:
            _plain_int("commId[i]", x, lo, hi)
        return np.array(commId, np.int64).astype(np.uint8).tobytes()

    # -- modules ---------------------------------------------------------------------------------
    def _modules(self):
        gpu = self
        cupy, cuda = types.ModuleType("cupy"), types.ModuleType("cupy.cuda")
        runtime, nccl = types.ModuleType("cupy.cuda.runtime"), types.ModuleType("cupy.cuda.nccl")

        class CUDARuntimeError(RuntimeError):
            pass

        class Device:
            def __init__(self, device=None):
                self.id = _plain_int("device", device, 0, gpu.devices)

            def use(self):
                gpu.current_device[gpu.process] = self.id

        def copyto(dst, src, casting="same_kind"):
            assert isinstance(dst, FakeArray) and isinstance(src, FakeArray), "fake: cupy.copyto takes CuPy arrays"
            if not np.can_cast(src.dtype, dst.dtype, casting):
                raise TypeError(f"Cannot cast array data from {src.dtype} to {dst.dtype} according to the rule '{casting}'")
            assert np.broadcast_shapes(src.shape, dst.shape) == dst.shape, f"fake: copyto {src.shape} -> {dst.shape}"
            for a in (dst, src):  # a CUDA kernel reading or writing a misaligned element faults (misaligned address)
                assert a.data.ptr % a.dtype.itemsize == 0, f"fake: copyto on a {a.dtype} array at a misaligned address"
            gpu.current_stream().enqueue(("host", lambda: np.copyto(dst, src, casting=casting)))

        def empty(shape, dtype=float):
            return gpu.wrap(np.empty(shape, dtype))

        def asarray(a):
            return a if isinstance(a, FakeArray) else gpu.wrap(np.array(a))

        def ascontiguousarray(a):
            return a if a.flags.c_contiguous else gpu.wrap(np.ascontiguousarray(a))

        def asnumpy(a):
            gpu.progress()
            return np.array(a).view(np.ndarray)

        runtime.CUDARuntimeError = CUDARuntimeError
        runtime.getDeviceCount = lambda: gpu.devices
        nccl.available = True
        for name, value in dict(NCCL_SUM=0, NCCL_PROD=1, NCCL_MAX=2, NCCL_MIN=3,
                                NCCL_INT8=0, NCCL_CHAR=0, NCCL_UINT8=1, NCCL_INT32=2, NCCL_INT=2, NCCL_UINT32=3, NCCL_INT64=4,
                                NCCL_UINT64=5, NCCL_FLOAT16=6, NCCL_HALF=6, NCCL_FLOAT32=7, NCCL_FLOAT=7, NCCL_FLOAT64=8,
                                NCCL_DOUBLE=8, NCCL_BFLOAT16=9).items():
            setattr(nccl, name, value)
        nccl.get_unique_id = self.get_unique_id
        nccl.NcclCommunicator = lambda ndev, commId, rank: FakeCommunicator(gpu, ndev, commId, rank)

        def group_start():
            assert gpu.group is None, "fake: nested groupStart (allowed by NCCL, unused here)"
            gpu.group = {}

        def group_end():
            assert gpu.group is not None, "fake: groupEnd without groupStart"
            group, gpu.group = gpu.group, None
            for stream, parts in group.items():
                stream.enqueue(("nccl", parts, set()))

        nccl.groupStart, nccl.groupEnd = group_start, group_end
        cuda.runtime, cuda.nccl, cuda.Device = runtime, nccl, Device
        cuda.Stream = lambda null=False, non_blocking=False: FakeStream(gpu, null, non_blocking)
        cuda.Event = lambda block=False, disable_timing=False, interprocess=False: FakeEvent(gpu, block, disable_timing, interprocess)
        cuda.get_current_stream = self.current_stream
        cupy.cuda, cupy.ndarray, cupy.uint8 = cuda, FakeArray, np.uint8
        cupy.empty, cupy.asarray, cupy.ascontiguousarray, cupy.asnumpy, cupy.copyto = empty, asarray, ascontiguousarray, asnumpy, copyto
        cupy.from_dlpack = lambda x: gpu.wrap(np.from_dlpack(x))
        return cupy, {"cupy": cupy, "cupy.cuda": cuda, "cupy.cuda.runtime": runtime, "cupy.cuda.nccl": nccl}

    def install(self, monkeypatch) -> "FakeGpu":
        for name, module in self.modules.items():
            monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.setattr("xmesh_plan.executor.nccl_convert.torch_on_stream", lambda stream, gpu: FakeTorchOnStream(self, stream))
        return self


class FakeTorchOnStream:
    """`nccl_convert.TorchOnStream` on the fake: torch (on CPU) over the fake's memory, its work queued on the engine's
    stream as a kernel, so it runs after the calls enqueued before it and before those after (a cast run at once, or
    on another stream, reads sources not yet arrived or is overwritten)."""

    def __init__(self, gpu: FakeGpu, stream: FakeStream):
        import torch

        assert isinstance(stream, FakeStream) and not stream.null, "fake: torch must run on the engine's own stream"
        self.gpu, self.stream, self.torch = gpu, stream, torch

    def tensor(self, array, dtype_name: str):
        from xmesh_plan.executor.nccl_convert import DLPACK_VIEW

        assert isinstance(array, FakeArray), f"fake: torch is handed a {type(array).__name__}, not GPU memory"
        lo = array.__array_interface__["data"][0]
        self.gpu.check_range("torch", "tensor", lo, array.nbytes, self.stream.process, self.gpu.current_device[self.stream.process])
        raw = np.asarray(array.view(DLPACK_VIEW.get(array.dtype, array.dtype)))
        return self.torch.from_numpy(raw).view(getattr(self.torch, dtype_name))

    def run(self, fn) -> None:
        current = self.gpu.current_stream()
        assert current is self.stream, "fake: torch work enqueued outside `with stream:` of the engine's stream"
        current.enqueue(("host", fn))


class FakeMpiComm:
    """Only the buffer-based MPI calls the engine may use for the unique ids (no lowercase, pickling ones)."""

    def __init__(self, mail, rank: int):
        self.mail, self.rank = mail, rank

    def _buffer(self, buf) -> np.ndarray:
        assert isinstance(buf, np.ndarray) and buf.nbytes == 128, f"unique id travels as a 128-byte numpy buffer, got {type(buf).__name__}"
        return buf

    def Isend(self, buf, dest: int, tag: int):
        self.mail[(self.rank, dest, tag)].append(self._buffer(buf).tobytes())
        return types.SimpleNamespace(Test=lambda: True)

    def Irecv(self, buf, source: int, tag: int):
        box, out = self.mail[(source, self.rank, tag)], self._buffer(buf)

        done = []

        def test_once() -> bool:
            if not done and box:
                out.view(np.uint8)[:] = np.frombuffer(box.popleft(), np.uint8)
                done.append(1)
            return bool(done)

        return types.SimpleNamespace(Test=test_once)


# ---------------------------------------------------------------------------------------------
# The engine against the fake
# ---------------------------------------------------------------------------------------------

RAW_VIEW = {np.dtype(np.uint16): np.int16, np.dtype(np.uint8): np.int8}  # how a caller hands in bfloat16 / float8


def nccl_engines(plan, gpu, timeout_s: float = 5.0):
    from xmesh_plan.executor.nccl_engine import NcclEngine

    mail, rank_of, dtype = defaultdict(deque), rank_of_devices(plan), storage_dtype(plan.problem.dtype)
    engines = []
    for rank, device in enumerate(plan_devices(plan)):
        gpu.process = device
        engine = NcclEngine(lower(plan, device), FakeMpiComm(mail, rank), rank_of, timeout_s, (1e-4, 1e-3),
                            devices_per_host=plan.problem.cluster.devices_per_host)
        engine.setup()
        engines.append(engine)
    assert not any(mail.values()), "unique ids sent that nobody received"
    return engines


def run_on_fake(plan, gpu, iterations: int = 3, mutate=None) -> list:
    """Every rank's NcclEngine in one process over the fake; every destination shard checked bit for bit.
    Returns the (closed) engines, for their staging."""
    engines = nccl_engines(plan, gpu)
    for e in engines:
        if mutate:
            mutate(e)
    gpu.check_init_order()
    shape, dtype = plan.problem.shape, storage_dtype(plan.problem.dtype)
    for it in range(iterations):
        shards = []
        for e in engines:
            gpu.process = e.program.device
            shard = None
            if e.program.src_block is not None:
                host = fill(e.program.src_block, shape, dtype, salt=37 * it)
                shard = e.adopt(host.view(RAW_VIEW.get(dtype, dtype)) if plan.problem.dtype.startswith(("bfloat16", "float8")) else host)
            if e.program.dst_block is not None:  # poison() makes the own shard, which the first start() would make
                e.poison()
            shards.append(shard)
        for e, shard in zip(engines, shards):
            gpu.process = e.program.device
            e.start(shard)
        gpu.drain()
        for e in engines:
            e.wait()
            assert (e.dst is None) == (e.program.dst_block is None)
            if e.dst is not None:
                bad, first = mismatches(gpu.cupy.asnumpy(e.dst), e.program.dst_block, shape, salt=37 * it)
                assert bad == 0, f"iteration {it}: device {e.program.device}: {bad} elements differ, first at {first}"
    for e in engines:
        gpu.process = e.program.device
        e.close()
    created = [(p, id(gpu.cliques[raw])) for p, order in gpu.init_order.items() for raw in order]
    assert sorted(gpu.destroyed) == sorted(created), "close() must destroy every communicator it created"
    for p, order in gpu.init_order.items():
        assert [c for q, c in gpu.destroyed if q == p] == [id(gpu.cliques[raw]) for raw in order], "destroyed out of creation order"
    return engines


def fake_nccl_transfer(plan, gpu, monkeypatch, order: str | None = None) -> list:
    """One `TransferExecutor(backend='nccl')` per rank in this process, set up by its own `prepare()` (lowering and
    passes, the check against the stated staging, the engine), every rank's engine before the next rank's: the lowest
    device of a group sends its unique id; the unique ids travel over `FakeMpiComm`, the rank agreement is this rank's
    alone."""
    from tests.support.fake_mpi import FakeWorld, WorldComm
    from xmesh_plan.executor import TransferExecutor
    from xmesh_plan.executor.executor import Executor

    def agree_alone(self, error):
        if error is not None:
            raise error

    monkeypatch.setattr(Executor, "_agree", agree_alone)
    world, mail, devices = FakeWorld(), defaultdict(deque), plan_devices(plan)
    out = []
    for rank, device in enumerate(devices):
        gpu.process = device
        ex = TransferExecutor(plan, WorldComm(world, rank, len(devices)), backend="nccl", order=order)
        ex.world.engine_comm = lambda timeout_s, poll_s, rank=rank: FakeMpiComm(mail, rank)
        ex.world.release = lambda comm: None
        ex.prepare()
        assert ex.stage_bytes == ex.entry.stage_need(ex.program)
        out.append(ex)
    assert not any(mail.values()), "unique ids sent that nobody received"
    gpu.check_init_order()
    return out


def drive(executors, gpu) -> None:
    """Call every rank's `test()` (as its process) until all have finished; fail naming the stuck streams."""
    import pytest

    for _ in range(10_000):
        done = []
        for ex in executors:
            gpu.process = ex.device
            done.append(ex.test())
        if all(done):
            return
    pytest.fail(f"stalled: {gpu.stuck()}")
