"""Run one device's steps over a torch.distributed gloo process group, on CPU tensors.

Every message moves raw bytes (a uint8 view of the shard or of staging), so every dtype the planner
knows travels bit for bit, bfloat16 and float8 included, although gloo has no such types. Local
copies, packs and unpacks are `Tensor.copy_` between views made once in `setup()`: no numpy, no
host round trip. Messages are posted straight on the ProcessGroup (`group.send([buf], peer, tag)`,
what `dist.isend` does after its checks) with the one-tensor lists made in `setup()`.

Gloo's point-to-point work cannot be polled: `is_completed()` stays False until `wait()` is called
(checked with torch 2.13), and `wait(timeout)` closes the connection when it expires. So each engine
has one progress thread that posts the steps, waits for the receives in step order (= tag order)
and posts what each unblocks. A send depends only on receives of its own or smaller tags, so
waiting in tag order never waits on a message that needs a later one first. `start()` hands the
iteration to that thread and returns; `test()` looks at a flag; `wait()` sleeps on an event and,
when nothing completes for `timeout_s`, raises naming the op, task and peer the thread waits on.
"""

from __future__ import annotations

import threading
import time

import numpy as np

from .arrays import RAW_KINDS
from .engines import EngineContext
from .errors import BackendUnavailableError, ExecutorError, PeerTimeoutError, PlanMismatchError
from .lower import RankProgram

_ABANDONED: list = []  # works (and the buffers they touch) still in flight after a failure: kept until exit


def torch_dtype(torch, name: str):
    """The torch dtype of a plan dtype name (every name in schemas.dtypes has one)."""
    return getattr(torch, name)


def _reads_src(step) -> bool:
    """Whether a step reads the caller's source shard (its views are remade when the shard changes)."""
    if step.action == "send":
        return step.data.buffer == "src"
    return step.action in ("copy", "pack") and step.box.side == "src"


