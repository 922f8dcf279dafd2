"""Cut a resharding into unit tasks: one box per cell of both specs' shard boundaries (paper appendix A).

Each cell's senders are the source devices whose shard contains it, its receivers the destination
devices whose shard contains it and that do not already hold it (overlapping meshes); those that do
hold it only copy locally. Adjacent cells with identical device sets are merged into one box.
The cell count, and what splitting by receiving host makes of the cells, are known from the cut points
alone, so a problem too large to compile is refused before anything is cut (`max_tasks`, the CLI's
`--max-tasks`).

What `--max-tasks` counts is what a compile holds: the unit tasks it schedules (every tensor's boxes, one per
receiving host with `--split-hosts`, small ones counted as the bundles `--coalesce` packs them into,
`check_scheduled_task_count`) and, before that, the boxes it cuts (tensors of one kind, shape and specs alike, are
cut once: `check_kinds_task_count`). The DeepSeek-V3-like weight sync's 1,025 tensors split by host into 7,099,392
boxes, yet its compile cuts 17 kinds into 148,480 boxes and schedules 613,248 tasks (32 MiB bundles): memory follows those. A refusal
before cutting names a limit every later check passes too (what all tensors split into; bundling only lowers it).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from itertools import product
from typing import NoReturn

import numpy as np

from xmesh_plan.schemas import ReshardingProblem
from xmesh_plan.schemas.geometry import Region

from .box_cells import box_split_count, decompose_boxes
from .problem_io import InputError

# Peak memory of a compile per unit task, measured by `bench/bench_task_limit.py` (BENCHMARKS.md, "Task limit");
# the default limit keeps a compile within about 8 GiB of a 24 GiB machine.
BYTES_PER_TASK = 8 * 2**10
DEFAULT_MAX_TASKS = 1_000_000


class TooManyTasksError(InputError):
    """The problem cuts into more unit tasks than the limit allows; raised before anything is cut."""


@dataclass(frozen=True, slots=True)
class Cell:
    """A box of the tensor with the devices that hold it and the devices that need it."""

    region: Region
    senders: tuple[int, ...]
    receivers: tuple[int, ...]
    local_copies: tuple[int, ...]
    merged_cells: int = 1

    def nbytes(self, itemsize: int) -> int:
        return math.prod(b - a for a, b in self.region) * itemsize

    def __str__(self) -> str:
        box = "[" + ", ".join(f"{a}:{b}" for a, b in self.region) + "]"
        return f"{box} from {list(self.senders)} to {list(self.receivers)}"


def cut_points(problem: ReshardingProblem) -> list[list[int]]:
    """Per dim, the sorted union of both sides' shard boundaries."""
    src, dst = problem.cut_points("src"), problem.cut_points("dst")
    return [sorted(set(a) | set(b)) for a, b in zip(src, dst)]


def task_count_bound(problem: ReshardingProblem) -> int:
    """Cells before merging: the product of each dim's interval count. Cutting never yields more unit tasks.

    Costs only the cut points (a few thousand integers even for meshes of thousands of devices).
    """
    return math.prod(max(0, len(c) - 1) for c in cut_points(problem))


def check_task_count(problem: ReshardingProblem, max_tasks: int | None) -> int:
    """The bound on unit tasks, or TooManyTasksError naming it and `--max-tasks` when it is above `max_tasks`."""
    bound = task_count_bound(problem)
    if max_tasks is not None and bound > max_tasks:
        per_dim = " x ".join(str(len(c) - 1) for c in cut_points(problem))
        raise TooManyTasksError(
            f"problem: cutting it gives up to {bound:,} unit tasks ({per_dim} intervals per dim), above the limit of "
            f"{max_tasks:,}; pass --max-tasks {bound} (max_tasks= in Python) if this machine has the memory "
            f"(about {_memory(bound * BYTES_PER_TASK)}), or use coarser meshes or specs")
    return bound


@dataclass(frozen=True, slots=True)
class TaskCount:
    """The unit tasks a compile makes, counted before anything is cut: `cells`, the cells before merging (cutting
    never yields more); `split`, what splitting the merged cells by receiving host makes (None: not split)."""

    cells: int
    split: int | None = None

    @property
    def needed(self) -> int:
        """The smallest `max_tasks` the compile passes: the cell bound, and what splitting makes when split."""
        return self.cells if self.split is None else max(self.cells, self.split)

    def times(self, copies: int) -> "TaskCount":
        return TaskCount(self.cells * copies, None if self.split is None else self.split * copies)

    def __add__(self, other: "TaskCount") -> "TaskCount":
        split = None if self.split is None or other.split is None else self.split + other.split
        return TaskCount(self.cells + other.cells, split)


