"""Prove a plan correct by replaying it symbolically on a grid of cells.

The grid is cut at every box boundary that appears in the problem or the plan, so every operation
covers whole cells. For each device we track when each cell became available (source shards at time
0). After the structural rules every reader shares (`schemas.plan_check`), replaying operations in
list order (the execution order) we check that every all-gather member held its part when the
operation started, that no device receives a cell twice, and at the end that every destination
device holds exactly its shard, and that the staging a plan states (`compile --max-staging-mb`) is
what `schemas.staging` computes. Numpy index arithmetic, no element loops; a plan the whole-array replay
(`planner.verify_arrays`) proves skips the replay one operation at a time.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from xmesh_plan.schemas import Plan, read_plan_file
from xmesh_plan.schemas.fused import fused_pieces
from xmesh_plan.schemas.geometry import Region, region_shape
from xmesh_plan.schemas.op_kinds import reads, writes
from xmesh_plan.schemas.plan import format_region
from xmesh_plan.schemas.plan_check import TOLERANCE_S, PlanError, check_plan, describe
from xmesh_plan.schemas.plan_tensors import is_multi, tensor_names, tensor_plans

from .verify_arrays import replay_summary
from .verify_columns import verify_compact

__all__ = ["PlanError", "VerifyReport", "fused_provenance", "verify_plan", "verify_plan_file"]


@dataclass(frozen=True, slots=True)
class VerifyReport:
    operations: int
    devices_checked: int
    cells: int
    tensors: int = 1
    staging_peak: int | None = None  # the largest stated per-device staging peak, checked (None: the plan states none)
    fused: int = 0  # fused destination tensors whose every element was traced to its part's element (`fused_provenance`)
    conversions: tuple[str, ...] = ()  # `name: bfloat16 -> float8_e4m3fn, block scales in 'name.scale'`, per converted tensor

    def __str__(self) -> str:
        every = f" of each of {self.tensors} tensors" if self.tensors > 1 else ""
        staging = "" if self.staging_peak is None else f"; stated staging right (peak {self.staging_peak} B per device)"
        fused = "" if not self.fused else f"; {self.fused} fused destination tensors each exactly their parts' boxes, concatenated"
        return (f"ok: {self.operations} operations replayed, {self.devices_checked} destination devices hold exactly their "
                f"shards{every} ({self.cells} destination cells){fused}{_converted(self.conversions)}{staging}")


class _Cells:
    """The cells of one device's block on one side: a time per cell when it became available (inf: never)."""

    def __init__(self, cuts: list[np.ndarray], block: Region, initial: float):
        self.block = block
        self.cuts = [c[(c >= lo) & (c <= hi)] for c, (lo, hi) in zip(cuts, block)]
        self.ready = np.full(tuple(max(len(c) - 1, 0) for c in self.cuts), initial)

    def index(self, box: Region) -> tuple[slice, ...]:
        return tuple(slice(int(np.searchsorted(c, a)), int(np.searchsorted(c, b))) for c, (a, b) in zip(self.cuts, box))

    def describe(self, idx: tuple[slice, ...], mask: np.ndarray) -> str:
        """The box, in global coordinates, of the first cell under `idx` where `mask` is set."""
        first = np.argwhere(mask)[0] + np.array([s.start for s in idx])
        return format_region(tuple((int(c[i]), int(c[i + 1])) for c, i in zip(self.cuts, first)))


def _empty(box: Region) -> bool:
    return any(a >= b for a, b in box)


def _cuts(plan: Plan) -> list[np.ndarray]:
    """Every box boundary in the problem and the plan, per dim, so each box covers whole cells."""
    boxes = list(plan.problem.blocks("src").values()) + list(plan.problem.blocks("dst").values())
    for op in plan.operations:
        boxes.append(op.region)
        boxes.extend(op.parts)
    return [np.unique(np.array([0, n] + [b[d][i] for b in boxes for i in (0, 1)], dtype=np.int64))
            for d, n in enumerate(plan.problem.shape)]