class TorchEngine:
    """Replays a RankProgram over a torch.distributed process group; an `executor.engines.Engine`."""

    def __init__(self, program: RankProgram, context: EngineContext):
        self.program, self.context, self.group = program, context, context.comm
        self.timeout_s, self.poll_s = context.timeout_s, context.poll_s
        self.steps = program.steps
        self.dst = None
        self.broken: str | None = None
        self.failure: ExecutorError | None = None

    def setup(self) -> None:
        """Allocate the destination shard and staging on the group's device and make every view that does not read the source."""
        import torch
        import torch.distributed as dist

        self.torch = torch
        backend = str(dist.get_backend(self.group)).lower()
        if backend != "gloo":
            raise BackendUnavailableError(
                f"the torch engine runs on gloo process groups, this one runs {backend}: NCCL needs every pair's sends and "
                "receives batched in one order (not done yet); use a gloo group, or backend='nccl' with an mpi4py communicator (CuPy)")
        self.device = torch.device("cpu")
        self.dtype = torch_dtype(torch, self.context.dtype_name)
        p = self.program
        self.dst = torch.empty(p.dst_shape, dtype=self.dtype, device=self.device) if p.dst_shape is not None else None
        self.stage = torch.empty(p.stage_bytes, dtype=torch.uint8, device=self.device)
        self.flat = {"dst": _bytes_of(self.dst), "stage": self.stage, "dst_typed": self.dst}
        self.rank = dist.get_rank(self.group)
        self.peer_rank = [self.context.rank_of.get(s.peer, -1) for s in self.steps]
        self.buffers: list = [None] * len(self.steps)  # [uint8 view] per message, (target, source) per local copy
        self.works: list = [None] * len(self.steps)
        for s in self.steps:
            if not _reads_src(s):
                self._make(s.index, self.flat)
        self.reads_src = [s.index for s in self.steps if _reads_src(s)]
        self.dependents: list[list[int]] = [[] for _ in self.steps]
        for s in self.steps:
            for d in s.deps:
                self.dependents[d].append(s.index)
        self.initial = [len(s.deps) for s in self.steps]
        self.remaining = self.initial.copy()
        self.first = [s.index for s in self.steps if not s.deps and s.action == "recv"]
        self.first += [s.index for s in self.steps if not s.deps and s.action != "recv"]
        self.recvs = [s.index for s in self.steps if s.action == "recv"]
        self.sends = [s.index for s in self.steps if s.action == "send"]
        self.bound = self.src = None
        self.pending = 0
        self.current = -1  # the step the progress thread waits on
        self.launching = -1  # the step being posted, when posting itself fails
        self.thread_error: tuple[int, BaseException] | None = None
        self.go, self.done, self.stopping = threading.Event(), threading.Event(), False
        self.done.set()
        self.thread = threading.Thread(target=self._serve, name=f"xmesh-torch-engine-d{p.device}", daemon=True)
        self.thread.start()

    def _make(self, i: int, flat: dict) -> None:
        s = self.steps[i]
        if s.action in ("send", "recv"):
            self.buffers[i] = [flat[s.data.buffer][s.data.start:s.data.stop]]
        elif s.action == "copy":
            self.buffers[i] = (self.dst[s.target.index], flat["src_typed"][s.box.index])
        else:
            staged = self.stage[s.data.start:s.data.stop].view(self.dtype).view(s.box.shape)
            shard = flat["dst_typed"] if s.box.side == "dst" else flat.get("src_typed")
            boxed = shard[s.box.index] if shard is not None else None
            self.buffers[i] = (boxed, staged) if s.action == "unpack" else (staged, boxed)

    def _bind(self, src) -> None:
        """Point the steps that read the source shard at `src`; remade only when another tensor arrives."""
        if src is None or src is self.bound or not self.reads_src:
            return
        typed = src if src.dtype == self.dtype else src.view(self.dtype)  # a raw same-size view of bfloat16/float8
        flat = {"src": _bytes_of(typed), "src_typed": typed, "dst_typed": self.dst}
        for i in self.reads_src:
            self._make(i, flat)
        self.bound = src

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
        if tuple(array.shape) != shape:
            raise PlanMismatchError(f"run(): device {device}'s source shard has shape {tuple(array.shape)} but the source "
                                    f"spec {str(spec)!r} gives it {shape}; pass this rank's shard under the source spec")
        raw_ok = dtype_name.startswith(RAW_KINDS) and not array.dtype.is_floating_point and array.element_size() == self.dst_itemsize
        if array.dtype != self.dtype and not raw_ok:
            raise PlanMismatchError(f"run(): device {device}'s source shard is {array.dtype} but the plan moves {dtype_name}; "
                                    f"pass a {self.dtype} tensor (or recompile the plan with that dtype)")

    @property
    def dst_itemsize(self) -> int:
        return self.program.itemsize

    def contiguous(self, array):
        return array if array.is_contiguous() else array.contiguous()

    def poison(self) -> None:
        self.flat["dst"].fill_(0xA5)

    def host_copy(self, array) -> np.ndarray:
        """`array`'s bits as a numpy array of the plan's storage dtype (uint16 for bfloat16, uint8 for float8)."""
        raw = _bytes_of(array.contiguous()).cpu().numpy()
        return raw.view(self.context.storage).reshape(tuple(array.shape))

    def start(self, src) -> None:
        """Hand one reshard to the progress thread and return; `src` is the contiguous source shard."""
        if self.broken:
            raise ExecutorError(f"this executor stopped after an error ({self.broken}); create and prepare a new one")
        self._bind(src)
        self.src = src
        self.pending = len(self.steps)
        self.last_progress = time.monotonic()
        self.done.clear()
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
        """Post the steps that wait for nothing, then finish the receives in tag order, then the sends."""
        for i in self.first:
            self._launch(i)
        works = self.works
        for i in self.recvs + self.sends:
            self.current = i
            works[i].wait()  # releases the GIL; a dead peer makes gloo raise here
            works[i] = None
            self.last_progress = time.monotonic()
            if self.steps[i].action == "recv":
                self._finish(i)
        self.current = -1

    def _launch(self, i: int) -> None:
        action = self.steps[i].action
        if action == "recv":
            self.launching = i  # a dead peer can make posting raise too: name this step, not the one waited on
            self.works[i] = self.group.recv(self.buffers[i], self.peer_rank[i], self.steps[i].tag)
            self.launching = -1
        elif action == "send":
            self.launching = i
            self.works[i] = self.group.send(self.buffers[i], self.peer_rank[i], self.steps[i].tag)
            self.launching = -1
        else:
            target, source = self.buffers[i]
            target.copy_(source)
            self._finish(i)

    def _finish(self, i: int) -> None:
        self.pending -= 1
        remaining, initial = self.remaining, self.initial
        for d in self.dependents[i]:
            remaining[d] -= 1
            if remaining[d] == 0:
                remaining[d] = initial[d]
                self._launch(d)

    def test(self) -> bool:
        """True when the reshard has finished; raises what the progress thread hit."""
        if self.broken:
            raise self.failure or ExecutorError(f"this reshard was abandoned ({self.broken}); close() the executor and make a new one")
        if not self.done.is_set():
            return False
        if self.thread_error is not None:
            step, err = self.thread_error
            self._fail(f"torch.distributed reported an error ({str(err).strip().splitlines()[0][:300]})", step)
        self.src = None
        return True

    def wait(self) -> None:
        """Sleep until done; PeerTimeoutError naming the step waited on when nothing completes for `timeout_s`."""
        low, high = self.poll_s
        nap = low
        while not self.test():
            if time.monotonic() - self.last_progress > self.timeout_s:
                self._fail(f"nothing completed for {self.timeout_s:g} s", self.current)
            self.done.wait(nap)
            nap = min(nap * 2, high)

    def close(self) -> None:
        """Stop the progress thread (when idle) and drop the views; the engine cannot run again."""
        self.broken = self.broken or "closed"
        if self.done.is_set():
            self.stopping = True
            self.go.set()
            self.thread.join(self.timeout_s)
            self.buffers = [None] * len(self.steps)
            self.bound = self.src = None

    def abandon(self, why: str) -> None:
        """Refuse to run again; the progress thread may stay blocked in gloo (it cannot cancel a receive),
        so the works and buffers it uses stay referenced."""
        self.broken = why
        _ABANDONED.append((self.works, self.src, self.buffers))

    def _fail(self, why: str, step: int) -> None:
        me = self.program.device
        at = f"{self.steps[step].describe()} (rank {self.peer_rank[step]})" if step >= 0 else "local steps"
        others = sum(w is not None for w in self.works) - (step >= 0 and self.works[step] is not None)
        self.failure = PeerTimeoutError(
            f"device {me} (rank {self.rank}): {why}; waiting on {at}{f' and {others} more transfers' if others > 0 else ''}; "
            "check that every rank is alive and runs the same plan, or raise timeout_s if transfers are just slow")
        self.abandon(why)
        raise self.failure


def _bytes_of(tensor):
    """A flat uint8 view of a contiguous tensor (None for None)."""
    if tensor is None:
        return None
    import torch

    flat = tensor.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