def count_tasks(problem: ReshardingProblem, split_hosts: bool = False, merge: bool = True) -> TaskCount:
    """`task_count_bound`, and with `split_hosts` what `split_by_receiver_host` makes of the cells (`split_task_count`)."""
    return TaskCount(task_count_bound(problem), split_task_count(problem, merge) if split_hosts else None)


def _counts_by_kind(problems: list[ReshardingProblem], split_hosts: bool, merge: bool
                    ) -> tuple[dict[tuple, TaskCount], list[TaskCount]]:
    """(shape and specs -> its count, each problem's count): tensors of one shape and specs are counted once."""
    known: dict[tuple, TaskCount] = {}
    counts = []
    for p in problems:
        key = (p.shape, p.src.layout_key(), p.dst.layout_key())
        if key not in known:
            known[key] = count_tasks(p, split_hosts, merge)
        counts.append(known[key])
    return known, counts


def check_joint_task_count(problems: list[ReshardingProblem], max_tasks: int | None, split_hosts: bool = False,
                           merge: bool = True) -> TaskCount:
    """`check_task_count` for the tensors of one transfer together (one plan holds all their tasks), counting what
    splitting by receiving host makes when `split_hosts`; tensors of one shape and specs are counted once (a model's
    layers repeat)."""
    if len(problems) == 1 and not split_hosts:
        return TaskCount(check_task_count(problems[0], max_tasks))
    known, counts = _counts_by_kind(problems, split_hosts, merge)
    largest = max(range(len(counts)), key=lambda i: counts[i].needed)
    total = sum(counts[1:], counts[0])
    if len(problems) == 1 and total.needed == total.cells:
        check_task_count(problems[0], max_tasks)  # the cells bind: named per dim
    check_task_total(len(counts), total, problems[largest].name, counts[largest].needed, max_tasks)
    return total


def check_kinds_task_count(problems: list[ReshardingProblem], max_tasks: int | None, split_hosts: bool = False,
                           merge: bool = True) -> int:
    """TooManyTasksError before anything is cut where the boxes of the problems' distinct kinds of tensor (shape and
    specs: each kind is cut once and shared by its tensors, `compile._kinds`) number more than `max_tasks`, counted from
    the cut points (split by receiving host when `split_hosts`); the message names what all the tensors together cut
    into, a limit the scheduled count (`check_scheduled_task_count`) passes as well. Returns the kinds' count. A
    single tensor unsplit is `check_task_count` (its message names the intervals per dim)."""
    if len(problems) == 1 and not split_hosts:
        return check_task_count(problems[0], max_tasks)
    known, counts = _counts_by_kind(problems, split_hosts, merge)
    total, cut = sum(counts[1:], counts[0]), sum(c.needed for c in known.values())
    check_kinds_total(len(known), cut, len(counts), total, max_tasks)
    return cut


def check_kinds_total(kinds: int, cut: int, tensors: int, total: TaskCount, max_tasks: int | None) -> None:
    """TooManyTasksError where the boxes of `kinds` kinds of tensor (`cut` of them) are more than `max_tasks`; the
    message names the limit that lets `tensors` tensors (`total`) through every check (`check_kinds_task_count`)."""
    if max_tasks is None or cut <= max_tasks:
        return
    split = total.split is not None
    what = "split by receiving host (--split-hosts), " if split else ""
    _refuse(f"{what}the {kinds} kinds of tensor it cuts (shape and specs) give {cut:,} unit tasks", max(cut, total.needed),
            max_tasks, split, f"; what its {tensors} tensors give together", "at most ")


def check_scheduled_task_count(scheduled: int, cut: int, tensors: int, max_tasks: int | None, split_hosts: bool,
                               coalesce: bool) -> None:
    """TooManyTasksError where a compile would schedule more than `max_tasks` unit tasks (`scheduled`, all `tensors`
    tensors), counted once each kind is cut (`cut` boxes), split and bundled, before anything is costed or scheduled;
    the message names the limit that passes both counts."""
    if max_tasks is None or scheduled <= max_tasks:
        return
    how = ", ".join(w for w, on in (("split by receiving host", split_hosts), ("small boxes bundled", coalesce)) if on)
    _refuse(f"its {tensors} tensors schedule {scheduled:,} unit tasks{f' ({how})' if how else ''}", max(scheduled, cut),
            max_tasks, split_hosts)


