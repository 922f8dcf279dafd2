"""The per-operation structural checks of `schemas.plan_check` for many operations at once, where they are simple.

A copy, send or broadcast (the kinds whose pattern is `local` or `chain`, no parts) passes `_check_operation`
exactly when its box lies inside the tensor and is not empty, its chunk count fits its kind and its box, its
devices are as the kind needs, the sender holds the box in its source shard and every receiver has room for it in
its destination shard. `proven_operations` tests all of that with whole-array interval arithmetic and marks the
operations it proves; `check_plan` checks the others (all-gathers, bundles, and any operation the arrays do not
prove) one by one, in list order, so the first fault and its message stay the one-by-one checker's.
"""

from __future__ import annotations

import numpy as np

from .op_kinds import OP_KINDS
from .problem import ReshardingProblem

_SIMPLE = {kind for kind, rule in OP_KINDS.items() if rule.pattern in ("local", "chain") and not rule.has_parts}


def _block_table(blocks: dict[int, tuple], ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """(sorted device ids, their blocks as an (n, ndim, 2) array)."""
    devices = np.array(sorted(blocks), dtype=np.int64)
    boxes = np.array([blocks[d] for d in devices.tolist()], dtype=np.int64).reshape(len(devices), ndim, 2)
    return devices, boxes


def _inside_blocks(devices: np.ndarray, boxes: np.ndarray, table: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    """Per row: `devices[k]` has a block in `table` and `boxes[k]` lies inside it."""
    ids, blocks = table
    if not len(ids):
        return np.zeros(len(devices), dtype=bool)
    at = np.clip(np.searchsorted(ids, devices), 0, len(ids) - 1)
    known = ids[at] == devices
    block = blocks[at]
    inside = ((block[:, :, 0] <= boxes[:, :, 0]) & (boxes[:, :, 1] <= block[:, :, 1])).all(axis=1)
    return known & inside


def proven_operations(operations, problems: list[ReshardingProblem], max_chunks: int) -> np.ndarray:
    """Per operation (list order): True where it is a copy, send or broadcast that `_check_operation` passes."""
    proven = np.zeros(len(operations), dtype=bool)
    rows: dict[int | None, list[int]] = {}
    for i, op in enumerate(operations):
        if op.kind in _SIMPLE and op.src is not None and not (op.parts or op.holders or op.needers):
            rule = OP_KINDS[op.kind]
            count = len(op.dsts)
            members_ok = rule.min_dsts <= count and (rule.max_dsts is None or count <= rule.max_dsts) and len(set(op.dsts)) == count
            members_ok = members_ok and ((op.dsts == (op.src,)) if rule.pattern == "local" else (op.src not in op.dsts))
            if members_ok and (rule.chunked or op.chunks == 1):
                rows.setdefault(op.tensor, []).append(i)
    for tensor, picked in rows.items():
        if tensor is not None and not 0 <= tensor < len(problems):
            continue
        problem = problems[tensor or 0]
        ndim = len(problem.shape)
        picked = [i for i in picked if len(operations[i].region) == ndim]
        if not picked:
            continue
        region = np.array([operations[i].region for i in picked], dtype=np.int64).reshape(len(picked), ndim, 2)
        shape = np.array(problem.shape, dtype=np.int64)
        lo, hi = region[:, :, 0], region[:, :, 1]
        ok = ((0 <= lo) & (lo < hi) & (hi <= shape)).all(axis=1)
        elements = np.prod(np.where(ok[:, None], hi - lo, 1), axis=1, dtype=np.int64)
        chunks = np.array([operations[i].chunks for i in picked], dtype=np.int64)
        ok &= chunks <= np.minimum(max_chunks, elements)
        src = np.array([operations[i].src for i in picked], dtype=np.int64)
        ok &= _inside_blocks(src, region, _block_table(problem.blocks("src"), ndim))
        counts = np.array([len(operations[i].dsts) for i in picked], dtype=np.int64)
        dsts = np.array([d for i in picked for d in operations[i].dsts], dtype=np.int64)
        owner = np.repeat(np.arange(len(picked)), counts)
        room = _inside_blocks(dsts, region[owner], _block_table(problem.blocks("dst"), ndim))
        ok &= np.bincount(owner, weights=~room, minlength=len(picked)) == 0
        proven[np.array(picked)[ok]] = True
    return proven
