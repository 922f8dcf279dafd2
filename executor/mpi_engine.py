"""Run one device's steps with non-blocking MPI point-to-point calls on raw byte buffers.

Steps start as soon as the steps they wait for have finished; requests are polled with `Testsome`
and a short, growing sleep, because a blocking MPI wait spins a core. If nothing completes for
`timeout_s`, the wait ends with an error naming the pending operations and peers, not a hang.
All buffer views except those into the caller's source shard are made once, in `setup()`.
"""

from __future__ import annotations

import time

import numpy as np

from .arrays import as_host_array
from .errors import ExecutorError, PeerTimeoutError
from .lower import RankProgram, Step

SHOWN_PENDING = 3
WINDOW = 16


class MpiEngine:
    """Replays a RankProgram over an mpi4py communicator (one the executor owns)."""

    def __init__(self, program: RankProgram, comm, rank_of: dict[int, int], dtype: np.dtype,
                 timeout_s: float, poll_s: tuple[float, float]):
        self.program, self.comm, self.rank_of, self.dtype = program, comm, rank_of, dtype
        self.timeout_s, self.poll_s = timeout_s, poll_s
        self.steps = program.steps
        self.dst: np.ndarray | None = None
        self.broken: str | None = None

    def setup(self, mpi=None) -> None:
        """Allocate the destination shard and staging once; build every view that does not involve the source shard.

        `mpi` stands in for the `mpi4py.MPI` module (tests pass an in-process fake).
        """
        if mpi is None:
            from mpi4py import MPI as mpi
        self._mpi = mpi
        p = self.program
        self.dst = np.empty(p.dst_shape, self.dtype) if p.dst_shape is not None else None
        self.stage = np.empty(p.stage_bytes, np.uint8)
        flat = {"dst": self.dst.reshape(-1).view(np.uint8) if self.dst is not None else None, "stage": self.stage}
        self.views: list = [None] * len(self.steps)
        for s in self.steps:
            self.views[s.index] = self._static_view(s, flat)
        self.dependents: list[list[int]] = [[] for _ in self.steps]
        for s in self.steps:
            for d in s.deps:
                self.dependents[d].append(s.index)
        self.initial = [len(s.deps) for s in self.steps]
        self.first = [s.index for s in self.steps if not s.deps and s.action == "recv"]
        self.first += [s.index for s in self.steps if not s.deps and s.action != "recv"]
        self.peer_rank = [self.rank_of.get(s.peer, -1) for s in self.steps]
        self.pending = 0

    def _static_view(self, s: Step, flat: dict):
        """The fixed buffer a step touches: a byte range, or (target, source) arrays for local copies."""
        if s.action in ("send", "recv"):
            return None if s.data.buffer == "src" else flat[s.data.buffer][s.data.start:s.data.stop]
        if s.action == "copy":
            return self.dst[s.target.index]
        staged = self.stage[s.data.start:s.data.stop].view(self.dtype).reshape(s.box.shape)
        if s.action == "unpack":
            return self.dst[s.box.index], staged
        return staged, (self.dst[s.box.index] if s.box.side == "dst" else None)

    def adopt(self, array) -> np.ndarray:
        return as_host_array(array, self.program.device)

    def contiguous(self, array: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(array)

    def poison(self) -> None:
        """Overwrite the destination shard with 0xA5 bytes, so a check proves the next run wrote all of it."""
        self.dst.reshape(-1).view(np.uint8).fill(0xA5)

    def host_copy(self, array: np.ndarray) -> np.ndarray:
        return array

    def start(self, src: np.ndarray | None) -> None:
        """Post every step that waits for nothing (receives first); `src` is the C-contiguous source shard."""
        if self.broken:
            raise ExecutorError(f"this executor stopped after an error ({self.broken}); create and prepare a new one")
        self.src = src
        self.src_bytes = src.reshape(-1).view(np.uint8) if src is not None else None
        self.remaining = self.initial.copy()
        self.pending = len(self.steps)
        self.requests, self.request_steps, self.finished, self.head = [], [], 0, 0
        self.last_progress = time.monotonic()
        for i in self.first:
            self._launch(i)

    def _launch(self, i: int) -> None:
        s, view, MPI = self.steps[i], self.views[i], self._mpi
        if s.action == "recv":
            self._track(self.comm.Irecv([view, MPI.BYTE], source=self.peer_rank[i], tag=s.tag), i)
        elif s.action == "send":
            buf = view if view is not None else self.src_bytes[s.data.start:s.data.stop]
            self._track(self.comm.Isend([buf, MPI.BYTE], dest=self.peer_rank[i], tag=s.tag), i)
        elif s.action == "copy":
            np.copyto(view, self.src[s.box.index])
            self._finish(i)
        else:
            target, source = view
            np.copyto(target, source if source is not None else self.src[s.box.index])
            self._finish(i)

    def _track(self, request, i: int) -> None:
        self.requests.append(request)
        self.request_steps.append(i)

    def _finish(self, i: int) -> None:
        self.pending -= 1
        remaining = self.remaining
        for d in self.dependents[i]:
            remaining[d] -= 1
            if remaining[d] == 0:
                self._launch(d)

    def test(self) -> bool:
        """Drive progress once without sleeping; True when every step has finished.

        mpi4py converts the whole request list on every `Testsome`, so testing all of n requests
        for each of n completions costs O(n^2). The oldest WINDOW live requests are tested first,
        the rest only when none of those finished. Finished requests become REQUEST_NULL in place;
        the lists are compacted once half of them are finished.
        """
        if self.pending and self.requests:
            null, requests = self._mpi.REQUEST_NULL, self.requests
            while self.head < len(requests) and requests[self.head] == null:
                self.head += 1
            done = self._testsome(self.head, self.head + WINDOW) or self._testsome(self.head + WINDOW, len(requests))
            if done:
                self.last_progress = time.monotonic()
                self.finished += len(done)
                steps = self.request_steps
                for k in done:
                    self._finish(steps[k])
                if 2 * self.finished > len(self.requests):
                    self._compact()
        return self.pending == 0

    def _testsome(self, lo: int, hi: int) -> list[int]:
        """Indices in [lo, hi) of requests that finished now (set to REQUEST_NULL in the list)."""
        if lo >= len(self.requests):
            return []
        part = self.requests[lo:hi]
        try:
            done = self._mpi.Request.Testsome(part)
        except self._mpi.Exception as err:
            self._fail(f"MPI reported an error ({err.Get_error_string()})")
        for k in done or ():
            self.requests[lo + k] = part[k]
        return [lo + k for k in done or ()]

    def _compact(self) -> None:
        null = self._mpi.REQUEST_NULL
        live = [k for k, r in enumerate(self.requests) if r != null]
        self.requests = [self.requests[k] for k in live]
        self.request_steps = [self.request_steps[k] for k in live]
        self.finished = self.head = 0

    def wait(self) -> None:
        """Poll until done; raise PeerTimeoutError when nothing completes for `timeout_s`."""
        low, high = self.poll_s
        nap = low
        self.last_progress = time.monotonic()
        while True:
            before = self.last_progress
            if self.test():
                return
            if self.last_progress != before:
                nap = low
                continue
            if time.monotonic() - self.last_progress > self.timeout_s:
                self._fail(f"nothing completed for {self.timeout_s:g} s")
            time.sleep(nap)
            nap = min(nap * 2, high)

    def _fail(self, why: str) -> None:
        """Raise with the pending transfers named; the engine refuses further runs."""
        me = self.program.device
        self._compact()
        shown = "; ".join(f"{self.steps[i].describe()} (rank {self.peer_rank[i]})" for i in self.request_steps[:SHOWN_PENDING])
        more = len(self.request_steps) - SHOWN_PENDING
        blocked = self.pending - len(self.request_steps)
        self.broken = why
        raise PeerTimeoutError(
            f"device {me} (rank {self.comm.Get_rank()}): {why}; waiting on {shown or 'nothing posted'}"
            f"{f' and {more} more transfers' if more > 0 else ''}{f', {blocked} steps not started' if blocked else ''}; "
            "check that every rank is alive and runs the same plan, or raise timeout_s if transfers are just slow")