def check_task_total(tensors: int, total: TaskCount, largest_name: str, largest: int, max_tasks: int | None) -> None:
    """TooManyTasksError where `tensors` tensors need a limit of `total.needed` unit tasks, above `max_tasks` (`largest`
    of them from the tensor called `largest_name`); the message names the number that lets the compile through."""
    if max_tasks is None or total.needed <= max_tasks:
        return
    most = "" if tensors == 1 else f" (the most, {largest:,}, from {largest_name!r})"
    split = total.needed != total.cells
    if not split:
        whose = "it gives" if tensors == 1 else f"its {tensors} tensors gives"
        what = f"cutting {whose} up to {total.cells:,} unit tasks{most}"
    else:
        whose = "it gives" if tensors == 1 else f"its {tensors} tensors give"
        what = f"split by receiving host (--split-hosts) {whose} {total.split:,} unit tasks{most}"
    _refuse(what, total.needed, max_tasks, split)


def _refuse(what: str, needed: int, max_tasks: int, split: bool, whose: str = "", bound: str = "") -> NoReturn:
    """The one refusal of every task count: `problem: <what>, above the limit`, the --max-tasks `needed` that passes
    (`whose` count it is), the memory that takes (`bound`: `at most ` where the compile holds fewer) and the other way
    out (`--no-split-hosts` where tasks are `split` by receiving host, coarser meshes or specs otherwise)."""
    other = "compile with --no-split-hosts" if split else "use coarser meshes or specs"
    raise TooManyTasksError(
        f"problem: {what}, above the limit of {max_tasks:,}; pass --max-tasks {needed} (max_tasks= in Python{whose}) if this "
        f"machine has the memory ({bound}about {_memory(needed * BYTES_PER_TASK)}), or {other}")


def _memory(nbytes: int) -> str:
    """`3.1 GiB`, or whole MiB (at least 1) below a GiB, so an estimate never reads as zero."""
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{max(1, round(nbytes / 2**20))} MiB"