class _Replay:
    """Symbolic state of every device's source and destination shard while operations replay.

    `check_plan` has already proved every box lies inside the shards it touches and every device is
    where its kind needs it, so the replay only tracks time: who holds what when, and twice-received cells.
    """

    def __init__(self, plan: Plan):
        cuts = _cuts(plan)
        self.src = {d: _Cells(cuts, b, 0.0) for d, b in plan.problem.blocks("src").items()}
        self.dst = {d: _Cells(cuts, b, np.inf) for d, b in plan.problem.blocks("dst").items()}
        self.op = None

    def fail(self, message: str) -> None:
        raise PlanError(f"{describe(self.op)}: {message}")

    def check_holds(self, device: int, box: Region) -> None:
        """All-gather member `device` must hold all of `box` in its destination shard when the operation starts."""
        cells = self.dst[device]
        idx = cells.index(box)
        late = cells.ready[idx] > self.op.start_s + TOLERANCE_S
        if late.any():
            self.fail(f"device {device} sends {cells.describe(idx, late)} which it does not hold at {self.op.start_s:.9g}s")

    def deliver(self, device: int, box: Region, skip: Region | None = None) -> None:
        """`device` receives `box` (less `skip`, its own all-gather part) into its destination shard."""
        cells = self.dst[device]
        idx = cells.index(box)
        incoming = np.ones(cells.ready[idx].shape, dtype=bool)
        if skip is not None and not _empty(skip):
            own = tuple(slice(s.start - i.start, s.stop - i.start) for s, i in zip(cells.index(skip), idx))
            incoming[own] = False
        twice = incoming & np.isfinite(cells.ready[idx])
        if twice.any():
            self.fail(f"device {device} receives {cells.describe(idx, twice)} a second time")
        cells.ready[idx] = np.where(incoming, self.op.end_s, cells.ready[idx])

    def run(self, op) -> None:
        """What the kind reads from a destination shard must be there when it starts (a source shard
        holds everything from time 0); then what it writes lands (`schemas.op_kinds`)."""
        self.op = op
        for device, shard, box in reads(op):
            if shard == "dst" and not _empty(box):
                self.check_holds(device, box)
        for device, box, own in writes(op):
            self.deliver(device, box, skip=own)

    def finish(self) -> None:
        for d in sorted(self.dst):
            cells = self.dst[d]
            missing = ~np.isfinite(cells.ready)
            if missing.any():
                everything = tuple(slice(0, n) for n in missing.shape)
                raise PlanError(f"destination device {d} never receives {cells.describe(everything, missing)} of its shard {format_region(cells.block)}")


def _quiet(stage: str) -> None:
    del stage


def _uncounted(done: int, total: int) -> None:
    del done, total


def verify_plan(plan: Plan, on_stage: Callable[[str], None] = _quiet,
                on_count: Callable[[int, int], None] = _uncounted) -> VerifyReport:
    """Raise PlanError at the first violation; return a short report when the plan is correct.

    The structural rules (`schemas.plan_check`, shared with the executor) first, then the replay; a
    multi-tensor plan replays each tensor's operations on its own (tensors share no bytes), and a
    failure begins with the tensor's name. `on_stage` hears each step's name and `on_count` (tensors replayed,
    tensors) each tensor's end, for progress (`planner.progress`)."""
    on_stage(f"checking {len(plan.operations):,} operations")
    check_plan(plan)
    cells, devices = 0, set()
    names = tensor_names(plan)
    on_stage(f"replaying {len(names):,} tensor{'s' if len(names) != 1 else ''}")
    for done, (name, single) in enumerate(zip(names, tensor_plans(plan))):
        on_count(done, len(names))
        summary = replay_summary(single)  # all operations at once; None: replayed one by one for the verdict's words
        if summary is None:
            try:
                replay = _replay(single)
            except PlanError as err:
                raise PlanError(f"tensor {name!r}: {err}" if is_multi(plan) else str(err)) from None
            summary = (sum(c.ready.size for c in replay.dst.values()), set(replay.dst))
        cells += summary[0]
        devices |= summary[1]
    on_count(len(names), len(names))
    return _report(plan, len(plan.operations), cells, devices)


def _report(plan: Plan, operations: int, cells: int, devices: set[int]) -> VerifyReport:
    """The report on a plan whose tensors replayed (`cells` destination cells on `devices`): its fused destinations
    traced element by element (`fused_provenance`, PlanError otherwise), its stated staging peak and conversions.
    Reads only the plan's problem and staging, so a plan read without its tables (`verify_columns`) gets it too."""
    fused = plan.problem.fused if is_multi(plan) else ()
    for j in range(len(fused)):
        for device in plan.problem.dst_mesh.devices:
            fused_provenance(plan, fused[j].name, device)
    peak = None if plan.staging is None else max(plan.staging.peak_bytes.values(), default=0)
    conversions = tuple(f"{k}: {v}" for k, v in plan.problem.conversions().items()) if is_multi(plan) else \
        ((f"{plan.problem.name or 'tensor'}: {plan.problem.dtype} -> {plan.problem.dst_dtype}",) if plan.problem.dst_dtype else ())
    return VerifyReport(operations, len(devices), cells, len(tensor_names(plan)), peak, len(fused), conversions)


