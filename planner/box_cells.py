"""Cut a resharding whose layouts are per-device boxes into cells, as `unit_tasks.decompose` does for specs.

The grid is cut at every bound of a non-empty box of either side. A cell's senders are the devices of
every source box covering it, its needers those of every destination box covering it; cells nobody
needs are dropped (a box layout's destination may leave parts of the tensor out). Adjacent cells with
the same senders and needers merge into one box, by the same run rule as the spec path.
"""

from __future__ import annotations

import math
from itertools import product

import numpy as np

from xmesh_plan.schemas import ReshardingProblem
from xmesh_plan.schemas.boxes import box_index, is_empty


def _holders(problem: ReshardingProblem, side: str, cuts: list[np.ndarray]) -> tuple[np.ndarray, list[tuple[int, ...]]]:
    """Per cell, the number of its holder set on `side`; and each number's devices, sorted.

    The distinct non-empty boxes are the columns of a cell-by-box membership table; its distinct rows are the
    holder sets."""
    by_box: dict[tuple, list[int]] = {}
    for device, box in problem.blocks(side).items():
        if not is_empty(box):
            by_box.setdefault(box, []).append(device)
    grid = tuple(len(c) - 1 for c in cuts)
    member = np.zeros(grid + (max(1, len(by_box)),), dtype=bool)
    for k, box in enumerate(by_box):
        member[box_index(cuts, box) + (k,)] = True
    rows, number = np.unique(member.reshape(-1, member.shape[-1]), axis=0, return_inverse=True)
    owners = list(by_box.values())
    devices = [tuple(sorted(d for k in np.flatnonzero(row) for d in owners[k])) for row in rows]
    return number.reshape(grid), devices


def decompose_boxes(problem: ReshardingProblem, cuts: list[list[int]], merge: bool, merge_runs) -> list:
    """The non-empty, needed cells of a problem with a box layout on either side, in row-major order."""
    from .unit_tasks import Cell

    edges = [np.asarray(c, dtype=np.int64) for c in cuts]
    src, src_sets = _holders(problem, "src", edges)
    dst, dst_sets = _holders(problem, "dst", edges)
    keys = src * len(dst_sets) + dst
    runs = [merge_runs(keys, d) if merge else [(i, i + 1) for i in range(keys.shape[d])] for d in range(keys.ndim)]
    cells = []
    for combo in product(*runs):
        first = tuple(r[0] for r in combo)
        senders, needers = src_sets[src[first]], dst_sets[dst[first]]
        if not needers:
            continue
        holding = set(senders)
        cells.append(Cell(
            region=tuple((cuts[d][r[0]], cuts[d][r[1]]) for d, r in enumerate(combo)),
            senders=senders,
            receivers=tuple(d for d in needers if d not in holding),
            local_copies=tuple(d for d in needers if d in holding),
            merged_cells=math.prod(r[1] - r[0] for r in combo),
        ))
    return cells



MAX_COUNTED_CELLS = 2_000_000  # box layouts are counted by cutting them; above this many cells, bounded instead


def box_split_count(problem: ReshardingProblem, merge: bool, decompose) -> int:
    """The unit tasks splitting a box-layout problem's cells by receiving host makes (`unit_tasks.split_task_count`):
    counted by cutting it, or, above MAX_COUNTED_CELLS cells, bounded by the cells times the destination's hosts."""
    from .unit_tasks import task_count_bound

    bound = task_count_bound(problem)
    if bound > MAX_COUNTED_CELLS:
        return bound * len(problem.dst.mesh.hosts(problem.cluster))
    host = problem.cluster.host_of
    return sum(len({host(d) for d in cell.receivers}) or 1 for cell in decompose(problem, merge, max_tasks=None))
