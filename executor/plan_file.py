"""A plan file as one rank of the executor reads it: only the operations its device takes part in.

    ex = TransferExecutor.from_file("sync.plan.npz", MPI.COMM_WORLD).prepare()

A compact plan (`*.plan.npz`, `schemas.plan_compact`) has a per-device index, so a rank reads the plan's
header (problem, staging) when the executor is made, and in `prepare()` the rows of its own operations
(`schemas.plan_io.read_plan_ops`); loading and lowering then cost the device's share of the plan, not
the plan's size. What is checked where:

- the rank's own operations, on their own (`plan_check.check_device_ops`: schema version, tensor
  indices, ids and order among them, each operation's devices, boxes, chunks, parts and bundles), and
  its part's replay in the lowering (nothing received twice, every destination shard complete);
- every rank read the same file: the ranks compare the SHA-256 of the file's bytes before anything
  moves (`Executor.prepare`), as they compare a plan object's fingerprint. The header, the rank's part and
  the digest are all read through the one handle `PlanFile.read` opened, so a file renamed over the path in
  between (a recompile between syncs) is not mixed in: the rank runs the file it read the header of;
- the rest needs the whole plan (tasks and host order, times against the prediction, shared messages,
  the staging peaks a plan states, and the index itself: the whole-file read rebuilds it from the operations
  table and refuses a file whose stored index differs): `xmesh-plan verify` of the file, once, where it is
  written. So a compact file must pass `verify` before ranks run it (`compile` verifies what it writes):
  what a rank does not check of the file, `verify` does.

A JSON plan file has no index: `open_plan` reads it whole into a `Plan`, which is checked whole once
(`plan_index`).
"""

from __future__ import annotations

import gc
import hashlib
import os
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from xmesh_plan.schemas import Plan
from xmesh_plan.schemas.plan import read_plan_file
from xmesh_plan.schemas.plan_io import DeviceOps, file_format, read_plan_head, read_plan_ops

from .lower import RankProgram, lower, lower_device_ops
from .plan_index import device_ops


@dataclass(frozen=True)
class PlanFile:
    """A compact plan file's header, read once (`read`): what every rank needs before it knows its device; its
    operations are read per device (`device_ops`). Everything is read through one handle, open from `read` to
    `close`: the file read, whatever is renamed over its path meanwhile."""

    path: str
    schema_version: int
    problem: Any
    staging: Any
    tags: int
    handle: BinaryIO | None = field(default=None, compare=False, repr=False)

    @classmethod
    def read(cls, path: str | os.PathLike) -> "PlanFile":
        """The file's header; PlanFileError naming the file and the fix when it is not a readable plan."""
        try:
            handle = open(path, "rb")
        except OSError:
            read_plan_head(path)  # the one-line PlanFileError naming the file and the fix
            raise
        try:
            with collector_paused():  # a large problem's header is 10^6 small lists and tuples
                head = read_plan_head(path, handle)
        except BaseException:
            handle.close()
            raise
        return cls(os.fspath(path), head.schema_version, head.problem, head.staging, head.tags, handle)

    def _open(self) -> BinaryIO:
        if self.handle is None or self.handle.closed:
            raise ValueError(f"plan file {self.path!r} was closed; read it again (PlanFile.read) to use it")
        return self.handle

    def device_ops(self, device: int) -> DeviceOps:
        """The operations `device` takes part in, read through the file's index."""
        return read_plan_ops(self.path, device, self._open(), DeviceOps(self.schema_version, self.problem, (), (), (), self.tags, self.staging))

    def digest(self) -> bytes:
        """SHA-256 of the file's bytes (read a block at a time): the ranks compare it to agree on the plan."""
        handle = self._open()
        handle.seek(0)
        return hashlib.file_digest(handle, "sha256").digest()

    def close(self) -> None:
        """Close the file (again: nothing); its header stays, its parts and digest can no longer be read."""
        if self.handle is not None:
            self.handle.close()


@contextmanager
def collector_paused():
    """Python's cyclic garbage collector off for the block (back on after it, if it was on): a rank's load and lowering
    make 10^5-10^6 small objects that form no cycles, and the collector's passes over them cost about a third of the
    time. What the block made then goes to the oldest generation at once (`gc.freeze`, then `gc.unfreeze`: two list
    moves), so the first young collection after it does not walk them all (a third of a second for 10^6 objects).
    The caller's young garbage is collected on entry (`gc.collect(1)`: the young generations only, cheap), so the move
    does not promote it to where only a full collection frees it; and when the caller has frozen objects
    (`gc.get_freeze_count()`, the pre-fork copy-on-write idiom) there is no move, since `gc.unfreeze` would thaw them."""
    enabled = gc.isenabled()
    if enabled:
        gc.collect(1)
    frozen_before = gc.get_freeze_count()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if frozen_before == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def open_plan(path: str | os.PathLike) -> Plan | PlanFile:
    """What the executor runs from a plan file: a compact file's header (`PlanFile`; each rank reads its part in
    `prepare()`), or a JSON file's whole plan."""
    return PlanFile.read(path) if file_format(path) == "compact" else read_plan_file(path)


def lower_part(plan: Plan | PlanFile, device: int, tag_limit: int | None = None,
               collectives: bool = True, share: bool = False) -> tuple[DeviceOps, RankProgram]:
    """(the operations `device` takes part in, its posted program, with its collectives where asked, each shared message
    lowered together where `share`) of a plan object (checked whole, once per object) or a plan file (its part read and
    checked on its own: `lower.lower_device_ops`)."""
    if isinstance(plan, PlanFile):
        ops = plan.device_ops(device)
        return ops, lower_device_ops(ops, device, tag_limit, collectives, share)
    return device_ops(plan, device), lower(plan, device, tag_limit, collectives, share)