def verify_plan_file(path: str | os.PathLike, on_stage: Callable[[str], None] = _quiet,
                     on_count: Callable[[int, int], None] = _uncounted) -> VerifyReport:
    """`verify_plan` of the plan in `path` (PlanFileError where it cannot be read): a compact plan its columns prove
    (`verify_columns`) without reading a record per operation, any other read as records and verified."""
    proved = verify_compact(path, on_stage, on_count)
    if proved is not None:
        return _report(*proved)
    on_stage("reading")
    return verify_plan(read_plan_file(path), on_stage, on_count)


def _converted(conversions: tuple[str, ...]) -> str:
    """`; converted at the sender: 2 tensors to float8_e4m3fn (scales in their .scale tensors), 1 to bfloat16`."""
    if not conversions:
        return ""
    targets: dict[str, int] = {}
    for line in conversions:
        if " -> " in line:
            target = line.split(" -> ")[1].split(",")[0]
            targets[target] = targets.get(target, 0) + 1
    scales = sum(" scales in " in line for line in conversions)
    counted = ", ".join(f"{n} to {t}" for t, n in sorted(targets.items()))
    return f"; converted at the sender: {counted}" + (f" ({scales} with their scales as tensors of the plan)" if scales else "")


def fused_provenance(plan: Plan, name: str, device: int) -> tuple[np.ndarray, np.ndarray]:
    """Where each element of `device`'s shard of destination tensor `name` comes from: (source tensor index, flat
    index into that source tensor), arrays of the shard's shape. A plain tensor's shard is its own elements; a fused
    tensor's (`schemas.fused`) is its parts' boxes on that device, concatenated along its dim: PlanError unless
    those tile the shard exactly, each inside the box of its tensor the device receives. Called after the replay
    has proved every tensor's destination box arrives on the device once, it traces every element of a fused shard
    to one source element."""
    problem = plan.problem
    if not is_multi(plan) or all(f.name != name for f in problem.fused):
        i = problem.index_of(name) if is_multi(plan) else 0
        single = problem.tensor_problem(i) if is_multi(plan) else problem
        box = single.blocks("dst")[device]
        return np.full(region_shape(box), i), _flat_index(single.shape, box)
    j = next(k for k, f in enumerate(problem.fused) if f.name == name)
    box = problem.fused_blocks(j)[device]
    tensors, index = np.full(region_shape(box), -1), np.full(region_shape(box), -1)
    for part, piece, where in fused_pieces(problem, j, device):
        i = problem.index_of(part)
        received = problem.tensor_problem(i).blocks("dst")[device]
        if any(not (r0 <= p0 and p1 <= r1) for (p0, p1), (r0, r1) in zip(piece, received)):
            raise PlanError(f"fused tensor {name!r}: device {device} needs {format_region(piece)} of {part!r} but receives "
                            f"{format_region(received)} of it")
        if (tensors[where] != -1).any():
            raise PlanError(f"fused tensor {name!r}: on device {device} two parts land on one element of its shard")
        tensors[where] = i
        index[where] = _flat_index(problem.tensors[i].shape, piece)
    if (tensors == -1).any():
        hole = tuple(int(x) for x in np.argwhere(tensors == -1)[0])
        raise PlanError(f"fused tensor {name!r}: element {hole} of device {device}'s shard {format_region(box)} comes from no part")
    return tensors, index


def _flat_index(shape: tuple[int, ...], box: Region) -> np.ndarray:
    """The row-major flat index, in a tensor of `shape`, of every element of `box`."""
    if any(b <= a for a, b in box):
        return np.zeros(region_shape(box), dtype=np.int64)
    grids = np.meshgrid(*[np.arange(a, b) for a, b in box], indexing="ij")
    return np.ravel_multi_index(tuple(grids), tuple(shape)).astype(np.int64)


def _replay(plan: Plan) -> _Replay:
    """Replay a checked single-tensor plan; PlanError at the first fault."""
    replay = _Replay(plan)
    for op in plan.operations:  # in execution order, checked above
        replay.run(op)
    replay.finish()
    return replay