def _owners(problem: ReshardingProblem, side: str) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Shard number per dim -> the devices holding that shard, sorted."""
    placement = getattr(problem, side)
    layout = problem.layout(side)
    owners: dict[tuple[int, ...], list[int]] = {}
    for device, coord in zip(placement.mesh.devices, placement.mesh.coords()):
        owners.setdefault(layout.shard_index(coord), []).append(device)
    return {k: tuple(sorted(v)) for k, v in owners.items()}


def _merge_runs(keys: np.ndarray, axis: int) -> list[tuple[int, int]]:
    """Runs [i, j) of consecutive indices along `axis` whose key slabs are identical."""
    runs, begin = [], 0
    for i in range(1, keys.shape[axis] + 1):
        if i == keys.shape[axis] or not np.array_equal(keys.take(i, axis), keys.take(begin, axis)):
            runs.append((begin, i))
            begin = i
    return runs


def decompose(problem: ReshardingProblem, merge: bool = True, max_tasks: int | None = DEFAULT_MAX_TASKS) -> list[Cell]:
    """All non-empty cells of the resharding, in row-major order of their boxes.

    Refuses (TooManyTasksError) before cutting when there could be more than `max_tasks` cells; None: no limit.
    """
    check_task_count(problem, max_tasks)
    cuts = cut_points(problem)
    if any(len(c) < 2 for c in cuts):  # a zero-length dim: nothing to move
        return []
    if problem.has_boxes:
        return decompose_boxes(problem, cuts, merge, _merge_runs)
    src_layout, dst_layout = problem.layout("src"), problem.layout("dst")
    src_owners, dst_owners = _owners(problem, "src"), _owners(problem, "dst")
    starts = [np.asarray(c[:-1]) for c in cuts]
    src_idx = [src_layout.shard_of_points(d, s) for d, s in enumerate(starts)]
    dst_idx = [dst_layout.shard_of_points(d, s) for d, s in enumerate(starts)]

    # One integer per cell naming its (source shard, destination shard) pair, for merging.
    src_counts = problem.src.spec.shard_counts(problem.src.mesh.shape)
    dst_counts = problem.dst.spec.shard_counts(problem.dst.mesh.shape)
    grids = np.meshgrid(*src_idx, indexing="ij") + np.meshgrid(*dst_idx, indexing="ij")
    keys = np.ravel_multi_index(tuple(grids), tuple(src_counts) + tuple(dst_counts))
    runs = [_merge_runs(keys, d) if merge else [(i, i + 1) for i in range(keys.shape[d])] for d in range(keys.ndim)]

    cells = []
    for combo in product(*runs):
        first = tuple(r[0] for r in combo)
        region = tuple((cuts[d][r[0]], cuts[d][r[1]]) for d, r in enumerate(combo))
        senders = src_owners.get(tuple(int(src_idx[d][i]) for d, i in enumerate(first)), ())
        needers = dst_owners.get(tuple(int(dst_idx[d][i]) for d, i in enumerate(first)), ())
        holding = set(senders)
        cells.append(Cell(
            region=region,
            senders=senders,
            receivers=tuple(d for d in needers if d not in holding),
            local_copies=tuple(d for d in needers if d in holding),
            merged_cells=math.prod(r[1] - r[0] for r in combo),
        ))
    return cells


def split_by_receiver_host(cells: list[Cell], cluster) -> list[Cell]:
    """Each cell whose receivers sit on several hosts as one cell per receiving host (same box and
    senders; local copies stay with the first), so each host's share is scheduled, and sent, on its own.

    A broadcast chain through two hosts holds both hosts' receive sides until its last hop ends;
    split, each host receives from a holder directly and the two transfers may overlap others.
    """
    out = []
    for cell in cells:
        by_host: dict[int, list[int]] = {}
        for device in cell.receivers:
            by_host.setdefault(cluster.host_of(device), []).append(device)
        if len(by_host) <= 1:
            out.append(cell)
            continue
        for k, (_, devices) in enumerate(sorted(by_host.items())):
            out.append(Cell(cell.region, cell.senders, tuple(devices), cell.local_copies if k == 0 else (), cell.merged_cells))
    return out


def split_task_count(problem: ReshardingProblem, merge: bool = True) -> int:
    """How many unit tasks `split_by_receiver_host(decompose(problem, merge), cluster)` makes, counted from the cut
    points without cutting: its time grows with the devices, not the cells (0.15 s for 2.7 million cells on 4,000 devices).

    A cell (merged or not) is one run of intervals per dim, and its devices depend only on each run's (source
    shard, destination shard) pair, so the cells with given pairs number the product of each dim's runs with
    them. Away from overlapping meshes a cell's receivers are the owners of its destination shard: each
    destination shard counts its receiving hosts once per cell over it. A device on both sides holds part
    of what it needs; the (source, destination) shard pairs it sits in are counted again, as few as such devices.
    """
    cuts = cut_points(problem)
    if any(len(c) < 2 for c in cuts):
        return 0
    if problem.has_boxes:
        return box_split_count(problem, merge, decompose)
    src_layout, dst_layout = problem.layout("src"), problem.layout("dst")
    runs = [_runs_by_pair(src_layout.shard_of_points(d, c[:-1]), dst_layout.shard_of_points(d, c[:-1]), merge)
            for d, c in enumerate(cuts)]
    to_dst = [Counter() for _ in runs]
    for d, pairs in enumerate(runs):
        for (_, t), n in pairs.items():
            to_dst[d][t] += n
    src_owners, dst_owners = _owners(problem, "src"), _owners(problem, "dst")

    def hosts(devices) -> int:  # the tasks a cell with these receivers splits into
        return max(1, len({problem.cluster.host_of(d) for d in devices}))

    total = sum(math.prod(c[k] for c, k in zip(to_dst, t)) * hosts(owners) for t, owners in dst_owners.items())
    src_of = {d: s for s, devices in src_owners.items() for d in devices}
    both = {(src_of[d], t) for t, devices in dst_owners.items() for d in devices if d in src_of}
    for s, t in both:
        cells = math.prod(pairs[(a, b)] for pairs, a, b in zip(runs, s, t))
        if cells:
            holding = set(src_owners[s])
            total += cells * (hosts([d for d in dst_owners[t] if d not in holding]) - hosts(dst_owners[t]))
    return total


def _runs_by_pair(src_idx: np.ndarray, dst_idx: np.ndarray, merge: bool) -> Counter:
    """(source shard, destination shard) -> how many runs of one dim's intervals have that pair: merged, a run is the
    longest stretch of consecutive intervals with one pair (`_merge_runs`); otherwise every interval is one."""
    first = np.ones(len(src_idx), dtype=bool)
    if merge:
        first[1:] = (src_idx[1:] != src_idx[:-1]) | (dst_idx[1:] != dst_idx[:-1])
    return Counter(zip(src_idx[first].tolist(), dst_idx[first].tolist()))
