"""Refuse host arrays of one call that would be written while they share memory: a caller's destination array whose
elements overlap each other, or that overlaps another destination array or a source shard of the same call (the MPI
engine receives straight into the caller's memory, so such a reshard's result would depend on the order bytes land).

Cheap on the common path: an array whose dims, by increasing stride, each step past the span of the ones before cannot
overlap itself, and arrays whose byte ranges are apart cannot overlap each other; only otherwise are the elements'
offsets (`overlaps_itself`) or `numpy.shares_memory` consulted.

>>> import numpy as np
>>> overlaps_itself(np.zeros((4, 6))[:, ::2]), overlaps_itself(np.lib.stride_tricks.as_strided(np.zeros(4), (3, 2), (8, 8)))
(False, True)
"""

from __future__ import annotations

from typing import Mapping

import numpy as np

from .errors import PlanMismatchError


def byte_bounds(array: np.ndarray) -> tuple[int, int]:
    """The addresses of the first byte `array` touches and one past its last, from its shape and strides (what NumPy 2's
    `numpy.lib.array_utils.byte_bounds` gives; NumPy 1.26, which the project supports, has no such module)."""
    low = high = array.__array_interface__["data"][0]
    if not array.size:
        return low, high
    for n, stride in zip(array.shape, array.strides):
        if stride < 0:
            low += (n - 1) * stride
        else:
            high += (n - 1) * stride
    return low, high + array.itemsize


def overlaps_itself(array: np.ndarray) -> bool:
    """Whether two elements of `array` share a byte (a zero stride, or strides that interleave too tightly)."""
    if array.size <= 1:
        return False
    dims = sorted((abs(stride), n) for n, stride in zip(array.shape, array.strides) if n > 1)
    reach = array.itemsize
    for stride, n in dims:
        if stride < reach:
            break
        reach += stride * (n - 1)
    else:
        return False
    offsets = np.zeros(1, np.int64)  # strides that interleave (rare): every element's offset, sorted, checked for gaps
    for stride, n in dims:
        offsets = (offsets[:, None] + np.arange(n, dtype=np.int64) * stride).reshape(-1)
    offsets.sort()
    return bool((np.diff(offsets) < array.itemsize).any())


def refuse_overlapping_into(array: np.ndarray, device: int, name: str) -> None:
    """PlanMismatchError for a caller's destination array whose elements share memory."""
    if overlaps_itself(array):
        raise PlanMismatchError(f"run(): into[{name!r}] on device {device} has elements sharing memory (shape {array.shape}, "
                                f"strides {array.strides}); pass an array or view whose elements are distinct")


def refuse_shared(targets: Mapping[str, np.ndarray], sources: Mapping[str, np.ndarray | None], device: int) -> None:
    """PlanMismatchError for a caller's destination array of one call sharing memory with another one's or with a source
    shard of the call (sources may share memory with each other: they are only read). Byte ranges sorted by their start;
    `numpy.shares_memory` only for pairs whose ranges meet."""
    spans = [(*byte_bounds(a), True, name, a) for name, a in targets.items() if a.size]
    spans += [(*byte_bounds(a), False, name, a) for name, a in sources.items() if a is not None and a.size]
    spans.sort(key=lambda span: span[0])
    open_: list = []
    for low, high, written, name, array in spans:
        open_ = [span for span in open_ if span[1] > low]
        for _, _, other_written, other, seen in open_:
            if (written or other_written) and np.shares_memory(array, seen):
                target, what = (name, f"into[{other!r}]" if other_written else f"the source shard of {other!r}") if written \
                    else (other, f"the source shard of {name!r}")
                raise PlanMismatchError(f"run(): into[{target!r}] on device {device} shares memory with {what}, which the "
                                        "same call writes or reads; pass separate arrays")
        open_.append((low, high, written, name, array))
